#!/usr/bin/python3
"""Speculative decoding against plain decode on one model, through the real server, and
llama.cpp's server with its own speculation on the same file, side by side.

Starts moed on MODEL (with --draft-model when given) and drives it over HTTP with S concurrent
streams, each request choosing its drafter with the "speculative" object, so every drafter
runs in the same process; with --llama DIR (llama.cpp's binaries, never part of the project;
or MOED_LLAMA_CPP) also one llama-server per speculation type (none, ngram-simple, and
draft-simple with -md DRAFT, each at llama.cpp's own settings unless a type says TYPE:N, its
--spec-draft-n-max), started once with -np S and kept for the stream count. The
configurations alternate within each round (the order rotates round by round; the round's
prompts are put into every server's prefix cache first, so that none prefills in them), so the
machine's noise hits them alike. Every engine gets the same prompt as token ids (moed's chat
rendering, /tokenize), at /v1/completions (moed) and /completion (llama-server).

Workloads (64 tokens at most by default):
  verses   "Quote <book> <c>:1-8." greedy: the model quotes verses it memorised, and so do its
           draft and its one-expert self (long, right drafts for the draft model and self)
  prompt   the same request with the model's own quotation of those verses pasted before it:
           text that repeats the prompt (long, right drafts for n-gram lookup)
  free     "Tell me about <topic>." at temperature 0.8, top_p 0.95, fixed seeds
  loop     the verses request, greedy, for --loop-tokens (256) tokens: these small models
           quote a few verses, then fall into a phrase they repeat to the end (text that
           repeats itself: long, right drafts for n-gram lookup; not among the defaults)

Printed per (workload, streams, configuration): generated tokens/s (median over rounds) and
their ratio to plain decode of the same engine (median of per-round ratios); the same ratio in
tokens per CPU-second of the server process (robust where other processes share the cores:
what time-sharing takes shows in wall time, not in CPU time); for moed the acceptance rate,
the mean accepted length (tokens per verifying step) and the distinct experts per MoE layer of
a verifying step from /metrics; and the cost-model bound for that acceptance:

    bound = max over k <= L of  (f (1 + a + ... + a^k) + (1 - f)) * t(S)
                                 / (f (t(S + S k) + k r(S)) + (1 - f) t(S))

t(n): the time of a decode step of n tokens (moed-bench -v on the model, the median wall time:
it runs before the timed runs, on an otherwise quiet machine, so this is the step's critical
path, what the controller measures; n = S (1 + k) for k up to K = --max-k, measured for each
stream count S among its own sizes), r(S): one draft round for S sequences (the draft model's
t(S) by moed-bench -v on it; for self the model's t(S) scaled by the draft pass's bytes over
the step's, one expert per token; 0 for n-gram lookup), a: the measured acceptance rate, f: the
share of the decoding sequence-steps in which the drafter had a proposal and L its mean length
(/metrics: proposal steps over sequence steps, proposed tokens over proposal steps; a model
drafter proposes in every step, the n-gram lookup only where it finds a match: most of its
steps decode plainly, whatever the controller does). The column "prop" prints f. For a model
drafter a is taken as (accepted + 1) / (drafted + 2), 0 with no drafts (the column "accept"
prints the plain rate): where the controller verified only a probe or two, the plain rate of
a handful of tokens would make the bound whatever those few happened to be.

For the n-gram lookup the bound is no such average: its drafts hold in runs (a loop's
repeats, all right; elsewhere, mostly wrong), which an i.i.d. acceptance misstates. Its
bounds come from the outputs themselves (return_token_ids): at each position the lookup's
real proposal and its class (engine/spec.c, redone here), and how many of its tokens the
output then repeats, h. A step that drafts k tokens there emits 1 + min(h, k) and costs
t(S (1 + k)) / S per sequence (a step's other sequences drafting alike); plain decode costs
t(S) / S per token. Over the n tokens of every output:

    bound  = plain time / the least time of a policy that drafts a fixed k per class
             (the best k of each class, by coordinate descent): what the acceptance the
             controller can know (per class) allows
    oracle = plain time / the least time of an oracle that knows h at every position and
             drafts exactly what holds, where it pays (dynamic programming): what no
             controller of these proposals can beat
    alone  = the bound again, with each sequence drafting alone in its step, the others
             plain: k drafts cost the step's growth t(S + k) - t(S) (t linear in n between
             the measured sizes), where "bound" charges t(S (1 + k)) / S. A step's time
             grows less per token the more tokens it has (they share experts), so drafts
             that come together cost each sequence less than drafts that come alone; with
             staggered streams the lookup's proposals come at each sequence's own times.
             At S = 1 the two are the same.

(medians over rounds; a "#   ... by round" line under the n-gram row pairs each round's ratio
with that round's bound, since each round is another prompt). Greedy
outputs (and seeded n-gram ones) are checked equal to plain decode's. --svg FILE draws tok/s
against streams per configuration, one panel per workload.

usage: bench_spec.py MOED MODEL [--draft FILE] [--streams 1,4,16] [--rounds 2] [--threads 2]
                     [--workloads verses,prompt,free] [--drafters off,ngram,draft,self]
                     [--llama DIR] [--llama-types none,ngram-simple,draft-simple]
                     [--max-tokens 64] [--loop-tokens 256] [--svg FILE] [--no-bound]
                     [--stagger] [--start-gap MS]
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
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("model")
ap.add_argument("--draft")
ap.add_argument("--streams", default="1,4,16")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--loop-tokens", type=int, default=256, help="max_tokens of the loop workload")
ap.add_argument("--max-k", type=int, default=32)
ap.add_argument("--per-stream", type=int, default=1, help="requests per stream and run")
ap.add_argument("--workloads", default="verses,prompt,free")
ap.add_argument("--drafters", default=None)
ap.add_argument("--llama", default=os.environ.get("MOED_LLAMA_CPP"))
ap.add_argument("--llama-types", default=None,
                help="llama.cpp speculation types to run, each TYPE or TYPE:N (N: its "
                "--spec-draft-n-max, the draft model's tokens per step; without it llama.cpp's "
                "own default, 3 in the build measured; ngram-simple drafts its m-gram, 48, "
                "whatever N) (default: none,ngram-simple and, with --draft, draft-simple)")
ap.add_argument("--svg")
ap.add_argument("--no-bound", action="store_true")
ap.add_argument("--stagger", action="store_true",
                help="stream j's first request is j/S shorter: the streams end apart (they "
                "still start together: --start-gap)")
ap.add_argument("--start-gap", type=float, default=0.0, metavar="MS",
                help="stream j's first request starts j*MS milliseconds after the round's start "
                "(0: all at once; then streams quoting verses decode the same positions in "
                "lockstep, and share experts a step that breaks the lockstep does not)")
ap.add_argument("--args", default="", help="more arguments for moed (e.g. '--device cuda'; "
                "the bound is from CPU step times, so add --no-bound on a device)")
args = ap.parse_args()

drafters = (args.drafters or ("off,ngram,draft,self" if args.draft else "off,ngram,self")).split(",")
streams = [int(x) for x in args.streams.split(",")]
workloads = args.workloads.split(",")
REFS = ["Genesis 1", "John 1", "Psalms 23", "Exodus 20", "Matthew 5", "Romans 8", "Isaiah 40",
        "Luke 2", "Proverbs 3", "Acts 2", "Mark 4", "Daniel 3", "Job 38", "Ruth 1", "Genesis 2",
        "John 3"]
TOPICS = ["the sea", "a king and his sons", "the harvest", "a long journey", "the temple",
          "wisdom", "the desert", "a shepherd", "the river", "the night sky", "a city wall",
          "bread and wine", "the mountains", "a storm", "the morning", "a great feast"]
LLAMA_TYPES = (args.llama_types.split(",") if args.llama_types else
               ["none", "ngram-simple"] + (["draft-simple"] if args.draft else []))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def request(port, method, path, body=None, timeout=1800):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"})
    r = c.getresponse()
    d = r.read()
    c.close()
    return r.status, d


def cpu_seconds(pid):
    """utime + stime of a process, in seconds (/proc/PID/stat)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Srv:
    def __init__(self, cmd, name):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-spec-%s-" % name,
                                               suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd + ["--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while True:
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.log.seek(0)
                sys.exit("%s did not start:\n%s" % (cmd[0], self.log.read()[-3000:]))
            time.sleep(0.3)

    def cpu(self):
        return cpu_seconds(self.proc.pid)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


servers = []
import atexit, signal  # noqa: E401,E402
atexit.register(lambda: [s.stop() for s in servers])
signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))

moed_cmd = [args.moed, "-m", args.model, "--threads", str(args.threads), "--spec", "off",
            "--spec-k", str(args.max_k), "--max-seqs", str(max(streams)), "--ctx-size", "1024"]
if args.draft:
    moed_cmd += ["--draft-model", args.draft]
moed_cmd += args.args.split()
moed = Srv(moed_cmd, "moed")
servers.append(moed)


MKEYS = ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_verify_steps_total",
         "spec_emitted_tokens_total", "spec_verify_layer_passes_total",
         "spec_verify_distinct_experts_total", "spec_sequence_steps_total",
         "spec_proposal_steps_total", "spec_proposed_tokens_total")


def metrics():
    b = request(moed.port, "GET", "/metrics")[1].decode()
    out = {}
    for k in MKEYS:
        m = re.search(r"^moed:%s(\{[^}]*\})? (\S+)$" % k, b, re.M)
        out[k] = float(m.group(2)) if m else 0.0
    return out


def tokenize(content):
    st, d = request(moed.port, "POST", "/tokenize",
                    {"messages": [{"role": "user", "content": content}]})
    if st != 200:
        sys.exit("tokenize: %d %s" % (st, d[:200]))
    return json.loads(d)["tokens"]


def moed_complete(ids, drafter, temp, seed, n=None):
    body = {"prompt": ids, "max_tokens": n or args.max_tokens, "temperature": temp,
            "speculative": {"drafter": drafter}, "return_token_ids": True}
    if temp > 0:
        body.update(top_p=0.95, seed=seed)
    st, d = request(moed.port, "POST", "/v1/completions", body)
    if st != 200:
        raise RuntimeError("moed status %d: %s" % (st, d[:300]))
    doc = json.loads(d)
    c = doc["choices"][0]
    return c["text"], doc["usage"]["completion_tokens"], c.get("token_ids", [])


def llama_complete(srv, ids, temp, seed, n=None):
    body = {"prompt": ids, "n_predict": n or args.max_tokens, "temperature": temp, "seed": seed,
            "cache_prompt": True}
    if temp > 0:
        body.update(top_p=0.95)
    else:
        body.update(top_k=1)
    st, d = request(srv.port, "POST", "/completion", body)
    if st != 200:
        raise RuntimeError("llama-server status %d: %s" % (st, d[:300]))
    doc = json.loads(d)
    t = doc.get("timings") or {}
    srv.drafted += t.get("draft_n", 0) or 0
    srv.accepted += t.get("draft_n_accepted", 0) or 0
    return doc.get("content", ""), doc.get("tokens_predicted", 0), []


# Prompts: the "prompt" workload pastes the model's own quotation (plain decode) first.
quoted = {}
for ref in REFS:
    quoted[ref] = moed_complete(tokenize("Quote %s:1-8." % ref), "off", 0.0, 0)[0]
prompt_ids = {}


def job(workload, i):
    ref = REFS[i % len(REFS)]
    if workload in ("verses", "loop"):
        content, temp = "Quote %s:1-8." % ref, 0.0
    elif workload == "prompt":
        content, temp = "%s\n\n%s\n\nQuote %s:1-8." % (ref, quoted[ref], ref), 0.0
    else:
        content, temp = "Tell me about %s." % TOPICS[i % len(TOPICS)], 0.8
    if content not in prompt_ids:
        prompt_ids[content] = tokenize(content)
    return prompt_ids[content], temp


def in_streams(S, items, fn):
    """fn(item) for every item, on S threads taking the items in order: S clients."""
    todo = list(items)
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop(0)
            fn(item)

    th = [threading.Thread(target=worker) for _ in range(S)]
    [t.start() for t in th]
    [t.join() for t in th]


def run(workload, cfg, S, rnd):
    """S streams, per_stream requests each, on one configuration: (tok/s, tokens per
    CPU-second of its server, texts by job index, (prompt ids, output ids) by job index:
    moed's only)."""
    kind, name = cfg
    srv = moed if kind == "moed" else llamas[(S, name)]
    n = S * args.per_stream
    ntok = args.loop_tokens if workload == "loop" else args.max_tokens
    texts, seqs, toks = {}, {}, [0]
    lock = threading.Lock()

    def one(i):
        ids, temp = job(workload, i + rnd * n)
        if i < S and args.start_gap > 0:
            time.sleep(i * args.start_gap / 1000.0)
        seed = 1000 + i + rnd * n
        nt = ntok - i * ntok // S if args.stagger and i < S else ntok
        if kind == "moed":
            text, ct, out = moed_complete(ids, name, temp, seed, nt)
        else:
            text, ct, out = llama_complete(srv, ids, temp, seed, nt)
        with lock:
            texts[i] = text
            if out:
                seqs[i] = (ids, out)
            toks[0] += ct

    c0 = srv.cpu()
    t0 = time.perf_counter()
    in_streams(S, range(n), one)
    dt = time.perf_counter() - t0
    dc = srv.cpu() - c0
    return toks[0] / dt, toks[0] / dc if dc > 0 else 0.0, texts, seqs


def warm(workload, S, rnd):
    """Put the round's prompts into every server's prefix cache (one token each, S at a time):
    moed's drafters share one server, and the first of them in a round would otherwise
    prefill what the others find cached (the prompt workload's ~150-token prompts: ratios
    swung 0.7-1.5x with the order of the configurations); llama-servers alike, so that no
    engine prefills in the timed runs."""
    n = S * args.per_stream
    calls = [lambda ids: moed_complete(ids, "off", 0.0, 0, 1)]
    for t in (LLAMA_TYPES if args.llama else []):
        calls.append(lambda ids, srv=llamas[(S, t)]: llama_complete(srv, ids, 0.0, 0, 1))
    in_streams(S, [(i, c) for i in range(n) for c in calls],
               lambda ic: ic[1](job(workload, ic[0] + rnd * n)[0]))


# ---- the cost model's bound (moed-bench -v) ----

def step_costs(model, sizes):
    """Wall ms of a decode step of n tokens, for n in sizes (moed-bench -v, -t threads; the
    process's CPU time, which it prints too, counts a pass by how busy it keeps the pool's
    threads: 2 tokens against 1 read 2.2x in it and 1.7x in wall time, as the server's steps
    do)."""
    bench = os.path.join(os.path.dirname(os.path.abspath(args.moed)), "..", "bench", "moed-bench")
    out = subprocess.run([bench, "-m", model, "-t", str(args.threads), "-p", "32", "-n", "3",
                          "-r", "3", "-v", ",".join(str(s) for s in sizes)],
                         capture_output=True, text=True, check=True).stdout
    t = {}
    for line in out.splitlines():
        f = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(f) >= 6 and f[0].isdigit():
            t[int(f[0])] = float(f[1])
    return t


def model_bytes(model):
    """(dense bytes, one expert's bytes, MoE layers, experts, experts per token) from the
    GGUF's tensor table (moed-gguf info)."""
    gguf = os.path.join(os.path.dirname(os.path.abspath(args.moed)), "..", "tools", "moed-gguf")
    out = subprocess.run([gguf, "info", model], capture_output=True, text=True).stdout
    dense, exp, layers, n_exp, k = 0, 0, set(), 1, 1
    for line in out.splitlines():
        m = re.match(r"\s*\d+\s+(\S+)\s+\S+\s+\[([^\]]*)\]\s+(\d+)", line)
        if m:
            name, shape, nb = m.group(1), m.group(2), int(m.group(3))
            if "_exps" in name:
                layers.add(name.split(".")[1])
                n_exp = int(shape.split(",")[-1])
                exp += nb
            elif name != "token_embd.weight" or "output.weight" not in out:
                dense += nb
        m = re.search(r"expert_used_count\s+u32 (\d+)", line)
        if m:
            k = int(m.group(1))
    L = max(len(layers), 1)
    return dense, exp / L / n_exp if layers else 0, L, n_exp, k


costs, draft_costs, self_ratio = {}, {}, 0.0
if not args.no_bound:
    K = args.max_k
    # per stream count, its own sizes only: measured among sizes up to 272 tokens, the
    # one-token step read 10.6 ms (CPU) where among 1..17 it reads 8.2, and 2 tokens against
    # 1 read 1.25x where the server's steps (and moed-bench among 1..17) say 1.7x in wall time
    costs = {S: step_costs(args.model, [S * (1 + k) for k in range(K + 1)]) for S in streams}
    if args.draft:
        draft_costs = step_costs(args.draft, sorted(set(streams)))
    dense, w_exp, L, n_exp, k_used = model_bytes(args.model)
    if w_exp:
        self_ratio = (dense + L * 1 * w_exp) / (dense + L * k_used * w_exp)


def bound(S, drafter, a, f=1.0, L=None):
    """The cost model's bound (see the docstring): drafts of k <= L tokens with acceptance a in
    a share f of the steps, plain decode in the others."""
    t = costs.get(S)
    if not t or S not in t:
        return None
    best = 1.0
    kmax = args.max_k if L is None else max(1, min(args.max_k, int(round(L))))
    for k in range(1, kmax + 1):
        n = S * (1 + k)
        if n not in t:
            break
        r = 0.0
        if drafter == "draft":
            r = draft_costs.get(S, 0.0)
        elif drafter == "self":
            r = t[S] * self_ratio
        e = sum(a ** j for j in range(k + 1))
        gain = (f * e + (1 - f)) * t[S] / (f * (t[n] + k * r) + (1 - f) * t[S])
        best = max(best, gain)
    return best


def ngram_proposal(toks, K, min_n=2, max_n=4, long_match=32):
    """The n-gram lookup's proposal for the sequence toks and its class (engine/spec.c,
    md_spec_ngram, with the engine's sizes 2..4): after the newest earlier occurrence of its
    last n tokens, what followed, continued as a repeat of period D past the end of toks (K
    tokens), and its class: 0, 1, 2 (a phrase seen before, matched on 2, 3 or 4 tokens), 3 (the
    last D tokens repeat the D before them) or 4 (a 32-token agreement); ([], None) where
    nothing matches."""
    nt = len(toks)
    for n in range(max_n, min_n - 1, -1):
        if nt < n + 1:
            continue
        suf = toks[nt - n:]
        for j in range(nt - n - 1, -1, -1):
            if toks[j] == suf[0] and toks[j:j + n] == suf:
                frm = j + n
                D = nt - frm
                out = []
                for k in range(K):
                    out.append(toks[frm + k] if k < D else out[k - D])
                m = n
                while m < long_match and m < frm and toks[frm - 1 - m] == toks[nt - 1 - m]:
                    m += 1
                return out, (4 if m >= long_match else 3 if m >= D else min(n, 4) - 2)
    return [], None


def ngram_bounds(S, seqs):
    """The n-gram lookup's two bounds from its real proposals (see the docstring): (the best
    fixed drafts per class, the oracle's), each as plain cost over its least cost, or None."""
    K = args.max_k
    tk = [costs.get(S, {}).get(S * (1 + k)) for k in range(K + 1)]
    if not seqs or None in tk:
        return None
    # alone: one sequence drafting in a step of S (the others plain), charged the step's
    # growth t(S + k) - t(S) for its k drafts, t between measured sizes linear in n
    ts = costs[S]
    sizes = sorted(ts)

    def t_at(n):
        for a, b in zip(sizes, sizes[1:]):
            if a <= n <= b:
                return ts[a] + (ts[b] - ts[a]) * (n - a) / (b - a)
        return ts[sizes[-1]]
    tk_alone = [tk[0] + S * (t_at(S + k) - tk[0]) for k in range(K + 1)]
    outs = []  # per sequence: [(tokens of the proposal that hold, class or None)]
    plain = oracle = 0.0
    for prompt, out in seqs.values():
        n = len(out)
        ctx = list(prompt)
        pos = []
        for i in range(n):
            prop, cls = ngram_proposal(ctx, K)
            a = 0
            while a < len(prop) and i + a < n and prop[a] == out[i + a]:
                a += 1
            pos.append((a, cls))
            ctx.append(out[i])
        outs.append(pos)
        C = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            C[i] = min(tk[k] + C[min(n, i + k + 1)] for k in range(min(pos[i][0], K) + 1))
        plain += n * tk[0]
        oracle += C[0]

    def walk(kc, tk):
        t = 0.0
        for pos in outs:
            i = 0
            while i < len(pos):
                a, cls = pos[i]
                k = kc[cls] if cls is not None else 0
                t += tk[k]
                i += min(a, k) + 1
        return t

    def fixed(tk):
        kc = [0] * 5
        best = walk(kc, tk)
        for _ in range(3):  # coordinate descent over the classes' k
            for c in range(5):
                for k in range(K + 1):
                    t = walk(kc[:c] + [k] + kc[c + 1:], tk)
                    if t < best:
                        best, kc = t, kc[:c] + [k] + kc[c + 1:]
        return best
    return plain / fixed(tk), plain / oracle, plain / fixed(tk_alone)


# ---- the runs ----

print("# model %s%s; %d threads; moed drafters %s%s; %d rounds; max_tokens %d%s; load %s" %
      (os.path.basename(args.model), (" + draft " + os.path.basename(args.draft)) if args.draft
       else "", args.threads, ",".join(drafters),
       ("; llama.cpp " + ",".join(LLAMA_TYPES)) if args.llama else "", args.rounds,
       args.max_tokens, "; staggered streams" if args.stagger else "",
       " ".join("%.1f" % x for x in os.getloadavg())), flush=True)
if costs:
    print("# step ms t(n), measured per stream count: " +
          "; ".join(" ".join("%d:%.1f" % kv for kv in sorted(t.items()))
                    for _, t in sorted(costs.items())) +
          ("; draft t(S): " + " ".join("%d:%.1f" % kv for kv in sorted(draft_costs.items()))
           if draft_costs else "") + ("; self pass / step bytes %.2f" % self_ratio
                                       if self_ratio else ""), flush=True)
print("%-7s %3s %-18s %8s %7s %7s %7s %8s %8s %5s %7s %7s %7s  %s" % (
    "work", "S", "config", "tok/s", "x plain", "x CPU", "accept", "mean len", "experts", "prop",
    "bound", "oracle", "alone", "per-round tok/s"), flush=True)
results = {}  # (workload, S, config name) -> median tok/s
mismatch = 0
llamas = {}
for S in streams:
    if args.llama:
        for t in LLAMA_TYPES:
            kind, _, nmax = t.partition(":")
            cmd = [os.path.join(args.llama, "llama-server"), "-m", args.model, "--host",
                   "127.0.0.1", "-t", str(args.threads), "-np", str(S), "-c", str(1024 * S),
                   "--log-disable", "--spec-type", kind]
            if kind == "draft-simple":
                cmd += ["-md", args.draft]
            if nmax:
                cmd += ["--spec-draft-n-max", nmax]
            srv = Srv(cmd, "llama-" + t)
            srv.drafted = srv.accepted = 0
            servers.append(srv)
            llamas[(S, t)] = srv
    cfgs = [("moed", d) for d in drafters] + [("llama", t) for t in (LLAMA_TYPES if args.llama else [])]
    for workload in workloads:
        rates = {c: [] for c in cfgs}
        ratios = {c: [] for c in cfgs}
        cratios = {c: [] for c in cfgs}
        acc = {c: [0.0] * len(MKEYS) for c in cfgs}
        oracles = []  # the n-gram lookup's oracle bound, per round
        round_bound = []  # its bound in each round (None: not computed)
        for rnd in range(args.rounds):
            order = cfgs[rnd % len(cfgs):] + cfgs[:rnd % len(cfgs)]
            got = {}
            warm(workload, S, rnd)
            for c in order:
                if c[0] == "moed":
                    m0 = metrics()
                else:
                    srv = llamas[(S, c[1])]
                    l0 = (srv.drafted, srv.accepted)
                r, rc, texts, seqs = run(workload, c, S, rnd)
                if c[0] == "moed":
                    m1 = metrics()
                    for j, k in enumerate(MKEYS):
                        acc[c][j] += m1[k] - m0[k]
                else:
                    acc[c][0] += srv.drafted - l0[0]
                    acc[c][1] += srv.accepted - l0[1]
                got[c] = (r, rc, texts)
                if c == ("moed", "ngram") and costs:
                    nb = ngram_bounds(S, seqs)
                    if nb:
                        oracles.append(nb)
                    round_bound.append(nb[0] if nb else None)
                rates[c].append(r)
            for c in cfgs:
                base = ("moed", "off") if c[0] == "moed" else ("llama", "none")
                if base in got:
                    ratios[c].append(got[c][0] / got[base][0])
                    cratios[c].append(got[c][1] / got[base][1] if got[base][1] else 0.0)
                if c[0] == "moed" and ("moed", "off") in got and (workload != "free" or c[1] == "ngram"):
                    for i, t in got[("moed", "off")][2].items():
                        if got[c][2].get(i) != t:
                            mismatch += 1
        for c in cfgs:
            dr, ac, vs, em, lp, di, sq, ps, pt = acc[c]
            a = ac / dr if dr else 0.0
            f = ps / sq if sq else None
            # the bound's acceptance: (accepted + 1) / (drafted + 2), as the controller's alpha,
            # so that one probe of one token that held does not read as a drafter that always
            # holds (with hundreds of drafts it is the measured rate)
            ab = (ac + 1) / (dr + 2) if dr else 0.0
            b = (bound(S, c[1], ab, f if f is not None else 1.0, pt / ps if ps else None)
                 if c[0] == "moed" and c[1] not in ("off", "ngram") else None)
            orc = alone = None
            if c == ("moed", "ngram") and oracles:
                b = statistics.median(x[0] for x in oracles)
                orc = statistics.median(x[1] for x in oracles)
                alone = statistics.median(x[2] for x in oracles)
            med = statistics.median(rates[c])
            results[(workload, S, "%s %s" % c)] = med
            print("%-7s %3d %-18s %8.1f %7.2f %7.2f %7s %8s %8s %5s %7s %7s %7s  %s" % (
                workload, S, "%s %s" % c, med, statistics.median(ratios[c]),
                statistics.median(cratios[c]), "%.2f" % a if dr else "-",
                "%.2f" % (em / vs) if vs else "-", "%.2f" % (di / lp) if lp else "-",
                "%.2f" % f if f is not None and c[1] != "off" else "-",
                "%.2f" % b if b else "-", "%.2f" % orc if orc else "-",
                "%.2f" % alone if alone else "-",
                " ".join("%.1f" % x for x in rates[c])), flush=True)
            if c == ("moed", "ngram") and any(round_bound) and len(ratios[c]) == len(round_bound):
                # each round is another prompt: its speedup against its own bound
                print("#   %s %d ngram by round, x plain / bound: %s" % (
                    workload, S, " ".join("%.2f/%.2f" % (x, b) if b else "%.2f/-" % x
                                          for x, b in zip(ratios[c], round_bound))), flush=True)
    for t in LLAMA_TYPES if args.llama else []:
        llamas[(S, t)].stop()
print("# outputs differing from plain decode (greedy, and seeded n-gram): %d; load %s" %
      (mismatch, " ".join("%.1f" % x for x in os.getloadavg())))


# ---- the plot ----

def svg(path):
    cfg_names = sorted({k[2] for k in results}, key=lambda n: (n.startswith("llama"), n))
    colors = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#7f7f7f", "#ff7f0e", "#8c564b",
              "#e377c2"]
    W, H, pad = 330, 260, 45
    total_w = W * len(workloads) + 180
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" '
           'font-size="11">' % (total_w, H + 40),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="10" y="16" font-size="13">%s: generated tok/s against concurrent streams '
           '(median of %d rounds; moed solid, llama.cpp dashed)</text>' %
           (os.path.basename(args.model), args.rounds)]
    xs = sorted(streams)
    for wi, w in enumerate(workloads):
        x0 = wi * W + pad
        ymax = max([results.get((w, S, n), 0) for S in xs for n in cfg_names] + [1]) * 1.1

        def px(S):
            return x0 + (xs.index(S) / max(len(xs) - 1, 1)) * (W - pad - 20)

        def py(v):
            return 30 + (1 - v / ymax) * (H - 50)
        out.append('<text x="%d" y="%d" font-size="12">%s</text>' % (x0, 32, w))
        out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (x0, H - 20, x0 + W - pad - 20, H - 20))
        out.append('<line x1="%d" y1="30" x2="%d" y2="%d" stroke="black"/>' % (x0, x0, H - 20))
        for S in xs:
            out.append('<text x="%.0f" y="%d" text-anchor="middle">%d</text>' % (px(S), H - 6, S))
        for j in range(5):
            v = ymax * j / 4
            out.append('<text x="%d" y="%.0f" text-anchor="end">%.0f</text>' % (x0 - 4, py(v) + 4, v))
        for ci, n in enumerate(cfg_names):
            pts = [(px(S), py(results[(w, S, n)])) for S in xs if (w, S, n) in results]
            dash = ' stroke-dasharray="5,3"' if n.startswith("llama") else ""
            out.append('<polyline fill="none" stroke="%s" stroke-width="1.8"%s points="%s"/>' % (
                colors[ci % len(colors)], dash, " ".join("%.1f,%.1f" % p for p in pts)))
            for p in pts:
                out.append('<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>' % (p[0], p[1], colors[ci % len(colors)]))
    lx = W * len(workloads) + 10
    for ci, n in enumerate(cfg_names):
        y = 50 + 16 * ci
        dash = ' stroke-dasharray="5,3"' if n.startswith("llama") else ""
        out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>' % (
            lx, y, lx + 22, y, colors[ci % len(colors)], dash))
        out.append('<text x="%d" y="%d">%s</text>' % (lx + 27, y + 4, n))
    out.append('<text x="%d" y="%d">streams</text>' % (W * len(workloads) // 2, H + 30))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


if args.svg:
    svg(args.svg)
for s in servers:
    s.stop()
