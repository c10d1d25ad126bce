"""Run test_structured.mjs (structured outputs through the official OpenAI Node SDK, validated
with ajv; needs Node 20+) against a real moed.

usage: test_structured.py MOED MODEL NPM_DIR
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, finish  # noqa: E402

moed, model, npm = sys.argv[1:4]
try:
    ver = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
except FileNotFoundError:
    ver = ""
if not ver or int(ver.lstrip("v").split(".")[0]) < 20:
    print("SKIP: the openai SDK needs Node 20+, found %r" % ver)
    sys.exit(77)
PKGS = ["openai@6.49.0", "ajv@8.17.1", "ajv-formats@3.0.1"]
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
                                               "test_structured.mjs")],
                         env=env, capture_output=True, text=True, timeout=800)
    print(out.stdout, out.stderr)
    check(out.returncode == 0, "structured-output SDK test passed", out.returncode)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
