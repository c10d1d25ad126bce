"""--trace-routing and the MoE routing counters through the real server: a completion's trace
has one record per fed token and MoE layer, /metrics counts the same layer-steps, and an
unwritable trace path stops the start with a message naming it. With --expert-batching 1 and
more streams than a step holds (24 streams, 16-token steps), greedy completions equal those
without it, and through the expert store its default (on there) gives them too.

usage: test_trace.py MOED MODEL (a MoE model: the moe64 one)
"""

import json
import os
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, curl, finish  # noqa: E402

moed, model = sys.argv[1:3]


def metric(srv, name):
    _, _, body = curl(srv, "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


with tempfile.TemporaryDirectory() as d:
    trace = os.path.join(d, "r.trace")
    srv = Server(moed, model, ["--trace-routing", trace])
    st, _, doc = call(srv, "POST", "/v1/completions",
                      {"prompt": "In the beginning God created", "max_tokens": 6,
                       "temperature": 0, "ignore_eos": True})
    check(st == 200, "completion", st)
    n_prompt, n_gen = doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"]
    steps = metric(srv, "moed:engine_steps_total")
    layer_steps = metric(srv, "moed:moe_layer_steps_total")
    distinct = metric(srv, "moed:moe_distinct_experts_total")
    rc = srv.stop()
    check(rc == 0, "clean stop", rc)
    lines = open(trace).read().splitlines()
    check(lines[:2] == ["# moed routing trace 2", "# n_layer 6 n_expert 64 n_used 4"],
          "trace header", lines[:2])
    recs = [l.split() for l in lines[2:] if not l.startswith("p ")]
    pregate = [l.split() for l in lines[2:] if l.startswith("p ")]
    # pre-gating's prediction for every fed token at every layer but the first, 4 experts each
    check(len(pregate) == (n_prompt + n_gen - 1) * 5 and all(len(p) == 5 + 4 for p in pregate)
          and {p[2] for p in pregate} == {"1", "2", "3", "4", "5"},
          "pre-gating lines for layers 1-5", len(pregate), n_prompt, n_gen)
    # every token fed to the model: the prompt and all generated tokens but the last
    check(len(recs) == (n_prompt + n_gen - 1) * 6, "one record per fed token and layer",
          len(recs), n_prompt, n_gen)
    check(all(len(r) == 4 + 4 + 4 for r in recs), "records have 4 experts and 4 weights")
    check(len({r[2] for r in recs}) == 1, "one sequence", {r[2] for r in recs})
    check(layer_steps == steps * 6, "moe layer-steps = steps x 6", layer_steps, steps)
    recs_steps = {r[0] for r in recs}
    check(len(recs_steps) == steps, "trace steps = engine steps", len(recs_steps), steps)
    # distinct experts per layer-step, from the trace, equal the counter
    per = {}
    for r in recs:
        per.setdefault((r[0], r[1]), set()).update(r[4:8])
    check(sum(len(v) for v in per.values()) == distinct, "distinct-experts counter matches trace",
          sum(len(v) for v in per.values()), distinct)

    bad = os.path.join(d, "missing-dir", "r.trace")
    r = subprocess.run([moed, "-m", model, "--port", "0", "--threads", "2", "--trace-routing", bad],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode != 0 and "cannot open routing trace '%s'" % bad in r.stderr,
          "unwritable trace path refused, named", r.returncode, r.stderr[-300:])


def completions(args, n=24):
    """n concurrent greedy completions; their texts in request order. The requests leave
    together (a barrier) and decode 32 tokens each, so that more sequences are ready than a
    step holds even where the engine is fast: with 12 tokens sent as the threads started, a
    Zen 5 finished the first requests before the last arrived and never had to choose."""
    srv = Server(moed, model, args)
    out = [None] * n
    go = threading.Barrier(n)

    def one(i):
        go.wait()
        st, _, doc = call(srv, "POST", "/v1/completions",
                          {"prompt": "And it came to pass %d" % i, "max_tokens": 32,
                           "temperature": 0, "ignore_eos": True})
        out[i] = doc["choices"][0]["text"] if st == 200 else st

    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    sel = metric(srv, "moed:expert_batching_selections_total")
    srv.stop()
    return out, sel


# 24 streams, 16-token steps: more decoders than a step holds
on, sel_on = completions(["--expert-batching", "1", "--step-tokens", "16"])
off, sel_off = completions(["--expert-batching", "0", "--step-tokens", "16"])
check(all(isinstance(t, str) for t in on + off), "all completions answered", on, off)
check(on == off, "same greedy text with expert batching on and off", on, off)
check(sel_on > 0 and sel_off == 0, "on chose steps by experts, off did not", sel_on, sel_off)
# Through the expert store (a cache of under a third of the experts) the default (-1) turns it on,
# weighing misses by what is resident: the same text again.
st, sel_st = completions(["--step-tokens", "16", "--expert-cache-mb", "8"])
check(st == off, "same greedy text through the store with the default expert-batching", st, off)
check(sel_st > 0, "the default chose steps by experts through the store", sel_st)
finish()
