"""Lifetimes across the ctypes boundary: nothing the library owns is freed while Python can still reach it. A
staging view keeps its engine alive, an engine keeps its table alive, and close() ends use (calls raise) without
freeing what a live array points into. Without that, each case below is a SIGSEGV (a freed engine's staging read,
an engine used after its table was closed). Also: empty arrays (a DP rank with no tokens) are accepted."""
import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import engram


def _attach(checkpoint, tmp_path):
    return engram.attach(checkpoint, dp_size=2, dp_rank=1, socket=str(tmp_path / "none.sock"), timeout_ms=300,
                         backend="cpu")


def test_a_staging_view_outlives_its_engine_object(checkpoint, tmp_path):
    t = _attach(checkpoint, tmp_path)
    s = t.engine(64).staging(0)  # the engine object itself is dropped at once
    gc.collect()
    s[...] = 7  # writes into memory that must still be the engine's staging
    assert int(s.sum()) == 7 * s.size


def test_a_closed_engine_raises_and_its_views_stay_readable(checkpoint, tmp_path):
    t = _attach(checkpoint, tmp_path)
    e = t.engine(64)
    s = e.staging(0)
    e.close()
    with pytest.raises(ValueError, match="closed"):
        e.wait(0)
    s[...] = 3
    assert int(s.sum()) == 3 * s.size
    del s
    gc.collect()
    assert e._h is None, "freed once its last view went"


def test_a_dropped_engine_is_freed_after_staging(checkpoint, tmp_path):
    # An engine dropped without close() goes once nothing the caller holds reaches it, staging() called or not (a
    # view cached in the engine made a cycle Engine -> view -> _View owner -> Engine that the collector cannot see:
    # ndarrays are not GC-tracked, and a torch tensor holds its array interface owner from C++).
    t = _attach(checkpoint, tmp_path)
    e = t.engine(64)
    e.staging(0)
    gone = weakref.ref(e)
    del e
    gc.collect()
    assert gone() is None, "the engine outlived every reference the caller had"
    t.close()
    assert t._h is None, "the table stayed mapped: a leaked engine still holds it"


def test_closing_the_table_under_a_live_engine_defers_the_free(checkpoint, tmp_path):
    with _attach(checkpoint, tmp_path) as t:
        e = t.engine(64)
    with pytest.raises(ValueError, match="closed"):
        t.engine(64)
    # The engine still works: the table is released only when its last engine goes.
    T = 5
    ids = e.hash(np.arange(1, T + 1, dtype=np.int32), np.arange(T, dtype=np.int64), np.array([0, T], np.int32))
    assert ids.shape[0] == T and t._h is not None
    e.close()
    assert t._h is None, "released with its last engine"


def test_empty_batches_are_accepted(checkpoint, tmp_path):
    t = _attach(checkpoint, tmp_path)
    e = t.engine(16)
    empty = e.hash(np.zeros(0, np.int32), np.zeros(0, np.int64), np.array([0, 0], np.int32))  # one empty request
    assert empty.shape[0] == 0
    e.prefetch(empty)  # a rank with no tokens still takes part in a step


def test_the_crash_cases_exit_cleanly_in_a_fresh_process(checkpoint, tmp_path):
    # The crash cases, each in its own interpreter: a crash would be a signal exit, not 0.
    code = textwrap.dedent(f"""
        import gc, numpy as np, engram
        t = engram.attach({checkpoint!r}, dp_size=2, socket={str(tmp_path / 'none.sock')!r}, timeout_ms=300,
                          backend="cpu")
        s = t.engine(8192).staging(0); gc.collect(); print(int(s.sum()) >= 0)
        e = t.engine(64); t.close()
        try:
            e.prefetch(np.zeros((0, len(t.layout.layers), t.layout.n_cols), np.int32))
        except ValueError as err:
            print("refused", err)
        del e, s; gc.collect()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
