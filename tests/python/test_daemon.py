"""Several Python processes share one table from one real engramd: each runs the example layer as its DP rank
(python/examples/engram_layer.py), reports SHARED, shows up in engram.status() while it holds the table, and its
outputs equal the independent reference."""
import json
import os
import subprocess
import sys
import time

import numpy as np

import engram
import spec_reference as ref
from conftest import REPO
from test_layer import compare

EXAMPLE = os.path.join(REPO, "python", "examples", "engram_layer.py")


def test_status_reports_the_daemons_segments(daemon, checkpoint):
    st = engram.status(daemon.socket)
    assert [s["state"] for s in st["segments"]] == ["READY"], st
    assert st["segments"][0]["tp_size"] == 1
    assert st["replicas"] == [] and st["draining"] is False


def test_one_process_attaches_shared_and_is_listed(daemon, checkpoint):
    t = engram.attach(checkpoint, dp_size=2, dp_rank=0, socket=daemon.socket, shm_dir=daemon.shm, backend="cpu")
    try:
        assert t.mode == "SHARED", t.reasons
        assert [r.name for r in t.reasons] == ["NO_CUDA_DEVICE"] or t.backend == "cpu"
        st = engram.status(daemon.socket)
        mine = [r for r in st["replicas"] if r["pid"] == os.getpid()]
        assert len(mine) == 1 and mine[0]["mode"] == "SHARED", st
    finally:
        t.close()


def test_status_carries_the_daemons_and_each_replicas_version(daemon, checkpoint):
    # The build's version, as CMake generated it for the package (<build>/python/engram/_version.py).
    from conftest import build_dir
    generated = {}
    with open(os.path.join(build_dir(), "python", "engram", "_version.py")) as f:
        exec(f.read(), generated)
    want = generated["__version__"]
    assert engram._lib.lib.engram_version().decode() == want
    t = engram.attach(checkpoint, dp_size=2, dp_rank=0, socket=daemon.socket, shm_dir=daemon.shm, backend="cpu")
    try:
        st = engram.status(daemon.socket)
        assert st["daemon_version"] == want, st
        mine = [r for r in st["replicas"] if r["pid"] == os.getpid()]
        assert len(mine) == 1 and mine[0]["client_version"] == want, st
    finally:
        t.close()


def test_a_fallback_names_its_reason_and_hint(daemon, checkpoint):
    # The daemon serves TP 1 only: a TP 2 rank gets a private table, and the daemon says why.
    t = engram.attach(checkpoint, tp_size=2, tp_rank=1, dp_size=2, socket=daemon.socket, shm_dir=daemon.shm,
                      backend="cpu")
    assert t.mode == "PRIVATE_PINNED"
    r = {x.name: x for x in t.reasons}
    assert "SEGMENT_NOT_READY" in r and r["SEGMENT_NOT_READY"].code == 14 and r["SEGMENT_NOT_READY"].hint, t.reasons
    assert (t.layout.col_begin, t.layout.col_end) == (t.layout.n_cols // 2, t.layout.n_cols)
    st = engram.status(daemon.socket)
    mine = [x for x in st["replicas"] if x["pid"] == os.getpid()]
    assert mine and mine[0]["mode"] == "PRIVATE_PINNED" and "SEGMENT_NOT_READY" in json.dumps(mine[0]["reasons"])
    t.close()


def test_several_processes_share_one_table(daemon, checkpoint, reference, tmp_path):
    n = 3
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    procs = []
    for r in range(n):
        dump = str(tmp_path / f"rank{r}.npz")
        procs.append((dump, subprocess.Popen(
            [sys.executable, EXAMPLE, "--checkpoint", checkpoint, "--socket", daemon.socket, "--shm-dir", daemon.shm,
             "--dp-size", str(n), "--dp-rank", str(r), "--steps", "2", "--tokens", "24", "--seed", "9",
             "--backend", "cpu", "--dump", dump, "--hold-until", str(tmp_path / "release")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)))
    try:
        # Every process is attached and reported while they all hold the table.
        reports = []
        for _, p in procs:
            line = p.stdout.readline()
            while line and not line.startswith("{"):  # the library's own log lines
                line = p.stdout.readline()
            assert line, p.stderr.read()
            reports.append(json.loads(line))
        assert [x["mode"] for x in reports] == ["SHARED"] * n, reports
        st = engram.status(daemon.socket)
        listed = {r["pid"]: r for r in st["replicas"]}
        for x in reports:
            assert listed[x["pid"]]["mode"] == "SHARED", st
        assert sorted(listed[x["pid"]]["dp_rank"] for x in reports) == list(range(n))
    finally:
        open(tmp_path / "release", "w").close()
        for _, p in procs:
            p.wait(timeout=60)
    for dump, p in procs:
        assert p.returncode == 0, p.stderr.read()
        d = np.load(dump)
        for s in range(2):
            hidden = d[f"hidden{s}"]
            for li in range(len(reference.layer_ids)):
                _, want = reference.layer(li, hidden, d[f"tokens{s}"], d[f"positions{s}"], d[f"qsl{s}"],
                                          d[f"lookback{s}"], d[f"dead{s}"])
                hidden = (ref.to_bf16(want).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            compare(d[f"out{s}"], ref.bf16_bits_to_f64(hidden))
    # The leases end with the processes.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and engram.status(daemon.socket)["replicas"]:
        time.sleep(0.05)
    assert engram.status(daemon.socket)["replicas"] == []
