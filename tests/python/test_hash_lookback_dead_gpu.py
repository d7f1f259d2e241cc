"""Engine.hash with a lookback dead mask on the CUDA backend: equal to the independent reference (spec_reference.py)
on fresh random batches (flags on known and unknown lookback ids, DEAD spans, requests near position 0) with poisoned
outputs, bool and uint8 masks; and, where ENGRAM_VLLM_SRC holds vLLM's Engram module (with triton), equal to vLLM's
own _hash_ids_kernel through its NgramHashState (its lookback window and mask are newest first: ours reversed along
the last axis). Skipped, with the reason, without torch >= 2.4 and a GPU; the vLLM comparison also without triton or
ENGRAM_VLLM_SRC."""
from types import SimpleNamespace

import numpy as np
import pytest

import engram
import vllm_stubs
from conftest import v41_like_checkpoint, torch_cuda
from engram_layer import random_batch

torch = torch_cuda()
if torch is None:
    pytest.skip("needs torch >= 2.4 with a CUDA GPU (the GPU machine runs these)", allow_module_level=True)

POISON = -123456


def on_gpu(a):
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def attach_private(ckpt, tmp_path_factory, name):
    sock = str(tmp_path_factory.mktemp(name) / "none.sock")
    return engram.attach(ckpt, socket=sock, timeout_ms=300)


@pytest.fixture(scope="module")
def table(checkpoint, tmp_path_factory):
    t = attach_private(checkpoint, tmp_path_factory, "lbdead-gpu")
    assert t.backend == "cuda", t.backend
    yield t
    t.close()


@pytest.mark.parametrize("mask_dtype", ["uint8", "bool"])
def test_cuda_hash_equals_the_reference_with_dead_lookback_ids(table, reference, mask_dtype):
    eng = table.engine(512)
    differs = 0
    for _ in range(3):
        seed = np.random.SeedSequence().entropy
        rng = np.random.default_rng(seed)
        lens = [1, 5, 17, 2, 40, 3, 9]
        tokens, positions, qsl, lookback, dead = random_batch(rng, len(reference.tmap), lens, reference.N,
                                                              dead_frac=0.1, start_max=8)
        lookback[rng.random(lookback.shape) < 0.3] = -1
        lookback_dead = rng.random(lookback.shape) < 0.5
        T = len(tokens)
        out = torch.full((T, len(reference.layer_ids), reference.C), POISON, dtype=torch.int32, device="cuda")
        mask = on_gpu(lookback_dead.astype(np.uint8))
        if mask_dtype == "bool":
            mask = mask.bool()
        got = eng.hash(on_gpu(tokens), on_gpu(positions), on_gpu(qsl), lookback=on_gpu(lookback),
                       dead=on_gpu(dead), lookback_dead=mask, out=out)
        assert got is out
        torch.cuda.synchronize()
        want = reference.hash(tokens, positions, qsl, lookback, dead, lookback_dead)
        np.testing.assert_array_equal(out.cpu().numpy(), want, err_msg=f"seed {seed}")
        differs += not np.array_equal(want, reference.hash(tokens, positions, qsl, lookback, dead))
    assert differs > 0  # the flags changed the ids of some batch
    # A host mask for a CUDA engine, and a mask without lookback ids, are refused before the launch.
    tokens, positions, qsl = on_gpu(np.arange(4, dtype=np.int32)), on_gpu(np.arange(9, 13)), on_gpu(
        np.array([0, 4], np.int32))
    lb = on_gpu(np.full((1, reference.N - 1), 3, np.int32))
    with pytest.raises(ValueError, match="lookback_dead: on cpu"):
        eng.hash(tokens, positions, qsl, lookback=lb, lookback_dead=np.zeros((1, reference.N - 1), np.uint8))
    with pytest.raises(ValueError, match="lookback_dead: needs lookback"):
        eng.hash(tokens, positions, qsl, lookback_dead=on_gpu(np.zeros((1, reference.N - 1), np.uint8)))
    eng.close()


# ---- vLLM's own kernel --------------------------------------------------------------------------------------------
def _vllm_or_skip():
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("vLLM's Engram kernels need triton")
    src, why = vllm_stubs.src_dir_or_skip_reason()
    if src is None:
        pytest.skip(why)
    return src


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory):
    # V4.1's column geometry (n-grams up to 4, 8 heads: 24 hash columns) on a small table, with its tokenizer.
    return v41_like_checkpoint(str(tmp_path_factory.mktemp("lbdead-vllm") / "ck"), 11)


def test_cuda_hash_equals_vllms_hash_kernel_with_dead_lookback_ids(v41_ckpt, tmp_path_factory):
    mod = vllm_stubs.load_engram_module(_vllm_or_skip())
    vcfg = vllm_stubs.make_vllm_config(v41_ckpt)
    vcfg.use_v2_model_runner = True  # no slot cache: an unknown lookback id hashes as pad
    vcfg.model_config.tokenizer = v41_ckpt
    vcfg.model_config.trust_remote_code = False
    layout = mod.EngramLayout.from_config(vllm_stubs.hf_config(v41_ckpt))
    with torch.device("cuda"):
        hasher = mod.NgramHashState(vcfg, layout, SimpleNamespace(block_size=16, kv_cache=None)).cuda()
    t = attach_private(v41_ckpt, tmp_path_factory, "lbdead-vllm-attach")
    eng = t.engine(1024)
    N = layout.max_ngram_size
    assert N == t.layout.max_ngram
    for trial in range(4):
        seed = np.random.SeedSequence().entropy
        rng = np.random.default_rng(seed)
        lens = [1, 5, 17, 300, 64, 2, 3, 40]
        R, T = len(lens), sum(lens)
        tokens = rng.integers(0, t.layout.raw_vocab, T).astype(np.int32)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        starts = rng.integers(0, 50, R)
        starts[1], starts[5] = 0, 1  # a request from position 0 (no lookback), one from position 1
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.int64)
        lookback = rng.integers(0, t.layout.raw_vocab, (R, N - 1)).astype(np.int32)  # ours: oldest first
        lookback[rng.random((R, N - 1)) < 0.3] = -1
        lookback_dead = rng.random((R, N - 1)) < 0.5
        # Every combination in every column: known and dead, known and alive, unknown with its flag set.
        lookback[2], lookback_dead[2] = tokens[:N - 1], True
        lookback[3], lookback_dead[3] = tokens[:N - 1], False
        lookback[4], lookback_dead[4] = -1, True
        lookback[6, -1], lookback_dead[6, -1] = 7, True
        lookback[7, 0], lookback_dead[7, 0] = -1, True
        dead = rng.random(T) < 0.05
        want = hasher(on_gpu(tokens), on_gpu(positions), on_gpu(qsl), on_gpu(dead),
                      on_gpu(lookback[:, ::-1]), on_gpu(lookback_dead[:, ::-1]), None, None)  # vLLM's: newest first
        out = torch.full((T, len(t.layout.layers), t.layout.n_cols), POISON, dtype=torch.int32, device="cuda")
        got = eng.hash(on_gpu(tokens), on_gpu(positions), on_gpu(qsl), lookback=on_gpu(lookback),
                       dead=on_gpu(dead.astype(np.uint8)), lookback_dead=on_gpu(lookback_dead), out=out)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"seed {seed}: {int((got != want).sum())} ids differ"
        # The same batch with the mask cleared is vLLM's with its mask cleared, and differs (the flags were read).
        plain = eng.hash(on_gpu(tokens), on_gpu(positions), on_gpu(qsl), lookback=on_gpu(lookback),
                         dead=on_gpu(dead.astype(np.uint8)))
        torch.cuda.synchronize()
        assert not torch.equal(plain, got), f"seed {seed}"
    eng.close()
    t.close()
