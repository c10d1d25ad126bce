#!/usr/bin/python3
"""Time to first token of a repeated long prompt and of a multi-turn chat, with the prefix
cache on and off, alternated in one run. Each round starts moed (127.0.0.1, a free port) with
--prefix-cache true, then false (order swapped every other round), sends the same long
completion prompt REPS times (TTFT of the repeats) and a chat whose every turn resends the
history (TTFT of turns 2..), and reads usage.prompt_tokens_details.cached_tokens. Prints
per-setting medians and the ratio off/on.

usage: bench_prefix.py MOED [ROUNDS=3] [REPS=8] [-- moed args, e.g. -m MODEL]"""
import http.client, json, socket, statistics, subprocess, sys, time

argv = sys.argv[1:]
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
    """Streams a request; returns (seconds to the first text, final usage, text). A chat
    stream's first chunk (the role) carries no token and does not count."""
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
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
    c.close()
    return ttft, usage, text


def one_run(cache):
    port = free_port()
    srv = subprocess.Popen([moed, "--port", str(port), "--log-level", "error",
                            "--prefix-cache", "true" if cache else "false"] + extra,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        rep, cached, n_prompt = [], [], 0
        for i in range(reps + 1):
            ttft, usage, _ = post_stream(port, "/v1/completions",
                                         {"prompt": LONG, "max_tokens": 4, "ignore_eos": True})
            if i:  # the first one fills the cache
                rep.append(ttft)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                n_prompt = usage["prompt_tokens"]
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
                turn_cached.append((usage["prompt_tokens_details"]["cached_tokens"],
                                    usage["prompt_tokens"]))
        return statistics.median(rep), statistics.median(cached), n_prompt, \
            statistics.median(turns), turn_cached
    finally:
        srv.terminate()
        srv.wait()


res = {True: [], False: []}
for r in range(rounds):
    for cache in ([True, False] if r % 2 == 0 else [False, True]):
        res[cache].append(one_run(cache))
for cache in (True, False):
    rs = res[cache]
    print("prefix cache %-3s: repeated %d-token prompt TTFT median %.1f ms (cached %d tokens); "
          "chat turns 2-5 TTFT median %.1f ms; last round's turns (cached, prompt): %s"
          % ("on" if cache else "off", rs[0][2], 1e3 * statistics.median(x[0] for x in rs),
             rs[0][1], 1e3 * statistics.median(x[3] for x in rs), rs[-1][4]))
on_rep = statistics.median(x[0] for x in res[True])
off_rep = statistics.median(x[0] for x in res[False])
on_t = statistics.median(x[3] for x in res[True])
off_t = statistics.median(x[3] for x in res[False])
print("ratio off/on: repeated prompt %.2fx, chat turns %.2fx" % (off_rep / on_rep, off_t / on_t))
