#!/usr/bin/python3
"""Time to first token under load, for two settings of the compute pool's spin
(MOED_POOL_SPIN_US), alternated in one run. For each round and setting it starts moed on the
default model (127.0.0.1, a free port), keeps LOAD streaming requests generating, sends PROBES
short requests one after another and records their TTFT, and counts the load's tokens/s.
Prints per-setting medians and the ratio B/A.

usage: bench_ttft_load.py MOED [ROUNDS=3] [LOAD=4] [PROBES=10] [A_US=2000] [B_US=100] [-- moed args]"""
import http.client, json, os, socket, statistics, subprocess, sys, threading, time
from srvwait import wait_health

argv = sys.argv[1:]
extra = []
if "--" in argv:
    extra = argv[argv.index("--") + 1:]
    argv = argv[:argv.index("--")]
moed = argv[0]
rounds = int(argv[1]) if len(argv) > 1 else 3
load_n = int(argv[2]) if len(argv) > 2 else 4
probes = int(argv[3]) if len(argv) > 3 else 10
settings = [argv[4] if len(argv) > 4 else "2000", argv[5] if len(argv) > 5 else "100"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def stream(port, prompt, max_tokens, on_token=None):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            if ttft is None:
                ttft = time.perf_counter() - t0
            if on_token:
                on_token()
    c.close()
    return ttft


def one_run(spin_us):
    port = free_port()
    env = dict(os.environ, MOED_POOL_SPIN_US=spin_us)
    srv = subprocess.Popen([moed, "--port", str(port), "--log-level", "error"] + extra, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_health(port, srv, interval=0.05)
        stop = threading.Event()
        count = [0]
        lock = threading.Lock()

        def tick():
            with lock:
                count[0] += 1

        def loader(i):
            while not stop.is_set():
                stream(port, "And it came to pass %d" % i, 200, tick)

        ths = [threading.Thread(target=loader, args=(i,), daemon=True) for i in range(load_n)]
        [t.start() for t in ths]
        time.sleep(1.0)
        c0, t0 = count[0], time.perf_counter()
        ttfts = [stream(port, "In the beginning %d" % k, 2) for k in range(probes)]
        rate = (count[0] - c0) / (time.perf_counter() - t0)
        stop.set()
        return statistics.median(ttfts), rate
    finally:
        srv.terminate()
        srv.wait()


res = {s: ([], []) for s in settings}
for r in range(rounds):
    for s in (settings if r % 2 == 0 else settings[::-1]):
        ttft, rate = one_run(s)
        res[s][0].append(ttft)
        res[s][1].append(rate)
        print("round %d spin %5s us: probe TTFT median %.1f ms, load %.0f tok/s"
              % (r, s, ttft * 1e3, rate), flush=True)
a, b = settings
ta, tb = statistics.median(res[a][0]), statistics.median(res[b][0])
ra, rb = statistics.median(res[a][1]), statistics.median(res[b][1])
print("spin %s us: TTFT %.1f ms, load %.0f tok/s" % (a, ta * 1e3, ra))
print("spin %s us: TTFT %.1f ms, load %.0f tok/s" % (b, tb * 1e3, rb))
print("ratio %s/%s: TTFT %.2fx, load tok/s %.2fx" % (b, a, tb / ta, rb / ra))
