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
import threading
import weakref
import json
import os
from collections import namedtuple

from . import _lib
from ._arrays import check, no_overlap, torch_module, view
from ._lib import EngramError, LibraryError

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

Reason = namedtuple("Reason", "code name hint")
Reason.__doc__ = "Why a table is not shared: code (engram.v1.FallbackReason number), name, hint (what to do)."
LayerLayout = namedtuple("LayerLayout", "layer_id row_begin row_end column_rows")


class Layout(namedtuple("Layout", "layers n_cols col_begin col_end head_dim record_bytes max_ngram hidden_size "
                                  "hc_mult rms_norm_eps pad_token_id raw_vocab staging_col_begin staging_col_end",
                        defaults=(None, None))):
    """A table's layout: layers (LayerLayout: backbone layer id, this shard's rows, rows per hash column), hash
    columns, row width, gate dimensions, and two column ranges of the n_cols hash columns:
      owned_cols   = (col_begin, col_end): the columns whose rows this table holds. The TP shard's columns, except
                     in a DP_SHARDED table: this rank's DP shard of them (the rest are the DP group's other members').
      staging_cols = (staging_col_begin, staging_col_end): the columns an engine's staging (and lookup) fills with
                     rows; every other column of a staging row is zero. Always the TP shard's columns: in a
                     DP_SHARDED table the exchange brings the group's other columns, so a TP rank's partial
                     products (wkv) run over staging_cols, not owned_cols.
    Outside DP_SHARDED the two are the same range."""

    __slots__ = ()

    @property
    def owned_cols(self):
        return (self.col_begin, self.col_end)

    @property
    def staging_cols(self):
        if self.staging_col_begin is None:
            return self.owned_cols
        return (self.staging_col_begin, self.staging_col_end)


def _tp_columns(n_cols, tp_size, tp_rank):
    # The TP shard's hash columns as docs/math.md section 8 splits them (model/layout.cc Layout::Shard): contiguous
    # parts of ceil(n_cols / tp_size) columns. The cross-check of the library's staging columns (a second computation).
    part = -(-n_cols // tp_size)
    return tp_rank * part, min((tp_rank + 1) * part, n_cols)


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


def _s(b):
    return b.decode("utf-8", "replace") if b is not None else ""


class Table:
    """An attached table: mode ("SHARED", "PRIVATE_PINNED", "DEVICE"), backend ("cuda"/"cpu"), reasons, layout.
    close() (or the end of a `with` block) ends its use: no new engines; the table and its lease are released at
    once when no engine of it is alive, else when the last one goes (an engine, and every staging view of one,
    keeps its table alive: nothing is freed under a live array)."""

    def __init__(self, handle, tp=(1, 0)):
        self._h = handle
        self._closed = False
        self._lock = threading.RLock()
        self._views = weakref.WeakSet()  # records() arrays handed out (each keeps this table alive)
        self._engines = weakref.WeakSet()
        L = _lib.lib
        h = handle
        self.mode = _s(L.engram_table_mode(h))
        self.backend = _s(L.engram_table_backend(h))
        self.reasons = [Reason(L.engram_table_reason_code(h, i), _s(L.engram_table_reason(h, i)),
                               _s(L.engram_table_reason_hint(h, i))) for i in range(L.engram_table_num_reasons(h))]
        n_cols = L.engram_table_num_cols(h)
        layers = []
        for i in range(L.engram_table_num_layers(h)):
            b, e = ctypes.c_int64(), ctypes.c_int64()
            _check_rc(L.engram_table_layer_rows(h, i, ctypes.byref(b), ctypes.byref(e)), "layer rows")
            rows = (ctypes.c_int64 * n_cols)()
            _check_rc(L.engram_table_column_rows(h, i, rows, n_cols), "column rows")
            layers.append(LayerLayout(L.engram_table_layer_id(h, i), b.value, e.value, tuple(rows)))
        cb, ce = ctypes.c_int(), ctypes.c_int()
        _check_rc(L.engram_table_col_range(h, ctypes.byref(cb), ctypes.byref(ce)), "column range")
        # The staging's columns come from the library; the TP split of docs/math.md section 8, recomputed here, must
        # agree with them.
        stb, ste = ctypes.c_int(), ctypes.c_int()
        _check_rc(L.engram_table_staging_col_range(h, ctypes.byref(stb), ctypes.byref(ste)), "staging columns")
        sb, se = stb.value, ste.value
        want = _tp_columns(n_cols, *tp) if self.mode == "DP_SHARDED" else (cb.value, ce.value)
        if (sb, se) != want or not sb <= cb.value <= ce.value <= se:
            self._free()
            raise EngramError(13, f"internal: staging columns [{sb}, {se}) disagree with TP rank {tp[1]} of {tp[0]} "
                                  f"({want}) or do not hold the owned columns [{cb.value}, {ce.value})")
        self.layout = Layout(tuple(layers), n_cols, cb.value, ce.value, L.engram_table_head_dim(h),
                             L.engram_table_record_bytes(h), L.engram_table_max_ngram(h),
                             L.engram_table_hidden_size(h), L.engram_table_hc_mult(h),
                             L.engram_table_rms_norm_eps(h), L.engram_table_pad_token_id(h),
                             L.engram_table_raw_vocab(h), sb, se)
        self.register_seconds = L.engram_table_register_seconds(h)

    @property
    def shared(self):
        return self.mode == "SHARED"

    def records(self, layer):
        """The host records of table `layer` as a read-only NumPy uint8 array [row_end - row_begin, record_bytes]
        (record of row_begin first: head_dim e4m3 bytes, then head_dim/32 ue8m0 scales), or None for a DEVICE
        table (no host copy). A SHARED table's records are the daemon's segment itself: reading a few rows costs
        nothing. Valid while the table is open (the array keeps the table alive)."""
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer: an int table index, got {type(layer).__name__}")
        if not 0 <= layer < len(self.layout.layers):
            raise ValueError(f"layer {layer} outside [0, {len(self.layout.layers)})")
        ptr = ctypes.c_void_p()
        import numpy as np
        with self._lock:  # until the view is tracked: a close() in another thread cannot free under it
            if self._closed or not self._h:
                raise ValueError("the table is closed")
            _check_rc(_lib.lib.engram_table_records(self._h, int(layer), ctypes.byref(ptr)), "records")
            if not ptr.value:
                return None
            lay = self.layout.layers[layer]
            rows = lay.row_end - lay.row_begin
            view = _HostRecords(ptr.value, (rows, self.layout.record_bytes), owner=self)
            self._views.add(view)
        arr = np.asarray(view)
        arr.flags.writeable = False
        return arr

    def engine(self, max_tokens, stream=None, staging=True):
        """An Engine for batches of at most max_tokens tokens. stream: None = torch's (or CuPy's) current stream at
        each call; else a torch.cuda.Stream, a CuPy stream or a cudaStream_t integer used by every call.
        staging=False: an engine that only looks up into the caller's buffers (lookup, lookup_into), without the
        staging buffers prefetch fills (n_layers x max_tokens x n_cols x head_dim bf16 of GPU memory saved).
        An engine's calls form one sequence: calls on different streams must be ordered by the caller."""
        return Engine(self, max_tokens, stream, staging)

    def close(self):
        """Ends its use: the table (and its lease) is freed once no engine of it and no records() array is left."""
        with self._lock:
            self._closed = True
        self._release()

    def _release(self, leaving=None):
        """Frees the table when it is closed and nothing but `leaving` (going now) still uses it."""
        with self._lock:
            users = [e for e in list(self._engines) if e._h] + list(self._views)
            _free_if_unused(self, users, leaving=leaving)

    def _free(self):
        with self._lock:  # taken once: a second caller finds no handle
            h, self._h = self._h, None
        if h:
            _lib.lib.engram_table_free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._free()
        except Exception:
            pass

    def __repr__(self):
        why = ", ".join(r.name for r in self.reasons) or "-"
        return f"<engram.Table mode={self.mode} backend={self.backend} layers={len(self.layout.layers)} reasons={why}>"


def _check_rc(rc, what):
    if rc != 0:
        raise EngramError(rc, what)


def _stream_handle(s):
    if s is None:
        return None
    if isinstance(s, int) and not isinstance(s, bool):
        h = s
    else:
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            if hasattr(s, attr):
                h = int(getattr(s, attr))
                break
        else:
            raise TypeError(f"stream: a torch.cuda.Stream, a CuPy stream or an int, got {type(s).__name__}")
    if not 0 <= h < 2**64:  # a cudaStream_t: ctypes would wrap anything else silently
        raise ValueError(f"stream: a handle in [0, 2**64), got {h}")
    return h


class Engine:
    """The per-step path of one replica over its table (engram/lookup_engine.h): hash -> prefetch -> wait ->
    staging, lookup, gate. CUDA backend: device arrays, asynchronous on the engine's stream (see Table.engine);
    CPU backend: NumPy (or CPU torch) arrays, synchronous. Staging buffers sit at fixed addresses (CUDA graphs
    replay them). One thread drives an Engine."""

    def __init__(self, table, max_tokens, stream=None, staging=True):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 2**31 - 1:
            # An int32 in the C ABI: ctypes would keep the low 32 bits (and the staging views would lie).
            raise ValueError(f"max_tokens: a positive int below 2**31, got {max_tokens!r}")
        if table._h is None or table._closed:
            raise ValueError("the table is closed")
        self.table = table
        self.layout = table.layout
        self.max_tokens = max_tokens
        self.backend = table.backend
        self._fixed_stream = _stream_handle(stream)
        self._device = ("cpu", None)
        if self.backend == "cuda":
            t = torch_module()
            idx = t.cuda.current_device() if t is not None and t.cuda.is_available() else 0
            self._device = ("cuda", idx)
        self._lock = threading.RLock()
        h = ctypes.c_void_p()
        with table._lock:
            if table._h is None or table._closed:
                raise ValueError("the table is closed")
            _lib.call(_lib.lib.engram_engine_create_flags, table._h, max_tokens, self._fixed_stream or 0,
                      0 if staging else _lib.ENGINE_NO_STAGING, ctypes.byref(h))
        self._h = h
        self._closed = False
        self._views = weakref.WeakSet()  # staging views handed out (each keeps this engine alive)
        table._engines.add(self)
        self._prefetched = None  # keeps the hash ids alive while the side stream reads them

    # -- streams and arrays ---------------------------------------------------------------------------------
    def stream(self):
        """The cudaStream_t the next call runs on (0 on the CPU backend)."""
        if self.backend != "cuda":
            return 0
        if self._fixed_stream is not None:
            return self._fixed_stream
        t = torch_module()
        if t is not None and t.cuda.is_available():
            return t.cuda.current_stream().cuda_stream
        import sys
        cp = sys.modules.get("cupy")
        if cp is not None:
            return cp.cuda.get_current_stream().ptr
        return 0

    def _v(self, x, name, dtypes, shape, contiguous=True, writable=False):
        return check(view(x, name), name, dtypes, shape, self._device, contiguous, writable)

    def _tokens(self, n, name):
        if n > self.max_tokens:
            raise ValueError(f"{name}: {n} tokens; the engine was sized for {self.max_tokens}")

    def _empty(self, like, shape, dtype):
        """A new array of the same kind and device as `like` (a View)."""
        if like.kind == "torch":
            t = torch_module()
            return t.empty(shape, dtype=getattr(t, dtype), device=like.obj.device)
        if like.kind == "numpy":
            import numpy as np
            return np.empty(shape, dtype={"bfloat16": np.uint16}.get(dtype, dtype))
        import cupy
        return cupy.empty(shape, dtype={"bfloat16": "uint16"}.get(dtype, dtype))

    def _bf16(self, v):
        """bf16 arrays: torch bfloat16, or uint16 bits (NumPy, CuPy, torch)."""
        return ("bfloat16", "uint16")

    # -- the calls --------------------------------------------------------------------------------------------
    def hash(self, tokens, positions, query_start_loc, lookback=None, dead=None, lookback_dead=None, out=None):
        """Hash ids of a flattened batch of requests (docs/math.md section 5). tokens int32 [T] raw ids; positions
        int64 [T] (contiguous within each request); query_start_loc int32 [R+1] (0 .. T); lookback int32 [R, N-1], the
        N-1 raw ids before each request's chunk, oldest first, -1 unknown (None: all unknown); dead bool/uint8 [T]
        (DEAD spans: no n-grams across them); lookback_dead bool/uint8 [R, N-1], the columns of lookback: true = that
        lookback id is DEAD (read only where the id is known; needs lookback; None: none dead). Returns (or writes) out
        int32 [T, n_layers, n_cols]."""
        L, C, N = len(self.layout.layers), self.layout.n_cols, self.layout.max_ngram
        tv = self._v(tokens, "tokens", ("int32",), (None,))
        T = tv.shape[0]
        self._tokens(T, "tokens")
        pv = self._v(positions, "positions", ("int64",), (T,))
        qv = self._v(query_start_loc, "query_start_loc", ("int32",), (None,))
        R = qv.shape[0] - 1
        if R < 1:
            raise ValueError("query_start_loc: needs at least two entries (one request)")
        lv = self._v(lookback, "lookback", ("int32",), (R, N - 1)) if lookback is not None else None
        dv = self._v(dead, "dead", ("bool", "uint8"), (T,)) if dead is not None else None
        if lookback_dead is not None and lookback is None:
            raise ValueError("lookback_dead: needs lookback (the ids it flags)")
        ldv = (self._v(lookback_dead, "lookback_dead", ("bool", "uint8"), (R, N - 1))
               if lookback_dead is not None else None)
        if out is None:
            out = self._empty(tv, (T, L, C), "int32")
        ov = self._v(out, "out", ("int32",), (T, L, C), writable=True)
        no_overlap(ov, "out", [(tv, "tokens"), (pv, "positions"), (qv, "query_start_loc"), (lv, "lookback"),
                               (dv, "dead"), (ldv, "lookback_dead")])
        self._c(_lib.lib.engram_engine_hash_v2, tv.ptr, pv.ptr, qv.ptr, lv.ptr if lv else None,
                  ldv.ptr if ldv else None, dv.ptr if dv else None, T, R, ov.ptr, self.stream())
        return out

    def lookup(self, layer, ids, out, packed=False):
        """Rows of table `layer` (0 .. n_layers-1) for ids int32 [T, n_cols] (any row stride; other strides are
        copied) into out: bf16 [T, n_cols, head_dim] (torch bfloat16 or uint16 bits), or with packed=True uint8
        [T, n_cols, record_bytes] (the raw records: head_dim e4m3 bytes + head_dim/32 ue8m0 scales). Ids outside
        this TP shard give zero rows. Returns out."""
        self._layer(layer)
        C, D, RB = self.layout.n_cols, self.layout.head_dim, self.layout.record_bytes
        iv = self._v(ids, "ids", ("int32",), (None, C), contiguous=False)
        T = iv.shape[0]
        self._tokens(T, "ids")
        if C > 1 and iv.strides[1] != 1 or T > 1 and iv.strides[0] < C:
            ids = ids.contiguous() if iv.kind == "torch" else _ascontiguous(ids)
            iv = self._v(ids, "ids", ("int32",), (T, C))
        row_stride = iv.strides[0] if T > 1 else C
        if packed:
            ov = self._v(out, "out", ("uint8",), (T, C, RB), writable=True)
        else:
            ov = self._v(out, "out", self._bf16(None), (T, C, D), writable=True)
        no_overlap(ov, "out", [(iv, "ids")])
        self._c(_lib.lib.engram_engine_lookup, int(layer), iv.ptr, T, row_stride, ov.ptr, int(bool(packed)),
                  self.stream())
        return out

    def lookup_into(self, layer, ids, out, col_begin=0, num_cols=None, background=False):
        """Rows of table `layer` for the hash columns [col_begin, col_begin + num_cols) of ids (int32 or int64 [T, >= col_begin
        + num_cols], unit column stride, any row stride) written into `out` in its own layout: bf16 [T, num_cols,
        head_dim] (each token's rows contiguous, any token stride that keeps 16-byte rows), or uint8 [T, num_cols,
        record_bytes] (packed records, any token stride). This is how an engine writes straight into its own
        buffer: a TP rank's window of heads, vLLM's packed rows at their OUT_STRIDE. background=True: a small grid,
        for a side stream beside the model's kernels. UVA kernels: capturable in a CUDA graph. Returns out."""
        self._layer(layer)
        C, D, RB = self.layout.n_cols, self.layout.head_dim, self.layout.record_bytes
        for n, v in (("col_begin", col_begin), ("num_cols", num_cols)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"{n}: an int, got {type(v).__name__}")
        if num_cols is None:
            num_cols = C - col_begin
        if col_begin < 0 or num_cols < 1 or col_begin + num_cols > C:
            raise ValueError(f"columns [{col_begin}, {col_begin + num_cols}) outside the table's [0, {C})")
        iv = self._v(ids, "ids", ("int32", "int64"), (None, None), contiguous=False)
        T = iv.shape[0]
        self._tokens(T, "ids")
        if iv.shape[1] < col_begin + num_cols:
            raise ValueError(f"ids: {iv.shape[1]} columns, the window needs {col_begin + num_cols}")
        if iv.shape[1] > 1 and iv.strides[1] != 1:
            raise ValueError(f"ids: column stride {iv.strides[1]}: the columns of a token must be contiguous")
        ids_stride = iv.strides[0] if T > 1 else iv.shape[1]
        if T > 1 and ids_stride < col_begin + num_cols:
            raise ValueError(f"ids: row stride {ids_stride} overlaps the next token's columns")
        packed = _is_packed(out)
        ov = self._v(out, "out", ("uint8",) if packed else self._bf16(None), (T, num_cols, RB if packed else D),
                     contiguous=False, writable=True)
        row = RB if packed else D
        if (num_cols > 1 and ov.strides[1] != row) or ov.strides[2] != 1:
            raise ValueError(f"out: strides {list(ov.strides)}: each token's rows must be contiguous "
                             f"({row} {'bytes' if packed else 'values'} apart)")
        token_stride = ov.strides[0] if T > 1 else num_cols * row
        if T > 1 and token_stride < num_cols * row:
            raise ValueError(f"out: token stride {token_stride} overlaps the next token's rows")
        if not packed and (token_stride % 8 or ov.ptr % 16):
            raise ValueError("out: bf16 rows must start 16-byte aligned (token stride a multiple of 8 values)")
        isz = 8 if iv.dtype == "int64" else 4
        _no_overlap(_span(iv, T, ids_stride, iv.shape[1], isz),
                    _span(ov, T, token_stride, num_cols * row, 1 if packed else 2))
        flags = (_lib.LOOKUP_PACKED if packed else 0) | (_lib.LOOKUP_BACKGROUND if background else 0) | \
            (_lib.LOOKUP_IDS64 if iv.dtype == "int64" else 0)
        self._c(_lib.lib.engram_engine_lookup_into, int(layer), iv.ptr, T, ids_stride, col_begin,
                  num_cols, ov.ptr, token_stride, flags, self.stream())
        return out

    def set_lookup_path(self, path):
        """The path of later prefetches: "auto" (per batch), "uva" (the UVA kernels: what CUDA-graph capture takes,
        and what DP ranks that must take the same path force) or "host_gather". The CPU backend has one path and
        accepts "auto" only."""
        if path not in _lib.LOOKUP_PATHS:
            raise ValueError(f"path: one of {', '.join(_lib.LOOKUP_PATHS)}, got {path!r}")
        self._c(_lib.lib.engram_engine_set_lookup_path, _lib.LOOKUP_PATHS[path])

    @property
    def last_lookup_path(self):
        """The path the last prefetch took: "uva", "host_gather", or "auto" before the first (and on the CPU)."""
        with self._lock:
            code = _lib.lib.engram_engine_last_lookup_path(self._live())
        return {v: k for k, v in _lib.LOOKUP_PATHS.items()}.get(code, "auto")

    def prefetch(self, hash_ids):
        """Every layer's rows for hash ids int32 [T, n_layers, n_cols] into the staging buffers: on the CUDA backend
        on the engine's side stream, after the work already queued on the current stream; wait(layer) orders the
        current stream after that layer's rows."""
        L, C = len(self.layout.layers), self.layout.n_cols
        hv = self._v(hash_ids, "hash_ids", ("int32",), (None, L, C))
        self._tokens(hv.shape[0], "hash_ids")
        self._c(_lib.lib.engram_engine_prefetch, hv.ptr, hv.shape[0], self.stream())
        self._prefetched = hash_ids
        return None

    def wait(self, layer):
        """Orders the current stream after layer `layer`'s prefetched rows (never blocks the host)."""
        self._layer(layer)
        self._c(_lib.lib.engram_engine_wait, int(layer), self.stream())

    def staging(self, layer):
        """The staging buffer of `layer`: bf16 [max_tokens, n_cols, head_dim] at a fixed address for the engine's
        life (a torch bfloat16 tensor on CUDA; NumPy uint16 bits on the CPU backend). A view: valid while the
        Engine lives. A new view at every call (cheap); not cached in the engine, since a view keeps its engine
        alive and an engine holding its views would be a cycle through torch that Python's collector cannot see."""
        self._layer(layer)
        shape = (self.max_tokens, self.layout.n_cols, self.layout.head_dim)
        t = torch_module() if self.backend == "cuda" else None
        if self.backend == "cuda" and t is None:
            raise RuntimeError("staging() on the CUDA backend returns a torch tensor: torch is not importable")
        with self._lock:  # until the view is tracked: a close() in another thread cannot free under it
            ptr = _lib.lib.engram_engine_staging(self._live(), int(layer))
            if not ptr:
                raise EngramError(13, f"no staging buffer for layer {layer}")
            if self.backend == "cuda":
                arr = _DeviceBuffer(ptr, shape, "<i2", self._device[1], owner=self)
            else:
                arr = _HostView(ptr, shape, "<u2", owner=self)
            self._views.add(arr)
        if self.backend == "cuda":
            return t.as_tensor(arr, device=f"cuda:{self._device[1]}").view(t.bfloat16)
        import numpy as np
        return np.asarray(arr)

    def gate(self, hidden, kv, q_weight, k_weight, dead=None, out=None, eps=None):
        """docs/math.md section 7: out[t, c] = hidden[t, c] + g * value, g = 0 for DEAD tokens. hidden bf16
        [T, hc_mult, D], kv bf16 [T, (hc_mult + 1) * D], q_weight / k_weight bf16 [hc_mult, D], dead bool/uint8 [T]
        or None; eps defaults to the checkpoint's rms_norm_eps. Returns (or writes) out bf16 [T, hc_mult, D]."""
        bf = self._bf16(None)
        hv = self._v(hidden, "hidden", bf, (None, None, None))
        T, HC, D = hv.shape
        self._tokens(T, "hidden")
        if HC < 1 or D < 1:
            raise ValueError(f"hidden: shape {list(hv.shape)} has an empty dimension")
        kvv = self._v(kv, "kv", (hv.dtype,), (T, (HC + 1) * D))
        qv = self._v(q_weight, "q_weight", (hv.dtype,), (HC, D))
        kwv = self._v(k_weight, "k_weight", (hv.dtype,), (HC, D))
        dv = self._v(dead, "dead", ("bool", "uint8"), (T,)) if dead is not None else None
        if out is None:
            out = self._empty(hv, (T, HC, D), "bfloat16" if hv.dtype == "bfloat16" else "uint16")
        ov = self._v(out, "out", (hv.dtype,), (T, HC, D), writable=True)
        no_overlap(ov, "out", [(hv, "hidden"), (kvv, "kv"), (qv, "q_weight"), (kwv, "k_weight"), (dv, "dead")])
        a = _lib.GateArgs(hv.ptr, kvv.ptr, qv.ptr, kwv.ptr, dv.ptr if dv else None, ov.ptr, T, HC, D,
                          float(self.layout.rms_norm_eps if eps is None else eps))
        self._c(_lib.lib.engram_engine_gate, ctypes.byref(a), self.stream())
        return out

    def _layer(self, layer):
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer: an int table index, got {type(layer).__name__}")
        if not 0 <= layer < len(self.layout.layers):
            raise ValueError(f"layer {layer} outside [0, {len(self.layout.layers)})")

    def _live(self):
        if self._closed or not self._h:
            raise ValueError("the engine is closed")
        return self._h

    def _c(self, fn, *args):
        """One library call on this engine, under its lock: close() from another thread waits for it to return."""
        with self._lock:
            return _lib.call(fn, self._live(), *args)

    def close(self):
        """Ends its use (every call raises ValueError afterwards); the engine is freed at once when no staging view
        of it is alive, else when the last one goes. A call running in another thread finishes first."""
        with self._lock:
            self._closed = True
        self._release()

    def _release(self, leaving=None):
        with self._lock:
            _free_if_unused(self, list(self._views), leaving=leaving)

    def _free(self):
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:  # taken once: a second caller finds no handle
            h, self._h = getattr(self, "_h", None), None
        if h:
            _lib.lib.engram_engine_free(h)
            self.table._release(leaving=self)

    def __del__(self):
        try:
            self._free()
        except Exception:
            pass


def _free_if_unused(owner, users, leaving=None):
    """The one rule that frees what the library owns: `owner` (a Table or an Engine) is freed once it is closed
    and none of `users` (its live engines, or the staging views of an engine) is left but `leaving`, the one going
    now."""
    if owner._closed and not any(u is not leaving for u in list(users)):
        owner._free()


def _is_packed(out):
    """uint8 output = packed records; anything else is checked as bf16."""
    try:
        v = view(out, "out")
    except TypeError:
        return False
    return v.dtype == "uint8"


def _span(v, n, stride, per_token, itemsize):
    """[first, last) byte addresses of n tokens, `stride` elements apart, `per_token` elements each."""
    return (v.ptr, v.ptr + ((n - 1) * stride + per_token) * itemsize) if n > 0 else (v.ptr, v.ptr)


def _no_overlap(ids_span, out_span):
    """ValueError when the output's bytes overlap the ids' (a write over an input the kernel is still reading)."""
    if ids_span[0] < out_span[1] and out_span[0] < ids_span[1]:
        raise ValueError("out: overlaps ids")


def _ascontiguous(x):
    import sys
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    import cupy
    return cupy.ascontiguousarray(x)


class _View:
    """Keeps its `owner` (an Engine, or a Table for records()) alive while an array made from it lives; the last
    view of a closed owner frees it."""

    def __del__(self):
        o = getattr(self, "_owner", None)
        if o is not None:
            try:
                o._release(leaving=self)
            except Exception:
                pass


class _HostView(_View):
    """Host memory owned by the library (a CPU engine's staging), described through __array_interface__ for
    np.asarray; it keeps `owner` (the Engine) alive for as long as any array made from it lives."""

    def __init__(self, ptr, shape, typestr, owner):
        self._owner = owner
        self.__array_interface__ = {"data": (int(ptr), False), "shape": tuple(shape), "typestr": typestr,
                                    "version": 3}


class _HostRecords(_View):
    """A table's host records (library-owned, read-only) through __array_interface__; keeps the Table, and its
    mapping, alive."""

    def __init__(self, ptr, shape, owner):
        self._owner = owner
        self.__array_interface__ = {"data": (int(ptr), True), "shape": tuple(shape), "typestr": "|u1", "version": 3}


class _DeviceBuffer(_View):
    """A device allocation owned by the library, described through __cuda_array_interface__ (for torch.as_tensor);
    it keeps `owner` (the Engine, when given) alive for as long as a tensor made from it lives."""

    def __init__(self, ptr, shape, typestr, device, owner=None):
        self._owner = owner
        self.__cuda_array_interface__ = {"data": (int(ptr), False), "shape": tuple(shape), "typestr": typestr,
                                         "version": 2, "strides": None}
