"""The ctypes binding of libengram_c.so (engram/engram_c.h): where the library is found, every signature, the
check that the library is the build this package expects, and the route of the library's log into Python's logging.

Nothing here loads the library at import: `import engram` (and the engines' plugins) never fails for want of it.
The library loads on first use (`load()`, or the first attribute of `lib`); a library that cannot be found, loaded
or is of another build raises LibraryError, which names what was tried and what differs. Search order: $ENGRAM_LIB
(a file), the package directory (where the wheel puts it), then the build trees of a source checkout
($ENGRAM_BUILD_DIR, <repo>/build, <repo>/build-*). Loaded once per process; the handle is shared and thread-safe
to read (each table/engine is driven by one thread, as the C API says).

Once loaded, the library's own lines (event=attached, lease_lost, ...) go to the Python logger `engram` (or the
one a plugin names with route_log), at their level, instead of raw stderr; ENGRAM_LOG_STDERR=1 keeps them on stderr.
"""
import atexit
import ctypes
import glob
import logging
import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_NAME = "libengram_c.so"

# The C ABI this binding declares (ENGRAM_ABI_VERSION of engram/engram_c.h): a library reporting another is refused.
ABI_VERSION = 1


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


class LibraryError(EngramError):
    """libengram_c.so cannot be used: not found, not loadable, or of another build than this package (code 9,
    FAILED_PRECONDITION). Raised by the first call that needs the library, never by an import."""

    def __init__(self, message):
        super().__init__(9, message)


def package_version():
    """This package's version when it was installed from a wheel (engram/_version.py), else None (a source tree:
    the library's version stands for it)."""
    try:
        from ._version import __version__
        return __version__
    except ImportError:
        return None


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


_lock = threading.Lock()
_loaded = {"lib": None, "path": None, "error": None, "version": None}


def _open():
    tried = []
    for cand in _candidates():
        tried.append(cand)
        if os.path.isfile(cand):
            cand = os.path.abspath(cand)  # a bare name would make dlopen search the library path instead
            try:
                return ctypes.CDLL(cand), cand
            except OSError as e:
                raise LibraryError(f"{cand} cannot be loaded: {e}") from None
    raise LibraryError(f"{_NAME} not found (tried {', '.join(tried)}): install the engram wheel into this "
                       "environment, or point ENGRAM_LIB at the library of a build")


def _check_build(cdll, where):
    """The library's version, after checking that its C ABI (and, for an installed package, its version) is this
    package's."""
    pkg = package_version()
    mine = f"the engram package {pkg or '(source tree)'} (C ABI {ABI_VERSION})"
    try:
        abi_fn, ver_fn = cdll.engram_abi_version, cdll.engram_version
    except AttributeError:
        raise LibraryError(f"{where} reports no C ABI version: it is an older build than {mine}; install the "
                           "library of the same build") from None
    abi_fn.restype, abi_fn.argtypes = ctypes.c_int, []
    ver_fn.restype, ver_fn.argtypes = ctypes.c_char_p, []
    abi = int(abi_fn())
    version = (ver_fn() or b"?").decode("utf-8", "replace")
    if abi != ABI_VERSION or (pkg is not None and version != pkg):
        raise LibraryError(f"{where} is engram {version} (C ABI {abi}), which {mine} cannot use: install the "
                           "package and the library of one build")
    return version


def load():
    """The loaded library (a ctypes.CDLL), loading it on the first call; LibraryError when it cannot be used (the
    same error on every later call)."""
    cdll = _loaded["lib"]
    if cdll is not None:
        return cdll
    with _lock:
        if _loaded["lib"] is not None:
            return _loaded["lib"]
        if _loaded["error"] is not None:
            raise _loaded["error"]
        try:
            cdll, where = _open()
            version = _check_build(cdll, where)
            _declare(cdll)
        except LibraryError as e:
            _loaded["error"] = e
            raise
        except AttributeError as e:  # a symbol this binding declares is missing
            _loaded["error"] = LibraryError(f"{where} lacks a function of the C ABI: {e}")
            raise _loaded["error"] from None
        _loaded.update(path=where, version=version)
        _route_log_lines(cdll)
        _loaded["lib"] = cdll
        return cdll


def loaded_path():
    """The path of the loaded library, or None before the first use."""
    return _loaded["path"]


def library_version():
    """The loaded library's version (loads it)."""
    load()
    return _loaded["version"]


def _reset_for_tests():
    """Forgets the loaded library or the cached failure (tests that change ENGRAM_LIB in-process)."""
    with _lock:
        cdll = _loaded["lib"]
        if cdll is not None:
            cdll.engram_set_log_callback(_LOG_FN(), None)
        _loaded.update(lib=None, path=None, error=None, version=None)


class _Lazy:
    """`lib`: the library's functions, loading it on the first attribute asked for."""

    def __getattr__(self, name):
        return getattr(load(), name)


lib = _Lazy()


def __getattr__(name):  # `_lib.path`: the loaded library's path (loads it)
    if name == "path":
        load()
        return _loaded["path"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the library's log, into Python's logging ----------------------------------------------------------------------

_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}
_log = {"logger": logging.getLogger("engram"), "fn": None}
_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def route_log(logger):
    """Sends the library's lines to `logger` (a logging.Logger or a name) from now on; the plugins name their
    engine's logger, so the lines carry the engine's format. Loads nothing."""
    _log["logger"] = logging.getLogger(logger) if isinstance(logger, str) else logger
    cdll = _loaded["lib"]
    if cdll is not None and _log["fn"] is not None:
        cdll.engram_set_log_level(_c_level(_log["logger"]))


def _c_level(logger):
    eff = logger.getEffectiveLevel()
    return 0 if eff <= logging.DEBUG else 1 if eff <= logging.INFO else 2 if eff <= logging.WARNING else 3


def _on_line(level, line, _user):
    try:
        _log["logger"].log(_LEVELS.get(level, logging.INFO), "%s", (line or b"").decode("utf-8", "replace"))
    except Exception:  # a handler's failure never reaches the library's thread
        pass


def _route_log_lines(cdll):
    if os.environ.get("ENGRAM_LOG_STDERR", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    fn = _LOG_FN(_on_line)
    _log["fn"] = fn  # kept alive as long as the library may call it
    cdll.engram_set_log_level(_c_level(_log["logger"]))
    cdll.engram_set_log_callback(fn, None)
    # The interpreter's end: the library's threads must not call into a finalising runtime.
    atexit.register(cdll.engram_set_log_callback, _LOG_FN(), None)  # _LOG_FN(): a NULL callback


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


LOOKUP_PACKED, LOOKUP_BACKGROUND, LOOKUP_IDS64 = 1, 2, 4
LOOKUP_PATHS = {"auto": 0, "uva": 1, "host_gather": 2}
ENGINE_NO_STAGING = 1


def _declare(cdll):
    """Sets every function's signature (the library's symbols; AttributeError for a missing one)."""

    def _sig(name, res, *args):
        f = getattr(cdll, name)
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

    _sig("engram_engine_create", _c.c_int, _P, _c.c_int32, _u, _c.POINTER(_P), *_errbuf)
    _sig("engram_engine_create_flags", _c.c_int, _P, _c.c_int32, _u, _c.c_int, _c.POINTER(_P), *_errbuf)
    _sig("engram_engine_free", None, _P)
    _sig("engram_engine_backend", _c.c_char_p, _P)
    _sig("engram_engine_max_tokens", _c.c_int32, _P)
    _sig("engram_engine_hash", _c.c_int, _P, _P, _P, _P, _P, _P, _c.c_int32, _c.c_int32, _P, _u, *_errbuf)
    _sig("engram_engine_hash_v2", _c.c_int, _P, _P, _P, _P, _P, _P, _P, _c.c_int32, _c.c_int32, _P, _u, *_errbuf)
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
    _sig("engram_version", _c.c_char_p)  # the library's version, static storage
    _sig("engram_abi_version", _c.c_int)  # ENGRAM_ABI_VERSION of engram/engram_c.h
    _sig("engram_set_log_callback", None, _LOG_FN, _P)
    _sig("engram_set_log_level", None, _c.c_int)


def call(fn, *args):
    """Calls a status-returning function with an error buffer appended; raises EngramError on failure."""
    err = _c.create_string_buffer(1024)
    rc = fn(*args, err, len(err))
    if rc != 0:
        msg = err.value.decode("utf-8", "replace")
        if rc == 3:  # INVALID_ARGUMENT: the caller's values, said as Python says it
            raise ValueError(msg)
        raise EngramError(rc, msg)
