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
