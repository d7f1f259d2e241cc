"""A hostile caller of the Python package (and, through it, the C ABI): every argument is checked before anything is
read or written, allocations sized from a caller's numbers are bounded and fail as errors, no C++ exception ends
the process, close() from another thread waits for a running call, a Table/Engine cycle is collected in any order,
and a forked child is refused the parent's objects (and its daemon connection) while the parent keeps working.
Each case ended the process (SIGSEGV, abort) or wrote out of bounds before; outputs are poisoned to show that a
refusal wrote nothing."""
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import engram


@pytest.fixture
def table(checkpoint, tmp_path):
    t = engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300, backend="cpu")
    yield t
    t.close()


def test_a_middle_request_boundary_past_the_tokens_is_refused_before_any_write(table):
    eng = table.engine(16)
    L, C = len(table.layout.layers), table.layout.n_cols
    tokens = np.arange(4, dtype=np.int32)
    positions = np.arange(4, dtype=np.int64)
    guard = np.full((4 + 8, L, C), -7, np.int32)  # rows past T guard the output's end
    with pytest.raises(ValueError, match="outside"):
        eng.hash(tokens, positions, np.array([0, 12, 4], np.int32), out=guard[:4])
    assert (guard == -7).all(), "a refused hash wrote into its output or past it"


def test_read_only_outputs_are_refused(table, tmp_path):
    eng = table.engine(8)
    L, C, D = len(table.layout.layers), table.layout.n_cols, table.layout.head_dim
    tok, pos, qsl = np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int64), np.array([0, 2], np.int32)
    out = np.zeros((2, L, C), np.int32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        eng.hash(tok, pos, qsl, out=out)
    mm_path = tmp_path / "rows.bin"
    mm_path.write_bytes(b"\0" * (2 * C * D * 2))
    ro = np.memmap(mm_path, dtype=np.uint16, mode="r", shape=(2, C, D))
    ids = eng.hash(tok, pos, qsl)
    with pytest.raises(ValueError, match="read-only"):
        eng.lookup(0, ids[:, 0, :], ro)
    with pytest.raises(ValueError, match="read-only"):
        eng.lookup_into(0, ids[:, 0, :], ro)
    assert mm_path.read_bytes() == b"\0" * (2 * C * D * 2)


def test_partially_overlapping_arrays_are_refused(table):
    eng = table.engine(8)
    HC, Dh = table.layout.hc_mult, table.layout.hidden_size
    T = 2
    buf = np.zeros(T * HC * Dh * 3, np.uint16)
    hidden = buf[: T * HC * Dh].reshape(T, HC, Dh)
    kv = np.zeros((T, (HC + 1) * Dh), np.uint16)
    w = np.zeros((HC, Dh), np.uint16)
    out = buf[1: 1 + T * HC * Dh].reshape(T, HC, Dh)  # one element past hidden's start
    with pytest.raises(ValueError, match="overlaps hidden"):
        eng.gate(hidden, kv, w, w, out=out)
    L, C = len(table.layout.layers), table.layout.n_cols
    raw = np.zeros(2 * L * C + 8, np.int32)
    tokens = raw[:2]
    tokens[:] = [1, 2]
    with pytest.raises(ValueError, match="overlaps tokens"):
        eng.hash(tokens, np.arange(2, dtype=np.int64), np.array([0, 2], np.int32), out=raw[1:1 + 2 * L * C].reshape(2, L, C))


def test_sizes_from_the_caller_are_bounded_and_fail_as_errors(table):
    with pytest.raises(ValueError, match="max_tokens must be in"):
        table.engine(2 ** 31 - 1)
    with pytest.raises(ValueError, match="max_tokens must be in"):
        table.engine(2 ** 21)
    # The largest engine allowed is an engine, created or refused with an error, never an abort.
    try:
        e = table.engine(2 ** 20)
    except engram.EngramError as err:
        assert err.code_name in ("RESOURCE_EXHAUSTED", "INTERNAL"), err
    else:
        e.close()


def test_close_from_another_thread_waits_for_the_running_call(table):
    eng = table.engine(4096)
    L, C = len(table.layout.layers), table.layout.n_cols
    rng = np.random.default_rng(1)
    T = 4096
    tok = rng.integers(0, table.layout.raw_vocab, T).astype(np.int32)
    pos = np.arange(T, dtype=np.int64)
    qsl = np.array([0, T], np.int32)
    errors, done = [], threading.Event()

    def worker():
        try:
            for _ in range(20):
                ids = eng.hash(tok, pos, qsl)
                eng.prefetch(ids)
                for l in range(L):
                    eng.wait(l)
        except ValueError as e:  # closed under us: refused, never freed under the call
            assert "closed" in str(e), e
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    th = threading.Thread(target=worker)
    th.start()
    time.sleep(0.05)
    eng.close()
    th.join(60)
    assert done.is_set() and not errors, errors
    with pytest.raises(ValueError, match="closed"):
        eng.hash(tok, pos, qsl)
    t2 = threading.Thread(target=table.close)  # the table too, from another thread
    t2.start()
    t2.join(10)
    assert not t2.is_alive()


def test_a_table_engine_cycle_is_collected_in_any_order(checkpoint, tmp_path):
    for _ in range(3):
        t = engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300, backend="cpu")
        e = t.engine(16)
        t.cycle, e.cycle = e, t  # a reference cycle through both objects
        e.prefetch(e.hash(np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64), np.array([0, 3], np.int32)))
        del t, e
        gc.collect()  # the collector frees them in its own order: the C objects stay valid until the last goes


FORK_CHILD = textwrap.dedent("""
    import os, sys, json, numpy as np, engram
    ckpt, sock = sys.argv[1], sys.argv[2]
    t = engram.attach(ckpt, socket=sock, backend="cpu")
    e = t.engine(8)
    tok, pos, qsl = np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64), np.array([0, 3], np.int32)
    want = e.hash(tok, pos, qsl)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = {}
        for name, call in (("hash", lambda: e.hash(tok, pos, qsl)), ("engine", lambda: t.engine(4)),
                           ("status", lambda: engram.status(sock, timeout_ms=2000)),
                           ("attach", lambda: engram.attach(ckpt, socket=sock, backend="cpu"))):
            try:
                call()
                out[name] = "ok"
            except Exception as exc:
                out[name] = type(exc).__name__ + ": " + str(exc)
        del e, t  # the child's collector must not tear down the parent's engine or session
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    _, code = os.waitpid(pid, 0)
    child = json.loads(os.read(r, 65536).decode())
    again = e.hash(tok, pos, qsl)  # the parent keeps working
    st = engram.status(sock)
    mine = [x for x in st["replicas"] if x["own_pid"] == os.getpid()]
    print(json.dumps({"child": child, "code": code, "same": bool((again == want).all()), "leases": len(mine)}))
""")


def test_a_forked_child_is_refused_and_the_parent_keeps_working(daemon, checkpoint):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", FORK_CHILD, checkpoint, daemon.socket], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    got = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    assert got["code"] == 0, got
    for name in ("hash", "engine"):
        assert "is a fork of it" in got["child"][name], got
    for name in ("status", "attach"):
        assert "forked from it" in got["child"][name], got
    assert got["same"] and got["leases"] == 1, got


def test_a_records_array_outlives_close_of_its_table(checkpoint, tmp_path):
    t = engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300, backend="cpu")
    r = t.records(0)
    want = int(r[:64].astype(np.int64).sum())
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.records(0)
    assert int(r[:64].astype(np.int64).sum()) == want  # the mapping is still there (it was unmapped under it)
    del r
    gc.collect()
    assert t._h is None, "the table was not freed once its last records() array went"


def test_cpu_torch_outputs_over_foreign_memory_are_refused(table):
    torch = pytest.importorskip("torch")
    if not hasattr(torch.Tensor, "untyped_storage"):
        pytest.skip(f"torch {torch.__version__} cannot tell memory it owns (no untyped_storage().resizable())")
    eng = table.engine(4)
    L, C = len(table.layout.layers), table.layout.n_cols
    tok, pos, qsl = np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int64), np.array([0, 2], np.int32)
    frozen = np.zeros((2, L, C), np.int32)
    frozen.flags.writeable = False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        over = torch.from_numpy(frozen)
    with pytest.raises(ValueError, match="read-only"):
        eng.hash(tok, pos, qsl, out=over)
    assert (frozen == 0).all()
    ok = torch.zeros((2, L, C), dtype=torch.int32)  # memory torch allocated: accepted
    eng.hash(tok, pos, qsl, out=ok)


def test_socket_paths_gRPC_would_rewrite_or_that_hold_a_nul_are_refused(tmp_path):
    # gRPC percent-decodes its target and splits it on ',' '?' '#': such a path would reach another socket.
    for bad in (str(tmp_path / "engramd%2esock"), str(tmp_path / "a.sock,b"), str(tmp_path / "a.sock?x=1")):
        with pytest.raises(ValueError) as e:  # INVALID_ARGUMENT
            engram.status(socket=bad, timeout_ms=500)
        assert "contains one of" in str(e.value), str(e.value)
    with pytest.raises(ValueError):
        engram.status(socket=str(tmp_path / "a.sock") + "\0junk", timeout_ms=500)
    with pytest.raises(ValueError) as e:
        engram.status(socket="/tmp/" + "x" * 300, timeout_ms=500)
    assert "too long" in str(e.value), str(e.value)


@pytest.mark.parametrize("kw", [{"dp_size": 2**32 + 4}, {"tp_size": 2**31}, {"dp_rank": -1},
                                {"local_dp_size": 2**32 + 1}, {"timeout_ms": 2**32 + 300}, {"timeout_ms": -1},
                                {"dp_size": 4.0}])
def test_ints_a_c_int_cannot_hold_are_refused_not_cut(tmp_path, kw):
    # ctypes keeps the low 32 bits of a larger int: DP 2**32 + 4 would attach as DP 4.
    with pytest.raises(ValueError, match=next(iter(kw))):
        engram.attach(str(tmp_path), socket=str(tmp_path / "none.sock"), **kw)
    if "timeout_ms" in kw:
        with pytest.raises(ValueError, match="timeout_ms"):
            engram.status(str(tmp_path / "none.sock"), timeout_ms=kw["timeout_ms"])


@pytest.mark.parametrize("field", ["checkpoint", "shm_dir"])
def test_a_nul_in_a_path_is_refused_not_cut(tmp_path, field):
    paths = {"checkpoint": str(tmp_path), "shm_dir": None}
    paths[field] = str(tmp_path) + "\0/elsewhere"
    with pytest.raises(ValueError, match=f"{field}: the path contains a NUL byte"):
        engram.attach(paths["checkpoint"], shm_dir=paths["shm_dir"], socket=str(tmp_path / "none.sock"))


@pytest.mark.parametrize("max_tokens", [2**32 + 1, 2**31, 2**63, 0, -1])
def test_an_engine_size_an_int32_cannot_hold_is_refused(table, max_tokens):
    # ctypes would pass the low 32 bits (2**32 + 1 as 1) while staging() sized its views by the Python value.
    with pytest.raises(ValueError, match="max_tokens"):
        table.engine(max_tokens)


@pytest.mark.parametrize("stream", [2**64, -1, 2**70])
def test_a_stream_handle_outside_64_bits_is_refused(table, stream):
    with pytest.raises(ValueError, match="stream"):
        table.engine(4, stream=stream)


@pytest.mark.parametrize("option", ["elastic_ep", "embedding_across_dp", "private_fallback"])
def test_boolean_options_take_booleans_only(tmp_path, option):
    with pytest.raises(TypeError, match=option):
        engram.attach(str(tmp_path), socket=str(tmp_path / "none.sock"), **{option: "false"})
