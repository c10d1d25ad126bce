#!/usr/bin/python3
"""Checks the exported GGUFs against the torch models: greedy tokens from moed-run and
token ids from moed-tokenize must equal what tools/train/train.py computes."""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402

PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,",
           "Blessed are the", "For God so loved", "Jesus wept. And"]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", required=True, help="meson build dir with tools/moed-run")
    ap.add_argument("--work", default="train-work")
    ap.add_argument("--models", default="models")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--check", default="moe,draft",
                    help="configurations to compare (their checkpoints in --work)")
    a = ap.parse_args()
    ok = True
    tok = train.load_tok(a.work)
    sp = tok.special
    chat = ([sp["<|im_start|>"]] + tok.encode("user\nRead me John 3:16.") + [sp["<|im_end|>"]]
            + tok.encode("\n") + [sp["<|im_start|>"]] + tok.encode("assistant\n"))
    prompts = [tok.encode(p) for p in PROMPTS] + [chat]
    for name in a.check.split(","):
        path = os.path.join(a.models, train.OUT_FILES[name])
        model, _ = train.load_model(a.work, name)  # matrices rounded to F16, as exported
        arg = ";".join(",".join(map(str, p)) for p in prompts)
        out = subprocess.run([os.path.join(a.build, "tools", "moed-run"), "-m", path, "-p", arg,
                              "-n", str(a.n)], capture_output=True, text=True, check=True).stdout
        got = {}
        for line in out.splitlines():
            if line.startswith("seq "):
                k, v = line.split(":", 1)
                got[int(k.split()[1])] = [int(x) for x in v.split()]
        for i, p in enumerate(prompts):
            want = train.greedy(model, p, a.n)
            same = 0
            while same < a.n and got[i][same] == want[same]:
                same += 1
            status = "OK" if same == a.n else f"DIFFER at {same}"
            ok &= same == a.n
            print(f"{name} prompt {i}: {status}  torch {want[:12]}... engine {got[i][:12]}...")
            print(f"   text: {tok.decode(p)!r} -> {tok.decode(want)!r}")
    # Tokenizer parity: the engine's qwen2 pre-tokenizer + merges vs this trainer's encoder.
    texts = PROMPTS + ["Then Peter said unto them, Repent, and be baptized every one of you "
                       "in the name of Jesus Christ for the remission of sins, 1:23 and ye "
                       "shall receive the gift of the Holy Ghost.\n\n  2 Hello, world! It's 42."]
    for t in texts:
        r = subprocess.run([os.path.join(a.build, "tools", "moed-tokenize"), "-m",
                            os.path.join(a.models, train.OUT_FILES[a.check.split(",")[0]]), t],
                           capture_output=True, text=True, check=True).stdout
        eng = [int(x) for x in r.replace(",", " ").split() if x.lstrip("-").isdigit()]
        mine = tok.encode(t)
        same = eng == mine
        ok &= same
        print(f"tokenize {'OK' if same else 'DIFFER'}: {t[:40]!r} torch {mine[:10]} engine {eng[:10]}")
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
