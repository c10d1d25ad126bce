"""Independent GGUF reader and GGML weight dequantizers (numpy) for the reference checks.

Written from the format descriptions only (GGUF spec; GGML block layouts); it shares no code
with the C engine, so that agreement between the two means something.

Usage as a library:
    g = GGUFFile(path)
    g.arch, g.kv['llama.block_count'], g.tensors['token_embd.weight'].ne
    w = g.dequant('blk.0.attn_q.weight')   # float32 array of shape ne[::-1]
"""

import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types.
T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 = range(13)

_SCALAR_FMT = {
    T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i",
    T_F32: "<f", T_BOOL: "<?", T_U64: "<Q", T_I64: "<q", T_F64: "<d",
}
_SCALAR_NP = {
    T_U8: "<u1", T_I8: "<i1", T_U16: "<u2", T_I16: "<i2", T_U32: "<u4", T_I32: "<i4",
    T_F32: "<f4", T_BOOL: "<u1", T_U64: "<u8", T_I64: "<i8", T_F64: "<f8",
}

# GGML tensor types: id -> (name, elements per block, bytes per block).
F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30
Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 = 3, 6, 7, 10, 11, 20, 23, 39
QK_K = 256
GGML_TYPES = {
    F32: ("f32", 1, 4),
    F16: ("f16", 1, 2),
    Q4_0: ("q4_0", 32, 2 + 16),
    Q4_1: ("q4_1", 32, 2 + 2 + 16),
    Q5_0: ("q5_0", 32, 2 + 4 + 16),
    Q5_1: ("q5_1", 32, 2 + 2 + 4 + 16),
    Q2_K: ("q2_k", QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    Q3_K: ("q3_k", QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    IQ4_NL: ("iq4_nl", 32, 2 + 16),
    IQ4_XS: ("iq4_xs", QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    MXFP4: ("mxfp4", 32, 1 + 16),
    Q8_0: ("q8_0", 32, 2 + 32),
    Q4_K: ("q4_k", QK_K, 2 + 2 + 12 + QK_K // 2),
    Q5_K: ("q5_k", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    Q6_K: ("q6_k", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    BF16: ("bf16", 1, 2),
}
TYPE_BY_NAME = {v[0]: k for k, v in GGML_TYPES.items()}


class GGUFError(Exception):
    pass


class _Cursor:
    """Bounds-checked little-endian reader over a bytes-like buffer."""

    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, n):
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError("truncated file at offset %d (need %d bytes)" % (self.pos, n))
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, t):
        fmt = _SCALAR_FMT[t]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self):
        return self.scalar(T_U32)

    def u64(self):
        return self.scalar(T_U64)

    def string(self):
        n = self.u64()
        return bytes(self.take(n)).decode("utf-8", errors="surrogateescape")

    def value(self, t):
        if t in _SCALAR_FMT:
            v = self.scalar(t)
            return bool(v) if t == T_BOOL else v
        if t == T_STR:
            return self.string()
        if t == T_ARR:
            et = self.u32()
            n = self.u64()
            if et in _SCALAR_NP:
                size = np.dtype(_SCALAR_NP[et]).itemsize
                if n * size > len(self.buf) - self.pos:
                    raise GGUFError("array of %d elements runs past the end" % n)
                arr = np.frombuffer(bytes(self.take(n * size)), dtype=_SCALAR_NP[et]).copy()
                return arr.astype(bool) if et == T_BOOL else arr
            if et in (T_STR, T_ARR):
                if n > len(self.buf) - self.pos:  # every element takes at least one byte
                    raise GGUFError("array of %d elements runs past the end" % n)
                return [self.value(et) for _ in range(n)]
            raise GGUFError("unknown array element type %d" % et)
        raise GGUFError("unknown metadata value type %d" % t)


class TensorInfo:
    def __init__(self, name, ne, ggml_type, offset):
        self.name = name
        self.ne = list(ne)            # GGUF order: ne[0] innermost
        self.type = ggml_type
        self.offset = offset          # relative to the data section
        self.n_elem = int(np.prod(ne, dtype=np.int64)) if ne else 1
        _, blk, bsz = GGML_TYPES[ggml_type]
        if self.ne[0] % blk != 0:
            raise GGUFError("tensor '%s': ne[0]=%d not a multiple of block %d"
                            % (name, self.ne[0], blk))
        self.nbytes = self.n_elem // blk * bsz

    def __repr__(self):
        return "TensorInfo(%s, ne=%s, type=%s)" % (self.name, self.ne, GGML_TYPES[self.type][0])


class GGUFFile:
    """A GGUF v2/v3 file: .version, .kv (dict), .tensors (dict name -> TensorInfo), .data."""

    def __init__(self, path):
        self.path = path
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self.mm))
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError("not a GGUF file")
        self.version = cur.u32()
        if self.version not in (2, 3):
            raise GGUFError("unsupported GGUF version %d" % self.version)
        n_tensors = cur.u64()
        n_kv = cur.u64()
        self.kv = {}
        self.kv_types = {}
        for _ in range(n_kv):
            key = cur.string()
            t = cur.u32()
            self.kv[key] = cur.value(t)
            self.kv_types[key] = t
        self.tensors = {}
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            nd = cur.u32()
            if nd > 4:
                raise GGUFError("tensor '%s' has %d dims" % (name, nd))
            ne = [cur.u64() for _ in range(nd)]
            t = cur.u32()
            off = cur.u64()
            if t not in GGML_TYPES:
                raise GGUFError("tensor '%s' has unsupported type %d" % (name, t))
            ti = TensorInfo(name, ne, t, off)
            if name in self.tensors:
                raise GGUFError("duplicate tensor '%s'" % name)
            self.tensors[name] = ti
            infos.append(ti)
        align = int(self.kv.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise GGUFError("bad alignment %d" % align)
        self.alignment = align
        self.data_offset = (cur.pos + align - 1) // align * align
        size = len(self.mm)
        for ti in infos:
            if ti.offset % align:
                raise GGUFError("tensor '%s' offset not aligned" % ti.name)
            if self.data_offset + ti.offset + ti.nbytes > size:
                raise GGUFError("tensor '%s' data runs past the end of the file" % ti.name)

    @property
    def arch(self):
        return self.kv["general.architecture"]

    def raw(self, name):
        """The tensor's bytes as a uint8 view into the memory map."""
        ti = self.tensors[name]
        a = self.data_offset + ti.offset
        return self.mm[a:a + ti.nbytes]

    def dequant(self, name):
        """The tensor as float32 with numpy shape ne[::-1] (rows of ne[0] elements)."""
        ti = self.tensors[name]
        flat = dequantize(self.raw(name), ti.type, ti.n_elem)
        return flat.reshape(ti.ne[::-1])


# ---------------------------------------------------------------------------------------------
# Dequantizers. Each takes the raw bytes (uint8 array) of n elements and returns float32 (n,).
# The arithmetic is done in float32 in the same order the GGML format description implies
# (e.g. Q4_K: (d*sc)*q - (dmin*m)), so the values are the exact floats any faithful
# implementation produces.

def _f16(u8, off, nblk, bsz):
    """Little-endian fp16 field at byte offset off of each block, as float32 (nblk,)."""
    blocks = u8.reshape(nblk, bsz)
    return blocks[:, off:off + 2].copy().view("<f2").reshape(nblk).astype(np.float32)


def deq_f32(u8, n):
    return np.frombuffer(u8, dtype="<f4", count=n).astype(np.float32)


def deq_f16(u8, n):
    return np.frombuffer(u8, dtype="<f2", count=n).astype(np.float32)


def deq_bf16(u8, n):
    # bf16 is the top half of an IEEE float32.
    h = np.frombuffer(u8, dtype="<u2", count=n).astype(np.uint32)
    return (h << 16).view(np.float32)


def deq_q8_0(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 34)
    d = _f16(u8, 0, nb, 34)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (q * d[:, None]).reshape(n)


def deq_q4_0(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 18)
    d = _f16(u8, 0, nb, 18)
    qs = blocks[:, 2:]
    lo = (qs & 0x0F).astype(np.int16) - 8   # elements 0..15
    hi = (qs >> 4).astype(np.int16) - 8     # elements 16..31
    q = np.concatenate([lo, hi], axis=1).astype(np.float32)
    return (q * d[:, None]).reshape(n)


def _k_scales_mins(sc12):
    """Unpack the 12-byte 6-bit scale/min field of Q4_K/Q5_K: (nb, 8) scales and (nb, 8) mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3 (low 6 bits); sub-blocks 4-7
    take their low 4 bits from the nibbles of bytes 8-11 (scale low, min high) and their top
    2 bits from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = sc12.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, 0:4] = s[:, 0:4] & 63
    mn[:, 0:4] = s[:, 4:8] & 63
    sc[:, 4:8] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:8] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def deq_q4_k(u8, n):
    bsz = GGML_TYPES[Q4_K][2]
    nb = n // QK_K
    blocks = np.asarray(u8).reshape(nb, bsz)
    d = _f16(u8, 0, nb, bsz)
    dmin = _f16(u8, 2, nb, bsz)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    qs = blocks[:, 16:16 + 128].reshape(nb, 4, 32)  # 4 groups of 32 bytes, 64 values each
    # Group g gives sub-block 2g (low nibbles) and 2g+1 (high nibbles).
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32).astype(np.float32)
    dl = (d[:, None] * sc.astype(np.float32)).astype(np.float32)      # (nb, 8)
    ml = (dmin[:, None] * mn.astype(np.float32)).astype(np.float32)
    y = q * dl[:, :, None] - ml[:, :, None]
    return y.astype(np.float32).reshape(n)


def deq_q5_k(u8, n):
    bsz = GGML_TYPES[Q5_K][2]
    nb = n // QK_K
    blocks = np.asarray(u8).reshape(nb, bsz)
    d = _f16(u8, 0, nb, bsz)
    dmin = _f16(u8, 2, nb, bsz)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48]                              # (nb, 32): bit k = high bit of sub-block k
    qs = blocks[:, 48:48 + 128].reshape(nb, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)
    bits = np.arange(8, dtype=np.uint8)
    high = (qh[:, None, :] >> bits[None, :, None]) & 1    # (nb, 8, 32)
    q = (low + (high << 4)).astype(np.float32)
    dl = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
    ml = (dmin[:, None] * mn.astype(np.float32)).astype(np.float32)
    y = q * dl[:, :, None] - ml[:, :, None]
    return y.astype(np.float32).reshape(n)


def deq_q6_k(u8, n):
    bsz = GGML_TYPES[Q6_K][2]
    nb = n // QK_K
    blocks = np.asarray(u8).reshape(nb, bsz)
    ql = blocks[:, 0:128].reshape(nb, 2, 64)       # per 128-value half: 64 bytes of low nibbles
    qh = blocks[:, 128:192].reshape(nb, 2, 32)     # per half: 32 bytes, 2 bits for 4 values each
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)   # (nb, 16), one per 16 values
    d = _f16(u8, 208, nb, bsz)
    # Within a half, value index v = 32*k + l (k in 0..3, l in 0..31):
    #   low 4 bits: k=0 ql[l]&15, k=1 ql[l+32]&15, k=2 ql[l]>>4, k=3 ql[l+32]>>4
    #   high 2 bits: (qh[l] >> 2k) & 3
    lo = np.stack([ql[:, :, 0:32] & 0x0F, ql[:, :, 32:64] & 0x0F,
                   ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4], axis=2)       # (nb, 2, 4, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    hi = (qh[:, :, None, :] >> shifts) & 3
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.float32).reshape(nb, 16, 16)
    ds = (d[:, None] * scales).astype(np.float32)     # (nb, 16)
    y = ds[:, :, None] * q
    return y.astype(np.float32).reshape(n)


def _nibbles32(qs):
    """(nb, 16) bytes of a 32-element block -> (nb, 32) values: low nibbles are elements
    0..15, high nibbles elements 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _u32(blocks, off):
    return blocks[:, off:off + 4].copy().view("<u4").reshape(-1)


def _fifth_bits(qh32):
    """(nb,) uint32 -> (nb, 32): bit e of the word is the fifth bit of element e."""
    return ((qh32[:, None] >> np.arange(32, dtype=np.uint32)[None, :]) & 1).astype(np.uint8)


def deq_q4_1(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 20)
    d, m = _f16(u8, 0, nb, 20), _f16(u8, 2, nb, 20)
    q = _nibbles32(blocks[:, 4:20]).astype(np.float32)
    # element = q*d + m, each step rounded to float32
    return ((q * d[:, None]).astype(np.float32) + m[:, None]).astype(np.float32).reshape(n)


def deq_q5_0(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 22)
    d = _f16(u8, 0, nb, 22)
    q = _nibbles32(blocks[:, 6:22]) | (_fifth_bits(_u32(blocks, 2)) << 4)
    return ((q.astype(np.int16) - 16).astype(np.float32) * d[:, None]).astype(np.float32).reshape(n)


def deq_q5_1(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 24)
    d, m = _f16(u8, 0, nb, 24), _f16(u8, 2, nb, 24)
    q = (_nibbles32(blocks[:, 8:24]) | (_fifth_bits(_u32(blocks, 4)) << 4)).astype(np.float32)
    return ((q * d[:, None]).astype(np.float32) + m[:, None]).astype(np.float32).reshape(n)


def _two_bit_planes(qs):
    """(nb, 64) bytes -> (nb, 256) 2-bit values of the Q2_K/Q3_K layout: each half of 128
    elements uses 32 bytes; element 32*j + l of a half is bits 2j..2j+1 of byte l."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 2, 1, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return ((q >> shifts) & 3).reshape(nb, 256)


def deq_q2_k(u8, n):
    nb = n // QK_K
    blocks = np.asarray(u8).reshape(nb, 84)
    sc = blocks[:, 0:16]                          # per 16 elements: low nibble scale, high min
    q = _two_bit_planes(blocks[:, 16:80]).astype(np.float32).reshape(nb, 16, 16)
    d, dmin = _f16(u8, 80, nb, 84), _f16(u8, 82, nb, 84)
    dl = (d[:, None] * (sc & 15).astype(np.float32)).astype(np.float32)
    ml = (dmin[:, None] * (sc >> 4).astype(np.float32)).astype(np.float32)
    y = (dl[:, :, None] * q).astype(np.float32) - ml[:, :, None]
    return y.astype(np.float32).reshape(n)


def _q3_k_scales(s):
    """(nb, 12) bytes -> (nb, 16) signed scales: scale i has its low 4 bits in byte i (low
    nibble, i < 8) or byte i-8 (high nibble), its top 2 bits at bits 2*(i//4) of byte
    8 + i%4; the stored 6-bit value is offset by 32."""
    i = np.arange(16)
    low = np.where(i < 8, s[:, i % 8] & 15, s[:, i % 8] >> 4)
    high = (s[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.int16) - 32


def deq_q3_k(u8, n):
    nb = n // QK_K
    blocks = np.asarray(u8).reshape(nb, 110)
    hmask = blocks[:, 0:32]
    low = _two_bit_planes(blocks[:, 32:96]).astype(np.int16)
    e = np.arange(256)
    hbit = (hmask[:, e % 32] >> (e // 32).astype(np.uint8)) & 1   # 1: no offset, 0: minus 4
    q = (low - 4 * (1 - hbit.astype(np.int16))).astype(np.float32).reshape(nb, 16, 16)
    d = _f16(u8, 108, nb, 110)
    dl = (d[:, None] * _q3_k_scales(blocks[:, 96:108]).astype(np.float32)).astype(np.float32)
    return (dl[:, :, None] * q).astype(np.float32).reshape(n)


# The 16 non-linear levels of IQ4_NL / IQ4_XS, and MXFP4's E2M1 values times two.
IQ4NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                         113], dtype=np.float32)
MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                        dtype=np.float32)


def deq_iq4_nl(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 18)
    d = _f16(u8, 0, nb, 18)
    return (IQ4NL_LEVELS[_nibbles32(blocks[:, 2:18])] * d[:, None]).astype(np.float32).reshape(n)


def deq_iq4_xs(u8, n):
    nb = n // QK_K
    blocks = np.asarray(u8).reshape(nb, 136)
    d = _f16(u8, 0, nb, 136)
    sh = blocks[:, 2:4].copy().view("<u2").reshape(nb).astype(np.int32)
    sl = blocks[:, 4:8].astype(np.int32)
    ib = np.arange(8)
    ls = ((sl[:, ib // 2] >> (4 * (ib % 2))) & 15) | (((sh[:, None] >> (2 * ib)) & 3) << 4)
    dl = (d[:, None] * (ls - 32).astype(np.float32)).astype(np.float32)          # (nb, 8)
    qs = blocks[:, 8:136].reshape(nb * 8, 16)
    v = IQ4NL_LEVELS[_nibbles32(qs)].reshape(nb, 8, 32)
    return (dl[:, :, None] * v).astype(np.float32).reshape(n)


def e8m0_half(e):
    """E8M0 exponent byte -> 2^(e - 128) as float32 (half the E8M0 scale, since the levels
    are doubled): exact, also for the two subnormal results e = 0, 1."""
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


def deq_mxfp4(u8, n):
    nb = n // 32
    blocks = np.asarray(u8).reshape(nb, 17)
    d = e8m0_half(blocks[:, 0])
    return (MXFP4_LEVELS[_nibbles32(blocks[:, 1:17])] * d[:, None]).astype(np.float32).reshape(n)


_DEQ = {F32: deq_f32, F16: deq_f16, BF16: deq_bf16, Q8_0: deq_q8_0, Q4_0: deq_q4_0,
        Q4_K: deq_q4_k, Q5_K: deq_q5_k, Q6_K: deq_q6_k, Q4_1: deq_q4_1, Q5_0: deq_q5_0,
        Q5_1: deq_q5_1, Q2_K: deq_q2_k, Q3_K: deq_q3_k, IQ4_NL: deq_iq4_nl,
        IQ4_XS: deq_iq4_xs, MXFP4: deq_mxfp4}


def dequantize(u8, ggml_type, n):
    u8 = np.asarray(u8, dtype=np.uint8)
    _, blk, bsz = GGML_TYPES[ggml_type]
    if n % blk or len(u8) != n // blk * bsz:
        raise GGUFError("bad size for %s: %d bytes for %d elements"
                        % (GGML_TYPES[ggml_type][0], len(u8), n))
    return _DEQ[ggml_type](u8, n)


def main(argv):
    """Dump a GGUF file's metadata and tensor table (a debugging aid)."""
    g = GGUFFile(argv[1])
    print("version", g.version, "alignment", g.alignment, "data offset", g.data_offset)
    for k, v in g.kv.items():
        if isinstance(v, (list, np.ndarray)) and len(v) > 8:
            v = "[%d items] %s ..." % (len(v), list(v[:4]))
        print("%s = %r" % (k, v))
    for ti in g.tensors.values():
        print(ti)


if __name__ == "__main__":
    main(sys.argv)
