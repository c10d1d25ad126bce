"""Run test_structured.mjs (structured outputs through the official OpenAI Node SDK, validated
with ajv; needs Node 20+) against a real moed.

usage: test_structured.py MOED MODEL NPM_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, finish, node_packages, run_node  # noqa: E402

moed, model, npm = sys.argv[1:4]
node_packages(npm, ["openai@6.49.0", "ajv@8.17.1", "ajv-formats@3.0.1"])
# the SDK sends a bearer key: exercise auth on the way
srv = Server(moed, model, args=["--api-key", "test-key"])
try:
    rc = run_node(srv, npm, 'test_structured.mjs', 800)
    check(rc == 0, 'structured-output SDK test passed', rc)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
