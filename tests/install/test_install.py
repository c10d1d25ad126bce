"""meson install into a DESTDIR puts moed, its units, the sysusers snippet, the configuration
and the default models in their FHS places; a second install keeps an edited configuration;
the installed units pass systemd-analyze verify without a word and the installed binary runs.

usage: test_install.py BUILD_DIR
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

build = sys.argv[1]
FAILS = []


def check(cond, what, *detail):
    if not cond:
        msg = what + "".join(" | " + repr(d)[:400] for d in detail)
        print("FAIL:", msg, flush=True)
        FAILS.append(msg)
    return cond


meson = shutil.which("meson")
if not meson:
    print("SKIP: meson not on PATH")
    sys.exit(77)
opts = {o["name"]: o["value"] for o in json.loads(subprocess.run(
    [meson, "introspect", "--buildoptions", build], capture_output=True, text=True,
    check=True).stdout)}
prefix = opts["prefix"]


def under(d):
    return d if os.path.isabs(d) else os.path.join(prefix, d)


bindir, datadir, sysconfdir = under(opts["bindir"]), under(opts["datadir"]), under(opts["sysconfdir"])
unitdir = opts.get("systemdunitdir") or os.path.join(prefix, "lib/systemd/system")
sysusersdir = opts.get("sysusersdir") or os.path.join(prefix, "lib/sysusers.d")

dest = tempfile.mkdtemp(prefix="moed-destdir-")


def install():
    r = subprocess.run([meson, "install", "-C", build, "--no-rebuild", "--destdir", dest],
                       capture_output=True, text=True)
    check(r.returncode == 0, "meson install succeeds", r.returncode, r.stdout[-600:], r.stderr[-600:])
    return r


def at(p):
    return os.path.join(dest, p.lstrip("/"))


try:
    install()
    files = {
        "binary": os.path.join(bindir, "moed"),
        "service": os.path.join(unitdir, "moed.service"),
        "socket": os.path.join(unitdir, "moed.socket"),
        "sysusers": os.path.join(sysusersdir, "moed.conf"),
        "config": os.path.join(sysconfdir, "moed", "moed.conf"),
        "default model": os.path.join(datadir, "moed", "default.gguf"),
        "default draft": os.path.join(datadir, "moed", "default-draft.gguf"),
    }
    for what, p in files.items():
        check(os.path.isfile(at(p)), "%s installed at %s" % (what, p))
    check(os.access(at(files["binary"]), os.X_OK), "binary is executable")
    svc = open(at(files["service"])).read()
    check("ExecStart=%s --config %s" % (files["binary"], files["config"]) in svc,
          "service runs the installed binary with the installed config",
          [l for l in svc.splitlines() if l.startswith("ExecStart")])
    check(open(at(files["sysusers"])).read().split("\n")[1].startswith("u moed "),
          "sysusers snippet creates the moed user")

    # the installed config is the shipped one; the installed binary accepts it with the
    # installed model (run from the DESTDIR, the config's own paths being relative to it)
    conf = at(files["config"])
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "moed.conf")
    check(open(conf).read() == open(src).read(), "config is conf/moed.conf")
    r = subprocess.run([at(files["binary"]), "-c", conf, "-m", at(files["default model"]),
                        "--check-config"], capture_output=True, text=True)
    check(r.returncode == 0 and "configuration OK" in r.stdout,
          "installed binary accepts the installed config", r.returncode, r.stdout, r.stderr)

    # reinstall: an administrator's edits survive, the sample lands beside them
    with open(conf, "a") as f:
        f.write("\n# edited by the administrator\n")
    edited = open(conf).read()
    r = install()
    check(open(conf).read() == edited, "reinstall keeps the edited config")
    check(os.path.isfile(conf + ".sample"), "reinstall puts the new sample beside it")

    # the installed units verify without a word (paths made to point into the DESTDIR, where
    # systemd-analyze can see that the binary exists)
    sa = shutil.which("systemd-analyze")
    if sa:
        vdir = os.path.join(dest, "verify")
        os.makedirs(vdir)
        for u in ("moed.service", "moed.socket"):
            text = open(os.path.join(dest, unitdir.lstrip("/"), u)).read()
            text = text.replace(files["binary"], at(files["binary"]))
            open(os.path.join(vdir, u), "w").write(text)
        r = subprocess.run([sa, "verify", "--man=no", os.path.join(vdir, "moed.socket"),
                            os.path.join(vdir, "moed.service")], capture_output=True, text=True)
        err = "\n".join(l for l in (r.stdout + r.stderr).splitlines()
                        if "User=moed" not in l and "user moed" not in l.lower())
        check(r.returncode == 0 and not err.strip(), "systemd-analyze verify prints nothing",
              r.returncode, r.stdout, r.stderr)
    else:
        print("note: systemd-analyze missing, units not verified")
    for root, dirs, names in os.walk(dest):
        for n in names:
            print("installed:", os.path.relpath(os.path.join(root, n), dest))
finally:
    shutil.rmtree(dest, ignore_errors=True)
if FAILS:
    print("%d check(s) failed" % len(FAILS))
    sys.exit(1)
print("all checks passed")
