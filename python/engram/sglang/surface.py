"""The SGLang surface the plugin relies on: SGLang's Engram module and the class it replaces (`check_surface` lists
what the running SGLang lacks of it; the plugin refuses a SGLang whose surface differs: fail closed), and SGLang's
plugin hook registry where it has one (`sglang.srt.plugins.hook_registry`). Reads modules only; thread-safe."""
import inspect

from .config import sglang_version

MODULE = "sglang.srt.layers.engram"
TARGET = MODULE + ".EngramEmbedding"
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"
TESTED_SGLANG_FILES = ("python/sglang/srt/layers/engram.py of SGLang 4be612a4 with EngramEmbedding(num_embeddings, "
                       "dim, layer_id) and EngramEmbedding.forward(indices, forward_batch=None, *, "
                       "cp_all_tokens=False)",)


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


def _in_sglang_loader():
    """Whether SGLang's plugin loader is running a plugin now (it applies the registered hooks when they are done)."""
    hr = _hook_registry()
    src = getattr(hr, "_current_plugin_source", None) if hr is not None else None
    try:
        return src is not None and src.get() is not None
    except Exception:
        return False
