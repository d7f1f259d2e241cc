#!/usr/bin/env python3
"""Engram's share of a decode step (GPU machine): a proxy DeepSeek-V4.1-Flash decode step (bf16 dense GEMMs of every
layer, CUDA graph) with and without the Engram layers reading a shared host table through the engram package with
prefetch on. Prints one JSON line per batch size and a table; the slowdown is (with - without) / without.

Proxy step (config.json gives hidden_size, hc_mult and num_hidden_layers; the rest are stated assumptions, shown in
the output): per layer q [h -> h], kv [h -> 2*kv_dim], o [h -> h] and an FFN of `ffn_width` active columns (gate+up
[h -> 2*ffn], down [ffn -> h]), then the LM head [h -> vocab]. With Engram, the step starts with the hash of the
batch's tokens and the prefetch of every Engram layer's rows (side stream), and each Engram layer waits for its rows,
projects them with wkv (bf16 copy of the checkpoint's FP8 wkv, [(hc+1)*h, n_cols*head_dim]) and gates the
[T, hc, h] hidden state.

    python3 bench/decode_step.py --checkpoint CK --socket S --shm-dir D [--batches 1,8,32,64,128,256]
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import engram  # noqa: E402
from engram.checkpoint import Checkpoint  # noqa: E402


def graph_time(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return float(np.median(times)), g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--shm-dir", default=None)
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--kv-dim", type=int, default=512)
    ap.add_argument("--ffn-width", type=int, default=None, help="active FFN columns (default 4 * hidden_size)")
    ap.add_argument("--layers", type=int, default=None, help="backbone layers (default config num_hidden_layers)")
    ap.add_argument("--config", default=None, help="config.json for the backbone's shape (default: the checkpoint's)")
    a = ap.parse_args()
    ck = Checkpoint(a.checkpoint)
    cfg = ck.config
    if a.config:
        with open(a.config) as f:
            cfg = json.load(f)
    H, HC = cfg["hidden_size"], cfg["hc_mult"]
    n_layers = a.layers or cfg.get("num_hidden_layers", 40)
    ffn = a.ffn_width or 4 * H
    vocab = cfg.get("vocab_size", 129280)
    dev = "cuda"
    torch.manual_seed(0)
    w = lambda o, i: (torch.randn(o, i, device=dev) * 0.02).to(torch.bfloat16)  # noqa: E731
    # One weight set per layer: the step reads every layer's weights from HBM, as a real model does.
    weights = [(w(H, H), w(2 * a.kv_dim, H), w(H, H), w(2 * ffn, H), w(H, ffn)) for _ in range(n_layers)]
    head = w(vocab, H)

    t0 = time.time()
    table = engram.attach(a.checkpoint, dp_size=a.dp_size, dp_rank=0, socket=a.socket, shm_dir=a.shm_dir)
    attach_s = time.time() - t0
    lay = table.layout
    L, C, D = len(lay.layers), lay.n_cols, lay.head_dim
    engram_at = {lid: i for i, lid in enumerate(l.layer_id for l in lay.layers)}
    wkv = [torch.from_numpy(ck.wkv(l.layer_id)).to(dev).to(torch.bfloat16).t().contiguous() for l in lay.layers]
    qk = [tuple(torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).to(dev) for x in ck.gate_weights(l.layer_id))
          for l in lay.layers]
    bmax = max(int(b) for b in a.batches.split(","))
    eng = table.engine(bmax)
    staging = [eng.staging(i) for i in range(L)]
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mode": table.mode,
            "backend": table.backend, "reasons": [r.name for r in table.reasons], "attach_s": round(attach_s, 3),
            "register_s": table.register_seconds, "layers": n_layers, "hidden": H, "hc_mult": HC, "kv_dim": a.kv_dim,
            "ffn_width": ffn, "vocab": vocab, "engram_layers": sorted(engram_at), "table_rows":
                sum(l.row_end - l.row_begin for l in lay.layers), "record_bytes": lay.record_bytes}
    print(json.dumps({"setup": info}), flush=True)

    # Same-run ceiling: H2D copy from pinned memory (64 MiB).
    src = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=dev)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 10 * src.numel() / (time.perf_counter() - t) / 1e9
    print(json.dumps({"ceiling_h2d_pinned_GBps": round(h2d, 1)}), flush=True)

    rows_out = []
    rng = np.random.default_rng(1)
    for B in [int(b) for b in a.batches.split(",")]:
        x = torch.randn(B, H, device=dev).to(torch.bfloat16)
        hid = torch.randn(B, HC, H, device=dev).to(torch.bfloat16)
        tok = torch.from_numpy(rng.integers(0, lay.raw_vocab, size=B).astype(np.int32)).to(dev)
        pos = torch.from_numpy(rng.integers(100, 4000, size=B).astype(np.int64)).to(dev)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)           # B decode requests of one token
        lb = torch.from_numpy(rng.integers(0, lay.raw_vocab, size=(B, lay.max_ngram - 1)).astype(np.int32)).to(dev)
        ids = torch.empty((B, L, C), dtype=torch.int32, device=dev)
        gate_out = [torch.empty_like(hid) for _ in range(L)]

        def backbone(with_engram):
            h = x
            hc = hid
            if with_engram:
                eng.hash(tok, pos, qsl, lookback=lb, out=ids)
                eng.prefetch(ids)
            for li, (wq, wkv_, wo, wup, wdown) in enumerate(weights):
                if with_engram and li in engram_at:
                    i = engram_at[li]
                    eng.wait(i)
                    kv = staging[i][:B].reshape(B, C * D) @ wkv[i]
                    hc = eng.gate(hc, kv, qk[i][0], qk[i][1], out=gate_out[i])
                    h = h + hc[:, 0]
                q = h @ wq.t()
                kvp = h @ wkv_.t()
                h = h + (q + torch.nn.functional.pad(kvp, (0, H - kvp.shape[1]))) @ wo.t()
                u = h @ wup.t()
                h = h + (torch.nn.functional.silu(u[:, :ffn]) * u[:, ffn:]) @ wdown.t()
            return h @ head.t()

        base, _ = graph_time(lambda: backbone(False), a.iters)
        with_e, _ = graph_time(lambda: backbone(True), a.iters)

        # Engram's pieces alone (graphs too): hash + prefetch + all waits; one lookup of a layer's rows.
        def engram_only():
            eng.hash(tok, pos, qsl, lookback=lb, out=ids)
            eng.prefetch(ids)
            for i in range(L):
                eng.wait(i)
        e_only, _ = graph_time(engram_only, a.iters)
        bytes_moved = B * L * C * lay.record_bytes
        r = {"batch": B, "step_us": round(base, 1), "step_engram_us": round(with_e, 1),
             "slowdown_pct": round(100 * (with_e - base) / base, 2), "engram_alone_us": round(e_only, 1),
             "rows": B * L * C, "gather_GBps": round(bytes_moved / (e_only * 1e-6) / 1e9, 2)}
        rows_out.append(r)
        print(json.dumps(r), flush=True)
    print("\n| batch | step (us) | with Engram (us) | slowdown | Engram alone (us) | rows | gather GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['batch']} | {r['step_us']} | {r['step_engram_us']} | {r['slowdown_pct']}% | "
              f"{r['engram_alone_us']} | {r['rows']} | {r['gather_GBps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
