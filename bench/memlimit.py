"""Memory-limited benchmark runs: a fresh cgroup v1 memory cgroup per run (page cache counted,
so a mapped file larger than the limit really pages from disk), the model's pages dropped from
the page cache before each run, and the disk's O_DIRECT bandwidth measured the way the expert
store reads (random expert-sized reads on several threads).

Shared by bench_experts.py and bench_expert_batching.py."""

import mmap
import os
import random
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


class MemCg:
    """A child memory cgroup of ours with a byte limit; None-like (falsy) when none can be
    made. preexec() moves the calling (child) process into it; stats() reads what it used."""

    def __init__(self, limit_mib, tag="moed-bench"):
        self.dir = None
        base = own_memcg()
        if not base:
            return
        d = os.path.join(base, "%s-%d-%d-%d" % (tag, os.getpid(), limit_mib,
                                                 int(time.monotonic() * 1000) % 100000))
        try:
            os.mkdir(d)
            with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit_mib * MIB))
            self.dir = d
        except OSError:
            pass

    def __bool__(self):
        return self.dir is not None

    def preexec(self):
        if self.dir:
            with open(os.path.join(self.dir, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def stats(self):
        """max_usage MiB and failcnt of the cgroup (0, 0 without one)."""
        if not self.dir:
            return 0.0, 0
        try:
            mx = int(open(os.path.join(self.dir, "memory.max_usage_in_bytes")).read())
            fc = int(open(os.path.join(self.dir, "memory.failcnt")).read())
            return mx / MIB, fc
        except OSError:
            return 0.0, 0

    def close(self):
        if not self.dir:
            return
        for _ in range(50):  # the last task may take a moment to leave
            try:
                with open(os.path.join(self.dir, "memory.force_empty"), "w") as f:
                    f.write("0")
            except OSError:
                pass
            try:
                os.rmdir(self.dir)
                break
            except OSError:
                time.sleep(0.1)
        self.dir = None


def usable():
    """Whether a memory cgroup can be made here."""
    cg = MemCg(4096, "moed-probe")
    ok = bool(cg)
    cg.close()
    return ok


def drop_file_cache(path):
    """Drop path's pages from the page cache (those no process maps)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    except OSError:
        pass
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def drop_caches(paths, everything=False):
    """Before a run: the model files' pages, or with everything the whole page cache
    (/proc/sys/vm/drop_caches; this machine's other users lose theirs too). Returns what was
    done, for the log."""
    if everything:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            return "page cache dropped"
        except OSError:
            pass
    for p in paths:
        drop_file_cache(p)
    return "model pages dropped"


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


def loadavg():
    return open("/proc/loadavg").read().split()[0]
