#!/usr/bin/python3
"""Decode speed of the server under a memory limit: the expert store against the mmap path.

For each limit, runs moed in a fresh cgroup v1 memory cgroup (page cache counted) with the
model file's pages dropped from the page cache first (POSIX_FADV_DONTNEED), once with the
default settings (the store takes over when the file exceeds 80% of the limit) and once with
--expert-cache-mb -1 (the plain mapping), alternating, --reps times each. Per run: a warm-up
request, then one streamed greedy completion of --tokens tokens; decode tok/s is (tokens - 1)
over the time from the first to the last token. Prints per-run figures, medians, the ratio
store/mmap, the expert bytes read per decoded token (/metrics), the O_DIRECT read bandwidth of
the model file measured here (random expert-sized reads), and the I/O bound they imply.

Without a usable memory cgroup (no v1 memory controller, or not allowed to make one) it says
so and runs the store with --expert-cache-mb set to the store's share of the limit instead.

  bench/bench_experts.py --moed build/server/moed -m MODEL.gguf --limits 1300,1000 [--reps 3]
"""

import argparse
import http.client
import json
import mmap
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1024 * 1024


def own_memcg():
    """The process's cgroup v1 memory directory, or None."""
    try:
        for line in open("/proc/self/cgroup"):
            _, ctl, path = line.rstrip("\n").split(":", 2)
            if "memory" in ctl.split(","):
                d = "/sys/fs/cgroup/memory" + path
                return d if os.path.isdir(d) else None
    except OSError:
        pass
    return None


def make_cg(base, limit_mb):
    d = os.path.join(base, "moed-bench-%d-%d" % (os.getpid(), limit_mb))
    try:
        os.mkdir(d)
        with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_mb * MIB))
        return d
    except OSError:
        return None


def drop_cg(d):
    if d:
        try:
            with open(os.path.join(d, "memory.force_empty"), "w") as f:
                f.write("0")
        except OSError:
            pass
        try:
            os.rmdir(d)
        except OSError:
            pass


def drop_file_cache(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


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


def stream_times(port, prompt, n):
    """Times (perf_counter) at which each streamed token arrived."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    times = []
    for line in r:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            if json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    c.close()
    return times


def expert_metrics(port):
    _, body = req(port, "GET", "/metrics")
    vals = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(moed:expert_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m:
            vals[m.group(1)] = float(m.group(3))
    return vals


def one_run(args, cg, extra):
    drop_file_cache(args.model)
    port = free_port()
    cmd = [args.moed, "-m", args.model, "--port", str(port), "--threads", str(args.threads),
           "--max-seqs", "4"] + extra
    log = tempfile.NamedTemporaryFile("w+", prefix="moed-bench-", suffix=".log", delete=False)
    pre = None
    if cg:
        procs = os.path.join(cg, "cgroup.procs")

        def pre():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pre)
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError("moed exited: " + open(log.name).read()[-1500:])
            try:
                if req(port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        load_s = time.perf_counter() - t0
        st, _ = req(port, "POST", "/v1/completions",
                     {"prompt": "Warm-up: the weather today", "max_tokens": 8, "temperature": 0})
        if st != 200:
            raise RuntimeError("warm-up failed: %d" % st)
        m0 = expert_metrics(port)
        times = stream_times(port, args.prompt, args.tokens)
        m1 = expert_metrics(port)
    finally:
        p.terminate()
        p.wait()
    text = open(log.name).read()
    os.unlink(log.name)
    mode = re.search(r"experts: (store|mmap)[^\n]*", text)
    n = len(times)
    tps = (n - 1) / (times[-1] - times[0]) if n > 1 else float("nan")
    dbytes = m1.get("moed:expert_read_bytes_total", 0) - m0.get("moed:expert_read_bytes_total", 0)
    return {"tps": tps, "tokens": n, "load_s": load_s, "mode": mode.group(0) if mode else "?",
            "bytes_per_tok": dbytes / n if n else 0.0,
            "stall": m1.get("moed:expert_stall_seconds_total", 0)
            - m0.get("moed:expert_stall_seconds_total", 0),
            "accuracy": m1.get("moed:expert_prefetch_accuracy", 0)}


def direct_bandwidth(path, chunk, n_threads, seconds=3.0):
    """MiB/s of random chunk-sized O_DIRECT reads of path (aligned offsets) on n_threads
    threads, as the store's readers do."""
    size = os.path.getsize(path)
    chunk = (chunk + 4095) // 4096 * 4096
    done = [0] * n_threads

    def reader(i):
        buf = mmap.mmap(-1, chunk)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        rnd = random.Random(i + 1)
        while time.perf_counter() - t0 < seconds:
            off = rnd.randrange(0, (size - chunk) // 4096) * 4096
            done[i] += os.preadv(fd, [buf], off)
        os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=reader, args=(i,)) for i in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(done) / MIB / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moed", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--limits", default="1300", help="MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="The history of the city begins with")
    ap.add_argument("--modes", default="store,mmap",
                    help="store (defaults), store-nopf (no prefetch), mmap; run alternately")
    args = ap.parse_args()

    base = own_memcg()
    limits = [int(x) for x in args.limits.split(",")]
    fsize = os.path.getsize(args.model)
    print("model %s (%.0f MiB), %d threads, %d tokens decoded per run, %d runs per cell"
          % (args.model, fsize / MIB, args.threads, args.tokens, args.reps))
    probe = make_cg(base, 4096) if base else None
    drop_cg(probe)
    use_cg = probe is not None
    if not use_cg:
        print("NOTE: no cgroup v1 memory controller usable here: no real memory limit; the "
              "store runs with --expert-cache-mb at 80% of the limit less the dense weights")
    rows = []
    for lim in limits:
        modes = args.modes.split(",")
        res = {m: [] for m in modes}
        for rep in range(args.reps):
            for mode in modes:
                cg = make_cg(base, lim) if use_cg else None
                extra = ["--expert-cache-mb", "-1"] if mode == "mmap" else []
                if mode != "mmap" and not use_cg:
                    extra = ["--expert-cache-mb", str(max(64, int(lim * 0.8 - 200)))]
                if mode == "store-nopf":
                    extra += ["--expert-prefetch", "0"]
                try:
                    r = one_run(args, cg, extra)
                finally:
                    drop_cg(cg)
                res[mode].append(r)
                print("limit %5d MiB %-5s run %d: %6.2f tok/s, load %.1f s, %.1f MiB read/token,"
                      " stall %.2f s, prefetch accuracy %.2f | %s"
                      % (lim, mode, rep, r["tps"], r["load_s"], r["bytes_per_tok"] / MIB,
                         r["stall"], r["accuracy"], r["mode"][:110]), flush=True)
        rows.append((lim, res))
    bw = direct_bandwidth(args.model, 5 * MIB, 4)
    print("\nO_DIRECT random 5 MiB reads of the model file: %.0f MiB/s (4 threads like the "
          "store's readers, measured after the runs)" % bw)
    base_mode = "mmap" if "mmap" in modes else modes[-1]
    print("\n| limit MiB | mode | tok/s (median, min..max) | / %s | MiB read/token | "
          "I/O bound tok/s | / bound |" % base_mode)
    print("|---|---|---|---|---|---|---|")
    for lim, res in rows:
        b = statistics.median(r["tps"] for r in res[base_mode])
        for mode, rs in res.items():
            t = [r["tps"] for r in rs]
            s = statistics.median(t)
            bpt = statistics.median(r["bytes_per_tok"] for r in rs)
            bound = bw * MIB / bpt if bpt > 0 else 0
            print("| %d | %s | %.2f (%.2f..%.2f) | %.2f | %.1f | %s | %s |"
                  % (lim, mode, s, min(t), max(t), s / b if b else float("nan"), bpt / MIB,
                     "%.1f" % bound if bound else "-", "%.2f" % (s / bound) if bound else "-"))


if __name__ == "__main__":
    main()
