"""A KV pool just above one full context: concurrent long greedy streams preempt each other
(preemption recomputes), and every stream's text equals the text it gets alone.

usage: test_preempt.py MOED MODEL
"""

import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, curl, finish, sse_events  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]
CTX, BLOCK = 256, 16
# one full context is CTX / BLOCK blocks; four more leave room for little else
srv = Server(moed, model, args=["--ctx-size", str(CTX), "--kv-blocks", str(CTX // BLOCK + 4),
                                "--max-seqs", "8", "--step-tokens", "64"])
N, MAX_TOKENS = 4, 120  # about 4 x 9 blocks wanted of 20: preemption, whatever the machine


def prompt(i):
    return "Story %d about the number %d: " % (i, i * 13) + "once upon a time " * (1 + i % 3)


def start(i, chat):
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(i)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt(i)
        path = "/v1/completions"
    f = tempfile.NamedTemporaryFile(delete=False)
    return f.name, subprocess.Popen(
        ["curl", "-sSN", "--max-time", "180", "-H", "Content-Type: application/json",
         "-d", json.dumps(body), srv.base + path], stdout=f)


def result(name, chat):
    """(text, finish reasons, completion tokens) of a finished stream."""
    datas, _ = sse_events(open(name, "rb").read())
    os.unlink(name)
    check(datas and datas[-1] == "[DONE]", "stream complete", datas[-2:])
    text, reasons, usage = "", [], None
    for d in datas[:-1]:
        ev = json.loads(d)
        if ev.get("usage"):
            usage = ev["usage"]["completion_tokens"]
        for c in ev["choices"]:
            text += c["delta"].get("content", "") if chat else c["text"]
            if c.get("finish_reason"):
                reasons.append(c["finish_reason"])
    return text, reasons, usage


def preemptions():
    b = curl(srv, "GET", "/metrics")[2].decode()
    m = re.search(r"^moed:num_preemptions_total\{[^}]*\} (\S+)$", b, re.M)
    return float(m.group(1)) if m else None


try:
    for chat in (False, True):
        kind = "chat" if chat else "completion"
        before = preemptions()
        alone = []
        for i in range(N):
            name, p = start(i, chat)
            p.wait()
            alone.append(result(name, chat))
        check(preemptions() == before, "no preemption with one stream at a time (%s)" % kind,
              before, preemptions())
        procs = [start(i, chat) for i in range(N)]
        for _, p in procs:
            p.wait()
        together = [result(name, chat) for name, _ in procs]
        after = preemptions()
        print("%s: preemptions %s -> %s" % (kind, before, after))
        check(after is not None and after > before, "%d streams in %d KV blocks preempt (%s)" %
              (N, CTX // BLOCK + 4, kind), before, after)
        for i in range(N):
            check(together[i][1] == ["length"] and together[i][2] == MAX_TOKENS,
                  "stream %d (%s) ran to max_tokens" % (i, kind), together[i][1:])
            check(alone[i][0] == together[i][0],
                  "stream %d (%s): same greedy text alone and under preemption" % (i, kind),
                  alone[i][0], together[i][0])
        check(len(set(t for t, _, _ in alone)) > 1, "different prompts give different texts")
    check(curl(srv, "GET", "/health")[0] == 200, "healthy after preemptions")
finally:
    check(srv.stop() == 0, "clean exit")
finish()
