"""An independent reference of one DeepSeek-V4.1 Engram layer, written from docs/math.md alone in NumPy and the Python
standard library: its own safetensors reader (8-byte little-endian header length, JSON header, raw bytes), its own
token map (tokenizer.json decoded piece by piece, Hugging Face normalisation rebuilt with unicodedata), NumPy's
default_rng multipliers, its own prime search, the hash (docs/math.md section 5) with Python integers, FP8 e4m3
decoded by its formula, the wkv GEMM in float64 and the gate in float64.

It never imports the engram package and never calls the project's C++ (that is what it checks).
"""
import json
import math
import os
import re
import struct
import unicodedata

import numpy as np

INT64_MAX = (1 << 63) - 1


# ---- safetensors ------------------------------------------------------------------------------------------------
def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n).decode("utf-8"))
    return 8 + n, header


class Tensors:
    """Tensor bytes by name over a checkpoint directory (index file or one model.safetensors)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        idx = os.path.join(ckpt, "model.safetensors.index.json")
        if os.path.exists(idx):
            with open(idx) as f:
                self.files = json.load(f)["weight_map"]
        else:
            _, h = read_safetensors_header(os.path.join(ckpt, "model.safetensors"))
            self.files = {k: "model.safetensors" for k in h if k != "__metadata__"}

    def get(self, name):
        key = name if name in self.files else "model." + name
        path = os.path.join(self.ckpt, self.files[key])
        start, header = read_safetensors_header(path)
        meta = header[key]
        b, e = meta["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + b)
            raw = f.read(e - b)
        assert len(raw) == e - b
        return meta["dtype"], meta["shape"], raw


# ---- number formats ---------------------------------------------------------------------------------------------
def e4m3_value(byte):
    s = -1.0 if byte & 0x80 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return s * (m / 8.0) * 2.0 ** (-6)
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3 = np.array([e4m3_value(b) for b in range(256)], dtype=np.float64)


def e8m0_value(byte):
    return 0.0 if byte == 0 else math.ldexp(1.0, int(byte) - 127)


E8M0 = np.array([e8m0_value(b) for b in range(256)], dtype=np.float64)


def to_bf16(x):
    """float64 -> nearest-even bf16, returned as float64 values (through float32, exact for our inputs)."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    r = ((u + 0x7FFF + lsb) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def bf16_bits_to_f64(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---- tokenizer compression (docs/math.md section 2) -------------------------------------------------------------
def _bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_RUST_WS = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {chr(c) for c in range(0x2000, 0x200B)}


def _normalise(text):
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if unicodedata.category(c) != "Mn")
    s = s.lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        s = "\ue000"
    i, j = 0, len(s)
    while i < j and s[i] in _RUST_WS:
        i += 1
    while j > i and s[j - 1] in _RUST_WS:
        j -= 1
    s = s[i:j]
    return s.replace("\ue000", " ")


def token_map(tokenizer_json_path):
    with open(tokenizer_json_path, encoding="utf-8") as f:
        tok = json.load(f)
    id_to_piece = {}
    for piece, i in tok["model"]["vocab"].items():
        id_to_piece[i] = piece
    added = {}
    for a in tok.get("added_tokens", []):
        id_to_piece[a["id"]] = a["content"]
        added[a["id"]] = a["content"]
    b2u = _bytes_to_unicode()
    size = max(id_to_piece) + 1
    keys, out = {}, np.zeros(size, dtype=np.int64)
    for i in range(size):
        piece = id_to_piece[i]
        if i in added:
            text = added[i]
        else:
            text = bytes(b2u[c] for c in piece).decode("utf-8", errors="replace")
        if "\ufffd" in text:
            key = piece
        else:
            key = _normalise(text) or text
        if key not in keys:
            keys[key] = len(keys)
        out[i] = keys[key]
    return out, len(keys)


# ---- layout (docs/math.md sections 3, 4) ------------------------------------------------------------------------
def is_prime(n):
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


class Spec:
    """What docs/math.md derives from a checkpoint directory: config, token map, multipliers, primes, offsets."""

    def __init__(self, ckpt):
        with open(os.path.join(ckpt, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        self.cfg = cfg
        self.layer_ids = list(cfg["engram_layer_ids"])
        self.N = cfg["engram_max_ngram_size"]
        self.H = cfg["engram_n_heads"]
        self.D = cfg["engram_head_dim"]
        self.C = (self.N - 1) * self.H
        self.hidden = cfg["hidden_size"]
        self.hc = cfg["hc_mult"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        pad = cfg.get("engram_pad_token_id", cfg.get("engram_pad_id"))
        self.tmap, cv = token_map(os.path.join(ckpt, "tokenizer.json"))
        assert cv == cfg["engram_compressed_vocab_size"], (cv, cfg["engram_compressed_vocab_size"])
        self.pad_c = int(self.tmap[pad])
        bound = max(1, (INT64_MAX // cv) // 2)
        self.mult = []
        for L in self.layer_ids:
            v = np.random.default_rng(10007 * L).integers(0, bound, size=self.N, dtype=np.int64)
            self.mult.append([2 * int(x) + 1 for x in v])
        seen = set()
        self.primes, self.offsets = [], []
        for li, L in enumerate(self.layer_ids):
            ps = []
            for n in range(2, self.N + 1):
                cur = cfg["engram_vocab_size"] - 1
                for _ in range(self.H):
                    cur += 1
                    while cur in seen or not is_prime(cur):
                        cur += 1
                    seen.add(cur)
                    ps.append(cur)
            assert sum(ps) == cfg["engram_num_embeddings"][li]
            self.primes.append(ps)
            self.offsets.append([sum(ps[:c]) for c in range(len(ps))])
        self.tensors = Tensors(ckpt)

    # docs/math.md section 5
    def hash(self, tokens, positions, qsl, lookback, dead, lookback_dead=None):
        T = len(tokens)
        DEAD = None
        out = np.zeros((T, len(self.layer_ids), self.C), dtype=np.int64)
        for r in range(len(qsl) - 1):
            b, e = int(qsl[r]), int(qsl[r + 1])
            if b == e:
                continue
            start = int(positions[b])
            for t in range(b, e):
                pos = int(positions[t])
                src = []
                for s in range(self.N):
                    lb = pos - s
                    if lb < 0:
                        src.append(DEAD)
                    elif lb >= start:
                        tt = b + (lb - start)
                        src.append(DEAD if dead is not None and dead[tt] else int(self.tmap[int(tokens[tt])]))
                    else:
                        k = (self.N - 1) - (start - lb)      # lookback is oldest first
                        rid = -1 if lookback is None else int(lookback[r][k])
                        if rid == -1:
                            # an unknown lookback id counts as the pad token and blocks nothing, whatever its flag
                            src.append(self.pad_c)
                        elif lookback_dead is not None and lookback_dead[r][k]:
                            src.append(DEAD)  # a known lookback id flagged dead blocks as a dead token does
                        else:
                            src.append(int(self.tmap[rid]))
                for li in range(len(self.layer_ids)):
                    rolling, blocked = 0, False
                    for s in range(self.N):
                        blocked = blocked or src[s] is DEAD
                        v = self.pad_c if blocked else src[s]
                        rolling ^= v * self.mult[li][s]
                        if s > 0:
                            for h in range(self.H):
                                c = (s - 1) * self.H + h
                                out[t, li, c] = rolling % self.primes[li][c] + self.offsets[li][c]
        return out

    # docs/math.md section 6: float64 dequantised rows (exact), then bf16
    def rows(self, li, ids):
        L = self.layer_ids[li]
        _, wshape, w = self.tensors.get(f"layers.{L}.engram.embed.weight")
        _, sshape, s = self.tensors.get(f"layers.{L}.engram.embed.scale")
        w = np.frombuffer(w, dtype=np.uint8).reshape(wshape)
        s = np.frombuffer(s, dtype=np.uint8).reshape(sshape)
        flat = ids.reshape(-1)
        vals = E4M3[w[flat]] * np.repeat(E8M0[s[flat]], 32, axis=1)
        return to_bf16(vals).reshape(ids.shape + (self.D,))

    def wkv(self, li):
        L = self.layer_ids[li]
        _, shape, w = self.tensors.get(f"layers.{L}.engram.wkv.weight")
        _, sshape, s = self.tensors.get(f"layers.{L}.engram.wkv.scale")
        w = E4M3[np.frombuffer(w, dtype=np.uint8).reshape(shape)]
        s = E8M0[np.frombuffer(s, dtype=np.uint8).reshape(sshape)]
        rows, cols = shape
        scale = np.empty(shape)
        for i in range(sshape[0]):
            for j in range(sshape[1]):
                scale[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32] = s[i, j]
        return w * scale

    def gate_weights(self, li):
        L = self.layer_ids[li]
        out = []
        for n in ("q_weight", "k_weight"):
            dt, shape, raw = self.tensors.get(f"layers.{L}.engram.{n}")
            assert dt == "BF16"
            out.append(bf16_bits_to_f64(np.frombuffer(raw, dtype=np.uint16).reshape(shape)))
        return out

    # docs/math.md section 7, float64
    def gate(self, hidden, kv, qw, kw, dead):
        T, HC, D = hidden.shape
        out = np.empty_like(hidden)
        for t in range(T):
            value = kv[t, HC * D:(HC + 1) * D]
            for c in range(HC):
                h = hidden[t, c]
                key = kv[t, c * D:(c + 1) * D]
                dot = np.sum(h * qw[c] * kw[c] * key) / math.sqrt(np.mean(h * h) + self.eps) \
                    / math.sqrt(np.mean(key * key) + self.eps) / math.sqrt(D)
                g = 1.0 / (1.0 + math.exp(-(math.copysign(1.0, dot) if dot != 0 else 0.0)
                                          * math.sqrt(max(abs(dot), 1e-6))))
                if dead is not None and dead[t]:
                    g = 0.0
                out[t, c] = h + g * value
        return out

    def layer(self, li, hidden_bits, tokens, positions, qsl, lookback, dead):
        """The whole layer: returns (hash ids, output as float64 of the bf16 result, kv before rounding)."""
        ids = self.hash(tokens, positions, qsl, lookback, dead)
        rows = self.rows(li, ids[:, li, :])                       # [T, C, D]
        kv = to_bf16(rows.reshape(len(tokens), -1) @ self.wkv(li).T)
        hidden = bf16_bits_to_f64(hidden_bits)
        qw, kw = self.gate_weights(li)
        return ids, to_bf16(self.gate(hidden, kv, qw, kw, dead))
