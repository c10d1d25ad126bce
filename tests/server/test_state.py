"""The warm-restart state file (--state-dir) under faults: the disk filling while it is written
(a file-size limit, RLIMIT_FSIZE, which needs no privilege: EFBIG; and, as root, a full tmpfs:
ENOSPC), SIGKILL, a stale temporary file, a cut or garbage state file, a state directory that
is not there. In every case the previous file survives byte for byte or is replaced whole
(never half-written), no temporary file is left, the server logs one clear line, serves
throughout and exits 0.

usage: test_state.py MOED MODEL
"""

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import check, curl, finish, free_port  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(prefix="moed-state-")
# the store holding every expert: the hot set is every expert a request used
STORE = ["--expert-cache-mb", "100000", "--expert-prefetch", "0"]


class Moed:
    """moed with its output on a pipe (a log file would fall under RLIMIT_FSIZE too)."""

    def __init__(self, state_dir, fsize=None):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.lines = []

        def limit():
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        self.proc = subprocess.Popen(
            [moed, "-m", model, "--port", str(self.port), "--threads", "2", "--state-dir",
             state_dir] + STORE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=limit)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError("moed exited early:\n" + self.log())
            try:
                if curl(self, "GET", "/health", timeout=2)[0] == 200:
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError("moed not ready in 60s:\n" + self.log())

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.decode(errors="replace"))

    def log(self):
        return "".join(self.lines)

    def serve(self, prompts):
        for p in prompts:
            st, _, b = curl(self, "POST", "/v1/completions",
                            {"prompt": p, "max_tokens": 8, "temperature": 0})
            check(st == 200, "completion served", st, b[:200])

    def stop(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.reader.join(10)
        return rc


def valid_state(data):
    """Whether data is a whole hot-set file for this model: magic, shape, 'layer expert' lines,
    each ending in a newline."""
    text = data.decode("ascii", errors="replace")
    if not text.endswith("\n"):
        return False
    lines = text.split("\n")[:-1]
    if len(lines) < 3 or lines[0] != "moed-hot-experts 1":
        return False
    m = re.fullmatch(r"layers (\d+) experts (\d+) file-bytes (\d+)", lines[1])
    if not m or int(m.group(3)) != os.path.getsize(model):
        return False
    nl, ne = int(m.group(1)), int(m.group(2))
    for line in lines[2:]:
        p = line.split(" ")
        if len(p) != 2 or not (p[0].isdigit() and p[1].isdigit()) or int(p[0]) >= nl or \
                int(p[1]) >= ne:
            return False
    return True


def read(path):
    return open(path, "rb").read() if os.path.exists(path) else None


PROMPTS_A = ["The history of the city", "Once upon a time"]
PROMPTS_B = ["1, 2, 3, 4, 5,", "List three rivers:", "a b c d e f g h", "Dear diary, today"]

# ---- a clean shutdown writes a whole state file ----
d = os.path.join(tmp, "state")
os.makedirs(d)
hot, tmpf = os.path.join(d, "hot-experts"), os.path.join(d, "hot-experts.tmp")
srv = Moed(d)
srv.serve(PROMPTS_A)
check(srv.stop() == 0, "clean exit")
first = read(hot)
check(first and valid_state(first), "a clean shutdown writes a whole state file", first)
check(not os.path.exists(tmpf), "no temporary file left")
print("state file: %d bytes, %d experts" % (len(first or b""), (first or b"").count(b"\n") - 2))


def failed_save(state_dir, start_kw, errno_text, what):
    """A run whose save must fail: serves, logs one clear line, exits 0, the old file kept."""
    before = read(os.path.join(state_dir, "hot-experts"))
    srv = Moed(state_dir, **start_kw)
    check(re.search(r"warm start, reading [1-9]\d* hot experts", srv.log()),
          "%s: the previous state file is read at start" % what, srv.log()[-600:])
    srv.serve(PROMPTS_B)
    rc = srv.stop()
    log = srv.log()
    errs = [l for l in log.splitlines() if "cannot write the hot set" in l]
    check(rc == 0, "%s: the server exits 0 when the state file cannot be written" % what, rc,
          log[-800:])
    check(len(errs) == 1 and errno_text in errs[0] and " error " in errs[0],
          "%s: one error line naming the file and the cause" % what, errs, log[-800:])
    check(read(os.path.join(state_dir, "hot-experts")) == before,
          "%s: the previous state file is left byte for byte" % what)
    check(not os.path.exists(os.path.join(state_dir, "hot-experts.tmp")),
          "%s: no half-written temporary file left" % what, os.listdir(state_dir))
    if errs:
        print("%s: %s" % (what, errs[0].split(" error ", 1)[1]))


# ---- the disk fills while the state file is written: a file-size limit (EFBIG) ----
# 32 bytes: less than the file's first two lines, so the very first write fails
failed_save(d, {"fsize": 32}, "File too large", "RLIMIT_FSIZE 32 bytes")
# and a limit the write runs into part-way (a short write, then EFBIG)
failed_save(d, {"fsize": len(first) // 2}, "File too large",
            "RLIMIT_FSIZE %d bytes" % (len(first) // 2))

# ---- a full file system (ENOSPC): a tmpfs of two pages, as root ----
mnt = os.path.join(tmp, "small")
os.makedirs(mnt)
mounted = os.geteuid() == 0 and subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=8k,mode=0755", "tmpfs", mnt],
    capture_output=True).returncode == 0
if mounted:
    try:
        shutil.copy(hot, os.path.join(mnt, "hot-experts"))
        filler = os.path.join(mnt, "filler")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:  # take every page that is left
            while os.write(fd, b"x" * 512) > 0:
                pass
        except OSError:
            pass
        os.close(fd)
        failed_save(mnt, {}, "No space left on device", "a full tmpfs")
        # room again: the next shutdown replaces the file whole
        os.unlink(filler)
        srv = Moed(mnt)
        srv.serve(PROMPTS_B)
        check(srv.stop() == 0, "full tmpfs, then room: clean exit")
        after = read(os.path.join(mnt, "hot-experts"))
        check(after and valid_state(after), "with room again the state file is rewritten whole",
              after)
    finally:
        subprocess.run(["umount", mnt])
else:
    print("SKIP (part): a full tmpfs (ENOSPC) needs root and mount; the RLIMIT_FSIZE runs above "
          "cover the failed write")

# ---- SIGKILL: the state file is only written on a clean shutdown; it is left as it was ----
before = read(hot)
srv = Moed(d)
srv.serve(PROMPTS_B)
check(srv.stop(signal.SIGKILL) == -signal.SIGKILL, "killed")
check(read(hot) == before, "SIGKILL leaves the state file as it was")
check(not os.path.exists(tmpf), "SIGKILL leaves no temporary file")
srv = Moed(d)
check(re.search(r"warm start, reading [1-9]\d* hot experts", srv.log()),
      "after SIGKILL the restart reads the state file", srv.log()[-600:])
srv.serve(PROMPTS_A)
check(srv.stop() == 0, "restart after SIGKILL exits 0")
check(valid_state(read(hot) or b""), "and writes a whole state file")

# ---- a stale temporary file and a cut state file (a crash of an older version, an editor) ----
whole = read(hot)
open(tmpf, "wb").write(b"\x00garbage from an interrupted write" * 10)
open(hot, "wb").write(whole[:len(whole) * 2 // 3])  # ends inside a line
srv = Moed(d)
check("ready" in srv.log(), "a cut state file: the server starts", srv.log()[-600:])
srv.serve(PROMPTS_A)
check(srv.stop() == 0, "cut state file: clean exit")
check(valid_state(read(hot) or b""), "a cut state file is replaced whole", read(hot))
check(not os.path.exists(tmpf), "the stale temporary file is gone")

# ---- garbage in the state file: not used, said so, the server serves ----
open(hot, "wb").write(os.urandom(300))
srv = Moed(d)
warn = [l for l in srv.log().splitlines() if "hot set" in l and "not used" in l]
check(len(warn) == 1 and hot in warn[0], "a garbage state file: one line saying it is not used",
      srv.log()[-600:])
srv.serve(PROMPTS_A)
check(srv.stop() == 0, "garbage state file: clean exit")
check(valid_state(read(hot) or b""), "a garbage state file is replaced whole")

# ---- a state directory that does not exist: the start is cold, the save fails clearly ----
gone = os.path.join(tmp, "no-such-dir")
srv = Moed(gone)
srv.serve(PROMPTS_A)
rc = srv.stop()
errs = [l for l in srv.log().splitlines() if "cannot write the hot set" in l]
check(rc == 0 and len(errs) == 1 and "No such file or directory" in errs[0],
      "a missing state directory: one clear error line, exit 0", rc, errs, srv.log()[-600:])
check(not os.path.exists(gone), "and nothing created")

shutil.rmtree(tmp, ignore_errors=True)
finish()
