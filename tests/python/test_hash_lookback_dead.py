"""Engine.hash with a lookback dead mask on the CPU backend (docs/math.md section 5): equal to the independent
reference (spec_reference.py) on fresh random batches with poisoned outputs, on every combination of a lookback id
(known and dead, known and alive, unknown with its flag set), and to the whole request hashed in one piece when a chunk's
lookback carries the request's own tokens and dead flags; every wrong mask is a TypeError or ValueError that writes
nothing."""
import numpy as np
import pytest

import engram
from engram_layer import random_batch

POISON = -123456


@pytest.fixture(scope="module")
def eng(checkpoint, tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("lbdead") / "none.sock")
    t = engram.attach(checkpoint, socket=sock, timeout_ms=300, backend="cpu")
    e = t.engine(128)
    yield e
    e.close()
    t.close()


def poisoned(T, reference):
    return np.full((T, len(reference.layer_ids), reference.C), POISON, dtype=np.int32)


def fresh_rng():
    seed = np.random.SeedSequence().entropy
    return seed, np.random.default_rng(seed)


@pytest.mark.parametrize("mask_dtype", [np.uint8, bool])
def test_equals_the_reference_on_fresh_random_batches(eng, reference, mask_dtype):
    differs = 0
    for _ in range(4):
        seed, rng = fresh_rng()
        tokens, positions, qsl, lookback, dead = random_batch(rng, len(reference.tmap), [5, 1, 9, 3, 12], reference.N,
                                                              dead_frac=0.1)
        lookback_dead = (rng.random(lookback.shape) < 0.5).astype(mask_dtype)
        out = poisoned(len(tokens), reference)
        assert eng.hash(tokens, positions, qsl, lookback=lookback, dead=dead, lookback_dead=lookback_dead,
                        out=out) is out
        want = reference.hash(tokens, positions, qsl, lookback, dead, lookback_dead)
        np.testing.assert_array_equal(out, want, err_msg=f"seed {seed}")
        differs += not np.array_equal(want, reference.hash(tokens, positions, qsl, lookback, dead))
    assert differs > 0  # the flags changed the ids of some batch


def test_every_combination_of_id_and_flag(eng, reference):
    """Per request one lookback position, each kind in each column: known+dead blocks, known+alive and unknown with
    its flag set hash as without the mask."""
    N, V = reference.N, len(reference.tmap)
    rng = np.random.default_rng(3)
    cases = []  # (column, id, flag)
    for k in range(N - 1):
        for rid, flag in ((int(rng.integers(0, V)), 1), (int(rng.integers(0, V)), 0), (-1, 1)):
            cases.append((k, rid, flag))
    R = len(cases)
    lens = [2] * R
    T = sum(lens)
    tokens = rng.integers(0, V, T).astype(np.int32)
    positions = np.concatenate([np.arange(20 + r, 22 + r) for r in range(R)]).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    lookback = rng.integers(0, V, (R, N - 1)).astype(np.int32)
    lookback_dead = np.zeros((R, N - 1), np.uint8)
    for r, (k, rid, flag) in enumerate(cases):
        lookback[r, k], lookback_dead[r, k] = rid, flag
    out = poisoned(T, reference)
    eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=lookback_dead, out=out)
    np.testing.assert_array_equal(out, reference.hash(tokens, positions, qsl, lookback, None, lookback_dead))
    plain = eng.hash(tokens, positions, qsl, lookback=lookback)
    for r, (k, rid, flag) in enumerate(cases):
        rows = slice(qsl[r], qsl[r + 1])
        if rid >= 0 and flag:
            # The dead id is k+1 positions back from the chunk's newest lookback: the first token's n-grams of that
            # length and longer become pad, so its ids differ from those without the mask.
            assert not np.array_equal(out[rows], plain[rows]), (k, rid, flag)
        else:
            np.testing.assert_array_equal(out[rows], plain[rows], err_msg=str((k, rid, flag)))


def test_a_chunk_hashes_as_the_whole_request(eng, reference):
    seed, rng = fresh_rng()
    N, V = reference.N, len(reference.tmap)
    for _ in range(10):
        T = int(rng.integers(2, 40))
        P = int(rng.integers(1, T))
        tokens = rng.integers(0, V, T).astype(np.int32)
        positions = np.arange(T, dtype=np.int64)
        dead = (rng.random(T) < 0.3).astype(np.uint8)
        whole = eng.hash(tokens, positions, np.array([0, T], np.int32), dead=dead)
        p = np.arange(P - (N - 1), P)
        lookback = np.where(p >= 0, tokens[np.maximum(p, 0)], -1).astype(np.int32)[None]
        lookback_dead = np.where(p >= 0, dead[np.maximum(p, 0)], 1).astype(bool)[None]
        out = poisoned(T - P, reference)
        eng.hash(tokens[P:], positions[P:], np.array([0, T - P], np.int32), lookback=lookback, dead=dead[P:],
                 lookback_dead=lookback_dead, out=out)
        np.testing.assert_array_equal(out, whole[P:], err_msg=f"seed {seed} T {T} chunk from {P}")


def test_wrong_masks_are_refused_and_write_nothing(eng, reference):
    N = reference.N
    tokens = np.arange(3, 7, dtype=np.int32)
    positions = np.arange(10, 14, dtype=np.int64)
    qsl = np.array([0, 4], np.int32)
    lookback = np.full((1, N - 1), 5, np.int32)
    out = poisoned(4, reference)
    with pytest.raises(TypeError, match="lookback_dead: dtype float32"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=np.zeros((1, N - 1), np.float32), out=out)
    with pytest.raises(TypeError, match="lookback_dead: dtype int32"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=np.zeros((1, N - 1), np.int32), out=out)
    with pytest.raises(ValueError, match="lookback_dead: shape"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=np.zeros((1, N), np.uint8), out=out)
    with pytest.raises(ValueError, match="lookback_dead: shape"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=np.zeros((2, N - 1), np.uint8), out=out)
    with pytest.raises(ValueError, match="lookback_dead: needs lookback"):
        eng.hash(tokens, positions, qsl, lookback_dead=np.zeros((1, N - 1), np.uint8), out=out)
    with pytest.raises(ValueError, match="lookback_dead: strides"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=np.zeros((1, 2 * (N - 1)), np.uint8)[:, ::2],
                 out=out)
    with pytest.raises(TypeError, match="lookback_dead"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=[[0] * (N - 1)], out=out)
    assert (out == POISON).all()
    # An output over the mask's bytes is refused before anything is written.
    buf = np.zeros(out.size, np.int32)
    mask_over_out = buf.view(np.uint8)[:N - 1].reshape(1, N - 1)
    with pytest.raises(ValueError, match="out: overlaps lookback_dead"):
        eng.hash(tokens, positions, qsl, lookback=lookback, lookback_dead=mask_over_out, out=buf.reshape(out.shape))
    assert (buf == 0).all()
