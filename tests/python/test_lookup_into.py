"""Engine.lookup_into: rows written straight into an engine's own layout (a TP rank's window of hash columns, packed
records at a token stride of the caller's choice), Table.records (the host records read in place) and the lookup
path controls, on the CPU backend against the independent reference (spec_reference.py reads the checkpoint's
tensors itself). Outputs are poisoned first, so a row not written or written at the wrong place shows."""
import numpy as np
import pytest

import engram
import spec_reference as ref
from engram_layer import random_batch


@pytest.fixture(scope="module")
def table(checkpoint, tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("nodaemon") / "none.sock")
    t = engram.attach(checkpoint, socket=sock, timeout_ms=300, backend="cpu")
    yield t
    t.close()


def _ids(table, reference, seed, lens):
    rng = np.random.default_rng(seed)
    tokens, positions, qsl, lookback, dead = random_batch(rng, len(reference.tmap), lens, reference.N, dead_frac=0.1)
    eng = table.engine(64)
    ids = eng.hash(tokens, positions, qsl, lookback=lookback, dead=dead)
    ids[2, :, 1] = -1  # outside every table: zero rows
    return eng, ids


def _packed_want(reference, li, ids):
    L = reference.layer_ids[li]
    _, _, w = reference.tensors.get(f"layers.{L}.engram.embed.weight")
    _, _, s = reference.tensors.get(f"layers.{L}.engram.embed.scale")
    w = np.frombuffer(w, np.uint8).reshape(-1, reference.D)
    s = np.frombuffer(s, np.uint8).reshape(-1, reference.D // 32)
    flat = ids.reshape(-1)
    want = np.concatenate([w[np.maximum(flat, 0)], s[np.maximum(flat, 0)]], axis=1)
    want[flat < 0] = 0
    return want.reshape(ids.shape + (want.shape[-1],))


@pytest.mark.parametrize("window", [(0, None), (1, 3), (4, 2), (5, 1)])
def test_a_column_window_in_bf16_writes_exactly_its_rows(table, reference, window):
    eng, ids = _ids(table, reference, 21, [9, 4, 3])
    T, C, D = ids.shape[0], reference.C, reference.D
    begin, n = window[0], (window[1] if window[1] is not None else C - window[0])
    for li in range(len(reference.layer_ids)):
        out = np.full((T, n, D), 0xDEAD, dtype=np.uint16)
        assert eng.lookup_into(li, ids[:, li, :], out, col_begin=begin, num_cols=n) is out
        want = reference.rows(li, np.maximum(ids[:, li, begin:begin + n], 0))
        want[ids[:, li, begin:begin + n] < 0] = 0
        np.testing.assert_array_equal(ref.bf16_bits_to_f64(out), want)


def test_packed_rows_at_a_token_stride_leave_the_gaps_alone(table, reference):
    eng, ids = _ids(table, reference, 5, [6, 10])
    T, C, RB = ids.shape[0], reference.C, reference.D + reference.D // 32
    L = len(reference.layer_ids)
    # vLLM's packed batch: [T, layers, part_cols, record] sliced at one layer: a token stride of L * n * RB bytes.
    begin, n = 2, 3
    buf = np.full((T, L, n, RB), 0xA5, dtype=np.uint8)
    for li in range(L):
        eng.lookup_into(li, ids[:, li, :], buf[:, li], col_begin=begin, num_cols=n)
    for li in range(L):
        np.testing.assert_array_equal(buf[:, li], _packed_want(reference, li, ids[:, li, begin:begin + n]))
    # A token stride with a gap after each token's rows: the gap keeps its poison.
    wide = np.full((T, n * RB + 40), 0x5A, dtype=np.uint8)
    out = np.lib.stride_tricks.as_strided(wide, shape=(T, n, RB), strides=(wide.strides[0], RB, 1))
    eng.lookup_into(0, ids[:, 0, :], out, col_begin=begin, num_cols=n)
    np.testing.assert_array_equal(wide[:, n * RB:], 0x5A)
    np.testing.assert_array_equal(out, _packed_want(reference, 0, ids[:, 0, begin:begin + n]))


def test_bad_windows_and_layouts_are_refused_before_anything_is_written(table, reference):
    eng, ids = _ids(table, reference, 8, [4])
    T, C, D, RB = ids.shape[0], reference.C, reference.D, reference.D + reference.D // 32
    out = np.full((T, 2, D), 7, dtype=np.uint16)
    with pytest.raises(ValueError, match="outside the table"):
        eng.lookup_into(0, ids[:, 0, :], out, col_begin=C - 1, num_cols=2)
    with pytest.raises(ValueError, match="outside the table"):
        eng.lookup_into(0, ids[:, 0, :], out, col_begin=-1, num_cols=2)
    with pytest.raises(ValueError, match="shape"):
        eng.lookup_into(0, ids[:, 0, :], out, col_begin=0, num_cols=3)
    with pytest.raises(ValueError, match="column stride"):
        eng.lookup_into(0, np.asfortranarray(ids[:, 0, :]), out, col_begin=0, num_cols=2)
    with pytest.raises(ValueError, match="contiguous"):
        wide = np.zeros((T, 2, 2 * D), dtype=np.uint16)
        eng.lookup_into(0, ids[:, 0, :], wide[:, :, ::2], col_begin=0, num_cols=2)
    with pytest.raises(ValueError, match="overlaps"):
        both = np.zeros(T * (C + 2 * RB), dtype=np.uint8)
        ids_in = both[:T * C * 4].view(np.int32).reshape(T, C)
        ids_in[:] = ids[:, 0, :]
        over = np.lib.stride_tricks.as_strided(both[8:], shape=(T, 2, RB), strides=(2 * RB, RB, 1))
        eng.lookup_into(0, ids_in, over, col_begin=0, num_cols=2)
    with pytest.raises(TypeError):
        eng.lookup_into(0, ids[:, 0, :], out, col_begin=0.5, num_cols=2)
    np.testing.assert_array_equal(out, 7)


def test_records_are_the_checkpoints_rows_read_in_place(table, reference):
    for li, lay in enumerate(table.layout.layers):
        rec = table.records(li)
        assert rec.shape == (lay.row_end - lay.row_begin, table.layout.record_bytes)
        assert not rec.flags.writeable
        rows = np.array([0, 1, rec.shape[0] // 2, rec.shape[0] - 1])
        want = _packed_want(reference, li, rows + lay.row_begin)
        np.testing.assert_array_equal(rec[rows], want)
        with pytest.raises(ValueError):
            rec[0, 0] = 1
    with pytest.raises(ValueError):
        table.records(len(table.layout.layers))


def test_the_cpu_backend_has_one_lookup_path(table):
    eng = table.engine(4)
    assert eng.last_lookup_path == "auto"
    eng.set_lookup_path("auto")
    with pytest.raises(engram.EngramError, match="single lookup path"):
        eng.set_lookup_path("uva")
    with pytest.raises(ValueError, match="one of"):
        eng.set_lookup_path("fast")


def test_int64_ids_give_the_same_rows_and_ids_past_int32_are_zero_rows(table, reference):
    eng, ids = _ids(table, reference, 31, [7, 5])
    T, C, D = ids.shape[0], reference.C, reference.D
    for li in range(len(reference.layer_ids)):
        want = np.full((T, C, D), 0xDEAD, dtype=np.uint16)
        eng.lookup_into(li, ids[:, li, :], want)
        wide = ids[:, li, :].astype(np.int64)
        wide[0, 0] = 2 ** 31 + 5   # past int32: outside every table
        wide[1, 1] = -(2 ** 40)
        got = np.full((T, C, D), 0xBEEF, dtype=np.uint16)
        eng.lookup_into(li, wide, got)
        want[0, 0] = 0
        want[1, 1] = 0
        np.testing.assert_array_equal(got, want)
