"""Run test_tools.mjs (tool calling through the official OpenAI Node SDK, arguments validated
with ajv; needs Node 20+) against a real moed.

usage: test_tools.py MOED MODEL NPM_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, finish, node_packages, run_node  # noqa: E402

moed, model, npm = sys.argv[1:4]
node_packages(npm, ["openai@6.49.0", "ajv@8.17.1"])
# the SDK sends a bearer key: exercise auth on the way
# the tool formats of other chat templates, on the same model (its tokenizer writes their
# markers as plain text; the grammar and the parser do the rest)
for family in ["mistral-nemo", "llama3.1"]:
    srv = Server(moed, model, args=["--api-key", "test-key", "--chat-template", family])
    try:
        os.environ["MOED_TOOL_FAMILY"] = family
        rc = run_node(srv, npm, 'test_tools.mjs', 300)
        check(rc == 0, 'tool-calling SDK test passed with the %s template' % family, rc)
    finally:
        check(srv.stop() == 0, "clean exit (%s)" % family)
os.environ.pop("MOED_TOOL_FAMILY", None)
srv = Server(moed, model, args=["--api-key", "test-key"])
try:
    rc = run_node(srv, npm, 'test_tools.mjs', 300)
    check(rc == 0, 'tool-calling SDK test passed', rc)
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
