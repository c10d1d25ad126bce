"""Run test_sdk.mjs (official OpenAI Node SDK, needs Node 20+) against a real moed.

usage: test_sdk.py MOED MODEL NPM_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, finish, node_packages, run_node  # noqa: E402

moed, model, npm = sys.argv[1:4]
node_packages(npm, ["openai@6.49.0"])
# the SDK sends a bearer key: exercise auth on the way
srv = Server(moed, model, args=["--api-key", "test-key"])
try:
    rc = run_node(srv, npm, 'test_sdk.mjs', 120)
    check(rc == 0, 'node SDK test passed', rc)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
