"""Every wrong array is a TypeError or ValueError with a message, never a crash: dtype, shape, strides, device,
too many tokens, layer out of range, bad request boundaries, closed handles, bad attach arguments."""
import numpy as np
import pytest

import engram


@pytest.fixture(scope="module")
def eng(checkpoint, tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("bad") / "none.sock")
    t = engram.attach(checkpoint, socket=sock, timeout_ms=300, backend="cpu")
    e = t.engine(8)
    yield e
    e.close()
    t.close()


def ok_inputs(T=4):
    return (np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int64), np.array([0, T], dtype=np.int32))


class FakeCudaArray:
    """Something that says it lives on a GPU (as a CuPy array does); its pointer must never be used here."""

    def __init__(self, shape, typestr="<i4"):
        self.__cuda_array_interface__ = {"data": (0xDEAD0000, False), "shape": shape, "typestr": typestr,
                                         "version": 2, "strides": None}


def test_hash_refuses_wrong_dtypes(eng):
    tok, pos, qsl = ok_inputs()
    with pytest.raises(TypeError, match="tokens: dtype int64"):
        eng.hash(tok.astype(np.int64), pos, qsl)
    with pytest.raises(TypeError, match="positions: dtype int32"):
        eng.hash(tok, pos.astype(np.int32), qsl)
    with pytest.raises(TypeError, match="float32"):
        eng.hash(tok, pos, qsl, dead=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="expected a NumPy array"):
        eng.hash([1, 2, 3], pos, qsl)


def test_hash_refuses_wrong_shapes_and_values(eng):
    tok, pos, qsl = ok_inputs()
    with pytest.raises(ValueError, match="positions: shape"):
        eng.hash(tok, pos[:3], qsl)
    with pytest.raises(ValueError, match="lookback: shape"):
        eng.hash(tok, pos, qsl, lookback=np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="out: shape"):
        eng.hash(tok, pos, qsl, out=np.zeros((4, 1, 1), np.int32))
    with pytest.raises(ValueError, match="query_start_loc"):
        eng.hash(tok, pos, np.array([0], np.int32))
    with pytest.raises(ValueError, match="query_start_loc must run from 0 to 4"):
        eng.hash(tok, pos, np.array([0, 9], np.int32))
    with pytest.raises(ValueError, match="not contiguous"):
        eng.hash(tok, np.array([0, 1, 5, 6], np.int64), qsl)
    with pytest.raises(ValueError, match="outside"):
        eng.hash(np.array([0, 1, 2, 1 << 30], np.int32), pos, qsl)


def test_too_many_tokens(eng):
    tok, pos, qsl = ok_inputs(9)
    with pytest.raises(ValueError, match="9 tokens; the engine was sized for 8"):
        eng.hash(tok, pos, qsl)
    C, D = eng.layout.n_cols, eng.layout.head_dim
    with pytest.raises(ValueError, match="sized for 8"):
        eng.lookup(0, np.zeros((9, C), np.int32), np.zeros((9, C, D), np.uint16))
    with pytest.raises(ValueError, match="sized for 8"):
        eng.prefetch(np.zeros((9, len(eng.layout.layers), C), np.int32))


def test_non_contiguous_outputs_and_inputs(eng):
    tok, pos, qsl = ok_inputs(4)
    L, C, D = len(eng.layout.layers), eng.layout.n_cols, eng.layout.head_dim
    with pytest.raises(ValueError, match="contiguous"):
        eng.hash(np.arange(8, dtype=np.int32)[::2], pos, qsl)
    with pytest.raises(ValueError, match="contiguous"):
        eng.hash(tok, pos, qsl, out=np.zeros((4, C, L), np.int32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="contiguous"):
        eng.lookup(0, np.zeros((4, C), np.int32), np.zeros((4, D, C), np.uint16).transpose(0, 2, 1))


def test_lookup_refusals(eng):
    C, D, RB = eng.layout.n_cols, eng.layout.head_dim, eng.layout.record_bytes
    ids = np.zeros((2, C), np.int32)
    with pytest.raises(ValueError, match="layer 7 outside"):
        eng.lookup(7, ids, np.zeros((2, C, D), np.uint16))
    with pytest.raises(ValueError, match="layer -1 outside"):
        eng.wait(-1)
    with pytest.raises(TypeError, match="layer: an int"):
        eng.lookup(0.0, ids, np.zeros((2, C, D), np.uint16))
    with pytest.raises(TypeError, match="out: dtype float32"):
        eng.lookup(0, ids, np.zeros((2, C, D), np.float32))
    with pytest.raises(TypeError, match="out: dtype uint16, expected uint8"):
        eng.lookup(0, ids, np.zeros((2, C, RB), np.uint16), packed=True)
    with pytest.raises(ValueError, match="ids: shape"):
        eng.lookup(0, np.zeros((2, C + 1), np.int32), np.zeros((2, C, D), np.uint16))
    with pytest.raises(ValueError, match="out: shape"):
        eng.lookup(0, ids, np.zeros((2, C, D + 1), np.uint16))


def test_gate_refusals(eng):
    HC, D = eng.layout.hc_mult, eng.layout.hidden_size
    h = np.zeros((2, HC, D), np.uint16)
    kv = np.zeros((2, (HC + 1) * D), np.uint16)
    w = np.zeros((HC, D), np.uint16)
    with pytest.raises(ValueError, match="kv: shape"):
        eng.gate(h, kv[:, :-1], w, w)
    with pytest.raises(TypeError, match="q_weight: dtype int16"):
        eng.gate(h, kv, w.astype(np.int16), w)
    with pytest.raises(ValueError, match="overlaps hidden"):
        eng.gate(h, kv, w, w, out=h)
    with pytest.raises(ValueError, match="dead: shape"):
        eng.gate(h, kv, w, w, dead=np.zeros(3, np.uint8))


def test_device_arrays_are_refused_by_the_cpu_backend(eng):
    tok, pos, qsl = ok_inputs()
    with pytest.raises(ValueError, match="on cuda, but this engine runs on the CPU backend"):
        eng.hash(FakeCudaArray((4,)), pos, qsl)
    C, D = eng.layout.n_cols, eng.layout.head_dim
    with pytest.raises(ValueError, match="on cuda"):
        eng.lookup(0, np.zeros((2, C), np.int32), FakeCudaArray((2, C, D), "<u2"))


def test_closed_and_bad_handles(checkpoint, tmp_path):
    t = engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300, backend="cpu")
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.engine(4)
    with pytest.raises(ValueError, match="max_tokens"):
        engram.Table.engine(engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300,
                                          backend="cpu"), 0)


def test_attach_refusals(checkpoint, tmp_path):
    s = str(tmp_path / "none.sock")
    with pytest.raises(ValueError, match="rank outside"):
        engram.attach(checkpoint, tp_size=2, tp_rank=2, socket=s)
    with pytest.raises(ValueError, match="dp_shared_memory"):
        engram.attach(checkpoint, dp_shared_memory="yes", socket=s)
    with pytest.raises(ValueError, match="backend"):
        engram.attach(checkpoint, backend="tpu", socket=s)
    with pytest.raises(engram.EngramError):
        engram.attach(str(tmp_path / "no-such-checkpoint"), socket=s, timeout_ms=300, backend="cpu")
    with pytest.raises(TypeError, match="stream"):
        engram.attach(checkpoint, socket=s, timeout_ms=300, backend="cpu").engine(4, stream="main")
