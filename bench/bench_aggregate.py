#!/usr/bin/python3
"""Aggregate generated tokens/s of any OpenAI-style /v1/completions server on 127.0.0.1 (moed,
or llama-server for a side-by-side run) at several concurrency levels: two waves of N
concurrent non-streaming requests per level, greedy, ignore_eos, counting
usage.completion_tokens (so byte-level tokens that decode to no text still count).
usage: bench_aggregate.py PORT LEVELS(e.g. 1,4,8,16) MAX_TOKENS"""
import http.client, json, sys, threading, time

port, levels, mt = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])

def one(i, out):
    body = json.dumps({"prompt": "Benchmark prompt number %d: tell me a long story." % i,
                       "max_tokens": mt, "temperature": 0, "ignore_eos": True, "stream": False,
                       "cache_prompt": False})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse(); d = r.read(); c.close()
    if r.status != 200:
        out.append(0); print("status", r.status, d[:200], file=sys.stderr); return
    out.append(json.loads(d)["usage"]["completion_tokens"])

for lvl in levels:
    out, ths = [], []
    t0 = time.perf_counter()
    # two waves of lvl concurrent requests (2 x lvl requests in all)
    todo = list(range(2 * lvl)); lock = threading.Lock()
    def w():
        while True:
            with lock:
                if not todo: return
                i = todo.pop()
            one(i, out)
    ths = [threading.Thread(target=w) for _ in range(lvl)]
    [t.start() for t in ths]; [t.join() for t in ths]
    wall = time.perf_counter() - t0
    print("streams %2d: %d req, %d tokens, %.1f s, %.1f tok/s" % (lvl, len(out), sum(out), wall, sum(out) / wall), flush=True)
