"""Reading an Engram layer's dense weights (wkv FP8 + block scales, q_weight, k_weight) from a checkpoint's
safetensors files, for a layer built on the package (python/examples/engram_layer.py). The table rows never go
through here: they come from the attached Table.

    ck = Checkpoint("/models/DeepSeek-V4.1-Flash")
    w = ck.wkv(layer_id)            # float32 [hidden*(hc_mult+1), n_cols*head_dim], FP8 e4m3 x ue8m0 32x32 blocks
    q, k = ck.bf16(f"layers.{layer_id}.engram.q_weight"), ...   # uint16 bf16 bits

Headers are checked (length, JSON, dtype, shape against byte ranges inside the file) and tensors are memory-mapped
read-only. `model.`-prefixed names are accepted (docs/math.md section 1). Needs NumPy; not thread-safe.
"""
import json
import os
import struct

import numpy as np

_ITEM = {"F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


def e4m3_table():
    """float32 value of each OCP FP8 E4M3 byte (NaN for 0x7f/0xff)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    val = sign * val
    val[(exp == 15) & (man == 7)] = np.nan
    return val.astype(np.float32)


def ue8m0(byte_array):
    """2^(byte-127) as float32, byte 0 = +0.0 (the float whose bits are byte << 23)."""
    return (byte_array.astype(np.uint32) << 23).view(np.float32)


def dequant_blocks(weight, scale, block=32):
    """FP8 e4m3 weight [R, K] (uint8) x ue8m0 scale [ceil(R/block), ceil(K/block)] -> float32 [R, K]."""
    vals = e4m3_table()[weight]
    s = ue8m0(scale)
    s = np.repeat(np.repeat(s, block, axis=0)[: weight.shape[0]], block, axis=1)[:, : weight.shape[1]]
    return vals * s


class Checkpoint:
    def __init__(self, path):
        self.path = os.fspath(path)
        with open(os.path.join(self.path, "config.json"), "rb") as f:
            cfg = json.load(f)
        self.config = cfg.get("text_config", cfg)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, "rb") as f:
                self._where = json.load(f)["weight_map"]
        else:
            self._where = None
        self._headers = {}

    def _header(self, fname):
        if fname not in self._headers:
            full = os.path.join(self.path, fname)
            size = os.path.getsize(full)
            with open(full, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise ValueError(f"{full}: shorter than a safetensors header")
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, 100 << 20):
                    raise ValueError(f"{full}: header length {n} does not fit the file")
                h = json.loads(f.read(n))
            self._headers[fname] = (full, 8 + n, size, h)
        return self._headers[fname]

    def _locate(self, name):
        for cand in (name, "model." + name):
            if self._where is not None:
                if cand in self._where:
                    return cand, self._where[cand]
            else:
                if cand in self._header("model.safetensors")[3]:
                    return cand, "model.safetensors"
        raise KeyError(f"{name}: not in the checkpoint {self.path}")

    def raw(self, name):
        """(dtype, shape, read-only uint8 memmap of the bytes) of tensor `name`."""
        real, fname = self._locate(name)
        full, base, size, h = self._header(fname)
        meta = h[real]
        dtype, shape = meta["dtype"], tuple(meta["shape"])
        b, e = meta["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if dtype not in _ITEM or e - b != count * _ITEM[dtype] or b < 0 or base + e > size:
            raise ValueError(f"{name}: {dtype} {list(shape)} does not match its bytes [{b}, {e}) in {full}")
        return dtype, shape, np.memmap(full, dtype=np.uint8, mode="r", offset=base + b, shape=(e - b,))

    def bf16(self, name):
        dtype, shape, raw = self.raw(name)
        if dtype != "BF16":
            raise ValueError(f"{name}: {dtype}, expected BF16")
        return np.array(raw).view(np.uint16).reshape(shape)

    def fp8(self, name):
        dtype, shape, raw = self.raw(name)
        if dtype not in ("F8_E4M3", "F8_E8M0", "U8"):
            raise ValueError(f"{name}: {dtype}, expected an 8-bit type")
        return np.asarray(raw).reshape(shape)

    def wkv(self, layer_id):
        """The dequantised wkv of backbone layer `layer_id`: float32 [hidden*(hc_mult+1), n_cols*head_dim]."""
        base = f"layers.{layer_id}.engram.wkv."
        return dequant_blocks(self.fp8(base + "weight"), self.fp8(base + "scale"))

    def gate_weights(self, layer_id):
        """(q_weight, k_weight) of layer `layer_id`: bf16 bits uint16 [hc_mult, hidden]."""
        base = f"layers.{layer_id}.engram."
        return self.bf16(base + "q_weight"), self.bf16(base + "k_weight")
