"""engram.sglang: the SGLang plugin that gives DeepSeek-V4.1's Engram layers their tables from engramd.

SGLang loads it in its processes (entry point group `sglang.srt.plugins`, name `engram`; `SGLANG_PLUGINS` filters
by that name). Configured by environment variables (SGLang is configured that way):

    ENGRAM_SGLANG_SOCKET=/run/engramd/engramd.sock python -m sglang.launch_server --model-path /models/DeepSeek-V4.1-Flash ...

ENGRAM_SGLANG_SOCKET (ENGRAM_SGLANG=1: on with the default socket /run/engramd/engramd.sock), ENGRAM_SGLANG_REQUIRE
(see below), ENGRAM_SGLANG_CHECKPOINT (the directory engramd serves; default SGLang's model path),
ENGRAM_SGLANG_TIMEOUT_MS (10000). Unconfigured, `register()` installs nothing: SGLang runs as it is.

Configured, `register()` (no CUDA) checks what serving needs: SGLang's Engram surface (`check_surface`), the engram
library (it loads), and engramd (it answers on the socket). All there: the plugin installs EngramdEmbedding, a
subclass of SGLang's `sglang.srt.layers.engram.EngramEmbedding`. On a SGLang with the plugin hook registry
(`sglang.srt.plugins.hook_registry`) it goes through `HookRegistry.register(target, cls, HookType.REPLACE)`: SGLang's
loader applies the hook once every plugin has run, to the module and to every `from sglang.srt.layers.engram import
EngramEmbedding` copy other modules hold. On a SGLang without the registry it replaces the module's attribute
(SGLang's `Engram.__init__` looks the class up in that module when it builds a layer). The log says which way, at
INFO: `engram.sglang: event=installed via=hook_registry|module_attribute sglang=<version> ...`.

Something missing: without ENGRAM_SGLANG_REQUIRE, SGLang keeps its own class and table, and one WARNING (logger
`sglang.engram`) says why (`event=fallback`, or `event=refused` for a SGLang whose surface differs). With
ENGRAM_SGLANG_REQUIRE=true it is a startup error naming what is missing: SGLang's plugin loader catches and only logs
what a plugin's register function raises (`execute_plugin_callbacks`), so `register()` raises nothing; it installs a
class whose construction raises the error, and the first Engram layer SGLang builds stops the server with it.
The same rules hold when a layer is built: engramd's table must be the layer's (its rows; a weight loader compares
a few rows of the loaded tensor with the served segment: another checkpoint is a startup error).

Each process attaches once, to the TP 1 segment: like SGLang's shared host layout, every SGLang rank gathers every
column of its tokens from one host copy, with no all-reduce. Each layer's EngramdEmbedding allocates no table memory
(one-row parameters), its weight loader reads no table bytes, and `forward(indices, ...)` runs the engram engine on
the current stream with SGLang's int64 ids, into a bf16 [*indices.shape, dim] result as SGLang's own gather returns
it: no host synchronisation, capturable in SGLang's CUDA graphs. SGLang's hashing, wkv and gate stay SGLang's.

Tested against SGLang's python/sglang/srt/layers/engram.py at the commits listed in docs/api.md (SGLang section):
served where EngramEmbedding is (num_embeddings, dim, layer_id) with forward(indices, forward_batch=None, *,
cp_all_tokens=False); refused elsewhere (fail closed). Thread-safety: the per-process state is guarded by a lock.
"""
import inspect
import logging
import os
import threading
import time

from . import _plugin

MODULE = "sglang.srt.layers.engram"
TARGET = MODULE + ".EngramEmbedding"
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"
TESTED_SGLANG_FILES = ("python/sglang/srt/layers/engram.py of SGLang 4be612a4 with EngramEmbedding(num_embeddings, "
                       "dim, layer_id) and EngramEmbedding.forward(indices, forward_batch=None, *, "
                       "cp_all_tokens=False)",)
DEFAULT_SOCKET = "/run/engramd/engramd.sock"

logger = logging.getLogger("sglang.engram")

# Ids per engine call: a larger batch (a long prefill) is looked up in pieces of this many ids.
_MAX_IDS = 1 << 16

_lock = threading.RLock()
_state = {"registered": False, "module": None, "original": None, "installed": None, "via": None, "attachment": None,
          "fallback_logged": set()}


class PluginConfig:
    def __init__(self, socket=DEFAULT_SOCKET, require=False, checkpoint=None, timeout_ms=10000):
        self.socket, self.require, self.checkpoint, self.timeout_ms = socket, require, checkpoint, timeout_ms


def plugin_config(environ=None):
    """The PluginConfig the environment gives, or None when the plugin is not configured; ValueError for a value
    that does not parse."""
    env = os.environ if environ is None else environ

    def boolean(name):
        try:
            return _plugin.env_bool(name, env.get(name, ""))
        except ValueError as e:
            raise ValueError(f"engram.sglang: {e}") from None

    if not env.get("ENGRAM_SGLANG_SOCKET") and not boolean("ENGRAM_SGLANG"):
        return None
    cfg = PluginConfig(socket=env.get("ENGRAM_SGLANG_SOCKET") or DEFAULT_SOCKET,
                       require=boolean("ENGRAM_SGLANG_REQUIRE"),
                       checkpoint=env.get("ENGRAM_SGLANG_CHECKPOINT") or None)
    if env.get("ENGRAM_SGLANG_TIMEOUT_MS"):
        try:
            cfg.timeout_ms = int(env["ENGRAM_SGLANG_TIMEOUT_MS"])
        except ValueError:
            raise ValueError(f"engram.sglang: ENGRAM_SGLANG_TIMEOUT_MS={env['ENGRAM_SGLANG_TIMEOUT_MS']!r}: expected "
                             "an integer") from None
        if cfg.timeout_ms < 1:
            raise ValueError(f"engram.sglang: ENGRAM_SGLANG_TIMEOUT_MS must be >= 1, got {cfg.timeout_ms}")
    return cfg


def sglang_version():
    import sys
    s = sys.modules.get("sglang")
    return getattr(s, "__version__", "unknown") if s is not None else "not imported"


def _params(fn):
    try:
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return None


def check_surface(mod):
    """What the running SGLang's Engram module lacks of the surface this plugin relies on (sentences; empty when
    everything is there)."""
    problems = []
    cls = getattr(mod, "EngramEmbedding", None)
    if cls is None:
        return ["no class EngramEmbedding"]
    P = inspect.Parameter
    init = _params(cls.__init__)
    if init is None or [n for n, _ in init] != ["self", "num_embeddings", "dim", "layer_id"]:
        problems.append("EngramEmbedding.__init__ is not (num_embeddings, dim, layer_id)")
    fwd = _params(getattr(cls, "forward", None))
    if fwd is None or [n for n, _ in fwd] != ["self", "indices", "forward_batch", "cp_all_tokens"] or \
            fwd[3][1] is not P.KEYWORD_ONLY:
        problems.append("EngramEmbedding.forward is not (indices, forward_batch=None, *, cp_all_tokens=False)")
    for name in ("finish_load", "_load_rows"):
        if not callable(getattr(cls, name, None)):
            problems.append(f"EngramEmbedding has no {name}")
    if getattr(mod, "Engram", None) is None:
        problems.append("no class Engram")
    for fn in ("get_parallel", "get_model"):
        if not callable(getattr(mod, fn, None)):
            problems.append(f"no function {fn}")
    return problems


def _surface_difference(what):
    return (f"SGLang {sglang_version()} differs from the Engram interface this plugin was tested against "
            f"({'; '.join(TESTED_SGLANG_FILES)}): {what}")


def _surface_error(what):
    return RuntimeError(f"engram.sglang: {_surface_difference(what)}. The plugin refuses to run on it (fail closed); "
                        "unset ENGRAM_SGLANG_SOCKET to serve with SGLang's own tables")


def _library_problem():
    """Why the engram library cannot be used here (None: it loads)."""
    try:
        from . import _lib
        load = getattr(_lib, "load", None)
        if load is not None:
            load()
        else:
            _lib.lib.engram_status_json  # the first attribute loads the library
    except Exception as e:  # EngramError (LibraryError), OSError, RuntimeError: the library's own words
        return f"the engram library cannot be loaded ({type(e).__name__}: {e})"
    return None


def _engramd_problem(cfg):
    """Why engramd does not answer on cfg.socket (None: it does)."""
    try:
        import engram
        engram.status(cfg.socket, timeout_ms=min(cfg.timeout_ms, _REACH_MS))
    except Exception as e:
        return f"engramd does not answer on {cfg.socket} ({e})"
    return None


# How long register()'s reachability check waits for engramd at most (the attach waits ENGRAM_SGLANG_TIMEOUT_MS).
_REACH_MS = 2000


def _hook_registry():
    """SGLang's plugin hook registry module, or None on a SGLang without it (or with another API)."""
    import importlib
    try:
        hr = importlib.import_module(HOOK_REGISTRY)
    except ImportError:
        return None
    reg, types_ = getattr(hr, "HookRegistry", None), getattr(hr, "HookType", None)
    if reg is None or not callable(getattr(reg, "register", None)) or not callable(getattr(reg, "apply_hooks", None)) \
            or getattr(types_, "REPLACE", None) is None:
        return None
    return hr


def register():
    """SGLang's entry point, once per process (no CUDA; never raises: SGLang's loader would only log it). Idle on a
    SGLang without DeepSeek-V4.1's Engram module or when unconfigured; otherwise checks the surface, the library and
    engramd, then installs the replacement (the hook registry where SGLang has it), keeps SGLang's own with one
    WARNING saying why, or (ENGRAM_SGLANG_REQUIRE) installs a class whose construction is the startup error."""
    with _lock:
        if _state["registered"]:
            return
        _state["registered"] = True
        try:
            _register()
        except Exception as e:  # a fault of the plugin itself: SGLang as it is, and the log says why
            logger.exception("engram.sglang: event=fallback sglang=%s detail=\"the plugin failed: %s\": SGLang keeps "
                             "its own Engram table", sglang_version(), e)


def _register():
    import importlib
    try:
        cfg = plugin_config()
    except ValueError as e:
        cfg, bad = None, str(e)
    else:
        bad = None
    if cfg is None and bad is None:
        logger.info("engram.sglang: event=idle sglang=%s reason=\"not configured (ENGRAM_SGLANG_SOCKET or "
                    "ENGRAM_SGLANG=1 turns it on)\"", sglang_version())
        return
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:
        logger.warning("engram.sglang: event=idle sglang=%s reason=\"this SGLang has no %s (%s): no Engram layer to "
                       "serve\"", sglang_version(), MODULE, e)
        return
    if bad is not None:  # a setting that does not parse: the first layer says so, whatever REQUIRE says
        _install(mod, [], error=RuntimeError(bad))
        logger.error("engram.sglang: event=startup_error sglang=%s detail=\"%s\"", sglang_version(), bad)
        return
    cls = getattr(mod, "EngramEmbedding", None)
    if cls is None:
        logger.warning("engram.sglang: event=refused sglang=%s detail=\"%s has no class EngramEmbedding\": nothing "
                       "to replace", sglang_version(), MODULE)
        return
    if getattr(cls, "_engram_plugin", False):
        return  # installed already (another copy of this plugin)
    problems = check_surface(mod)
    missing = []
    if problems:
        missing.append(_surface_difference("; ".join(problems)) + " (the plugin refuses it: fail closed)")
    lib = _library_problem()
    if lib:
        missing.append(lib)
    else:
        down = _engramd_problem(cfg)
        if down:
            missing.append(down)
    if missing:
        why = "; ".join(missing)
        if cfg.require:
            err = RuntimeError(f"engram.sglang: the Engram table cannot come from engramd ({cfg.socket}) and "
                               f"ENGRAM_SGLANG_REQUIRE is set: {why}")
            via = _install(mod, problems, error=err)
            logger.error("engram.sglang: event=startup_error sglang=%s via=%s detail=\"%s\" (the first Engram layer "
                         "SGLang builds raises it)", sglang_version(), via, why)
        else:
            event = "refused" if problems else "fallback"
            _state["fallback_logged"].add(why)
            logger.warning("engram.sglang: event=%s sglang=%s detail=\"%s\": SGLang keeps its own Engram table",
                           event, sglang_version(), why)
        return
    via = _install(mod, problems)
    logger.info("engram.sglang: event=installed via=%s sglang=%s target=%s socket=%s%s", via, sglang_version(),
                TARGET, cfg.socket, " (SGLang applies the REPLACE hook once its plugins have run)"
                if via == "hook_registry" and _in_sglang_loader() else "")


def _in_sglang_loader():
    """Whether SGLang's plugin loader is running a plugin now (it applies the registered hooks when they are done)."""
    hr = _hook_registry()
    src = getattr(hr, "_current_plugin_source", None) if hr is not None else None
    try:
        return src is not None and src.get() is not None
    except Exception:
        return False


def _install(mod, problems, error=None):
    """Installs the replacement of mod.EngramEmbedding (EngramdEmbedding, or with `error` a class that raises it
    when built): through SGLang's hook registry where there is one, else as the module's attribute. Returns which."""
    cls = mod.EngramEmbedding
    new = _make_refusal(cls, error) if error is not None else _make_class(mod, cls, problems)
    hr = _hook_registry() if getattr(mod, "__name__", None) == MODULE else None
    _state["module"], _state["original"], _state["installed"] = mod, cls, new
    if hr is None:
        mod.EngramEmbedding = new
        _state["via"] = "module_attribute"
        return "module_attribute"
    hr.HookRegistry.register(TARGET, new, hr.HookType.REPLACE)
    _state["via"] = "hook_registry"
    if not _in_sglang_loader():
        hr.HookRegistry.apply_hooks()  # called outside SGLang's loader: nothing else would apply it
        if mod.EngramEmbedding is not new:  # the registry did not apply it (it logged why): the attribute, then
            mod.EngramEmbedding = new
            _state["via"] = "module_attribute"
            return "module_attribute"
    return "hook_registry"


def install(mod):
    """Replaces mod.EngramEmbedding by a subclass that serves engramd's table where configured (its attribute: no
    checks at install; a configured layer on a SGLang whose surface differs raises when it is built)."""
    with _lock:
        cls = getattr(mod, "EngramEmbedding", None)
        if cls is None or getattr(cls, "_engram_plugin", False):
            if cls is None:
                logger.error("engram.sglang: event=incompatible sglang=%s detail=\"no class EngramEmbedding\"",
                             sglang_version())
            return
        problems = check_surface(mod)
        if problems:
            logger.warning("engram.sglang: event=incompatible sglang=%s detail=\"%s\" (a configured engine will "
                           "refuse to start)", sglang_version(), "; ".join(problems))
        new = _make_class(mod, cls, problems)
        _state["module"], _state["original"], _state["installed"], _state["via"] = mod, cls, new, "module_attribute"
        mod.EngramEmbedding = new


def uninstall():
    """Puts SGLang's own class back (the module, the copies the hook registry patched, the registry's hook)."""
    import sys
    with _lock:
        mod, orig, new = _state["module"], _state["original"], _state["installed"]
        if mod is not None and orig is not None:
            if _state["via"] == "hook_registry":
                hr = sys.modules.get(HOOK_REGISTRY)
                reg = getattr(hr, "HookRegistry", None)
                hooks = getattr(reg, "_hooks", None)
                if isinstance(hooks, dict) and TARGET in hooks:
                    hooks[TARGET] = [h for h in hooks[TARGET] if h[1] is not new]
                    if not hooks[TARGET]:
                        del hooks[TARGET]
                    patched = getattr(reg, "_patched", None)
                    if isinstance(patched, set):
                        patched.discard(TARGET)
                for m in list(sys.modules.values()):
                    try:
                        names = [k for k, v in vars(m).items() if v is new]
                    except TypeError:
                        continue
                    for k in names:
                        setattr(m, k, orig)
            mod.EngramEmbedding = orig
        _state.update(registered=False, module=None, original=None, installed=None, via=None, attachment=None,
                      fallback_logged=set())


class Attachment:
    """The process's table from engramd and an engine per layer (lookup-only), or why there is none."""

    def __init__(self, table=None, why=None, checkpoint=None, max_ids=0):
        self.table, self.why, self.checkpoint, self.max_ids = table, why, checkpoint, max_ids
        self.engines = {}

    def engine(self, layer):
        e = self.engines.get(layer)
        if e is None:
            e = self.engines[layer] = self.table.engine(self.max_ids, staging=False)
        return e


def _attach(mod, cfg):
    att = _state["attachment"]
    if att is not None:
        return att
    import engram
    t0 = time.monotonic()
    ckpt = cfg.checkpoint or getattr(mod.get_model(), "model_path", None)
    if not ckpt or not os.path.isdir(ckpt):
        att = Attachment(why=f"the model path {ckpt!r} is not a local directory: set ENGRAM_SGLANG_CHECKPOINT to "
                             "the directory engramd serves")
    else:
        par = mod.get_parallel()
        try:
            # The TP 1 segment whatever SGLang's TP: every rank gathers every column (SGLang's shared layout).
            table = engram.attach(ckpt, tp_size=1, tp_rank=0, cpu_offload=True, socket=cfg.socket,
                                  timeout_ms=cfg.timeout_ms, private_fallback=False)
        except (engram.EngramError, OSError, RuntimeError) as e:  # a library that cannot load: a reason too
            att = Attachment(why=str(e), checkpoint=ckpt)
        else:
            if table.backend != "cuda":
                why = "; ".join(f"{r.name}: {r.hint}" for r in table.reasons) or "no CUDA backend"
                table.close()
                att = Attachment(why=f"the engram library has no usable GPU here ({why})", checkpoint=ckpt)
            else:
                att = Attachment(table, checkpoint=ckpt, max_ids=_MAX_IDS)
                t = table
                gib = sum(l.row_end - l.row_begin for l in t.layout.layers) * t.layout.record_bytes / 2 ** 30
                logger.info("engram.sglang: event=attached mode=%s backend=%s sglang_tp=%d/%d segment_tp=1 "
                            "reasons=%s register_seconds=%.3f attach_seconds=%.3f table_gib=%.2f checkpoint=%s "
                            "socket=%s (SGLang allocates no Engram table; every rank gathers every column from one "
                            "host copy)", t.mode, t.backend, getattr(par, "tp_rank", 0), getattr(par, "tp_size", 1),
                            ",".join(r.name for r in t.reasons) or "-", t.register_seconds,
                            time.monotonic() - t0, gib, ckpt, cfg.socket)
    _state["attachment"] = att
    return att


def _make_refusal(base, error):
    """SGLang's EngramEmbedding whose construction raises `error` (whatever arguments SGLang passes)."""
    class EngramdEmbedding(base):
        _engram_plugin = True

        def __init__(self, *args, **kwargs):
            raise error

    EngramdEmbedding.__name__ = EngramdEmbedding.__qualname__ = "EngramdEmbedding"
    return EngramdEmbedding


def _make_class(mod, base, problems):
    class EngramdEmbedding(base):
        """SGLang's EngramEmbedding whose table is engramd's shared segment (see engram.sglang)."""

        _engram_plugin = True

        def __init__(self, num_embeddings, dim, layer_id):
            cfg = plugin_config()
            self_engramd = None
            if cfg is not None:
                if problems:
                    raise _surface_error("; ".join(problems))
                with _lock:
                    att = _attach(mod, cfg)
                    why = att.why
                    layer = None
                    if why is None:
                        ids = [l.layer_id for l in att.table.layout.layers]
                        if layer_id not in ids:
                            why = f"engramd's table has no Engram layer {layer_id} (it has {ids})"
                        else:
                            layer = ids.index(layer_id)
                            lay = att.table.layout.layers[layer]
                            if (lay.row_begin, lay.row_end) != (0, num_embeddings):
                                why = (f"engramd's layer {layer_id} holds rows [{lay.row_begin}, {lay.row_end}), "
                                       f"SGLang's {num_embeddings}: a different config.json")
                    if why is not None:
                        if cfg.require:
                            raise RuntimeError(f"engram.sglang: the Engram table cannot come from engramd "
                                               f"({cfg.socket}) and ENGRAM_SGLANG_REQUIRE is set: {why}")
                        if why not in _state["fallback_logged"]:
                            _state["fallback_logged"].add(why)
                            logger.warning("engram.sglang: event=fallback detail=\"%s\": SGLang keeps its own Engram "
                                           "table storage", why)
                    else:
                        att.engine(layer)  # now, at model construction: never first under a graph capture
                        self_engramd = (att, layer)
            if self_engramd is None:
                object.__setattr__(self, "_engramd", None)
                super().__init__(num_embeddings, dim, layer_id)
                return
            import torch
            from torch import nn
            nn.Module.__init__(self)
            object.__setattr__(self, "_engramd", self_engramd)
            object.__setattr__(self, "_engramd_fast", set())
            self.dim = dim
            par = mod.get_parallel()
            self.tp_size = getattr(par, "tp_size", 1)
            self.row_start, self.rows = 0, num_embeddings
            self.host_table = None
            block = int(getattr(mod, "FP8_BLOCK_SIZE", 32))
            self.weight = nn.Parameter(_plugin.placeholder(num_embeddings, dim, "float8_e4m3fn"), requires_grad=False)
            self.scale = nn.Parameter(_plugin.placeholder(num_embeddings, dim // block, "uint8"), requires_grad=False)
            self.weight.weight_loader = self._load_rows
            self.scale.weight_loader = self._load_rows
            self._torch = torch

        def _load_rows(self, param, loaded_weight):
            if self._engramd is None:
                return super()._load_rows(param, loaded_weight)
            att, layer = self._engramd
            which = "weight" if param is self.weight else "scale"
            width = self.dim if which == "weight" else param.shape[1]
            if tuple(loaded_weight.shape) != (self.rows, width):
                raise RuntimeError(f"engram.sglang: the checkpoint's Engram {which} of layer index {layer} has shape "
                                   f"{tuple(loaded_weight.shape)}; the served table has {self.rows} rows of {width}")
            rows = _plugin.sample_rows(self.rows, 1000003 * layer + (which == "scale"))
            cols = slice(0, self.dim) if which == "weight" else slice(self.dim, self.dim + width)
            bad = _plugin.mismatched_rows(loaded_weight, att.table.records(layer), 0, rows, cols)
            if bad:
                raise RuntimeError(
                    f"engram.sglang: the checkpoint SGLang loads is not the one engramd serves: row {bad[0]} of the "
                    f"Engram {which} of layer index {layer} differs ({len(bad)} of {len(rows)} sampled rows) "
                    f"between SGLang's weights and engramd's segment of {att.checkpoint}; point SGLang and engramd "
                    "at the same files")

        def finish_load(self, label=""):
            if self._engramd is None:
                return super().finish_load(label)
            return None  # nothing was written: the rows are engramd's

        def forward(self, indices, forward_batch=None, *, cp_all_tokens=False):
            if self._engramd is None:
                return super().forward(indices, forward_batch, cp_all_tokens=cp_all_tokens)
            att, layer = self._engramd
            out = self._torch.empty(*indices.shape, self.dim, dtype=self._torch.bfloat16, device=indices.device)
            n = indices.numel()
            if n == 0:
                return out
            # Every id is a row of the whole table: one id per "token" of one column, so any shape of ids works.
            flat = indices.reshape(n, 1)
            if not flat.is_contiguous():
                flat = flat.contiguous()
            rows = out.view(n, 1, self.dim)
            eng = att.engine(layer)
            key = (flat.dtype, flat.device)
            for a in range(0, n, att.max_ids):
                ids_part, rows_part = flat[a:a + att.max_ids], rows[a:a + att.max_ids]
                if key in self._engramd_fast:
                    # Contiguous [m, 1] ids into a fresh contiguous [m, 1, dim] result, as a call the engine's
                    # checks accepted: only the pointers, the count and the stream are new.
                    from . import _lib
                    eng._c(_lib.lib.engram_engine_lookup_into, layer, ids_part.data_ptr(), ids_part.shape[0], 1, 0,
                           1, rows_part.data_ptr(), self.dim,
                           _lib.LOOKUP_IDS64 if ids_part.element_size() == 8 else 0, eng.stream())
                else:
                    eng.lookup_into(layer, ids_part, rows_part, num_cols=1)
                    self._engramd_fast.add(key)
            return out

    EngramdEmbedding.__name__ = EngramdEmbedding.__qualname__ = "EngramdEmbedding"
    return EngramdEmbedding
