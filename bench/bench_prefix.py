#!/usr/bin/python3
"""Time to first token of a repeated long prompt and of a multi-turn chat, with the prefix
cache on and off, alternated in one run. Each round starts moed (127.0.0.1, a free port) with
--prefix-cache true, then false (order swapped every other round), sends the same long
completion prompt REPS times (TTFT of the repeats) and a chat whose every turn resends the
history (TTFT of turns 2..), and reads usage.prompt_tokens_details.cached_tokens. Prints
per-setting medians and the ratio off/on.

With --llama DIR (llama.cpp's binaries, built beside the project, never part of it; or
MOED_LLAMA_CPP) each round also starts DIR/llama-server on the same model (-m, required then)
with its own prompt caching (slot reuse, cache_prompt on by default), one slot, the same
threads, and runs the same requests: the side-by-side column. llama-server caps a slot's
context at the model's training context (the default model's is 256 tokens, shorter than the
long prompt; moed only warns): --llama-args "--override-kv ARCH.context_length=int:4096" lifts
it for the comparison.

usage: bench_prefix.py MOED [ROUNDS=3] [REPS=8] [--llama DIR] [--llama-args STR] [-- moed args, e.g. -m MODEL -t 2]"""
import http.client, json, os, shlex, socket, statistics, subprocess, sys, time
from srvwait import wait_health

argv = sys.argv[1:]
llama = os.environ.get("MOED_LLAMA_CPP")
llama_args = []
for opt in ("--llama", "--llama-args"):
    if opt in argv[:argv.index("--") if "--" in argv else len(argv)]:
        i = argv.index(opt)
        if opt == "--llama":
            llama = argv[i + 1]
        else:
            llama_args = shlex.split(argv[i + 1])
        del argv[i:i + 2]
extra = []
if "--" in argv:
    extra = argv[argv.index("--") + 1:]
    argv = argv[:argv.index("--")]
moed = argv[0]
rounds = int(argv[1]) if len(argv) > 1 else 3
reps = int(argv[2]) if len(argv) > 2 else 8

LONG = " ".join("In the beginning God created the heaven and the earth, and the earth was "
                "without form, and void; and darkness was upon the face of the deep." for _ in range(16))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def post_stream(port, path, body):
    """Streams a request; returns (seconds to the first text, or to the finish of a reply with
    none, final usage, text). A chat stream's first chunk (the role) carries no token and does
    not count."""
    body = dict(body, stream=True, stream_options={"include_usage": True}, temperature=0)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft, usage, text = None, None, ""
    while True:
        line = r.readline()
        if not line:
            break
        if not line.startswith(b"data: {"):
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            # a reply that ends at once (the end token first) counts at its finish
            if (piece or ch.get("finish_reason")) and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
    c.close()
    return ttft, usage, text


def cached_of(usage):
    """usage.prompt_tokens_details.cached_tokens; -1 where the server does not report it."""
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", -1)


def arg_of(flag, default=None):
    for f in flag:
        if f in extra:
            return extra[extra.index(f) + 1]
    return default


def one_run(kind):
    """kind: "on" / "off" (moed with the prefix cache on / off) or "llama" (llama-server)."""
    port = free_port()
    if kind == "llama":
        model = arg_of(["-m", "--model"])
        if not model:
            sys.exit("bench_prefix: --llama needs the model as a moed argument (-- -m MODEL)")
        cmd = [os.path.join(llama, "llama-server"), "-m", model, "--host", "127.0.0.1",
               "--port", str(port), "-t", arg_of(["-t", "--threads"], "2"), "-np", "1",
               "-c", "4096", "--log-disable"] + llama_args
    else:
        cmd = [moed, "--port", str(port), "--log-level", "error",
               "--prefix-cache", "true" if kind == "on" else "false"] + extra
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_health(port, srv)
        rep, cached, n_prompt = [], [], 0
        for i in range(reps + 1):
            ttft, usage, _ = post_stream(port, "/v1/completions",
                                         {"prompt": LONG, "max_tokens": 4, "ignore_eos": True})
            if i:  # the first one fills the cache
                rep.append(ttft)
                cached.append(cached_of(usage))
                n_prompt = (usage or {}).get("prompt_tokens", 0)
        msgs = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
        turns, turn_cached = [], []
        for q in ["Tell me about the sea.", "And the sky?", "And the stars?", "And the moon?",
                  "Thank you."]:
            msgs.append({"role": "user", "content": q})
            ttft, usage, text = post_stream(port, "/v1/chat/completions",
                                            {"messages": msgs, "max_tokens": 24})
            msgs.append({"role": "assistant", "content": text})
            if len(msgs) > 3:
                turns.append(ttft)
                turn_cached.append((cached_of(usage), (usage or {}).get("prompt_tokens", 0)))
        if None in rep + turns:
            sys.exit("bench_prefix: %s: a streamed reply carried neither text nor a finish "
                     "(repeats %s, turns %s)" % (kind, rep, turns))
        return statistics.median(rep), statistics.median(cached), n_prompt, \
            statistics.median(turns), turn_cached
    finally:
        srv.terminate()
        srv.wait()


kinds = ["on", "off"] + (["llama"] if llama else [])
res = {k: [] for k in kinds}
for r in range(rounds):
    for kind in (kinds if r % 2 == 0 else kinds[::-1]):
        res[kind].append(one_run(kind))
names = {"on": "moed, prefix cache on", "off": "moed, prefix cache off", "llama": "llama-server"}
for kind in kinds:
    rs = res[kind]
    print("%-23s: repeated %d-token prompt TTFT median %.1f ms (cached %d tokens); "
          "chat turns 2-5 TTFT median %.1f ms; last round's turns (cached, prompt): %s"
          % (names[kind], rs[0][2], 1e3 * statistics.median(x[0] for x in rs),
             rs[0][1], 1e3 * statistics.median(x[3] for x in rs), rs[-1][4]))
med = {k: (statistics.median(x[0] for x in res[k]), statistics.median(x[3] for x in res[k]))
       for k in kinds}
print("ratio off/on: repeated prompt %.2fx, chat turns %.2fx"
      % (med["off"][0] / med["on"][0], med["off"][1] / med["on"][1]))
if llama:
    print("ratio llama-server/moed (cache on): repeated prompt %.2fx, chat turns %.2fx"
          % (med["llama"][0] / med["on"][0], med["llama"][1] / med["on"][1]))
