"""The layout of a DP_SHARDED table reports both column ranges: owned_cols (= col_begin, col_end: this rank's DP
shard, the rows it holds) and staging_cols (the TP shard's columns, which the exchange fills in the engine's
staging). Checked against the rows themselves: two processes step together, and every column of staging_cols
carries a row (the other member's columns included) while the columns outside it are zero; outside DP_SHARDED the
two ranges are the same."""
import json
import os
import subprocess
import sys
import textwrap

import engram

from conftest import REPO

WORKER = textwrap.dedent("""
    import json, sys, numpy as np, engram
    ckpt, sock, rank, result = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    t = engram.attach(ckpt, dp_size=2, dp_rank=rank, socket=sock, embedding_across_dp=True,
                      dp_shared_memory=False, backend="cpu")
    assert t.mode == "DP_SHARDED", (t.mode, t.reasons)
    lay = t.layout
    e = t.engine(16)
    T = 7
    ids = e.hash(np.arange(3, T + 3, dtype=np.int32), np.arange(T, dtype=np.int64), np.array([0, T], np.int32))
    e.prefetch(ids)
    e.wait(0)
    rows = np.array(e.staging(0)[:T])  # [T, n_cols, head_dim] bf16 bits
    filled = [int(c) for c in range(lay.n_cols) if np.any(rows[:, c, :] != 0)]
    # To a file: the library's log lines share stdout with this process.
    with open(result, "w") as f:
        json.dump({"n_cols": lay.n_cols, "owned": list(lay.owned_cols), "cols": [lay.col_begin, lay.col_end],
                   "staging": list(lay.staging_cols), "filled": filled}, f)
    e.close()
    t.close()
""")


def test_a_dp_sharded_layout_reports_owned_and_staging_columns(daemon, checkpoint, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    results = [str(tmp_path / f"layout{r}.json") for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, checkpoint, daemon.socket, str(r), results[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    got = []
    for p, (out, err), result in zip(procs, outs, results):
        assert p.returncode == 0, (out[-2000:], err[-2000:])
        with open(result) as f:
            got.append(json.load(f))
    n = got[0]["n_cols"]
    half = n // 2
    # Each rank holds its DP shard; col_begin/col_end keep meaning the held columns (backward compatible).
    assert [g["owned"] for g in got] == [[0, half], [half, n]], got
    assert all(g["cols"] == g["owned"] for g in got), got
    # The staging holds the TP shard's columns (TP 1: all of them), and exactly those carry rows: the other
    # member's columns arrived through the exchange.
    for g in got:
        assert g["staging"] == [0, n], g
        assert g["filled"] == list(range(*g["staging"])), g


def test_outside_dp_sharded_owned_and_staging_columns_are_the_same(daemon, checkpoint):
    # A TP 2 rank the daemon does not serve: a private table of the TP shard's columns.
    t = engram.attach(checkpoint, tp_size=2, tp_rank=1, dp_size=2, socket=daemon.socket, shm_dir=daemon.shm,
                      backend="cpu")
    try:
        lay = t.layout
        assert t.mode != "DP_SHARDED"
        assert lay.owned_cols == lay.staging_cols == (lay.n_cols // 2, lay.n_cols), lay
        # A layout built positionally from its first 12 fields (no staging range) reports the one range for both.
        old = engram.Layout(*lay[:12])
        assert old.staging_cols == old.owned_cols == (lay.col_begin, lay.col_end)
    finally:
        t.close()
