#!/usr/bin/python3
"""Decode speed of servers under a real memory limit: moed's expert store (each policy, with
and without prefetch) against moed's own mmap path and llama.cpp's server on the same file.

For each limit (MiB, or --fractions of the file), every mode runs once per round, in a fresh
cgroup v1 memory cgroup (page cache counted) with the model's pages dropped from the page
cache first (--drop-caches all: the whole page cache), rounds alternating the order of the
modes (A B C, C B A, ...). A run: start the server with the same threads, one warm-up request
(8 tokens), then one streamed greedy completion of --tokens tokens; decode tok/s is
(tokens - 1) over the time from the first to the last token. For moed it also reads, from
/metrics over the measured request: expert bytes read per decoded token, the host tier's hit
rate (hits / (hits + misses) of the planned experts), stall seconds and the prefetch accuracy.
Bytes read per token, the hit rate and the stall count the decode window only (a /metrics snapshot when the first token
arrives: the prompt's prefill is done then), as tok/s does; the prefill's reads are printed
beside them.

The disk's O_DIRECT bandwidth is measured the way the store reads (random expert-sized reads
on 4 threads) before the first run and after the last one of each limit; the I/O bound of a
mode is that bandwidth (the median of the measurements) over its bytes read per token, and
"/ bound" says how close the mode came to it.

Modes: store (the defaults: policy pred, prefetch off), store-lru, store-lfu, store-pred,
store-nopf (no prefetch), store-pf (prefetch on), store-nofill (the cache not filled at start:
--expert-fill 0), store-lazy (the cache's slots faulted in by their first reads, as before
2026-12-06), mmap (--expert-cache-mb -1), memory (the
defaults with no limit: the file paged into memory, the speed of compute alone; with it the
table adds the bound min(I/O bound, memory's tok/s) beside the I/O bound), llama
(DIR/llama-server, with --llama DIR or MOED_LLAMA_CPP; llama.cpp is never part of moed), bench (moed-bench, the engine without the
server, from the same build, with the store at the budget the store mode's server chose; it
decodes random tokens, so its routing is not the server's text's; after store in --modes).

  bench/bench_experts.py --moed build/server/moed -m MODEL.gguf --limits 4096,1843,1331 \\
      --modes store,store-lfu,store-pred,mmap,llama --llama ../llama.cpp/build/bin
  bench/bench_experts.py --moed build/server/moed -m MOE64-2G.gguf --fractions 25,50,75
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
import time

import memlimit
from memlimit import MIB

POLICY = {"store": [], "store-lru": ["--expert-policy", "lru"],
          "store-lfu": ["--expert-policy", "lfu"], "store-pred": ["--expert-policy", "pred"],
          "store-nopf": ["--expert-prefetch", "0"], "store-pf": ["--expert-prefetch", "1"],
          "store-nofill": ["--expert-fill", "0"], "store-lazy": []}
# A/B modes that need the environment: store-lazy leaves the cache's slots to fault in on their
# first read (MOED_ARENA_LAZY, engine/experts.c prefault_arena), as before 2026-12-06.
ENV = {"store-lazy": {"MOED_ARENA_LAZY": "1"}}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def req(port, method, path, body=None, timeout=900):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def stream_times(port, prompt, n, on_first=None):
    """Times (perf_counter) at which each streamed chunk with text arrived; on_first() is
    called when the first one has (the prompt's prefill is then done)."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    times = []
    for line in r:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            ch = json.loads(line[6:]).get("choices") or [{}]
            if ch[0].get("text"):
                times.append(time.perf_counter())
                if len(times) == 1 and on_first:
                    on_first()
    c.close()
    return times


def expert_metrics(port):
    """The host tier's moed:expert_* values (the first series of each name)."""
    _, body = req(port, "GET", "/metrics")
    vals = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(moed:expert_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m and (not m.group(2) or 'tier="device"' not in m.group(2)):
            vals.setdefault(m.group(1), float(m.group(3)))
    return vals


def wait_ready(p, port, log):
    while True:
        if p.poll() is not None:
            raise RuntimeError("server exited: " + open(log).read()[-1500:])
        try:
            if req(port, "GET", "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)


def bench_run(args, limit_mib, cache_mib):
    """moed-bench (the engine alone, no server) with the store at the budget the server
    chose at this limit: one warm-up pass, then tg of --tokens random tokens."""
    memlimit.drop_caches([args.model], args.drop_caches == "all")
    cg = memlimit.MemCg(limit_mib) if args.use_cg else None
    cache_mib = cache_mib or 0  # 0: the store was not chosen here, the engine on the mapping
    cmd = [args.moed_bench, "-m", args.model, "-t", str(args.threads), "-p", "0", "-n",
           str(args.tokens), "-r", "1", "-c", str(cache_mib)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                             preexec_fn=cg.preexec if cg else None).stdout
    finally:
        peak, failcnt = cg.stats() if cg else (0.0, 0)
        if cg:
            cg.close()
    m = re.search(r"\| tg%d \| ([0-9.]+) \|" % args.tokens, out)
    return {"tps": float(m.group(1)) if m else float("nan"), "tokens": args.tokens,
            "load_s": 0.0, "mode_line": "moed-bench -c %d" % cache_mib if cache_mib else
            "moed-bench on the mapping", "bytes_per_tok": 0.0,
            "hit": float("nan"), "stall": 0.0, "accuracy": float("nan"), "peak_mib": peak,
            "failcnt": failcnt, "note": ""}


def one_run(args, mode, limit_mib, cache_mib=None):
    if mode == "bench":
        return bench_run(args, limit_mib, cache_mib)
    note = memlimit.drop_caches([args.model], args.drop_caches == "all")
    cg = memlimit.MemCg(limit_mib) if args.use_cg and mode != "memory" else None
    port = free_port()
    if mode == "llama":
        cmd = [os.path.join(args.llama, "llama-server"), "-m", args.model, "--host", "127.0.0.1",
               "--port", str(port), "-t", str(args.threads), "-np", "1", "-c", "4096"]
    else:
        cmd = [args.moed, "-m", args.model, "--port", str(port), "--threads", str(args.threads)]
        if mode == "mmap":
            cmd += ["--expert-cache-mb", "-1"]
        elif mode != "memory":
            cmd += POLICY[mode]
            if not args.use_cg:  # no real limit: the store's share of it as a budget
                cmd += ["--expert-cache-mb", str(max(64, int(limit_mib * 0.8 - args.dense_mib)))]
        cmd += args.moed_args
    log = tempfile.NamedTemporaryFile("w+", prefix="moed-bench-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    env = dict(os.environ, **ENV.get(mode, {}))
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                         preexec_fn=cg.preexec if cg else None)
    try:
        wait_ready(p, port, log.name)
        load_s = time.perf_counter() - t0
        st, _ = req(port, "POST", "/v1/completions",
                    {"prompt": "Warm-up: the weather today", "max_tokens": 8, "temperature": 0})
        if st != 200:
            raise RuntimeError("warm-up failed: %d" % st)
        m0 = expert_metrics(port) if mode != "llama" else {}
        mf = {}
        times = stream_times(port, args.prompt, args.tokens,
                             (lambda: mf.update(expert_metrics(port))) if mode != "llama" else None)
        m1 = expert_metrics(port) if mode != "llama" else {}
    finally:
        p.terminate()
        p.wait()
        peak, failcnt = cg.stats() if cg else (0.0, 0)
        if cg:
            cg.close()
    text = open(log.name).read()
    os.unlink(log.name)
    mm = re.search(r"experts: (store|mmap)[^\n]*", text)
    n = len(times)

    def d(k):
        return m1.get(k, 0) - m0.get(k, 0)

    def dd(k):  # over the decode window only: from the first token to the last
        return m1.get(k, 0) - mf.get(k, m0.get(k, 0))
    hits, misses = dd("moed:expert_hits_total"), dd("moed:expert_misses_total")
    pred_t = d("moed:expert_predicted_total")
    return {"tps": (n - 1) / (times[-1] - times[0]) if n > 1 else float("nan"), "tokens": n,
            "load_s": load_s, "mode_line": mm.group(0) if mm else "",
            "bytes_per_tok": dd("moed:expert_read_bytes_total") / (n - 1) if n > 1 else 0.0,
            "prefill_mib": (mf.get("moed:expert_read_bytes_total", 0) -
                            m0.get("moed:expert_read_bytes_total", 0)) / MIB,
            "hit": hits / (hits + misses) if hits + misses else float("nan"),
            "stall": dd("moed:expert_stall_seconds_total"),
            "accuracy": d("moed:expert_predicted_used_total") / pred_t if pred_t else float("nan"),
            "peak_mib": peak, "failcnt": failcnt, "note": note}


def med(rs, k):
    v = [r[k] for r in rs if r[k] == r[k]]
    return statistics.median(v) if v else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moed", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--limits", help="MiB, comma-separated")
    ap.add_argument("--fractions", help="percent of the file, comma-separated (instead)")
    ap.add_argument("--rounds", "--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="The history of the city begins with")
    ap.add_argument("--modes", default="store,mmap")
    ap.add_argument("--llama", default=os.environ.get("MOED_LLAMA_CPP"),
                    help="llama.cpp's bin directory (llama-server), for the llama mode")
    ap.add_argument("--drop-caches", choices=("file", "all"), default="file",
                    help="before each run drop the model's pages (default; the machine is "
                    "shared) or the whole page cache")
    ap.add_argument("--dense-mib", type=float, default=0,
                    help="without a cgroup: MiB of dense weights, to size the budget")
    ap.add_argument("moed_args", nargs="*", help="after --: more moed arguments")
    args = ap.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in POLICY and m not in ("mmap", "memory", "llama", "bench"):
            sys.exit("bench_experts: unknown mode '%s'" % m)
    if "bench" in modes and (modes.index("bench") < modes.index("store") if "store" in modes
                             else True):
        sys.exit("bench_experts: the bench mode needs the store mode before it (for its budget)")
    args.moed_bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.moed))),
                                   "bench", "moed-bench")
    if "llama" in modes and not (args.llama and os.path.exists(
            os.path.join(args.llama, "llama-server"))):
        sys.exit("bench_experts: the llama mode needs --llama DIR (or MOED_LLAMA_CPP) with "
                 "llama-server in it")
    fsize = os.path.getsize(args.model)
    if args.fractions:
        limits = [int(fsize / MIB * int(x) / 100) for x in args.fractions.split(",")]
    else:
        limits = [int(x) for x in (args.limits or "1300").split(",")]
    args.use_cg = memlimit.usable()
    print("model %s (%.0f MiB), %d threads, %d tokens decoded per run, %d rounds, modes %s, "
          "load average %s at start" % (args.model, fsize / MIB, args.threads, args.tokens,
                                        args.rounds, ",".join(modes), memlimit.loadavg()))
    if not args.use_cg:
        print("NOTE: no cgroup v1 memory controller usable here: no real memory limit; the "
              "store runs with --expert-cache-mb at 80% of the limit less --dense-mib")
    rows = []
    cache_mib = {}  # limit -> the host budget the server's default plan chose
    mapped = set()  # limits where the default plan kept the mapping
    chunk = 5 * MIB
    for lim in limits:
        res = {m: [] for m in modes}
        bws = [memlimit.direct_bandwidth(args.model, chunk, 4)]
        for rnd in range(args.rounds):
            order = modes if rnd % 2 == 0 else modes[::-1]
            for mode in order:
                if mode in POLICY and mode != "store" and lim in mapped:
                    continue  # the default plan kept the mapping here: the same run as store
                r = one_run(args, mode, lim, cache_mib.get(lim))
                res[mode].append(r)
                cm = re.search(r"host cache (\d+) MiB", r["mode_line"])
                if cm and mode == "store":
                    cache_mib[lim] = int(cm.group(1))
                if mode == "store" and "experts: mmap" in r["mode_line"]:
                    mapped.add(lim)
                print("limit %5d MiB %-10s round %d: %6.2f tok/s, load %.1f s, %.1f MiB "
                      "read/token (%.0f MiB in the prompt's prefill), hit %.2f, stall %.2f s, prefetch accuracy %.2f, peak %.0f "
                      "MiB, load avg %s | %s" % (lim, mode, rnd, r["tps"], r["load_s"],
                                                 r["bytes_per_tok"] / MIB, r.get("prefill_mib", 0),
                                                 r["hit"], r["stall"],
                                                 r["accuracy"], r["peak_mib"],
                                                 memlimit.loadavg(), r["mode_line"][:150]),
                      flush=True)
        bws.append(memlimit.direct_bandwidth(args.model, chunk, 4))
        print("limit %d MiB: O_DIRECT random %d MiB reads on 4 threads: %.0f MiB/s before, %.0f "
              "after" % (lim, chunk // MIB, bws[0], bws[1]), flush=True)
        rows.append((lim, res, statistics.median(bws)))
    base = "llama" if "llama" in modes else ("mmap" if "mmap" in modes else modes[-1])
    print("\nload average at the end %s; %s before each run" % (memlimit.loadavg(),
                                                                 rows[0][1][modes[0]][0]["note"]))
    print("\n| limit MiB | mode | tok/s (median, min..max) | / %s | MiB read/token | host hit "
          "rate | prefetch accuracy | disk MiB/s | I/O bound tok/s | / bound | / min(bound, memory) |"
          % base)
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lim, res, bw in rows:
        b = med(res[base], "tps")
        mem = med(res["memory"], "tps") if res.get("memory") else 0
        for mode, rs in res.items():
            if not rs:
                continue
            t = [r["tps"] for r in rs]
            s = med(rs, "tps")
            bpt = med(rs, "bytes_per_tok")
            bound = bw * MIB / bpt if bpt > 0 else 0
            acc, hit = med(rs, "accuracy"), med(rs, "hit")
            both = min(bound, mem) if bound and mem else 0
            print("| %d | %s | %.2f (%.2f..%.2f) | %.2f | %s | %s | %s | %.0f | %s | %s | %s |"
                  % (lim, mode, s, min(t), max(t), s / b if b else float("nan"),
                     "%.1f" % (bpt / MIB) if mode.startswith("store") else "-",
                     "%.2f" % hit if hit == hit else "-", "%.2f" % acc if acc == acc else "-",
                     bw, "%.1f" % bound if bound else "-",
                     "%.2f" % (s / bound) if bound else "-",
                     "%.2f" % (s / both) if both else "-"))


if __name__ == "__main__":
    main()
