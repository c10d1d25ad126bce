#!/usr/bin/python3
"""A balanced A/B of two speculative configurations on one moed server: what a drafter costs or
gains against another (plain decode by default), where bench_spec.py's rounds are too few to
tell a few percent from the machine's noise.

One server (with --draft when given) serves S concurrent streams, each sending the same
prompts in turn (64 sampled tokens each, seeds fixed per round, ignore_eos so every request
is the same length); the two configurations alternate A B, B A, ... for --rounds rounds, so a
slow spell of the machine hits both alike. Printed per configuration: generated tok/s and
tokens per CPU-second of the server (its utime + stime), medians over the rounds, and the
second over the first.

  bench/bench_spec_ab.py build/server/moed bench/models/default-1g.gguf \\
      --draft bench/models/default-1g-draft.gguf --streams 4 --rounds 6 --configs off,draft
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from srvwait import wait_health

PROMPTS = ["Tell me about the history of the sea and the ships that sailed it.",
           "Write about a garden in spring.", "Describe a city at night."]

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("model")
ap.add_argument("--draft")
ap.add_argument("--streams", type=int, default=4)
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--configs", default="off,draft", help="two drafters, comma-separated; "
                "DRAFTER:K caps the drafts per step at K (the request's speculative.max_k)")
args = ap.parse_args()
cfgs = args.configs.split(",")
if len(cfgs) != 2:
    ap.error("--configs takes two drafters")

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
cmd = [args.moed, "-m", args.model, "--port", str(port), "--threads", str(args.threads)]
if args.draft:
    cmd += ["--draft-model", args.draft]
log = tempfile.TemporaryFile("w+")
srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def post(body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError("status %d: %s" % (r.status, data[:300]))


def cpu():
    with open("/proc/%d/stat" % srv.pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(cfg, rnd):
    drafter, _, k = cfg.partition(":")
    sp = {"drafter": drafter}
    if k:
        sp["max_k"] = int(k)

    def stream(j):
        for i, p in enumerate(PROMPTS):
            post({"prompt": "%s (%d)" % (p, j), "max_tokens": args.tokens, "temperature": 0.8,
                  "top_p": 0.95, "seed": 100 + i + 7 * rnd + j, "ignore_eos": True,
                  "speculative": sp})
    c0, t0 = cpu(), time.perf_counter()
    th = [threading.Thread(target=stream, args=(j,)) for j in range(args.streams)]
    [t.start() for t in th]
    [t.join() for t in th]
    n = args.streams * len(PROMPTS) * args.tokens
    return n / (time.perf_counter() - t0), n / max(cpu() - c0, 1e-9)


try:
    wait_health(port, srv, timeout=300, log=log)
    res = {d: [] for d in cfgs}
    for rnd in range(args.rounds):
        for d in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
            res[d].append(run(d, rnd))
    med = {d: (statistics.median(r[0] for r in res[d]), statistics.median(r[1] for r in res[d]))
           for d in cfgs}
    print("%d streams, %d rounds, %d tokens a request, load %s" %
          (args.streams, args.rounds, args.tokens, open("/proc/loadavg").read().split()[0]))
    for d in cfgs:
        print("%-6s tok/s %7.1f  tokens per CPU-second %7.1f  per round: %s" %
              (d, med[d][0], med[d][1], " ".join("%.0f" % r[0] for r in res[d])))
    print("%s / %s: %.3f tok/s, %.3f per CPU-second" %
          (cfgs[1], cfgs[0], med[cfgs[1]][0] / med[cfgs[0]][0], med[cfgs[1]][1] / med[cfgs[0]][1]))
finally:
    srv.terminate()
    srv.wait()
