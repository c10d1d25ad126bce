"""gpt-oss's harmony channels through a real moed: the analysis channel comes back as
message.reasoning_content (delta.reasoning_content when streaming), the final channel as content,
the markers as neither, and a request's messages are rendered with the harmony template.

The model is a random-weight gpt-oss file from moed-gguf gen with the harmony chat template
selected (--chat-template gpt-oss). Random weights do not write harmony on their own, so the
raw grammar extension forces the output's shape (channel headers, bodies of random letters);
what the model picks inside it differs per request, and the test checks that each piece lands
in its field. A model whose output is not harmony still gets all of it as content.

usage: test_harmony.py MOED MOED_GGUF
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, call, check, finish  # noqa: E402

moed, moed_gguf = sys.argv[1:3]
tmp = tempfile.mkdtemp(prefix="moed-harmony-")
model = os.path.join(tmp, "gpt-oss.gguf")
import subprocess  # noqa: E402
subprocess.run([moed_gguf, "gen", "--arch", "gpt-oss", "--n-embd", "64", "--n-head", "4",
                "--n-head-kv", "2", "--head-dim", "16", "--n-ff-exp", "64", "--sliding-window", "8",
                "--n-vocab", "512", "--seed", "3", model], check=True, capture_output=True)

R, C = "[a-z]{3,8}", "[a-z]{2,6}"
GRAMMAR = ('root ::= "<|channel|>analysis<|message|>" reason "<|end|><|start|>assistant'
           '<|channel|>final<|message|>" answer\nreason ::= %s (" " %s)?\nanswer ::= %s' % (R, R, C))

srv = Server(moed, model, args=["--chat-template", "gpt-oss"])
try:
    body = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": "What is 2+2?"}],
            "max_tokens": 300, "temperature": 0, "grammar": GRAMMAR}
    st, _, doc = call(srv, "POST", "/v1/chat/completions", body)
    check(st == 200, "harmony chat 200", st, doc)
    msg = doc["choices"][0]["message"]
    content, reasoning = msg.get("content"), msg.get("reasoning_content")
    check(isinstance(reasoning, str) and reasoning and reasoning.replace(" ", "").isalpha() and
          reasoning.islower(), "the analysis channel is message.reasoning_content", msg)
    check(isinstance(content, str) and content.isalpha() and content.islower(),
          "the final channel is message.content", msg)
    check("<|" not in (content or "") + (reasoning or ""), "no harmony markers in the message", msg)
    check(doc["choices"][0]["finish_reason"] == "stop", "finish stop", doc["choices"][0])

    # The same request streamed (greedy: the same tokens): reasoning deltas, then content.
    st, _, evs = call(srv, "POST", "/v1/chat/completions", dict(body, stream=True))
    check(st == 200, "harmony stream 200", st)
    deltas = [c["delta"] for e in evs for c in e["choices"]]
    r = "".join(d.get("reasoning_content") or "" for d in deltas)
    c = "".join(d.get("content") or "" for d in deltas)
    check(r == reasoning and c == content, "streamed deltas reassemble the whole response",
          r, c, reasoning, content)
    first_r = min((i for i, d in enumerate(deltas) if d.get("reasoning_content")), default=-1)
    first_c = min((i for i, d in enumerate(deltas) if d.get("content")), default=-1)
    check(0 <= first_r < first_c, "reasoning streams before the content", first_r, first_c)
    check(sum(1 for d in deltas if d.get("reasoning_content")) >= 2,
          "reasoning arrives in pieces as it is generated", deltas[:6])

    # Without the grammar the random model writes no harmony: everything is content, nothing
    # is lost to the parser, and reasoning_content is null.
    st, _, doc = call(srv, "POST", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                       "temperature": 0})
    msg = doc["choices"][0]["message"]
    check(st == 200 and msg.get("reasoning_content") is None, "no reasoning without harmony", msg)
    check(doc["usage"]["completion_tokens"] == 0 or msg.get("content"),
          "a model that does not write harmony keeps its text as content", doc)

    # The prompt is the harmony rendering (the template's byte-exact check is tmpl-gpt-oss):
    # /tokenize renders the messages, /detokenize gives the text back.
    st, _, t = call(srv, "POST", "/tokenize",
                    {"messages": [{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": "x"}]})
    st2, _, dt = call(srv, "POST", "/detokenize", {"tokens": t["tokens"]})
    text = dt.get("content", "") if isinstance(dt, dict) else ""
    want_head = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
                 "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ")
    want_tail = ("\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel "
                 "must be included for every message.<|end|><|start|>developer<|message|>"
                 "# Instructions\n\nBe brief.\n\n<|end|><|start|>user<|message|>x<|end|>"
                 "<|start|>assistant")
    check(st == st2 == 200 and text.startswith(want_head) and text.endswith(want_tail) and
          len(text) == len(want_head) + len("YYYY-MM-DD") + len(want_tail),
          "the prompt is the harmony rendering", text)
    # reasoning_effort lands in the system header ("Reasoning: low" is shorter than the default
    # "medium"); an effort gpt-oss does not know is refused by name.
    eff = {}
    for e in ("low", None):
        req = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        if e:
            req["reasoning_effort"] = e
        st, _, d = call(srv, "POST", "/v1/chat/completions", req)
        eff[e] = d["usage"]["prompt_tokens"] if st == 200 else None
    check(eff["low"] is not None and eff[None] is not None and eff["low"] < eff[None],
          "reasoning_effort reaches the harmony system header", eff)
    st, _, d = call(srv, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"})
    check(st == 400 and d["error"]["param"] == "reasoning_effort", "unknown effort refused", st, d)
    log = srv.logtext()
    check("gpt-oss" in log, "the log names the chat template", log[-2000:])
finally:
    check(srv.stop() == 0, "clean exit")
finish()
