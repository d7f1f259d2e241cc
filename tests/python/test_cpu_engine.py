"""The package on the CPU backend with NumPy arrays: attach without a daemon (reasons surfaced), layout, hash,
lookup (bf16 and packed), prefetch/wait/staging and gate, each against the independent reference (spec_reference.py)."""
import numpy as np
import pytest

import engram
import spec_reference as ref
from engram_layer import random_batch


@pytest.fixture(scope="module")
def table(checkpoint, tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("nodaemon") / "none.sock")
    t = engram.attach(checkpoint, dp_size=2, dp_rank=1, socket=sock, timeout_ms=300, backend="cpu")
    yield t
    t.close()


def test_without_a_daemon_the_table_is_private_and_says_why(table):
    assert table.mode == "PRIVATE_PINNED"
    assert table.backend == "cpu"
    names = {r.name: r for r in table.reasons}
    assert "DAEMON_UNAVAILABLE" in names, table.reasons
    r = names["DAEMON_UNAVAILABLE"]
    assert r.code == 10 and r.hint, r
    assert all(x.hint for x in table.reasons)
    assert "DAEMON_UNAVAILABLE" in repr(table)


def test_explicit_dp_shared_memory_turns_the_fallback_into_an_error(checkpoint, tmp_path):
    with pytest.raises(engram.EngramError) as e:
        engram.attach(checkpoint, dp_size=2, socket=str(tmp_path / "none.sock"), timeout_ms=300,
                      dp_shared_memory=True, backend="cpu")
    assert "DAEMON_UNAVAILABLE" in str(e.value)


def test_layout_matches_the_spec(table, reference):
    lay = table.layout
    assert [l.layer_id for l in lay.layers] == reference.layer_ids
    assert lay.n_cols == reference.C and (lay.col_begin, lay.col_end) == (0, reference.C)
    assert lay.head_dim == reference.D and lay.record_bytes == reference.D + reference.D // 32
    assert lay.max_ngram == reference.N and lay.hidden_size == reference.hidden and lay.hc_mult == reference.hc
    for li, l in enumerate(lay.layers):
        assert list(l.column_rows) == reference.primes[li]
        assert (l.row_begin, l.row_end) == (0, sum(reference.primes[li]))


def batch(reference, seed, lens):
    rng = np.random.default_rng(seed)
    vocab = len(reference.tmap)
    return random_batch(rng, vocab, lens, reference.N, dead_frac=0.15)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hash_equals_the_reference_with_requests_lookback_and_dead_spans(table, reference, seed):
    tokens, positions, qsl, lookback, dead = batch(reference, seed, [5, 1, 17, 9])
    eng = table.engine(64)
    got = eng.hash(tokens, positions, qsl, lookback=lookback, dead=dead)
    assert got.dtype == np.int32 and got.shape == (32, len(reference.layer_ids), reference.C)
    np.testing.assert_array_equal(got, reference.hash(tokens, positions, qsl, lookback, dead))
    # Into a caller's buffer, and with a bool dead mask and no lookback.
    out = np.full_like(got, -5)
    assert eng.hash(tokens, positions, qsl, dead=dead.astype(bool), out=out) is out
    np.testing.assert_array_equal(out, reference.hash(tokens, positions, qsl, None, dead))


def test_lookup_bf16_and_packed_equal_the_reference(table, reference):
    tokens, positions, qsl, lookback, dead = batch(reference, 11, [20, 12])
    eng = table.engine(32)
    ids = eng.hash(tokens, positions, qsl, lookback=lookback, dead=dead)
    ids[3, 1, 2] = -1                       # outside the table: a zero row
    for li in range(len(reference.layer_ids)):
        out = np.zeros((32, reference.C, reference.D), dtype=np.uint16)
        eng.lookup(li, ids[:, li, :], out)  # a strided view: row stride n_layers * n_cols
        want = reference.rows(li, np.maximum(ids[:, li, :], 0))
        if li == 1:
            want[3, 2] = 0
        np.testing.assert_array_equal(ref.bf16_bits_to_f64(out), want)
        packed = np.zeros((32, reference.C, reference.D + reference.D // 32), dtype=np.uint8)
        eng.lookup(li, np.asfortranarray(ids[:, li, :]), packed, packed=True)  # copied to rows first
        L = reference.layer_ids[li]
        _, _, w = reference.tensors.get(f"layers.{L}.engram.embed.weight")
        _, _, s = reference.tensors.get(f"layers.{L}.engram.embed.scale")
        w = np.frombuffer(w, np.uint8).reshape(-1, reference.D)
        s = np.frombuffer(s, np.uint8).reshape(-1, reference.D // 32)
        flat = ids[:, li, :].reshape(-1)
        want_p = np.concatenate([w[np.maximum(flat, 0)], s[np.maximum(flat, 0)]], axis=1)
        want_p[flat < 0] = 0
        np.testing.assert_array_equal(packed.reshape(-1, packed.shape[-1]), want_p)


def test_prefetch_wait_staging_equal_lookup(table, reference):
    tokens, positions, qsl, lookback, dead = batch(reference, 5, [7, 7, 2])
    eng = table.engine(40)
    ids = eng.hash(tokens, positions, qsl, lookback=lookback, dead=dead)
    eng.prefetch(ids)
    for li in range(len(reference.layer_ids)):
        eng.wait(li)
        st = eng.staging(li)
        assert st.shape == (40, reference.C, reference.D) and st.dtype == np.uint16
        assert eng.staging(li).ctypes.data == st.ctypes.data  # a fixed address
        np.testing.assert_array_equal(ref.bf16_bits_to_f64(st[:16]), reference.rows(li, ids[:, li, :]))


def test_gate_equals_the_float64_reference(table, reference):
    rng = np.random.default_rng(3)
    T, HC, D = 6, reference.hc, reference.hidden
    f = lambda *s: ref.to_bf16(rng.standard_normal(s))  # noqa: E731
    hidden, kv, qw, kw = f(T, HC, D), f(T, (HC + 1) * D), f(HC, D), f(HC, D)
    bits = lambda x: (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    dead = np.array([0, 1, 0, 0, 1, 0], dtype=np.uint8)
    eng = table.engine(8)
    out = eng.gate(bits(hidden), bits(kv), bits(qw), bits(kw), dead=dead)
    want = reference.gate(hidden, kv, qw, kw, dead)
    got = ref.bf16_bits_to_f64(out)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_array_equal(out[1], bits(hidden[1]))  # DEAD: hidden unchanged


def test_status_without_a_daemon_is_unavailable(tmp_path):
    with pytest.raises(engram.EngramError) as e:
        engram.status(str(tmp_path / "none.sock"), timeout_ms=300)
    assert e.value.code in (4, 14), e.value  # DEADLINE_EXCEEDED or UNAVAILABLE
