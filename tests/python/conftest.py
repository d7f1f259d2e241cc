"""Fixtures of the Python tests: the build's binaries (ENGRAM_BUILD_DIR, set by ctest), a small real checkpoint made
by engram-mkckpt, an engramd started on a test's own socket and shm directory (removed at the end), and the
independent reference (spec_reference.py, written from docs/math.md) of that checkpoint."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "python", "examples"))

from ckpt_tensors import embed_tensors  # noqa: E402,F401 (the GPU tests' loader)


def build_dir():
    b = os.environ.get("ENGRAM_BUILD_DIR")
    if b:
        return b
    for cand in [os.path.join(REPO, "build")] + sorted(glob.glob(os.path.join(REPO, "build-*"))):
        if os.path.exists(os.path.join(cand, "tools", "engram-mkckpt")):
            return cand
    pytest.fail("no build directory with tools/engram-mkckpt: set ENGRAM_BUILD_DIR")


def binary(rel):
    p = os.path.join(build_dir(), rel)
    if not os.path.exists(p):
        pytest.fail(f"{p} is missing: build it first")
    return p


def make_checkpoint(out, mib=2.0, seed=1, extra=()):
    subprocess.run([binary("tools/engram-mkckpt"), "--out", out, "--table-mib", str(mib), "--seed", str(seed),
                    *extra], check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="session")
def workdir():
    d = tempfile.mkdtemp(prefix="engram-pytest-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint(workdir):
    # Small enough that the reference's pure-Python hash stays quick; 3 layers, N = 3, 4 heads, hidden 256, hc 4.
    return make_checkpoint(os.path.join(workdir, "ck"), mib=2.0, seed=7, extra=("--layers", "1,3,6"))


@pytest.fixture(scope="session")
def reference(checkpoint):
    import spec_reference
    return spec_reference.Spec(checkpoint)


class Daemon:
    def __init__(self, ckpt, root):
        self.shm = tempfile.mkdtemp(prefix="engram-pytest-", dir="/dev/shm")
        self.socket = os.path.join(root, "engramd.sock")
        self.log = os.path.join(root, "engramd.log")
        self.proc = subprocess.Popen([binary("daemon/engramd"), "--checkpoint", ckpt, "--tp", "1", "--shm-dir",
                                      self.shm, "--socket", self.socket, "--log-level", "debug"],
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, engram, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engramd exited {self.proc.returncode}: {open(self.log).read()[-2000:]}")
            try:
                st = engram.status(self.socket, timeout_ms=1000)
                segs = st.get("segments", [])
                if segs and all(s["state"] in ("READY", "FAILED") for s in segs):
                    return st
            except engram.EngramError:
                pass
            time.sleep(0.05)
        raise AssertionError("engramd did not become ready: " + open(self.log).read()[-2000:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.shm, ignore_errors=True)


@pytest.fixture
def daemon(checkpoint, tmp_path):
    import engram
    d = Daemon(checkpoint, str(tmp_path))
    try:
        d.wait_ready(engram)
        yield d
    finally:
        d.stop()


def v41_like_checkpoint(path, seed):
    """A small checkpoint of V4.1's column geometry (n-grams up to 4, 8 heads: 24 hash columns, head_dim 256)."""
    return make_checkpoint(path, mib=48, seed=seed, extra=("--layers", "1,14", "--heads", "8", "--max-ngram", "4"))


def torch_cuda():
    """torch when it is >= 2.4 with a usable GPU, else None."""
    try:
        import torch
    except ImportError:
        return None
    v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if v < (2, 4) or not torch.cuda.is_available():
        return None
    return torch
