#!/usr/bin/python3
"""Decode steps of a moed server log written with MOED_SPEC_TRACE=1 (bench_spec.py leaves its
server's log in /tmp/bench-spec-moed-*.log), summed by kind:

  plain steps of B sequences, by how many steps before the last verifying step was
  (1-4, 5-16, 17-64, more than 64 or none): median wall ms, mean distinct experts computed,
  tokens/s over their wall time;
  verifying steps of B sequences, by drafted tokens: the same, and tokens per step.

With --phases the plain steps are grouped instead by whether the controller was asked about
them (a spec-ctl line before the step: a request with a drafter was decoding) or not (plain
decode's own runs, drafter off). With bench_spec.py --drafters off,X that splits the steps of
the two configurations (bench/README.md, "2026-12-07: streams that start apart").

What it shows: whether speculation pays per step (a verifying step's tokens/s against plain
steps'), and what it does to the plain steps around it (desynchronised sequences share fewer
experts: bench/README.md, "Speculative decoding").

With --balance it adds what speculation bought and what it paid over the whole log: the
verifying steps' wall time against the same tokens at plain decode's cost (each emitted token
at the median wall per token of plain steps of the same B), and the wall time of the drafters'
own passes (the draft model's rounds with its catch-up, spec-draft lines; self-speculation's
passes, spec-self lines), which the step lines do not include.

  bench/spec_trace.py /tmp/bench-spec-moed-XXXX.log [--batch 4] [--phases] [--balance]
"""

import argparse
import re
import statistics

ap = argparse.ArgumentParser()
ap.add_argument("log")
ap.add_argument("--batch", type=int, default=0, help="only steps of this many sequences")
ap.add_argument("--phases", action="store_true",
                help="plain steps by whether the controller was asked about them")
ap.add_argument("--balance", action="store_true",
                help="verifying steps against plain decode's cost, and the drafters' own passes")
args = ap.parse_args()

STEP = re.compile(r"spec-step n=(\d+) items=(\d+) out=(\d+) dt=([\d.]+)ms wall=([\d.]+)ms"
                  r"(?: experts=(\d+))?")
DRAFTER = re.compile(r"spec-(draft|self) seqs=\d+ k0=\d+ .*?wall=([\d.]+)ms")
CTL_B = re.compile(r"spec-ctl B=(\d+) ")
steps = []
drafter_ms = {"draft": [], "self": []}  # (B of the step it drafts for, wall ms)
asked = False  # a spec-ctl line since the last step: the controller chose for the next one
ctl_b = 0      # B of the last spec-ctl line: the step the next drafter pass drafts for
with open(args.log, errors="replace") as f:
    for line in f:
        if line.startswith("spec-ctl "):
            asked = True
            m = CTL_B.match(line)
            ctl_b = int(m[1]) if m else ctl_b
            continue
        m = DRAFTER.match(line)
        if m:
            drafter_ms[m[1]].append((ctl_b, float(m[2])))
            continue
        m = STEP.match(line)
        if m:
            steps.append((int(m[1]), int(m[2]), int(m[3]), float(m[5]),
                          int(m[6]) if m[6] else -1, asked))
            asked = False


def since_bucket(d):
    for hi, name in ((4, "1-4"), (16, "5-16"), (64, "17-64")):
        if d <= hi:
            return name
    return ">64"


groups = {}
last = None
for i, (n, items, out, wall, experts, ctl) in enumerate(steps):
    verifying = n > items
    if verifying:
        last = i
    if args.batch and items != args.batch:
        continue
    if verifying:
        key = ("verify", items, "drafts %d" % (n - items) if n - items < 10 else "drafts >=10")
    elif args.phases:
        key = ("plain", items, "asked" if ctl else "not asked")
    else:
        key = ("plain", items, "since " + (since_bucket(i - last) if last is not None else ">64"))
    groups.setdefault(key, []).append((out, wall, experts))

ORDER = {"since 1-4": 0, "since 5-16": 1, "since 17-64": 2, "since >64": 3}
print("%-7s %3s %-13s %6s %9s %9s %8s %8s" % ("kind", "B", "group", "steps", "tok/step",
                                             "wall ms", "experts", "tok/s"))
for key in sorted(groups, key=lambda k: (k[0], k[1], ORDER.get(k[2], 9), len(k[2]), k[2])):
    v = groups[key]
    outs = sum(x[0] for x in v)
    walls = sum(x[1] for x in v)
    ex = [x[2] for x in v if x[2] >= 0]
    print("%-7s %3d %-13s %6d %9.2f %9.2f %8s %8.0f" % (
        key[0], key[1], key[2], len(v), outs / len(v), statistics.median(x[1] for x in v),
        "%.2f" % statistics.mean(ex) if ex else "-", 1000 * outs / walls if walls else 0))

if args.balance:
    per_tok = {}  # B -> median wall ms per token of plain steps of B sequences
    for n, items, out, wall, experts, ctl in steps:
        if n == items:
            per_tok.setdefault(items, []).append(wall / items)
    per_tok = {b: statistics.median(v) for b, v in per_tok.items()}
    B_GROUPS = ((1, 1), (2, 4), (5, 8), (9, 12), (13, 16), (17, 1 << 30))

    def b_group(b):
        for lo, hi in B_GROUPS:
            if lo <= b <= hi:
                return (lo, hi)

    saved = {}    # B group -> [verifying ms, tokens, at plain cost ms]
    missing = 0
    for n, items, out, wall, experts, ctl in steps:
        if n > items and (not args.batch or items == args.batch):
            g = saved.setdefault(b_group(items), [0.0, 0, 0.0])
            g[0] += wall
            g[1] += out
            if items in per_tok:
                g[2] += out * per_tok[items]
            else:
                missing += 1
                g[2] += wall
    vt = sum(g[0] for g in saved.values())
    vout = sum(g[1] for g in saved.values())
    veq = sum(g[2] for g in saved.values())
    print("verifying steps: %.0f ms wall for %d tokens; the same tokens at plain decode's cost "
          "%.0f ms: saved %.0f ms%s" % (vt, vout, veq, veq - vt,
                                      " (%d steps of a B without plain steps counted level)"
                                      % missing if missing else ""))
    for d in ("draft", "self"):
        if drafter_ms[d]:
            print("%s passes: %d, %.0f ms wall" % ("draft model" if d == "draft" else
                                                  "self-draft", len(drafter_ms[d]),
                                                  sum(x[1] for x in drafter_ms[d])))
    # By the step's sequences: where speculation gained and where its drafts cost more
    print("%-8s %12s %10s %14s %14s %10s" % ("B", "verify ms", "saved ms", "draft-model ms",
                                            "self-draft ms", "net ms"))
    for lo, hi in B_GROUPS:
        if args.batch and not lo <= args.batch <= hi:
            continue
        g = saved.get((lo, hi), [0.0, 0, 0.0])
        dm = sum(x[1] for x in drafter_ms["draft"] if lo <= x[0] <= hi)
        sd = sum(x[1] for x in drafter_ms["self"] if lo <= x[0] <= hi)
        if g[0] == 0 and dm == 0 and sd == 0:
            continue
        name = str(lo) if lo == hi else "%d-%d" % (lo, hi) if hi < (1 << 30) else ">%d" % (lo - 1)
        print("%-8s %12.0f %10.0f %14.0f %14.0f %10.0f" % (name, g[0], g[2] - g[0], dm, sd,
                                                           g[2] - g[0] - dm - sd))
