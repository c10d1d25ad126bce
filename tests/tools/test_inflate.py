#!/usr/bin/python3
"""moed-gguf inflate computes the same function: the default model and generated models of
every architecture, inflated at several multiples, give moed-run the same greedy tokens and
top-5 log-probabilities (within float tolerance) as the original; a row length the target
type cannot hold is refused with the tensor's name.

With MOED_LLAMA_CPP set to a directory holding llama.cpp's llama-server (or to a llama.cpp
checkout with build/bin/llama-server), the default model inflated at several multiples also
gives llama.cpp the same greedy tokens and top-5 log-probabilities as the original (server with
f32 KV cache, no flash attention, temperature 0, /completion n_probs 5). Unset: that part is
skipped with a note. llama.cpp is never built by the test.

usage: test_inflate.py MOED_GGUF MOED_RUN DEFAULT_MODEL"""
import json, os, shutil, socket, subprocess, sys, tempfile, time, urllib.request

import numpy as np

gguf, run, default = sys.argv[1:4]
tmp = tempfile.mkdtemp(prefix="moed-inflate-")
fails = []
PROMPT = "100,200,300,400,5,17"
N_GEN = 24
TOL = 1e-4  # top-5 log-probability difference; float sums in another order
LLAMA_ROUND_TOL = 2e-2  # llama.cpp on F16/Q8_0 weights: activations rounded (see below)


def sh(*args):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (args[:2], r.returncode, r.stderr[-2000:]))
    return r.stdout


def greedy(model, n_vocab):
    dump = os.path.join(tmp, os.path.basename(model) + ".logits")
    out = sh(run, "-m", model, "-p", PROMPT, "-n", str(N_GEN), "--dump-logits", dump)
    ids = [l for l in out.splitlines() if l.startswith("seq 0:")][0].split()[2:]
    logits = np.fromfile(dump, dtype=np.float32).reshape(-1, n_vocab)
    m = logits.max(1, keepdims=True)
    return ids, logits - m - np.log(np.exp(logits - m).sum(1, keepdims=True))


def same_function(name, orig, args, n_vocab, tol=TOL):
    out = os.path.join(tmp, name + ".gguf")
    sh(gguf, "inflate", *args, orig, out)
    ids_a, lp_a = greedy(orig, n_vocab)
    ids_b, lp_b = greedy(out, n_vocab)
    worst = 0.0
    for i in range(len(lp_a)):
        top = np.argsort(-lp_a[i])[:5]
        worst = max(worst, float(np.abs(lp_a[i][top] - lp_b[i][top]).max()))
    size = os.path.getsize(out) / os.path.getsize(orig)
    ok = ids_a == ids_b and worst <= tol
    print("%-28s %s  x%.1f bytes  greedy %s  top-5 max diff %.2g" %
          (name, " ".join(args), size, "equal" if ids_a == ids_b else "DIFFERENT", worst))
    if not ok:
        fails.append(name)
    os.unlink(out)


q8 = os.path.join(tmp, "src-default-q8_0.gguf")
sh(gguf, "quantize", default, q8, "q8_0")

# The trained default model (f16), and its q8_0 quantization inflated in its own type.
same_function("default-f16", default, ["--embd", "2", "--heads", "2", "--ff", "4"], 4096)
same_function("default-f16-embd4", default, ["--embd", "4"], 4096)
same_function("default-q8_0", q8, ["--embd", "4", "--heads", "2", "--ff", "4"], 4096)
same_function("default-q8_0-embd8", q8, ["--embd", "8"], 4096)
same_function("default-f16-to-f32", default, ["--embd", "2", "--type", "f32"], 4096)

# Generated models: shared expert and biases (qwen2moe), full-width QK-norm (olmoe), Mixtral,
# a dense draft-style model with a tied output.
for arch, extra in (("qwen2moe", []), ("olmoe", []), ("mixtral", []), ("qwen3", ["--tied"]),
                    ("qwen3moe", ["--tied"])):
    src = os.path.join(tmp, arch + ".gguf")
    sh(gguf, "gen", "--arch", arch, "--type", "f32", "--seed", "7", "--n-layer", "2",
       "--n-embd", "64", "--n-vocab", "512", "--std", "0.08", *extra, src)
    same_function("gen-" + arch + ("-tied" if extra else ""), src,
                  ["--embd", "2", "--heads", "2", "--ff", "2"], 512)

# A K-quant model kept in its type: its blocks are copied byte for byte.
src = os.path.join(tmp, "q4k.gguf")
sh(gguf, "gen", "--arch", "qwen3moe", "--type", "q4_k", "--seed", "3", "--n-layer", "2",
   "--n-embd", "256", "--n-head", "4", "--n-head-kv", "2", "--head-dim", "64", "--n-ff-exp", "256",
   "--n-vocab", "512", "--std", "0.08", src)
same_function("gen-qwen3moe-q4_k", src, ["--embd", "2", "--heads", "2", "--ff", "2"], 512)

# The newer block types kept in their type (mxfp4's E8M0 scales, iq4_xs's packed 6-bit ones),
# checked on the dequantizing kernels (MOED_KERNELS=ref). On the integer ones the wider model's
# float sums (attention over twice the heads) differ in the last bits, which can flip an 8-bit
# activation rounding downstream (measured: iq4_xs one row 6e-3 off with every other row within
# 1e-6; mxfp4 0.0094 on the AVX2 table, 0 on AVX-512; greedy equal in both). That is the integer
# kernels' legitimate noise, not a change of function, and which table shows it depends on the
# machine, so the check of the function does not run on them.
for wt, env in (("mxfp4", "ref"), ("iq4_xs", "ref")):
    src = os.path.join(tmp, wt + ".gguf")
    sh(gguf, "gen", "--arch", "qwen3moe", "--type", wt, "--seed", "5", "--n-layer", "2",
       "--n-embd", "256", "--n-head", "4", "--n-head-kv", "2", "--head-dim", "64",
       "--n-ff-exp", "256", "--n-vocab", "512", "--std", "0.08", src)
    old_env = os.environ.get("MOED_KERNELS")
    if env:
        os.environ["MOED_KERNELS"] = env
    try:
        same_function("gen-qwen3moe-" + wt, src, ["--embd", "2", "--heads", "2", "--ff", "2"],
                      512)
    finally:
        if env:
            if old_env is None:
                del os.environ["MOED_KERNELS"]
            else:
                os.environ["MOED_KERNELS"] = old_env

# q4_K needs rows that are multiples of 256: n_embd 192 x 1 is refused, naming the tensor.
r = subprocess.run([gguf, "inflate", "--type", "q4_k", default, os.path.join(tmp, "x.gguf")],
                   capture_output=True, text=True)
if r.returncode == 0 or "token_embd.weight" not in r.stderr or "q4_K" not in r.stderr:
    print("FAIL: q4_k with rows of 192 was not refused clearly:", r.returncode, r.stderr)
    fails.append("refuse")
else:
    print("refused as expected:", r.stderr.strip())



# ------------------------------------------------------------------ llama.cpp, when present

def llama_server_bin():
    d = os.environ.get("MOED_LLAMA_CPP", "")
    if not d:
        return None
    for c in (os.path.join(d, "llama-server"), os.path.join(d, "build", "bin", "llama-server")):
        if os.access(c, os.X_OK):
            return c
    print("FAIL: MOED_LLAMA_CPP=%s holds no llama-server (nor build/bin/llama-server)" % d)
    fails.append("llama.cpp-missing")
    return None


def free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def llama_greedy(server, model):
    """Greedy tokens after PROMPT and, at each generated position, the top-5 (id, log-prob)
    before sampling, from a llama-server of its own."""
    port = free_port()
    log = open(os.path.join(tmp, os.path.basename(model) + ".llama.log"), "w")
    proc = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                             "-c", "256", "-np", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32",
                             "-fa", "off", "--no-warmup"], stdout=log, stderr=subprocess.STDOUT)
    base = "http://127.0.0.1:%d" % port
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError("llama-server exited %d on %s (log %s)" %
                                   (proc.returncode, model, log.name))
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("llama-server did not become ready on %s" % model)
            time.sleep(0.2)
        body = {"prompt": [int(t) for t in PROMPT.split(",")], "n_predict": N_GEN,
                "temperature": 0, "n_probs": 5, "ignore_eos": True, "cache_prompt": False,
                "post_sampling_probs": False}
        req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            res = json.load(r)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    probs = res["completion_probabilities"]
    ids = [p["id"] for p in probs]
    top = [[(t["id"], t["logprob"]) for t in p["top_logprobs"]] for p in probs]
    return ids, top


def llama_same_function(server, name, orig, args, tol):
    out = os.path.join(tmp, name + ".gguf")
    sh(gguf, "inflate", *args, orig, out)
    ids_a, top_a = llama_greedy(server, orig)
    ids_b, top_b = llama_greedy(server, out)
    worst = 0.0
    for ta, tb in zip(top_a, top_b):
        lb = dict(tb)
        for tid, lp in ta:
            # a token of the original's top 5 missing from the inflated one's: a big difference
            worst = max(worst, abs(lp - lb[tid]) if tid in lb else float("inf"))
    full = all(len(t) == 5 for t in top_a + top_b)  # top-5 at every position, both models
    ok = len(ids_a) == N_GEN and full and ids_a == ids_b and worst <= tol
    print("llama.cpp %-18s %s  greedy %s  top-5 max diff %.2g (tol %g)" %
          (name, " ".join(args), "equal" if ids_a == ids_b else "DIFFERENT", worst, tol))
    if not ok:
        fails.append("llama.cpp-" + name)
    os.unlink(out)


server = llama_server_bin()
if server is None and not os.environ.get("MOED_LLAMA_CPP"):
    print("note: MOED_LLAMA_CPP is not set: the llama.cpp half of this test is skipped "
          "(set it to a directory with llama-server to run it)")
elif server is not None:
    f32 = os.path.join(tmp, "src-default-f32.gguf")
    sh(gguf, "quantize", default, f32, "f32")
    # F32 weights: llama.cpp computes in floats, the inflated rows only add exact zeros.
    for name, src, args in (("f32", f32, ["--embd", "2", "--heads", "2", "--ff", "4"]),
                            ("f32-embd4", f32, ["--embd", "4"]),
                            ("f32-heads4-ff8", f32, ["--heads", "4", "--ff", "8"])):
        llama_same_function(server, name, src, args, TOL)
    # F16 and Q8_0 weights: llama.cpp rounds the activations to F16 / 8-bit blocks before the
    # matmul, and an RMS over a longer row may differ in its last bit, so a value can round
    # the other way: the same tokens, log-probabilities within LLAMA_ROUND_TOL.
    for name, src, args in (("f16", default, ["--embd", "2", "--heads", "2", "--ff", "4"]),
                            ("q8_0", q8, ["--embd", "4", "--heads", "2", "--ff", "4"])):
        llama_same_function(server, name, src, args, LLAMA_ROUND_TOL)

if fails:
    print("%d case(s) failed: %s" % (len(fails), ", ".join(fails)))
    sys.exit(1)
print("all inflation cases compute the same function")
shutil.rmtree(tmp, True)  # kept on failure: the logs and logits are there
