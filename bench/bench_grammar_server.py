#!/usr/bin/python3
"""Decode tok/s of constrained against unconstrained streams end to end through the server:
moed is started once (127.0.0.1, a free port); each round sends a chat with response_format
json_object (seeded, temperature 1) and the same chat without it, generating as many tokens
(max_tokens = the constrained reply's length, ignore_eos), in alternating order. A stream's
rate is its tokens after the first over the time from the first token to the last (TTFT
apart: the prompt is the same). Prints per-kind medians, the ratio of the medians and the
median of the per-round ratios (adjacent in time, so the machine's load moves both alike),
and the same in tokens per CPU-second of the moed process (/proc: user + system time over the
stream), which other processes' load disturbs far less than wall time.

usage: bench_grammar_server.py MOED [ROUNDS=8] [-- moed args, e.g. -m MODEL -t 2]"""
import http.client
import os
import json
import socket
import statistics
import subprocess
import sys
import time
from srvwait import wait_health

argv = sys.argv[1:]
extra = []
if "--" in argv:
    extra = argv[argv.index("--") + 1:]
    argv = argv[:argv.index("--")]
moed = argv[0]
rounds = int(argv[1]) if len(argv) > 1 else 8
PROMPT = "Describe the book of Genesis as a JSON object with a few fields."


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream(port, body):
    """(tokens, seconds from the first token to the last, text) of one streamed chat."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    t_first = t_last = None
    usage, text = None, ""
    while True:
        line = r.readline()
        if not line:
            break
        if not line.startswith(b"data: {"):
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") or ""
            if piece:
                t_last = time.perf_counter()
                t_first = t_first or t_last
                text += piece
    c.close()
    return usage["completion_tokens"], (t_last - t_first) if t_first else 0.0, text


port = free_port()
proc = subprocess.Popen([moed, "--port", str(port), "--spec", "off"] + extra,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    wait_health(port, proc)
    base = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 1.0}
    rates = {"constrained": [], "unconstrained": []}
    cpu = {"constrained": [], "unconstrained": []}
    pairs, cpu_pairs = [], []
    for r in range(rounds):
        for seed in range(100 + 10 * r, 110 + 10 * r):  # a reply long enough to time
            con = dict(base, seed=seed, max_tokens=160, response_format={"type": "json_object"})
            n, _, text = stream(port, con)  # its length (seeded: the timed rerun is identical)
            json.loads(text)
            if n >= 32:
                break
        unc = dict(base, seed=seed, max_tokens=n, ignore_eos=True)
        got = {}
        for kind in (["constrained", "unconstrained"] if r % 2 == 0 else
                     ["unconstrained", "constrained"]):
            c0 = cpu_seconds(proc.pid)
            k, dt, _ = stream(port, con if kind == "constrained" else unc)
            c1 = cpu_seconds(proc.pid)
            got[kind] = (k - 1) / dt if dt > 0 and k > 1 else float("nan")
            rates[kind].append(got[kind])
            cpu[kind].append(k / (c1 - c0) if c1 > c0 else float("nan"))
        pairs.append(got["constrained"] / got["unconstrained"])
        cpu_pairs.append(cpu["constrained"][-1] / cpu["unconstrained"][-1])
        print("round %d: %d tokens, constrained %.2f tok/s, unconstrained %.2f tok/s" %
              (r, n, got["constrained"], got["unconstrained"]), flush=True)
    mc, mu = statistics.median(rates["constrained"]), statistics.median(rates["unconstrained"])
    print("median tok/s: constrained %.2f, unconstrained %.2f, ratio %.3f; per-round ratio median "
          "%.3f (min %.3f, max %.3f)" % (mc, mu, mc / mu, statistics.median(pairs), min(pairs),
                                         max(pairs)))
    cc, cu = statistics.median(cpu["constrained"]), statistics.median(cpu["unconstrained"])
    print("median tokens per CPU-second: constrained %.2f, unconstrained %.2f, ratio %.3f; "
          "per-round ratio median %.3f (min %.3f, max %.3f)" % (
              cc, cu, cc / cu, statistics.median(cpu_pairs), min(cpu_pairs), max(cpu_pairs)))
finally:
    proc.terminate()
    proc.wait()
