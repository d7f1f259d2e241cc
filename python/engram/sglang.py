"""engram.sglang: the SGLang plugin that gives DeepSeek-V4.1's Engram layers their tables from engramd.

SGLang loads it in its processes (entry point group `sglang.srt.plugins`, name `engram`; `SGLANG_PLUGINS` filters
by that name). Loading touches no CUDA and replaces one name, `sglang.srt.layers.engram.EngramEmbedding`, by a
subclass (SGLang's `Engram.__init__` looks the class up in that module when it builds a layer); the subclass is
SGLang's own class unless the plugin is configured, by environment variables (SGLang is configured that way):

    ENGRAM_SGLANG_SOCKET=/run/engramd/engramd.sock python -m sglang.launch_server --model-path /models/DeepSeek-V4.1-Flash ...

ENGRAM_SGLANG_SOCKET (ENGRAM_SGLANG=1: on with the default socket /run/engramd/engramd.sock), ENGRAM_SGLANG_REQUIRE
(false: when the table cannot come from engramd SGLang keeps its own storage and the log says why; true: a startup
error), ENGRAM_SGLANG_CHECKPOINT (the directory engramd serves; default SGLang's model path),
ENGRAM_SGLANG_TIMEOUT_MS (10000).

Each process attaches once, to the TP 1 segment: like SGLang's shared host layout, every SGLang rank gathers every
column of its tokens from one host copy, with no all-reduce. Each layer's EngramdEmbedding allocates no table memory
(one-row parameters), its weight loader reads no table bytes (it compares a few rows of the loaded tensor with the
served segment: another checkpoint is a startup error), and `forward(indices, ...)` runs the engram engine on the
current stream with SGLang's int64 ids, into a bf16 [*indices.shape, dim] result as SGLang's own gather returns it:
no host synchronisation, capturable in SGLang's CUDA graphs. SGLang's hashing, wkv and gate stay SGLang's.

The SGLang surface used is checked at startup (`check_surface`); a configured engine on a SGLang that differs fails
with a message naming what differs (fail closed). Thread-safety: the per-process state is guarded by a lock.
"""
import inspect
import logging
import os
import threading
import time

from . import _plugin

MODULE = "sglang.srt.layers.engram"
TESTED_SGLANG_FILES = ("python/sglang/srt/layers/engram.py with EngramEmbedding(num_embeddings, dim, layer_id) and "
                       "EngramEmbedding.forward(indices, forward_batch=None, *, cp_all_tokens=False)",)
DEFAULT_SOCKET = "/run/engramd/engramd.sock"

logger = logging.getLogger("sglang.engram")

# Ids per engine call: a larger batch (a long prefill) is looked up in pieces of this many ids.
_MAX_IDS = 1 << 16

_lock = threading.RLock()
_state = {"registered": False, "module": None, "original": None, "attachment": None, "fallback_logged": set()}


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


def _surface_error(what):
    return RuntimeError(f"engram.sglang: SGLang {sglang_version()} differs from the Engram interface this plugin was "
                        f"tested against ({'; '.join(TESTED_SGLANG_FILES)}): {what}. The plugin refuses to run on it "
                        "(fail closed); unset ENGRAM_SGLANG_SOCKET to serve with SGLang's own tables")


def register():
    """SGLang's entry point: installs the replacement once per process (no CUDA); idle on a SGLang without
    DeepSeek-V4.1's Engram module."""
    with _lock:
        if _state["registered"]:
            return
        _state["registered"] = True
        try:
            import importlib
            mod = importlib.import_module(MODULE)
        except ImportError as e:
            logger.info("engram.sglang: event=idle reason=\"this SGLang (%s) has no %s: %s\"", sglang_version(),
                        MODULE, e)
            return
        install(mod)


def install(mod):
    """Replaces mod.EngramEmbedding by a subclass that serves engramd's table where configured."""
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
        _state["module"], _state["original"] = mod, cls
        mod.EngramEmbedding = new


def uninstall():
    with _lock:
        mod = _state["module"]
        if mod is not None and _state["original"] is not None:
            mod.EngramEmbedding = _state["original"]
        _state.update(registered=False, module=None, original=None, attachment=None, fallback_logged=set())


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
        except engram.EngramError as e:
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
