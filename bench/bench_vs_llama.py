#!/usr/bin/python3
"""moed-bench against llama-bench on the same GGUF: prefill (pp) and decode (tg) tok/s.

The two engines run in turns, one repetition each per round (moed pp, llama pp, moed tg,
llama tg, then the next round), so a change of load on a shared machine falls on both; the
table gives each side's median and spread over the rounds and the ratio of the medians, with
the load average before and after. Same file, same thread count, the same test sizes.

usage: bench_vs_llama.py -m MODEL.gguf [--moed-bench PATH] [--llama DIR] [-t THREADS]
       [-p N_PROMPT] [-n N_GEN] [-r ROUNDS]
--llama (or MOED_LLAMA_CPP): a directory holding llama-bench, or a llama.cpp checkout with
build/bin/llama-bench.

The gpt-oss file of bench/README.md ("gpt-oss against llama.cpp"):
  moed-gguf gen --arch gpt-oss --type q8_0 --exp-type mxfp4 --seed 1 --n-layer 8 --n-embd 1024 \\
    --n-head 16 --n-head-kv 4 --head-dim 64 --n-expert 32 --n-expert-used 4 --n-ff-exp 1024 \\
    --n-vocab 32768 --rms-eps 1e-5 bench/models/gpt-oss-mxfp4-0.5g.gguf
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def moed_once(bench, model, threads, p, n):
    out = subprocess.run([bench, "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n),
                          "-r", "1"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 8 and cells[6] in ("pp%d" % p, "tg%d" % n):
            return float(cells[7])
    raise RuntimeError("no result in moed-bench output:\n" + out)


def llama_once(bench, model, threads, p, n):
    out = subprocess.run([bench, "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n),
                          "-r", "1", "-o", "json"], capture_output=True, text=True,
                         check=True).stdout
    res = json.loads(out)
    return float(res[0]["avg_ts"])


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--moed-bench", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "build", "bench", "moed-bench"))
    ap.add_argument("--llama", default=os.environ.get("MOED_LLAMA_CPP", ""))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    a = ap.parse_args()
    lb = None
    for c in (os.path.join(a.llama, "llama-bench"), os.path.join(a.llama, "build", "bin", "llama-bench")):
        if a.llama and os.access(c, os.X_OK):
            lb = c
            break
    if not lb:
        print("bench_vs_llama: no llama-bench (give --llama DIR or set MOED_LLAMA_CPP)", file=sys.stderr)
        return 2
    tests = [("pp%d" % a.n_prompt, a.n_prompt, 0), ("tg%d" % a.n_gen, 0, a.n_gen)]
    res = {(t, e): [] for t, _, _ in tests for e in ("moed", "llama")}
    before = loadavg()
    for _ in range(a.rounds):
        for name, p, n in tests:
            res[(name, "moed")].append(moed_once(a.moed_bench, a.model, a.threads, p, n))
            res[(name, "llama")].append(llama_once(lb, a.model, a.threads, p, n))
    after = loadavg()
    print("model %s, %d threads, %d rounds alternating; load average %s before, %s after"
          % (os.path.basename(a.model), a.threads, a.rounds, before, after))
    print("| test | moed t/s (median) | spread | llama.cpp t/s (median) | spread | moed / llama.cpp |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, _, _ in tests:
        m, l = res[(name, "moed")], res[(name, "llama")]
        mm, ml = statistics.median(m), statistics.median(l)
        print("| %s | %.2f | %.2f..%.2f | %.2f | %.2f..%.2f | %.2fx |"
              % (name, mm, min(m), max(m), ml, min(l), max(l), mm / ml))
    return 0


if __name__ == "__main__":
    sys.exit(main())
