"""Test-only GGUF writer and random-model maker for exercising the reference on its own.

The real parity models come from the C tool (moed-gguf gen); this helper exists so the
reference's reader and forward pass can be tested without it (ref-self). Quantized tensors are
random but valid blocks (random quants, small positive scales), not quantizations of floats.
"""

import struct

import numpy as np

from gguf_ref import (BF16, F16, F32, GGML_TYPES, IQ4_NL, IQ4_XS, MXFP4, Q2_K, Q3_K, Q4_0, Q4_1,
                      Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QK_K, T_ARR,
                      T_BOOL, T_F32, T_F64, T_I8, T_I16, T_I32, T_I64, T_STR, T_U8, T_U16,
                      T_U32, T_U64)

_FMT = {T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i",
        T_F32: "<f", T_BOOL: "<?", T_U64: "<Q", T_I64: "<q", T_F64: "<d"}
_NP = {T_U8: "<u1", T_I8: "<i1", T_U16: "<u2", T_I16: "<i2", T_U32: "<u4", T_I32: "<i4",
       T_F32: "<f4", T_BOOL: "<u1", T_U64: "<u8", T_I64: "<i8", T_F64: "<f8"}


def _str(s):
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(t, v, et=None):
    if t in _FMT:
        return struct.pack(_FMT[t], v)
    if t == T_STR:
        return _str(v)
    if t == T_ARR:
        out = struct.pack("<IQ", et, len(v))
        if et in _NP:
            return out + np.asarray(v).astype(_NP[et]).tobytes()
        return out + b"".join(_value(et, x) for x in v)
    raise ValueError(t)


def write_gguf(path, kvs, tensors, version=3, alignment=32):
    """kvs: list of (key, type, value[, elem_type]); tensors: list of (name, ne, type, bytes)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for kv in kvs:
        key, t, v = kv[0], kv[1], kv[2]
        head += _str(key) + struct.pack("<I", t) + _value(t, v, kv[3] if len(kv) > 3 else None)
    off = 0
    offs = []
    for name, ne, t, data in tensors:
        offs.append(off)
        off += (len(data) + alignment - 1) // alignment * alignment
    for (name, ne, t, data), o in zip(tensors, offs):
        head += _str(name) + struct.pack("<I", len(ne)) + struct.pack("<%dQ" % len(ne), *ne)
        head += struct.pack("<IQ", t, o)
    pad = (-len(head)) % alignment
    with open(path, "wb") as f:
        f.write(head + b"\0" * pad)
        for name, ne, t, data in tensors:
            f.write(data + b"\0" * ((-len(data)) % alignment))


def _f16b(x):
    return np.asarray(x, dtype="<f2").view(np.uint8)


def random_tensor_bytes(rng, ne, t, std):
    """Bytes of a random tensor of shape ne and GGML type t with roughly the given std."""
    n = int(np.prod(ne))
    if t == F32:
        return (rng.standard_normal(n) * std).astype("<f4").tobytes()
    if t == F16:
        return (rng.standard_normal(n) * std).astype("<f2").tobytes()
    if t == BF16:
        f = (rng.standard_normal(n) * std).astype("<f4").view("<u4")
        return (f >> 16).astype("<u2").tobytes()
    _, blk, bsz = GGML_TYPES[t]
    nb = n // blk
    b = rng.integers(0, 256, size=(nb, bsz), dtype=np.uint8)
    if t == Q8_0:
        b[:, 0:2] = _f16b(np.full(nb, std / 73.0)).reshape(nb, 2)
    elif t == Q4_0:
        b[:, 0:2] = _f16b(np.full(nb, std / 4.6)).reshape(nb, 2)
    elif t in (Q4_K, Q5_K):
        qmax = 15 if t == Q4_K else 31
        b[:, 0:2] = _f16b(np.full(nb, 2 * std / qmax / 32)).reshape(nb, 2)   # d
        b[:, 2:4] = _f16b(np.full(nb, std / 32)).reshape(nb, 2)              # dmin
    elif t == Q6_K:
        b[:, 192:208] = rng.integers(8, 64, size=(nb, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = _f16b(np.full(nb, std / 18 / 36)).reshape(nb, 2)
    elif t in (Q4_1, Q5_1):
        d = std / (4.6 if t == Q4_1 else 9.2)
        b[:, 0:2] = _f16b(np.full(nb, d)).reshape(nb, 2)
        b[:, 2:4] = _f16b(np.full(nb, -(7.5 if t == Q4_1 else 15.5) * d)).reshape(nb, 2)
    elif t == Q5_0:
        b[:, 0:2] = _f16b(np.full(nb, std / 9.2)).reshape(nb, 2)
    elif t == Q2_K:
        b[:, 80:82] = _f16b(np.full(nb, std / 8)).reshape(nb, 2)    # d
        b[:, 82:84] = _f16b(np.full(nb, std / 16)).reshape(nb, 2)   # dmin
    elif t == Q3_K:
        b[:, 108:110] = _f16b(np.full(nb, std / 42)).reshape(nb, 2)
    elif t == IQ4_NL:
        b[:, 0:2] = _f16b(np.full(nb, std / 70)).reshape(nb, 2)
    elif t == IQ4_XS:
        b[:, 0:2] = _f16b(np.full(nb, std / 1260)).reshape(nb, 2)
    elif t == MXFP4:
        e0 = 128 + int(np.floor(np.log2(std / 5.5)))
        b[:, 0] = rng.integers(e0 - 1, e0 + 2, size=nb).astype(np.uint8)
    else:
        raise ValueError(t)
    return b.tobytes()


ARCH_OF = {"mixtral": "llama", "llama": "llama"}


def make_model(path, arch, wtype, seed=1, n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
               head_dim=64, n_ff=256, n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256,
               n_vocab=512, std=0.08, tied=False, layout="merged"):
    """Write a random model of the given test arch (qwen3moe ... mixtral, llama) and type.

    layout: "merged" (3-D expert tensors, 1-D shared-expert gate); "converter" (the
    shared-expert gate 2-D [n_embd, 1] as convert_hf_to_gguf.py writes it); "split-experts"
    (per-expert 2-D tensors blk.N.ffn_{gate,down,up}.E.weight, expert by expert, as the old
    convert.py wrote Mixtral). The same seed gives the same weights in every layout."""
    rng = np.random.default_rng(seed)
    ga = ARCH_OF.get(arch, arch)
    moe = arch in ("qwen3moe", "qwen2moe", "mixtral", "olmoe")
    if not moe:
        n_expert = 0
    N, H, K, D, V = n_embd, n_head, n_head_kv, head_dim, n_vocab
    F = n_ff_exp if ga in ("qwen3moe", "qwen2moe") else n_ff
    kvs = [("general.architecture", T_STR, ga), ("general.name", T_STR, "reftest"),
           (ga + ".block_count", T_U32, n_layer), (ga + ".context_length", T_U32, 256),
           (ga + ".embedding_length", T_U32, N), (ga + ".feed_forward_length", T_U32, n_ff),
           (ga + ".attention.head_count", T_U32, H), (ga + ".attention.head_count_kv", T_I32, K),
           (ga + ".attention.key_length", T_U32, D), (ga + ".attention.value_length", T_U32, D),
           (ga + ".rope.freq_base", T_F32, 10000.0),
           (ga + ".attention.layer_norm_rms_epsilon", T_F32, 1e-6),
           ("tokenizer.ggml.model", T_STR, "gpt2"),
           ("tokenizer.ggml.tokens", T_ARR, ["t%d" % i for i in range(V)], T_STR),
           ("tokenizer.ggml.scores", T_ARR, np.zeros(V), T_F32)]
    if moe:
        kvs += [(ga + ".expert_count", T_U32, n_expert), (ga + ".expert_used_count", T_U32, n_expert_used)]
        if ga in ("qwen3moe", "qwen2moe"):
            kvs.append((ga + ".expert_feed_forward_length", T_U32, n_ff_exp))
        if ga == "qwen2moe":
            kvs.append((ga + ".expert_shared_feed_forward_length", T_U32, n_ff_shexp))
    ts = []

    def add(name, ne, t=None, s=std, ones=False):
        t = wtype if t is None else t
        if ones:
            data = (1.0 + 0.1 * rng.standard_normal(int(np.prod(ne)))).astype("<f4").tobytes()
        else:
            data = random_tensor_bytes(rng, ne, t, s)
        ts.append((name, ne, t, data))

    add("token_embd.weight", [N, V], s=1.0)
    add("output_norm.weight", [N], F32, ones=True)
    if not tied or ga in ("qwen2moe", "olmoe"):
        add("output.weight", [N, V])
    for i in range(n_layer):
        p = "blk.%d." % i
        add(p + "attn_norm.weight", [N], F32, ones=True)
        add(p + "attn_q.weight", [N, H * D])
        add(p + "attn_k.weight", [N, K * D])
        add(p + "attn_v.weight", [N, K * D])
        add(p + "attn_output.weight", [H * D, N])
        if ga in ("qwen2moe", "qwen2"):
            add(p + "attn_q.bias", [H * D], F32)
            add(p + "attn_k.bias", [K * D], F32)
            add(p + "attn_v.bias", [K * D], F32)
        if ga in ("qwen3moe", "qwen3"):
            add(p + "attn_q_norm.weight", [D], F32, ones=True)
            add(p + "attn_k_norm.weight", [D], F32, ones=True)
        if ga == "olmoe":
            add(p + "attn_q_norm.weight", [H * D], F32, ones=True)
            add(p + "attn_k_norm.weight", [K * D], F32, ones=True)
        add(p + "ffn_norm.weight", [N], F32, ones=True)
        if moe:
            add(p + "ffn_gate_inp.weight", [N, n_expert], F32, s=0.3)
            add(p + "ffn_gate_exps.weight", [N, F, n_expert])
            add(p + "ffn_up_exps.weight", [N, F, n_expert])
            add(p + "ffn_down_exps.weight", [F, N, n_expert])
            if layout == "split-experts":
                merged = {w: ts.pop(-1) for w in ("down", "up", "gate")}
                for e in range(n_expert):
                    for w in ("gate", "down", "up"):
                        _, ne, t, data = merged[w]
                        mat = len(data) // n_expert
                        ts.append((p + "ffn_%s.%d.weight" % (w, e), ne[:2], t,
                                   data[e * mat:(e + 1) * mat]))
            if ga == "qwen2moe":
                add(p + "ffn_gate_inp_shexp.weight", [N, 1] if layout == "converter" else [N], F32)
                add(p + "ffn_gate_shexp.weight", [N, n_ff_shexp])
                add(p + "ffn_up_shexp.weight", [N, n_ff_shexp])
                add(p + "ffn_down_shexp.weight", [n_ff_shexp, N])
        else:
            add(p + "ffn_gate.weight", [N, n_ff])
            add(p + "ffn_up.weight", [N, n_ff])
            add(p + "ffn_down.weight", [n_ff, N])
    write_gguf(path, kvs, ts)
