"""The ctypes binding of libengram_c.so (engram/engram_c.h): where the library is found and every signature.

Search order for the library: $ENGRAM_LIB (a file), the package directory (where `cmake --install` puts it), then
the build trees of a source checkout ($ENGRAM_BUILD_DIR, <repo>/build, <repo>/build-*). Loaded once per process;
the handle is shared and thread-safe to read (each table/engine is driven by one thread, as the C API says).
"""
import ctypes
import glob
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_NAME = "libengram_c.so"


class EngramError(RuntimeError):
    """A failure reported by libengram_c: `code` is the absl/gRPC status code, the message says what happened."""

    CODES = {1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
             6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
             10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
             15: "DATA_LOSS", 16: "UNAUTHENTICATED"}

    def __init__(self, code, message):
        self.code = code
        self.code_name = self.CODES.get(code, str(code))
        super().__init__(f"{self.code_name}: {message}")


def _candidates():
    env = os.environ.get("ENGRAM_LIB")
    if env:
        yield env
        return
    yield os.path.join(_HERE, _NAME)
    repo = os.path.dirname(os.path.dirname(_HERE))
    build = os.environ.get("ENGRAM_BUILD_DIR")
    if build:
        yield os.path.join(build, "client", _NAME)
    yield os.path.join(repo, "build", "client", _NAME)
    yield from sorted(glob.glob(os.path.join(repo, "build-*", "client", _NAME)))


def _load():
    tried = []
    for path in _candidates():
        tried.append(path)
        if os.path.isfile(path):
            return ctypes.CDLL(path), path
    raise ImportError(
        f"engram: {_NAME} not found (tried {', '.join(tried)}); build the engram_c target or run `cmake --install`, "
        "or point ENGRAM_LIB at the library")


lib, path = _load()

_c = ctypes
_P = _c.c_void_p
_sz = _c.c_size_t
_u = _c.c_size_t  # uintptr_t (same width on every platform we build for)
_errbuf = (_c.c_char_p, _sz)


class AttachRequest(_c.Structure):
    _fields_ = [("checkpoint", _c.c_char_p), ("tp_size", _c.c_int), ("tp_rank", _c.c_int), ("dp_size", _c.c_int),
                ("dp_rank", _c.c_int), ("local_dp_size", _c.c_int), ("elastic_ep", _c.c_int),
                ("cpu_offload", _c.c_int), ("dp_shared_memory", _c.c_int), ("embedding_across_dp", _c.c_int),
                ("shm_dir", _c.c_char_p), ("use_gpu", _c.c_int), ("private_fallback", _c.c_int)]


class GateArgs(_c.Structure):
    _fields_ = [("hidden", _P), ("kv", _P), ("q_weight", _P), ("k_weight", _P), ("mask", _P), ("out", _P),
                ("num_tokens", _c.c_int32), ("hc_mult", _c.c_int32), ("dim", _c.c_int32), ("eps", _c.c_float)]


def _sig(name, res, *args):
    f = getattr(lib, name)
    f.restype = res
    f.argtypes = list(args)


_sig("engram_attach", _c.c_int, _c.c_char_p, _c.c_int, _c.POINTER(AttachRequest), _c.POINTER(_P), *_errbuf)
_sig("engram_table_free", None, _P)
for _n in ("engram_table_mode", "engram_table_backend"):
    _sig(_n, _c.c_char_p, _P)
_sig("engram_table_num_reasons", _c.c_int, _P)
_sig("engram_table_reason", _c.c_char_p, _P, _c.c_int)
_sig("engram_table_reason_hint", _c.c_char_p, _P, _c.c_int)
_sig("engram_table_reason_code", _c.c_int, _P, _c.c_int)
_sig("engram_reason_name", _c.c_char_p, _c.c_int)
for _n in ("engram_table_num_layers", "engram_table_num_cols", "engram_table_head_dim", "engram_table_max_ngram",
           "engram_table_record_bytes", "engram_table_hidden_size", "engram_table_hc_mult"):
    _sig(_n, _c.c_int, _P)
_sig("engram_table_raw_vocab", _c.c_int64, _P)
_sig("engram_table_pad_token_id", _c.c_int64, _P)
_sig("engram_table_rms_norm_eps", _c.c_double, _P)
_sig("engram_table_register_seconds", _c.c_double, _P)
_sig("engram_table_layer_id", _c.c_int64, _P, _c.c_int)
_sig("engram_table_layer_rows", _c.c_int, _P, _c.c_int, _c.POINTER(_c.c_int64), _c.POINTER(_c.c_int64))
_sig("engram_table_column_rows", _c.c_int, _P, _c.c_int, _c.POINTER(_c.c_int64), _c.c_int)
_sig("engram_table_col_range", _c.c_int, _P, _c.POINTER(_c.c_int), _c.POINTER(_c.c_int))
_sig("engram_table_staging_col_range", _c.c_int, _P, _c.POINTER(_c.c_int), _c.POINTER(_c.c_int))
_sig("engram_table_records", _c.c_int, _P, _c.c_int, _c.POINTER(_P))

LOOKUP_PACKED, LOOKUP_BACKGROUND, LOOKUP_IDS64 = 1, 2, 4
LOOKUP_PATHS = {"auto": 0, "uva": 1, "host_gather": 2}

_sig("engram_engine_create", _c.c_int, _P, _c.c_int32, _u, _c.POINTER(_P), *_errbuf)
_sig("engram_engine_create_flags", _c.c_int, _P, _c.c_int32, _u, _c.c_int, _c.POINTER(_P), *_errbuf)
ENGINE_NO_STAGING = 1
_sig("engram_engine_free", None, _P)
_sig("engram_engine_backend", _c.c_char_p, _P)
_sig("engram_engine_max_tokens", _c.c_int32, _P)
_sig("engram_engine_hash", _c.c_int, _P, _P, _P, _P, _P, _P, _c.c_int32, _c.c_int32, _P, _u, *_errbuf)
_sig("engram_engine_lookup", _c.c_int, _P, _c.c_int, _P, _c.c_int32, _c.c_int64, _P, _c.c_int, _u, *_errbuf)
_sig("engram_engine_lookup_into", _c.c_int, _P, _c.c_int, _P, _c.c_int32, _c.c_int64, _c.c_int32, _c.c_int32, _P,
     _c.c_int64, _c.c_int, _u, *_errbuf)
_sig("engram_engine_set_lookup_path", _c.c_int, _P, _c.c_int, *_errbuf)
_sig("engram_engine_last_lookup_path", _c.c_int, _P)
_sig("engram_engine_prefetch", _c.c_int, _P, _P, _c.c_int32, _u, *_errbuf)
_sig("engram_engine_wait", _c.c_int, _P, _c.c_int, _u, *_errbuf)
_sig("engram_engine_staging", _P, _P, _c.c_int)
_sig("engram_engine_gate", _c.c_int, _P, _c.POINTER(GateArgs), _u, *_errbuf)
_sig("engram_status_json", _c.c_int, _c.c_char_p, _c.c_int, _c.POINTER(_P), *_errbuf)
_sig("engram_string_free", None, _P)


def call(fn, *args):
    """Calls a status-returning function with an error buffer appended; raises EngramError on failure."""
    err = _c.create_string_buffer(1024)
    rc = fn(*args, err, len(err))
    if rc != 0:
        msg = err.value.decode("utf-8", "replace")
        if rc == 3:  # INVALID_ARGUMENT: the caller's values, said as Python says it
            raise ValueError(msg)
        raise EngramError(rc, msg)
