"""SGLang's own Engram gather on its own shared host table (memfd, pinned) against the engram.sglang plugin's, in the
same run, same int64 ids: per table size (V4.1's geometry: 2 layers, 24 hash columns, head_dim 256), per token
count, eagerly and in a CUDA graph; and the time to a ready table in a worker (SGLang's: create the memfd, load from
the page cache, pin; the plugin's: attach and register).

Needs the GPU machine's torch + triton and SGLang's own source files (ENGRAM_SGLANG_SRC: one tree, or one per commit,
of which the first the plugin serves is used; loaded against the stand-ins of tests/python/sglang_stubs.py). `ratio`
is SGLang's time over ours (> 1: ours faster).

    python3 bench/sglang_lookup.py --table-mib 512,16384 [--tokens 1,4,64,1024,8192] [--iters 30]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, os.path.join(REPO, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engram  # noqa: E402
import engram.sglang as es  # noqa: E402
import sglang_stubs  # noqa: E402
from ckpt_tensors import embed_tensors as tensors  # noqa: E402
from vllm_lookup import start_daemon  # noqa: E402


_KEEP = []


def build(mod, ckpt, cfg, li, sock, own):
    sglang_stubs.STATE.model.model_path = ckpt
    sglang_stubs.STATE.env = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": True,
                              "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "shared"}
    os.environ.pop("ENGRAM_SGLANG_SOCKET", None)
    if not own:
        os.environ["ENGRAM_SGLANG_SOCKET"] = sock
        os.environ["ENGRAM_SGLANG_REQUIRE"] = "1"
    layer_id = cfg["engram_layer_ids"][li]
    emb = mod.EngramEmbedding(cfg["engram_num_embeddings"][li], cfg["engram_head_dim"], layer_id)
    t = tensors(ckpt, layer_id)
    emb.weight.weight_loader(emb.weight, t["weight"])
    emb.scale.weight_loader(emb.scale, t["scale"])
    emb.finish_load("bench")
    return emb


def ready(mod, ckpt, cfg, sock, own):
    t0 = time.monotonic()
    embs = [build(mod, ckpt, cfg, li, sock, own) for li in (0, 1)]
    torch.cuda.synchronize()
    return embs, time.monotonic() - t0


def time_forward(emb, sets, graph, iters):
    static = sets[0].clone()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            emb(static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            emb(static)
    times = []
    for i in range(iters + 3):
        x = sets[i % len(sets)]
        if graph:
            static.copy_(x)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph:
            g.replay()
        else:
            emb(x)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) * 1000)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-mib", default="512,16384")
    ap.add_argument("--tokens", default="1,4,64,1024,8192")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--build", default=os.environ.get("ENGRAM_BUILD_DIR", os.path.join(REPO, "build")))
    args = ap.parse_args()
    why = sglang_stubs.skip_reason()
    if why:
        sys.exit(why)
    mod = src = None
    for commit, tree in sglang_stubs.sources():  # the first SGLang commit the plugin serves
        m = sglang_stubs.load_engram_module(tree)
        if not es.check_surface(m):
            mod, src = m, tree
            break
    if mod is None:
        sys.exit("ENGRAM_SGLANG_SRC holds no SGLang commit the plugin serves: " +
                 ", ".join(c for c, _ in sglang_stubs.sources()))
    es.install(mod)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} sglang-src {src}")
    for mib in [int(x) for x in args.table_mib.split(",")]:
        work = tempfile.mkdtemp(prefix="engram-sb-")
        shm = tempfile.mkdtemp(prefix="engram-sb-", dir="/dev/shm")
        ckpt, sock = os.path.join(work, "ck"), os.path.join(work, "sock")
        subprocess.run([os.path.join(args.build, "tools/engram-mkckpt"), "--out", ckpt, "--table-mib", str(mib),
                        "--layers", "1,14", "--heads", "8", "--max-ngram", "4", "--shards", "2"], check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(ckpt, "config.json")) as f:
            cfg = json.load(f)
        d, publish = start_daemon(args.build, ckpt, shm, sock, os.path.join(work, "engramd.log"))
        print(f"table {mib} MiB: engramd published in {publish:.2f} s")
        try:
            es._state["attachment"] = None
            theirs, t_own = ready(mod, ckpt, cfg, sock, True)
            ours, t_plugin = ready(mod, ckpt, cfg, sock, False)
            reg = es._state["attachment"].table.register_seconds
            print(f"ready table {mib} MiB: sglang_shared_host_table_s {t_own:.3f} plugin_attach_s {t_plugin:.3f} "
                  f"(register {reg:.3f}) ratio {t_own / t_plugin:.2f}")
            rows = cfg["engram_num_embeddings"][0]
            C = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
            rng = np.random.default_rng(1)
            for T in [int(x) for x in args.tokens.split(",")]:
                sets = [torch.from_numpy(rng.integers(0, rows, (T, C)).astype(np.int64)).cuda() for _ in range(8)]
                for graph in (False, True):
                    ts = time_forward(theirs[0], sets, graph, args.iters)
                    to = time_forward(ours[0], sets, graph, args.iters)
                    same = torch.equal(theirs[0](sets[0]).view(torch.int16), ours[0](sets[0]).view(torch.int16))
                    print(f"lookup table_mib {mib} tokens {T} {'graph' if graph else 'eager'}: sglang_us {ts:.1f} "
                          f"ours_us {to:.1f} ratio {ts / to:.2f} equal {same}")
            # SGLang's host tables stay registered with CUDA for the process's life (its _HostTable never
            # unregisters): kept alive, so that the next table's mappings cannot reuse their addresses.
            _KEEP.extend(theirs)
            del theirs, ours
            es._state["attachment"] = None
            torch.cuda.empty_cache()
        finally:
            d.terminate()
            d.wait()
            subprocess.run(["rm", "-rf", work, shm])


if __name__ == "__main__":
    main()
