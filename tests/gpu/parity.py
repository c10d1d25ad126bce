"""Greedy parity of whole generations through the server: the same prompts served by moed with
--device cuda and with --device cpu give the same completions (both with MOED_KERNELS=ref, so
that the CPU dequantizes as the GPU does; what may still differ is summation order, which can
flip a near tie: such a prompt is reported with the token where the texts part). Prints a
table; exits 1 when fewer than all prompts agree on any model.

usage: parity.py MOED MOED_GGUF DEFAULT_MODEL WORKDIR"""

import json
import os
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from harness import Server  # noqa: E402

moed, moed_gguf, default_model, work = sys.argv[1:5]
PROMPTS = ["And the LORD said unto Moses,", "The history of the city", "Once upon a time,",
           "1, 2, 3, 4, 5, 6, 7, 8,", "In the beginning", "The quick brown fox"]
N_TOK = 48


def complete(srv, prompt):
    req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps(
        {"prompt": prompt, "max_tokens": N_TOK, "temperature": 0, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


def serve(model, device):
    srv = Server(moed, model, ["--device", device, "--max-seqs", "4", "--kv-memory-mb", "256",
                               "--threads", str(os.cpu_count() or 2)],
                 env={"MOED_KERNELS": "ref"})
    try:
        out = [complete(srv, p) for p in PROMPTS]
    finally:
        srv.stop()
    log = srv.logtext()
    line = [ln for ln in log.splitlines() if "device:" in ln]
    return out, line[0].split("info ", 1)[-1] if line else ""


models = [("default model (trained, f16)", default_model)]
for name, args in (("qwen3moe q4_k", ["--arch", "qwen3moe", "--type", "q4_k", "--n-embd", "512",
                                      "--n-ff-exp", "512", "--n-head", "8", "--head-dim", "64"]),
                   ("gpt-oss, mxfp4 experts", ["--arch", "gpt-oss", "--type", "q8_0",
                                               "--exp-type", "mxfp4", "--head-dim", "64"]),
                   ("qwen2moe q6_k", ["--arch", "qwen2moe", "--type", "q6_k", "--n-embd", "256",
                                      "--n-ff-exp", "256", "--n-ff-shexp", "256", "--n-head", "4",
                                      "--head-dim", "64"]),
                   ("deepseek2 q8_0", ["--arch", "deepseek2", "--type", "q8_0", "--head-dim", "32",
                                       "--kv-lora-rank", "64"])):
    path = os.path.join(work, name.replace(" ", "-") + ".gguf")
    subprocess.run([moed_gguf, "gen", "--seed", "7", "--n-layer", "4", "--n-expert", "16",
                    "--n-vocab", "2048"] + args + [path], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    models.append((name, path))

bad = 0
print("| model | prompts equal (%d tokens each) | first difference |" % N_TOK)
print("| --- | ---: | --- |")
for name, path in models:
    ref, _ = serve(path, "cpu")
    got, line = serve(path, "cuda")
    eq = sum(a == b for a, b in zip(ref, got))
    first = ""
    for a, b in zip(ref, got):
        if a != b:
            i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            first = "char %d: %r vs %r" % (i, a[max(0, i - 10):i + 10], b[max(0, i - 10):i + 10])
            break
    print("| %s | %d / %d | %s |" % (name, eq, len(PROMPTS), first))
    if "forward pass on the device" not in line and "device: " not in line:
        print("  (not on the device: %s)" % line)
        bad += 1
    bad += eq != len(PROMPTS)
sys.exit(1 if bad else 0)
