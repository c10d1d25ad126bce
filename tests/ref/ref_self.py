#!/usr/bin/python3
"""Self-test of the reference: dequantizers on hand-built blocks, the GGUF reader on a file
with every metadata type, and forward-pass invariants (incremental == batched prefill).
Exit 0 when everything holds; prints each failure with both values."""

import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_ref as G  # noqa: E402
from gguf_testgen import make_model, write_gguf  # noqa: E402
import forward_ref  # noqa: E402

FAILS = []


def check(name, got, want, atol=0.0):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        FAILS.append("%s: shape %s != %s" % (name, got.shape, want.shape))
        return
    with np.errstate(invalid="ignore"):
        ok = (got == want) | (np.abs(got - want) <= atol)
    bad = np.nonzero(~ok)[0] if got.ndim == 1 else []
    if got.ndim != 1 and not np.all(ok):
        FAILS.append("%s: max diff %g" % (name, np.max(np.abs(got - want))))
    elif len(bad):
        i = bad[0]
        FAILS.append("%s: element %d got %r want %r (%d bad)" % (name, i, got[i], want[i], len(bad)))


def h16(x):
    return struct.pack("<e", x)


# --- literal blocks: bytes written out, values worked out by hand ----------------------------

def test_literal():
    # F16 / BF16 / F32 bit patterns.
    check("f16", G.dequantize(np.frombuffer(bytes.fromhex("003e00c0007c"), np.uint8), G.F16, 3),
          [1.5, -2.0, np.inf])
    check("bf16", G.dequantize(np.frombuffer(bytes.fromhex("803f00bf4940"), np.uint8), G.BF16, 3),
          [1.0, -0.5, 3.140625])
    check("f32", G.dequantize(np.frombuffer(struct.pack("<2f", 0.25, -7.0), np.uint8), G.F32, 2),
          [0.25, -7.0])
    # Q8_0: d = 0.5, qs = -128, 127, 3, 0... -> -64, 63.5, 1.5, 0...
    b = h16(0.5) + bytes([0x80, 0x7F, 0x03]) + bytes(29)
    want = np.zeros(32)
    want[:3] = [-64, 63.5, 1.5]
    check("q8_0 literal", G.dequantize(np.frombuffer(b, np.uint8), G.Q8_0, 32), want)
    # Q4_0: d = 2; qs[0] = 0xF0 -> x0 = (0-8)*2 = -16, x16 = (15-8)*2 = 14; others 0x88 -> 0.
    b = h16(2.0) + bytes([0xF0]) + bytes([0x88] * 15)
    want = np.zeros(32)
    want[0], want[16] = -16, 14
    check("q4_0 literal", G.dequantize(np.frombuffer(b, np.uint8), G.Q4_0, 32), want)
    # Q4_K: d = 1, dmin = 0.5. scales[0] = 5 | 1<<6 (sc0 = 5, top bits of sc4 = 1),
    # scales[1] = 3 (sc1), scales[8] = 0x47 (sc4 low = 7, m4 low = 4) -> sc4 = 23, m4 = 4.
    # qs[0] = 0x21: element 0 = 5*1 - 0 = 5, element 32 = 3*2 = 6.
    # qs[64] = 0x03: element 128 (sub-block 4) = 23*3 - 0.5*4 = 67;
    # element 160 (sub-block 5, sc5 = m5 = 0) = 0. Elements of sub-block 4 with q = 0 give -2.
    sc = bytearray(12)
    sc[0], sc[1], sc[8] = 5 | (1 << 6), 3, 0x47
    qs = bytearray(128)
    qs[0], qs[64] = 0x21, 0x03
    b = h16(1.0) + h16(0.5) + bytes(sc) + bytes(qs)
    y = G.dequantize(np.frombuffer(b, np.uint8), G.Q4_K, 256)
    check("q4_k literal", y[[0, 32, 128, 129, 160, 1]], [5, 6, 67, -2, 0, 0])
    # Q5_K: same scales; qh[0] = 0b00010001 sets the high bit of element 0 (sub-block 0) and of
    # element 128 (sub-block 4): element 0 = 5*(1+16) = 85, element 128 = 23*(3+16) - 2 = 435.
    qh = bytearray(32)
    qh[0] = 0x11
    b = h16(1.0) + h16(0.5) + bytes(sc) + bytes(qh) + bytes(qs)
    y = G.dequantize(np.frombuffer(b, np.uint8), G.Q5_K, 256)
    check("q5_k literal", y[[0, 32, 128, 160, 1]], [85, 6, 435, 0, 0])
    # Q6_K: d = 0.25; scales[0] = -4, scales[2] = 8, scales[8] = 2, others 1.
    # ql[0] = 0x21, qh[0] = 0b00000011 (element 0 high bits 3), ql[32] low 5:
    #   element 0: q = (1 | 3<<4) - 32 = 17 -> 0.25*-4*17 = -17
    #   element 32 (k=1, low = ql[32]&15 = 5, high = (qh[0]>>2)&3 = 0): q = 5-32 = -27,
    #     scale index 2 (= 32//16) -> 0.25*8*-27 = -54
    #   element 64 (k=2, low = ql[0]>>4 = 2, high 0): q = -30, scale 4 = 1 -> -7.5
    #   element 128 (second half, ql[64] = 0, qh[32] = 0): q = -32, scale 8 = 2 -> -16
    #   element 1: ql[1] = 0, qh[1] = 0 -> q = -32, scale 0 -> 0.25*-4*-32 = 32
    ql = bytearray(128)
    ql[0], ql[32] = 0x21, 0x05
    qh6 = bytearray(64)
    qh6[0] = 0x03
    scales = np.ones(16, dtype=np.int8)
    scales[0], scales[2], scales[8] = -4, 8, 2
    b = bytes(ql) + bytes(qh6) + scales.tobytes() + h16(0.25)
    y = G.dequantize(np.frombuffer(b, np.uint8), G.Q6_K, 256)
    check("q6_k literal", y[[0, 32, 64, 128, 1]], [-17, -54, -7.5, -16, 32])


def deq(b, t, n):
    return G.dequantize(np.frombuffer(bytes(b), np.uint8), t, n)


def test_literal_more():
    """The types added after the first set: Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4."""
    # Q4_1: d = 0.5, m = -1; qs[0] = 0x3A: element 0 = 10*0.5 - 1 = 4, element 16 = 3*0.5 - 1.
    b = h16(0.5) + h16(-1.0) + bytes([0x3A]) + bytes(15)
    check("q4_1 literal", deq(b, G.Q4_1, 32)[[0, 16, 1, 31]], [4, 0.5, -1, -1])
    # Q5_0: d = 0.25, qh = bits 0 and 17; qs[0] = 0x21: element 0 = (1|16) - 16 = 1 -> 0.25,
    # element 16 = 2 - 16 -> -3.5, element 1 = -16 -> -4, element 17 = (0|16) - 16 = 0.
    b = h16(0.25) + struct.pack("<I", (1 << 0) | (1 << 17)) + bytes([0x21]) + bytes(15)
    check("q5_0 literal", deq(b, G.Q5_0, 32)[[0, 16, 1, 17]], [0.25, -3.5, -4, 0])
    # Q5_1: d = 2, m = 0.5, qh = bit 31, qs[15] = 0xF0: element 15 = 0 -> 0.5,
    # element 31 = 15|16 = 31 -> 62.5.
    b = h16(2.0) + h16(0.5) + struct.pack("<I", 1 << 31) + bytes(15) + bytes([0xF0])
    check("q5_1 literal", deq(b, G.Q5_1, 32)[[15, 31, 0]], [0.5, 62.5, 0.5])
    # Q2_K: d = 0.5, dmin = 0.25. qs[0] = 0xE4 holds 0, 1, 2, 3 for elements 0, 32, 64, 96
    # (scales 0, 2, 4, 6); qs[32] = 3 is element 128 (scale 8).
    #   element 0:   sc 1, m 2  (0x21): 0.5*1*0 - 0.25*2 = -0.5
    #   element 32:  sc 15, m 0 (0x0F): 0.5*15*1 = 7.5
    #   element 64:  sc 3, m 1  (0x13): 0.5*3*2 - 0.25 = 2.75
    #   element 96:  sc 2, m 15 (0xF2): 0.5*2*3 - 3.75 = -0.75
    #   element 128: sc 1, m 0  (0x01): 0.5*1*3 = 1.5
    sc = bytearray(16)
    sc[0], sc[2], sc[4], sc[6], sc[8] = 0x21, 0x0F, 0x13, 0xF2, 0x01
    qs = bytearray(64)
    qs[0], qs[32] = 0xE4, 0x03
    b = bytes(sc) + bytes(qs) + h16(0.5) + h16(0.25)
    check("q2_k literal", deq(b, G.Q2_K, 256)[[0, 32, 64, 96, 128, 16]],
          [-0.5, 7.5, 2.75, -0.75, 1.5, 0])
    # Q3_K: d = 0.5. Scales (6-bit, minus 32): scale 0 = 33 (low 1 in byte 0, high 2 in bits
    # 0-1 of byte 8), scale 2 = 0, scale 4 = 63 (low 15 in byte 4, high 3 in bits 2-3 of byte 8),
    # scale 6 = 32 (high 2 in bits 2-3 of byte 10), scale 8 = 40 (low 8 in the high nibble of
    # byte 0, high 2 in bits 4-5 of byte 8); the rest 0 (-32).
    # hmask: all set but bit 0 of bytes 0 and 1 (elements 0 and 1 get -4).
    #   element 0:   low 0, -4 -> 0.5*1*-4 = -2;  element 1: same = -2
    #   element 32:  low 1 -> 0.5*-32*1 = -16;    element 64: low 2 -> 0.5*31*2 = 31
    #   element 96:  low 3, scale 0 -> 0;        element 128: low 2 (qs[32]) -> 0.5*8*2 = 8
    hm = bytearray([0xFF] * 32)
    hm[0], hm[1] = 0xFE, 0xFE
    qs = bytearray(64)
    qs[0], qs[32] = 0xE4, 0x02
    s3 = bytearray(12)
    s3[0], s3[4], s3[8], s3[10] = 0x81, 0x0F, 0x2E, 0x08
    b = bytes(hm) + bytes(qs) + bytes(s3) + h16(0.5)
    check("q3_k literal", deq(b, G.Q3_K, 256)[[0, 1, 32, 64, 96, 128]], [-2, -2, -16, 31, 0, 8])
    # IQ4_NL: d = 0.5; qs[0] = 0xF0: element 0 = -127/2, element 16 = 113/2;
    # qs[1] = 0x78: element 1 = 1/2, element 17 = -10/2.
    b = h16(0.5) + bytes([0xF0, 0x78]) + bytes(14)
    check("iq4_nl literal", deq(b, G.IQ4_NL, 32)[[0, 16, 1, 17]], [-63.5, 56.5, 0.5, -5])
    # IQ4_XS: d = 0.25. Sub-block scales ls (6 bits, minus 32): sub-block 0 = 33 (low 1 in
    # scales_l[0], high 2 in bits 0-1 of scales_h), sub-block 3 = 63 (low 15 in the high nibble
    # of scales_l[1], high 3 in bits 6-7), the rest 0 (-32 -> -8).
    #   element 0 (qs[0] low 0) = 0.25*-127 = -31.75, element 16 (qs[0] high 15) = 0.25*113
    #   element 96 (qs[48] low 8) = 7.75*1, element 112 (qs[48] high 0) = 7.75*-127
    #   element 224 (qs[112] low 8) = -8*1
    qs = bytearray(128)
    qs[0], qs[48], qs[112] = 0xF0, 0x08, 0x88
    b = h16(0.25) + struct.pack("<H", 2 | (3 << 6)) + bytes([0x01, 0xF0, 0, 0]) + bytes(qs)
    check("iq4_xs literal", deq(b, G.IQ4_XS, 256)[[0, 16, 96, 112, 224]],
          [-31.75, 28.25, 7.75, -984.25, -8])
    # MXFP4: E8M0 scale e gives 2^(e-128) times the doubled E2M1 level.
    # Block 0: e = 128 (1); qs[0] = 0x97: element 0 = level 7 = 12, element 16 = level 9 = -1.
    # Block 1: e = 0 (2^-128, subnormal); qs[0] = 0x01: element 32 = 2^-128.
    # Block 2: e = 130 (4); qs[15] = 0xE6: element 79 = 4*8 = 32, element 95 = 4*-8 = -32.
    b = bytes([128, 0x97]) + bytes(15) + bytes([0, 0x01]) + bytes(15)
    b += bytes([130]) + bytes(15) + bytes([0xE6])
    check("mxfp4 literal", deq(b, G.MXFP4, 96)[[0, 16, 32, 79, 95, 1]],
          [12, -1, 2.0 ** -128, 32, -32, 0])


# --- full blocks built element by element from the layout description ------------------------

def pack_k_scales(sc, mn):
    """12-byte 6-bit scales/mins of Q4_K/Q5_K from 8 scales and 8 mins (each < 64)."""
    b = bytearray(12)
    for j in range(4):
        b[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        b[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        b[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    return bytes(b)


def test_full_blocks():
    sc = [1, 2, 3, 63, 17, 33, 50, 63]
    mn = [0, 1, 2, 3, 20, 40, 5, 63]
    d, dmin = 0.125, 0.0625
    i = np.arange(256)
    # Q4_K: element i is in sub-block i//32; group g = i//64 stores sub-block 2g in the low
    # nibbles of qs[32g..32g+31] and sub-block 2g+1 in their high nibbles.
    q = (i * 7) % 16
    qs = bytearray(128)
    for e in range(256):
        g, r = divmod(e, 64)
        if r < 32:
            qs[32 * g + r] |= q[e]
        else:
            qs[32 * g + r - 32] |= q[e] << 4
    b = h16(d) + h16(dmin) + pack_k_scales(sc, mn) + bytes(qs)
    want = [np.float32(d * sc[e // 32]) * q[e] - np.float32(dmin * mn[e // 32]) for e in range(256)]
    # Two blocks: the second identical block checks the block stride.
    check("q4_k full", G.dequantize(np.frombuffer(b + b, np.uint8), G.Q4_K, 512), want + want)
    # Q5_K: 5-bit q; the high bit of element e is bit (e//32) of qh[e%32].
    q5 = (i * 11) % 32
    qs = bytearray(128)
    qh = bytearray(32)
    for e in range(256):
        g, r = divmod(e, 64)
        lo = q5[e] & 15
        if r < 32:
            qs[32 * g + r] |= lo
        else:
            qs[32 * g + r - 32] |= lo << 4
        if q5[e] >> 4:
            qh[e % 32] |= 1 << (e // 32)
    b = h16(d) + h16(dmin) + pack_k_scales(sc, mn) + bytes(qh) + bytes(qs)
    want = [np.float32(d * sc[e // 32]) * q5[e] - np.float32(dmin * mn[e // 32]) for e in range(256)]
    check("q5_k full", G.dequantize(np.frombuffer(b, np.uint8), G.Q5_K, 256), want)
    # Q6_K: element e: half h = e//128, r = e%128, k = r//32, l = r%32; low nibble in
    # ql[64h + l] (k=0 low, k=2 high) or ql[64h + 32 + l] (k=1 low, k=3 high); the top two
    # bits are bits 2k..2k+1 of qh[32h + l]; value = d * scales[e//16] * (q - 32).
    q6 = (i * 13) % 64
    ql = bytearray(128)
    qh = bytearray(64)
    for e in range(256):
        h, r = divmod(e, 128)
        k, l = divmod(r, 32)
        lo, hi = q6[e] & 15, q6[e] >> 4
        idx = 64 * h + l + (32 if k in (1, 3) else 0)
        ql[idx] |= lo if k < 2 else lo << 4
        qh[32 * h + l] |= hi << (2 * k)
    scales = (np.arange(16) * 9 - 70).astype(np.int8)
    d6 = 0.03125
    b = bytes(ql) + bytes(qh) + scales.tobytes() + h16(d6)
    want = [np.float32(d6 * float(scales[e // 16])) * (int(q6[e]) - 32) for e in range(256)]
    check("q6_k full", G.dequantize(np.frombuffer(b, np.uint8), G.Q6_K, 256), want)
    # Q4_0 / Q8_0 over two blocks with different scales.
    q4 = (np.arange(64) * 5) % 16
    blocks = b""
    for blk, dd in enumerate((0.5, -3.0)):
        qs = bytes(int(q4[32 * blk + j]) | (int(q4[32 * blk + 16 + j]) << 4) for j in range(16))
        blocks += h16(dd) + qs
    want = [(int(q4[e]) - 8) * (0.5 if e < 32 else -3.0) for e in range(64)]
    check("q4_0 full", G.dequantize(np.frombuffer(blocks, np.uint8), G.Q4_0, 64), want)
    q8 = (np.arange(64) * 37 % 256 - 128).astype(np.int8)
    blocks = h16(0.25) + q8[:32].tobytes() + h16(-1.5) + q8[32:].tobytes()
    want = [int(q8[e]) * (0.25 if e < 32 else -1.5) for e in range(64)]
    check("q8_0 full", G.dequantize(np.frombuffer(blocks, np.uint8), G.Q8_0, 64), want)


def test_reader(tmp):
    kvs = [("general.architecture", G.T_STR, "qwen3"), ("general.alignment", G.T_U32, 64),
           ("a.u8", G.T_U8, 200), ("a.i8", G.T_I8, -100), ("a.u16", G.T_U16, 60000),
           ("a.i16", G.T_I16, -30000), ("a.u32", G.T_U32, 4000000000),
           ("a.i32", G.T_I32, -2000000000), ("a.f32", G.T_F32, 1.5), ("a.bool", G.T_BOOL, True),
           ("a.str", G.T_STR, "h\u00e9llo"), ("a.u64", G.T_U64, 2 ** 63 + 5),
           ("a.i64", G.T_I64, -2 ** 62), ("a.f64", G.T_F64, 0.1),
           ("a.arr_i32", G.T_ARR, [1, -2, 3], G.T_I32),
           ("a.arr_str", G.T_ARR, ["x", "", "yz"], G.T_STR),
           ("a.arr_bool", G.T_ARR, [True, False], G.T_BOOL)]
    w = np.arange(64, dtype=np.float32).reshape(2, 32)
    tensors = [("t0", [32, 2], G.F32, w.tobytes()),
               ("t1", [5], G.F32, np.arange(5, dtype=np.float32).tobytes())]
    for ver in (2, 3):
        p = os.path.join(tmp, "kv%d.gguf" % ver)
        write_gguf(p, kvs, tensors, version=ver, alignment=64)
        g = G.GGUFFile(p)
        for kv in kvs:
            got = g.kv[kv[0]]
            want = kv[2]
            same = list(got) == list(want) if isinstance(want, list) else got == want
            if not same:
                FAILS.append("reader v%d key %s: %r != %r" % (ver, kv[0], got, want))
        if g.alignment != 64 or g.data_offset % 64:
            FAILS.append("reader alignment %d offset %d" % (g.alignment, g.data_offset))
        check("reader t0", g.dequant("t0"), w)
        check("reader t1", g.dequant("t1"), np.arange(5))
    # Truncated file and bad magic are rejected.
    p = os.path.join(tmp, "kv3.gguf")
    data = open(p, "rb").read()
    for bad, why in ((data[:-50], "truncated"), (b"GGUX" + data[4:], "magic")):
        q = os.path.join(tmp, "bad.gguf")
        open(q, "wb").write(bad)
        try:
            G.GGUFFile(q)
            FAILS.append("reader accepted a %s file" % why)
        except G.GGUFError:
            pass


def test_forward(tmp):
    """Prefill in one call == token-by-token; the forward pass is causal."""
    for arch, t in (("qwen3moe", G.Q4_K), ("qwen2moe", G.Q8_0), ("mixtral", G.F16),
                    ("olmoe", G.Q6_K), ("llama", G.F32), ("qwen2", G.BF16), ("qwen3", G.Q5_K)):
        p = os.path.join(tmp, "m_%s.gguf" % arch)
        make_model(p, arch, t, n_vocab=300, tied=(arch == "llama"))
        m = forward_ref.Model(p)
        toks = [5, 17, 2, 299, 0, 42, 42, 7]
        full = m.forward(m.new_cache(), toks)
        c = m.new_cache()
        inc = np.concatenate([m.forward(c, [x]) for x in toks])
        check("forward %s incremental" % arch, inc, full, atol=1e-9 * np.abs(full).max())
        c = m.new_cache()
        split = np.concatenate([m.forward(c, toks[:3]), m.forward(c, toks[3:])])
        check("forward %s split" % arch, split, full, atol=1e-9 * np.abs(full).max())
        # Changing a later token must not change earlier logits.
        alt = m.forward(m.new_cache(), toks[:4] + [1, 2, 3, 4])
        check("forward %s causal" % arch, alt[:4], full[:4], atol=1e-12 * np.abs(full).max())
        if np.allclose(alt[4:], full[4:]):
            FAILS.append("forward %s: later tokens do not matter" % arch)


def test_layouts(tmp):
    """The same weights in the layouts of llama.cpp's writers give the same logits: Qwen2-MoE's
    2-D [n_embd, 1] shared-expert gate, and old Mixtral per-expert tensors."""
    toks = [5, 17, 2, 299, 0, 42]
    for arch, t, layout in (("qwen2moe", G.F32, "converter"), ("mixtral", G.Q8_0, "split-experts")):
        base = os.path.join(tmp, "l_%s_merged.gguf" % arch)
        alt = os.path.join(tmp, "l_%s_%s.gguf" % (arch, layout))
        make_model(base, arch, t, n_vocab=300, n_layer=1)
        make_model(alt, arch, t, n_vocab=300, n_layer=1, layout=layout)
        names = set(G.GGUFFile(alt).tensors)
        if layout == "split-experts" and ("blk.0.ffn_up.3.weight" not in names
                                          or "blk.0.ffn_up_exps.weight" in names):
            FAILS.append("layout %s: tensors %s" % (layout, sorted(names)[:8]))
        if layout == "converter" and G.GGUFFile(alt).tensors["blk.0.ffn_gate_inp_shexp.weight"].ne != [256, 1]:
            FAILS.append("layout converter: shared-expert gate not [256, 1]")
        want = forward_ref.Model(base).forward(forward_ref.Model(base).new_cache(), toks)
        m = forward_ref.Model(alt)
        check("layout %s %s" % (arch, layout), m.forward(m.new_cache(), toks), want)


def main():
    test_literal()
    test_literal_more()
    test_full_blocks()
    with tempfile.TemporaryDirectory() as tmp:
        test_reader(tmp)
        test_forward(tmp)
        test_layouts(tmp)
    for f in FAILS:
        print("FAIL", f)
    print("ref-self: %s (%d failures)" % ("PASS" if not FAILS else "FAIL", len(FAILS)))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
