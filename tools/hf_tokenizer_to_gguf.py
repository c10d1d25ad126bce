#!/usr/bin/python3
"""Embed a Hugging Face tokenizer.json (+ tokenizer_config.json) into a vocab-only GGUF.

The keys follow llama.cpp's converter (convert_hf_to_gguf.py), so `moed-gguf gen
--tokenizer-gguf` can copy the tokenizer.* keys into a generated model and any GGUF reader that
knows llama.cpp's layout understands them:

  tokenizer.ggml.model        "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
  tokenizer.ggml.pre          "qwen2", "llama-bpe", "deepseek-v3", "gpt-4o" or "default" (gpt2 only)
  tokenizer.ggml.tokens       every id 0..max id; holes become "[PAD<id>]" (type UNUSED)
  tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control (special added tokens),
                              4 user-defined (non-special added tokens), 5 unused, 6 byte
  tokenizer.ggml.merges       "a b" strings, by rank (gpt2)
  tokenizer.ggml.scores       llama only: -rank of the first merge that makes the token, 0 for
                              tokens no merge makes (characters, bytes, specials). Hugging Face
                              lists every split of a SentencePiece token as contiguous merges,
                              so merging by this score gives the same ids as merging by rank.
                              (llama.cpp writes -1000 for every token of a tokenizer.json-only
                              model, which loses the merge order.)
  tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token,
  tokenizer.ggml.add_space_prefix (llama), tokenizer.chat_template.

Standard library only; run with /usr/bin/python3.
"""

import argparse
import json
import os
import re
import struct
import sys

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GGUF value types
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9


class GGUFWriter:
    """Minimal GGUF v3 writer: metadata only (a vocab-only file has no tensors)."""

    def __init__(self):
        self.kv = []

    def add(self, key, vtype, value, elem_type=None):
        self.kv.append((key, vtype, value, elem_type))

    @staticmethod
    def _str(s):
        b = s if isinstance(s, bytes) else s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def _val(self, vtype, v, elem_type):
        if vtype == T_UINT32:
            return struct.pack("<I", v)
        if vtype == T_INT32:
            return struct.pack("<i", v)
        if vtype == T_FLOAT32:
            return struct.pack("<f", v)
        if vtype == T_BOOL:
            return struct.pack("<B", 1 if v else 0)
        if vtype == T_STRING:
            return self._str(v)
        if vtype == T_ARRAY:
            head = struct.pack("<IQ", elem_type, len(v))
            if elem_type == T_STRING:
                return head + b"".join(self._str(x) for x in v)
            if elem_type == T_INT32:
                return head + struct.pack("<%di" % len(v), *v)
            if elem_type == T_FLOAT32:
                return head + struct.pack("<%df" % len(v), *v)
        raise ValueError("unsupported value type %d" % vtype)

    def write(self, path):
        out = [b"GGUF", struct.pack("<IQQ", 3, 0, len(self.kv))]
        for key, vtype, value, elem_type in self.kv:
            out.append(self._str(key))
            out.append(struct.pack("<I", vtype))
            out.append(self._val(vtype, value, elem_type))
        data = b"".join(out)
        data += b"\0" * ((32 - len(data) % 32) % 32)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


# Split regexes of the pre-tokenizers we know, as they appear in tokenizer.json.
KNOWN_PRE = {
    "qwen2": ["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
              "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "llama-bpe": ["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
                  "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "deepseek-v3": ["\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"],
    # o200k (gpt-4o, gpt-oss): llama.cpp's "gpt-4o" pre-tokenizer type
    "gpt-4o": ["[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}"
               "\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}"
               "\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}|"
               " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
}


def walk(node, kind):
    """All components of the given type in a (possibly Sequence) normalizer/pre-tokenizer."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        out = []
        for sub in node.get("pretokenizers", node.get("normalizers", [])):
            out += walk(sub, kind)
        return out
    return [node] if node.get("type") == kind else []


def detect_pre(tj):
    pt = tj.get("pre_tokenizer")
    splits = [s["pattern"].get("Regex", s["pattern"].get("String")) for s in walk(pt, "Split")]
    for name, pats in KNOWN_PRE.items():
        if splits == pats:
            return name
    bl = walk(pt, "ByteLevel")
    if not splits and bl and bl[0].get("use_regex", True):
        return "default"
    raise SystemExit("unknown pre-tokenizer %s; pass --pre NAME" % json.dumps(pt)[:300])


def token_content(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tokenizer", help="tokenizer.json, or a directory holding it")
    ap.add_argument("-o", "--output", required=True, help="GGUF file to write")
    ap.add_argument("--config", help="tokenizer_config.json (default: beside tokenizer.json)")
    ap.add_argument("--pre", help="override tokenizer.ggml.pre")
    ap.add_argument("--arch", help="also write general.architecture")
    ap.add_argument("--name", help="general.name")
    a = ap.parse_args()

    path = a.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    cfg_path = a.config or os.path.join(os.path.dirname(path), "tokenizer_config.json")
    tc = {}
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            tc = json.load(f)

    model = tj["model"]
    if model.get("type") != "BPE":
        raise SystemExit("only BPE tokenizer.json models are supported (got %s)" % model.get("type"))
    norm_prepend = [n for n in walk(tj.get("normalizer"), "Prepend") if n.get("prepend") == "\u2581"]
    metaspace = walk(tj.get("pre_tokenizer"), "Metaspace")
    spm = bool(model.get("byte_fallback")) or bool(norm_prepend) or bool(metaspace)
    if not spm and not walk(tj.get("pre_tokenizer"), "ByteLevel"):
        raise SystemExit("neither byte-level BPE nor SentencePiece-style BPE")

    vocab = model["vocab"]
    added = tj.get("added_tokens", [])
    n = max(list(vocab.values()) + [t["id"] for t in added]) + 1
    tokens = [None] * n
    types = [UNUSED] * n
    unk = token_content(tc.get("unk_token")) or model.get("unk_token")
    byte_re = re.compile(r"^<0x[0-9A-F]{2}>$")
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = NORMAL
        if spm and byte_re.match(text):
            types[i] = BYTE
    for t in added:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = CONTROL if t.get("special") else USER_DEFINED
    for i in range(n):
        if tokens[i] is None:
            tokens[i] = "[PAD%d]" % i
        elif unk is not None and tokens[i] == unk:
            types[i] = UNKNOWN

    merges = []
    for m in model.get("merges", []):
        merges.append(m if isinstance(m, str) else " ".join(m))

    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)

    def tok_id(key):
        c = token_content(tc.get(key))
        return ids.get(c) if c is not None else None

    w = GGUFWriter()
    if a.arch:
        w.add("general.architecture", T_STRING, a.arch)
    if a.name:
        w.add("general.name", T_STRING, a.name)
    if spm:
        w.add("tokenizer.ggml.model", T_STRING, "llama")
        pre = a.pre
    else:
        w.add("tokenizer.ggml.model", T_STRING, "gpt2")
        pre = a.pre or detect_pre(tj)
    if pre:
        w.add("tokenizer.ggml.pre", T_STRING, pre)
    w.add("tokenizer.ggml.tokens", T_ARRAY, tokens, T_STRING)
    w.add("tokenizer.ggml.token_type", T_ARRAY, types, T_INT32)
    if spm:
        scores = [0.0] * n
        seen = set()
        for r, m in enumerate(merges):
            left, right = m.split(" ", 1)
            i = ids.get(left + right)
            if i is not None and i not in seen:
                seen.add(i)
                scores[i] = -float(r)
        w.add("tokenizer.ggml.scores", T_ARRAY, scores, T_FLOAT32)
    else:
        w.add("tokenizer.ggml.merges", T_ARRAY, merges, T_STRING)

    for key, gkey in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        i = tok_id(key)
        if i is not None:
            w.add("tokenizer.ggml.%s_token_id" % gkey, T_UINT32, i)

    add_bos = tc.get("add_bos_token")
    if add_bos is None:
        post = tj.get("post_processor") or {}
        single = post.get("single") if post.get("type") == "TemplateProcessing" else None
        if single:
            add_bos = "SpecialToken" in single[0]
        else:
            add_bos = pre == "llama-bpe"  # llama.cpp's default for Llama-3
    w.add("tokenizer.ggml.add_bos_token", T_BOOL, bool(add_bos) and tok_id("bos_token") is not None)
    w.add("tokenizer.ggml.add_eos_token", T_BOOL, bool(tc.get("add_eos_token", False)))
    if spm:
        prefix = bool(norm_prepend) or any(m.get("prepend_scheme", "always") != "never" and
                                           m.get("add_prefix_space", True) for m in metaspace)
        w.add("tokenizer.ggml.add_space_prefix", T_BOOL, prefix)

    tmpl = tc.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl}
        tmpl = named.get("default") or (tmpl[0].get("template") if tmpl else None)
    if isinstance(tmpl, str):
        w.add("tokenizer.chat_template", T_STRING, tmpl)

    w.write(a.output)
    print("%s: model %s, pre %s, %d tokens, %d merges, bos %s, eos %s, add_bos %s" %
          (a.output, "llama" if spm else "gpt2", pre, n, len(merges), tok_id("bos_token"),
           tok_id("eos_token"), bool(add_bos)), file=sys.stderr)


if __name__ == "__main__":
    main()
