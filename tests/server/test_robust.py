"""Disconnects, overload, malformed and slow clients, auth, limits, drain, --check-config.

usage: test_robust.py MOED MODEL
"""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, curl, finish, sse_events  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]


def raw(srv, data, wait=2.0, read=True):
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(wait)
    s.sendall(data)
    out = b""
    if read:
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                out += b
        except socket.timeout:
            pass
    s.close()
    return out


def metric(srv, name):
    b = curl(srv, "GET", "/metrics", headers=AUTH)[2].decode()
    m = re.search(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), b, re.M)
    return float(m.group(2)) if m else None


AUTH = ["Authorization: Bearer sekret"]
LONG = {"prompt": "stream forever", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
        "stream": True}

srv = Server(moed, model, args=["--header-timeout", "0.5", "--idle-timeout", "1.5",
                                "--max-header-bytes", "4096", "--heartbeat-interval", "0.05",
                                "--step-tokens", "16", "--api-key", "sekret"])
AUTH = ["Authorization: Bearer sekret"]
try:
    # auth: /health open, others need the key
    check(curl(srv, "GET", "/health")[0] == 200, "health needs no key")
    check(call(srv, "GET", "/v1/models")[0] == 401, "no key 401")
    st, h, d = call(srv, "GET", "/v1/models", headers=["Authorization: Bearer wrong"])
    check(st == 401 and d["error"]["code"] == "invalid_api_key", "wrong key 401", st, d)
    check(call(srv, "GET", "/v1/models", headers=AUTH)[0] == 200, "right key 200")

    # client disconnects mid-stream: its sequence and KV blocks are freed
    body = json.dumps(LONG).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    s.settimeout(30)
    got = b""
    while got.count(b"data: ") < 5:
        piece = s.recv(4096)
        if not piece:
            break
        got += piece
    running = metric(srv, "moed:num_requests_running")
    used = metric(srv, "moed:kv_cache_blocks_used")
    check(running == 1 and used and used > 0, "one sequence running mid-stream", running, used)
    s.close()
    for _ in range(50):
        if metric(srv, "moed:num_requests_running") == 0:
            break
        time.sleep(0.1)
    check(metric(srv, "moed:num_requests_running") == 0, "disconnect frees the sequence")
    check(metric(srv, "moed:kv_cache_blocks_used") == 0, "disconnect frees KV blocks")
    b = curl(srv, "GET", "/metrics", headers=AUTH)[2].decode()
    check(re.search(r'finished_reason="abort"\} [1-9]', b), "abort counted")
    st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3}, headers=AUTH)
    check(st == 200, "still serving after a disconnect", st, d)

    # heartbeats during a long prefill (16-token steps over a long prompt)
    # Size the prompt in tokens (whatever the model's vocabulary): about 3000, under the
    # default 4096-token context.
    st, h, d = call(srv, "POST", "/tokenize", {"content": "lorem ipsum " * 100}, headers=AUTH)
    per100 = max(1, len(d["tokens"]))
    long_prompt = "lorem ipsum " * (100 * 3000 // per100)
    st, h, b = curl(srv, "POST", "/v1/completions", {"prompt": long_prompt,
                                                     "max_tokens": 2, "stream": True}, headers=AUTH)
    datas, comments = sse_events(b)
    check(st == 200 and datas[-1] == "[DONE]", "long-prefill stream ends", st, datas[-1:])
    check(comments >= 1, "heartbeat comments during prefill", comments)

    # malformed HTTP, oversized head, slow head, idle timeout, pipelining
    r = raw(srv, b"GARBAGE / NOTHTTP\r\n\r\n")
    check(r.startswith(b"HTTP/1.1 400"), "malformed request line 400", r[:80])
    r = raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    check(r.startswith(b"HTTP/1.1 431"), "oversized head 431", r[:80])
    t0 = time.time()
    r = raw(srv, b"GET /health HTTP/1.1\r\nHo", wait=5)
    check(r.startswith(b"HTTP/1.1 408") and time.time() - t0 < 4, "slow head 408", r[:80])
    t0 = time.time()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(5)
    closed = s.recv(10) == b""
    check(closed and time.time() - t0 < 4, "idle connection closed", time.time() - t0)
    s.close()
    r = raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer sekret\r\nConnection: close\r\n\r\n", wait=3)
    parts = re.findall(rb"HTTP/1.1 (\d+)", r)
    check(parts == [b"200", b"404"], "pipelined responses in order", parts)
    # invalid UTF-8 in JSON and a chunked oversized body
    st, h, d = call(srv, "POST", "/v1/chat/completions", raw=b'{"messages":[{"role":"user","content":"\xc3\x28"}]}',
                    headers=AUTH)
    check(st == 400, "invalid UTF-8 400", st, d)
    r = raw(srv, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
            b"".join(b"100000\r\n" + b"a" * 0x100000 + b"\r\n" for _ in range(5)), wait=3)
    check(r.startswith(b"HTTP/1.1 413"), "chunked oversized body 413", r[:80])
    check(curl(srv, "GET", "/health")[0] == 200, "healthy after abuse")

    # clients that reset the connection right after a streaming request (chat: the stream
    # start writes a role chunk per choice; n=4) while its stream is being started: every
    # generation is freed, nothing leaks, the server keeps serving (run under ASan too)
    for i in range(40):
        chat = i % 2 == 0
        req = dict(LONG, max_tokens=50)
        if chat:
            req.pop("prompt")
            req["messages"] = [{"role": "user", "content": "reset %d" % i}]
            req["n"] = 4
        data = json.dumps(req).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (b"/v1/chat/completions" if chat else b"/v1/completions", len(data)) + data)
        if i % 4 == 1:
            time.sleep(0.002)
        s.close()  # SO_LINGER 0: RST
    for _ in range(100):
        if (metric(srv, "moed:num_requests_running") == 0 and
                metric(srv, "moed:num_requests_waiting") == 0 and
                metric(srv, "moed:http_requests_in_flight") == 1):
            break
        time.sleep(0.1)
    check(metric(srv, "moed:num_requests_running") == 0, "reset clients: sequences freed")
    check(metric(srv, "moed:kv_cache_blocks_used") == 0, "reset clients: KV blocks freed")
    check(metric(srv, "moed:http_requests_in_flight") == 1, "reset clients: no request left",
          metric(srv, "moed:http_requests_in_flight"))
    st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3}, headers=AUTH)
    check(st == 200, "still serving after reset clients", st, d)
finally:
    check(srv.stop() == 0, "clean exit")

# overload: a one-slot queue answers 429 with Retry-After
# The two clients ask for far more tokens than they will get (they are terminated below), so
# the slot stays busy however fast the model and machine are.
srv = Server(moed, model, args=["--max-seqs", "1", "--max-queue", "1", "--retry-after", "3",
                                "--ctx-size", "65536", "--max-tokens-cap", "60000",
                                "--drain-timeout", "1"])
try:
    def hog():
        return subprocess.Popen(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                                 "-H", "Content-Type: application/json", "-d",
                                 json.dumps(dict(LONG, max_tokens=60000)),
                                 srv.base + "/v1/completions"], stdout=subprocess.PIPE, text=True)

    def wait_for(running, waiting):
        # bounded: slow (sanitizer, loaded) machines need more than a fixed sleep
        for _ in range(300):
            if (metric(srv, "moed:num_requests_running") == running and
                    metric(srv, "moed:num_requests_waiting") == waiting):
                return True
            time.sleep(0.1)
        return False

    # two together: both are accepted (the not-yet-admitted one takes the free slot, not the
    # queue), then one runs and one waits
    procs = [hog(), hog()]
    check(wait_for(1, 1), "one slot + one-deep queue: two requests together, one runs, one waits",
          metric(srv, "moed:num_requests_running"), metric(srv, "moed:num_requests_waiting"))
    st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=20)
    check(st == 429 and h.get("retry-after") == "3", "queue full 429 + Retry-After", st, h)
    check((d or {}).get("error", {}).get("type") == "rate_limit_error", "429 error object", d)
    for p in procs:
        p.terminate()
        p.wait()
    for _ in range(50):
        st, h, d = call(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        if st == 200:
            break
        time.sleep(0.1)
    check(st == 200, "served again once the clients left", st, d)
finally:
    check(srv.stop() == 0, "clean exit")

# drain: SIGTERM lets a short stream finish, cancels a long one after the grace period
srv = Server(moed, model, args=["--drain-timeout", "1"])
try:
    out = tempfile.NamedTemporaryFile(delete=False)
    p = subprocess.Popen(["curl", "-sSN", "-H", "Content-Type: application/json", "-d",
                          json.dumps(dict(LONG, max_tokens=4000)), srv.base + "/v1/completions"],
                         stdout=out)
    time.sleep(0.5)
    t0 = time.time()
    rc = srv.stop(signal.SIGTERM)
    p.wait(timeout=10)
    datas, _ = sse_events(open(out.name, "rb").read())
    check(rc == 0, "drain exits 0", rc)
    check(time.time() - t0 < 8, "drain within the grace period", time.time() - t0)
    check(datas and datas[-1] == "[DONE]", "cancelled stream still ends with [DONE]", datas[-2:])
    fins = [json.loads(x)["choices"][0]["finish_reason"] for x in datas[:-1]
            if json.loads(x)["choices"] and json.loads(x)["choices"][0]["finish_reason"]]
    check(fins == ["abort"], "cancelled at the grace period", fins)
finally:
    srv.stop()

# --check-config: good and bad files
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("[server]\nport = 9999\n[engine]\nmax-seqs = 4\n")
r = subprocess.run([moed, "-c", f.name, "-m", model, "--check-config"], capture_output=True, text=True)
check(r.returncode == 0 and "OK" in r.stdout, "good config OK", r.returncode, r.stdout, r.stderr)
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("[server]\nport = 9999\n\n[engine]\nmax-seqs = lots\n")
r = subprocess.run([moed, "-c", f.name, "-m", model, "--check-config"], capture_output=True, text=True)
check(r.returncode != 0 and "%s:5:" % f.name in r.stderr, "bad config names file:line", r.stderr)
r = subprocess.run([moed, "-m", model, "--port", "99999", "--check-config"], capture_output=True, text=True)
check(r.returncode != 0 and "port" in r.stderr, "bad flag rejected", r.stderr)
r = subprocess.run([moed, "-c", f.name, "--max-seqs", "8", "-m", model, "--check-config"],
                   capture_output=True, text=True)
check(r.returncode != 0, "file errors are reported even when a flag overrides", r.stderr)
finish()
