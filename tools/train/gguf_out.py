"""Minimal GGUF v3 writer (stdlib + numpy): metadata, F32/F16 tensors."""
import struct

import numpy as np

ALIGN = 32
T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 = range(13)
GGML_F32, GGML_F16 = 0, 1


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


class Writer:
    def __init__(self):
        self.kv = []        # (key, encoded type+value)
        self.tensors = []   # (name, np.ndarray in C order, ggml type)

    def u32(self, k, v):
        self.kv.append((k, struct.pack("<II", T_U32, v)))

    def i32(self, k, v):
        self.kv.append((k, struct.pack("<Ii", T_I32, v)))

    def f32(self, k, v):
        self.kv.append((k, struct.pack("<If", T_F32, v)))

    def bool(self, k, v):
        self.kv.append((k, struct.pack("<IB", T_BOOL, 1 if v else 0)))

    def str(self, k, v):
        self.kv.append((k, struct.pack("<I", T_STR) + _str(v)))

    def str_arr(self, k, vs):
        body = b"".join(_str(v) for v in vs)
        self.kv.append((k, struct.pack("<IIQ", T_ARR, T_STR, len(vs)) + body))

    def i32_arr(self, k, vs):
        a = np.asarray(vs, dtype="<i4")
        self.kv.append((k, struct.pack("<IIQ", T_ARR, T_I32, len(a)) + a.tobytes()))

    def tensor(self, name, arr):
        """arr in numpy (row-major) order: GGUF ne is the reversed shape. 1-D -> F32,
        2-D/3-D -> F16."""
        arr = np.ascontiguousarray(arr)
        if arr.ndim == 1:
            self.tensors.append((name, arr.astype("<f4"), GGML_F32))
        else:
            self.tensors.append((name, arr.astype("<f2"), GGML_F16))

    def write(self, path):
        head = bytearray(b"GGUF")
        head += struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))
        for k, v in self.kv:
            head += _str(k) + v
        off = 0
        offs = []
        for name, arr, typ in self.tensors:
            ne = list(reversed(arr.shape))
            head += _str(name) + struct.pack("<I", len(ne))
            head += b"".join(struct.pack("<Q", n) for n in ne)
            head += struct.pack("<IQ", typ, off)
            offs.append(off)
            off += arr.nbytes
            off = (off + ALIGN - 1) // ALIGN * ALIGN
        head += b"\0" * ((-len(head)) % ALIGN)
        with open(path, "wb") as f:
            f.write(head)
            pos = 0
            for (name, arr, typ), o in zip(self.tensors, offs):
                f.write(b"\0" * (o - pos))
                f.write(arr.tobytes())
                pos = o + arr.nbytes
            f.write(b"\0" * ((-pos) % ALIGN))
