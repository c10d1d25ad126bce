"""Waiting for a server a bench script started: until GET /health on 127.0.0.1 answers 200.

Used by the bench scripts that start moed (or llama-server) themselves."""
import http.client
import time


def wait_health(port, proc=None, timeout=120.0, interval=0.1, log=None):
    """Poll /health every interval seconds until it answers 200. Exits with a message when
    proc (a Popen) ends first or timeout seconds pass, with the tail of log (an open file, or
    a path) when given."""
    deadline = time.time() + timeout
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        dead = proc is not None and proc.poll() is not None
        if dead or time.time() > deadline:
            tail = ""
            if log is not None:
                if hasattr(log, "seek"):
                    log.seek(0)
                    tail = log.read()[-1500:]
                else:
                    with open(log) as f:
                        tail = f.read()[-1500:]
            raise SystemExit("server on port %d %s: %s" % (
                port, "exited" if dead else "not ready in %.0f s" % timeout, tail))
        time.sleep(interval)
