"""vLLM's own Engram lookup on its own pinned table against the engram.vllm plugin's, in the same run, same ids, with
the layer built by the model's own Engram class of one stored vLLM version (`--version`, a tag of
tests/python/vllm_stubs.py VERSIONS; default the upstream NVIDIA layout):
per table size (V4.1's geometry: 2 layers, 24 hash columns, head_dim 256), per token count, bf16 and packed output,
eagerly and in a CUDA graph; and the time to a ready table in a worker (vLLM's pinned path: allocate and load from the
page cache, vs the plugin: attach and register), for a first and a second engine while the segment stays READY.

Needs the GPU machine's torch + triton and vLLM's own source files (ENGRAM_VLLM_SRC, loaded against the stand-ins
of tests/python/vllm_stubs.py). Prints one line per measurement; `ratio` is vLLM's time over ours (> 1: ours faster).

    python3 bench/vllm_lookup.py --table-mib 512,16384 [--tokens 1,4,64,1024,8192] [--iters 50] [--version TAG]
                                 [--per-graph 20] [--background] [--no-ready]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import inspect
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, os.path.join(REPO, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engram  # noqa: E402
import engram.vllm as ev  # noqa: E402
import vllm_stubs  # noqa: E402
from vllm_stubs import no_dp_shm  # noqa: E402
from ckpt_tensors import embed_tensors  # noqa: E402


def binary(build, rel):
    return os.path.join(build, rel)


def start_daemon(build, ckpt, shm, sock, log):
    p = subprocess.Popen([binary(build, "daemon/engramd"), "--checkpoint", ckpt, "--tp", "1", "--shm-dir", shm,
                          "--socket", sock, "--log-level", "warn"], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while True:
        try:
            st = engram.status(sock, timeout_ms=1000)
            if st["segments"] and all(s["state"] == "READY" for s in st["segments"]):
                return p, time.monotonic() - t0
        except engram.EngramError:
            pass
        if p.poll() is not None:
            raise RuntimeError(open(log).read()[-2000:])
        time.sleep(0.1)


tensors = embed_tensors


def make(vm, ckpt, sock, li, own, max_tokens):
    """The embedding of layer index li, in the layer the model's own Engram class builds (vLLM's own table when
    `own`, else the plugin's)."""
    vllm_stubs.STATE.tp = (1, 0)
    extra = {} if own else {"engram": {"socket": sock, "require": True}}
    vllm_stubs.STATE.config = vllm_stubs.make_vllm_config(ckpt, additional_config=extra, max_tokens=max_tokens,
                                                          engram_fields=vm.engram_fields, **no_dp_shm(vm))
    with torch.device("cuda"):
        layer, layout = vm.build_layer(ckpt, li)
    return layer.embed_tokens, layout


def packed_kw(vm, emb):
    """How the version's lookup is asked for packed records: {"packed": True}, {} (it reads the out's dtype), or
    None (it cannot write them)."""
    if "packed" in inspect.signature(type(emb).lookup).parameters:
        return {"packed": True}
    return {} if vm.version.tag.startswith("merged") else None


def ready_table(vm, ckpt, sock, own, max_tokens):
    """Seconds until both layers' embeddings exist and their weights are loaded (the worker's view)."""
    t0 = time.monotonic()
    embs = []
    for li in (0, 1):
        emb, layout = make(vm, ckpt, sock, li, own, max_tokens)
        t = tensors(ckpt, layout.layer_ids[li])
        emb.weight.weight_loader(emb.weight, t["weight"])
        emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, t["scale"])
        embs.append(emb)
    torch.cuda.synchronize()
    return embs, layout, time.monotonic() - t0


def ids_for(layout, T, n, seed):
    rng = np.random.default_rng(seed)
    primes = [p for order in layout.primes[0] for p in order]
    offsets = layout.offsets[0].tolist()
    L, C = len(layout.layer_ids), len(primes)
    out = []
    for _ in range(n):
        a = np.empty((T, L, C), np.int32)
        for c in range(C):
            a[:, :, c] = offsets[c] + rng.integers(0, primes[c], size=(T, L))
        out.append(torch.from_numpy(a).cuda())
    return out


def time_lookup(emb, ids_sets, out, graph, iters, kw, per_graph=1):
    """Median microseconds of one lookup of layer 0's ids into out, a fresh id set each time. In a graph:
    `per_graph` lookups per replay (each its own fresh ids, copied in before the replay, outside the timed span),
    time per lookup."""
    times = []
    n = per_graph if graph else 1
    pool = [torch.stack([ids_sets[(i * n + k) % len(ids_sets)] for k in range(n)]) for i in range(len(ids_sets))]
    static = pool[0].clone()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            emb.lookup(static[0][:, 0, :], out, **kw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for k in range(n):
                emb.lookup(static[k][:, 0, :], out, **kw)
    for i in range(iters + 3):
        ids = ids_sets[i % len(ids_sets)]
        if graph:
            static.copy_(pool[i % len(pool)])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph:
            g.replay()
        else:
            emb.lookup(ids[:, 0, :], out, **kw)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) * 1000 / n)
    return float(np.median(times))


def attach_in_new_process(ckpt, sock, max_tokens):
    code = ("import sys, time, engram; t0 = time.monotonic(); t = engram.attach(sys.argv[1], socket=sys.argv[2]);"
            "e = t.engine(int(sys.argv[3])); print(t.mode, t.register_seconds, time.monotonic() - t0)")
    r = subprocess.run([sys.executable, "-c", code, ckpt, sock, str(max_tokens)], capture_output=True, text=True,
                       env=dict(os.environ))
    line = [l for l in r.stdout.splitlines() if l and not l.startswith("[")][-1]
    mode, reg, total = line.split()
    return mode, float(reg), float(total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-mib", default="512,16384")
    ap.add_argument("--tokens", default="1,4,64,1024,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--build", default=os.environ.get("ENGRAM_BUILD_DIR", os.path.join(REPO, "build")))
    ap.add_argument("--per-graph", type=int, default=1,
                    help="lookups per graph replay (each with fresh ids); the time is per lookup")
    ap.add_argument("--background", action="store_true",
                    help="both lookups as a prefetch stream runs them (lookup(..., background=True))")
    ap.add_argument("--no-ready", action="store_true", help="skip the second engine's attach in a new process")
    ap.add_argument("--version", default=next(v.tag for v in vllm_stubs.VERSIONS if v.tag.startswith("nvidia")))
    args = ap.parse_args()
    version = next((v for v in vllm_stubs.VERSIONS if v.tag == args.version), None)
    if version is None:
        sys.exit(f"--version: one of {', '.join(v.tag for v in vllm_stubs.VERSIONS)}")
    why = vllm_stubs.missing_files(version)
    if why:
        sys.exit(why)
    tokens = [int(x) for x in args.tokens.split(",")]
    max_tokens = max(tokens)
    vm = vllm_stubs.load_version(version)
    for s in ev.layouts.find(lambda name, e: sys.exit(f"{name}: {e}")):
        ev.install(s)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} vllm {version.tag} "
          f"({vm.model_module.__name__}) engram {engram.__version__} from {engram._lib.path}")
    for mib in [int(x) for x in args.table_mib.split(",")]:
        work = tempfile.mkdtemp(prefix="engram-vb-")
        shm = tempfile.mkdtemp(prefix="engram-vb-", dir="/dev/shm")
        ckpt, sock = os.path.join(work, "ck"), os.path.join(work, "sock")
        subprocess.run([binary(args.build, "tools/engram-mkckpt"), "--out", ckpt, "--table-mib", str(mib),
                        "--layers", "1,14", "--heads", "8", "--max-ngram", "4", "--shards", "2"], check=True,
                       stdout=subprocess.DEVNULL)
        d, publish = start_daemon(args.build, ckpt, shm, sock, os.path.join(work, "engramd.log"))
        print(f"table {mib} MiB: engramd published in {publish:.2f} s")
        try:
            ev._state["attachments"].clear()
            theirs, layout, t_own = ready_table(vm, ckpt, sock, True, max_tokens)
            ours, _, t_plugin = ready_table(vm, ckpt, sock, False, max_tokens)
            mode2, reg2, t2 = ("-", 0.0, 0.0) if args.no_ready else attach_in_new_process(ckpt, sock, max_tokens)
            att = next(a for a in ev._state["attachments"].values() if isinstance(a, ev.embedding.Attachment))
            print(f"ready table {mib} MiB: vllm_pinned_load_s {t_own:.3f} plugin_attach_s {t_plugin:.3f} "
                  f"(register {att.table.register_seconds:.3f}) second_engine_s {t2:.3f} (mode {mode2}, register "
                  f"{reg2:.3f}) ratio {t_own / t_plugin:.2f}")
            part, D = theirs[0].part_n_hash_cols, theirs[0].dim
            RB = D + D // 32
            for T in tokens:
                sets = ids_for(layout, T, max(8, 4 * args.per_graph) if T <= 64 else 8, seed=T)
                kw = packed_kw(vm, theirs[0])
                for packed in (False, True) if kw is not None else (False,):
                    for graph in (False, True):
                        shape = (T, part, RB) if packed else (T, part, D)
                        dt = torch.uint8 if packed else torch.bfloat16
                        o1, o2 = torch.empty(shape, dtype=dt, device="cuda"), torch.empty(shape, dtype=dt,
                                                                                          device="cuda")
                        pk = dict(kw if packed else {})
                        if args.background:
                            pk["background"] = True
                        tv = time_lookup(theirs[0], sets, o1, graph, args.iters, pk, args.per_graph)
                        to = time_lookup(ours[0], sets, o2, graph, args.iters, pk, args.per_graph)
                        theirs[0].lookup(sets[0][:, 0, :], o1, **pk)
                        ours[0].lookup(sets[0][:, 0, :], o2, **pk)
                        torch.cuda.synchronize()
                        same = torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))
                        print(f"lookup table_mib {mib} tokens {T} out {'packed' if packed else 'bf16'} "
                              f"{'background ' if args.background else ''}"
                              f"{f'graph x{args.per_graph}' if graph else 'eager'}: vllm_us {tv:.1f} ours_us {to:.1f} "
                              f"ratio {tv / to:.2f} equal {same}")
            del theirs, ours
            ev._state["attachments"].clear()
            torch.cuda.empty_cache()
        finally:
            d.terminate()
            d.wait()
            subprocess.run(["rm", "-rf", work, shm])


if __name__ == "__main__":
    main()
