#!/usr/bin/python3
"""Fairness under a small step budget: N concurrent streaming completions against a server on
127.0.0.1 (start moed with e.g. --max-seqs 40 --step-tokens 16). Prints each stream's time to
first token, the median and maximum TTFT, when the first stream finished, and how many streams
got their first token only after some stream had already finished (a starving scheduler makes
that most of them; a fair one none).
usage: bench_fairness.py PORT [STREAMS=40] [MAX_TOKENS=60]"""
import http.client, json, statistics, sys, threading, time

port = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
mt = int(sys.argv[3]) if len(sys.argv) > 3 else 60
first, done = [None] * n, [None] * n
t0 = time.perf_counter()


def one(i):
    body = json.dumps({"prompt": "In the beginning %d" % i, "max_tokens": mt, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: ") and first[i] is None and b"[DONE]" not in line:
            first[i] = time.perf_counter() - t0
    done[i] = time.perf_counter() - t0
    c.close()


ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in ths]
[t.join() for t in ths]
ttft = [f for f in first if f is not None]
first_finish = min(done)
late = sum(1 for f in ttft if f > first_finish)
print("streams %d, max_tokens %d" % (n, mt))
print("ttft median %.2f s, max %.2f s; first stream finished at %.2f s, last at %.2f s"
      % (statistics.median(ttft), max(ttft), first_finish, max(done)))
print("streams whose first token came after a stream had finished: %d of %d" % (late, n))
