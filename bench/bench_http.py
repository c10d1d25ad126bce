#!/usr/bin/python3
"""HTTP load benchmark: streaming completions at 1, 4, 16 and 64 concurrent clients.

Reports requests/s, TTFT p50/p99, inter-token latency p50/p99 and aggregate output tokens/s.
Starts moed itself (--moed BIN [-m MODEL]) or targets a running server (--url).

  bench/bench_http.py --moed build/server/moed [-m model.gguf] [--requests 32] [--max-tokens 64]
  bench/bench_http.py --url http://127.0.0.1:8080
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from srvwait import wait_health


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


def one_request(host, port, prompt, max_tokens, out):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        out.append({"status": r.status})
        r.read()
        c.close()
        return
    times = []
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            ev = json.loads(line[6:])
            if ev["choices"] and ev["choices"][0]["text"]:
                times.append(time.perf_counter())
    c.close()
    out.append({"status": 200, "t0": t0, "times": times, "end": time.perf_counter()})


def run_level(host, port, conc, n_req, max_tokens):
    results, lock = [], threading.Lock()
    todo = list(range(n_req))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            one_request(host, port, "Benchmark prompt number %d: tell me a long story." % i,
                        max_tokens, results)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and r["times"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    toks = sum(len(r["times"]) for r in ok)
    return {"concurrency": conc, "requests": len(results), "ok": len(ok), "wall_s": wall,
            "req_per_s": len(ok) / wall, "ttft_p50_ms": pct(ttft, 50) * 1e3,
            "ttft_p99_ms": pct(ttft, 99) * 1e3, "itl_p50_ms": pct(itl, 50) * 1e3,
            "itl_p99_ms": pct(itl, 99) * 1e3, "tok_per_s": toks / wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--moed")
    ap.add_argument("-m", "--model")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=0, help="per level (default 2 x concurrency, min 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print one JSON object per level")
    a = ap.parse_args()
    proc = None
    if a.url:
        u = urllib.parse.urlparse(a.url)
        host, port = u.hostname, u.port or 80
    elif a.moed:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        host = "127.0.0.1"
        cmd = [a.moed, "--port", str(port), "--log-level", "warn", "--max-seqs", "64"]
        if a.model:
            cmd += ["-m", a.model]
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        wait_health(port, proc)
    else:
        ap.error("give --url or --moed")
    try:
        if not a.json:
            print("%5s %6s %8s %10s %10s %9s %9s %9s" % ("conc", "ok", "req/s", "ttft p50", "ttft p99",
                                                        "itl p50", "itl p99", "tok/s"))
        for lvl in [int(x) for x in a.levels.split(",")]:
            n = a.requests or max(8, 2 * lvl)
            r = run_level(host, port, lvl, n, a.max_tokens)
            if a.json:
                print(json.dumps(r))
            else:
                print("%5d %3d/%-3d %7.2f %8.1fms %8.1fms %7.1fms %7.1fms %9.1f" % (
                    r["concurrency"], r["ok"], r["requests"], r["req_per_s"], r["ttft_p50_ms"],
                    r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"], r["tok_per_s"]))
            sys.stdout.flush()
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
