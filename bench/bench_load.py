#!/usr/bin/python3
"""Load through nginx, to and past saturation: starts REPLICAS moed replicas on the default
model (127.0.0.1, free ports) with a small batch and queue each, nginx in front of them with
conf/nginx-moed.conf, and runs bench/loadgen.mjs at rising concurrency and back down to 1
(recovery). Prints loadgen's table (throughput, TTFT and inter-token p50/p99, refusal
latency, answers by status), then each replica's counters.

usage: bench_load.py MOED [--replicas 2] [--max-seqs 4] [--max-queue 4]
                          [--levels 1,2,4,8,16,32,64,1] [--seconds 8] [--max-tokens 64]
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "server"))
from nginx_run import NGINX, start_nginx  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("--replicas", type=int, default=2)
ap.add_argument("--max-seqs", default="4")
ap.add_argument("--max-queue", default="4")
ap.add_argument("--levels", default="1,2,4,8,16,32,64,1")
ap.add_argument("--seconds", default="8")
ap.add_argument("--max-tokens", default="64")
a = ap.parse_args()
if not NGINX or not shutil.which("node"):
    sys.exit("bench_load: needs nginx and node")


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_health(port):
    for _ in range(300):
        r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time",
                            "2", "http://127.0.0.1:%d/health" % port], capture_output=True,
                           text=True)
        if r.stdout == "200":
            return
        time.sleep(0.1)
    sys.exit("bench_load: replica on %d not ready" % port)


tmp = tempfile.mkdtemp(prefix="moed-load-")
reps, ports, ng = [], [], None
try:
    for i in range(a.replicas):
        port = free_port()
        log = open(os.path.join(tmp, "moed-%d.log" % i), "w")
        reps.append(subprocess.Popen([a.moed, "--port", str(port), "--threads", "1",
                                      "--max-seqs", a.max_seqs, "--max-queue", a.max_queue,
                                      "--log-level", "warn"], stdout=log,
                                     stderr=subprocess.STDOUT))
        ports.append(port)
    for p in ports:
        wait_health(p)
    nport = free_port()
    os.makedirs(os.path.join(tmp, "nginx"))
    ng = start_nginx(os.path.join(tmp, "nginx"), nport, ports)
    print("bench_load: %d replicas (max-seqs %s, max-queue %s, 1 thread each) behind nginx "
          "%s; nproc %d, load average %s" % (a.replicas, a.max_seqs, a.max_queue,
                                             NGINX, os.cpu_count(),
                                             open("/proc/loadavg").read().split()[0]))
    sys.stdout.flush()
    subprocess.run(["node", os.path.join(HERE, "loadgen.mjs"), "http://127.0.0.1:%d" % nport,
                    "--levels", a.levels, "--seconds", a.seconds, "--max-tokens", a.max_tokens],
                   check=True)
    for i, p in enumerate(ports):
        m = subprocess.run(["curl", "-s", "http://127.0.0.1:%d/metrics" % p],
                           capture_output=True, text=True).stdout
        codes = re.findall(r'^moed:http_requests_total\{code="(\d+)"\} (\d+)', m, re.M)
        print("replica %d: responses by status %s" % (i, " ".join("%s:%s" % c for c in codes)))
finally:
    if ng:
        ng.terminate()
        ng.wait(10)
    for r in reps:
        r.send_signal(signal.SIGTERM)
        r.wait(30)
    shutil.rmtree(tmp, ignore_errors=True)
