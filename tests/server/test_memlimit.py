"""A model larger than the memory the service may use, under a real cgroup v1 memory limit:
served through the expert store within the limit (never killed by the OOM killer), or, when
even the store's smallest budget cannot fit, refused at start with one clear line and exit 78
(EX_CONFIG: systemd does not restart it).

Needs root and a writable cgroup v1 memory controller (as on the machines TOOLCHAIN.md
describes); exits 77 (skipped) where it cannot make a cgroup with a limit, and for a
sanitizer build (its shadow memory and quarantine do not fit a small limit).

A model that fits, under a limit smaller than its KV pool: the pool (anonymous memory, unlike
the mapped file) is capped below the limit at start (before, the default model under 64 MiB
was OOM-killed once its 512 MiB pool had taken ~27,000 distinct prompt tokens; capped, 48,000
were served; that fill is too slow for a test, so the test checks the cap and a completion).

usage: test_memlimit.py MOED MOED_GGUF DEFAULT_MODEL
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import check, curl, finish, free_port  # noqa: E402

moed, moed_gguf, default_model = sys.argv[1], sys.argv[2], sys.argv[3]
MIB = 1 << 20


def skip(why):
    print("SKIP:", why)
    sys.exit(77)


if os.geteuid() != 0:
    skip("a memory cgroup needs root")
if "libasan" in subprocess.run(["ldd", moed], capture_output=True, text=True).stdout:
    skip("an ASan build does not fit a small memory limit (shadow memory, quarantine)")
own = None
for line in open("/proc/self/cgroup"):
    parts = line.rstrip("\n").split(":", 2)
    if len(parts) == 3 and "memory" in parts[1].split(","):
        own = parts[2]
root = "/sys/fs/cgroup/memory"
if own is None or not os.path.isfile(os.path.join(root, "memory.limit_in_bytes")):
    skip("no cgroup v1 memory controller at %s" % root)
parent = os.path.join(root, own.lstrip("/"))
if not os.path.isdir(parent):
    parent = root
cg = os.path.join(parent, "moed-test-%d" % os.getpid())
try:
    os.mkdir(cg)
    with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
        f.write(str(256 * MIB))
except OSError as e:
    if os.path.isdir(cg):
        os.rmdir(cg)
    skip("cannot make a memory cgroup under %s: %s" % (parent, e))

tmp = tempfile.mkdtemp(prefix="moed-memlimit-")


def cg_read(name):
    return open(os.path.join(cg, name)).read()


def set_limit(b):
    with open(os.path.join(cg, "memory.max_usage_in_bytes"), "w") as f:
        f.write("0")  # reset the peak
    with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
        f.write(str(b))


def oom_kills():
    m = re.search(r"^oom_kill (\d+)$", cg_read("memory.oom_control"), re.M)
    return int(m.group(1)) if m else 0


def uncache(path):
    """Drop the file's pages from the page cache, so what moed reads is charged to its cgroup
    (a page is charged to the cgroup that first brings it in)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def start(model, args=()):
    port = free_port()
    log = open(os.path.join(tmp, "moed-%d.log" % port), "w+")

    def enter():
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    p = subprocess.Popen([moed, "-m", model, "--port", str(port), "--threads", "2"] + list(args),
                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=enter)
    return p, port, log


class At:
    def __init__(self, port):
        self.base = "http://127.0.0.1:%d" % port


try:
    # 8 layers of 64 experts, 105 MiB of experts and 3 MiB of dense weights: larger than the
    # 64 MiB limit below, whose reserve (32 MiB for the process) leaves the store ~23 MiB
    model = os.path.join(tmp, "big.gguf")
    r = subprocess.run([moed_gguf, "gen", "--n-layer", "8", "--n-expert", "64",
                        "--n-expert-used", "2", "--n-embd", "256", "--n-head", "4",
                        "--n-head-kv", "2", "--head-dim", "64", "--n-ff-exp", "256",
                        "--n-vocab", "512", "--type", "q8_0", model], capture_output=True, text=True)
    check(r.returncode == 0, "model generated", r.stderr[-400:])
    size = os.path.getsize(model)

    # ---- served through the expert store within the limit (a 512-token context: its KV
    # pool is 4 MiB; 4096 tokens would take 32 MiB, refused below) ----
    limit = 64 * MIB
    uncache(model)
    set_limit(limit)
    kills0 = oom_kills()
    p, port, log = start(model, ["--ctx-size", "512"])
    ready = False
    for _ in range(600):
        if p.poll() is not None:
            break
        try:
            if curl(At(port), "GET", "/health", timeout=2)[0] == 200:
                ready = True
                break
        except Exception:
            pass
        time.sleep(0.1)
    log.seek(0)
    text = log.read()
    check(ready, "a %.0f MiB model under a %.0f MiB limit starts" % (size / MIB, limit / MIB),
          p.poll(), text[-800:])
    plan = [l for l in text.splitlines() if "experts: store" in l]
    check(plan and "cgroup v1" in plan[0] and "limit 64 MiB" in plan[0],
          "the start-up line names the store, the cgroup and its limit", plan, text[-800:])
    if plan:
        print(plan[0].split(" info ", 1)[-1])
    served = 0
    if ready:
        for i in range(6):
            st, _, b = curl(At(port), "POST", "/v1/completions",
                            {"prompt": "request %d: the quick brown fox" % i, "max_tokens": 32,
                             "temperature": 0.8, "seed": i, "ignore_eos": True}, timeout=120)
            check(st == 200, "completion %d served under the limit" % i, st, b[:200])
            served += st == 200
        m = curl(At(port), "GET", "/metrics")[2].decode()
        misses = re.search(r"^moed:expert_misses_total(\{[^}]*\})? (\S+)$", m, re.M)
        check(misses and float(misses.group(2)) > 0, "experts read through the store", m[-300:])
    alive = p.poll() is None
    anon = int(re.search(r"^rss (\d+)$", cg_read("memory.stat"), re.M).group(1))
    hwm = 0
    if alive:
        for line in open("/proc/%d/status" % p.pid):
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
        p.send_signal(signal.SIGTERM)
    rc = p.wait(60)
    check(alive and rc == 0, "alive after serving, exit 0 on SIGTERM (not killed)", alive, rc)
    check(oom_kills() == kills0, "no OOM kill in the cgroup", cg_read("memory.oom_control"))
    print("served %d completions; anonymous memory %.1f MiB, peak RSS %.1f MiB, limit %.0f MiB "
          "(page cache fills the rest and is reclaimed), %d OOM kills" % (
              served, anon / MIB, hwm / MIB, limit / MIB, oom_kills() - kills0))

    # ---- a model that fits, its 512 MiB KV pool capped below a 64 MiB limit ----
    limit = 64 * MIB
    set_limit(limit)
    p, port, log = start(default_model)
    ready = False
    for _ in range(600):
        if p.poll() is not None:
            break
        try:
            if curl(At(port), "GET", "/health", timeout=2)[0] == 200:
                ready = True
                break
        except Exception:
            pass
        time.sleep(0.1)
    log.seek(0)
    text = log.read()
    check(ready, "the default model under a 64 MiB limit starts", text[-800:])
    mm = [l for l in text.splitlines() if "experts: mmap" in l]
    kv = [l for l in text.splitlines() if "KV cache" in l]
    check(mm and "KV capped at 32 MiB" in mm[0], "the start-up line says the KV pool is capped",
          mm, text[-800:])
    check(kv and "(32.0 MiB," in kv[0], "the KV pool made is the capped one", kv)
    if ready:
        st, _, b = curl(At(port), "POST", "/v1/completions",
                        {"prompt": "hello", "max_tokens": 8}, timeout=120)
        check(st == 200, "a completion under the capped pool", st, b[:200])
        p.send_signal(signal.SIGTERM)
    check(p.wait(60) == 0, "capped pool: exit 0")
    check(oom_kills() == kills0, "capped pool: no OOM kill", cg_read("memory.oom_control"))
    if kv:
        print("fits, KV capped: %s" % kv[0].split(" info ", 1)[-1])

    # ---- too small for even the store's smallest budget: refused at start, exit 78 (before
    # this check such starts were OOM-killed at 40 and 48 MiB a few requests in) ----
    for limit, args, what in ((40 * MIB, ["--ctx-size", "512"], "40 MiB"),
                              (64 * MIB, [], "64 MiB with a 4096-token context")):
        set_limit(limit)
        p, port, log = start(model, args)
        try:
            rc = p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        log.seek(0)
        text = log.read()
        errs = [l for l in text.splitlines() if " error " in l]
        check(rc == 78, "%s: exit 78 (EX_CONFIG)" % what, rc, text[-800:])
        check(len(errs) == 1 and "cannot be served within the memory limit" in errs[0] and
              model in errs[0] and "raise the limit, lower ctx-size" in errs[0],
              "%s: one error line naming the model, the limit and the fix" % what, errs)
        check("ready" not in text, "%s: never ready" % what)
        check(oom_kills() == kills0, "%s: no OOM kill" % what, cg_read("memory.oom_control"))
        if errs:
            print("refused at %s: %s" % (what, errs[0].split(" error ", 1)[1]))
finally:
    for _ in range(50):
        try:
            os.rmdir(cg)
            break
        except OSError:
            time.sleep(0.1)
    shutil.rmtree(tmp, ignore_errors=True)
finish()
