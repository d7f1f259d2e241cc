"""engram.vllm on the GPU against every stored vLLM layout it serves (vllm_stubs.VERSIONS, the commits in the test
ids: loaded from ENGRAM_VLLM_SRC with stand-ins of the vllm.* modules they import), the layer built by the model's
own Engram class as the DeepSeek-V4.1 model builds it: the rows the plugin's lookup writes equal, bit for bit,
those of vLLM's own Triton kernel on vLLM's own pinned table filled by vLLM's own weight loader, for ids including
-1 and ids outside the TP shard, TP 1 and both ranks of TP 2 (a column window), bf16 and packed (vLLM's packed
batch at its token stride), eagerly, under torch.cuda.graph capture and replay, and through the layer's own
prefetch on vLLM's side stream; a checkpoint other than the served one fails the load; engramd down keeps vLLM's
own storage (or fails when required); and our hash equals vLLM's _hash_ids_kernel (through its NgramHashState and
its own token map) where lookbacks have unknown ids. Skipped, with the reason, without torch >= 2.4 and a GPU,
triton, or a version's files under ENGRAM_VLLM_SRC."""
import inspect
import logging
import os
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

import engram
import engram.vllm as ev
import vllm_stubs
from vllm_stubs import no_dp_shm
from conftest import v41_like_checkpoint, Daemon, binary, embed_tensors, torch_cuda

torch = torch_cuda()
if torch is None:
    pytest.skip("needs torch >= 2.4 with a CUDA GPU (the GPU machine runs these)", allow_module_level=True)
try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("vLLM's Engram kernels need triton", allow_module_level=True)
SRC, WHY = vllm_stubs.src_root_or_skip_reason()
if SRC is None:
    pytest.skip(WHY, allow_module_level=True)

MAX_TOKENS = 4096
SERVED = [v for v, _ in vllm_stubs.available_versions() if v.served]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # V4.1's column geometry (n-grams up to 4, 8 heads: 24 hash columns, head_dim 256) on a small table.
    d = tmp_path_factory.mktemp("vllm-ckpt")
    return v41_like_checkpoint(str(d / "ck"), 11)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-other")
    return v41_like_checkpoint(str(d / "ck"), 12)


class TpDaemon(Daemon):
    """engramd serving TP 1 and TP 2 segments of one checkpoint."""

    def __init__(self, ckpt, root):  # noqa: super().__init__ would start an engramd of TP 1 only
        import tempfile
        self.shm = tempfile.mkdtemp(prefix="engram-pytest-", dir="/dev/shm")
        self.socket = os.path.join(root, "engramd.sock")
        self.log = os.path.join(root, "engramd.log")
        self.proc = subprocess.Popen([binary("daemon/engramd"), "--checkpoint", ckpt, "--tp", "1,2", "--shm-dir",
                                      self.shm, "--socket", self.socket], stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    d = TpDaemon(ckpt, str(tmp_path_factory.mktemp("vllm-daemon")))
    try:
        d.wait_ready(engram)
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module", params=SERVED, ids=lambda v: v.tag)
def mod(request, tmp_path_factory):
    """A served version's real modules with the plugin installed into each of its Engram modules."""
    why = vllm_stubs.missing_files(request.param)
    if why:
        pytest.skip(why)
    vm = vllm_stubs.load_version(request.param, str(tmp_path_factory.mktemp("vllm-version")))
    ev.uninstall()
    for s in ev.layouts.find(lambda name, e: pytest.fail(f"{name}: {e}")):
        ev.install(s)
    yield vm
    ev.uninstall()


def make(vm, ckpt, socket, tp, li, *, require=False, own=False):
    """(embedding, layout, layer) for layer index li at TP (size, rank), the layer built by the model's own Engram
    class: the plugin's table when own is False, else vLLM's own."""
    vllm_stubs.STATE.tp = tp
    extra = {} if own else {"engram": {"socket": socket, "require": require, "timeout_ms": 3000}}
    vllm_stubs.STATE.config = vllm_stubs.make_vllm_config(ckpt, additional_config=extra, max_tokens=MAX_TOKENS,
                                                          engram_fields=vm.engram_fields, **no_dp_shm(vm))
    with torch.device("cuda"):
        layer, layout = vm.build_layer(ckpt, li)
    return layer.embed_tokens, layout, layer


def packed_kw(vm, emb):
    """How a version's lookup is asked for packed records: {"packed": True}, {} (it reads the out's dtype), or
    None (its kernel writes bf16 rows only)."""
    if "packed" in inspect.signature(type(emb).lookup).parameters:
        return {"packed": True}
    return {} if vm.version.tag.startswith("merged") else None


tensors = embed_tensors


def load(emb, ckpt, layout, li):
    t = tensors(ckpt, layout.layer_ids[li])
    emb.weight.weight_loader(emb.weight, t["weight"])
    emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, t["scale"])


def random_ids(layout, li, T, seed):
    """[T, layers, cols] int32 on the GPU: each column's ids in its own bucket range, some ids of the whole layer
    range (other columns' rows: outside the TP shard for a TP rank), -1 and ids past the table."""
    rng = np.random.default_rng(seed)
    L, C = len(layout.layer_ids), layout.n_hash_cols
    primes = [p for order in layout.primes[li] for p in order]
    offsets = layout.offsets[li].tolist()
    ids = np.empty((T, L, C), np.int64)
    for c in range(C):
        ids[:, :, c] = offsets[c] + rng.integers(0, primes[c], size=(T, L))
    rows = offsets[-1] + primes[-1]
    k = max(1, T * C // 8)
    t_idx, c_idx = rng.integers(0, T, k), rng.integers(0, C, k)
    ids[t_idx, li, c_idx] = rng.integers(0, rows, k)
    ids[rng.integers(0, T, k), li, rng.integers(0, C, k)] = -1
    ids[rng.integers(0, T, k), li, rng.integers(0, C, k)] = rows + rng.integers(0, 1000, k)
    return torch.from_numpy(ids.astype(np.int32)).cuda()


TPS = [(1, 0), (2, 0), (2, 1)]


@pytest.mark.parametrize("tp", TPS)
def test_rows_equal_vllms_own_kernel_on_vllms_own_table(mod, ckpt, served, tp, caplog):
    for li in (0, 1):
        with caplog.at_level(logging.INFO, logger="vllm.engram"):
            ours, layout, _ = make(mod, ckpt, served.socket, tp, li)
        assert type(ours).__name__ == "EngramdEmbedding", caplog.text
        theirs, _, _ = make(mod, ckpt, served.socket, tp, li, own=True)
        assert type(theirs) is mod.model_module.ParallelEngramEmbedding
        assert ours.weight.untyped_storage().nbytes() <= ours.dim, "vLLM must allocate no table for the plugin"
        load(ours, ckpt, layout, li)
        load(theirs, ckpt, layout, li)
        part, D = theirs.part_n_hash_cols, theirs.dim
        L = len(layout.layer_ids)
        for T in (1, 4, 64, 1024, MAX_TOKENS):
            ids = random_ids(layout, li, T, seed=T * 7 + li)[:, li, :]  # vLLM's per-layer view: row stride L * C
            want = torch.empty((T, part, D), dtype=torch.bfloat16, device="cuda")
            theirs.lookup(ids, want)
            got = torch.full((T, part, D), float("nan"), dtype=torch.bfloat16, device="cuda")
            ours.lookup(ids, got)
            torch.cuda.synchronize()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tp, li, T)
            # Packed, into vLLM's batch layout [T, L, part, 264] at one layer (a token stride of L * part * 264).
            pk = packed_kw(mod, theirs)
            if pk is None:
                continue
            RB = D + D // 32
            # vLLM's own records into a contiguous out (not every version's kernel honours an out's strides);
            # ours into the batch layout at its token stride.
            want_p = torch.zeros((T, part, RB), dtype=torch.uint8, device="cuda")
            theirs.lookup(ids, want_p, **pk)
            got_p = torch.full((T, L, part, RB), 0xA5, dtype=torch.uint8, device="cuda")
            ours.lookup(ids, got_p[:, li], background=True, **pk)
            torch.cuda.synchronize()
            assert torch.equal(got_p[:, li], want_p), (tp, li, T, "packed")
            assert bool((got_p[:, 1 - li] == 0xA5).all()), "the other layer's slots must stay untouched"
    assert "event=attached layout=" in caplog.text and "mode=SHARED backend=cuda" in caplog.text, caplog.text


def test_cuda_graph_capture_and_replay_with_new_ids(mod, ckpt, served):
    ours, layout, _ = make(mod, ckpt, served.socket, (1, 0), 0)
    theirs, _, _ = make(mod, ckpt, served.socket, (1, 0), 0, own=True)
    load(ours, ckpt, layout, 0)
    load(theirs, ckpt, layout, 0)
    for T in (1, 64, 2048):
        static_ids = random_ids(layout, 0, T, seed=1)[:, 0, :].contiguous()
        out = torch.zeros((T, ours.part_n_hash_cols, ours.dim), dtype=torch.bfloat16, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ours.lookup(static_ids, out)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ours.lookup(static_ids, out)
        for seed in (2, 3):
            static_ids.copy_(random_ids(layout, 0, T, seed=seed)[:, 0, :])
            out.fill_(float("nan"))
            g.replay()
            want = torch.empty_like(out)
            theirs.lookup(static_ids, want)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (T, seed)


def test_through_the_layers_own_prefetch_on_vllms_side_stream(mod, ckpt, served):
    ours, layout, layer = make(mod, ckpt, served.socket, (1, 0), 1)
    theirs, _, _ = make(mod, ckpt, served.socket, (1, 0), 1, own=True)
    load(ours, ckpt, layout, 1)
    load(theirs, ckpt, layout, 1)
    if mod.nvidia is not None:
        assert layer._prefetch_stream is not None, "an offloaded table prefetches on vLLM's side stream"
    for T in (3, 512):
        ids = random_ids(layout, 1, T, seed=T)[:, 1, :]
        layer.staged_rows.fill_(float("nan"))
        layer.prepare_embeddings(ids)
        rows = layer._ready_rows(T)
        want = torch.empty_like(rows)
        theirs.lookup(ids, want)
        torch.cuda.synchronize()
        assert torch.equal(rows.view(torch.int16), want.view(torch.int16)), T


def test_a_checkpoint_other_than_the_served_one_fails_the_load(mod, ckpt, other_ckpt, served):
    ours, layout, _ = make(mod, ckpt, served.socket, (1, 0), 0)
    t = tensors(other_ckpt, layout.layer_ids[0])
    with pytest.raises(RuntimeError, match="not the one engramd serves") as e:
        ours.weight.weight_loader(ours.weight, t["weight"])
    assert ckpt in str(e.value)
    ours.weight.weight_loader(ours.weight, tensors(ckpt, layout.layer_ids[0])["weight"])  # the served one loads


def test_engramd_down_keeps_vllms_own_storage_or_fails_when_required(mod, ckpt, tmp_path, caplog):
    sock = str(tmp_path / "none.sock")
    ev._state["attachments"].clear()
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        emb, layout, _ = make(mod, ckpt, sock, (1, 0), 0)
    assert type(emb) is mod.model_module.ParallelEngramEmbedding
    assert "DAEMON_UNAVAILABLE" in caplog.text and "vLLM keeps its own" in caplog.text
    load(emb, ckpt, layout, 0)  # vLLM's own pinned table, loaded by vLLM's own loader
    ev._state["attachments"].clear()
    with pytest.raises(RuntimeError, match="require is true"):
        make(mod, ckpt, sock, (1, 0), 0, require=True)
    ev._state["attachments"].clear()


def test_our_hash_equals_vllms_hash_kernel_where_lookbacks_have_unknown_ids(mod, ckpt, served):
    vcfg = vllm_stubs.make_vllm_config(ckpt)
    vcfg.use_v2_model_runner = True  # no slot cache: unknown lookback ids hash as pad
    vcfg.model_config.tokenizer = ckpt
    vcfg.model_config.trust_remote_code = False
    layout = mod.layout(ckpt)
    with torch.device("cuda"):
        hasher = mod.common.NgramHashState(vcfg, layout, SimpleNamespace(block_size=16, kv_cache=None)).cuda()
    t = engram.attach(ckpt, socket=served.socket)
    eng = t.engine(MAX_TOKENS)
    rng = np.random.default_rng(5)
    N = layout.max_ngram_size
    lens = [1, 5, 17, 300, 64, 2]
    R, T = len(lens), sum(lens)
    tokens = rng.integers(0, t.layout.raw_vocab, T).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    starts = rng.integers(0, 50, R)
    starts[1] = 0  # a request from position 0 (no lookback)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.int64)
    lookback = rng.integers(0, t.layout.raw_vocab, (R, N - 1)).astype(np.int32)  # ours: oldest first
    lookback[rng.random((R, N - 1)) < 0.4] = -1
    lookback[2, -1] = -1  # an unknown id newer than known ones
    lookback[3, 0] = -1
    dead = (rng.random(T) < 0.05)
    g = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    want = hasher(g(tokens), g(positions), g(qsl), g(dead), g(lookback[:, ::-1]),  # vLLM's: newest first
                  torch.zeros((R, N - 1), dtype=torch.bool, device="cuda"), None, None)
    got = eng.hash(g(tokens), g(positions), g(qsl), lookback=g(lookback), dead=g(dead.astype(np.uint8)))
    torch.cuda.synchronize()
    assert torch.equal(got, want), int((got != want).sum())
    eng.close()
    t.close()
