"""What users try by hand: stop strings spanning tokens, n=2 streams, keep-alive reuse, many
clients vanishing at once, huge max_tokens, over-long prompts, SIGHUP key reload.

usage: test_edge.py MOED MODEL
"""

import json
import os
import re
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, curl, finish  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]
keyfile = tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False)
keyfile.write("# keys\nfirst-key\n")
keyfile.close()
AUTH = ["Authorization: Bearer first-key"]


def metric(srv, name):
    b = curl(srv, "GET", "/metrics", headers=AUTH)[2].decode()
    m = re.search(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), b, re.M)
    return float(m.group(2)) if m else None


def http_req(path, body, keep=True):
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer first-key\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(data), b"" if keep else b"Connection: close\r\n")) + data


def read_response(s, deadline):
    """One HTTP/1.1 response (Content-Length or chunked) from socket s: (status, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf and time.time() < deadline:
        piece = s.recv(65536)
        if not piece:
            break
        buf += piece
    head, _, rest = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0
    m = re.search(rb"(?i)content-length: *(\d+)", head)
    if m:
        n = int(m.group(1))
        while len(rest) < n and time.time() < deadline:
            piece = s.recv(65536)
            if not piece:
                break
            rest += piece
        return status, rest[:n]
    body = b""
    while time.time() < deadline:  # chunked
        while b"\r\n" not in rest and time.time() < deadline:
            piece = s.recv(65536)
            if not piece:
                return status, body
            rest += piece
        line, _, rest = rest.partition(b"\r\n")
        size = int(line, 16)
        while len(rest) < size + 2 and time.time() < deadline:
            piece = s.recv(65536)
            if not piece:
                return status, body
            rest += piece
        body += rest[:size]
        rest = rest[size + 2:]
        if size == 0:
            return status, body
    return status, body


srv = Server(moed, model, args=["--api-key-file", keyfile.name, "--ctx-size", "256",
                                "--max-tokens-cap", "100000"])
try:
    # ---- stop strings that span two tokens, streamed and not, with n=2 ----
    base = {"prompt": "The story begins", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    st, h, full = call(srv, "POST", "/v1/completions", dict(base, logprobs=1), headers=AUTH)
    toks = full["choices"][0]["logprobs"]["tokens"]
    text = full["choices"][0]["text"]
    check(st == 200 and "".join(toks) == text, "logprob tokens spell the text", toks, text)
    stop = None
    for k in range(1, len(toks) - 1):
        a, b = toks[k], toks[k + 1]
        if len(a) >= 2 and len(b) >= 2:
            cand = a[-2:] + b[:2]
            pos = text.find(cand)
            if pos == len("".join(toks[:k + 1])) - 2:  # first occurrence is the spanning one
                stop = cand
                cut = text[:pos]
                break
    if check(stop is not None, "found a stop string spanning two tokens", toks):
        st, h, r = call(srv, "POST", "/v1/completions", dict(base, stop=stop), headers=AUTH)
        check(r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop",
              "spanning stop cuts (non-streaming)", r["choices"][0], cut)
        st, h, evs = call(srv, "POST", "/v1/completions",
                          dict(base, stop=["never-appears", stop], stream=True, n=2,
                               stream_options={"include_usage": True}), headers=AUTH)
        for i in range(2):
            got = "".join(e["choices"][0]["text"] for e in evs
                          if e.get("choices") and e["choices"][0]["index"] == i)
            fins = [e["choices"][0]["finish_reason"] for e in evs
                    if e.get("choices") and e["choices"][0]["index"] == i
                    and e["choices"][0]["finish_reason"]]
            check(got == cut, "spanning stop held back in stream, choice %d" % i, got, cut)
            check(fins == ["stop"], "one finish chunk for choice %d" % i, fins)
            check(all(stop not in e["choices"][0]["text"] for e in evs if e.get("choices")),
                  "no chunk leaks the stop string")
        check(evs[-1].get("usage") and evs[-1]["choices"] == [], "usage chunk last", evs[-1])

    # ---- keep-alive: a streamed and a plain response on one connection, then a third ----
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(30)
    dl = time.time() + 60
    s.sendall(http_req("/v1/completions", dict(base, max_tokens=4, stream=True)))
    st1, b1 = read_response(s, dl)
    s.sendall(http_req("/v1/completions", dict(base, max_tokens=4)))
    st2, b2 = read_response(s, dl)
    s.sendall(http_req("/tokenize", {"content": "hello"}, keep=False))
    st3, b3 = read_response(s, dl)
    s.close()
    check(st1 == 200 and b1.rstrip().endswith(b"data: [DONE]"), "stream on a kept-alive connection",
          st1, b1[-80:])
    check(st2 == 200 and json.loads(b2)["choices"][0]["finish_reason"] == "length",
          "second request on the same connection", st2, b2[:200])
    check(st3 == 200 and json.loads(b3)["count"] >= 1, "third request on the same connection", st3, b3)

    # ---- 20 streaming clients vanish at once: every sequence and KV block comes back ----
    socks = []
    for i in range(20):
        c = socket.create_connection(("127.0.0.1", srv.port))
        c.settimeout(30)
        c.sendall(http_req("/v1/completions" if i % 2 else "/v1/chat/completions",
                           {"prompt": "client %d" % i, "max_tokens": 200, "ignore_eos": True,
                            "stream": True} if i % 2 else
                           {"messages": [{"role": "user", "content": "client %d" % i}],
                            "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2}))
        socks.append(c)
    for c in socks:  # each has started streaming
        got, dl = b"", time.time() + 60
        while got.count(b"data: ") < 3 and time.time() < dl:
            piece = c.recv(65536)
            if not piece:
                break
            got += piece
        check(got.count(b"data: ") >= 3, "client streaming before the disconnect", got[:120])
    running = metric(srv, "moed:num_requests_running")
    check(running is not None and running >= 20, "sequences running before the disconnect", running)
    for c in socks:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        c.close()  # RST, like a killed client
    for _ in range(100):
        if metric(srv, "moed:num_requests_running") == 0 and metric(srv, "moed:kv_cache_blocks_used") == 0:
            break
        time.sleep(0.1)
    check(metric(srv, "moed:num_requests_running") == 0, "all 30 sequences freed")
    check(metric(srv, "moed:kv_cache_blocks_used") == 0, "all KV blocks freed")
    check(metric(srv, "moed:http_connections") in (None, 1.0), "connections closed",
          metric(srv, "moed:http_connections"))
    st, h, d = call(srv, "POST", "/v1/completions", dict(base, max_tokens=3), headers=AUTH)
    check(st == 200, "serving after the mass disconnect", st, d)

    # ---- limits a user hits by hand ----
    st, h, d = call(srv, "POST", "/v1/completions", dict(base, max_tokens=10 ** 9), headers=AUTH)
    check(st == 400 and d["error"]["param"] == "max_tokens", "huge max_tokens is 400", st, d)
    st, h, d = call(srv, "POST", "/v1/completions", dict(base, max_tokens=1e300), headers=AUTH)
    check(st == 400 and len(d["error"]["message"]) < 200, "1e300 max_tokens: short message", st, d)
    st, h, d = call(srv, "POST", "/v1/completions", dict(base, max_tokens=255), headers=AUTH)
    check(st == 400 and d["error"]["code"] == "context_length_exceeded", "prompt + max_tokens > ctx",
          st, d)
    st, h, d = call(srv, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "word " * 400}], "stream": True},
                    headers=AUTH)
    check(st == 400 and d["error"]["code"] == "context_length_exceeded", "long prompt (stream) 400",
          st, d)
    st, h, d = call(srv, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2,
                     "temperature": 0}, headers=AUTH)
    check(st == 200 and d["choices"][0]["message"] == d["choices"][1]["message"],
          "greedy n=2 choices agree", st, d)

    # ---- SIGHUP re-reads the key file; a broken file keeps the old keys ----
    with open(keyfile.name, "w") as f:
        f.write("second-key\n")
    srv.proc.send_signal(signal.SIGHUP)
    ok = False
    for _ in range(50):
        if curl(srv, "GET", "/v1/models", headers=["Authorization: Bearer second-key"])[0] == 200:
            ok = True
            break
        time.sleep(0.1)
    check(ok, "SIGHUP loads the new key")
    check(curl(srv, "GET", "/v1/models", headers=AUTH)[0] == 401, "old key refused after SIGHUP")
    os.unlink(keyfile.name)
    srv.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    check(srv.proc.poll() is None, "SIGHUP with a missing key file does not kill the server")
    check(curl(srv, "GET", "/v1/models", headers=["Authorization: Bearer second-key"])[0] == 200,
          "failed reload keeps the keys")
finally:
    rc = srv.stop()
    check(rc == 0, "clean exit (sanitizers: no leaks)", rc, srv.logtext()[-3000:])
finish()
