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

The package: engram.sglang.config (the settings), .surface (SGLang's surface and its hook registry), .embedding (the
process's attach and EngramdEmbedding), .state (the per-process state); this module registers and installs.
"""
from .config import DEFAULT_SOCKET, PluginConfig, plugin_config, sglang_version
from .embedding import _MAX_IDS, Attachment, _attach, _make_class, _make_refusal
from .state import _lock, _state, logger
from .surface import (HOOK_REGISTRY, MODULE, TARGET, TESTED_SGLANG_FILES, _hook_registry, _in_sglang_loader, _params,
                      _surface_difference, _surface_error, check_surface)


def _library_problem():
    """Why the engram library cannot be used here (None: it loads)."""
    try:
        from .. import _lib
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
