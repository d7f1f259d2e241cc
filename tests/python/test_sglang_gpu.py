"""engram.sglang on the GPU against SGLang's own Engram module at each SGLang commit ENGRAM_SGLANG_SRC holds (one tree,
or one per commit; stand-ins of the sglang.* modules it imports, sglang_stubs.py): SGLang's forward through the
plugin equals, bit for bit, SGLang's own Triton gather (its engram_gather.py, from the commit's tree or another of
the directory) on its own shared host table (memfd, pinned) filled by its own loader, for int64 ids including -1,
ids past the table and batches larger than one engine call, eagerly and under torch.cuda.graph capture and replay;
another checkpoint fails the load; engramd down keeps SGLang's own storage (or fails when required). A commit the
plugin refuses (test_sglang_plugin.py) skips here with the reason. Skipped, with the reason, without torch >= 2.4
and a GPU, triton, SGLang's gather kernel, or ENGRAM_SGLANG_SRC."""
import json
import logging
import os
import sys

import numpy as np
import pytest

import engram.sglang as es
import sglang_stubs
from conftest import v41_like_checkpoint, Daemon, embed_tensors, torch_cuda

torch = torch_cuda()
if torch is None:
    pytest.skip("needs torch >= 2.4 with a CUDA GPU (the GPU machine runs these)", allow_module_level=True)
try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("SGLang's Engram gather needs triton", allow_module_level=True)
if sglang_stubs.skip_reason():
    pytest.skip(sglang_stubs.skip_reason(), allow_module_level=True)
COMMITS = sglang_stubs.sources()

# SGLang's own host tables are registered with CUDA and never unregistered (its _HostTable keeps them for the
# process's life): they are kept alive here, so that no later mapping of this test process reuses their addresses
# (CUDA would call such a range registered already).
_KEEP = []


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang-ckpt")
    return v41_like_checkpoint(str(d / "ck"), 21)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang-other")
    return v41_like_checkpoint(str(d / "ck"), 22)


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    import engram
    d = Daemon(ckpt, str(tmp_path_factory.mktemp("sglang-daemon")))
    try:
        d.wait_ready(engram)
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module", params=[src for _, src in COMMITS], ids=[c for c, _ in COMMITS])
def mod(request):
    src = request.param
    if sglang_stubs.kernel_file(src, "engram_gather") is None:
        pytest.skip(f"ENGRAM_SGLANG_SRC has no {sglang_stubs.KERNELS}/engram_gather.py (SGLang's gather, the "
                    f"oracle) for {sglang_stubs.commit_of(src)} or another commit")
    m = sglang_stubs.load_engram_module(src)
    problems = es.check_surface(m)
    if problems:
        pytest.skip(f"the plugin refuses SGLang {sglang_stubs.commit_of(src)} ({'; '.join(problems)}): nothing to "
                    "serve on the GPU (test_sglang_plugin.py tests the refusal)")
    es.uninstall()
    es.install(m)
    yield m
    es.uninstall()
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def config(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)


tensors = embed_tensors


def build(mod, ckpt, li, monkeypatch, socket=None, own=False, require=False):
    """Layer index li's embedding: SGLang's own on its shared host table (own), else through the plugin."""
    cfg = config(ckpt)
    sglang_stubs.STATE.model.model_path = ckpt
    sglang_stubs.STATE.env = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": True,
                              "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "shared"}
    for k in ("ENGRAM_SGLANG_SOCKET", "ENGRAM_SGLANG_REQUIRE", "ENGRAM_SGLANG_TIMEOUT_MS"):
        monkeypatch.delenv(k, raising=False)
    if not own:
        monkeypatch.setenv("ENGRAM_SGLANG_SOCKET", socket)
        monkeypatch.setenv("ENGRAM_SGLANG_TIMEOUT_MS", "3000")
        if require:
            monkeypatch.setenv("ENGRAM_SGLANG_REQUIRE", "1")
    layer_id = cfg["engram_layer_ids"][li]
    emb = mod.EngramEmbedding(cfg["engram_num_embeddings"][li], cfg["engram_head_dim"], layer_id)
    if emb._engramd is None:
        _KEEP.append(emb)
    return emb, layer_id


def load(emb, ckpt, layer_id):
    t = tensors(ckpt, layer_id)
    emb.weight.weight_loader(emb.weight, t["weight"])
    emb.scale.weight_loader(emb.scale, t["scale"])
    emb.finish_load("test")


def ids(ckpt, li, T, seed):
    """int64 [T, cols] rows of the table, some -1 (SGLang's gather reads any id it is given below 2^62: it is given
    none past the table, as its hasher makes none; ours gives zero rows for those, test_lookup_into.py)."""
    cfg = config(ckpt)
    rng = np.random.default_rng(seed)
    rows = cfg["engram_num_embeddings"][li]
    C = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    a = rng.integers(0, rows, size=(T, C)).astype(np.int64)
    k = max(1, T * C // 10)
    a[rng.integers(0, T, k), rng.integers(0, C, k)] = -1
    return torch.from_numpy(a).cuda()


def test_rows_equal_sglangs_own_gather_on_its_own_table(mod, ckpt, served, monkeypatch, caplog):
    for li in (0, 1):
        with caplog.at_level(logging.INFO, logger="sglang.engram"):
            ours, layer_id = build(mod, ckpt, li, monkeypatch, socket=served.socket)
        assert type(ours).__name__ == "EngramdEmbedding" and ours._engramd is not None, caplog.text
        theirs, _ = build(mod, ckpt, li, monkeypatch, own=True)
        assert theirs._engramd is None and theirs.host_table is not None
        assert ours.weight.untyped_storage().nbytes() <= ours.dim, "SGLang must allocate no table for the plugin"
        load(ours, ckpt, layer_id)
        load(theirs, ckpt, layer_id)
        for T in (1, 7, 64, 1024, 8192):  # 8192 x 24 ids: more than one engine call
            x = ids(ckpt, li, T, seed=T + 100 * li)
            want = theirs(x)
            got = ours(x)
            torch.cuda.synchronize()
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (li, T)
    assert "event=attached mode=SHARED backend=cuda" in caplog.text, caplog.text


def test_cuda_graph_capture_and_replay(mod, ckpt, served, monkeypatch):
    ours, layer_id = build(mod, ckpt, 0, monkeypatch, socket=served.socket)
    theirs, _ = build(mod, ckpt, 0, monkeypatch, own=True)
    load(ours, ckpt, layer_id)
    load(theirs, ckpt, layer_id)
    for T in (1, 64, 2048):
        static = ids(ckpt, 0, T, seed=1).contiguous()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ours(static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = ours(static)
        for seed in (2, 3):
            static.copy_(ids(ckpt, 0, T, seed=seed))
            g.replay()
            want = theirs(static)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (T, seed)


def test_another_checkpoint_fails_the_load(mod, ckpt, other_ckpt, served, monkeypatch):
    ours, layer_id = build(mod, ckpt, 0, monkeypatch, socket=served.socket)
    with pytest.raises(RuntimeError, match="not the one engramd serves"):
        ours.weight.weight_loader(ours.weight, tensors(other_ckpt, layer_id)["weight"])


def test_engramd_down_keeps_sglangs_storage_or_fails_when_required(mod, ckpt, tmp_path, monkeypatch, caplog):
    es._state["attachment"] = None
    sock = str(tmp_path / "none.sock")
    with caplog.at_level(logging.WARNING, logger="sglang.engram"):
        emb, layer_id = build(mod, ckpt, 0, monkeypatch, socket=sock)
    assert emb._engramd is None and emb.host_table is not None
    assert "DAEMON_UNAVAILABLE" in caplog.text and "SGLang keeps its own" in caplog.text
    load(emb, ckpt, layer_id)
    es._state["attachment"] = None
    with pytest.raises(RuntimeError, match="ENGRAM_SGLANG_REQUIRE"):
        build(mod, ckpt, 0, monkeypatch, socket=sock, require=True)
    es._state["attachment"] = None
