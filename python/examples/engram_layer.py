#!/usr/bin/env python3
"""A DeepSeek-V4.1 Engram layer on the engram package: hash once per step, prefetch every Engram layer's rows on a
side stream, then per layer wait, the wkv projection (the checkpoint's FP8 wkv dequantised with its 32x32 block
scales; a plain matmul) and the gate (docs/math.md sections 5-7).

    step = EngramStep(table, max_tokens)                  # one per replica: the engine and its staging buffers
    layers = [EngramLayer(step, ckpt, i) for i in range(len(table.layout.layers))]
    ids = step.begin(tokens, positions, query_start_loc, lookback, dead)   # hash + prefetch (side stream)
    ... the backbone runs up to the Engram layer ...
    hidden = layers[i](hidden, ids, dead)                 # wait(i) -> rows -> wkv -> gate

Arrays: torch tensors (CUDA, or CPU) or, on the CPU backend without torch, NumPy arrays with bf16 as uint16 bits.
With torch >= 2.4 the CUDA path goes through the engram.torch ops (torch.compile and CUDA graphs take it whole).
Tensor parallelism: a rank's staging holds the rows of its TP shard's columns (layout.staging_cols; in a DP_SHARDED
table wider than the DP shard it holds, layout.owned_cols) and it computes a partial wkv product over them; pass
`all_reduce` (e.g. torch.distributed.all_reduce) when tp_size > 1.

As a program: N DP processes against one engramd, each attaching its rank and running random steps:
    python3 engram_layer.py --checkpoint DIR --socket S --shm-dir D --dp-size 4 --dp-rank 1 [--steps 3]
prints one JSON line per process (mode, reasons, backend, a checksum of the outputs).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import engram  # noqa: E402
from engram._arrays import torch_module  # noqa: E402
from engram.checkpoint import Checkpoint  # noqa: E402

try:
    import engram.torch as _ops  # noqa: F401
    HAVE_OPS = True
except ImportError:
    HAVE_OPS = False


def bf16_bits_from_f32(x):
    """Round float32 to bf16 (nearest even) as uint16 bits (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def f32_from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


class EngramStep:
    """Per replica and step: the engine (staging buffers at fixed addresses) and the hash + prefetch."""

    def __init__(self, table, max_tokens, use_ops=None):
        self.table = table
        self.engine = table.engine(max_tokens)
        self.layout = table.layout
        self.torch = torch_module() if table.backend == "cuda" or use_ops else None
        self.use_ops = HAVE_OPS if use_ops is None else use_ops
        self.use_ops = self.use_ops and table.backend == "cuda"
        self.eid = _ops.register(self.engine) if self.use_ops else None
        if table.backend == "cuda":
            self.staging = [self.engine.staging(i) for i in range(len(self.layout.layers))]
        self.ticket = None

    def begin(self, tokens, positions, query_start_loc, lookback=None, dead=None):
        """Hash the step's tokens, then prefetch every layer's rows (side stream). Returns the hash ids."""
        if self.use_ops:
            t = self.torch
            ids = t.ops.engram.hash(self.eid, tokens, positions, query_start_loc, lookback, dead)
            self.ticket = t.ops.engram.prefetch(self.eid, ids)
            return ids
        ids = self.engine.hash(tokens, positions, query_start_loc, lookback=lookback, dead=dead)
        self.engine.prefetch(ids)
        return ids

    def rows(self, layer, ids):
        """bf16 [T, n_cols, head_dim] of `layer` (after its prefetch)."""
        T = ids.shape[0]
        if self.use_ops:
            return self.torch.ops.engram.wait_rows(self.eid, layer, ids, self.ticket)
        self.engine.wait(layer)
        s = self.engine.staging(layer)
        if isinstance(s, np.ndarray):
            s = s[:T].copy()
            t = torch_module() if not isinstance(ids, np.ndarray) else None
            return t.from_numpy(s.view(np.int16)).view(t.bfloat16) if t is not None else s
        return s[:T]


class EngramLayer:
    """One Engram layer (table index `index`): (hidden [T, hc_mult, hidden], hash ids, dead) -> [T, hc_mult, hidden]."""

    def __init__(self, step, checkpoint, index, device=None, all_reduce=None):
        self.step, self.index = step, index
        lay = step.layout
        self.layer_id = lay.layers[index].layer_id
        ck = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        D = lay.head_dim
        cb, ce = lay.staging_cols  # the columns the staging fills (DP_SHARDED: more than the table holds)
        self.cols = (cb, ce)
        self.partial = (cb, ce) != (0, lay.n_cols)
        if self.partial and all_reduce is None:
            raise ValueError(f"this TP rank's staging holds columns [{cb}, {ce}) of {lay.n_cols}: pass all_reduce")
        self.all_reduce = all_reduce
        wkv = ck.wkv(self.layer_id)[:, cb * D: ce * D]                  # float32, exact bf16 values
        q, k = ck.gate_weights(self.layer_id)                           # bf16 bits
        self.eps = float(lay.rms_norm_eps)
        t = step.torch if step.torch is not None else None
        if t is None and device is not None and str(device).startswith("cpu"):
            t = torch_module()
        self.t = t
        if t is not None:
            dev = device or ("cuda" if step.table.backend == "cuda" else "cpu")
            self.wkv_t = t.from_numpy(np.ascontiguousarray(wkv.T)).to(dev).to(t.bfloat16)   # [C*D, out]
            self.q = t.from_numpy(q.view(np.int16).copy()).view(t.bfloat16).to(dev)
            self.k = t.from_numpy(k.view(np.int16).copy()).view(t.bfloat16).to(dev)
        else:
            self.wkv_t = np.ascontiguousarray(wkv.T)                    # float32 [C*D, out]
            self.q, self.k = q, k

    def kv(self, rows):
        T = rows.shape[0]
        cb, ce = self.cols
        r = rows[:, cb:ce].reshape(T, -1)
        if self.t is not None:
            kv = r @ self.wkv_t
        else:
            kv = bf16_bits_from_f32(f32_from_bf16_bits(r) @ self.wkv_t)
        if self.partial:
            self.all_reduce(kv)
        return kv

    def __call__(self, hidden, ids, dead=None):
        rows = self.step.rows(self.index, ids)
        kv = self.kv(rows)
        if self.step.use_ops:
            return self.t.ops.engram.gate(self.step.eid, hidden, kv, self.q, self.k, dead, self.eps)
        return self.step.engine.gate(hidden, kv, self.q, self.k, dead=dead, eps=self.eps)


def random_batch(rng, vocab, lens, max_ngram, dead_frac=0.1, start_max=50):
    """tokens, positions, query_start_loc, lookback, dead (NumPy) of len(lens) requests with random starts and
    lookback (some unknown) and random DEAD spans."""
    T = int(sum(lens))
    tokens = rng.integers(0, vocab, size=T, dtype=np.int64).astype(np.int32)
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(lens)
    positions = np.zeros(T, dtype=np.int64)
    lookback = np.full((len(lens), max_ngram - 1), -1, dtype=np.int32)
    for r, n in enumerate(lens):
        start = int(rng.integers(0, start_max))
        positions[qsl[r]:qsl[r + 1]] = np.arange(start, start + n)
        known = min(start, max_ngram - 1)
        for k in range(max_ngram - 1 - known, max_ngram - 1):
            lookback[r, k] = -1 if rng.random() < 0.2 else int(rng.integers(0, vocab))
    dead = np.zeros(T, dtype=np.uint8)
    i = 0
    while i < T:
        if rng.random() < dead_frac:
            span = int(rng.integers(1, 5))
            dead[i:i + span] = 1
            i += span
        i += 1
    return tokens, positions, qsl, lookback, dead


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--socket", default=engram.DEFAULT_SOCKET)
    ap.add_argument("--shm-dir", default=None)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hold", type=float, default=0, help="seconds to keep the table attached at the end")
    ap.add_argument("--dump", default=None, help="write every step's inputs and outputs to this .npz")
    ap.add_argument("--hold-until", default=None, help="after reporting, keep the table until this file exists")
    ap.add_argument("--backend", default="auto", choices=("auto", "cpu"))
    a = ap.parse_args(argv)
    table = engram.attach(a.checkpoint, dp_size=a.dp_size, dp_rank=a.dp_rank, socket=a.socket, shm_dir=a.shm_dir,
                          backend=a.backend)
    lay = table.layout
    step = EngramStep(table, a.tokens)
    layers = [EngramLayer(step, a.checkpoint, i) for i in range(len(lay.layers))]
    rng = np.random.default_rng(a.seed * 1000 + a.dp_rank)
    digest = 0
    dump = {}
    for n in range(a.steps):
        lens = [a.tokens // 2, a.tokens - a.tokens // 2]
        tokens, positions, qsl, lookback, dead = random_batch(rng, lay.raw_vocab, lens, lay.max_ngram)
        hidden = bf16_bits_from_f32(rng.standard_normal((a.tokens, lay.hc_mult, lay.hidden_size)).astype(np.float32))
        arrays = [tokens, positions, qsl, lookback, dead, hidden]
        if table.backend == "cuda":
            t = torch_module()
            arrays = [t.from_numpy(x).cuda() for x in arrays[:5]] + \
                     [t.from_numpy(hidden.view(np.int16)).view(t.bfloat16).cuda()]
        for k, v in zip(("tokens", "positions", "qsl", "lookback", "dead", "hidden"), arrays[:5] + [hidden]):
            dump[f"{k}{n}"] = v if isinstance(v, np.ndarray) else v.cpu().numpy()
        tokens, positions, qsl, lookback, dead, h = arrays
        ids = step.begin(tokens, positions, qsl, lookback, dead)
        for layer in layers:
            h = layer(h, ids, dead)
        out = h if isinstance(h, np.ndarray) else h.view(torch_module().int16).cpu().numpy().view(np.uint16)
        dump[f"out{n}"] = out
        digest ^= int(np.bitwise_xor.reduce(out.reshape(-1).astype(np.uint64) * np.arange(1, out.size + 1,
                                                                                         dtype=np.uint64)))
    if a.dump:
        np.savez(a.dump, **dump)
    print(json.dumps({"dp_rank": a.dp_rank, "mode": table.mode, "backend": table.backend,
                      "reasons": [r.name for r in table.reasons], "digest": digest, "pid": os.getpid()}), flush=True)
    import time
    if a.hold > 0:
        time.sleep(a.hold)
    deadline = time.monotonic() + 120
    while a.hold_until and not os.path.exists(a.hold_until) and time.monotonic() < deadline:
        time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
