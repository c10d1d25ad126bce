"""SIGHUP re-reads the config file: log-level, log-format and API keys change without a restart;
a broken file keeps the running configuration; options given as flags still win.

usage: test_reload.py MOED MODEL
"""

import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, curl, finish  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]


def write_conf(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def hup(srv, want):
    """Send SIGHUP and wait until the log has one more line containing want."""
    before = srv.logtext().count(want)
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 10
    while time.time() < deadline:
        if srv.logtext().count(want) > before:
            return True
        time.sleep(0.05)
    return False


def access_lines(srv, path, json_format=False):
    """Access-log lines of GET path so far."""
    text = srv.logtext()
    if json_format:
        return [l for l in text.splitlines() if '"path":"%s"' % path in l]
    return [l for l in text.splitlines() if " info req=" in l and (" GET %s " % path) in l]


conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False).name
write_conf(conf, "[log]\nlog-level = warn\n")
srv = Server(moed, model, args=["-c", conf])
try:
    # warn: requests leave no access line
    check(curl(srv, "GET", "/v1/models")[0] == 200, "models at warn")
    time.sleep(0.2)
    check(not access_lines(srv, "/v1/models"), "no access line at log-level warn",
          srv.logtext()[-600:])

    # info: after SIGHUP the same request is logged
    write_conf(conf, "[log]\nlog-level = info\n")
    check(hup(srv, "SIGHUP: configuration reloaded"), "SIGHUP reload is logged at the new level",
          srv.logtext()[-600:])
    check(curl(srv, "GET", "/v1/models")[0] == 200, "models at info")
    time.sleep(0.2)
    check(len(access_lines(srv, "/v1/models")) == 1, "access line at log-level info after SIGHUP",
          srv.logtext()[-600:])

    # json format and an API key from the file
    write_conf(conf, "[security]\napi-key = k1\n[log]\nlog-level = info\nlog-format = json\n")
    check(hup(srv, '"msg":"SIGHUP: configuration reloaded'), "json after SIGHUP",
          srv.logtext()[-600:])
    check(curl(srv, "GET", "/v1/models")[0] == 401, "api-key from the reloaded file required")
    check(curl(srv, "GET", "/v1/models", headers=["Authorization: Bearer k1"])[0] == 200,
          "api-key from the reloaded file accepted")
    time.sleep(0.2)
    check(len(access_lines(srv, "/v1/models", json_format=True)) == 2, "json access lines",
          srv.logtext()[-800:])

    # a broken file: one error line naming file:line, the running configuration stays
    write_conf(conf, "[log]\nlog-level = loud\n")
    check(hup(srv, "keeping the old configuration"), "broken file reported", srv.logtext()[-600:])
    check("%s:2:" % conf in srv.logtext(), "the error names file:line", srv.logtext()[-600:])
    check(srv.proc.poll() is None, "server alive after a broken reload")
    check(curl(srv, "GET", "/v1/models")[0] == 401, "old key still required")
    check(curl(srv, "GET", "/v1/models", headers=["Authorization: Bearer k1"])[0] == 200,
          "old key still accepted")
    time.sleep(0.2)
    check(len(access_lines(srv, "/v1/models", json_format=True)) == 4, "still json at info",
          srv.logtext()[-800:])

    # removing the keys from the file opens the API again
    write_conf(conf, "[log]\nlog-level = info\n")
    check(hup(srv, "SIGHUP: configuration reloaded"), "reload back to text")
    check(curl(srv, "GET", "/v1/models")[0] == 200, "no key needed once removed from the file")
finally:
    check(srv.stop() == 0, "clean exit")

# flags win over the file on reload too
write_conf(conf, "[log]\nlog-level = warn\n")
srv = Server(moed, model, args=["-c", conf, "--log-level", "info"])
try:
    write_conf(conf, "[log]\nlog-level = error\n")
    check(hup(srv, "SIGHUP: configuration reloaded"), "reload logged at the flag's level",
          srv.logtext()[-600:])
    check(curl(srv, "GET", "/v1/models")[0] == 200, "models")
    time.sleep(0.2)
    check(len(access_lines(srv, "/v1/models")) >= 1, "--log-level info still wins after SIGHUP",
          srv.logtext()[-600:])
finally:
    check(srv.stop() == 0, "clean exit")
os.unlink(conf)
finish()
