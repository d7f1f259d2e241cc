"""engram.Engine: one replica's per-step path over its table (hash, prefetch, wait, staging, lookup, gate), with the
checks that every array passes before a pointer reaches C. The contract of the package is in engram/__init__.py."""
import ctypes
import threading
import weakref

from . import _lib
from ._arrays import check, no_overlap, torch_module, view
from ._lib import EngramError
from ._views import _DeviceBuffer, _HostView, _free_if_unused


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
