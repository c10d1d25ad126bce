#!/usr/bin/python3
"""Speculation request by request: one greedy request per Bible reference, decoded with each of
two drafters back to back (the order alternating round by round), on one moed server and one
stream. Where bench_spec.py's loop workload sums a round's requests, whose outputs repeat from
token ~60 for some references and hardly at all for others, this prints each reference's own
ratio, and how much of its output repeats (the share of tokens from which the rest is periodic
with a period of at most 40 tokens), so the speedup can be read against how long and right the
n-gram drafts could be.

  bench/bench_spec_pairs.py build/server/moed bench/models/default-1g.gguf \\
      --refs "John 1,Psalms 23,Genesis 1" --tokens 256 --rounds 3 --configs off,ngram
  bench/bench_spec_pairs.py build/server/moed bench/models/default-1g.gguf \\
      --draft bench/models/default-1g-draft.gguf --configs off,draft --tokens 64

Printed per reference: the share of the output in its final loop, the second configuration's
tok/s over the first's per round and their median; then the median over every pair, and the
ratio of the summed tokens over the summed times (what a client sending all of them in turn sees).
"""

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import tempfile
import time
from srvwait import wait_health

REFS = ("Genesis 1,John 1,Psalms 23,Exodus 20,Matthew 5,Romans 8,Isaiah 40,Luke 2,Proverbs 3,"
        "Acts 2,Mark 4,Daniel 3,Job 38,Ruth 1,Genesis 2")

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("model")
ap.add_argument("--refs", default=REFS)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--configs", default="off,ngram", help="two drafters, comma-separated")
ap.add_argument("--draft", help="a draft model (--draft-model), for the drafter draft")
args = ap.parse_args()
cfgs = args.configs.split(",")
if len(cfgs) != 2:
    ap.error("--configs takes two drafters")
refs = args.refs.split(",")

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
log = tempfile.TemporaryFile("w+")
srv = subprocess.Popen([args.moed, "-m", args.model, "--port", str(port), "--threads",
                        str(args.threads), "--ctx-size", str(max(1024, 2 * args.tokens))] +
                       (["--draft-model", args.draft] if args.draft else []),
                       stdout=log, stderr=subprocess.STDOUT)


def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    d = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError("status %d: %s" % (r.status, d[:300]))
    return json.loads(d)


def loop_share(toks):
    """The share of toks from the first position after which every token repeats the one p
    earlier, for the best period p <= 40."""
    n, onset = len(toks), len(toks)
    for p in range(1, 41):
        i = n - 1
        while i - p >= 0 and toks[i] == toks[i - p]:
            i -= 1
        onset = min(onset, i + 1)
    return (n - onset) / n if n else 0.0


try:
    wait_health(port, srv, timeout=300, log=log)
    ratios = {r: [] for r in refs}
    share, texts, tot = {}, {}, {c: [0, 0.0] for c in cfgs}
    for rnd in range(args.rounds):
        for ref in refs:
            ids = post("/tokenize", {"messages": [{"role": "user",
                                                   "content": "Quote %s:1-8." % ref}]})["tokens"]
            rate = {}
            for c in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
                t0 = time.perf_counter()
                d = post("/v1/completions", {"prompt": ids, "max_tokens": args.tokens,
                                             "temperature": 0, "logprobs": 1,
                                             "speculative": {"drafter": c}})
                dt = time.perf_counter() - t0
                toks = d["choices"][0]["logprobs"]["tokens"]
                rate[c] = len(toks) / dt
                tot[c][0] += len(toks)
                tot[c][1] += dt
                share[ref] = loop_share(toks)
                texts.setdefault(ref, set()).add(d["choices"][0]["text"])
            ratios[ref].append(rate[cfgs[1]] / rate[cfgs[0]])
    print("# %s, %d tokens, %d rounds, load %s" % (args.model.rsplit("/", 1)[-1], args.tokens,
          args.rounds, open("/proc/loadavg").read().split()[0]))
    print("%-12s %6s  %s / %s per round (median)" % ("reference", "loop", cfgs[1], cfgs[0]))
    for ref in refs:
        print("%-12s %5.0f%%  %s  (%.2f)" % (ref, 100 * share[ref],
              " ".join("%.2f" % x for x in ratios[ref]), statistics.median(ratios[ref])))
    allr = [x for v in ratios.values() for x in v]
    print("median over %d pairs: %.2f; summed tokens / summed time: %.2f" %
          (len(allr), statistics.median(allr),
           (tot[cfgs[1]][0] / tot[cfgs[1]][1]) / (tot[cfgs[0]][0] / tot[cfgs[0]][1])))
    print("# outputs differing between the two (greedy): %d" %
          sum(len(t) > 1 for t in texts.values()))
finally:
    srv.terminate()
    srv.wait()
