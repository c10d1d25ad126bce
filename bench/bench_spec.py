#!/usr/bin/python3
"""Speculative decoding against plain decode on one model, through the real server.

Starts moed on MODEL (with --draft-model when given) and drives it over HTTP with S concurrent
streams, each request choosing its drafter with the "speculative" object, so every drafter
runs in the same process and the configurations alternate round by round (the machine's noise
hits them alike). Workloads, chat format, 128 tokens at most:
  verses   "Quote <book> <c>:1-8." greedy: the model quotes verses it memorised, and so does
           its draft (long, right drafts for the draft model)
  prompt   the same request with the model's own quotation of those verses pasted before it:
           text that repeats the prompt (long, right drafts for n-gram lookup)
  free     "Tell me about <topic>." at temperature 0.8, top_p 0.95, fixed seeds
For each (workload, streams, drafter): generated tokens/s (median over rounds), the ratio to
plain decode (median of the per-round ratios), the acceptance rate and the mean accepted
length (tokens per verifying step) from /metrics. Greedy outputs are checked identical.

usage: bench_spec.py MOED MODEL [--draft FILE] [--streams 1,4] [--rounds 3] [--threads 2]
                     [--workloads verses,prompt,free] [--drafters off,ngram,draft] [--fixed]
"""
import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("model")
ap.add_argument("--draft")
ap.add_argument("--streams", default="1,4")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--per-stream", type=int, default=2, help="requests per stream and run")
ap.add_argument("--workloads", default="verses,prompt,free")
ap.add_argument("--drafters", default=None)
args = ap.parse_args()

drafters = (args.drafters or ("off,ngram,draft" if args.draft else "off,ngram")).split(",")
streams = [int(x) for x in args.streams.split(",")]
REFS = ["Genesis 1", "John 1", "Psalms 23", "Exodus 20", "Matthew 5", "Romans 8", "Isaiah 40",
        "Luke 2", "Proverbs 3", "Acts 2", "Mark 4", "Daniel 3", "Job 38", "Ruth 1", "Genesis 2",
        "John 3"]
TOPICS = ["the sea", "a king and his sons", "the harvest", "a long journey", "the temple",
          "wisdom", "the desert", "a shepherd", "the river", "the night sky", "a city wall",
          "bread and wine", "the mountains", "a storm", "the morning", "a great feast"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


port = free_port()
log = tempfile.NamedTemporaryFile("w+", prefix="bench-spec-", suffix=".log", delete=False)
cmd = [args.moed, "-m", args.model, "--port", str(port), "--threads", str(args.threads),
       "--spec", "off", "--max-seqs", str(max(streams)), "--ctx-size", "1024"]
if args.draft:
    cmd += ["--draft-model", args.draft]
proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
import atexit, signal  # noqa: E401,E402
atexit.register(lambda: proc.poll() is None and proc.terminate())
signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))


def request(method, path, body=None, timeout=900):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"})
    r = c.getresponse()
    d = r.read()
    c.close()
    return r.status, d


deadline = time.time() + 300
while True:
    try:
        if request("GET", "/health", timeout=2)[0] == 200:
            break
    except OSError:
        pass
    if proc.poll() is not None or time.time() > deadline:
        log.seek(0)
        sys.exit("moed did not start:\n" + log.read())
    time.sleep(0.2)


def metrics():
    b = request("GET", "/metrics")[1].decode()
    out = {}
    for k in ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_verify_steps_total",
              "spec_emitted_tokens_total"):
        m = re.search(r"^moed:%s\{[^}]*\} (\S+)$" % k, b, re.M)
        out[k] = float(m.group(1)) if m else 0.0
    return out


def chat(content, drafter, temp=0.0, seed=None):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens,
            "temperature": temp, "speculative": {"drafter": drafter}}
    if temp > 0:
        body.update(top_p=0.95, seed=seed)
    st, d = request("POST", "/v1/chat/completions", body)
    if st != 200:
        raise RuntimeError("status %d: %s" % (st, d[:300]))
    doc = json.loads(d)
    return doc["choices"][0]["message"]["content"], doc["usage"]["completion_tokens"]


# The "prompt" workload pastes the model's own quotation (plain decode) before the request.
quoted = {}
for ref in REFS:
    quoted[ref] = chat("Quote %s:1-8." % ref, "off")[0]


def job(workload, i):
    ref = REFS[i % len(REFS)]
    if workload == "verses":
        return ("Quote %s:1-8." % ref,), 0.0
    if workload == "prompt":
        return ("%s\n\n%s\n\nQuote %s:1-8." % (ref, quoted[ref], ref),), 0.0
    return ("Tell me about %s." % TOPICS[i % len(TOPICS)],), 0.8


def run(workload, drafter, S, rnd):
    """S streams, per_stream requests each; returns (tok/s, texts by job index)."""
    n = S * args.per_stream
    todo = list(range(n))
    texts, toks = {}, [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            (content,), temp = job(workload, i + rnd * n)
            text, ct = chat(content, drafter, temp, seed=1000 + i + rnd * n)
            with lock:
                texts[i] = text
                toks[0] += ct

    th = [threading.Thread(target=worker) for _ in range(S)]
    t0 = time.perf_counter()
    [t.start() for t in th]
    [t.join() for t in th]
    return toks[0] / (time.perf_counter() - t0), texts


print("# model %s%s; %d threads; drafters %s; %d rounds; max_tokens %d" %
      (os.path.basename(args.model), (" + draft " + os.path.basename(args.draft)) if args.draft
       else "", args.threads, ",".join(drafters), args.rounds, args.max_tokens), flush=True)
print("%-7s %3s %-6s %9s %8s %8s %9s  %s" % ("work", "S", "spec", "tok/s", "x plain", "accept",
                                             "mean len", "per-round tok/s"))
mismatch = 0
for workload in args.workloads.split(","):
    for S in streams:
        rates = {d: [] for d in drafters}
        ratios = {d: [] for d in drafters}
        acc = {d: [0.0, 0.0, 0.0, 0.0] for d in drafters}
        for rnd in range(args.rounds):
            order = drafters[rnd % len(drafters):] + drafters[:rnd % len(drafters)]
            got = {}
            for d in order:
                m0 = metrics()
                r, texts = run(workload, d, S, rnd)
                m1 = metrics()
                got[d] = (r, texts)
                rates[d].append(r)
                for j, k in enumerate(("spec_draft_tokens_total", "spec_accepted_tokens_total",
                                       "spec_verify_steps_total", "spec_emitted_tokens_total")):
                    acc[d][j] += m1[k] - m0[k]
            for d in drafters:
                ratios[d].append(got[d][0] / got["off"][0])
                if workload != "free" or d == "ngram":
                    for i, t in got["off"][1].items():
                        if got[d][1].get(i) != t:
                            mismatch += 1
        for d in drafters:
            dr, ac, vs, em = acc[d]
            print("%-7s %3d %-6s %9.1f %8.2f %8s %9s  %s" % (
                workload, S, d, statistics.median(rates[d]), statistics.median(ratios[d]),
                "%.2f" % (ac / dr) if dr else "-", "%.2f" % (em / vs) if vs else "-",
                " ".join("%.0f" % x for x in rates[d])), flush=True)
print("# outputs differing from plain decode (greedy, and seeded n-gram): %d" % mismatch)
proc.terminate()
proc.wait(30)
