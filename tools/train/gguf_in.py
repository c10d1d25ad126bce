"""Minimal GGUF v3 reader (stdlib + numpy) for the files gguf_out.py writes: metadata and
F32/F16 tensors. Lets the trainer evaluate a shipped model without its checkpoint."""
import struct

import numpy as np

import gguf_out

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_DTYPE = {gguf_out.GGML_F32: "<f4", gguf_out.GGML_F16: "<f2"}


class Reader:
    """r.kv: {key: value} (arrays as lists); r.tensor(name): float32 array in numpy order
    (the reversed GGUF ne). Raises ValueError on anything but F32/F16 GGUF v3."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.buf = f.read()
        self.pos = 0
        if self._take(4) != b"GGUF" or self._u32() != 3:
            raise ValueError(f"{path}: not a GGUF v3 file")
        nt, nkv = struct.unpack("<QQ", self._take(16))
        self.kv = {}
        for _ in range(nkv):
            k = self._str()
            self.kv[k] = self._value(self._u32())
        self.info = {}
        for _ in range(nt):
            name = self._str()
            nd = self._u32()
            ne = struct.unpack(f"<{nd}Q", self._take(8 * nd))
            typ, off = struct.unpack("<IQ", self._take(12))
            if typ not in _DTYPE:
                raise ValueError(f"{path}: tensor '{name}' has type {typ}, not F32/F16")
            self.info[name] = (tuple(reversed(ne)), typ, off)
        align = self.kv.get("general.alignment", gguf_out.ALIGN)
        self.data = (self.pos + align - 1) // align * align

    def tensor(self, name):
        shape, typ, off = self.info[name]
        n = int(np.prod(shape))
        a = np.frombuffer(self.buf, dtype=_DTYPE[typ], count=n, offset=self.data + off)
        return a.astype(np.float32).reshape(shape)

    def _take(self, n):
        b = self.buf[self.pos:self.pos + n]
        if len(b) != n:
            raise ValueError("truncated GGUF")
        self.pos += n
        return b

    def _u32(self):
        return struct.unpack("<I", self._take(4))[0]

    def _str(self):
        n = struct.unpack("<Q", self._take(8))[0]
        return self._take(n).decode("utf-8", errors="surrogateescape")

    def _value(self, t):
        if t == gguf_out.T_STR:
            return self._str()
        if t == gguf_out.T_ARR:
            et = self._u32()
            n = struct.unpack("<Q", self._take(8))[0]
            return [self._value(et) for _ in range(n)]
        fmt = _SCALAR[t]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]
