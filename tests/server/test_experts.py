"""The expert store through the server: greedy completions token-identical to the mapping at
several budgets on the default model and on a generated 64-expert model; the start-up line and
/metrics; a budget below one layer's active experts refused at start with a clear message; a
model file cut short under the server fails that request, the server keeps serving, and once the
file is whole again the same completions come back; with one expert cut from the file, of two
requests served together only the one that needs it fails; the device tier on the simulated
device gives the same completions and reports a device row of every per-tier series; the
cache filled at start (expert-fill) gives the same completions with fewer misses.

usage: test_experts.py MOED DEFAULT_MODEL MOED_GGUF"""

import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading

from harness import Server, call, check, curl, finish

moed, default_model, moed_gguf = sys.argv[1:4]
PROMPTS = ["The history of the city", "Once upon a time, in a land far away,",
           "1, 2, 3, 4, 5, 6, 7, 8,"]
# One engine step holds 16 tokens at most, so the smallest budget is one layer's experts for 16
# tokens (min(n_expert, 16 * n_used)).
BASE = ["--step-tokens", "16", "--max-seqs", "4", "--expert-prefetch", "0"]


def completions(srv):
    out = []
    for p in PROMPTS:
        st, _, doc = call(srv, "POST", "/v1/completions",
                          {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        check(st == 200, "completion 200", st, doc)
        out.append(doc["choices"][0]["text"] if st == 200 else None)
    return out


def metrics(srv):
    _, _, body = curl(srv, "GET", "/metrics")
    vals = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(moed:expert_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m:
            vals[m.group(1)] = float(m.group(3))
    return vals


def run(model, args):
    srv = Server(moed, model, BASE + args)
    try:
        out, m = completions(srv), metrics(srv)
    finally:
        srv.stop()
    return out, m, srv.logtext()


def budgets(model, fracs, label):
    """Reference on the mapping, then the store at each fraction of the experts' bytes."""
    ref, m, log = run(model, ["--expert-cache-mb", "-1"])
    check(m.get("moed:expert_store") == 0, label + ": mapping reported", m)
    check("experts: mmap" in log, label + ": start-up line names the mmap mode", log[-800:])
    full, m, log = run(model, ["--expert-cache-mb", "100000"])
    check(full == ref, label + ": store holding every expert: same completions", full, ref)
    found = re.search(r"experts: store, host cache \S+ MiB \((\d+) of (\d+) experts", log)
    check(found, label + ": start-up line names the store mode and budgets", log[-800:])
    if not found:
        return
    units = int(found.group(2))
    slot = m["moed:expert_cache_bytes"] / int(found.group(1))
    check(m.get("moed:expert_store") == 1 and m.get("moed:expert_misses_total", 0) > 0,
          label + ": store counters", m)
    for f in fracs:
        mb = f * units * slot / 1048576.0
        got, m, log = run(model, ["--expert-cache-mb", "%.4f" % mb])
        check(got == ref, "%s: %d%% of expert bytes: same completions" % (label, f * 100), got, ref)
        check(m.get("moed:expert_read_errors_total") == 0,
              "%s: %d%%: no read errors" % (label, f * 100), m)
        if f <= 0.25:  # three short prompts touch more than a quarter of the experts
            check(m.get("moed:expert_evictions_total", 0) > 0,
                  "%s: %d%%: evictions" % (label, f * 100), m)
        check(m.get("moed:expert_distinct_per_step", 0) > 0, label + ": distinct per step", m)
    # Pre-gating prefetch on (BASE turns it off): the same completions, and it guesses.
    mb = fracs[0] * units * slot / 1048576.0
    got, m, log = run(model, ["--expert-cache-mb", "%.4f" % mb, "--expert-prefetch", "1"])
    check(got == ref, "%s: prefetch on: same completions" % label, got, ref)
    check(m.get("moed:expert_predicted_total", 0) > 0 and
          0 < m.get("moed:expert_prefetch_accuracy", 0) <= 1 and "prefetch on" in log,
          "%s: prefetch accuracy reported" % label, m)
    return ref, units, slot


def tier_metrics(srv):
    """{(name, tier or on= label): value} of the moed:expert_* series."""
    _, _, body = curl(srv, "GET", "/metrics")
    vals = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(moed:expert_[a-z_]+)\{[^}]*(?:tier|on)="([a-z]+)"[^}]*\} ([0-9.e+-]+)$',
                     line)
        if m:
            vals[(m.group(1), m.group(2))] = float(m.group(3))
    return vals


def device_tier(model, ref, units, slot):
    """The device tier through the server on the simulated device: the same completions, the
    start-up line, and a tier="device" row of every per-tier series; an instant device serves
    hits, a 1 MB/s bus leaves every miss on the CPU."""
    for spec, fast in (("sim", True), ("sim:1", False)):
        mb = max(1, int(0.25 * units * slot / 1048576.0 + 1))
        srv = Server(moed, model, BASE + ["--device-expert-mb", str(mb), "--expert-device", spec])
        try:
            got = completions(srv)
            m = tier_metrics(srv)
        finally:
            srv.stop()
        log = srv.logtext()
        check(got == ref, "device tier (%s): same completions" % spec, got, ref)
        check(re.search(r"experts: store, .*device tier \d+ MiB on simulated device", log),
              "device tier (%s): start-up line names it" % spec, log[-900:])
        for name in ("hits_total", "misses_total", "read_bytes_total", "evictions_total",
                     "stall_seconds_total", "resident", "cache_bytes", "prefetch_issued_total",
                     "prefetch_used_total", "prefetch_wasted_bytes_total"):
            check(("moed:expert_" + name, "device") in m and ("moed:expert_" + name, "host") in m,
                  "device tier (%s): %s has a host and a device row" % (spec, name), m)
        check(m.get(("moed:expert_read_bytes_total", "device"), 0) > 0 and
              m.get(("moed:expert_cache_bytes", "device"), 0) >= slot,
              "device tier (%s): bytes uploaded, device memory used" % spec, m)
        dev = m.get(("moed:expert_device_misses_computed_total", "device"), -1)
        cpu = m.get(("moed:expert_device_misses_computed_total", "cpu"), -1)
        check(dev + cpu == m.get(("moed:expert_misses_total", "device")),
              "device tier (%s): every device miss computed somewhere" % spec, m)
        if fast:  # whether a miss is copied up depends on measured rates: not checked here
            check(m.get(("moed:expert_hits_total", "device"), 0) > 0,
                  "instant device: device hits", m)
        else:
            check(dev == 0 and cpu > 0, "1 MB/s bus: misses computed on the CPU", m)


def refused(model, mb):
    try:
        srv = Server(moed, model, BASE + ["--expert-cache-mb", "%.4f" % mb])
        srv.stop()
        check(False, "a budget below one layer's active experts is refused")
    except RuntimeError as e:
        msg = str(e)
        check("cannot set up the expert store" in msg and "raise expert-cache-mb" in msg,
              "refusal names the store and the fix", msg[-600:])


def warm_restart(model, mb, ref):
    """A clean shutdown writes the hot set to --state-dir; the next start reads it ahead, and the
    same completions then miss less."""
    d = tempfile.mkdtemp(prefix="moed-state-")
    try:
        args = ["--expert-cache-mb", "%.4f" % mb, "--state-dir", d]
        cold, m_cold, log = run(model, args)
        check("cold start" in log and "hot set written" in log,
              "first start is cold and a clean shutdown writes the hot set", log[-800:])
        check(os.path.exists(os.path.join(d, "hot-experts")), "hot-experts file written")
        warm, m_warm, log = run(model, args)
        check(re.search(r"warm start, reading [1-9]\d* hot experts", log),
              "second start reads the hot set", log[-800:])
        check(warm == ref and cold == ref, "warm restart: same completions", warm, ref)
        check(m_warm.get("moed:expert_misses_total", 1e9) < m_cold.get("moed:expert_misses_total", 0),
              "warm restart: fewer misses", m_warm, m_cold)
    finally:
        shutil.rmtree(d)


def fill(model, ref):
    """expert-fill (on by default) reads experts into the empty cache before the first request:
    with every expert fitting, the requests then miss far less than with it off, and complete
    the same."""
    got, m_off, log = run(model, ["--expert-cache-mb", "100000", "--expert-fill", "0"])
    check(got == ref and "filling the cache" not in log, "fill off: same completions, no fill",
          got, log[-600:])
    srv = Server(moed, model, BASE + ["--expert-cache-mb", "100000"])
    try:
        found = re.search(r"filling the cache, reading (\d+) experts", srv.logtext())
        check(found, "fill on: the start-up log says how many experts it reads",
              srv.logtext()[-800:])
        n = int(found.group(1)) if found else 0
        got, m_on = completions(srv), metrics(srv)
    finally:
        srv.stop()
    check(got == ref, "fill on: same completions", got, ref)
    check(m_on.get("moed:expert_misses_total", 1e9) < m_off.get("moed:expert_misses_total", 0),
          "fill on: fewer misses than off", m_on, m_off)
    check(n > 0 and m_on.get("moed:expert_resident", 0) >= n,
          "fill on: the %d experts read at start stay resident" % n, m_on)


def bad_policy(model):
    try:
        srv = Server(moed, model, BASE + ["--expert-cache-mb", "100", "--expert-policy", "fifo"])
        srv.stop()
        check(False, "an unknown expert-policy is refused")
    except RuntimeError as e:
        check("unknown expert-policy 'fifo'" in str(e), "unknown policy named", str(e)[-400:])


def experts_last(src, dst, name):
    """Copy GGUF src to dst with tensor `name`'s data moved to the end of the file, so cutting
    the file short takes only (some of) that tensor's experts away."""
    data = open(src, "rb").read()
    pos = 8
    n_t, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16
    sizes = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}
    align = 32

    def skip_val(t, p):
        if t == 8:
            n, = struct.unpack_from("<Q", data, p)
            return p + 8 + n
        if t == 9:
            et, n = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(n):
                p = skip_val(et, p)
            return p
        return p + sizes[t]

    for _ in range(n_kv):
        kl, = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + kl].decode()
        t, = struct.unpack_from("<I", data, pos + 8 + kl)
        vpos = pos + 12 + kl
        if key == "general.alignment":
            align, = struct.unpack_from("<I", data, vpos)
        pos = skip_val(t, vpos)
    infos = []
    for _ in range(n_t):
        nl, = struct.unpack_from("<Q", data, pos)
        tname = data[pos + 8:pos + 8 + nl].decode()
        nd, = struct.unpack_from("<I", data, pos + 8 + nl)
        off_pos = pos + 8 + nl + 4 + 8 * nd + 4
        off, = struct.unpack_from("<Q", data, off_pos)
        infos.append([tname, off_pos, off])
        pos = off_pos + 8
    start = (pos + align - 1) // align * align
    by_off = sorted(infos, key=lambda i: i[2])
    ends = [i[2] for i in by_off[1:]] + [len(data) - start]
    size = {i[0]: e - i[2] for i, e in zip(by_off, ends)}
    order = [i for i in by_off if i[0] != name] + [i for i in by_off if i[0] == name]
    out = bytearray(data[:start])
    body = bytearray()
    for i in order:
        struct.pack_into("<Q", out, i[1], len(body))
        if i[0] == name:
            tail_off = start + len(body)
        body += data[start + i[2]:start + i[2] + size[i[0]]]
    open(dst, "wb").write(bytes(out + body))
    return tail_off, size[name]


def truncated(model, ref, n_layer):
    d = tempfile.mkdtemp(prefix="moed-cut-")
    try:
        cut = os.path.join(d, "cut.gguf")
        off, size = experts_last(model, cut, "blk.%d.ffn_down_exps.weight" % (n_layer - 1))
        keep = off + size // 4  # the last layer's experts past the first quarter are gone
        tail = open(cut, "rb").read()[keep:]
        srv = Server(moed, cut, BASE + ["--expert-cache-mb", "100000"])
        try:
            os.truncate(cut, keep)
            st, _, doc = call(srv, "POST", "/v1/completions",
                              {"prompt": PROMPTS[0] + " and of its people, told from the start",
                               "max_tokens": 8, "temperature": 0})
            check(st >= 500, "a file cut short fails the request", st, doc)
            m = metrics(srv)
            check(m.get("moed:expert_read_errors_total", 0) > 0, "read errors counted", m)
            st, _, _ = curl(srv, "GET", "/health")
            check(st == 200, "the server still serves", st)
            with open(cut, "r+b") as f:
                f.seek(keep)
                f.write(tail)
            got = completions(srv)
            check(got == ref, "whole again: the same completions", got, ref)
            check(srv.proc.poll() is None, "the server never exited")
        finally:
            srv.stop()
        check("cannot read expert" in srv.logtext(), "the failed read is logged")
    finally:
        shutil.rmtree(d)


def layer_use(trace, layer):
    """{request id: set of experts its fed tokens used at layer} from a routing trace."""
    use = {}
    for line in open(trace):
        if line.startswith("#") or line.startswith("p "):
            continue  # comments, and pre-gating's predictions
        f = line.split()
        if int(f[1]) == layer:
            k = (len(f) - 4) // 2
            use.setdefault(int(f[2]), set()).update(int(x) for x in f[4:4 + k])
    return use


def partial_failure(model, n_layer, n_expert):
    """The last experts of the last layer cut from the file: of two requests served in the same
    steps, the one whose tokens need one of them fails, the other completes with the text it
    gets from the whole file, and the server keeps serving."""
    d = tempfile.mkdtemp(prefix="moed-part-")
    try:
        cut = os.path.join(d, "cut.gguf")
        off, size = experts_last(model, cut, "blk.%d.ffn_down_exps.weight" % (n_layer - 1))
        trace = os.path.join(d, "r.trace")
        cands = ["Item %d of the list:" % i for i in range(12)]
        srv = Server(moed, cut, BASE + ["--expert-cache-mb", "100000", "--trace-routing", trace])
        texts = {}
        try:
            for p in cands:
                st, _, doc = call(srv, "POST", "/v1/completions",
                                  {"prompt": p, "max_tokens": 8, "temperature": 0,
                                   "ignore_eos": True})
                check(st == 200, "reference completion", st, doc)
                texts[p] = doc["choices"][0]["text"] if st == 200 else None
        finally:
            srv.stop()
        use = layer_use(trace, n_layer - 1)
        ids = sorted(use)  # requests in the order they were sent
        check(len(ids) == len(cands), "one traced request per prompt", len(ids))
        # Cutting the tensor short takes its last experts away: from the highest one a request
        # used, so that request needs a lost expert and those below it do not.
        top = {p: max(use[i]) for p, i in zip(cands, ids)}
        gone = max(top.values())
        needs = [p for p in cands if top[p] >= gone]
        clean = [p for p in cands if top[p] < gone]
        check(needs and clean, "prompts that need expert %d and prompts that do not" % gone,
              top)
        if not (needs and clean):
            return
        srv = Server(moed, cut, BASE + ["--expert-cache-mb", "100000"])
        try:
            os.truncate(cut, off + size * gone // n_expert)  # the loader checks sizes
            res = {}

            def one(p):
                res[p] = call(srv, "POST", "/v1/completions",
                              {"prompt": p, "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True})
            ts = [threading.Thread(target=one, args=(p,)) for p in (needs[0], clean[0])]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            st, _, doc = res[needs[0]]
            check(st >= 500 and "error" in doc, "the request needing the lost expert fails",
                  st, doc)
            st, _, doc = res[clean[0]]
            check(st == 200 and doc["choices"][0]["text"] == texts[clean[0]],
                  "the request beside it completes with its text", st, doc, texts[clean[0]])
            st, _, doc = call(srv, "POST", "/v1/completions",
                              {"prompt": clean[-1], "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True})
            check(st == 200 and doc["choices"][0]["text"] == texts[clean[-1]],
                  "and the server keeps serving", st, doc)
            check(srv.proc.poll() is None, "the server never exited")
        finally:
            srv.stop()
        check("cannot be read" in srv.logtext() and "the other requests go on" in srv.logtext(),
              "the failed request is logged", srv.logtext()[-800:])
    finally:
        shutil.rmtree(d)


# The default model: 4 layers x 16 experts, 2 used; a 16-token step may need all 16 of a layer
# (25% of the experts' bytes), so 10% is below the smallest budget and refused.
r = budgets(default_model, [0.25, 0.5], "default")
if r:
    ref, units, slot = r
    refused(default_model, 0.10 * units * slot / 1048576.0)
    bad_policy(default_model)
    truncated(default_model, ref, 4)
    warm_restart(default_model, 0.5 * units * slot / 1048576.0, ref)
    device_tier(default_model, ref, units, slot)

# A generated many-expert model: 8 layers x 64 experts, 2 used: a step needs 32 of 512 (6.25%).
d = tempfile.mkdtemp(prefix="moed-moe64-")
try:
    gen = os.path.join(d, "moe64.gguf")
    subprocess.run([moed_gguf, "gen", "--type", "q8_0", "--seed", "9", "--n-layer", "8",
                    "--n-embd", "128", "--head-dim", "32", "--n-ff-exp", "256", "--n-expert", "64",
                    "--n-expert-used", "2", "--n-vocab", "512", gen], check=True,
                   stdout=subprocess.DEVNULL)
    r = budgets(gen, [0.1, 0.5], "64 experts")
    if r:
        fill(gen, r[0])
    partial_failure(gen, 8, 64)
finally:
    shutil.rmtree(d)
finish()
