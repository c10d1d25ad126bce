"""Run test_sdk.mjs (official OpenAI Node SDK, needs Node 20+) against a real moed.

usage: test_sdk.py MOED MODEL NPM_DIR
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
SDK = "openai@6.49.0"
pkg = os.path.join(npm, "node_modules", "openai", "package.json")
if not os.path.exists(pkg):
    # Install the official SDK into the shared, git-ignored npm cache, under the lock the
    # tokenizer and template suites use, so concurrent installs do not collide.
    import fcntl
    os.makedirs(npm, exist_ok=True)
    with open(os.path.join(npm, ".install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(pkg):
            # Bounded: an unreachable registry fails the test in minutes, not at the
            # harness's timeout.
            try:
                r = subprocess.run(["npm", "install", "--prefix", npm, "--no-audit",
                                    "--no-fund", "--loglevel=error", "--fetch-retries=1",
                                    "--fetch-timeout=30000", SDK],
                                   capture_output=True, text=True, timeout=240)
                print(r.stdout, r.stderr)
            except subprocess.TimeoutExpired:
                print("npm install did not finish in 240 s (registry unreachable?)")
if not os.path.exists(pkg):
    print("FAIL: could not install the npm package %s into %s" % (SDK, npm))
    sys.exit(1)
# the SDK sends a bearer key: exercise auth on the way
srv = Server(moed, model, args=["--api-key", "test-key"])
try:
    env = dict(os.environ, MOED_BASE=srv.base, MOED_NPM=os.path.abspath(npm))
    out = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "test_sdk.mjs")],
                         env=env, capture_output=True, text=True, timeout=120)
    print(out.stdout, out.stderr)
    check(out.returncode == 0, "node SDK test passed", out.returncode)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
