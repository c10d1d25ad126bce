#!/usr/bin/python3
"""Trains moed's models (the default qwen3moe MoE and dense qwen3 draft, and the many-expert
qwen3moe "moe64") and exports GGUFs.

Steps (each one resumable, all from a fixed seed):
  prep    KJV text -> documents, held-out split, byte-level BPE, token arrays
  train   --model moe|draft|moe64|moe64-draft: AdamW + cosine LR, checkpoints, --resume;
          moe64-draft is distilled from moe64 (KL to the teacher's softmax, --teacher)
  export  --models NAME,... (default moe,draft) -> GGUF (F16 matrices, F32 vectors)
  eval    --models TARGET,DRAFT (a configuration or a .gguf file each; default moe,draft):
          validation loss/perplexity, expert usage and locality, draft agreement, samples
  all     every step in order
"""
import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time

import numpy as np

# OpenBLAS's pthreads spin; on a busy shared machine one thread is ~3x faster per token.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402
import gguf_in  # noqa: E402
import gguf_out  # noqa: E402

SEED = 1234
VOCAB = 4096
SEQ = 256
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONFIGS = {
    "moe": dict(arch="qwen3moe", name="moed-default-moe", n_layer=4, d=192, n_head=6, n_kv=2,
                hd=32, n_exp=16, k=2, ff_exp=128, ff=0, batch=4, lr=3e-3, aux=0.01),
    "draft": dict(arch="qwen3", name="moed-default-draft", n_layer=2, d=128, n_head=4, n_kv=2,
                  hd=32, n_exp=0, k=0, ff_exp=0, ff=384, batch=4, lr=3e-3, aux=0.0),
    # Many fine-grained experts for the routing statistics expert caches and prefetchers are
    # measured on: top-4 of 64, renormalised, the share of experts a token uses in
    # Qwen3-30B-A3B (8 of 128); 6 layers.
    "moe64": dict(arch="qwen3moe", name="moed-moe64", n_layer=6, d=192, n_head=6, n_kv=2,
                  hd=32, n_exp=64, k=4, ff_exp=64, ff=0, batch=4, lr=3e-3, aux=0.01),
    # moe64's own draft: the default draft's shape, trained on moe64's output distribution
    # (distill = weight of KL(teacher || draft) in the loss, the rest is the data loss), so its
    # argmax agrees with moe64's more often than a draft trained on the text alone.
    "moe64-draft": dict(arch="qwen3", name="moed-moe64-draft", n_layer=2, d=128, n_head=4,
                        n_kv=2, hd=32, n_exp=0, k=0, ff_exp=0, ff=384, batch=4, lr=3e-3,
                        aux=0.0, teacher="moe64", distill=1.0),
}
# The file each configuration is exported to (models/).
OUT_FILES = {"moe": "moed-default-moe.gguf", "draft": "moed-default-draft.gguf",
             "moe64": "moed-moe64.gguf", "moe64-draft": "moed-moe64-draft.gguf"}
# Each model gets its own stream of training batches (moe/draft keep their original seeds).
# moe64-draft reads the default draft's stream: the two drafts differ only in their loss.
BATCH_SEED = {"moe": 0, "draft": 7, "moe64": 13, "moe64-draft": 7}
EPS = 1e-6
ROPE_BASE = 10000.0


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---------------------------------------------------------------- data

def read_kjv():
    """The King James Bible as printed by the bible-kjv program (bible-kjv-text data)."""
    return subprocess.run(["bible", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                          check=True, env=dict(os.environ, COLUMNS="80")).stdout


def kjv_chapters(raw):
    """Parses 'Book N' headers (between blank lines) and indented 'V text' verses with
    wrapped continuation lines: [(book, chapter, [(verse, text), ...]), ...]."""
    lines = raw.split("\n")
    chapters = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\S.*) (\d+)$", line)
        if (m and (i == 0 or not lines[i - 1].strip())
                and (i + 1 == len(lines) or not lines[i + 1].strip())):
            chapters.append((m.group(1), int(m.group(2)), []))
            continue
        if not line.strip() or not chapters:
            continue
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            chapters[-1][2].append((int(m.group(1)), m.group(2).strip()))
        elif chapters[-1][2]:
            v, t = chapters[-1][2][-1]
            chapters[-1][2][-1] = (v, t + " " + line.strip())
    return chapters


def make_docs(chapters, rng):
    """Each chapter is one document; some become a ChatML exchange asking for a passage."""
    docs = []
    for book, c, verses in chapters:
        text = f"{book} {c}\n\n" + "\n".join(f"{v} {t}" for v, t in verses) + "\n"
        docs.append(("text", text))
        if rng.random() < 0.5:
            a = rng.randrange(len(verses))
            b = min(len(verses), a + rng.randint(1, 4))
            ask = rng.choice(["Read me {}.", "Quote {}.", "What does {} say?", "Recite {}.",
                              "Please give me {}."])
            ref = f"{book} {c}:{verses[a][0]}" + (f"-{verses[b - 1][0]}" if b - a > 1 else "")
            ans = " ".join(t for _, t in verses[a:b])
            docs.append(("chat", (ask.format(ref), ans)))
    return docs


def encode_docs(tok, docs):
    sp = tok.special
    ids = []
    for kind, d in docs:
        if kind == "text":
            ids += tok.encode(d)
            ids.append(sp["<|endoftext|>"])
        else:
            q, a = d
            ids += [sp["<|im_start|>"]] + tok.encode("user\n" + q) + [sp["<|im_end|>"]]
            ids += tok.encode("\n")
            ids += [sp["<|im_start|>"]] + tok.encode("assistant\n" + a) + [sp["<|im_end|>"]]
            ids += tok.encode("\n")
            ids.append(sp["<|endoftext|>"])
    return np.array(ids, dtype=np.int32)


def cmd_prep(a):
    os.makedirs(a.work, exist_ok=True)
    raw = read_kjv()
    chapters = kjv_chapters(raw)
    log(f"kjv: {len(chapters)} chapters, {sum(len(c[2]) for c in chapters)} verses, "
        f"{len(raw)} bytes")
    rng = random.Random(SEED)
    # Held out: every 20th chapter (about 5%), spread over the whole book.
    train_ch = [c for i, c in enumerate(chapters) if i % 20 != 7]
    val_ch = [c for i, c in enumerate(chapters) if i % 20 == 7]
    train_docs = make_docs(train_ch, rng)
    val_docs = make_docs(val_ch, rng)
    rng.shuffle(train_docs)
    texts = [d if k == "text" else "user\n" + d[0] + "\nassistant\n" + d[1]
             for k, d in train_docs]
    t0 = time.time()
    merges = bpe.train_bpe(texts, VOCAB - 256 - len(bpe.SPECIALS), log=log)
    log(f"bpe: {len(merges)} merges in {time.time() - t0:.1f}s")
    tok = bpe.Tokenizer(merges)
    tr = encode_docs(tok, train_docs)
    va = encode_docs(tok, val_docs)
    np.save(os.path.join(a.work, "train.npy"), tr)
    np.save(os.path.join(a.work, "val.npy"), va)
    with open(os.path.join(a.work, "merges.json"), "w") as f:
        json.dump(merges, f)
    # Unigram cross-entropy of the validation set under train token frequencies (add-one).
    cnt = np.bincount(tr, minlength=len(tok.tokens)).astype(np.float64) + 1
    p = cnt / cnt.sum()
    uni = float(-np.log(p[va]).mean())
    nbytes_val = sum(len(d.encode()) if k == "text" else len(d[0]) + len(d[1]) + 30
                     for k, d in val_docs)
    info = dict(train_tokens=int(len(tr)), val_tokens=int(len(va)), unigram_ce=uni,
                val_bytes_approx=nbytes_val, vocab=len(tok.tokens),
                train_chapters=len(train_ch), val_chapters=len(val_ch))
    with open(os.path.join(a.work, "data.json"), "w") as f:
        json.dump(info, f, indent=1)
    log("prep:", json.dumps(info))
    log("sample:", repr(tok.decode(va[:60].tolist())))


def load_tok(work):
    with open(os.path.join(work, "merges.json")) as f:
        merges = [tuple(m) for m in json.load(f)]
    return bpe.Tokenizer(merges)


# ---------------------------------------------------------------- model

def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, cos, sin):
    """NEOX rotation: pairs (i, i + D/2)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, H, K, D = c["d"], c["n_head"], c["n_kv"], c["hd"]
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.wq = nn.Linear(d, H * D, bias=False)
        self.wk = nn.Linear(d, K * D, bias=False)
        self.wv = nn.Linear(d, K * D, bias=False)
        self.wo = nn.Linear(H * D, d, bias=False)
        self.q_norm = nn.Parameter(torch.ones(D))
        self.k_norm = nn.Parameter(torch.ones(D))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        if c["n_exp"]:
            E, Fe = c["n_exp"], c["ff_exp"]
            self.router = nn.Linear(d, E, bias=False)
            self.gate = nn.Parameter(torch.randn(E, Fe, d) * 0.02)
            self.up = nn.Parameter(torch.randn(E, Fe, d) * 0.02)
            self.down = nn.Parameter(torch.randn(E, d, Fe) * 0.02 / math.sqrt(2 * c["n_layer"]))
        else:
            self.ffn_gate = nn.Linear(d, c["ff"], bias=False)
            self.ffn_up = nn.Linear(d, c["ff"], bias=False)
            self.ffn_down = nn.Linear(c["ff"], d, bias=False)

    def attn(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        H, K, D = c["n_head"], c["n_kv"], c["hd"]
        h = rmsnorm(x, self.attn_norm)
        q = self.wq(h).view(B, T, H, D)
        k = self.wk(h).view(B, T, K, D)
        v = self.wv(h).view(B, T, K, D)
        q = rope(rmsnorm(q, self.q_norm), cos, sin).transpose(1, 2)
        k = rope(rmsnorm(k, self.k_norm), cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        k = k.repeat_interleave(H // K, dim=1)
        v = v.repeat_interleave(H // K, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        s = s.masked_fill(mask, float("-inf"))
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
        return self.wo(o)

    def moe(self, h, stats):
        """Batched experts: tokens are grouped expert-major into an [E, C, d] buffer
        (C = most tokens any expert got), run with bmm, and scattered back with index_add."""
        c = self.c
        E, k = c["n_exp"], c["k"]
        T, d = h.shape
        p = self.router(h).float().softmax(-1)
        topw, topi = p.topk(k, dim=-1)
        topw = topw / topw.sum(-1, keepdim=True)
        fe = topi.reshape(-1)
        ft = torch.arange(T).repeat_interleave(k)
        fw = topw.reshape(-1)
        order = torch.argsort(fe, stable=True)
        se, st, sw = fe[order], ft[order], fw[order]
        counts = torch.bincount(fe, minlength=E)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(T * k) - starts[se]
        C = int(counts.max())
        buf = h.new_zeros(E, C, d)
        buf[se, pos] = h[st]
        g = torch.bmm(buf, self.gate.transpose(1, 2))
        u = torch.bmm(buf, self.up.transpose(1, 2))
        y = torch.bmm(F.silu(g) * u, self.down.transpose(1, 2))
        out = h.new_zeros(T, d).index_add_(0, st, y[se, pos] * sw[:, None])
        # Switch-style load balancing: E * sum_e (share of routings to e) * (mean prob of e).
        aux = E * (counts.float() / (T * k) * p.mean(0)).sum()
        if stats is not None:
            stats.append(counts.detach())
            self.last_topi = topi.detach()  # [T, k] chosen experts, for locality statistics
        return out, aux

    def forward(self, x, cos, sin, stats=None):
        x = x + self.attn(x, cos, sin)
        h = rmsnorm(x, self.ffn_norm)
        if self.c["n_exp"]:
            B, T, d = h.shape
            y, aux = self.moe(h.reshape(B * T, d), stats)
            return x + y.view(B, T, d), aux
        y = self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))
        return x + y, x.new_zeros(())


class Model(nn.Module):
    def __init__(self, c, vocab):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(vocab, c["d"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.out_norm = nn.Parameter(torch.ones(c["d"]))
        for n, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if n.endswith("wo.weight") or n.endswith("ffn_down.weight"):
                    p.data /= math.sqrt(2 * c["n_layer"])
        D = c["hd"]
        inv = ROPE_BASE ** (-torch.arange(0, D, 2).float() / D)
        ang = torch.arange(SEQ).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids, stats=None):
        T = ids.shape[1]
        x = self.emb(ids)
        cos, sin = self.cos[:T][:, None], self.sin[:T][:, None]
        aux = 0.0
        for b in self.blocks:
            x, a = b(x, cos, sin, stats)
            aux = aux + a
        return rmsnorm(x, self.out_norm) @ self.emb.weight.t(), aux


# ---------------------------------------------------------------- training

def batch(data, bsz, step, seed):
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    ix = torch.randint(0, len(data) - SEQ - 1, (bsz,), generator=g)
    x = torch.stack([data[i:i + SEQ + 1] for i in ix.tolist()])
    return x[:, :-1].long(), x[:, 1:].long()


@torch.no_grad()
def evaluate(model, val, max_tokens=None):
    model.eval()
    n = len(val) - 1
    if max_tokens:
        n = min(n, max_tokens)
    tot, cnt = 0.0, 0
    for s in range(0, n - SEQ + 1, SEQ):
        x = val[s:s + SEQ + 1].long()[None]
        logits, _ = model(x[:, :-1])
        tot += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        cnt += SEQ
    model.train()
    return tot / cnt


def load_teacher(a, name):
    """The model a draft is distilled from: --teacher (a configuration or a .gguf file), else
    the configuration's teacher from its checkpoint in --work, else its shipped GGUF in --out.
    Matrices rounded to F16 either way: the draft learns the function the engine serves."""
    t = a.teacher or name
    if not t.endswith(".gguf") and not os.path.exists(os.path.join(a.work, f"{t}.pt")):
        t = os.path.join(a.out, OUT_FILES[t])
    model, _ = load_model(a.work, t)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def distill_kl(teacher, x, logits):
    """Mean over positions of KL(softmax(teacher) || softmax(logits)), nats."""
    with torch.no_grad():
        tl, _ = teacher(x)
        tlp = tl.float().log_softmax(-1)
    lp = logits.float().log_softmax(-1)
    return (tlp.exp() * (tlp - lp)).sum(-1).mean()


def cmd_train(a):
    torch.manual_seed(SEED)
    torch.set_num_threads(a.threads)
    c = CONFIGS[a.model]
    tok = load_tok(a.work)
    V = len(tok.tokens)
    tr = torch.from_numpy(np.load(os.path.join(a.work, "train.npy")))
    va = torch.from_numpy(np.load(os.path.join(a.work, "val.npy")))
    model = Model(c, V)
    nparam = sum(p.numel() for p in model.parameters())
    log(f"{a.model}: {nparam / 1e6:.2f}M params, train {len(tr)} tokens, val {len(va)}")
    if a.distill >= 0:
        c = dict(c, distill=a.distill)
    teacher, alpha = None, c.get("distill", 0.0)
    if c.get("teacher"):
        teacher = load_teacher(a, c["teacher"])
        log(f"distilling from {a.teacher or c['teacher']}: loss = {alpha} * KL(teacher || "
            f"model) + {1 - alpha:g} * data loss")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    nodecay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=c["lr"], betas=(0.9, 0.95))
    ck = os.path.join(a.work, f"{a.model}.pt")
    step = 0
    if a.resume and os.path.exists(ck):
        st = torch.load(ck)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        log(f"resumed at step {step}")
    steps, warm = a.steps, max(1, min(100, a.steps // 20))

    def lr_at(s):
        if s < warm:
            return c["lr"] * (s + 1) / warm
        t = (s - warm) / max(1, steps - warm)
        return c["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "config": c}, ck + ".tmp")
        os.replace(ck + ".tmp", ck)

    t0 = time.time()
    s0 = step
    stop = min(steps, a.stop_at) if a.stop_at else steps
    while step < stop:
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step)
        x, y = batch(tr, c["batch"], step, SEED + BATCH_SEED[a.model])
        logits, aux = model(x)
        ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        loss = ce + c["aux"] * aux
        kl = None
        if teacher is not None:
            kl = distill_kl(teacher, x, logits)
            loss = alpha * kl + (1 - alpha) * ce + c["aux"] * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == s0 + 1:
            dt = time.time() - t0
            tps = (step - s0) * c["batch"] * SEQ / dt
            log(f"{a.model} step {step}/{steps} loss {ce.item():.4f} aux "
                f"{float(aux):.3f}" + ("" if kl is None else f" kl {kl.item():.4f}")
                + f" lr {lr_at(step):.2e} {tps:.0f} tok/s")
        if step % a.eval_every == 0 or step == stop:
            vl = evaluate(model, va, 4096)
            log(f"{a.model} step {step} val_loss(4k) {vl:.4f} ppl {math.exp(vl):.2f}")
            save()
    save()


# ---------------------------------------------------------------- export

def load_gguf_model(path, vocab):
    """A model exported by cmd_export, read back from its GGUF (F16 matrices, as exported):
    evaluates shipped models whose checkpoints are not at hand."""
    r = gguf_in.Reader(path)
    ar = r.kv["general.architecture"]
    kv = lambda k, d=0: r.kv.get(f"{ar}.{k}", d)  # noqa: E731
    n_exp = kv("expert_count")
    c = dict(arch=ar, name=r.kv["general.name"], n_layer=kv("block_count"),
             d=kv("embedding_length"), n_head=kv("attention.head_count"),
             n_kv=kv("attention.head_count_kv"), hd=kv("attention.key_length"), n_exp=n_exp,
             k=kv("expert_used_count"), ff_exp=kv("expert_feed_forward_length"),
             ff=0 if n_exp else kv("feed_forward_length"), batch=4, lr=3e-3, aux=0.0)
    model = Model(c, vocab)
    names = {"emb.weight": "token_embd.weight", "out_norm": "output_norm.weight"}
    for i in range(c["n_layer"]):
        p, b = f"blk.{i}.", f"blocks.{i}."
        for mine, theirs in (("attn_norm", "attn_norm"), ("wq.weight", "attn_q"),
                             ("wk.weight", "attn_k"), ("wv.weight", "attn_v"),
                             ("wo.weight", "attn_output"), ("q_norm", "attn_q_norm"),
                             ("k_norm", "attn_k_norm"), ("ffn_norm", "ffn_norm"),
                             ("router.weight", "ffn_gate_inp"), ("gate", "ffn_gate_exps"),
                             ("up", "ffn_up_exps"), ("down", "ffn_down_exps"),
                             ("ffn_gate.weight", "ffn_gate"), ("ffn_up.weight", "ffn_up"),
                             ("ffn_down.weight", "ffn_down")):
            names[b + mine] = p + theirs + ".weight"
    sd = {k: torch.from_numpy(r.tensor(names[k])) for k in model.state_dict()}
    model.load_state_dict(sd)
    model.eval()
    return model


def load_model(work, name, f16_round=True):
    """A trained model: NAME from its checkpoint in work (matrices rounded to F16 unless
    f16_round is false), or NAME ending in .gguf read back from that file."""
    if name.endswith(".gguf"):
        tok = load_tok(work)
        return load_gguf_model(name, len(tok.tokens)), tok
    st = torch.load(os.path.join(work, f"{name}.pt"))
    tok = load_tok(work)
    model = Model(st["config"], len(tok.tokens))
    model.load_state_dict(st["model"])
    if f16_round:  # what the engine sees: every matrix rounded to F16
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.copy_(p.half().float())
    model.eval()
    return model, tok


def cmd_export(a):
    os.makedirs(a.out, exist_ok=True)
    for name in a.models.split(","):
        fname = OUT_FILES[name]
        model, tok = load_model(a.work, name, f16_round=False)
        c = model.c
        ar = c["arch"]
        w = gguf_out.Writer()
        w.str("general.architecture", ar)
        w.str("general.name", c["name"])
        w.str("general.license", "public-domain-data; model weights CC0-1.0")
        w.u32("general.alignment", gguf_out.ALIGN)
        w.u32(f"{ar}.block_count", c["n_layer"])
        w.u32(f"{ar}.context_length", SEQ)
        w.u32(f"{ar}.embedding_length", c["d"])
        w.u32(f"{ar}.feed_forward_length", c["ff"] if c["ff"] else c["ff_exp"])
        w.u32(f"{ar}.attention.head_count", c["n_head"])
        w.u32(f"{ar}.attention.head_count_kv", c["n_kv"])
        w.u32(f"{ar}.attention.key_length", c["hd"])
        w.u32(f"{ar}.attention.value_length", c["hd"])
        w.f32(f"{ar}.rope.freq_base", ROPE_BASE)
        w.f32(f"{ar}.attention.layer_norm_rms_epsilon", EPS)
        if c["n_exp"]:
            w.u32(f"{ar}.expert_count", c["n_exp"])
            w.u32(f"{ar}.expert_used_count", c["k"])
            w.u32(f"{ar}.expert_feed_forward_length", c["ff_exp"])
        w.str("tokenizer.ggml.model", "gpt2")
        w.str("tokenizer.ggml.pre", "qwen2")
        w.str_arr("tokenizer.ggml.tokens", tok.tokens)
        w.i32_arr("tokenizer.ggml.token_type",
                  [3 if t in tok.special else 1 for t in tok.tokens])
        w.str_arr("tokenizer.ggml.merges", [x + " " + y for x, y in tok.merges])
        w.u32("tokenizer.ggml.bos_token_id", tok.special["<|endoftext|>"])
        w.u32("tokenizer.ggml.eos_token_id", tok.special["<|im_end|>"])
        w.u32("tokenizer.ggml.padding_token_id", tok.special["<|endoftext|>"])
        w.bool("tokenizer.ggml.add_bos_token", False)
        w.str("tokenizer.chat_template", CHATML_TEMPLATE)
        sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        w.tensor("token_embd.weight", sd["emb.weight"])
        for i in range(c["n_layer"]):
            p, b = f"blk.{i}.", f"blocks.{i}."
            w.tensor(p + "attn_norm.weight", sd[b + "attn_norm"])
            w.tensor(p + "attn_q.weight", sd[b + "wq.weight"])
            w.tensor(p + "attn_k.weight", sd[b + "wk.weight"])
            w.tensor(p + "attn_v.weight", sd[b + "wv.weight"])
            w.tensor(p + "attn_output.weight", sd[b + "wo.weight"])
            w.tensor(p + "attn_q_norm.weight", sd[b + "q_norm"])
            w.tensor(p + "attn_k_norm.weight", sd[b + "k_norm"])
            w.tensor(p + "ffn_norm.weight", sd[b + "ffn_norm"])
            if c["n_exp"]:
                w.tensor(p + "ffn_gate_inp.weight", sd[b + "router.weight"])
                w.tensor(p + "ffn_gate_exps.weight", sd[b + "gate"])
                w.tensor(p + "ffn_up_exps.weight", sd[b + "up"])
                w.tensor(p + "ffn_down_exps.weight", sd[b + "down"])
            else:
                w.tensor(p + "ffn_gate.weight", sd[b + "ffn_gate.weight"])
                w.tensor(p + "ffn_up.weight", sd[b + "ffn_up.weight"])
                w.tensor(p + "ffn_down.weight", sd[b + "ffn_down.weight"])
        w.tensor("output_norm.weight", sd["out_norm"])
        path = os.path.join(a.out, fname)
        w.write(path)
        log(f"wrote {path} ({os.path.getsize(path)} bytes)")


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def greedy(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        logits, _ = model(torch.tensor([ids[-SEQ:]]))
        t = int(logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


def routing_stats(moe, va, n_tok, windows=(1, 4, 16)):
    """Routing statistics of an MoE over the first n_tok held-out tokens, in SEQ windows.
    Per layer: entropy of the expert-usage distribution (bits), the share of routings taken by
    the hottest ceil(10 %) of experts, and reuse[W]: the mean fraction of a token's k experts
    that were also chosen by at least one of the W tokens before it in the same window (W = 1
    is "the next token reuses": the locality an expert cache lives on). The uniform baseline
    for reuse[W] is 1 - (1 - k/E)^W."""
    c = moe.c
    E, k, L = c["n_exp"], c["k"], c["n_layer"]
    counts = torch.zeros(L, E, dtype=torch.float64)
    hits = {w: np.zeros(L) for w in windows}
    pairs = {w: 0 for w in windows}
    stats = []
    for s in range(0, n_tok, SEQ):
        stats.clear()
        moe(va[s:s + SEQ].long()[None], stats)
        counts += torch.stack(stats).double()
        for l, b in enumerate(moe.blocks):
            sel = np.zeros((SEQ, E), dtype=bool)  # [T, E]: expert e chosen at position t
            sel[np.arange(SEQ)[:, None], b.last_topi.numpy()] = True
            for w in windows:
                # seen[t] = experts chosen anywhere in t-w .. t-1, for t >= w
                seen = np.zeros((SEQ - w, E), dtype=bool)
                for d in range(1, w + 1):
                    seen |= sel[w - d:SEQ - d]
                hits[w][l] += (seen & sel[w:]).sum() / k
                if l == 0:
                    pairs[w] += SEQ - w
    usage = []
    for l, cl in enumerate(counts):
        p = cl / cl.sum()
        ent = float(-(p[p > 0] * p[p > 0].log2()).sum())
        hot = int(math.ceil(0.1 * len(p)))
        share = float(p.sort(descending=True).values[:hot].sum())
        reuse = {str(w): float(hits[w][l] / pairs[w]) for w in windows}
        usage.append(dict(layer=l, entropy_bits=ent, hottest_share=share, hot_n=hot,
                          reuse=reuse, counts=[int(x) for x in cl]))
        log(f"layer {l}: entropy {ent:.3f} bits (max {math.log2(len(p)):.2f}), "
            f"hottest {hot} experts get {share * 100:.1f}% of routings, next token reuses "
            f"{reuse['1'] * 100:.1f}% (uniform {k / E * 100:.1f}%), previous "
            + ", ".join(f"{w}: {reuse[str(w)] * 100:.1f}%" for w in windows[1:]))
    return usage


def agreement(moe, draft, va, n_tok=10240):
    """Draft/target greedy agreement (teacher-forced) over the first n_tok held-out tokens."""
    agree = tot = 0
    for s in range(0, n_tok, SEQ):
        x = va[s:s + SEQ].long()[None]
        a1 = moe(x)[0].argmax(-1)
        a2 = draft(x)[0].argmax(-1)
        agree += int((a1 == a2).sum())
        tot += a1.numel()
    log(f"draft agrees with target argmax on {agree}/{tot} = {agree / tot * 100:.1f}% "
        "of held-out positions")
    return agree / tot


@torch.no_grad()
def cmd_eval(a):
    """--models TARGET,DRAFT (default moe,draft, written to eval.json; any other target to
    eval-TARGET.json): losses of both, routing statistics of the target, agreement, samples.
    --quick: only the draft's loss and the agreement (eval-quick-TARGET-DRAFT.json)."""
    torch.set_num_threads(a.threads)
    tname, dname = a.models.split(",")
    moe, tok = load_model(a.work, tname)
    draft, _ = load_model(a.work, dname)
    va = torch.from_numpy(np.load(os.path.join(a.work, "val.npy")))
    if a.quick:
        vl = evaluate(draft, va)
        log(f"draft: val loss {vl:.4f} ppl {math.exp(vl):.2f} (F16 weights, "
            f"{(len(va) - 1) // SEQ * SEQ} tokens)")
        res = {"target": tname, "draft": dname, "draft_val_loss": vl,
               "draft_val_ppl": math.exp(vl), "draft_agreement": agreement(moe, draft, va)}
        tag = "-".join(os.path.basename(n).removesuffix(".gguf") for n in (tname, dname))
        with open(os.path.join(a.work, f"eval-quick-{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    with open(os.path.join(a.work, "data.json")) as f:
        info = json.load(f)
    res = {"unigram_ce": info["unigram_ce"], "val_tokens": info["val_tokens"],
           "target": tname, "draft": dname}
    for name, m in (("moe", moe), ("draft", draft)):
        vl = evaluate(m, va)
        res[f"{name}_val_loss"] = vl
        res[f"{name}_val_ppl"] = math.exp(vl)
        log(f"{name}: val loss {vl:.4f} ppl {math.exp(vl):.2f} (F16 weights, "
            f"{(len(va) - 1) // SEQ * SEQ} tokens)")
    # Expert usage and locality over 10k held-out tokens.
    res["expert_usage"] = routing_stats(moe, va, 10240)
    # Draft/target greedy agreement (teacher-forced) on held-out text.
    res["draft_agreement"] = agreement(moe, draft, va)
    # Greedy continuations for the C engine comparison.
    prompts = ["In the beginning God created", "And the LORD said unto Moses,",
               "Blessed are the", "For God so loved"]
    res["greedy"] = []
    for ptxt in prompts:
        ids = tok.encode(ptxt)
        g = {}
        for name, m in (("moe", moe), ("draft", draft)):
            g[name] = greedy(m, ids, 32)
        res["greedy"].append(dict(prompt=ptxt, ids=ids, **g))
        log(f"prompt {ptxt!r} ids {','.join(map(str, ids))}")
        log(f"  moe  : {tok.decode(g['moe'])!r}")
        log(f"  draft: {tok.decode(g['draft'])!r}")
    chat = ([tok.special["<|im_start|>"]] + tok.encode("user\nRead me John 3:16.")
            + [tok.special["<|im_end|>"]] + tok.encode("\n")
            + [tok.special["<|im_start|>"]] + tok.encode("assistant\n"))
    g = greedy(moe, chat, 48)
    res["greedy"].append(dict(prompt="chat: Read me John 3:16.", ids=chat, moe=g,
                              draft=greedy(draft, chat, 32)))
    log(f"chat sample: {tok.decode(g)!r}")
    tag = os.path.basename(tname).removesuffix(".gguf")
    out = "eval.json" if tname == "moe" else f"eval-{tag}.json"
    with open(os.path.join(a.work, out), "w") as f:
        json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["prep", "train", "export", "eval", "all"])
    ap.add_argument("--work", default="train-work", help="data, checkpoints, eval results")
    ap.add_argument("--out", default="models", help="where the GGUFs go")
    ap.add_argument("--model", choices=sorted(CONFIGS), default="moe",
                    help="train: which configuration")
    ap.add_argument("--models", default="moe,draft",
                    help="export: configurations to write; eval: TARGET,DRAFT")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--moe-steps", type=int, default=900)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="eval: only the draft's held-out loss and its agreement")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="train: stop (with a checkpoint) after this step, the schedule "
                    "still that of --steps")
    ap.add_argument("--teacher", default="",
                    help="train: the model to distill from (configuration or .gguf), "
                    "overriding the configuration's")
    ap.add_argument("--distill", type=float, default=-1,
                    help="train: weight of the KL-to-teacher loss (0-1), overriding the "
                    "configuration's")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.cmd == "prep":
        cmd_prep(a)
    elif a.cmd == "train":
        a.steps = a.steps or (a.draft_steps if a.model.endswith("draft") else a.moe_steps)
        cmd_train(a)
    elif a.cmd == "export":
        cmd_export(a)
    elif a.cmd == "eval":
        cmd_eval(a)
    else:
        if not os.path.exists(os.path.join(a.work, "merges.json")):
            cmd_prep(a)
        for m in ("moe", "draft"):
            a.model = m
            a.steps = a.moe_steps if m == "moe" else a.draft_steps
            cmd_train(a)
        cmd_export(a)
        cmd_eval(a)


if __name__ == "__main__":
    main()
