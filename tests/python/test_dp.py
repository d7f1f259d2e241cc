"""DP_SHARDED from Python on the CPU backend (the host transport): two processes attach with embedding_across_dp
and sharing disabled, form their group through a real engramd, and step together; their rows equal a private
table's. A member that closes its engine while its process lives on tells the other at once: the next step fails
naming it, instead of waiting for the step timeout. An empty batch on one rank still takes part in the step."""
import os
import subprocess
import sys
import textwrap

import numpy as np

from conftest import REPO

WORKER = textwrap.dedent("""
    import sys, time, numpy as np, engram
    ckpt, sock, rank, close_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    t = engram.attach(ckpt, dp_size=2, dp_rank=rank, socket=sock, embedding_across_dp=True,
                      dp_shared_memory=False, backend="cpu")
    assert t.mode == "DP_SHARDED", (t.mode, t.reasons)
    e = t.engine(32)
    T = 5 if rank == 0 else 0  # rank 1 has no tokens this step
    ids = e.hash(np.arange(1, T + 1, dtype=np.int32), np.arange(T, dtype=np.int64), np.array([0, T], np.int32))
    e.prefetch(ids)
    e.wait(0)
    rows = np.array(e.staging(0)[:T])
    if rank == 0:
        mine = engram.attach(ckpt, dp_size=2, socket=sock + ".none", timeout_ms=200, backend="cpu")
        want = mine.engine(32)
        want.prefetch(ids)
        want.wait(0)
        assert np.array_equal(rows, want.staging(0)[:T]), "DP_SHARDED rows differ from a private table's"
        print("rows-equal", flush=True)
    if close_after:
        e.close()
        print("closed", flush=True)
        time.sleep(30)
    else:
        time.sleep(1.0)
        try:
            e.prefetch(ids)
            print("second step ok", flush=True)
        except engram.EngramError as err:
            print("second step failed:", err, flush=True)
""")


def test_two_processes_step_together_and_a_closed_engine_is_noticed(daemon, checkpoint, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    p0 = subprocess.Popen([sys.executable, "-c", WORKER, checkpoint, daemon.socket, "0", "0"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p1 = subprocess.Popen([sys.executable, "-c", WORKER, checkpoint, daemon.socket, "1", "1"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out0, err0 = p0.communicate(timeout=120)
    p1.kill()
    out1, err1 = p1.communicate(timeout=30)
    assert p0.returncode == 0, (out0, err0[-2000:])
    assert "rows-equal" in out0, (out0, err0[-2000:])
    assert "closed" in out1, (out1, err1[-2000:])
    assert "second step failed" in out0 and "closed its engine" in out0, (out0, err0[-2000:])
