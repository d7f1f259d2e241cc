"""engram.Table: an attached table (mode, backend, reasons, layout), its host records and its engines; and the
namedtuples that describe it (Reason, LayerLayout, Layout). The contract of the package is in engram/__init__.py."""
import ctypes
import threading
import weakref
from collections import namedtuple

from . import _lib
from ._lib import EngramError
from ._views import _HostRecords, _check_rc, _free_if_unused, _s

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
        from ._engine import Engine
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
