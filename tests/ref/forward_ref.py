#!/usr/bin/python3
"""Independent float64 reference forward pass (numpy) for every architecture moed supports.

Implements the shared architecture notes (llama.cpp-compatible semantics): qwen3moe, qwen2moe, llama
(with experts = Mixtral, or dense), olmoe, qwen2, qwen3, gpt-oss (attention sinks, sliding-window
layers, YaRN rope, biases everywhere, clamped SwiGLU, softmax over the chosen experts' logits),
deepseek2, glm4moe. Each sequence has its own KV cache and is computed on its own: batching in
the C engine must not change the mathematics, so this is the answer any micro-batch composition
has to reproduce.

deepseek2's multi-head latent attention is written the straightforward way: every head's key
and value are decompressed from the latent (attn_kv_b, or attn_k_b/attn_v_b put back into that
layout) and cached whole, then ordinary attention runs; the C engine caches only the latent and
attends in the latent space, so agreement checks that absorbed computation.

CLI mirrors moed-run:
    forward_ref.py -m MODEL -p "1,2;3,4,5" -n N [--chunk C] [-t T] [--dump-logits PATH]
stdout: "seq K: ID ID ..." per sequence. The logits dump has the same layout as moed-run's:
per sequence, rows for prompt positions 0..L-1, then rows for generated tokens 0..n_gen-2,
each row n_vocab little-endian float32.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_ref import (F32, GGUFFile, IQ4_NL, IQ4_XS, MXFP4, Q2_K, Q3_K, Q4_0, Q4_1,  # noqa: E402
                      Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)

ROPE_NORM, ROPE_NEOX = "norm", "neox"

# Per-architecture behaviour: rope style, QK-norm style, default top-k renormalisation.
ARCH_TRAITS = {
    "qwen3moe": dict(rope=ROPE_NEOX, qk_norm="head", norm_topk=True),
    "qwen2moe": dict(rope=ROPE_NEOX, qk_norm=None, norm_topk=False),
    "llama":    dict(rope=ROPE_NORM, qk_norm=None, norm_topk=True),
    "olmoe":    dict(rope=ROPE_NEOX, qk_norm="full", norm_topk=False),
    "qwen2":    dict(rope=ROPE_NEOX, qk_norm=None, norm_topk=False),
    "qwen3":    dict(rope=ROPE_NEOX, qk_norm="head", norm_topk=False),
    "gpt-oss":  dict(rope=ROPE_NEOX, qk_norm=None, norm_topk=False),
    "deepseek2": dict(rope=ROPE_NORM, qk_norm=None, norm_topk=False),
    "glm4moe":  dict(rope=ROPE_NEOX, qk_norm="optional-head", norm_topk=False),
}

# gpt-oss's SwiGLU (OpenAI's reference: alpha 1.702, limit 7, "+ 1" on the linear half).
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def swiglu_oai(g, u):
    g = np.minimum(g, OAI_LIMIT)
    u = np.clip(u, -OAI_LIMIT, OAI_LIMIT)
    return g / (1.0 + np.exp(-OAI_ALPHA * g)) * (u + 1.0)


def rmsnorm(x, w, eps):
    """x: (..., n); normalise over the last axis, times w (n,)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def yarn_get_mscale(scale, mscale):
    """YaRN's attention magnitude 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * np.log(scale) + 1.0


class RopeScaling:
    """Rope frequency scaling from a file's metadata, one reading for every architecture:
    none, or YaRN (per pair, a ramp between the pairs whose wavelength fits beta_fast resp.
    beta_slow times into the original context mixes the interpolated frequency, divided by the
    factor, with the original one; the correction dims rounded outward as llama.cpp does).
    Written from the YaRN paper, the DeepSeek-V2 reference code and OpenAI's gpt-oss code, with
    llama.cpp's reading of the GGUF keys: beta_fast 32, beta_slow 1, extrapolation factor 1
    (the yarn_beta_*/yarn_ext_factor keys are not read for these architectures), DeepSeek's
    mscale taken equal to mscale_all_dim = yarn_log_multiplier / 0.1. The magnitude of the
    rotated dims (rot_mag) is rope.scaling.attn_factor times YaRN's get_mscale(factor, 1), or
    for a file with mscale_all_dim get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim) = 1; deepseek2 scales q.k by its mscale squared (kq_scale), every other
    architecture by 1 / sqrt(head_dim). Linear scaling is refused as by the engine."""

    def __init__(self, meta, n_rot, head_dim, arch):
        typ = meta("rope.scaling.type", "linear")
        factor = float(meta("rope.scaling.factor", meta("rope.scale_linear", 0.0)))
        self.n_rot = n_rot
        self.scale = 1.0 if typ == "none" or factor == 0.0 else factor
        if typ not in ("none", "linear", "yarn"):
            raise ValueError("rope scaling '%s' not implemented" % typ)
        if typ == "linear" and self.scale != 1.0:
            raise ValueError("linear rope scaling factor %g not implemented" % factor)
        self.yarn = typ == "yarn" and self.scale != 1.0
        attn = float(meta("rope.scaling.attn_factor", 1.0))
        has_log_mul = meta("rope.scaling.yarn_log_multiplier", None) is not None
        mscale_all = float(np.float32(meta("rope.scaling.yarn_log_multiplier", 0.0))) / 0.1
        self.n_orig = int(meta("rope.scaling.original_context_length", meta("context_length", 4096)))
        self.rot_mag = attn
        m_qk = attn
        if self.yarn:
            if has_log_mul and mscale_all != 0.0:
                # DeepSeek: cos/sin times get_mscale(s, mscale) / get_mscale(s, mscale_all)
                # (1 with mscale = mscale_all), q.k times get_mscale(s, mscale_all)^2
                m_qk = attn * yarn_get_mscale(self.scale, mscale_all)
            else:
                self.rot_mag = attn * yarn_get_mscale(self.scale, 1.0)
                m_qk = self.rot_mag
        self.kq_scale = (m_qk * m_qk if arch == "deepseek2" else 1.0) / np.sqrt(head_dim)

    def inv_freq(self, base):
        """Per-pair angle per position (n_rot / 2,) for rope base `base`."""
        n_rot, half = self.n_rot, self.n_rot // 2
        i = np.arange(half, dtype=np.float64)
        inv = base ** (-2.0 * i / n_rot)
        if not self.yarn:
            return inv

        def corr(beta):   # the pair index whose wavelength fits beta turns in n_orig
            return n_rot * np.log(self.n_orig / (beta * 2 * np.pi)) / (2 * np.log(base))
        low = max(0.0, float(np.floor(corr(32.0))))
        high = min(n_rot - 1.0, float(np.ceil(corr(1.0))))
        mix = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1: keep original
        return inv / self.scale * (1.0 - mix) + inv * mix


class Layer:
    pass


# Activation block size of the 8-bit activation quantization that llama.cpp-style SIMD kernels
# pair with each quantized weight type (Q8_0 blocks for Q8_0/Q4_0, Q8_K for K-quants).
ACT_Q8_BLOCK = {Q8_0: 32, Q4_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256, Q4_1: 32, Q5_0: 32,
                Q5_1: 32, IQ4_NL: 32, MXFP4: 32, Q2_K: 256, Q3_K: 256, IQ4_XS: 256}


def act_q8(x, block):
    """Round activations to 8 bits per block of `block` elements as such kernels do:
    d = max|x| / 127, q = round-half-away(x / d), x' = q * d (float32 arithmetic)."""
    shp = x.shape
    xb = x.astype(np.float32).reshape(-1, shp[-1] // block, block)
    amax = np.max(np.abs(xb), axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = xb * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    return (q * d).astype(np.float64).reshape(shp)


class Model:
    def __init__(self, path, act_quant=False, latent_half=True):
        """act_quant: emulate kernels that round activations to 8 bits before every matmul
        with a quantized weight (a diagnostic: the default is the exact computation).
        latent_half: deepseek2's cached latent rows are rounded to half (the engine's default;
        False for its kv-cache-type f32)."""
        self.act_quant = act_quant
        self.latent_half = latent_half
        self.route_flips = set()    # (layer, position): take the (k+1)-th expert for the k-th;
                                    # (layer, position, "group"): the same for expert groups
        self.route_margins = None   # or a list of per-layer dicts position -> margin
        self.group_margins = None   # the same for the groups (group-limited routing)
        g = GGUFFile(path)
        self.gguf = g
        arch = g.arch
        if arch not in ARCH_TRAITS:
            raise ValueError("unsupported architecture '%s'" % arch)
        self.arch = arch
        tr = ARCH_TRAITS[arch]
        kv = g.kv

        _req = object()

        def meta(key, default=_req):
            full = arch + "." + key
            if full in kv:
                return kv[full]
            if default is _req:
                raise KeyError("missing metadata key '%s'" % full)
            return default

        # NextN/MTP layers at the end of the file are not run (llama.cpp skips them).
        self.n_layer = int(meta("block_count")) - int(meta("nextn_predict_layers", 0))
        self.n_embd = int(meta("embedding_length"))
        self.n_head = int(meta("attention.head_count"))
        self.n_head_kv = int(meta("attention.head_count_kv", self.n_head))
        self.head_dim = int(meta("attention.key_length", self.n_embd // self.n_head))
        vlen = int(meta("attention.value_length", self.head_dim))
        self.n_rot = int(meta("rope.dimension_count", self.head_dim))
        self.mla = arch == "deepseek2"
        if self.mla:
            # Latent attention: today's converter puts the latent row (kv_lora_rank + rope) in
            # key/value_length and the head sizes in the _mla keys; older files the head sizes.
            self.kv_lora = int(meta("attention.kv_lora_rank"))
            self.q_lora = int(meta("attention.q_lora_rank", 0))
            if (arch + ".attention.key_length_mla") in kv:
                self.head_dim = int(meta("attention.key_length_mla"))
                vlen = int(meta("attention.value_length_mla"))
            self.v_dim = vlen
            self.nope = self.head_dim - self.n_rot
        elif vlen != self.head_dim:
            raise ValueError("value_length %d != key_length %d not supported" % (vlen, self.head_dim))
        self.rope_base = float(meta("rope.freq_base", 10000.0))
        self.eps = float(np.float32(meta("attention.layer_norm_rms_epsilon", 1e-6)))
        self.n_expert = int(meta("expert_count", 0)) if (arch + ".expert_count") in kv else 0
        self.n_expert_used = int(meta("expert_used_count", 0)) if self.n_expert else 0
        self.norm_topk = bool(kv.get(arch + ".expert_weights_norm", tr["norm_topk"]))
        self.rope = tr["rope"]
        self.qk_norm = tr["qk_norm"]
        if self.qk_norm == "optional-head":   # glm4moe: GLM-4.5 has it, GLM-4.5-Air not
            self.qk_norm = "head" if "blk.0.attn_q_norm.weight" in g.tensors else None
        # Routing: softmax or sigmoid scores (expert_gating_func 1 / 2; glm4moe defaults to
        # sigmoid), an optional selection bias, group-limited top-k, routed weight scale.
        gating = int(meta("expert_gating_func", 0))
        if gating == 0:
            gating = 2 if arch == "glm4moe" else 1
        if gating not in (1, 2):
            raise ValueError("expert_gating_func %d not supported" % gating)
        self.sigmoid_gate = gating == 2
        self.w_scale = float(np.float32(meta("expert_weights_scale", 0.0))) or 1.0
        self.n_groups = int(meta("expert_group_count", 0))
        self.n_group_used = int(meta("expert_group_used_count", 0))
        self.rope_scaling = RopeScaling(meta, self.n_rot, self.head_dim, arch)
        # Sliding window (gpt-oss): layers with il % period < period - 1 see the last n_swa
        # positions only, with their own rope base where the file gives one.
        self.oss = arch == "gpt-oss"
        self.n_swa = int(meta("attention.sliding_window")) if self.oss else 0
        period = int(kv.get(arch + ".attention.sliding_window_pattern", 2))
        self.is_swa = [self.n_swa > 0 and (period == 0 or i % period < period - 1)
                       for i in range(self.n_layer)]
        self.rope_base_swa = float(kv.get(arch + ".rope.freq_base_swa", self.rope_base))

        self.wtype = {}   # id(weight array) -> GGML type, for act_quant

        def t(name, required=True):
            if name not in g.tensors:
                if required:
                    raise KeyError("missing tensor '%s'" % name)
                return None
            a = g.dequant(name).astype(np.float64)
            self.wtype[id(a)] = g.tensors[name].type
            return a

        def experts(i, what):
            """The 3-D expert tensor blk.i.ffn_<what>_exps.weight (E, rows, cols), or, in
            older Mixtral files, the E per-expert matrices blk.i.ffn_<what>.e.weight stacked."""
            merged = "blk.%d.ffn_%s_exps.weight" % (i, what)
            if merged in g.tensors:
                return t(merged)
            parts = [t("blk.%d.ffn_%s.%d.weight" % (i, what, e)) for e in range(self.n_expert)]
            types = {g.tensors["blk.%d.ffn_%s.%d.weight" % (i, what, e)].type
                     for e in range(self.n_expert)}
            assert len(types) == 1, "per-expert tensors of one merged tensor differ in type"
            a = np.stack(parts)
            self.wtype[id(a)] = types.pop()
            return a

        N, H, K, D = self.n_embd, self.n_head, self.n_head_kv, self.head_dim
        self.tok_embd = t("token_embd.weight")            # (V, N)
        self.n_vocab = self.tok_embd.shape[0]
        self.output_norm = t("output_norm.weight")
        out = t("output.weight", required=False)
        self.output = self.tok_embd if out is None else out  # (V, N)
        self.layers = []
        for i in range(self.n_layer):
            p = "blk.%d." % i
            L = Layer()
            L.attn_norm = t(p + "attn_norm.weight")
            if self.mla:
                self.load_mla(L, p, t)
            else:
                L.wq = t(p + "attn_q.weight")                  # (H*D, N)
                L.wk = t(p + "attn_k.weight")                  # (K*D, N)
                L.wv = t(p + "attn_v.weight")
                L.wo = t(p + "attn_output.weight")             # (N, H*D)
                assert L.wq.shape == (H * D, N) and L.wk.shape == (K * D, N), "attention shapes"
                L.bq = t(p + "attn_q.bias", False)
                L.bk = t(p + "attn_k.bias", False)
                L.bv = t(p + "attn_v.bias", False)
            L.q_norm = t(p + "attn_q_norm.weight", self.qk_norm is not None)
            L.k_norm = t(p + "attn_k_norm.weight", self.qk_norm is not None)
            if self.qk_norm == "head":
                assert L.q_norm.shape == (D,) and L.k_norm.shape == (D,), "per-head qk norm"
            elif self.qk_norm == "full":
                assert L.q_norm.shape == (H * D,) and L.k_norm.shape == (K * D,), "full qk norm"
            L.bo = t(p + "attn_output.bias", self.oss)
            L.sinks = t(p + "attn_sinks.weight", self.oss)                   # (H,)
            # gpt-oss and glm4moe name the norm before the FFN post_attention_norm
            L.ffn_norm = t(p + ("post_attention_norm.weight" if self.oss or arch == "glm4moe"
                                else "ffn_norm.weight"))
            L.moe = (p + "ffn_gate_inp.weight") in g.tensors
            if L.moe:
                L.router = t(p + "ffn_gate_inp.weight")     # (E, N)
                L.probs_b = t(p + "exp_probs_b.bias", False)  # (E,) selection bias
                L.gate_exps = experts(i, "gate")             # (E, F, N)
                L.up_exps = experts(i, "up")                 # (E, F, N)
                L.down_exps = experts(i, "down")             # (E, N, F)
                assert L.router.shape[0] == self.n_expert, "router rows != expert_count"
                L.router_b = t(p + "ffn_gate_inp.bias", self.oss)            # (E,)
                L.gate_b = t(p + "ffn_gate_exps.bias", self.oss)             # (E, F)
                L.up_b = t(p + "ffn_up_exps.bias", self.oss)
                L.down_b = t(p + "ffn_down_exps.bias", self.oss)             # (E, N)
                L.shexp_gate = t(p + "ffn_gate_inp_shexp.weight", False)  # (N,)
                if L.shexp_gate is not None:
                    # The converter writes it [n_embd, 1] (read here as (1, N)), the
                    # quantizer 1-D: the same vector either way.
                    assert L.shexp_gate.size == N, "shared-expert gate size != n_embd"
                    L.shexp_gate = L.shexp_gate.reshape(N)
                L.gate_sh = t(p + "ffn_gate_shexp.weight", False)         # (S, N)
                L.up_sh = t(p + "ffn_up_shexp.weight", False)
                L.down_sh = t(p + "ffn_down_shexp.weight", False)         # (N, S)
            else:
                L.gate = t(p + "ffn_gate.weight")             # (FF, N)
                L.up = t(p + "ffn_up.weight")
                L.down = t(p + "ffn_down.weight")             # (N, FF)
            self.layers.append(L)

    def load_mla(self, L, p, t):
        """deepseek2's latent attention weights; the key/value decompression as HF's kv_b_proj
        (H*(nope+v), C): attn_kv_b as it is, or attn_k_b (H, C, nope) transposed back beside
        attn_v_b (H, v, C)."""
        H, C, R, Dn, Dv = self.n_head, self.kv_lora, self.n_rot, self.nope, self.v_dim
        if self.q_lora:
            L.wq_a = t(p + "attn_q_a.weight")               # (QL, N)
            L.q_a_norm = t(p + "attn_q_a_norm.weight")
            L.wq_b = t(p + "attn_q_b.weight")               # (H*(Dn+R), QL)
            L.wq = None
        else:
            L.wq = t(p + "attn_q.weight")                   # (H*(Dn+R), N)
        L.wkv_a = t(p + "attn_kv_a_mqa.weight")             # (C+R, N)
        L.kv_a_norm = t(p + "attn_kv_a_norm.weight")
        L.wo = t(p + "attn_output.weight")                  # (N, H*Dv)
        kvb = t(p + "attn_kv_b.weight", False)
        g = self.gguf
        if kvb is not None:
            kvb = kvb.reshape(H, Dn + Dv, C)
            L.k_b, L.v_b = kvb[:, :Dn, :], kvb[:, Dn:, :]    # (H, Dn, C), (H, Dv, C)
            # act_quant: where integer kernels round activations. An engine that absorbs
            # the key product may keep an older file's key rows as floats.
            L.k_b_type, L.v_b_type = F32, g.tensors[p + "attn_kv_b.weight"].type
        else:
            L.k_b = t(p + "attn_k_b.weight").reshape(H, C, Dn).transpose(0, 2, 1)
            L.v_b = t(p + "attn_v_b.weight").reshape(H, Dv, C)
            L.k_b_type = g.tensors[p + "attn_k_b.weight"].type
            L.v_b_type = g.tensors[p + "attn_v_b.weight"].type
        L.bq = L.bk = L.bv = None

    # -----------------------------------------------------------------------------------------
    def mm(self, x, w, wt=None):
        """x (..., n_in) times weight w (n_out, n_in) -> (..., n_out). wt: the weight's
        GGML type where w is a slice of a 3-D expert tensor."""
        if self.act_quant:
            blk = ACT_Q8_BLOCK.get(self.wtype.get(id(w)) if wt is None else wt)
            if blk:
                x = act_q8(x, blk)
        return x @ w.T

    def rope_apply(self, x, pos, swa=False):
        """x: (T, n_heads, D); pos: (T,) int. Rotates the first n_rot dims of each head (a
        sliding-window layer with its own base where the file gives one), cos and sin times
        the scaling's magnitude."""
        half = self.n_rot // 2
        inv = self.rope_scaling.inv_freq(self.rope_base_swa if swa else self.rope_base)
        ang = pos[:, None].astype(np.float64) * inv[None, :]   # (T, half)
        c = np.cos(ang)[:, None, :] * self.rope_scaling.rot_mag
        s = np.sin(ang)[:, None, :] * self.rope_scaling.rot_mag
        y = x.copy()
        if self.rope == ROPE_NEOX:
            a = x[:, :, 0:half]
            b = x[:, :, half:2 * half]
            y[:, :, 0:half] = a * c - b * s
            y[:, :, half:2 * half] = a * s + b * c
        else:
            a = x[:, :, 0:2 * half:2]
            b = x[:, :, 1:2 * half:2]
            y[:, :, 0:2 * half:2] = a * c - b * s
            y[:, :, 1:2 * half:2] = a * s + b * c
        return y

    def moe_ffn(self, L, h, li=0, pos=None):
        """h: (T, N) -> (T, N); li: the layer's index, pos: (T,) the tokens' positions.

        Where (li, position) is in self.route_flips, the k-th and (k+1)-th choices trade places
        (the other side of a near-tie, see parity.py); every token's margin between them is
        appended to self.route_margins[li] when that is a list."""
        T = h.shape[0]
        if self.oss:
            return self.moe_oss(L, h, li, pos)
        logits = h @ L.router.T
        probs = 1.0 / (1.0 + np.exp(-logits)) if self.sigmoid_gate else softmax(logits)  # (T, E)
        # Selection: score + bias, only within the n_group_used groups whose two best biased
        # scores sum highest; the weights are the unbiased scores.
        sel = probs + L.probs_b if getattr(L, "probs_b", None) is not None else probs.copy()
        if self.n_groups > 1:
            G, u = self.n_groups, self.n_group_used
            grp = sel.reshape(T, G, -1)
            top2 = np.sort(grp, axis=-1)[:, :, ::-1][:, :, :2].sum(axis=-1)     # (T, G)
            for t in range(T):
                order = np.argsort(-top2[t], kind="stable")
                p = int(pos[t]) if pos is not None else t
                if self.group_margins is not None:
                    self.group_margins[li][p] = float(top2[t, order[u - 1]] - top2[t, order[u]])
                if (li, p, "group") in self.route_flips:
                    order = order.copy()
                    order[u - 1], order[u] = order[u], order[u - 1]
                mask = np.ones(G, dtype=bool)
                mask[order[:u]] = False
                grp[t, mask, :] = -np.inf
            sel = grp.reshape(T, -1)
        out = np.zeros_like(h)
        k = self.n_expert_used
        picks = {}   # expert -> [(token, weight)]
        for t in range(T):
            # Top-k by probability, ties broken by the lower expert index (stable sort).
            full = np.argsort(-sel[t], kind="stable")
            p = int(pos[t]) if pos is not None else t
            if self.route_margins is not None and k < len(full):
                self.route_margins[li][p] = float(sel[t, full[k - 1]] - sel[t, full[k]])
            if (li, p) in self.route_flips and k < len(full):
                full = full.copy()
                full[k - 1], full[k] = full[k], full[k - 1]
            order = full[:k]
            w = probs[t, order]
            if self.norm_topk:
                w = w / max(np.sum(w), 6.103515625e-5)
            w = w * self.w_scale
            for e, we in zip(order, w):
                picks.setdefault(int(e), []).append((t, we))
        # Each expert once over the tokens that chose it (row by row the same products).
        tg, tu, td = (self.wtype[id(a)] for a in (L.gate_exps, L.up_exps, L.down_exps))
        for e, tw in sorted(picks.items()):
            ts = np.array([t for t, _ in tw])
            we = np.array([w for _, w in tw])
            g = self.mm(h[ts], L.gate_exps[e], tg)
            u = self.mm(h[ts], L.up_exps[e], tu)
            out[ts] += we[:, None] * self.mm(silu(g) * u, L.down_exps[e], td)
        if L.gate_sh is not None:
            g = self.mm(h, L.gate_sh)
            u = self.mm(h, L.up_sh)
            y = self.mm(silu(g) * u, L.down_sh)              # (T, N)
            if L.shexp_gate is not None:
                sg = 1.0 / (1.0 + np.exp(-(h @ L.shexp_gate)))  # (T,)
                y = y * sg[:, None]
            out += y
        return out

    def moe_oss(self, L, h, li=0, pos=None):
        """gpt-oss: the k largest biased router logits, weights a softmax over those k; each
        expert with its biases and the clamped SwiGLU. Near ties between the k-th and
        (k+1)-th logits are recorded and flipped as in moe_ffn."""
        logits = h @ L.router.T + L.router_b                # (T, E)
        out = np.zeros_like(h)
        k = self.n_expert_used
        tg, tu, td = (self.wtype[id(a)] for a in (L.gate_exps, L.up_exps, L.down_exps))
        for t in range(h.shape[0]):
            full = np.argsort(-logits[t], kind="stable")
            p = int(pos[t]) if pos is not None else t
            if self.route_margins is not None and k < len(full):
                self.route_margins[li][p] = float(logits[t, full[k - 1]] - logits[t, full[k]])
            if (li, p) in self.route_flips and k < len(full):
                full = full.copy()
                full[k - 1], full[k] = full[k], full[k - 1]
            order = full[:k]
            w = softmax(logits[t, order])
            for e, we in zip(order, w):
                g = self.mm(h[t], L.gate_exps[e], tg) + L.gate_b[e]
                u = self.mm(h[t], L.up_exps[e], tu) + L.up_b[e]
                out[t] += we * (self.mm(swiglu_oai(g, u), L.down_exps[e], td) + L.down_b[e])
        return out

    def new_cache(self):
        if self.mla:   # the decompressed keys and values of every head
            return [dict(k=np.zeros((0, self.n_head, self.head_dim)),
                         v=np.zeros((0, self.n_head, self.v_dim))) for _ in range(self.n_layer)]
        return [dict(k=np.zeros((0, self.n_head_kv, self.head_dim)),
                     v=np.zeros((0, self.n_head_kv, self.head_dim))) for _ in range(self.n_layer)]

    def attn_mla(self, L, h, c, pos):
        """deepseek2 attention of h (T, N), decompressed: per head q = [q_nope, rope(q_pe)],
        k = [W_k_b,h latent, rope(k_pe)], v = W_v_b,h latent, latent = RMSNorm of the first
        kv_lora_rank outputs of W_kv_a, rounded to half as a cache holds it. Appends k, v to the
        cache c."""
        T = h.shape[0]
        H, C, R, Dn = self.n_head, self.kv_lora, self.n_rot, self.nope
        if L.wq is None:
            q = self.mm(rmsnorm(self.mm(h, L.wq_a), L.q_a_norm, self.eps), L.wq_b)
        else:
            q = self.mm(h, L.wq)
        q = q.reshape(T, H, Dn + R)
        kva = self.mm(h, L.wkv_a)                                   # (T, C+R)
        lat = rmsnorm(kva[:, :C], L.kv_a_norm, self.eps)            # (T, C)
        k_pe = self.rope_apply(kva[:, None, C:].copy(), pos)          # (T, 1, R)
        # The cache holds the latent and the rope key in half (llama.cpp's F16 cache, moed's
        # latent rows by default): every later use reads them rounded.
        if self.latent_half:
            lat = lat.astype(np.float16).astype(np.float64)
            k_pe = k_pe.astype(np.float16).astype(np.float64)
        q_pe = self.rope_apply(q[:, :, Dn:].copy(), pos)              # (T, H, R)
        k_nope = np.einsum("hdc,tc->thd", L.k_b, lat)               # (T, H, Dn)
        v = np.einsum("hdc,tc->thd", L.v_b, lat)                    # (T, H, Dv)
        q_nope = q[:, :, :Dn]
        if self.act_quant and ACT_Q8_BLOCK.get(L.k_b_type):
            # Integer kernels multiply the key weights with the query, not the latent:
            # Q(q) . (W_k c) = (W_k^T Q(q)) . c, so rounding q here is the same thing.
            q_nope = act_q8(q_nope, ACT_Q8_BLOCK[L.k_b_type])
        qf = np.concatenate([q_nope, q_pe], axis=-1)
        kf = np.concatenate([k_nope, np.repeat(k_pe, H, axis=1)], axis=-1)
        c["k"] = np.concatenate([c["k"], kf], axis=0)
        c["v"] = np.concatenate([c["v"], v], axis=0)
        c["lat"] = np.concatenate([c.get("lat", np.zeros((0, C))), lat], axis=0)
        S = c["k"].shape[0]
        scores = np.einsum("thd,shd->hts", qf, c["k"]) * self.rope_scaling.kq_scale
        mask = np.arange(S)[None, :] > pos[:, None]
        scores = np.where(mask[None, :, :], -np.inf, scores)
        att = softmax(scores, axis=-1)
        if self.act_quant and ACT_Q8_BLOCK.get(L.v_b_type):
            # ... and the value weights with the weighted sum of latents, rounded first
            # (the one place this variant uses the latent: W_v sum a c = sum a W_v c).
            olat = act_q8(np.einsum("hts,sc->thc", att, c["lat"]), ACT_Q8_BLOCK[L.v_b_type])
            o = np.einsum("hdc,thc->thd", L.v_b, olat).reshape(T, -1)
        else:
            o = np.einsum("hts,shd->thd", att, c["v"]).reshape(T, -1)
        return self.mm(o, L.wo)

    def forward(self, cache, tokens):
        """Run tokens (list of ids) at the next positions of the sequence owning cache.

        Appends to cache; returns logits (T, n_vocab) float64."""
        H, K, D = self.n_head, self.n_head_kv, self.head_dim
        T = len(tokens)
        p0 = cache[0]["k"].shape[0]
        pos = np.arange(p0, p0 + T)
        x = self.tok_embd[np.asarray(tokens, dtype=np.int64)].copy()   # (T, N)
        group = H // K
        for li, L in enumerate(self.layers):
            h = rmsnorm(x, L.attn_norm, self.eps)
            if self.mla:
                x = x + self.attn_mla(L, h, cache[li], pos)
                h = rmsnorm(x, L.ffn_norm, self.eps)
                x = x + (self.moe_ffn(L, h, li, pos) if L.moe else
                         self.mm(silu(self.mm(h, L.gate)) * self.mm(h, L.up), L.down))
                continue
            q = self.mm(h, L.wq)
            k = self.mm(h, L.wk)
            v = self.mm(h, L.wv)
            if L.bq is not None:
                q = q + L.bq
            if L.bk is not None:
                k = k + L.bk
            if L.bv is not None:
                v = v + L.bv
            if self.qk_norm == "full":
                q = rmsnorm(q, L.q_norm, self.eps)
                k = rmsnorm(k, L.k_norm, self.eps)
            q = q.reshape(T, H, D)
            k = k.reshape(T, K, D)
            v = v.reshape(T, K, D)
            if self.qk_norm == "head":
                q = rmsnorm(q, L.q_norm, self.eps)
                k = rmsnorm(k, L.k_norm, self.eps)
            q = self.rope_apply(q, pos, self.is_swa[li])
            k = self.rope_apply(k, pos, self.is_swa[li])
            c = cache[li]
            c["k"] = np.concatenate([c["k"], k], axis=0)
            c["v"] = np.concatenate([c["v"], v], axis=0)
            S = c["k"].shape[0]
            kk = np.repeat(c["k"], group, axis=1)           # (S, H, D): head h -> kv h // group
            vv = np.repeat(c["v"], group, axis=1)
            scores = np.einsum("thd,shd->hts", q, kk) * self.rope_scaling.kq_scale  # (H, T, S)
            mask = np.arange(S)[None, :] > pos[:, None]     # (T, S) future positions
            if self.is_swa[li]:                             # and those out of the window
                mask |= pos[:, None] - np.arange(S)[None, :] >= self.n_swa
            scores = np.where(mask[None, :, :], -np.inf, scores)
            if L.sinks is not None:
                # The sink: one more logit per head in the softmax, with no value row.
                sk = np.broadcast_to(L.sinks[:, None, None], (H, T, 1))
                att = softmax(np.concatenate([scores, sk], axis=-1), axis=-1)[:, :, :S]
            else:
                att = softmax(scores, axis=-1)
            o = np.einsum("hts,shd->thd", att, vv).reshape(T, H * D)
            x = x + self.mm(o, L.wo)
            if L.bo is not None:
                x = x + L.bo
            h = rmsnorm(x, L.ffn_norm, self.eps)
            if L.moe:
                x = x + self.moe_ffn(L, h, li, pos)
            else:
                x = x + self.mm(silu(self.mm(h, L.gate)) * self.mm(h, L.up), L.down)
        return self.mm(rmsnorm(x, self.output_norm, self.eps), self.output)

    def generate(self, prompt, n_gen):
        """Greedy generation for one sequence. Returns (generated ids, logit rows)."""
        cache = self.new_cache()
        rows = []
        logits = self.forward(cache, prompt)
        rows.extend(logits)
        out = []
        last = logits[-1]
        for i in range(n_gen):
            tok = int(np.argmax(last))       # ties: lowest id
            out.append(tok)
            if i == n_gen - 1:
                break
            last = self.forward(cache, [tok])[0]
            rows.append(last)
        return out, np.array(rows).reshape(-1, self.n_vocab)


def parse_prompts(s):
    seqs = []
    for part in s.split(";"):
        part = part.strip()
        if not part:
            raise ValueError("empty prompt in '%s'" % s)
        seqs.append([int(x) for x in part.split(",")])
    return seqs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", required=True)
    ap.add_argument("-n", "--n-gen", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=0, help="accepted for CLI parity; no effect")
    ap.add_argument("-t", "--threads", type=int, default=1, help="accepted; no effect")
    ap.add_argument("--dump-logits")
    ap.add_argument("--act-q8", action="store_true",
                    help="round activations to 8 bits before quantized matmuls (diagnostic)")
    a = ap.parse_args(argv)
    try:
        m = Model(a.model, act_quant=a.act_q8)
        seqs = parse_prompts(a.prompt)
        for s in seqs:
            for tok in s:
                if not 0 <= tok < m.n_vocab:
                    raise ValueError("token %d out of range (n_vocab %d)" % (tok, m.n_vocab))
    except Exception as e:  # one error line, exit 1, like moed-run
        print("forward_ref: %s" % e, file=sys.stderr)
        return 1
    t0 = time.time()
    dump = []
    for i, s in enumerate(seqs):
        gen, rows = m.generate(s, a.n_gen)
        print("seq %d: %s" % (i, " ".join(str(x) for x in gen)))
        dump.append(rows)
    print("# reference forward: %.2f s" % (time.time() - t0))
    if a.dump_logits:
        np.concatenate(dump, axis=0).astype("<f4").tofile(a.dump_logits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
