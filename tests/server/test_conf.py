"""conf/moed.conf documents every option and passes --check-config; moed.service verifies.

usage: test_conf.py MOED MODEL SOURCE_ROOT
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import check, finish  # noqa: E402

moed, model, root = sys.argv[1:4]
conf = os.path.join(root, "conf", "moed.conf")
helptext = subprocess.run([moed, "--help"], capture_output=True, text=True).stdout
flags = re.findall(r"--([a-z][a-z0-9-]+) ", helptext)
keys = set(re.findall(r"^([a-z][a-z0-9-]*) =", open(conf).read(), re.M))
opts = [f for f in flags if f not in ("config", "check-config", "help", "version")]
check(len(opts) > 20, "help lists the options", opts)
for o in opts:
    check(o in keys, "conf/moed.conf documents '%s'" % o)
for k in keys:
    check(k in opts, "conf key '%s' is an option" % k)
r = subprocess.run([moed, "-c", conf, "-m", model, "--check-config"], capture_output=True, text=True)
check(r.returncode == 0, "shipped config passes --check-config", r.stdout, r.stderr)
# flags win over the file
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("[server]\nport = 1234\n")
r = subprocess.run([moed, "-c", f.name, "--port", "4321", "-m", model, "--check-config"],
                   capture_output=True, text=True)
check(":4321" in r.stdout, "flag wins over file", r.stdout)


def run(*args):
    return subprocess.run([moed] + list(args), capture_output=True, text=True, timeout=30)


# A KV pool too small for one full context cannot work: refused at load with the numbers.
r = run("-m", model, "--port", "0", "--kv-blocks", "3", "--ctx-size", "256")
check(r.returncode != 0 and "kv-blocks 3 cannot hold one full context of 256 tokens (needs 17"
      in r.stderr and r.stderr.count("cannot hold") == 1, "too few kv-blocks refused once, clearly",
      r.returncode, r.stderr[-400:])


# --help, --version, unknown flags, bad values: exit codes and one-line messages
r = run("--help")
check(r.returncode == 0 and r.stdout.startswith("usage:"), "--help exits 0 with usage", r.returncode)
r = run("--version")
check(r.returncode == 0 and re.match(r"moed \d+\.\d+", r.stdout), "--version", r.stdout)
for bad, word in [(["--bogus"], "bogus"), (["--port"], "needs a value"), (["--port=abc"], "port"),
                  (["stray.gguf"], "stray.gguf"), (["--threads", "-1"], "threads"),
                  (["--drain-timeout", "nan"], "drain-timeout"), (["--log-level", "loud"], "log-level"),
                  (["--host", '"127.0.0.1"'], "host"), (["--host", "example.com"], "host"),
                  (["-c"], "-c"), (["-c", "/nonexistent/moed.conf"], "/nonexistent/moed.conf"),
                  (["--expert-device", "gpu"], "sim[:COPY_MBPS"),
                  (["--expert-device", "sim:fast"], "expert-device"),
                  (["--expert-device", "sim:1:2:3"], "expert-device")]:
    r = run(*(["-m", model, "--check-config"] + bad))
    check(r.returncode == 2 and word in r.stderr and not r.stdout, "rejected: %s" % bad,
          r.returncode, r.stdout, r.stderr)
for host in ["::1", "localhost", "0.0.0.0"]:
    r = run("--host", host, "-m", model, "--check-config")
    check(r.returncode == 0, "host %s accepted" % host, r.stderr)
for dev in ["auto", "none", "cuda", "sim", "sim:100", "sim:0:2.5"]:
    r = run("--expert-device", dev, "-m", model, "--check-config")
    check(r.returncode == 0, "expert-device %s accepted" % dev, r.stderr)

# the line named with an INI error is the line of the message, even with later errors
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("[server]\nport = abc\nbogus = 1\n")
r = run("-c", f.name, "-m", model, "--check-config")
check(r.returncode == 2 and "%s:2: 'port' needs an integer" % f.name in r.stderr,
      "first INI error names its own line", r.stderr)
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("[server]\nthis line is junk\nbogus = 1\n")
r = run("-c", f.name, "-m", model, "--check-config")
check(r.returncode == 2 and "%s:2: syntax error" % f.name in r.stderr,
      "syntax error is not reported with a later key's message", r.stderr)
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("port = 1\n")
r = run("-c", f.name, "-m", model, "--check-config")
check(r.returncode == 2 and "%s:1:" % f.name in r.stderr and "[server]" in r.stderr,
      "key outside its section", r.stderr)

unit = os.path.join(root, "systemd", "moed.service")
sa = shutil.which("systemd-analyze")
if sa:
    with tempfile.TemporaryDirectory() as d:
        text = open(unit).read().replace("/usr/bin/moed", os.path.abspath(moed))
        p = os.path.join(d, "moed.service")
        open(p, "w").write(text)
        r = subprocess.run([sa, "verify", "--man=no", p], capture_output=True, text=True)
        err = "\n".join(l for l in r.stderr.splitlines() if "User=moed" not in l and "user moed" not in l.lower())
        check(r.returncode == 0 and not err.strip(), "systemd-analyze verify is silent", r.returncode, r.stderr)
        check("Type=notify" in text, "unit is Type=notify")
else:
    print("note: systemd-analyze missing, unit not verified")
finish()
