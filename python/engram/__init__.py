"""engram: DeepSeek-V4.1 Engram tables shared between serving replicas, from Python.

    import engram
    table = engram.attach("/models/DeepSeek-V4.1-Flash", tp_size=1, tp_rank=0, dp_size=4, dp_rank=1)
    print(table.mode, table.backend, table.reasons)       # SHARED cuda [] -- or a fallback and why
    eng = table.engine(max_tokens=8192)                    # stream: torch's current stream per call
    ids = eng.hash(input_ids, positions, query_start_loc, lookback=lb, dead=dead)   # int32 [T, L, C]
    eng.prefetch(ids)          # every layer's rows on a side stream, into fixed staging buffers
    eng.wait(0); rows = eng.staging(0)[:T]                 # bf16 [T, C, head_dim]
    out = eng.gate(hidden, kv, q_weight, k_weight, dead=dead)

A thin ctypes binding of libengram_c.so (engram/engram_c.h; python/README.md says why ctypes). Arrays: NumPy on the
CPU backend (bf16 as uint16 bits), torch tensors or CUDA arrays on the CUDA backend; every shape, dtype, device and
stride is checked here (TypeError/ValueError) before a pointer reaches C. A Table and its Engines are driven by one
thread; the Table must outlive its Engines (an Engine holds a reference to it). torch custom ops: engram.torch.
"""
import ctypes
import json
import os

from . import _lib
from ._engine import Engine
from ._lib import EngramError, LibraryError
from ._table import LayerLayout, Layout, Reason, Table

__all__ = ["attach", "status", "Table", "Engine", "Reason", "Layout", "LayerLayout", "EngramError", "LibraryError",
           "DEFAULT_SOCKET"]
_PACKAGE_VERSION = _lib.package_version()
if _PACKAGE_VERSION is not None:
    __version__ = _PACKAGE_VERSION


def __getattr__(name):
    # A source tree has no version file of its own: its version is the build's library's (loaded when asked for).
    if name == "__version__":
        return _lib.library_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DEFAULT_SOCKET = "/run/engramd/engramd.sock"
def _choice(v, name):
    if v is None or v == "auto":
        return -1
    if isinstance(v, bool):
        return int(v)
    raise ValueError(f"{name}: True, False, None or 'auto', got {v!r}")


def _socket_path(socket):
    """The daemon's socket path as bytes for the C ABI; a NUL inside it would silently cut it short."""
    raw = os.fsencode(socket)
    if b"\0" in raw:
        raise ValueError("the socket path contains a NUL byte")
    return raw


def _c_int(name, v):
    """A value for a C `int`: a non-negative Python int that fits (ctypes would cut a larger one silently)."""
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 2**31 - 1:
        raise ValueError(f"{name}: a non-negative int below 2**31, got {v!r}")
    return v


def _path_bytes(path, name):
    """A path as bytes for the C ABI; a NUL inside it would silently cut it short."""
    raw = os.fsencode(os.fspath(path))
    if b"\0" in raw:
        raise ValueError(f"{name}: the path contains a NUL byte")
    return raw


def attach(checkpoint, *, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0, local_dp_size=None, cpu_offload=None,
           dp_shared_memory="auto", embedding_across_dp=False, elastic_ep=False, socket=DEFAULT_SOCKET,
           shm_dir=None, timeout_ms=10000, backend="auto", private_fallback=True):
    """Attaches this replica (one TP rank of one DP rank) to its TP shard's table: shared from engramd when the
    daemon allows it, otherwise a private table with the reasons. dp_shared_memory=True turns a fallback into an
    EngramError that names the reasons. shm_dir: only for the path fallback (engramd passed no descriptor): the
    daemon's shm directory as this process sees it; None: the directory the grant names.
    backend: "auto" (CUDA where a GPU is usable) or "cpu" (the CPU backend, NumPy arrays, even beside a GPU).
    private_fallback=False: a table that cannot be shared is not built; EngramError FAILED_PRECONDITION (code 9)
    names every reason instead (for an engine that keeps a table store of its own)."""
    if backend not in ("auto", "cpu"):
        raise ValueError(f"backend: 'auto' or 'cpu', got {backend!r}")
    for n, v in (("tp_size", tp_size), ("tp_rank", tp_rank), ("dp_size", dp_size), ("dp_rank", dp_rank),
                 ("local_dp_size", 0 if local_dp_size is None else local_dp_size), ("timeout_ms", timeout_ms)):
        _c_int(n, v)
    if tp_size < 1 or dp_size < 1 or tp_rank >= tp_size or dp_rank >= dp_size:
        raise ValueError(f"rank outside its size: tp {tp_rank}/{tp_size}, dp {dp_rank}/{dp_size}")
    req = _lib.AttachRequest()
    req.checkpoint = _path_bytes(checkpoint, "checkpoint")
    req.tp_size, req.tp_rank, req.dp_size, req.dp_rank = tp_size, tp_rank, dp_size, dp_rank
    for n, v in (("elastic_ep", elastic_ep), ("embedding_across_dp", embedding_across_dp),
                 ("private_fallback", private_fallback)):
        if not isinstance(v, bool):  # "false" is truthy: a string here would mean the opposite of what it says
            raise TypeError(f"{n}: True or False, got {v!r}")
    req.local_dp_size = 0 if local_dp_size is None else int(local_dp_size)
    req.elastic_ep = int(bool(elastic_ep))
    req.cpu_offload = _choice(cpu_offload, "cpu_offload")
    req.dp_shared_memory = _choice(dp_shared_memory, "dp_shared_memory")
    req.embedding_across_dp = int(bool(embedding_across_dp))
    req.shm_dir = _path_bytes(shm_dir, "shm_dir") if shm_dir is not None else None
    req.use_gpu = 0 if backend == "cpu" else 1
    req.private_fallback = 1 if private_fallback else 0
    handle = ctypes.c_void_p()
    err = ctypes.create_string_buffer(2048)
    rc = _lib.lib.engram_attach(_socket_path(socket), int(timeout_ms), ctypes.byref(req), ctypes.byref(handle), err,
                                len(err))
    if rc != 0:
        raise EngramError(rc, err.value.decode("utf-8", "replace"))
    return Table(handle, tp=(tp_size, tp_rank))


def status(socket=DEFAULT_SOCKET, timeout_ms=5000):
    """engramd's status as a dict: shm, segments (state, tp, bytes, ...), replicas (pid, mode, backend, reasons with
    hints), recent_fallbacks, draining. EngramError (UNAVAILABLE, ...) when no daemon answers."""
    out = ctypes.c_void_p()
    _lib.call(_lib.lib.engram_status_json, _socket_path(socket), _c_int("timeout_ms", timeout_ms), ctypes.byref(out))
    try:
        return json.loads(ctypes.string_at(out.value).decode("utf-8"))
    finally:
        _lib.lib.engram_string_free(out)
