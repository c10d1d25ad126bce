"""Run test_tools.mjs (tool calling through the official OpenAI Node SDK, arguments validated
with ajv; needs Node 20+) against a real moed.

usage: test_tools.py MOED MODEL NPM_DIR
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, finish  # noqa: E402

moed, model, npm = sys.argv[1:4]
try:
    ver = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
except FileNotFoundError:
    ver = ""
if not ver or int(ver.lstrip("v").split(".")[0]) < 20:
    print("SKIP: the openai SDK needs Node 20+, found %r" % ver)
    sys.exit(77)
PKGS = ["openai@6.49.0", "ajv@8.17.1"]
# Into the shared npm cache, through the installer (and lock) the other suites use.
r = subprocess.run(["sh", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                       "npm_install.sh"), npm] + PKGS)
if r.returncode != 0:
    print("FAIL: could not install the npm packages %s into %s" % (PKGS, npm))
    sys.exit(1)
# the SDK sends a bearer key: exercise auth on the way
srv = Server(moed, model, args=["--api-key", "test-key"])
try:
    env = dict(os.environ, MOED_BASE=srv.base, MOED_NPM=os.path.abspath(npm))
    out = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "test_tools.mjs")],
                         env=env, capture_output=True, text=True, timeout=300)
    print(out.stdout, out.stderr)
    check(out.returncode == 0, "tool-calling SDK test passed", out.returncode)
    # the wire shapes against proto/openapi.yaml: a whole response and a stream with tool calls
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 100,
            "temperature": 0, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"], "additionalProperties": False}}}]}
    key = ["Authorization: Bearer test-key"]
    st, _, doc = call(srv, "POST", "/v1/chat/completions", body, headers=key)
    check(st == 200 and doc["choices"][0]["finish_reason"] == "tool_calls" and
          doc["choices"][0]["message"]["content"] is None, "whole tool-call response", doc)
    st, _, evs = call(srv, "POST", "/v1/chat/completions", dict(body, stream=True), headers=key)
    deltas = [d for e in evs for c in e["choices"] for d in c["delta"].get("tool_calls", [])]
    check(st == 200 and deltas and deltas[0].get("id") and
          "".join(d["function"].get("arguments", "") for d in deltas) ==
          doc["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
          "streamed tool-call deltas reassemble", deltas[:3])
finally:
    check(srv.stop() == 0, "clean exit")
finish()
