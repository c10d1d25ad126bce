"""systemd integration without systemd: the sd_notify datagrams (STATUS while loading, READY,
STOPPING, watchdog cadence) on a listener at $NOTIFY_SOCKET, socket activation with an
inherited listening socket ($LISTEN_FDS/$LISTEN_PID), and the units' offline checks.

usage: test_systemd.py MOED MODEL SOURCE_ROOT
"""

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import FAILS, Server, call, check, finish, free_port  # noqa: E402

moed, model, root = sys.argv[1], sys.argv[2], sys.argv[3]
tmp = tempfile.mkdtemp(prefix="moed-systemd-")

# ---- notifications: a datagram listener where systemd's would be ----
WD_USEC = 400000
path = os.path.join(tmp, "notify")
ls = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
ls.bind(path)
ls.settimeout(0.05)
got = []  # (time, message)
# Read continuously, as systemd does: a sender blocks when the datagram queue is full (the
# kernel's default queue is 10 datagrams deep).
reading = True


def reader():
    while reading:
        try:
            m = ls.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            break
        got.append((time.time(), m.decode()))


rt = threading.Thread(target=reader, daemon=True)
rt.start()


def drain(until):
    time.sleep(max(0.0, until - time.time()))


srv = Server(moed, model, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(WD_USEC)})
t_ready = time.time()
drain(time.time() + 2.5)
st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
check(st == 200, "serving with a notify socket", st, d)
rc = srv.stop(signal.SIGTERM)
drain(time.time() + 0.5)
check(rc == 0, "exit 0 after SIGTERM", rc)
msgs = [m for _, m in got]
fields = []  # (index, key, value) in order
for i, m in enumerate(msgs):
    for line in m.split("\n"):
        k, _, v = line.partition("=")
        fields.append((i, k, v))
status = [v for _, k, v in fields if k == "STATUS"]
print("STATUS lines:", status)
ready = [i for i, k, v in fields if k == "READY" and v == "1"]
stopping = [i for i, k, v in fields if k == "STOPPING" and v == "1"]
check(len(ready) == 1, "one READY=1", msgs[:20])
check(len(stopping) == 1, "one STOPPING=1", msgs[-5:])
check(status and status[0].startswith("loading model"), "first STATUS says the model is loading",
      status[:2])
pcts = [int(m.group(1)) for m in (re.match(r"loading weights\s+(\d+)%", s) for s in status) if m]
check(len(pcts) >= 2 and pcts == sorted(pcts) and pcts[-1] == 100,
      "STATUS loading weights N% rising to 100%", pcts)
first_load = min(i for i, k, v in fields if k == "STATUS" and v.startswith("loading"))
last_load = max(i for i, k, v in fields if k == "STATUS" and v.startswith("loading"))
if ready and stopping:
    check(first_load < ready[0] < stopping[0], "order: loading, READY, STOPPING",
          first_load, ready, stopping)
    check(last_load < ready[0], "no loading STATUS after READY")
    check(any(k == "STATUS" and v == "serving" for i, k, v in fields if i == ready[0]),
          "READY=1 comes with STATUS=serving", msgs[ready[0]])
    check(any(k == "STATUS" and v.startswith("draining") for i, k, v in fields
              if i == stopping[0]), "STOPPING=1 comes with STATUS=draining", msgs[stopping[0]])
# watchdog: pings at half the interval, each well within it
wd = [t for t, m in got if "WATCHDOG=1" in m.split("\n")]
gaps = [b - a for a, b in zip(wd, wd[1:])]
print("watchdog pings: %d, gaps (s): %s" % (len(wd), " ".join("%.3f" % g for g in gaps)))
check(len(wd) >= 4, "watchdog pings while serving", len(wd))
half = WD_USEC / 2e6
check(gaps and all(half * 0.5 < g < WD_USEC / 1e6 for g in gaps),
      "every watchdog gap between %.2fs and the %.2fs deadline" % (half * 0.5, WD_USEC / 1e6), gaps)
if gaps:
    gaps.sort()
    med = gaps[len(gaps) // 2]
    check(abs(med - half) < 0.05, "median watchdog gap is half the interval", med)
# a WATCHDOG_PID that is not ours: no pings
got.clear()
srv = Server(moed, model, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(WD_USEC),
                               "WATCHDOG_PID": "1"})
drain(time.time() + 1.0)
srv.stop()
check(not any("WATCHDOG=1" in m for _, m in got), "no pings for another process's watchdog")
reading = False
rt.join()
ls.close()

# ---- socket activation: the listening socket is inherited as descriptor 3 ----
lsock = socket.socket()
lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lsock.bind(("127.0.0.1", 0))
lsock.listen(64)
port = lsock.getsockname()[1]
# the configured port is taken: moed must not try to bind it
blocker = socket.socket()
blocker.bind(("127.0.0.1", 0))
blocker.listen(1)
busy_port = blocker.getsockname()[1]


def activated(pid_expr="$$", fd=None):
    """Start moed the way systemd does: socket on fd 3, LISTEN_FDS=1, LISTEN_PID its pid."""
    # a copy numbered 5..9 (sh takes one digit), so "3<&N N<&-" cannot close what it made
    fd = fcntl.fcntl(lsock.fileno() if fd is None else fd, fcntl.F_DUPFD, 5)
    log = open(os.path.join(tmp, "act.log"), "w+")
    script = ('LISTEN_FDS=1 LISTEN_PID=%s exec "$0" "$@" 3<&%d %d<&-' % (pid_expr, fd, fd))
    p = subprocess.Popen(["sh", "-c", script, moed, "-m", model, "--threads", "2", "--port",
                          str(busy_port)], pass_fds=(fd,), stdout=log, stderr=subprocess.STDOUT)
    os.close(fd)
    return p, log


def get_health(port, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                  "--max-time", "2", "http://127.0.0.1:%d/health" % port],
                                 capture_output=True, text=True).stdout
            if out == "200":
                return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


class Fake:
    def __init__(self, port):
        self.base = "http://127.0.0.1:%d" % port


p, log = activated()
try:
    check(get_health(port), "serves on the inherited socket")
    st, h, d = call(Fake(port), "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    check(st == 200, "completion through the inherited socket", st, d)
    log.seek(0)
    text = log.read()
    check("socket passed by the service manager" in text, "log says socket activation", text[-400:])
finally:
    p.send_signal(signal.SIGTERM)
    rc = p.wait(30)
check(rc == 0, "activated server drains and exits 0", rc)
if FAILS:
    finish()
# While no moed runs, the socket (held here, as systemd holds it) queues clients; the next
# instance answers them: a restart refuses nobody.
c = socket.create_connection(("127.0.0.1", port), timeout=30)
c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
p, log = activated()
try:
    r = b""
    while True:
        b = c.recv(4096)
        if not b:
            break
        r += b
    # answered, not refused: 200, or 503 + Retry-After while the model is still loading
    check(r.startswith(b"HTTP/1.1 200") or
          (r.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After:" in r),
          "a client queued during the restart gets an answer", r[:200])
    check(get_health(port), "the restarted instance serves")
finally:
    c.close()
    p.send_signal(signal.SIGTERM)
    check(p.wait(30) == 0, "second activated instance exits 0")

# LISTEN_PID of another process: ignored, moed binds its own port
own = free_port()
log = open(os.path.join(tmp, "other.log"), "w+")
hi = fcntl.fcntl(lsock.fileno(), fcntl.F_DUPFD, 5)
p = subprocess.Popen(["sh", "-c", 'LISTEN_FDS=1 LISTEN_PID=1 exec "$0" "$@" 3<&%d %d<&-'
                      % (hi, hi), moed, "-m", model, "--threads", "2",
                      "--port", str(own)], pass_fds=(hi,), stdout=log,
                     stderr=subprocess.STDOUT)
os.close(hi)
try:
    check(get_health(own), "LISTEN_PID not ours: binds its own port")
finally:
    p.send_signal(signal.SIGTERM)
    p.wait(30)
# descriptor 3 that is not a listening socket: a clear error, exit 1
with open(os.path.join(tmp, "plain"), "w") as f:
    p, log = activated(fd=f.fileno())
    rc = p.wait(30)
log.seek(0)
text = log.read()
check(rc == 1 and "not a listening stream socket" in text, "bad inherited fd: clear error, exit 1",
      rc, text[-300:])
lsock.close()
blocker.close()

# ---- the units: verify silently, security exposure at most 1.6 ----
sa = shutil.which("systemd-analyze")
if sa:
    d = os.path.join(tmp, "units")
    os.makedirs(d)
    for u in ("moed.service", "moed.socket"):
        text = open(os.path.join(root, "systemd", u)).read().replace("/usr/bin/moed",
                                                                     os.path.abspath(moed))
        open(os.path.join(d, u), "w").write(text)
    units = [os.path.join(d, u) for u in ("moed.socket", "moed.service")]
    r = subprocess.run([sa, "verify", "--man=no"] + units, capture_output=True, text=True)
    err = "\n".join(l for l in r.stderr.splitlines()
                    if "User=moed" not in l and "user moed" not in l.lower())
    check(r.returncode == 0 and not err.strip(), "systemd-analyze verify of both units is silent",
          r.returncode, r.stderr)
    for u in units:
        r = subprocess.run([sa, "security", "--offline=yes", u], capture_output=True, text=True)
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
        score = float(m.group(1)) if m else None
        print("%s: systemd-analyze security exposure %s" % (os.path.basename(u), score))
        check(score is not None and score <= 1.6, "%s exposure <= 1.6" % os.path.basename(u),
              score, r.stdout[-300:], r.stderr[-300:])
else:
    print("note: systemd-analyze missing, units not checked")
shutil.rmtree(tmp, ignore_errors=True)
finish()
