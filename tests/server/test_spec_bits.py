"""Greedy decode gives the same bits whatever shares its step: the default model as shipped
(f16), in bf16, and quantized to q8_0 (its routers stay f16, as our quantizer and llama.cpp's
leave them) answers with the same tokens and the same logprobs, to the last printed digit,
when each request decodes alone, when four decode together, and when every step verifies up to
16 n-gram drafts (MOED_SPEC_FIXED: the drafts of every proposal are verified). A product whose
sums depend on how many tokens share it would move logprobs by 1e-6 to 1e-2 here, and at a
near-tie change the text. Every file runs on the kernels the CPU picks (engine/kern/cpu.h).

usage: test_spec_bits.py MOED MODEL MOED_GGUF
"""

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, curl, finish  # noqa: E402

moed, model, moed_gguf = sys.argv[1], sys.argv[2], sys.argv[3]
REFS = ["Genesis 1", "John 1", "Psalms 23", "Exodus 20", "Matthew 5", "Isaiah 40", "Luke 2",
        "Daniel 3"]

tmp = tempfile.mkdtemp(prefix="moed-spec-bits-")
files = [("f16", model)]
for mix in ("bf16", "q8_0"):
    path = os.path.join(tmp, "default-%s.gguf" % mix)
    subprocess.run([moed_gguf, "quantize", model, path, mix], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files.append((mix, path))


def complete(srv, ids, drafter):
    st, _, doc = call(srv, "POST", "/v1/completions",
                      {"prompt": ids, "max_tokens": 160, "temperature": 0, "logprobs": 1,
                       "speculative": {"drafter": drafter}}, timeout=120)
    check(st == 200, "completion 200", st, doc)
    lp = doc["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def same_bits(mix, path):
    srv = Server(moed, path, args=["--max-seqs", "4", "--spec-k", "16", "--ctx-size", "512"],
                 env={"MOED_SPEC_FIXED": "1"})
    try:
        prompts = []
        for r in REFS:
            st, _, doc = call(srv, "POST", "/tokenize",
                              {"messages": [{"role": "user", "content": "Quote %s:1-8." % r}]})
            check(st == 200, "tokenize", st)
            prompts.append(doc["tokens"])
        alone = [complete(srv, p, "off") for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: complete(srv, p, "off"), prompts))
        drafted = [complete(srv, p, "ngram") for p in prompts]
        body = curl(srv, "GET", "/metrics")[2].decode()
        m = re.search(r"^moed:spec_draft_tokens_total(\{[^}]*\})? (\S+)$", body, re.M)
        n_drafted = float(m.group(2)) if m else 0
        check(n_drafted > 500, "%s: many drafts were verified" % mix, n_drafted)
        for r, a, t, d in zip(REFS, alone, together, drafted):
            check(t[0] == a[0], "%s %s: the same tokens decoding beside three others" % (mix, r))
            check(t[1] == a[1], "%s %s: the same logprobs decoding beside three others" % (mix, r),
                  max((abs(x - y) for x, y in zip(a[1], t[1])), default=0))
            check(d[0] == a[0], "%s %s: the same tokens with every step verifying drafts" % (mix, r))
            check(d[1] == a[1], "%s %s: the same logprobs with every step verifying drafts" % (mix, r),
                  max((abs(x - y) for x, y in zip(a[1], d[1])), default=0))
    finally:
        srv.stop()


try:
    for mix, path in files:
        same_bits(mix, path)
finally:
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)
finish()
