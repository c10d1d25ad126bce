#!/usr/bin/python3
"""Expert-aware batching on and off, alternating, against the real server on 127.0.0.1.

For each stream count, starts moed (MOED binary, MODEL) with --step-tokens STEP and
--expert-batching 1 and 0, RUNS times each, alternating (on-off, off-on, ...); each run sends
one streaming completion per stream at once (King James prompts in turn, temperature 0.8,
fixed seeds, ignore_eos, TOKENS tokens) and measures: tokens/s (completion tokens / wall
time), tokens per CPU second of the server process (steadier than wall time on a shared
machine), p99 of the inter-token gaps of all streams, engine steps, the steps between a
stream's tokens (p50, p99; from a routing trace written during the run: machine load cannot
move it), and distinct experts per MoE layer and step (from /metrics:
moed:moe_distinct_experts_total / moed:moe_layer_steps_total over the run). Prints one line
per run and a table of medians with the on/off ratio.

With --baseline MOED2 the "off" runs use that binary with --expert-batching 1 too, so the
table compares two builds of the scheduler (say, one that orders only decoders by experts
against one that orders prompt chunks as well); the table also gives the time to the first
token (median and p90 over the streams) and the steps whose prompt chunks were reordered.

With --limit MIB each run is in a fresh cgroup v1 memory cgroup of that size (page cache
counted; the model's pages dropped first), so a model larger than the limit goes through the
expert store (the default plan) and the table adds the experts read per token.

usage: bench_expert_batching.py MOED MODEL [--streams 16,64] [--step 16] [--tokens 64]
                                [--runs 3] [--port 18533] [--threads 2] [--limit MIB]
                                [--args "more moed arguments"] [--baseline MOED2]"""
import argparse, http.client, json, os, resource, statistics, subprocess, tempfile, threading
import time
import memlimit
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

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("model")
ap.add_argument("--streams", default="16,64")
ap.add_argument("--step", type=int, default=16)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--port", type=int, default=18533)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--limit", type=int, default=0, help="MiB: run under a memory cgroup")
ap.add_argument("--args", default="", help="more moed arguments, space-separated")
ap.add_argument("--baseline", default="", help="the off runs: this binary, batching on")
a = ap.parse_args()


def get(path):
    c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


def metrics():
    _, body = get("/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(("moed:moe_", "moed:expert_batching", "moed:engine_steps",
                            "moed:expert_read_bytes", "moed:expert_hits", "moed:expert_misses")):
            k, v = line.rsplit(" ", 1)
            out.setdefault(k.split("{")[0], float(v))
    return out


def cpu_s(pid):
    """User + system CPU seconds of a process (/proc/PID/stat fields 14 and 15)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream(i, gaps, toks, ttft, lock):
    body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": a.tokens,
                       "temperature": 0.8, "seed": 1000 + i, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=900)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    first = []
    mine, got = read_stream(r, first)
    c.close()
    with lock:
        gaps.extend(mine)
        toks[0] += got
        if first:
            ttft.append(first[0] - t0)


def step_gaps(trace):
    """Steps between a sequence's successive tokens, from a routing trace (layer 0 records)."""
    last, gaps = {}, []
    with open(trace) as f:
        for line in f:
            if line[0] in "#p":
                continue  # comments, and pre-gating's predictions
            step, layer, seq = line.split(None, 3)[:3]
            if layer != "0":
                continue
            step = int(step)
            if seq in last and last[seq] != step:
                gaps.append(step - last[seq])
            last[seq] = step
    return sorted(gaps)


def run(streams, on):
    trace = tempfile.NamedTemporaryFile(prefix="moed-eb-", suffix=".trace", delete=False).name
    cg = None
    if a.limit:
        memlimit.drop_caches([a.model])
        cg = memlimit.MemCg(a.limit)
        if not cg:
            raise SystemExit("bench_expert_batching: --limit needs a cgroup v1 memory controller")
    exe = a.baseline if a.baseline and not on else a.moed
    srv = subprocess.Popen([exe, "-m", a.model, "-p", str(a.port), "-t", str(a.threads),
                            "--step-tokens", str(a.step), "--max-seqs", str(max(streams, 1)),
                            "--expert-batching", "1" if on or a.baseline else "0",
                            "--trace-routing", trace]
                           + a.args.split(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           preexec_fn=cg.preexec if cg else None)
    try:
        for _ in range(600):
            try:
                if get("/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        m0 = metrics()
        c0 = cpu_s(srv.pid)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        gaps, toks, ttft, lock = [], [0], [], threading.Lock()
        ths = [threading.Thread(target=stream, args=(i, gaps, toks, ttft, lock))
               for i in range(streams)]
        t0 = time.perf_counter()
        [t.start() for t in ths]
        [t.join() for t in ths]
        wall = time.perf_counter() - t0
        m1 = metrics()
        cpu = cpu_s(srv.pid) - c0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        client = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    finally:
        srv.terminate()
        srv.wait()
        if cg:
            cg.close()
    gaps.sort()
    sg = step_gaps(trace)
    os.unlink(trace)
    d = m1["moed:moe_distinct_experts_total"] - m0["moed:moe_distinct_experts_total"]
    n = m1["moed:moe_layer_steps_total"] - m0["moed:moe_layer_steps_total"]
    sel = m1["moed:expert_batching_selections_total"] - m0["moed:expert_batching_selections_total"]
    psel = (m1.get("moed:expert_batching_prefill_selections_total", 0)
            - m0.get("moed:expert_batching_prefill_selections_total", 0))
    ttft.sort()
    rd = m1.get("moed:expert_read_bytes_total", 0) - m0.get("moed:expert_read_bytes_total", 0)
    return {"mib_tok": rd / toks[0] / 1048576 if toks[0] else 0.0, "tok_s": toks[0] / wall,
            "cpu_share": cpu / wall, "client_cpu": client / wall, "p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "experts": d / n if n else 0.0, "selections": sel, "tok_cpu_s": toks[0] / cpu,
            "prefill_sel": psel, "ttft_p50": ttft[len(ttft) // 2] if ttft else 0.0,
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))] if ttft else 0.0,
            "steps": m1["moed:engine_steps_total"] - m0["moed:engine_steps_total"],
            "gap_p50": sg[len(sg) // 2], "gap_p99": sg[int(0.99 * (len(sg) - 1))]}


print("moed %s, model %s, step-tokens %d, %d tokens per stream, %d alternating runs%s%s, "
      "load average %s" % (a.moed, a.model, a.step, a.tokens, a.runs,
                           ", limit %d MiB" % a.limit if a.limit else "",
                           ", off = %s with expert batching on" % a.baseline if a.baseline
                           else "", memlimit.loadavg()))
OFF, ON = ("baseline", "this build") if a.baseline else ("off", "on")
rows = []
for s in [int(x) for x in a.streams.split(",")]:
    res = {True: [], False: []}
    for r in range(a.runs):
        for on in ((True, False) if r % 2 == 0 else (False, True)):  # ABBA: no order bias
            x = run(s, on)
            res[on].append(x)
            print("streams %d expert-batching %d run %d: %.1f tok/s, %.1f tok per CPU s, p99 ITL "
                  "%.1f ms, %.2f experts per layer-step, %d steps, %d selected by experts, "
                  "%d prompt chunks reordered, first token p50 %.2f s p90 %.2f s, "
                  "steps between tokens p50 %d p99 %d, %.2f MiB read per token, server CPU %.2f "
                  "and client CPU %.2f of wall, load %s"
                  % (s, on, r + 1, x["tok_s"], x["tok_cpu_s"], x["p99_ms"], x["experts"],
                     x["steps"], x["selections"], x["prefill_sel"], x["ttft_p50"],
                     x["ttft_p90"], x["gap_p50"], x["gap_p99"], x["mib_tok"],
                     x["cpu_share"], x["client_cpu"], memlimit.loadavg()),
                  flush=True)
    med = {on: {k: statistics.median(v[k] for v in res[on]) for k in res[on][0]}
           for on in res}
    rows.append((s, med))

print("\n| streams | expert-batching | distinct experts per layer and step | steps | tok/s | "
      "tokens per CPU second | p99 inter-token latency (ms) | steps between tokens, p50 / p99 |"
      " MiB read per token | first token p50 / p90 (s) | prompt chunks reordered |\n"
      "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for s, med in rows:
    for on in (False, True):
        m = med[on]
        print("| %d | %s | %.2f | %d | %.1f | %.1f | %.1f | %d / %d | %.2f | %.2f / %.2f | %d |"
              % (s, ON if on else OFF, m["experts"], m["steps"], m["tok_s"], m["tok_cpu_s"],
                 m["p99_ms"], m["gap_p50"], m["gap_p99"], m["mib_tok"], m["ttft_p50"],
                 m["ttft_p90"], m["prefill_sel"]))
    r = {k: med[True][k] / med[False][k] for k in med[True] if med[False][k]}
    print("| %d | %s / %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f / %.2f | %s | %s | - |"
          % (s, ON, OFF, r["experts"], r["steps"], r["tok_s"], r["tok_cpu_s"], r["p99_ms"],
             r["gap_p50"], r["gap_p99"], "%.3f" % r["mib_tok"] if "mib_tok" in r else "-",
             "%.2f / %.2f" % (r["ttft_p50"], r["ttft_p90"]) if "ttft_p50" in r else "-"))
print("load average at the end %s" % memlimit.loadavg())
