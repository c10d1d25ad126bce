#!/usr/bin/python3
"""Concurrent streaming completions against a moed server on 127.0.0.1, on real prompts (the
trained models' King James text): for routing traces (start moed with --trace-routing FILE) and
for expert-aware batching (bench/README.md). STREAMS clients each send REQS requests one after
another, prompts taken in turn from the list below, sampled at temperature 0.8 with a seed per
request, so runs are reproducible for one batch composition.

Prints the decoded tokens/s over the whole run (generated tokens, from each response's usage,
over the wall time), and the median and 99th percentile of inter-token latency (the gaps
between a stream's successive events; moed sends one event per token).

usage: bench_streams.py PORT [STREAMS=1] [REQS=4] [MAX_TOKENS=96] [--json]"""
import http.client, json, statistics, sys, threading, time
from sse_gaps import read_stream

PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was",
    "And it came to pass, when the king heard the words of the book of the law,",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are",
    "The LORD is my shepherd; I shall not want. He maketh me",
    "Now the serpent was more subtil than any beast of the field which",
    "And Jesus answering said unto them, Go your way, and tell John what things",
    "Then spake Jesus again unto them, saying, I am the light of the world:",
    "And the children of Israel journeyed from Rameses to Succoth, about",
    "Hear, O Israel: The LORD our God is one LORD: And thou shalt love",
    "For God so loved the world, that he gave his only begotten Son,",
    "And David said unto Saul, Let no man's heart fail because of him;",
    "Wisdom is the principal thing; therefore get wisdom: and with all thy getting",
]

args = [a for a in sys.argv[1:] if not a.startswith("--")]
port = int(args[0])
streams = int(args[1]) if len(args) > 1 else 1
reqs = int(args[2]) if len(args) > 2 else 4
max_tokens = int(args[3]) if len(args) > 3 else 96
gaps, tokens = [], [0]
lock = threading.Lock()


def one(stream):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    for r in range(reqs):
        n = stream * reqs + r
        body = json.dumps({"prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens,
                           "temperature": 0.8, "seed": 1000 + n, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}})
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = c.getresponse()
        mine, got = read_stream(resp)
        resp.read()
        with lock:
            gaps.extend(mine)
            tokens[0] += got
    c.close()


t0 = time.perf_counter()
ths = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
[t.start() for t in ths]
[t.join() for t in ths]
wall = time.perf_counter() - t0
gaps.sort()
p50 = statistics.median(gaps) if gaps else 0
p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0
out = {"streams": streams, "requests": streams * reqs, "tokens": tokens[0], "wall_s": wall,
       "tok_per_s": tokens[0] / wall, "itl_p50_ms": 1000 * p50, "itl_p99_ms": 1000 * p99}
if "--json" in sys.argv:
    print(json.dumps(out))
else:
    print("streams %d, %d requests of %d tokens: %.1f tok/s over %.1f s; inter-token latency "
          "median %.1f ms, p99 %.1f ms" % (streams, streams * reqs, max_tokens,
                                            out["tok_per_s"], wall, out["itl_p50_ms"],
                                            out["itl_p99_ms"]))
