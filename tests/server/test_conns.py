"""Connections: thousands of idle ones do not lock clients out, the cap displaces idle ones or
answers 503 + Retry-After, silent new connections time out, half-closed clients get answers.

usage: test_conns.py MOED MODEL
"""

import json
import os
import re
import resource
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, curl, finish  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]

# This process holds thousands of sockets too.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
N_IDLE = 2000
if hard < N_IDLE + 200:
    N_IDLE = max(100, hard - 200)
    print("note: open-file hard limit %d: holding %d idle connections" % (hard, N_IDLE))


def metric(srv, name):
    b = curl(srv, "GET", "/metrics")[2].decode()
    m = re.search(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), b, re.M)
    return float(m.group(2)) if m else None


def wait_metric(srv, name, pred, tries=100):
    v = None
    for _ in range(tries):
        v = metric(srv, name)
        if v is not None and pred(v):
            return v
        time.sleep(0.1)
    return v


def rss_kib(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def http_req(path, body=None, keep=True, method=None):
    data = json.dumps(body).encode() if body is not None else b""
    m = method or ("POST" if body is not None else "GET")
    head = "%s %s HTTP/1.1\r\nHost: x\r\n" % (m, path)
    if body is not None:
        head += "Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data)
    if not keep:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n" + data


def read_all(s, deadline):
    out = b""
    while time.time() < deadline:
        try:
            b = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            out += b"<RESET>"
            break
        if not b:
            break
        out += b
    return out


def timed_completion(srv):
    t0 = time.time()
    st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3,
                                                     "temperature": 0}, timeout=30)
    return st, d, time.time() - t0


# ---- 1. thousands of idle connections, then a normal request is served at once ----
srv = Server(moed, model, args=["--header-timeout", "60"])
idle = []
try:
    st, d, base_t = timed_completion(srv)
    check(st == 200, "baseline request", st, d)
    rss0 = rss_kib(srv.proc.pid)
    t0 = time.time()
    for i in range(N_IDLE):
        s = socket.socket()
        s.settimeout(10)
        s.connect(("127.0.0.1", srv.port))
        idle.append(s)
    n = wait_metric(srv, "moed:http_connections", lambda v: v >= N_IDLE)
    check(n is not None and n >= N_IDLE, "server holds %d idle connections" % N_IDLE, n)
    print("opened %d idle connections in %.2fs" % (N_IDLE, time.time() - t0))
    st, d, t = timed_completion(srv)
    check(st == 200, "request served beside %d idle connections" % N_IDLE, st, d)
    # "at once": no queueing behind the idle ones (a generous bound for a loaded 2-core box)
    check(t < max(2.0, 5 * base_t), "served at once", "%.3fs (baseline %.3fs)" % (t, base_t))
    print("completion: %.3fs with %d idle connections, %.3fs without" % (t, N_IDLE, base_t))
    per_conn = (rss_kib(srv.proc.pid) - rss0) * 1024.0 / N_IDLE
    print("resident memory per idle connection: %.0f bytes" % per_conn)
    # a per-connection 64 KiB read buffer would show here
    check(per_conn < 16384, "an idle connection costs little memory", per_conn)
    st, h, b = curl(srv, "GET", "/health")
    check(st == 200, "health beside the idle connections", st)
finally:
    for s in idle:
        s.close()
    idle = []
    check(srv.stop() == 0, "clean exit")

# ---- 2. at the cap: the longest idle connection makes room; none idle: 503 + Retry-After ----
CAP = 20
srv = Server(moed, model, args=["--max-connections", str(CAP), "--header-timeout", "60",
                                "--retry-after", "7"])
held = []
try:
    for i in range(CAP * 3):  # three times the cap of silent connections, each displacing one
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(5)
        held.append(s)
        time.sleep(0.002)  # accepted in order: the oldest is the longest idle
    n = wait_metric(srv, "moed:http_connections", lambda v: v <= CAP)
    check(n is not None and n <= CAP, "connections stay at the cap", n)
    st, d, t = timed_completion(srv)
    check(st == 200, "a client past the cap is served (an idle one made room)", st, d)
    first = held[0]
    first.settimeout(5)
    try:
        got = first.recv(10)
    except ConnectionResetError:
        got = b""
    check(got == b"", "the longest idle connection was closed", got)
    ev = metric(srv, "moed:http_connections_evicted_total")
    check(ev is not None and ev >= 2 * CAP, "evictions counted", ev)
    for s in held:
        s.close()
    held = []
    check(wait_metric(srv, "moed:http_connections", lambda v: v <= 1) is not None,
          "connections released")

    # fill the cap with connections that are mid-request (not idle: nothing to displace)
    def partial():
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        held.append(s)
    for i in range(CAP - 1):
        partial()
    # the scrape's own connection is the last free one
    n = wait_metric(srv, "moed:http_connections", lambda v: v >= CAP)
    check(n == CAP, "cap all but filled by requests in progress", n)
    partial()
    time.sleep(0.3)
    # the next client sends a request with a large body and still reads the 503 (no reset)
    body = b'{"prompt": "' + b"x" * 300000 + b'"}'
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(10)
    t0 = time.time()
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except (BrokenPipeError, ConnectionResetError):
        pass
    r = read_all(s, time.time() + 10)
    s.close()
    head, _, rbody = r.partition(b"\r\n\r\n")
    check(head.startswith(b"HTTP/1.1 503"), "over the cap: 503, not a reset", r[:120])
    check(b"\r\nRetry-After: 7" in head, "503 carries Retry-After", head)
    check(b"Connection: close" in head, "503 closes the connection", head)
    try:
        err = json.loads(rbody)["error"]
        check(err["code"] == 503 and err["type"] == "server_error", "503 error object", err)
    except ValueError:
        check(False, "503 body is JSON", rbody[:200])
    check(time.time() - t0 < 3, "503 at once", time.time() - t0)
    # plain curl sees the status too
    st, h, b = curl(srv, "GET", "/health", timeout=10)
    check(st == 503 and h.get("retry-after") == "7", "curl over the cap gets 503 + Retry-After",
          st, h)
    # once the in-progress requests go away, clients are served again
    for s in held:
        s.close()
    held = []
    wait_metric(srv, "moed:http_connections", lambda v: v <= 1)
    st, h, b = curl(srv, "GET", "/health")
    check(st == 200, "served again below the cap", st)
    rf = metric(srv, "moed:http_connections_refused_total")
    check(rf is not None and rf >= 2, "refusals counted", rf)
finally:
    for s in held:
        s.close()
    check(srv.stop() == 0, "clean exit")

# ---- 3. silent new connections time out; half-closed clients still get their answers ----
srv = Server(moed, model, args=["--header-timeout", "0.5", "--idle-timeout", "30"])
try:
    t0 = time.time()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(10)
    try:
        got = s.recv(10)
    except ConnectionResetError:
        got = b""
    dt = time.time() - t0
    s.close()
    check(got == b"" and dt < 3, "a connection that sends nothing is closed after header-timeout",
          got, dt)
    # a kept-alive connection after a request waits the (longer) idle timeout
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(10)
    s.sendall(http_req("/health"))
    r = s.recv(65536)
    check(r.startswith(b"HTTP/1.1 200"), "health on a keep-alive connection", r[:40])
    time.sleep(1.5)
    s.sendall(http_req("/health", keep=False))
    r = read_all(s, time.time() + 10)
    check(r.startswith(b"HTTP/1.1 200"), "keep-alive connection outlives header-timeout", r[:40])
    s.close()

    # half-close: whole request, then shutdown(SHUT_WR); the full response still arrives
    req = {"prompt": "half close", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(30)
        s.sendall(http_req("/v1/completions", dict(req, stream=stream)))
        s.shutdown(socket.SHUT_WR)
        r = read_all(s, time.time() + 60)
        s.close()
        head, _, body = r.partition(b"\r\n\r\n")
        check(head.startswith(b"HTTP/1.1 200"), "half-closed client answered (stream=%s)" % stream,
              r[:200])
        if stream:
            check(body.rstrip().endswith(b"0"), "chunked stream ends", body[-40:])
            check(b"data: [DONE]" in body, "half-closed stream gets [DONE]", body[-120:])
            check(body.count(b'"text"') >= 24, "half-closed stream gets every token",
                  body.count(b'"text"'))
        else:
            try:
                doc = json.loads(body)
                check(doc["usage"]["completion_tokens"] == 24, "half-closed: every token", doc)
            except ValueError:
                check(False, "half-closed: JSON body", body[:200])
    # pipelined requests, then half-close: both answered, in order
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(30)
    s.sendall(http_req("/health") + http_req("/v1/completions", dict(req, max_tokens=3)))
    s.shutdown(socket.SHUT_WR)
    r = read_all(s, time.time() + 60)
    s.close()
    check(re.findall(rb"HTTP/1.1 (\d+)", r) == [b"200", b"200"],
          "pipelined then half-closed: both answered", r[:300])

    # a client that closes entirely (FIN) mid-stream: its generation is cancelled
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(30)
    s.sendall(http_req("/v1/completions", dict(req, max_tokens=3000, stream=True)))
    got = b""
    while got.count(b"data: ") < 3:
        piece = s.recv(4096)
        if not piece:
            break
        got += piece
    check(metric(srv, "moed:num_requests_running") == 1, "stream running before the close")
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    v = wait_metric(srv, "moed:num_requests_running", lambda v: v == 0)
    check(v == 0, "a vanished client's stream is cancelled", v)
    check(wait_metric(srv, "moed:kv_cache_blocks_used", lambda v: v == 0) == 0,
          "its KV blocks freed")
    st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    check(st == 200, "still serving", st, d)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
