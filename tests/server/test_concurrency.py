"""16 concurrent streaming clients get the same greedy text as one client alone.

usage: test_concurrency.py MOED MODEL
"""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, finish, sse_events  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]
# a small step budget forces chunked prefill to share steps with other streams' decodes
srv = Server(moed, model, args=["--max-seqs", "16", "--step-tokens", "48"])
N = 16


def prompt(i):
    return "Request %d: " % i + "tell me about the number %d " % (i * 7) * (1 + i % 5)


def start(i, chat):
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(i)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt(i)
        path = "/v1/completions"
    f = tempfile.NamedTemporaryFile(delete=False)
    return f.name, subprocess.Popen(
        ["curl", "-sSN", "--max-time", "120", "-H", "Content-Type: application/json",
         "-d", json.dumps(body), srv.base + path], stdout=f)


def text_of(name, chat):
    datas, _ = sse_events(open(name, "rb").read())
    check(datas and datas[-1] == "[DONE]", "stream complete", datas[-2:])
    out = ""
    for d in datas[:-1]:
        ev = json.loads(d)
        for c in ev["choices"]:
            out += c["delta"].get("content", "") if chat else c["text"]
    return out


try:
    for chat in (False, True):
        alone = []
        for i in range(N):
            name, p = start(i, chat)
            p.wait()
            alone.append(text_of(name, chat))
        procs = [start(i, chat) for i in range(N)]
        for _, p in procs:
            p.wait()
        together = [text_of(name, chat) for name, _ in procs]
        for i in range(N):
            check(alone[i] == together[i], "client %d (%s) same text alone and with 15 others" %
                  (i, "chat" if chat else "completion"), alone[i], together[i])
        check(len(set(alone)) > 1, "different prompts give different texts", alone[:3])
    metrics = subprocess.run(["curl", "-s", srv.base + "/metrics"], capture_output=True, text=True).stdout
    steps = [l for l in metrics.splitlines() if l.startswith("moed:engine_steps_total")]
    print(steps)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
