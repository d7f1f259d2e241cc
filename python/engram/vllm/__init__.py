"""engram.vllm: the vLLM general plugin that gives DeepSeek-V4.1's Engram layers their tables from engramd.

vLLM loads it in every process (entry point group `vllm.general_plugins`, name `engram`; `VLLM_PLUGINS` filters by
that name) before the model is built. Loading touches no CUDA, loads no native library, and patches
`Engram._create_embedding` in every Engram module the running vLLM has (engram.vllm.layouts: the NVIDIA class the
model builds on NVIDIA GPUs, the merged single-file layout, the platform-neutral base; both package names); the
startup log names each module patched, its layout and vLLM's version. The patch does nothing unless the plugin is
configured:

    vllm serve /models/DeepSeek-V4.1-Flash --additional-config '{"engram": {"socket": "/run/engramd/engramd.sock"}}'
    ENGRAM_VLLM_SOCKET=/run/engramd/engramd.sock vllm serve ...     # for launchers that cannot pass it

Keys (additional_config["engram"], else the environment variable in brackets): socket [ENGRAM_VLLM_SOCKET]
(default /run/engramd/engramd.sock; ENGRAM_VLLM=1 turns the plugin on with the defaults), require
[ENGRAM_VLLM_REQUIRE], checkpoint [ENGRAM_VLLM_CHECKPOINT] (the directory engramd serves; default the model's
directory), timeout_ms [ENGRAM_VLLM_TIMEOUT_MS] (10000). An unknown key is a startup error.

Configured means served or a clear failure:
- require false: when the table cannot come from engramd (no library, a vLLM surface the plugin does not know, a
  layout whose table lives in GPU memory, engramd unreachable, a fallback) vLLM keeps its own table and the log
  says why, once, at WARNING.
- require true: a startup error naming what is missing. vLLM propagates an exception from `register()` (and
  from the model's construction), so: with the environment's settings (visible when plugins load) `register()`
  itself checks the library, the surface and engramd; settings from additional_config (which exists only once vLLM
  builds its configuration) are checked when the first Engram layer is built.

In each worker the first Engram layer attaches once for the process (its TP rank and size, DP rank, size and local
size, elastic EP); every layer then gets an EngramdEmbedding (engram.vllm.embedding). vLLM's Engram internals change
fast: the methods and attributes used are checked against the running vLLM (engram.vllm.layouts); where they
differ the plugin fails closed with a message that names the vLLM version, the module and what differs.
Thread-safety: vLLM builds a model in one thread; the per-process state is guarded by a lock anyway.
"""
import logging
import sys
import threading

from .. import _lib
from . import embedding, layouts
from .config import (DEFAULT_SOCKET, PluginConfig, engram_config_values, environment_config, plugin_config,
                     thp_setting, vllm_version, PARALLEL_FIELDS)
from .layouts import Surface, check_surface

__all__ = ["register", "install", "uninstall", "plugin_config", "PluginConfig", "check_surface", "DEFAULT_SOCKET",
           "TESTED_VLLM_FILES"]

# What docs/api.md's tested-versions table lists, by layout.
TESTED_VLLM_FILES = ("vllm/models/deepseek_v41/nvidia/engram.py (NVIDIA Engram over common/engram.py)",
                     "vllm/models/deepseek_v41/common/engram.py (merged: ParallelEngramEmbedding with cpu_offload)",
                     "vllm/models/deepseek_v4_1/{nvidia,common}/engram.py (the package before its rename)")

logger = logging.getLogger("vllm.engram")  # under vLLM's "vllm" logger: its handler prints these lines

_lock = threading.RLock()
_state = {"registered": False, "patched": {}, "attachments": {}, "said": set()}


def _surface_error(surface, what):
    return RuntimeError(f"engram.vllm: vLLM {vllm_version()} ({surface.name}, layout {surface.kind}) differs from the "
                        f"Engram interface this plugin was tested against: {what}. The plugin refuses to run on it "
                        "(fail closed); unset the engram plugin config to serve with vLLM's own tables")


def _once(level, key, msg, *args):
    if key not in _state["said"]:
        _state["said"].add(key)
        logger.log(level, msg, *args)


def register():
    """vLLM's entry point, once per process; touches no CUDA. Patches each Engram module of the running vLLM when it
    is imported (an import hook: a process that never builds DeepSeek-V4.1 imports nothing more, and a module that
    fails to import at first is patched when it does import), or at once when it already is. Configured by the
    environment, it imports them now; with require, raises (a startup error) when the library, a served vLLM
    surface or engramd is missing."""
    with _lock:
        if _state["registered"]:
            return
        _state["registered"] = True
        _lib.route_log("vllm.engram")  # the library's own lines into vLLM's log, in its format
        cfg = environment_config()
        _state["env_configured"] = cfg is not None
        layouts.watch_imports(_on_import)
        for name in layouts.CANDIDATES:
            if name in sys.modules:
                install(sys.modules[name])
        if cfg is None:
            return
        surfaces = layouts.find(lambda name, e: logger.warning(
            "engram.vllm: event=module_unusable module=%s vllm=%s detail=\"%s: %s\" (patched if it imports later)",
            name, vllm_version(), type(e).__name__, e))
        for s in surfaces:
            install(s)
        if not surfaces and not cfg.require:
            logger.warning("engram.vllm: event=idle vllm=%s reason=\"configured, but this vLLM has none of the Engram "
                           "modules the plugin knows (%s): vLLM keeps its own Engram tables\"", vllm_version(),
                           ", ".join(layouts.CANDIDATES))
        if cfg.require:
            missing = preflight(cfg, surfaces)
            if missing:
                raise RuntimeError(f"engram.vllm: require is true ({cfg.source}) and the Engram table cannot come "
                                   f"from engramd ({cfg.socket}): {'; '.join(missing)}")


def _on_import(module):
    with _lock:
        if _state["registered"]:
            install(module)


def preflight(cfg, surfaces):
    """What stops engramd's table from reaching this vLLM, in sentences (empty: nothing known): the library, a
    served surface, engramd."""
    import engram
    missing = []
    try:
        _lib.load()
    except engram.LibraryError as e:
        missing.append(f"the engram library: {e}")
    served = [s for s in surfaces if s.served and not s.problems]
    if not served:
        seen = "; ".join(f"{s.describe()}: {'; '.join(s.problems) or 'its table lives in GPU memory'}"
                         for s in surfaces) or "no DeepSeek-V4.1 Engram module"
        missing.append(f"vLLM {vllm_version()} has no Engram layer the plugin can serve ({seen})")
    if not missing:
        try:
            engram.status(cfg.socket, timeout_ms=min(cfg.timeout_ms, 5000))
        except (engram.EngramError, ValueError) as e:
            missing.append(f"engramd at {cfg.socket}: {e}")
    return missing


def install(module):
    """Patches the Engram class of `module` (a vLLM Engram module or a layouts.Surface): its _create_embedding gives
    engramd's table where configured. When the surface differs from what the plugin knows, the patch only raises,
    when configured, naming the difference (fail closed)."""
    surface = module if isinstance(module, Surface) else Surface(module)
    with _lock:
        cls = surface.engram
        if cls is None:
            logger.error("engram.vllm: event=incompatible module=%s vllm=%s detail=\"%s\"", surface.name,
                         vllm_version(), "; ".join(surface.problems))
            return
        original = cls.__dict__.get("_create_embedding")
        if original is None:
            # Nothing to patch where vLLM asks for the embedding: a configured engine is refused when it builds
            # the layer instead (fail closed), rather than left to build its own table unnoticed.
            _guard_init(surface, cls)
            return
        if getattr(original, "_engram_plugin", False):
            return  # already installed into this class

        def _create_embedding(self, layout, layer_hash_index):
            return _provide(surface, original, self, layout, layer_hash_index)

        _create_embedding._engram_plugin = True
        _create_embedding.__wrapped__ = original
        cls._create_embedding = _create_embedding
        _state["patched"][(cls, "_create_embedding")] = original
        if surface.problems:
            # WARNING where the environment configures the plugin; otherwise a configured engine is refused (with
            # this detail) when it builds the layer, and an unconfigured one is not concerned.
            logger.log(logging.WARNING if _state.get("env_configured") else logging.INFO,
                       "engram.vllm: event=incompatible module=%s layout=%s vllm=%s detail=\"%s\" (a configured "
                       "engine will refuse to start)", surface.name, surface.kind, vllm_version(),
                       "; ".join(surface.problems))
        else:
            logger.info("engram.vllm: event=installed module=%s layout=%s vllm=%s served=%s", surface.name,
                        surface.kind, vllm_version(), "yes" if surface.served else
                        "no (the table lives in GPU memory)")


def _guard_init(surface, cls):
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_engram_plugin", False):
        return

    def __init__(self, *args, **kwargs):
        get_config = surface.fn("get_current_vllm_config")
        vllm_config = get_config() if get_config is not None else None
        if plugin_config(getattr(vllm_config, "additional_config", None)) is not None:
            raise _surface_error(surface, "; ".join(surface.problems))
        return original(self, *args, **kwargs)

    __init__._engram_plugin = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__
    _state["patched"][(cls, "__init__")] = original
    logger.log(logging.WARNING if _state.get("env_configured") else logging.INFO,
               "engram.vllm: event=incompatible module=%s layout=%s vllm=%s detail=\"%s\" (a configured engine will "
               "refuse to start)", surface.name, surface.kind, vllm_version(), "; ".join(surface.problems))


def uninstall():
    """Restores every patched class's own method and forgets the process's state (tests)."""
    with _lock:
        for (cls, attr), original in _state["patched"].items():
            setattr(cls, attr, original)
        _state.update(registered=False, patched={}, attachments={}, said=set(), env_configured=False)
        layouts.watch_imports(None)
        _lib.route_log("engram")


def _unsupported(values, group):
    """Why this vLLM configuration keeps vLLM's own storage whatever engramd offers, or None."""
    if not values["cpu_offload"]:
        return "cpu_offload is false: the tables live in GPU memory (vLLM's own); engramd shares host tables"
    if group > 1 and not values["dp_shared_memory"]:
        # vLLM's model then gathers every member's hash ids and splits the table over its node-local DP group
        # (embedding_across_dp): the rows are its exchange's, not one replica's lookup.
        return ("vLLM runs a node-local Engram DP group without dp_shared_memory (its DP-sharded exchange): drop "
                "embedding_across_dp, or let dp_shared_memory default, to share engramd's host table")
    return None


def _fallback(cfg, why, original, engram_layer, layout, layer_hash_index):
    if cfg.require:
        raise RuntimeError(f"engram.vllm: the Engram table cannot come from engramd ({cfg.socket}) and require is "
                           f"true: {why}")
    _once(logging.WARNING, ("fallback", why), "engram.vllm: event=fallback detail=\"%s\": vLLM keeps its own Engram "
          "table storage", why)
    return original(engram_layer, layout, layer_hash_index)


def _provide(surface, original, engram_layer, layout, layer_hash_index):
    get_config = surface.fn("get_current_vllm_config")
    vllm_config = get_config() if get_config is not None else None
    cfg = plugin_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        return original(engram_layer, layout, layer_hash_index)
    if surface.problems:
        raise _surface_error(surface, "; ".join(surface.problems))
    if not surface.served:
        return _fallback(cfg, f"vLLM {vllm_version()}'s {surface.name} (layout {surface.kind}) keeps its Engram table "
                              "in GPU memory (its ParallelEngramEmbedding has no cpu_offload); engramd serves host "
                              "tables", original, engram_layer, layout, layer_hash_index)
    ecfg = getattr(vllm_config, "engram_config", None)
    values, missing = engram_config_values(ecfg)
    if ecfg is None or missing:
        raise _surface_error(surface, f"its engram_config lacks {', '.join(missing) or 'everything'}")
    pc = getattr(vllm_config, "parallel_config", None)
    missing = [a for a in PARALLEL_FIELDS if not hasattr(pc, a)]
    if not hasattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens"):
        missing.append("scheduler_config.max_num_batched_tokens")
    if missing:
        raise _surface_error(surface, f"its config lacks {', '.join(missing)}")
    with _lock:
        thp_name, thp = thp_setting(ecfg)
        if thp:
            _once(logging.INFO, ("thp", thp_name), "engram.vllm: event=thp_ignored field=%s: vLLM's huge-page "
                  "packing is for a table of its own; engramd's segment has its mount's pages", thp_name)
        group = int(surface.fn("get_engram_dp_size")())
        why = _unsupported(values, group)
        att = None
        if why is None:
            max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
            att = embedding.attach(surface, vllm_config, cfg, max_tokens, _state["attachments"])
            why = att.why
        if why is None:
            # vLLM's co-located group with dp_shared_memory: one table for the group, TP shards, every replica its
            # own tokens (what engramd's copy gives); without a group, the same.
            emb = embedding.make_embedding(surface, att, layout, layer_hash_index, group > 1,
                                           lambda what: _surface_error(surface, what))
            if not isinstance(emb, str):
                return emb
            why = emb
            if not att.engines:  # no layer uses the table: give it back rather than hold it beside vLLM's
                att.close(why)
        return _fallback(cfg, why, original, engram_layer, layout, layer_hash_index)
