"""Byte-level BPE (GPT-2 byte mapping, qwen2 pre-tokenizer): trainer and encoder."""
import collections
import re

try:
    import regex as _re
    _L, _N = r"\p{L}", r"\p{N}"
    QWEN2_PRE = _re.compile(
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
except ImportError:
    # Python's re has no \p{..}: letters are [^\W\d_], numbers \d, and "not a letter or
    # number" is (?:_|[^\w]) -- identical to llama.cpp's qwen2 regex on ASCII text, which
    # is all this corpus holds.
    QWEN2_PRE = re.compile(
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|(?:_|[^\r\n\w])?[^\W\d_]+|\d| ?(?:_|[^\s\w])+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


B2U = bytes_to_unicode()


def pretokenize(text):
    """Text -> list of pre-token strings in the byte-unicode alphabet."""
    return ["".join(B2U[b] for b in m.group(0).encode("utf-8"))
            for m in QWEN2_PRE.finditer(text)]


def train_bpe(texts, n_merges, log=print):
    """Learns n_merges merges from texts. Returns the merge list [(a, b), ...]."""
    wc = collections.Counter()
    for t in texts:
        wc.update(pretokenize(t))
    words = [list(w) for w in wc]
    counts = [wc[w] for w in wc]
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += counts[i]
            where[(a, b)].add(i)
    merges = []
    log(f"bpe: {len(words)} distinct pre-tokens, {len(pairs)} pairs")
    for m in range(n_merges):
        if not pairs:
            break
        # Highest count; ties broken by the smaller pair so the result is deterministic.
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        if pairs[best] < 2:
            break
        merges.append(best)
        a, b = best
        ab = a + b
        for i in list(where[best]):
            w = words[i]
            c = counts[i]
            # Remove this word's old pairs, merge, add its new pairs.
            for p in zip(w, w[1:]):
                pairs[p] -= c
                if pairs[p] <= 0:
                    del pairs[p]
                where[p].discard(i)
            out = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(ab)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pairs[p] += c
                where[p].add(i)
        where.pop(best, None)
        if (m + 1) % 500 == 0:
            log(f"bpe: {m + 1} merges, last {a!r}+{b!r}")
    return merges


class Tokenizer:
    def __init__(self, merges):
        self.merges = merges
        self.tokens = [B2U[b] for b in range(256)] + [a + b for a, b in merges] + SPECIALS
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        assert len(self.ids) == len(self.tokens), "duplicate token"
        self.rank = {p: r for r, p in enumerate(merges)}
        self.cache = {}
        self.special = {s: self.ids[s] for s in SPECIALS}
        self.u2b = {u: b for b, u in B2U.items()}

    def _bpe(self, word):
        ids = self.cache.get(word)
        if ids is not None:
            return ids
        parts = list(word)
        while len(parts) > 1:
            best, br = None, None
            for k in range(len(parts) - 1):
                r = self.rank.get((parts[k], parts[k + 1]))
                if r is not None and (br is None or r < br):
                    best, br = k, r
            if best is None:
                break
            a, b = parts[best], parts[best + 1]
            out = []
            j = 0
            while j < len(parts):
                if j + 1 < len(parts) and parts[j] == a and parts[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(parts[j])
                    j += 1
            parts = out
        ids = [self.ids[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode(self, text):
        """Plain text (no special tokens parsed) -> ids."""
        out = []
        for w in pretokenize(text):
            out.extend(self._bpe(w))
        return out

    def decode(self, ids):
        bs = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t in self.special:
                bs.extend(t.encode())
            else:
                bs.extend(self.u2b[c] for c in t)
        return bs.decode("utf-8", errors="replace")
