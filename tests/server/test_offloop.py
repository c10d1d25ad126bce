"""Tokenizing a long prompt does not stop the loop thread: while a chat request with a prompt of
hundreds of thousands of characters is being tokenized, /health on another connection still
answers at once.

The chat's prompt is far longer than the model's context, so after tokenizing it moed answers a
small 400 (context_length_exceeded): the request's time is its tokenization (the body's upload
and JSON parse are a few ms of it). Health probes go out one after another on a second
connection for as long as the chat is pending. If the loop thread tokenized, one probe would
wait for most of the tokenization; off the loop, each answers in about a millisecond. The bound
is generous (half the chat's own time, which grows with the machine's load as a probe's delay
does), three tries are allowed, and the prompt grows until tokenizing it takes >= 100 ms, so a
fast machine tests the same thing.

usage: test_offloop.py MOED MODEL
"""

import http.client
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, check, finish  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]
VERSE = "In the beginning God created the heaven and the earth. "


def chat_body(n_chars):
    text = (VERSE * (n_chars // len(VERSE) + 1))[:n_chars]
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1})


def timed_chat(srv, body):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    doc = json.loads(r.read())
    c.close()
    return time.perf_counter() - t0, r.status, doc


def probe_while_pending(srv, body):
    """Send the chat, then /health probes back to back until the chat's answer arrives.
    Returns (the chat's seconds, its status, [each probe's seconds])."""
    chat = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    health = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    health.request("GET", "/health")  # connected and warm before the chat goes
    health.getresponse().read()
    t0 = time.perf_counter()
    chat.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    chat.sock.setblocking(False)
    lat = []
    done = None
    while done is None and time.perf_counter() - t0 < 120:
        t1 = time.perf_counter()
        health.request("GET", "/health")
        health.getresponse().read()
        lat.append(time.perf_counter() - t1)
        try:
            if chat.sock.recv(1, 2):  # MSG_PEEK: the chat's answer has started to arrive
                done = time.perf_counter() - t0
        except BlockingIOError:
            pass
    chat.sock.setblocking(True)
    r = chat.getresponse()
    r.read()
    chat.close()
    health.close()
    return done or time.perf_counter() - t0, r.status, lat


srv = Server(moed, model)
try:
    n = 400_000
    while True:
        t, st, doc = timed_chat(srv, chat_body(n))
        check(st == 400 and doc["error"]["code"] == "context_length_exceeded",
              "a prompt past the context is tokenized, then refused", st, doc)
        if t >= 0.1 or n * 2 > 3_500_000:
            break
        n *= 2
    print("prompt of %d characters: %.0f ms to tokenize and refuse" % (n, t * 1000))
    body = chat_body(n)
    tries = []
    for _ in range(3):
        t_chat, st, lat = probe_while_pending(srv, body)
        tries.append((t_chat, lat))
        print("chat pending %.0f ms: %d /health probes, slowest %.1f ms, median %.1f ms" % (
            t_chat * 1000, len(lat), max(lat) * 1000, sorted(lat)[len(lat) // 2] * 1000))
        if len(lat) >= 3 and max(lat) < t_chat / 2:
            break
    t_chat, lat = tries[-1]
    check(len(lat) >= 3, "several /health probes answered while the prompt was tokenized", len(lat))
    check(max(lat) < t_chat / 2, "no /health probe waited for the tokenization",
          [round(x * 1000, 1) for x in lat], round(t_chat * 1000))
    # still serving
    t, st, doc = timed_chat(srv, json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                               "max_tokens": 4}))
    check(st == 200, "a short chat after", st, doc)
finally:
    check(srv.stop() == 0, "clean exit")
finish()
