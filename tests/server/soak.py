#!/usr/bin/python3
"""Soak: many mixed requests against one moed on one model, every one checked.

The mix: chat and completions, streaming and not, with every sampling parameter (temperature,
top_p, top_k, min_p, the three penalties, seed, logit_bias), n > 1, stop strings, logprobs,
response_format (json_object and json_schema), tools, token-id prompts; streams cancelled
mid-way (reset or FIN); pipelined pairs; the small endpoints; malformed JSON and invalid
parameters; malformed HTTP; and a mutational HTTP fuzz whose inputs are the committed fuzz
seeds (tests/fuzz/corpus/http, .../request) and the soak's own requests, byte-mutated, spliced
or with a JSON value swapped for a hostile one. Each kind has its right answer: 200 with a
response that matches proto/openapi.yaml and the request (choice count, finish reasons, stop
strings absent, logprobs shaped as asked, JSON that parses, tool calls with JSON arguments),
400 naming the parameter, 404/405, 400/413/431 for bad HTTP, and for fuzz inputs any answer
below 500 or a close (never a 5xx, a hang or a crash). Every request must get its answer.
--fuzz N adds N more fuzz inputs after the mix (a bounded HTTP fuzz run on the real server,
the sampler and grammar engine included, as CI does against the ASan+UBSan build).

The requests run in rounds (--concurrency clients at once); between rounds, with nothing in
flight, the server's VmRSS and open descriptors are read from /proc/PID. RSS is flat when,
after the warm-up (the first --warmup fraction of the requests), the peak over the second half
of the remaining samples exceeds the peak over their first half by at most
max(--rss-slack-mib, 0.5 %): a leak of L bytes per request shows as L x (a third of the
requests). The KV pool is resident as far as its blocks have ever been used (the prefix cache
keeps whole freed blocks and takes never-used ones first), so before the mix the soak sends
distinct long prompts until every block has been used once; --kv-memory-mb (default: the
server's own, 512 MiB) sets the pool. Descriptors must come back to the count after the
warm-up. Under ASan (libasan mapped in the server) the
RSS criterion is not applied (its quarantine holds freed memory; LeakSanitizer checks at exit
instead) and the request count is divided by --asan-divide. At the end the server must still
serve, hold no sequence, queue entry or KV block, and exit 0 on SIGTERM.

usage: soak.py MOED MODEL [--requests 10000] [--concurrency 8] [--seed 1] [--rounds 20]
               [--warmup 0.3] [--kv-memory-mb MB] [--fuzz N] [--json FILE]
               [--moed-arg=ARG ...]
Exit status: 0 when every check passed, 1 otherwise.
"""

import argparse
import json
import os
import random
import re
import socket
import struct
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import openapi_check  # noqa: E402
from harness import Server  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("moed")
ap.add_argument("model")
ap.add_argument("--requests", type=int, default=10000)
ap.add_argument("--concurrency", type=int, default=8)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--rounds", type=int, default=20)
ap.add_argument("--warmup", type=float, default=0.3)
ap.add_argument("--rss-slack-mib", type=float, default=2.0)
ap.add_argument("--kv-memory-mb", help="the server's KV pool (default: its own default)")
ap.add_argument("--asan-divide", type=int, default=4)
ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
ap.add_argument("--fuzz", type=int, default=0,
                help="mutated HTTP inputs after the mix (the fuzz+ row)")
ap.add_argument("--json")
ap.add_argument("--moed-arg", action="append", default=[])
a = ap.parse_args()

MAX_TOKENS_CAP = 256  # --max-tokens-cap: bounds what a fuzzed request can ask for
MAX_HEADER = 16384    # moed's default max-header-bytes
MAX_BODY = 4194304    # and max-body-bytes
FUZZ_OK = {200, 400, 404, 405, 408, 413, 431}  # what a fuzzed input may be answered


# ---------------------------------------------------------------- a small HTTP/1.1 client

class Closed(Exception):
    pass


class Conn:
    """One client connection; reads whole responses (Content-Length, chunked or to close)."""

    def __init__(self, port, timeout):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""
        self.eof = False

    def close(self, reset=False):
        if reset:
            try:
                self.s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.s.close()

    def send(self, data):
        self.s.sendall(data)

    def _more(self):
        try:
            b = self.s.recv(65536)
        except ConnectionResetError:
            b = b""
        if not b:
            self.eof = True
            raise Closed()
        self.buf += b

    def _until(self, sep):
        while True:
            k = self.buf.find(sep)
            if k >= 0:
                out, self.buf = self.buf[:k], self.buf[k + len(sep):]
                return out
            self._more()

    def _exactly(self, n):
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self, on_chunk=None):
        """(status, headers, body). on_chunk(bytes so far) may return True to stop reading
        (the caller then closes the connection). Raises Closed at EOF before a whole head."""
        while True:
            head = self._until(b"\r\n\r\n").decode("latin1")
            lines = head.split("\r\n")
            m = re.match(r"HTTP/1\.[01] (\d{3}) ", lines[0] + " ")
            if not m:
                raise ValueError("bad status line %r" % lines[0][:100])
            status = int(m.group(1))
            if status != 100:
                break  # 100 Continue (Expect: 100-continue) is interim: the answer follows
        hdrs = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        body = b""
        if hdrs.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int(self._until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    self._until(b"\r\n")
                    break
                body += self._exactly(size)
                self._exactly(2)
                if on_chunk and on_chunk(body):
                    return status, hdrs, body
        elif "content-length" in hdrs:
            body = self._exactly(int(hdrs["content-length"]))
        else:
            try:
                while True:
                    self._more()
            except Closed:
                pass
            body, self.buf = self.buf, b""
        return status, hdrs, body


def http_request(method, path, body=None, headers=()):
    h = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1"]
    if body is not None:
        h += ["Content-Type: application/json", "Content-Length: %d" % len(body)]
    h += list(headers)
    return ("\r\n".join(h) + "\r\n\r\n").encode() + (body or b"")


def jbody(doc):
    return json.dumps(doc).encode()


# ---------------------------------------------------------------- request kinds

PROMPTS = ["The history of the city", "Once upon a time", "1, 2, 3, 4,", "Write a haiku",
           "Tell me about rivers.", "What is a mixture of experts?", "Hello", "a b c d e f g",
           "Ünïcödé and emoji 🙂 in the prompt", "List three colours:"]
STOPS = ["\n", ".", " the", "e", "END", ",", "  ", "ing", "!"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
     "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                   "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}}},
]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
N_VOCAB = [1000]  # set from the server (tokenize) before the soak starts


def sampling(rng, body):
    """A random subset of every sampling parameter, in range."""
    pick = rng.random
    if pick() < 0.7:
        body["temperature"] = rng.choice([0, 0.3, 0.7, 1.0, 1.5, 2.0, round(rng.uniform(0, 2), 3)])
    if pick() < 0.4:
        body["top_p"] = rng.choice([0.05, 0.5, 0.9, 1.0, round(rng.uniform(0.01, 1), 3)])
    if pick() < 0.4:
        body["top_k"] = rng.choice([-1, 0, 1, 2, 40, 1 << 20])
    if pick() < 0.3:
        body["min_p"] = rng.choice([0, 0.05, 0.2, 1.0])
    if pick() < 0.3:
        body["presence_penalty"] = round(rng.uniform(-2, 2), 3)
    if pick() < 0.3:
        body["frequency_penalty"] = round(rng.uniform(-2, 2), 3)
    if pick() < 0.3:
        body["repetition_penalty"] = rng.choice([0.5, 1.0, 1.3, 10.0, round(rng.uniform(0.1, 3), 3)])
    if pick() < 0.6:
        body["seed"] = rng.randrange(-(1 << 40), 1 << 40)
    if pick() < 0.2:
        body["logit_bias"] = {str(rng.randrange(N_VOCAB[0])): rng.choice([-100, -5, 0.5, 3, 100])
                              for _ in range(rng.randint(1, 4))}
    if pick() < 0.3:
        body["stop"] = rng.choice(STOPS) if pick() < 0.5 else rng.sample(STOPS, rng.randint(1, 4))
    if pick() < 0.3:
        body["n"] = rng.randint(2, 4)
    if pick() < 0.3:
        body["ignore_eos"] = True
    if pick() < 0.2:
        body["user"] = "soak-%d" % rng.randrange(100)
    body["max_tokens"] = rng.randint(1, 24)
    return body


def stops_of(body):
    s = body.get("stop")
    return [] if s is None else [s] if isinstance(s, str) else s


def chat_body(rng, stream):
    msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "Be brief."})
    if rng.random() < 0.2:
        msgs += [{"role": "assistant", "content": "Sure."},
                 {"role": "user", "content": [{"type": "text", "text": rng.choice(PROMPTS)}]}]
    b = sampling(rng, {"messages": msgs})
    if rng.random() < 0.3:
        b["max_completion_tokens"] = b.pop("max_tokens")
    if rng.random() < 0.3:
        b["logprobs"] = True
        if rng.random() < 0.7:
            b["top_logprobs"] = rng.randint(0, 5)
    if stream:
        b["stream"] = True
        if rng.random() < 0.5:
            b["stream_options"] = {"include_usage": True}
    return b


def comp_body(rng, stream):
    r = rng.random()
    if r < 0.6:
        prompt = rng.choice(PROMPTS)
    elif r < 0.8:
        prompt = rng.sample(PROMPTS, 2)
    else:
        prompt = [rng.randrange(N_VOCAB[0]) for _ in range(rng.randint(1, 12))]
    b = sampling(rng, {"prompt": prompt})
    if rng.random() < 0.3:
        b["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.1:
        b["echo"] = False
    if stream:
        b["stream"] = True
        if rng.random() < 0.5:
            b["stream_options"] = {"include_usage": True}
    return b


def n_choices(body):
    p = body.get("prompt")
    n_prompts = len(p) if isinstance(p, list) and p and isinstance(p[0], str) else 1
    return n_prompts * body.get("n", 1)


def oapi(path, status, ctype, doc):
    return openapi_check.validate_response("POST", path, status, ctype, doc)


def sse(body):
    datas = []
    for block in body.decode("utf-8", "replace").split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                datas.append(line[6:])
    return datas


def check_generation(path, req, status, hdrs, body):
    """None when a 200 generation answers req rightly; else what is wrong."""
    if status != 200:
        return "status %d: %s" % (status, body[:200])
    chat = path.endswith("chat/completions")
    want = n_choices(req)
    stops = stops_of(req)
    texts, fins, lps = {}, {}, {}
    if req.get("stream"):
        if not hdrs.get("content-type", "").startswith("text/event-stream"):
            return "stream content-type %r" % hdrs.get("content-type")
        datas = sse(body)
        if not datas or datas[-1] != "[DONE]":
            return "stream does not end with [DONE]: %r" % datas[-2:]
        for d in datas[:-1]:
            doc = json.loads(d)
            errs = oapi(path, 200, "text/event-stream", doc)
            if errs:
                return "SSE event off the spec: %s %s" % (errs[:2], d[:200])
            for c in doc["choices"]:
                i = c["index"]
                if chat:
                    texts[i] = texts.get(i, "") + (c["delta"].get("content") or "")
                    if c.get("logprobs"):
                        lps.setdefault(i, []).extend(c["logprobs"]["content"] or [])
                else:
                    texts[i] = texts.get(i, "") + c["text"]
                    if c.get("logprobs"):
                        lps.setdefault(i, []).extend(c["logprobs"]["top_logprobs"])
                if c["finish_reason"]:
                    if i in fins:
                        return "choice %d finished twice" % i
                    fins[i] = c["finish_reason"]
        usage = json.loads(datas[-2]).get("usage") if len(datas) > 1 else None
        if req.get("stream_options", {}).get("include_usage") and not usage:
            return "include_usage but no usage chunk"
    else:
        doc = json.loads(body)
        errs = oapi(path, 200, "application/json", doc)
        if errs:
            return "response off the spec: %s" % errs[:3]
        for c in doc["choices"]:
            i = c["index"]
            if chat:
                texts[i] = c["message"].get("content") or ""
                if c.get("logprobs"):
                    lps[i] = c["logprobs"]["content"] or []
            else:
                texts[i] = c["text"]
                if c.get("logprobs"):
                    lps[i] = c["logprobs"]["top_logprobs"]
            fins[i] = c["finish_reason"]
        u = doc["usage"]
        if u["completion_tokens"] > want * req.get("max_tokens", req.get("max_completion_tokens", 16)):
            return "more tokens than asked: %s" % u
    if sorted(fins) != list(range(want)):
        return "choices %s finished, want %d" % (sorted(fins), want)
    ok_fin = {"stop", "length", "tool_calls"} if req.get("tools") else {"stop", "length"}
    if any(f not in ok_fin for f in fins.values()):
        return "finish reasons %s" % fins
    for i, t in texts.items():
        for s in stops:
            if s in t:
                return "choice %d holds stop string %r: %r" % (i, s, t[:120])
    k = req.get("top_logprobs") if chat else req.get("logprobs")
    want_lp = req.get("logprobs") is True if chat else isinstance(req.get("logprobs"), int)
    if want_lp:
        for i in range(want):
            for e in lps.get(i, []):
                tops = e["top_logprobs"] if chat else e
                if k is not None and len(tops) > max(k, 1 if not chat else k):
                    return "choice %d: %d top logprobs, asked %s" % (i, len(tops), k)
                if chat and e["logprob"] > 1e-6:
                    return "logprob above 0: %s" % e
    return None


def check_json_output(req, status, hdrs, body):
    err = check_generation("/v1/chat/completions", req, status, hdrs, body)
    if err:
        return err
    for c in json.loads(body)["choices"]:
        if c["finish_reason"] != "stop":
            continue  # cut by max_tokens: may be incomplete
        try:
            v = json.loads(c["message"]["content"])
        except ValueError:
            return "response_format output is not JSON: %r" % c["message"]["content"][:200]
        if req["response_format"]["type"] == "json_object" and not isinstance(v, dict):
            return "json_object output is not an object: %r" % v
        if req["response_format"]["type"] == "json_schema" and (
                set(v) != {"name", "age"} or not isinstance(v["age"], int) or
                not isinstance(v["name"], str) or len(v["name"]) > 12):
            return "json_schema output does not match: %r" % v
    return None


def check_tools(req, status, hdrs, body):
    err = check_generation("/v1/chat/completions", req, status, hdrs, body)
    if err:
        return err
    for c in json.loads(body)["choices"]:
        calls = c["message"].get("tool_calls") or []
        if c["finish_reason"] == "tool_calls" and not calls:
            return "finish tool_calls without calls"
        for call in calls:
            if call["function"]["name"] not in ("get_weather", "add"):
                return "undeclared tool %r" % call["function"]["name"]
            try:
                json.loads(call["function"]["arguments"])
            except ValueError:
                return "tool arguments not JSON: %r" % call["function"]["arguments"]
    return None


def error_answer(status, want, body, param=None):
    if status != want:
        return "status %d, want %d: %s" % (status, want, body[:200])
    try:
        doc = json.loads(body)
    except ValueError:
        return "error body not JSON: %r" % body[:200]
    errs = openapi_check.errors({"$ref": "#/components/schemas/ErrorResponse"}, doc)
    if errs:
        return "error body off the spec: %s" % errs[:2]
    if param is not None and doc["error"]["param"] != param:
        return "error names %r, want %r" % (doc["error"]["param"], param)
    return None


# Bodies no endpoint accepts, and bodies a generation endpoint refuses.
BAD_JSON = [b'{"prompt": "x",', b"[1, 2]", b'{"prompt": "\xff\xfe"}', b"", b'{"prompt": "x"} trailing',
            b"nul", b'{"a":' * 300 + b"1" + b"}" * 300, b"\x00\x01\x02", b'"just a string"']
BAD_GEN_JSON = [b'{"prompt": "x", "max_tokens": 1e999}', b'{"prompt": "\\ud800"}',
                b'{"messages": "hi"}', b'{"prompt": null}', b'{"prompt": ["x", 5]}']
BAD_PARAMS = [("temperature", "hot"), ("temperature", 3), ("temperature", -0.1), ("top_p", 0),
              ("top_p", 1.5), ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", 10 ** 9),
              ("n", 0), ("n", 65), ("stream", "yes"), ("stop", 5), ("stop", ["x"] * 17),
              ("logit_bias", {"abc": 1}), ("logit_bias", {"1": 500}), ("logit_bias", {"-1": 1}),
              ("presence_penalty", -3), ("frequency_penalty", 2.5), ("repetition_penalty", 0),
              ("min_p", 2), ("top_k", -2), ("seed", "s"), ("seed", 1e300),
              ("stream_options", {"include_usage": True}), ("response_format", {"type": "xml"}),
              ("response_format", {"type": "json_schema"}), ("tools", [{"type": "nope"}]),
              ("tool_choice", "sometimes"), ("top_logprobs", 2), ("max_completion_tokens", -1)]
# (raw bytes, status); each on a fresh connection, which the server then closes
BAD_HTTP = [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad\x00Header: 1\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
     400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER + 100) + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * (MAX_HEADER + 100) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1), 413),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    # accepted as llhttp reads them: a request line without a version (HTTP/0.9), a folded
    # header line (obs-fold, which RFC 9112 lets a server unfold)
    (b"GET /health\r\n\r\n", 200),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n continued\r\n\r\n", 200),
]


def load_seeds():
    root = os.path.join(HERE, "..", "fuzz", "corpus")
    http, req = [], []
    for name in sorted(os.listdir(os.path.join(root, "http"))):
        http.append(open(os.path.join(root, "http", name), "rb").read()[1:])
    for name in sorted(os.listdir(os.path.join(root, "request"))):
        d = open(os.path.join(root, "request", name), "rb").read()
        if d:
            path = "/v1/chat/completions" if d[0] & 1 else "/v1/completions"
            req.append((path, d[1:]))
    return http, req


HTTP_SEEDS, REQ_SEEDS = load_seeds()
HOSTILE = [None, True, False, 0, -1, 1 << 62, -(1 << 63), 1e308, -1e308, 5e-324, 0.5, "",
           "x" * 5000, [], [[[]]], {}, {"": None}, "\u0000", "\ud83d\ude00" * 50, 4096, 257, 256,
           -0.0, 2, 1.0000001, "NaN"]


def mutate_json(rng, doc):
    """Swap a random value somewhere in doc for a hostile one (in place)."""
    node = doc
    for _ in range(rng.randint(1, 4)):
        if isinstance(node, dict) and node:
            k = rng.choice(list(node))
            if isinstance(node[k], (dict, list)) and node[k] and rng.random() < 0.5:
                node = node[k]
                continue
            node[k] = rng.choice(HOSTILE)
            return
        if isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if isinstance(node[i], (dict, list)) and node[i] and rng.random() < 0.5:
                node = node[i]
                continue
            node[i] = rng.choice(HOSTILE)
            return
        break
    if isinstance(node, dict):
        node[rng.choice(["max_tokens", "n", "logprobs", "top_logprobs", "stop", "tools",
                         "response_format", "grammar", "speculative", "tool_choice"])] = \
            rng.choice(HOSTILE)


def mutate_bytes(rng, data):
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(6)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2:
            del b[pos:pos + rng.randint(1, 16)]
        elif op == 3 and b:
            s = rng.randrange(len(b))
            b[pos:pos] = b[s:s + rng.randint(1, 64)]
        elif op == 4:
            b[pos:pos] = rng.choice([b"\r\n", b"\r\n\r\n", b"0\r\n\r\n", b":", b" ", b"\x00",
                                     b"Transfer-Encoding: chunked\r\n", b"Content-Length: 5\r\n",
                                     b"Connection: close\r\n", b"Expect: 100-continue\r\n"])
        elif op == 5:
            other = rng.choice(HTTP_SEEDS)
            b = b[:pos] + bytearray(other[rng.randrange(len(other) + 1):])
    return bytes(b[:65536])


def fuzz_input(rng):
    r = rng.random()
    if r < 0.35:
        return mutate_bytes(rng, rng.choice(HTTP_SEEDS))
    if r < 0.7:
        path, body = rng.choice(REQ_SEEDS)
        try:
            doc = json.loads(body)
            mutate_json(rng, doc)
            body = json.dumps(doc).encode()
        except ValueError:
            body = mutate_bytes(rng, body)
        return http_request("POST", path, body)
    path, req = ("/v1/chat/completions", chat_body(rng, rng.random() < 0.5)) if rng.random() < 0.5 \
        else ("/v1/completions", comp_body(rng, rng.random() < 0.5))
    if rng.random() < 0.5:
        mutate_json(rng, req)
        return http_request("POST", path, jbody(req))
    return mutate_bytes(rng, http_request("POST", path, jbody(req)))


# Kinds and their weights in the mix.
KINDS = [("chat", 14), ("chat_stream", 14), ("comp", 10), ("comp_stream", 10),
         ("json_format", 4), ("tools", 4), ("cancel", 8), ("pipelined", 4), ("small", 6),
         ("bad_json", 5), ("bad_param", 6), ("bad_http", 5), ("fuzz", 10)]


class Client:
    """One soak client: its own keep-alive connection for well-formed requests."""

    def __init__(self, port):
        self.port = port
        self.c = None

    def conn(self):
        if self.c is None:
            self.c = Conn(self.port, a.timeout)
        return self.c

    def drop(self):
        if self.c:
            self.c.close()
        self.c = None

    def exchange(self, data, on_chunk=None):
        """Send on the keep-alive connection (a fresh one if the server had closed it)."""
        for attempt in (0, 1):
            c = self.conn()
            try:
                c.send(data)
                r = c.response(on_chunk)
                if r[1].get("connection", "").lower() == "close":
                    self.drop()
                return r
            except (Closed, BrokenPipeError, ConnectionResetError):
                # an idle keep-alive connection the server closed before this request
                self.drop()
                if attempt or c.buf:
                    raise
        raise Closed()

    def one(self, kind, rng):
        """Run one request of kind; returns (outcome label, error or None)."""
        if kind in ("chat", "chat_stream"):
            req = chat_body(rng, kind == "chat_stream")
            st, h, b = self.exchange(http_request("POST", "/v1/chat/completions", jbody(req)))
            return str(st), check_generation("/v1/chat/completions", req, st, h, b)
        if kind in ("comp", "comp_stream"):
            req = comp_body(rng, kind == "comp_stream")
            st, h, b = self.exchange(http_request("POST", "/v1/completions", jbody(req)))
            return str(st), check_generation("/v1/completions", req, st, h, b)
        if kind == "json_format":
            req = chat_body(rng, False)
            req.pop("logit_bias", None)  # a ban on '{' could make JSON impossible
            req["max_tokens"] = 80
            req.pop("max_completion_tokens", None)
            req.pop("stop", None)
            req["response_format"] = {"type": "json_object"} if rng.random() < 0.5 else \
                {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                        "schema": SCHEMA}}
            st, h, b = self.exchange(http_request("POST", "/v1/chat/completions", jbody(req)))
            return str(st), check_json_output(req, st, h, b)
        if kind == "tools":
            req = {"messages": [{"role": "user", "content": "Weather in Paris, and 2 plus 3?"}],
                   "tools": TOOLS, "max_tokens": 120, "temperature": rng.choice([0, 0.7, 1.0]),
                   "seed": rng.randrange(1000),
                   "tool_choice": rng.choice(["required", "auto", "none",
                                              {"type": "function", "function": {"name": "add"}}]),
                   "parallel_tool_calls": rng.random() < 0.5}
            st, h, b = self.exchange(http_request("POST", "/v1/chat/completions", jbody(req)))
            return str(st), check_tools(req, st, h, b)
        if kind == "cancel":
            path = rng.choice(["/v1/chat/completions", "/v1/completions"])
            req = chat_body(rng, True) if path.endswith("chat/completions") else comp_body(rng, True)
            req.update(max_tokens=200, ignore_eos=True)
            req.pop("max_completion_tokens", None)
            req.pop("stop", None)
            want = rng.randint(1, 4)
            c = Conn(self.port, a.timeout)
            try:
                c.send(http_request("POST", path, jbody(req)))
                st, h, b = c.response(lambda so_far: so_far.count(b"data: ") >= want)
            finally:
                c.close(reset=rng.random() < 0.5)
            if st != 200:
                return str(st), "cancelled stream: status %d %s" % (st, b[:200])
            if b.count(b"data: ") < want:
                return "200", "stream ended before %d events" % want
            return "cancelled", None
        if kind == "pipelined":
            reqs = [comp_body(rng, rng.random() < 0.5) for _ in range(2)]
            c = Conn(self.port, a.timeout)
            try:
                c.send(b"".join(http_request("POST", "/v1/completions", jbody(r)) for r in reqs))
                for r in reqs:
                    st, h, b = c.response()
                    err = check_generation("/v1/completions", r, st, h, b)
                    if err:
                        return str(st), "pipelined: " + err
            finally:
                c.close()
            return "200x2", None
        if kind == "small":
            r = rng.randrange(7)
            if r == 0:
                st, h, b = self.exchange(http_request("GET", "/health"))
                return str(st), None if st == 200 and json.loads(b) == {"status": "ok"} else \
                    "health %d %r" % (st, b[:100])
            if r == 1:
                st, h, b = self.exchange(http_request("GET", "/v1/models"))
                return str(st), None if st == 200 and json.loads(b)["data"] else "models %d" % st
            if r == 2:
                st, h, b = self.exchange(http_request("GET", "/metrics"))
                return str(st), None if st == 200 and b"moed:http_requests_total" in b else \
                    "metrics %d" % st
            if r == 3:
                text = rng.choice(PROMPTS)
                st, h, b = self.exchange(http_request("POST", "/tokenize", jbody(
                    {"content": text, "with_pieces": True})))
                if st != 200:
                    return str(st), "tokenize %d %r" % (st, b[:200])
                toks = json.loads(b)["tokens"]
                st, h, b = self.exchange(http_request("POST", "/detokenize", jbody({"tokens": toks})))
                return str(st), None if st == 200 and json.loads(b)["content"] == text else \
                    "detokenize round trip %d %r" % (st, b[:200])
            if r == 4:
                st, h, b = self.exchange(http_request("GET", "/nope/%d" % rng.randrange(99)))
                return str(st), error_answer(st, 404, b)
            if r == 5:
                st, h, b = self.exchange(http_request("GET", "/v1/chat/completions"))
                return str(st), error_answer(st, 405, b)
            st, h, b = self.exchange(http_request("POST", "/v1/chat/completions", jbody(
                {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})))
            return str(st), error_answer(st, 404, b, "model")
        if kind == "bad_json":
            path = rng.choice(["/v1/chat/completions", "/v1/completions", "/tokenize"])
            body = rng.choice(BAD_JSON + ([] if path == "/tokenize" else BAD_GEN_JSON))
            st, h, b = self.exchange(http_request("POST", path, body))
            return str(st), error_answer(st, 400, b)
        if kind == "bad_param":
            name, val = rng.choice(BAD_PARAMS)
            chat = name in ("top_logprobs", "max_completion_tokens", "tools", "tool_choice") or \
                rng.random() < 0.5
            body = chat_body(rng, False) if chat else comp_body(rng, False)
            body.pop("logprobs", None)
            body.pop("top_logprobs", None)
            body.pop("stream_options", None)
            body[name] = val
            path = "/v1/chat/completions" if chat else "/v1/completions"
            st, h, b = self.exchange(http_request("POST", path, jbody(body)))
            return str(st), error_answer(st, 400, b, name)
        if kind == "bad_http":
            data, want = rng.choice(BAD_HTTP)
            c = Conn(self.port, a.timeout)
            try:
                try:
                    c.send(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # answered and closed while the rest was still being sent
                try:
                    st, h, b = c.response()
                except Closed:
                    return "closed", "bad HTTP %r: closed without an answer" % data[:60]
            finally:
                c.close()
            if want == 200:
                return str(st), None if st == 200 else "status %d, want 200: %r" % (st, b[:200])
            return str(st), error_answer(st, want, b)
        if kind in ("fuzz", "fuzz+"):
            data = fuzz_input(rng)
            c = Conn(self.port, a.timeout)
            got = []
            try:
                try:
                    c.send(data)
                    c.s.shutdown(socket.SHUT_WR)  # nothing more comes: no waiting for bytes
                except (BrokenPipeError, ConnectionResetError):
                    pass
                while True:
                    try:
                        st, h, b = c.response()
                    except Closed:
                        break
                    except ValueError as e:
                        return "garbled", "fuzz: %s after %s for %r" % (e, got, data[:200])
                    got.append(st)
            finally:
                c.close()
            bad = [s for s in got if s not in FUZZ_OK]
            label = "fuzz:" + ("+".join(map(str, sorted(set(got)))) if got else "closed")
            return label, "fuzz input answered %s: %r" % (bad, data[:300]) if bad else None
        raise ValueError(kind)


# ---------------------------------------------------------------- the soak

def proc_sample(pid, floor):
    """(VmRSS KiB, open descriptors). The connection settle() last used may still be closing:
    when the count is above floor, look again (bounded) before taking it."""
    rss = 0
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    for _ in range(40):
        fds = len(os.listdir("/proc/%d/fd" % pid))
        if floor is None or fds <= floor:
            break
        time.sleep(0.05)
    return rss, fds


def metric(port, name):
    c = Conn(port, 30)
    try:
        c.send(http_request("GET", "/metrics", headers=["Connection: close"]))
        _, _, b = c.response()
    finally:
        c.close()
    m = re.search(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), b.decode(), re.M)
    return float(m.group(2)) if m else None


def settle(port, tries=600):
    """Wait (bounded) until nothing runs, waits, holds KV blocks, or stays connected."""
    for _ in range(tries):
        if (metric(port, "moed:num_requests_running") == 0 and
                metric(port, "moed:num_requests_waiting") == 0 and
                metric(port, "moed:kv_cache_blocks_used") == 0 and
                metric(port, "moed:http_connections") == 1):
            return True
        time.sleep(0.05)
    return False


def fill_kv_pool(port):
    """Make every KV block resident once: distinct long token-id prompts whose whole blocks
    the prefix cache keeps, until the prompts hold more positions than the pool. Returns a
    line saying what was sent."""
    blocks = int(metric(port, "moed:kv_cache_blocks_total") or 0)
    c = Client(port)
    _, _, b = c.exchange(http_request("GET", "/v1/models"))
    ctx = json.loads(b)["data"][0].get("max_model_len", 2048)
    c.drop()
    length = max(16, min(ctx - 32, 1024))  # longer prompts cost quadratically more
    n = (blocks * 16 + length - 1) // length + 1
    fails = []
    nxt = [0]
    lock = threading.Lock()

    def worker():
        cl = Client(port)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n:
                break
            rng = random.Random(a.seed * 7919 + i)
            req = {"prompt": [rng.randrange(N_VOCAB[0]) for _ in range(length)], "max_tokens": 1}
            try:
                st, h, b = cl.exchange(http_request("POST", "/v1/completions", jbody(req)))
                if st != 200:
                    fails.append("fill request %d: %d %r" % (i, st, b[:200]))
            except (Closed, OSError) as e:
                fails.append("fill request %d: %r" % (i, e))
                cl.drop()
        cl.drop()

    ths = [threading.Thread(target=worker) for _ in range(min(n, a.concurrency))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if fails:
        raise RuntimeError("filling the KV pool failed: %s" % fails[:3])
    return "%d prompts of %d tokens for %d KV blocks (%d positions)" % (n, length, blocks,
                                                                        blocks * 16)


def main():
    args = ["--max-tokens-cap", str(MAX_TOKENS_CAP)]
    if a.kv_memory_mb:
        args += ["--kv-memory-mb", a.kv_memory_mb]
    srv = Server(a.moed, a.model, args=args + a.moed_arg)
    fails, counts, examples = [], {}, {}
    lock = threading.Lock()
    try:
        asan = "libasan" in open("/proc/%d/maps" % srv.proc.pid).read()
        total = max(200, a.requests // a.asan_divide) if asan else a.requests
        c0 = Client(srv.port)
        # the vocabulary size, from the error an id past it gets
        st, _, b = c0.exchange(http_request("POST", "/detokenize", jbody({"tokens": [1 << 30]})))
        m = re.search(rb"in \[0, (\d+)\)", b)
        N_VOCAB[0] = int(m.group(1)) if m else 256
        c0.drop()
        # (under ASan RSS is not judged, so the pool need not be made resident)
        fill = "no (ASan build)" if asan else fill_kv_pool(srv.port)
        names = [k for k, _ in KINDS]
        weights = [w for _, w in KINDS]
        plan_rng = random.Random(a.seed)
        plan = plan_rng.choices(names, weights, k=total)
        rounds = max(2, a.rounds)
        per = (total + rounds - 1) // rounds
        samples = []  # (requests done, rss KiB, fds)
        t0 = time.time()
        print("soak: KV pool made resident first: %s" % fill)
        print("soak: %d requests (%s), %d clients, %d rounds, seed %d, server pid %d" % (
            total, "ASan build" if asan else "plain build", a.concurrency, rounds, a.seed,
            srv.proc.pid), flush=True)
        done = 0
        def run_items(items, kind_of):
            """Run items (request numbers) on a.concurrency clients; kind_of(i) -> kind."""
            nxt = [0]

            def worker():
                cl = Client(srv.port)
                while True:
                    with lock:
                        if nxt[0] >= len(items):
                            break
                        i = items[nxt[0]]
                        nxt[0] += 1
                    kind = kind_of(i)
                    rng = random.Random(a.seed * 1000003 + i)
                    try:
                        label, err = cl.one(kind, rng)
                    except (Closed, OSError, ValueError) as e:
                        cl.drop()
                        label, err = "no answer", "%s: %r" % (type(e).__name__, e)
                    with lock:
                        key = (kind, label)
                        counts[key] = counts.get(key, 0) + 1
                        if err:
                            fails.append((i, kind, err))
                            examples.setdefault(kind, []).append("#%d %s" % (i, err[:400]))
                cl.drop()

            ths = [threading.Thread(target=worker) for _ in range(a.concurrency)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()

        for rnd in range(rounds):
            items = list(range(rnd * per, min(total, (rnd + 1) * per)))
            if not items:
                break
            run_items(items, lambda i: plan[i])
            done += len(items)
            if srv.proc.poll() is not None:
                fails.append((-1, "server", "moed exited with %s during the soak" % srv.proc.returncode))
                break
            if not settle(srv.port):
                fails.append((-1, "settle", "requests, KV blocks or connections left after round %d"
                              % rnd))
            # Wait (bounded) for the fewest descriptors seen so far: the first sample may
            # itself have caught settle()'s last connection closing (ASan run: 13 first,
            # then 12 and 13 alternating, the last 13 read as a leak against 12).
            rss, fds = proc_sample(srv.proc.pid, min(x[2] for x in samples) if samples else None)
            samples.append((done, rss, fds))
            print("soak: %5d requests, %6.1f s, VmRSS %7.1f MiB, %d fds, %d failed" % (
                done, time.time() - t0, rss / 1024, fds, len(fails)), flush=True)
        wall = time.time() - t0

        # the HTTP fuzz phase: --fuzz more mutated inputs, numbered after the mix
        t1 = time.time()
        if a.fuzz and srv.proc.poll() is None:
            run_items(list(range(total, total + a.fuzz)), lambda i: "fuzz+")
            print("soak: %d fuzz inputs in %.1f s" % (a.fuzz, time.time() - t1), flush=True)
            if srv.proc.poll() is not None:
                fails.append((-1, "server", "moed exited with %s during the fuzz phase" %
                              srv.proc.returncode))
            elif not settle(srv.port):
                fails.append((-1, "settle", "requests, KV blocks or connections left after the "
                              "fuzz phase"))

        # still serving: a normal completion and a stream
        cl = Client(srv.port)
        req = {"prompt": "still serving?", "max_tokens": 8, "temperature": 0}
        st, h, b = cl.exchange(http_request("POST", "/v1/completions", jbody(req)))
        err = check_generation("/v1/completions", req, st, h, b)
        if err:
            fails.append((-1, "after", "a completion after the soak: " + err))
        req = dict(req, stream=True)
        st, h, b = cl.exchange(http_request("POST", "/v1/completions", jbody(req)))
        err = check_generation("/v1/completions", req, st, h, b)
        if err:
            fails.append((-1, "after", "a stream after the soak: " + err))
        cl.drop()

        # RSS flat after warm-up; descriptors back where they were
        post = [x for x in samples if x[0] > a.warmup * total]
        rss_verdict = "not applied (ASan)" if asan else "too few samples"
        if len(post) >= 4 and not asan:
            half = len(post) // 2
            first = max(x[1] for x in post[:half])
            second = max(x[1] for x in post[half:])
            slack = max(a.rss_slack_mib * 1024, 0.005 * first)
            flat = second - first <= slack
            rss_verdict = ("flat" if flat else "GROWING") + (
                ": peak %.1f MiB over requests %d-%d, %.1f MiB over %d-%d (%+.1f MiB, "
                "allowed %.1f)" % (first / 1024, post[0][0], post[half - 1][0], second / 1024,
                                   post[half][0], post[-1][0], (second - first) / 1024,
                                   slack / 1024))
            if not flat:
                fails.append((-1, "rss", rss_verdict))
        if post and post[-1][2] > post[0][2]:
            fails.append((-1, "fds", "open descriptors %d after warm-up, %d at the end" % (
                post[0][2], post[-1][2])))
    finally:
        rc = srv.stop()
    if rc != 0:
        fails.append((-1, "exit", "moed exit status %s on SIGTERM: %s" % (rc, srv.logtext()[-1500:])))
    log = srv.logtext()
    for pat in ("runtime error", "AddressSanitizer", "LeakSanitizer", "UndefinedBehavior"):
        if pat in log:
            k = log.index(pat)
            fails.append((-1, "sanitizer", log[max(0, k - 200):k + 1500]))
            break

    print("\nsoak: %d requests in %.1f s (%.0f/s), load average %s" % (
        total, wall, total / wall, open("/proc/loadavg").read().split()[0]))
    print("| kind | requests | answers |")
    print("| --- | ---: | --- |")
    for k in names + ["fuzz+"]:
        got = {lab: n for (kk, lab), n in counts.items() if kk == k}
        print("| %s | %d | %s |" % (k, sum(got.values()), " ".join(
            "%s:%d" % (lab, n) for lab, n in sorted(got.items()))))
    print("VmRSS (MiB) per round: %s" % " ".join("%.1f" % (s[1] / 1024) for s in samples))
    print("open descriptors per round: %s" % " ".join(str(s[2]) for s in samples))
    print("RSS after warm-up (first %d%% of requests): %s" % (a.warmup * 100, rss_verdict))
    answered = sum(counts.values())
    if answered != total + a.fuzz:
        fails.append((-1, "count", "%d of %d requests accounted for" % (answered, total)))
    for kind, ex in examples.items():
        print("FAIL: %s: %d failed, e.g. %s" % (kind, len(ex), " || ".join(ex[:3])))
    for i, kind, err in fails:
        if i < 0:
            print("FAIL: %s: %s" % (kind, err[:3000]))
    if a.json:
        json.dump({"requests": total, "seconds": wall, "samples": samples,
                   "counts": {"%s/%s" % k: n for k, n in counts.items()},
                   "failures": [f[2][:500] for f in fails]}, open(a.json, "w"), indent=1)
    if fails:
        print("%d failure(s)" % len(fails))
        sys.exit(1)
    print("all checks passed: every request answered as its kind should be")
    sys.exit(0)


main()
