"""Start a real moed on a free loopback port and talk to it with curl (tests/server helpers)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import openapi_check

FAILS = []


def check(cond, what, *detail):
    """Record a failed expectation (printing both sides) without stopping the test."""
    if cond:
        return True
    msg = what + ("".join(" | " + repr(d)[:600] for d in detail))
    print("FAIL:", msg, flush=True)
    FAILS.append(msg)
    return False


def finish():
    if FAILS:
        print("%d check(s) failed" % len(FAILS))
        sys.exit(1)
    print("all checks passed")
    sys.exit(0)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, moed, model=None, args=(), env=None):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.log = tempfile.NamedTemporaryFile("w+", prefix="moed-", suffix=".log", delete=False)
        cmd = [moed, "--port", str(self.port), "--threads", "2"]
        if model:
            cmd += ["-m", model]
        cmd += list(args)
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("moed exited early:\n" + self.logtext())
            try:
                st, _, _ = curl(self, "GET", "/health", timeout=2)
                if st == 200:
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError("moed not ready in 60s:\n" + self.logtext())

    def logtext(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        return rc


def curl(srv, method, path, body=None, headers=(), raw=None, timeout=60, extra=()):
    """Returns (status, headers dict lower-case, body bytes)."""
    with tempfile.TemporaryDirectory() as d:
        hf, bf = os.path.join(d, "h"), os.path.join(d, "b")
        cmd = ["curl", "-sS", "-X", method, "-D", hf, "-o", bf, "--max-time", str(timeout),
               "-w", "%{http_code}", "-H", "Expect:"]
        for h in headers:
            cmd += ["-H", h]
        if body is not None or raw is not None:
            data = raw if raw is not None else json.dumps(body).encode()
            p = os.path.join(d, "req")
            with open(p, "wb") as f:
                f.write(data)
            cmd += ["-H", "Content-Type: application/json", "--data-binary", "@" + p]
        cmd += list(extra)
        cmd.append(srv.base + path)
        out = subprocess.run(cmd, capture_output=True, timeout=timeout + 5)
        status = int(out.stdout.decode() or 0)
        hdrs = {}
        if os.path.exists(hf):
            for line in open(hf, "rb").read().decode("latin1").split("\r\n"):
                if ":" in line:
                    k, v = line.split(":", 1)
                    hdrs[k.strip().lower()] = v.strip()
        b = open(bf, "rb").read() if os.path.exists(bf) else b""
        return status, hdrs, b


def sse_events(body):
    """Split an SSE body into (data strings, comment count)."""
    datas, comments = [], 0
    for block in body.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                datas.append(line[6:])
            elif line.startswith(":"):
                comments += 1
    return datas, comments


def validate(method, path, status, hdrs, body):
    """Check a response against proto/openapi.yaml; returns the parsed JSON (or SSE list)."""
    ctype = hdrs.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        datas, _ = sse_events(body)
        check(datas and datas[-1] == "[DONE]", "stream ends with [DONE]", datas[-1:] if datas else None)
        out = []
        for d in datas[:-1]:
            doc = json.loads(d)
            errs = openapi_check.validate_response(method, path, status, "text/event-stream", doc)
            check(not errs, "SSE event of %s %s matches openapi" % (method, path), errs, d)
            out.append(doc)
        return out
    if ctype.startswith("application/json"):
        doc = json.loads(body)
        errs = openapi_check.validate_response(method, path, status, "application/json", doc)
        check(not errs, "%s %s %d matches openapi" % (method, path, status), errs, body[:300])
        return doc
    errs = openapi_check.validate_response(method, path, status, ctype.split(";")[0], body.decode())
    check(not errs, "%s %s %d matches openapi" % (method, path, status), errs)
    return body


def call(srv, method, path, body=None, **kw):
    st, h, b = curl(srv, method, path, body, **kw)
    return st, h, validate(method, path, st, h, b)


def node_packages(npm, pkgs):
    """Skip (exit 77) without Node 20+ (the openai SDK needs it); install pkgs into the shared
    npm cache npm through tests/npm_install.sh (the installer and lock every suite uses), or
    fail (exit 1)."""
    try:
        ver = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        ver = ""
    if not ver or int(ver.lstrip("v").split(".")[0]) < 20:
        print("SKIP: the openai SDK needs Node 20+, found %r" % ver)
        sys.exit(77)
    here = os.path.dirname(os.path.abspath(__file__))
    if subprocess.run(["sh", os.path.join(here, "..", "npm_install.sh"), npm] + pkgs).returncode:
        print("FAIL: could not install the npm packages %s into %s" % (pkgs, npm))
        sys.exit(1)


def run_node(srv, npm, script, timeout):
    """Run the Node test script (beside this file) against srv; returns its exit status after
    printing what it wrote."""
    env = dict(os.environ, MOED_BASE=srv.base, MOED_NPM=os.path.abspath(npm))
    out = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)), script)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    print(out.stdout, out.stderr)
    return out.returncode
