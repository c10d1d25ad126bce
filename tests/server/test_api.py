"""Every endpoint and error path of a real moed, driven by curl, checked against openapi.yaml.

usage: test_api.py MOED MODEL
"""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, curl, finish, sse_events, validate  # noqa: E402

moed, model = sys.argv[1], sys.argv[2]
srv = Server(moed, model)
try:
    # ---- small endpoints ----
    st, h, doc = call(srv, "GET", "/health")
    check(st == 200 and doc == {"status": "ok"}, "health 200", st, doc)
    st, h, doc = call(srv, "GET", "/v1/models")
    check(st == 200 and len(doc["data"]) == 1, "models lists one", doc)
    name = doc["data"][0]["id"]
    st, h, doc = call(srv, "GET", "/v1/models/" + name)
    check(st == 200 and doc["id"] == name, "model by id", st, doc)
    st, h, doc = call(srv, "GET", "/v1/models/nope")
    check(st == 404 and doc["error"]["code"] == "model_not_found", "unknown model id 404", st, doc)
    st, h, body = call(srv, "GET", "/metrics")
    text = body.decode() if isinstance(body, bytes) else body
    for m in ("moed:http_requests_total", "moed:prompt_tokens_total", "moed:generation_tokens_total",
              "moed:time_to_first_token_seconds_bucket", "moed:inter_token_latency_seconds_bucket",
              "moed:num_requests_waiting", "moed:num_requests_running", "moed:kv_cache_blocks_used",
              "moed:request_success_total"):
        check(m in text, "metrics has " + m)
    check(h.get("content-type", "").startswith("text/plain"), "metrics content type", h)

    st, h, doc = call(srv, "POST", "/tokenize", {"content": "Hello world", "with_pieces": True})
    check(st == 200 and doc["count"] == len(doc["tokens"]) > 0, "tokenize", doc)
    check("".join(doc.get("pieces", [])) == "Hello world", "pieces join to the text", doc)
    toks = doc["tokens"]
    st, h, doc = call(srv, "POST", "/detokenize", {"tokens": toks})
    check(st == 200 and doc["content"] == "Hello world", "detokenize round trip", doc)
    st, h, doc = call(srv, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    check(st == 200 and doc["count"] > 2, "tokenize a chat", doc)
    st, h, doc = call(srv, "POST", "/detokenize", {"tokens": [-1]})
    check(st == 400, "detokenize bad id 400", st, doc)
    # a character cut in two decodes as Hugging Face's byte-level decoder does: one U+FFFD for
    # the cut sequence, the whole character after it intact (tests/tok checks against HF)
    eur = call(srv, "POST", "/tokenize", {"content": "\u20ac"})[2]["tokens"]
    if len(eur) == 3:
        st, h, doc = call(srv, "POST", "/detokenize", {"tokens": eur[:2] + eur + eur[:1]})
        check(st == 200 and doc["content"] == "\ufffd\u20ac\ufffd", "detokenize a cut character", doc)

    # ---- completions ----
    req = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    st, h, c1 = call(srv, "POST", "/v1/completions", req)
    check(st == 200 and c1["object"] == "text_completion", "completion 200", st, c1)
    check(c1["usage"]["completion_tokens"] <= 8 and c1["usage"]["prompt_tokens"] > 0, "usage", c1)
    check(c1["choices"][0]["finish_reason"] in ("stop", "length"), "finish reason", c1)
    st, h, c2 = call(srv, "POST", "/v1/completions", req)
    check(c1["choices"][0]["text"] == c2["choices"][0]["text"], "greedy is repeatable", c1, c2)
    # the same prompt as token ids gives the same text
    ids = call(srv, "POST", "/tokenize", {"content": "The quick brown fox"})[2]["tokens"]
    st, h, c3 = call(srv, "POST", "/v1/completions", dict(req, prompt=ids))
    check(st == 200 and c3["choices"][0]["text"] == c1["choices"][0]["text"], "token-id prompt", c3)
    st, h, c4 = call(srv, "POST", "/v1/completions", dict(req, prompt=["a b", "c d"], n=2))
    check(st == 200 and sorted(c["index"] for c in c4["choices"]) == [0, 1, 2, 3], "list prompt x n", c4)
    # streaming completion with usage and logprobs
    st, h, evs = call(srv, "POST", "/v1/completions",
                      dict(req, stream=True, stream_options={"include_usage": True}, logprobs=2))
    check(st == 200 and h.get("content-type", "").startswith("text/event-stream"), "SSE type", h)
    check(h.get("cache-control") == "no-cache" and h.get("x-accel-buffering") == "no", "SSE headers", h)
    text = "".join(e["choices"][0]["text"] for e in evs if e.get("choices"))
    check(text == c1["choices"][0]["text"], "streamed text equals non-streamed", text, c1)
    check(evs[-1]["choices"] == [] and "usage" in evs[-1], "usage chunk last", evs[-1])
    check(all("usage" in e and e["usage"] is None for e in evs[:-1]),
          "usage: null on the chunks before it", [e for e in evs[:-1] if e.get("usage")])
    fin = [e for e in evs if e.get("choices") and e["choices"][0]["finish_reason"]]
    check(len(fin) == 1, "one finish chunk", fin)
    lps = [e["choices"][0]["logprobs"] for e in evs if e.get("choices") and e["choices"][0]["logprobs"]]
    check(sum(len(l["tokens"]) for l in lps) == evs[-1]["usage"]["completion_tokens"] - (
        1 if fin and fin[0]["choices"][0]["finish_reason"] == "stop" else 0),
        "one logprob per emitted token", lps, evs[-1])
    for l in lps:
        for t in l["top_logprobs"]:
            check(len(t) <= 2, "top_logprobs <= 2", t)
    # no usage chunk without include_usage
    st, h, evs = call(srv, "POST", "/v1/completions", dict(req, stream=True))
    check(all("usage" not in e for e in evs), "no usage chunk without include_usage", evs[-1:])

    # seeded sampling is reproducible; different seeds usually differ
    sreq = {"prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    a = call(srv, "POST", "/v1/completions", sreq)[2]["choices"][0]["text"]
    b = call(srv, "POST", "/v1/completions", sreq)[2]["choices"][0]["text"]
    c = call(srv, "POST", "/v1/completions", dict(sreq, seed=43))[2]["choices"][0]["text"]
    check(a == b, "same seed same text", a, b)
    check(a != c, "different seed different text", a, c)
    # ignore_eos + max_tokens: exactly max_tokens tokens
    d = call(srv, "POST", "/v1/completions", dict(sreq, max_tokens=5))[2]
    check(d["usage"]["completion_tokens"] == 5 and d["choices"][0]["finish_reason"] == "length",
          "max_tokens honoured", d)
    # top_k=1 equals greedy
    g = call(srv, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 8, "temperature": 0})[2]
    k1 = call(srv, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 8,
                                               "temperature": 1.5, "top_k": 1, "seed": 5})[2]
    check(g["choices"][0]["text"] == k1["choices"][0]["text"], "top_k=1 is greedy", g, k1)
    # logit_bias forces a token
    force = ids[0]
    lb = call(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0,
                                               "logit_bias": {str(force): 100}, "ignore_eos": True})[2]
    piece = call(srv, "POST", "/detokenize", {"tokens": [force] * 3})[2]["content"]
    check(lb["choices"][0]["text"] == piece, "logit_bias +100 forces the token", lb, piece)

    # stop strings: cut the greedy text at a substring taken from it
    full = call(srv, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 24,
                                                 "temperature": 0, "ignore_eos": True})[2]
    ft = full["choices"][0]["text"]
    if len(ft) >= 6:
        stop = ft[3:6]
        cut = ft[:ft.index(stop)]
        r = call(srv, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 24,
                                                  "temperature": 0, "stop": stop, "ignore_eos": True})[2]
        check(r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop",
              "stop string cuts", r, cut)
        st, h, evs = call(srv, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 24,
                                                           "temperature": 0, "stop": [stop, "zzzz"],
                                                           "stream": True, "ignore_eos": True})
        streamed = "".join(e["choices"][0]["text"] for e in evs if e.get("choices"))
        check(streamed == cut, "streamed stop string held back", streamed, cut)
    else:
        check(False, "greedy text long enough for the stop test", ft)

    # return_token_ids (vLLM's extension): the ids behind the text and the prompt
    st, h, ri = call(srv, "POST", "/v1/completions", dict(req, prompt=["The quick brown fox", "a b"],
                                                          n=2, return_token_ids=True))
    check(st == 200 and len(ri["choices"]) == 4, "return_token_ids 200", st, ri)
    for c in ri["choices"]:
        tok_ids = c.get("token_ids", [])
        check(len(tok_ids) == ri["usage"]["completion_tokens"] // 4 or c["finish_reason"] == "stop",
              "token_ids: one per generated token", c, ri["usage"])
        back = call(srv, "POST", "/detokenize", {"tokens": tok_ids})[2]["content"]
        check(back.startswith(c["text"]) and tok_ids, "token_ids decode to the text", c, back)
        want = ids if c["index"] < 2 else call(srv, "POST", "/tokenize", {"content": "a b"})[2]["tokens"]
        check(c.get("prompt_token_ids") == want, "prompt_token_ids per choice", c, want)
    check(ri["choices"][0]["text"] == c1["choices"][0]["text"], "return_token_ids: same text", ri, c1)
    # streamed: each choice's chunks add up to the whole response's ids, the prompt's on the
    # choice's first chunk only
    st, h, sev = call(srv, "POST", "/v1/completions", dict(req, prompt=["The quick brown fox", "a b"],
                                                           n=2, return_token_ids=True, stream=True))
    for c in ri["choices"]:
        mine = [e["choices"][0] for e in sev if e.get("choices") and e["choices"][0]["index"] == c["index"]]
        got = [t for x in mine for t in x.get("token_ids", [])]
        check(st == 200 and got == c["token_ids"], "streamed token_ids add up", c["index"], got, c)
        heads = [x.get("prompt_token_ids") for x in mine if "prompt_token_ids" in x]
        check(heads == [c["prompt_token_ids"]] and "prompt_token_ids" in mine[0],
              "streamed prompt_token_ids once, first", c["index"], heads)
        check("".join(x["text"] for x in mine) == c["text"], "streamed text with ids", mine, c)
    check("token_ids" not in c1["choices"][0], "no token_ids unless asked", c1)

    # ---- chat ----
    creq = {"model": name, "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Say hello"}],
            "max_tokens": 10, "temperature": 0}
    st, h, ch = call(srv, "POST", "/v1/chat/completions", creq)
    check(st == 200 and ch["object"] == "chat.completion", "chat 200", st, ch)
    st, h, evs = call(srv, "POST", "/v1/chat/completions",
                      dict(creq, stream=True, stream_options={"include_usage": True}, logprobs=True,
                           top_logprobs=3))
    check(evs[0]["choices"][0]["delta"].get("role") == "assistant", "role chunk first", evs[0])
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in evs if e.get("choices"))
    check(content == ch["choices"][0]["message"]["content"], "streamed chat equals non-streamed",
          content, ch)
    def counts(u):
        return {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    check(counts(evs[-1]["usage"]) == counts(ch["usage"]), "streamed usage equals", evs[-1],
          ch["usage"])
    st, h, ri = call(srv, "POST", "/v1/chat/completions", dict(creq, return_token_ids=True))
    rendered = call(srv, "POST", "/tokenize", {"messages": creq["messages"]})[2]["tokens"]
    check(st == 200 and ri.get("prompt_token_ids") == rendered
          and len(ri["prompt_token_ids"]) == ri["usage"]["prompt_tokens"],
          "chat return_token_ids: the rendered prompt", ri, rendered)
    back = call(srv, "POST", "/detokenize", {"tokens": ri["choices"][0]["token_ids"]})[2]["content"]
    check(len(ri["choices"][0]["token_ids"]) == ri["usage"]["completion_tokens"]
          and back.startswith(ch["choices"][0]["message"]["content"]),
          "chat token_ids: the reply's tokens", ri, back)
    st, h, sev = call(srv, "POST", "/v1/chat/completions", dict(creq, return_token_ids=True, stream=True))
    got = [t for e in sev if e.get("choices") for t in e["choices"][0].get("token_ids", [])]
    check(st == 200 and sev[0].get("prompt_token_ids") == rendered
          and all("prompt_token_ids" not in e for e in sev[1:]) and got == ri["choices"][0]["token_ids"],
          "chat streamed ids: the prompt's first, the reply's adding up", sev[:2], got, ri)
    # the same prompt again: all of it but the last token comes from the prefix cache (whole
    # blocks shared, the rest copied from the first run's last block), and usage says so
    n_cached = ch["usage"]["prompt_tokens"] - 1
    check(evs[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == n_cached,
          "repeated prompt: cached_tokens", evs[-1]["usage"], n_cached)
    ents = [x for e in evs if e.get("choices") and e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"]["content"]]
    check(all(len(x["top_logprobs"]) == 3 and x["logprob"] <= 0 for x in ents), "chat logprobs", ents[:2])
    check(all(abs(x["top_logprobs"][0]["logprob"] - x["logprob"]) < 1e-4 for x in ents),
          "greedy token is the top logprob", ents[:2])
    # content parts and max_completion_tokens
    st, h, d = call(srv, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}],
                     "max_completion_tokens": 3, "temperature": 0, "n": 2, "ignore_eos": True})
    check(st == 200 and len(d["choices"]) == 2 and d["usage"]["completion_tokens"] == 6, "n=2 parts", d)

    # ---- errors ----
    def err(method, path, body, status, param=None, raw=None, headers=()):
        st, h, d = call(srv, method, path, body, raw=raw, headers=headers)
        ok = check(st == status, "%s %s -> %d" % (method, path, status), st, d, body)
        if ok and param is not None:
            check(d["error"]["param"] == param, "error names param " + param, d)
        return st, h, d
    err("POST", "/v1/chat/completions", {"messages": []}, 400, "messages")
    err("POST", "/v1/chat/completions", {}, 400, "messages")
    err("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
        "messages[0].role")
    err("POST", "/v1/chat/completions", dict(creq, temperature="hot"), 400, "temperature")
    err("POST", "/v1/chat/completions", dict(creq, temperature=3), 400, "temperature")
    err("POST", "/v1/chat/completions", dict(creq, top_p=0), 400, "top_p")
    err("POST", "/v1/chat/completions", dict(creq, max_tokens=0), 400, "max_tokens")
    err("POST", "/v1/chat/completions", dict(creq, max_tokens=1.5), 400, "max_tokens")
    err("POST", "/v1/chat/completions", dict(creq, max_tokens=10 ** 9), 400, "max_tokens")
    err("POST", "/v1/chat/completions", dict(creq, n=0), 400, "n")
    err("POST", "/v1/chat/completions", dict(creq, stream="yes"), 400, "stream")
    err("POST", "/v1/chat/completions", dict(creq, stop=5), 400, "stop")
    err("POST", "/v1/chat/completions", dict(creq, logit_bias={"abc": 1}), 400, "logit_bias")
    err("POST", "/v1/chat/completions", dict(creq, logit_bias={"1": 500}), 400, "logit_bias")
    err("POST", "/v1/chat/completions", dict(creq, top_logprobs=2), 400, "top_logprobs")
    err("POST", "/v1/chat/completions", dict(creq, presence_penalty=-3), 400, "presence_penalty")
    err("POST", "/v1/chat/completions", dict(creq, stream_options={"include_usage": True}), 400,
        "stream_options")
    err("POST", "/v1/chat/completions", dict(creq, model="gpt-4"), 404, "model")
    err("POST", "/v1/completions", {"prompt": 5}, 400, "prompt")
    err("POST", "/v1/completions", {"prompt": [1, -2]}, 400, "prompt")
    err("POST", "/v1/completions", {}, 400, "prompt")
    err("POST", "/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs")
    st, h, d = err("POST", "/v1/completions", {"prompt": "x", "unknown_field": [1, {"a": 2}],
                                               "max_tokens": 1}, 200)
    err("POST", "/v1/completions", None, 400, raw=b'{"prompt": "x",')
    err("POST", "/v1/completions", None, 400, raw=b'[1, 2]')
    err("POST", "/v1/completions", None, 400, raw=b'{"prompt": "\xff\xfe"}')
    err("POST", "/v1/completions", None, 400, raw=b'')
    err("POST", "/v1/completions", None, 400, raw=b'{"prompt": "x"} trailing')
    err("GET", "/v1/chat/completions", None, 405)
    err("POST", "/health", None, 405)
    err("GET", "/nope", None, 404)
    # context overflow
    err("POST", "/v1/completions", {"prompt": "word " * 5000, "max_tokens": 1}, 400, "prompt")
    # body limit: 413 with an error object
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    st, h, d = call(srv, "POST", "/v1/completions", raw=big)
    check(st == 413 and d["error"]["type"] == "invalid_request_error", "oversized body 413", st, d)
    # the server still serves
    st, h, d = call(srv, "GET", "/health")
    check(st == 200, "still healthy after errors", st)
    st, h, b = curl(srv, "GET", "/metrics")
    check('moed:http_requests_total{code="400"}' in b.decode(), "400s counted in metrics")
finally:
    rc = srv.stop()
    check(rc == 0, "SIGTERM exits 0", rc, srv.logtext()[-2000:])
finish()
