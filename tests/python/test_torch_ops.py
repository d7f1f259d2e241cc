"""engram.torch: the custom ops (torch >= 2.4) on a CUDA table: equal to the Engine's calls, fake implementations
under FakeTensorMode, out-variants, CUDA-graph capture and replay (fixed staging addresses, new tokens per replay),
and torch.compile of the example layer against its eager result. Skipped, with the reason, without torch >= 2.4 or
a GPU (Debian's torch is 1.13)."""
import numpy as np
import pytest

import engram
from conftest import torch_cuda
from engram_layer import EngramLayer, EngramStep, random_batch

torch = torch_cuda()
if torch is None:
    pytest.skip("engram.torch needs torch >= 2.4 with a CUDA GPU (Debian's torch is 1.13; the GPU machine runs these)",
                allow_module_level=True)
import engram.torch as et  # noqa: E402


@pytest.fixture(scope="module")
def table(checkpoint, tmp_path_factory):
    t = engram.attach(checkpoint, socket=str(tmp_path_factory.mktemp("ops") / "none.sock"), timeout_ms=300)
    assert t.backend == "cuda", t.reasons
    yield t


def inputs(reference_like_layout, seed, lens):
    rng = np.random.default_rng(seed)
    lay = reference_like_layout
    tok, pos, qsl, lb, dead = random_batch(rng, lay.raw_vocab, lens, lay.max_ngram, 0.15)
    return [torch.from_numpy(x).cuda() for x in (tok, pos, qsl, lb, dead)]


def test_ops_equal_the_engine_calls(table):
    eng = table.engine(64)
    eid = et.register(eng)
    tok, pos, qsl, lb, dead = inputs(table.layout, 1, [9, 4, 11])
    ids = torch.ops.engram.hash(eid, tok, pos, qsl, lb, dead)
    want = eng.hash(tok, pos, qsl, lookback=lb, dead=dead)
    assert torch.equal(ids, want)
    out = torch.empty_like(ids)
    torch.ops.engram.hash_out(eid, tok, pos, qsl, lb, dead, out)
    assert torch.equal(out, want)
    # The lookback's DEAD ids: the ops pass the mask through as the engine's call takes it.
    lbd = torch.from_numpy(np.random.default_rng(2).random(tuple(lb.shape)) < 0.5).cuda()
    with_dead = eng.hash(tok, pos, qsl, lookback=lb, dead=dead, lookback_dead=lbd)
    assert torch.equal(torch.ops.engram.hash(eid, tok, pos, qsl, lb, dead, lbd), with_dead)
    out.fill_(-7)
    torch.ops.engram.hash_out(eid, tok, pos, qsl, lb, dead, out, lbd)
    assert torch.equal(out, with_dead)
    ticket = torch.ops.engram.prefetch(eid, ids)
    for l in range(len(table.layout.layers)):
        rows = torch.ops.engram.wait_rows(eid, l, ids, ticket)
        direct = torch.ops.engram.lookup(eid, l, ids[:, l, :], False)
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, direct)
        packed = torch.ops.engram.lookup(eid, l, ids[:, l, :], True)
        assert packed.shape[-1] == table.layout.record_bytes
    et.unregister(eid)


def test_fake_impls_give_shapes_without_touching_the_table(table):
    from torch._subclasses.fake_tensor import FakeTensorMode
    eng = table.engine(64)
    eid = et.register(eng)
    L, C, D = len(table.layout.layers), table.layout.n_cols, table.layout.head_dim
    with FakeTensorMode():
        tok = torch.empty(10, dtype=torch.int32, device="cuda")
        pos = torch.empty(10, dtype=torch.int64, device="cuda")
        qsl = torch.empty(3, dtype=torch.int32, device="cuda")
        ids = torch.ops.engram.hash(eid, tok, pos, qsl, None, None)
        assert ids.shape == (10, L, C) and ids.dtype == torch.int32
        t = torch.ops.engram.prefetch(eid, ids)
        rows = torch.ops.engram.wait_rows(eid, 0, ids, t)
        assert rows.shape == (10, C, D) and rows.dtype == torch.bfloat16


def test_cuda_graph_capture_and_replay(table):
    eng = table.engine(32)
    eid = et.register(eng)
    lay = table.layout
    T = 24
    static = [x.clone() for x in inputs(lay, 2, [10, 14])]
    ids_buf = torch.empty((T, len(lay.layers), lay.n_cols), dtype=torch.int32, device="cuda")
    rows_buf = torch.empty((T, lay.n_cols, lay.head_dim), dtype=torch.bfloat16, device="cuda")

    def step():
        torch.ops.engram.hash_out(eid, *static, ids_buf)
        t = torch.ops.engram.prefetch(eid, ids_buf)
        for l in range(len(lay.layers)):
            torch.ops.engram.wait_rows_out(eid, l, t, rows_buf if l == 0 else rows_buf.clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in (3, 4, 5):
        fresh = inputs(lay, seed, [10, 14])
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        want_ids = eng.hash(*static[:3], lookback=static[3], dead=static[4])
        assert torch.equal(ids_buf, want_ids)
        want_rows = torch.empty_like(rows_buf)
        eng.lookup(0, want_ids[:, 0, :], want_rows)
        torch.cuda.synchronize()
        assert torch.equal(rows_buf, want_rows)


def test_torch_compile_of_the_example_layer_equals_eager(table, checkpoint):
    step = EngramStep(table, 64)
    assert step.use_ops
    layers = [EngramLayer(step, checkpoint, i) for i in range(len(table.layout.layers))]
    lay = table.layout
    rng = np.random.default_rng(8)

    def forward(tok, pos, qsl, lb, dead, hidden):
        ids = step.begin(tok, pos, qsl, lb, dead)
        h = hidden
        for layer in layers:
            h = layer(h, ids, dead)
        return h

    compiled = torch.compile(forward, fullgraph=True)
    for seed in (11, 12):
        tok, pos, qsl, lb, dead = inputs(lay, seed, [8, 8])
        hidden = torch.from_numpy(rng.standard_normal((16, lay.hc_mult, lay.hidden_size)).astype(np.float32)).cuda()
        hidden = hidden.to(torch.bfloat16)
        eager = forward(tok, pos, qsl, lb, dead, hidden)
        got = compiled(tok, pos, qsl, lb, dead, hidden)
        torch.cuda.synchronize()
        assert torch.equal(got, eager)


def test_wrong_device_and_dtype_are_refused(table):
    eng = table.engine(8)
    with pytest.raises(ValueError, match="on cpu, but this engine runs on CUDA"):
        eng.hash(torch.zeros(4, dtype=torch.int32), torch.arange(4, device="cuda"),
                 torch.tensor([0, 4], dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match="dtype float32"):
        eng.hash(torch.zeros(4, device="cuda"), torch.arange(4, device="cuda"),
                 torch.tensor([0, 4], dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="sized for 8"):
        eng.hash(torch.zeros(9, dtype=torch.int32, device="cuda"), torch.arange(9, device="cuda"),
                 torch.tensor([0, 9], dtype=torch.int32, device="cuda"))
