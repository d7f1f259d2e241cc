"""engram.vllm: the vLLM general plugin that gives DeepSeek-V4.1's Engram layers their tables from engramd.

vLLM loads it in every process (entry point group `vllm.general_plugins`, name `engram`; `VLLM_PLUGINS` filters by
that name) before the model is built. Loading touches no CUDA and patches one method, `Engram._create_embedding`;
the patch does nothing unless the plugin is configured:

    vllm serve /models/DeepSeek-V4.1-Flash --additional-config '{"engram": {"socket": "/run/engramd/engramd.sock"}}'
    ENGRAM_VLLM_SOCKET=/run/engramd/engramd.sock vllm serve ...     # for launchers that cannot pass it

Keys (additional_config["engram"], else the environment variable in brackets): socket [ENGRAM_VLLM_SOCKET]
(default /run/engramd/engramd.sock; ENGRAM_VLLM=1 turns the plugin on with the defaults), require
[ENGRAM_VLLM_REQUIRE] (false: when the table cannot come from engramd vLLM keeps its own storage and the log says
why; true: a startup error), checkpoint [ENGRAM_VLLM_CHECKPOINT] (the directory engramd serves; default the model's
directory), timeout_ms [ENGRAM_VLLM_TIMEOUT_MS] (10000). An unknown key is a startup error.

In each worker the first Engram layer attaches once for the process (its TP rank and size, DP rank, size and local
size, elastic EP); every layer then gets an `EngramdEmbedding`: a `ParallelEngramEmbedding` that allocates no table
memory (its parameters are one-row views), whose weight loader reads no table bytes (it compares a few rows of the
loaded tensor with the served segment: a different checkpoint is a startup error naming both), and whose
`lookup(indices, out, background)` runs the engram engine on torch's current stream straight into vLLM's `out`
(bf16 or packed, vLLM's column window and token stride): no host synchronisation, no allocation, capturable in
vLLM's CUDA graphs. vLLM's hashing, prefetch stream, staging, wkv and gate stay vLLM's.

vLLM's Engram internals change fast: the methods and attributes used here are checked against the running vLLM
(`check_surface`); when they differ the plugin fails closed (a startup error when configured) with a message that
names the vLLM version and what differs. Thread-safety: vLLM builds a model in one thread; the per-process state
below is guarded by a lock anyway.
"""
import inspect
import json
import logging
import os
import sys
import threading
import time

from . import _plugin

MODULE = "vllm.models.deepseek_v41.common.engram"
TESTED_VLLM_FILES = ("vllm/models/deepseek_v41/common/engram.py with ParallelEngramEmbedding.lookup(indices, out, "
                     "background) and Engram._create_embedding(layout, layer_hash_index)",)
DEFAULT_SOCKET = "/run/engramd/engramd.sock"
_KEYS = {"socket": str, "require": bool, "checkpoint": str, "timeout_ms": int}
_ENV = {"socket": "ENGRAM_VLLM_SOCKET", "require": "ENGRAM_VLLM_REQUIRE", "checkpoint": "ENGRAM_VLLM_CHECKPOINT",
        "timeout_ms": "ENGRAM_VLLM_TIMEOUT_MS"}

logger = logging.getLogger("vllm.engram")  # under vLLM's "vllm" logger: its handler prints these lines

_lock = threading.RLock()
_state = {"registered": False, "module": None, "original": None, "attachments": {}, "class": None}


class PluginConfig:
    """The plugin's settings for one vLLM instance (see the module docstring)."""

    def __init__(self, socket=DEFAULT_SOCKET, require=False, checkpoint=None, timeout_ms=10000, source=""):
        self.socket, self.require, self.checkpoint, self.timeout_ms = socket, require, checkpoint, timeout_ms
        self.source = source

    def __repr__(self):
        return (f"PluginConfig(socket={self.socket!r}, require={self.require}, checkpoint={self.checkpoint!r}, "
                f"timeout_ms={self.timeout_ms}, source={self.source})")


def _env_bool(name, text):
    try:
        return _plugin.env_bool(name, text)
    except ValueError as e:
        raise ValueError(f"engram.vllm: {e}") from None


def plugin_config(additional_config, environ=None):
    """The PluginConfig that vLLM's additional_config (a dict, a JSON text or None) and the environment give, or
    None when the plugin is not configured. ValueError for an unknown key or a value of the wrong type."""
    environ = os.environ if environ is None else environ
    extra = additional_config
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    section = extra.get("engram") if isinstance(extra, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"engram.vllm: additional_config['engram'] must be an object, got {type(section).__name__}")
    env_on = bool(environ.get("ENGRAM_VLLM_SOCKET")) or _env_bool("ENGRAM_VLLM", environ.get("ENGRAM_VLLM", ""))
    if section is None and not env_on:
        return None
    section = dict(section or {})
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        raise ValueError(f"engram.vllm: unknown key(s) {', '.join(unknown)} in additional_config['engram'] "
                         f"(known: {', '.join(_KEYS)})")
    values = {}
    for key, kind in _KEYS.items():
        if key in section:
            v = section[key]
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)) or \
                    kind is not int and not isinstance(v, kind):
                raise ValueError(f"engram.vllm: additional_config['engram']['{key}'] must be {kind.__name__}, "
                                 f"got {v!r}")
            values[key] = v
        elif environ.get(_ENV[key]):
            text = environ[_ENV[key]]
            if kind is bool:
                values[key] = _env_bool(_ENV[key], text)
            elif kind is int:
                try:
                    values[key] = int(text)
                except ValueError:
                    raise ValueError(f"engram.vllm: {_ENV[key]}={text!r}: expected an integer") from None
            else:
                values[key] = text
    if "timeout_ms" in values and values["timeout_ms"] < 1:
        raise ValueError(f"engram.vllm: timeout_ms must be >= 1, got {values['timeout_ms']}")
    source = "additional_config" if section or not env_on else "environment"
    return PluginConfig(source=source, **values)


def vllm_version():
    v = sys.modules.get("vllm")
    return getattr(v, "__version__", "unknown") if v is not None else "not imported"


def _params(fn):
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def check_surface(mod):
    """What the running vLLM's Engram module lacks of the surface this plugin relies on: a list of sentences,
    empty when everything is there."""
    problems = []
    engram_cls = getattr(mod, "Engram", None)
    emb_cls = getattr(mod, "ParallelEngramEmbedding", None)
    if engram_cls is None:
        problems.append("no class Engram")
    elif _params(getattr(engram_cls, "_create_embedding", None)) != ["self", "layout", "layer_hash_index"]:
        problems.append("Engram._create_embedding is not (self, layout, layer_hash_index)")
    if emb_cls is None:
        problems.append("no class ParallelEngramEmbedding")
    else:
        want_init = ["self", "num_embeddings", "dim", "head_sizes", "block_size", "cpu_offload", "dp_shared_memory",
                     "use_thp"]
        if _params(emb_cls.__init__) != want_init:
            problems.append(f"ParallelEngramEmbedding.__init__ is not ({', '.join(want_init[1:])})")
        for name, want in (("_allocate_weights", ["self"]), ("_storage", ["self"]),
                           ("lookup", ["self", "indices", "out", "background"])):
            if _params(getattr(emb_cls, name, None)) != want:
                problems.append(f"ParallelEngramEmbedding.{name} is not ({', '.join(want[1:])})")
        if not hasattr(emb_cls, "_weight_loader"):
            problems.append("ParallelEngramEmbedding has no _weight_loader")
    for fn in ("get_current_vllm_config", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
               "get_engram_dp_size"):
        if not callable(getattr(mod, fn, None)):
            problems.append(f"no function {fn}")
    return problems


# The instance attributes ParallelEngramEmbedding.__init__ must leave (checked on every EngramdEmbedding).
_INSTANCE_ATTRS = ("head_start", "part_n_hash_cols", "n_hash_cols", "vocab_start_idx", "vocab_end_idx", "dim",
                   "block_size", "dp_size", "cpu_offload", "weight", "weight_scale_inv", "part_num_embeddings")
_PARALLEL_ATTRS = ("data_parallel_size", "data_parallel_rank", "data_parallel_size_local", "enable_elastic_ep")
_ENGRAM_CONFIG_ATTRS = ("cpu_offload", "dp_shared_memory", "embedding_across_dp", "use_thp")


def _surface_error(what):
    return RuntimeError(f"engram.vllm: vLLM {vllm_version()} differs from the Engram interface this plugin was "
                        f"tested against ({'; '.join(TESTED_VLLM_FILES)}): {what}. The plugin refuses to run on it "
                        "(fail closed); unset the engram plugin config to serve with vLLM's own tables")


def register():
    """vLLM's entry point: installs the patch once per process. Touches no CUDA; logs and stays idle on a vLLM
    without DeepSeek-V4.1's Engram module."""
    with _lock:
        if _state["registered"]:
            return
        _state["registered"] = True
        try:
            import importlib
            mod = importlib.import_module(MODULE)
        except ImportError as e:
            logger.info("engram.vllm: event=idle reason=\"this vLLM (%s) has no %s: %s\"", vllm_version(), MODULE, e)
            return
        install(mod)


def install(mod):
    """Patches `mod` (vLLM's Engram module): Engram._create_embedding gives engramd's table where configured. When
    the module's surface differs from what the plugin knows, the patch only raises, when configured, naming the
    difference (fail closed)."""
    with _lock:
        if getattr(getattr(getattr(mod, "Engram", None), "_create_embedding", None), "_engram_plugin", False):
            return  # already installed into this module
        problems = check_surface(mod)
        engram_cls = getattr(mod, "Engram", None)
        if engram_cls is None:
            logger.error("engram.vllm: event=incompatible vllm=%s detail=\"%s\"", vllm_version(), "; ".join(problems))
            return
        original = engram_cls.__dict__.get("_create_embedding")
        if original is None:  # nothing to patch: vLLM never asks for an embedding this way
            logger.error("engram.vllm: event=incompatible vllm=%s detail=\"%s\"", vllm_version(), "; ".join(problems))
            return

        def _create_embedding(self, layout, layer_hash_index):
            return _provide(mod, original, problems, self, layout, layer_hash_index)

        _create_embedding._engram_plugin = True
        _create_embedding.__wrapped__ = original
        engram_cls._create_embedding = _create_embedding
        _state["module"], _state["original"] = mod, original
        if problems:
            logger.warning("engram.vllm: event=incompatible vllm=%s detail=\"%s\" (a configured engine will refuse "
                           "to start)", vllm_version(), "; ".join(problems))


def uninstall():
    """Restores the module's own method (tests)."""
    with _lock:
        mod = _state["module"]
        if mod is not None and _state["original"] is not None:
            mod.Engram._create_embedding = _state["original"]
        _state.update(registered=False, module=None, original=None, attachments={}, **{"class": None})


class Attachment:
    """One process's attach to engramd for one checkpoint and rank: the table and an engine per layer (a layer's
    lookups run on its own streams; one engine's calls must be one ordered sequence), or the reason it could not
    be had."""

    def __init__(self, table=None, why=None, seconds=0.0, max_tokens=0):
        self.table, self.why, self.seconds, self.max_tokens = table, why, seconds, max_tokens
        self.engines = {}     # layer index -> Engine (lookup-only: no staging buffers)
        self.checked = set()  # (layer, which) pairs whose rows the weight loader compared

    def engine(self, layer):
        e = self.engines.get(layer)
        if e is None:
            e = self.engines[layer] = self.table.engine(self.max_tokens, staging=False)
        return e

    def close(self, why):
        """Gives the table back (no layer uses it): its lease, registration and engines go; later layers fall
        back for the same reason."""
        for e in self.engines.values():
            e.close()
        self.engines = {}
        if self.table is not None:
            self.table.close()
        self.table, self.why = None, why


def _model_dir(vllm_config, cfg):
    if cfg.checkpoint:
        return cfg.checkpoint
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    if model and os.path.isdir(model):
        return model
    try:  # a hub id: the local snapshot vLLM downloaded, if any
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=getattr(vllm_config.model_config, "revision", None),
                                 local_files_only=True)
    except Exception:
        return None


def _attach(mod, vllm_config, cfg, max_tokens):
    """The process's Attachment (made once per checkpoint, rank and socket)."""
    import engram
    pc = vllm_config.parallel_config
    tp_size, tp_rank = int(mod.get_tensor_model_parallel_world_size()), int(mod.get_tensor_model_parallel_rank())
    dp_size = int(pc.data_parallel_size or 1)
    dp_rank = int(pc.data_parallel_rank or 0)
    local = pc.data_parallel_size_local
    elastic = bool(pc.enable_elastic_ep)
    ckpt = _model_dir(vllm_config, cfg)
    key = (ckpt, cfg.socket, tp_size, tp_rank, dp_size, dp_rank)
    att = _state["attachments"].get(key)
    if att is not None:
        return att
    t0 = time.monotonic()
    if ckpt is None:
        att = Attachment(why="the model is not a local directory and no local snapshot of it was found: set "
                             "additional_config['engram']['checkpoint'] to the directory engramd serves")
    else:
        try:
            table = engram.attach(ckpt, tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size,
                                  dp_rank=min(dp_rank, dp_size - 1),
                                  local_dp_size=int(local) if local else None, cpu_offload=True,
                                  dp_shared_memory="auto", embedding_across_dp=False, elastic_ep=elastic,
                                  socket=cfg.socket, timeout_ms=cfg.timeout_ms, private_fallback=False)
        except engram.EngramError as e:
            att = Attachment(why=str(e))
        else:
            if table.backend != "cuda":
                why = "; ".join(f"{r.name}: {r.hint}" for r in table.reasons) or "no CUDA backend"
                table.close()
                att = Attachment(why=f"the engram library has no usable GPU here ({why})")
            else:
                att = Attachment(table, max_tokens=max_tokens)
    att.seconds = time.monotonic() - t0
    att.checkpoint, att.tp, att.dp = ckpt, (tp_rank, tp_size), (dp_rank, dp_size, local)
    _state["attachments"][key] = att
    if att.table is not None:
        t = att.table
        gib = sum((l.row_end - l.row_begin) for l in t.layout.layers) * t.layout.record_bytes / 2 ** 30
        logger.info("engram.vllm: event=attached mode=%s backend=%s tp=%d/%d dp=%d/%d local_dp=%s reasons=%s "
                    "register_seconds=%.3f attach_seconds=%.3f table_gib=%.2f checkpoint=%s socket=%s (vLLM "
                    "allocates no Engram table; lookups run the engram engine)", t.mode, t.backend, tp_rank,
                    tp_size, dp_rank, dp_size, local if local else "all",
                    ",".join(r.name for r in t.reasons) or "-", t.register_seconds, att.seconds, gib, ckpt,
                    cfg.socket)
    return att


def _unsupported(mod, vllm_config, ecfg):
    """Why this vLLM configuration keeps vLLM's own storage whatever engramd offers, or None."""
    if not ecfg.cpu_offload:
        return "cpu_offload is false: the tables live in GPU memory (vLLM's own); engramd shares host tables"
    if int(mod.get_engram_dp_size()) > 1 and not ecfg.dp_shared_memory:
        # vLLM's model then gathers every member's hash ids and splits the table over its node-local DP group
        # (embedding_across_dp): the rows are its exchange's, not one replica's lookup.
        return ("vLLM runs a node-local Engram DP group without dp_shared_memory (its DP-sharded exchange): drop "
                "embedding_across_dp, or let dp_shared_memory default, to share engramd's host table")
    return None


def _provide(mod, original, problems, engram_layer, layout, layer_hash_index):
    vllm_config = mod.get_current_vllm_config()
    cfg = plugin_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        return original(engram_layer, layout, layer_hash_index)
    if problems:
        raise _surface_error("; ".join(problems))
    ecfg = getattr(vllm_config, "engram_config", None)
    missing = [a for a in _ENGRAM_CONFIG_ATTRS if not hasattr(ecfg, a)]
    if ecfg is None or missing:
        raise _surface_error(f"its engram_config lacks {', '.join(missing) or 'everything'}")
    pc = getattr(vllm_config, "parallel_config", None)
    missing = [a for a in _PARALLEL_ATTRS if not hasattr(pc, a)]
    if not hasattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens"):
        missing.append("scheduler_config.max_num_batched_tokens")
    if missing:
        raise _surface_error(f"its config lacks {', '.join(missing)}")
    with _lock:
        why = _unsupported(mod, vllm_config, ecfg)
        att = None
        if why is None:
            max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
            att = _attach(mod, vllm_config, cfg, max_tokens)
            why = att.why
        if why is None:
            emb = _embedding(mod, att, layout, layer_hash_index)
            if isinstance(emb, str):
                why = emb
                if not att.engines:  # no layer uses the table: give it back rather than hold it beside vLLM's
                    att.close(why)
            else:
                return emb
        if cfg.require:
            raise RuntimeError(f"engram.vllm: the Engram table cannot come from engramd ({cfg.socket}) and "
                               f"require is true: {why}")
        key = ("fallback", why)
        if key not in _state["attachments"]:
            _state["attachments"][key] = True
            logger.warning("engram.vllm: event=fallback detail=\"%s\": vLLM keeps its own Engram table storage",
                           why)
        return original(engram_layer, layout, layer_hash_index)


def _embedding_class(mod):
    cls = _state["class"]
    if cls is not None and cls.__bases__[0] is mod.ParallelEngramEmbedding:
        return cls
    cls = _make_class(mod.ParallelEngramEmbedding)
    _state["class"] = cls
    return cls


def _embedding(mod, att, layout, layer_hash_index):
    """An EngramdEmbedding for one layer, or a sentence saying why this layer cannot take engramd's table."""
    t = att.table
    li = layer_hash_index
    if li >= len(t.layout.layers):
        return f"layer index {li}: engramd's table has {len(t.layout.layers)} layers"
    cfg = mod.get_current_vllm_config().engram_config
    missing = [a for a in ("primes", "num_embeddings", "head_dim") if not hasattr(layout, a)]
    if missing:
        raise _surface_error(f"EngramLayout has no {', '.join(missing)}")
    head_sizes = tuple(size for order in layout.primes[li] for size in order)
    # vLLM's co-located group with dp_shared_memory: one table for the group, TP shards, every replica its own
    # tokens (what engramd's copy gives); without a group, the same.
    dp_shared = int(mod.get_engram_dp_size()) > 1 and bool(cfg.dp_shared_memory)
    emb = _embedding_class(mod)(att, li, layout.num_embeddings[li], layout.head_dim, head_sizes,
                                cpu_offload=True, dp_shared_memory=dp_shared, use_thp=False)
    missing = [a for a in _INSTANCE_ATTRS if not hasattr(emb, a)]
    if missing:
        raise _surface_error(f"ParallelEngramEmbedding leaves no {', '.join(missing)}")
    lay = t.layout.layers[li]
    window = (emb.head_start, emb.head_start + emb.part_n_hash_cols)
    if window[1] > emb.n_hash_cols:
        return (f"TP shard {window} pads past the {emb.n_hash_cols} hash columns: the padded heads are vLLM's "
                "(this plugin serves TP sizes that divide the columns)")
    if (t.layout.col_begin, t.layout.col_end) != window or (lay.row_begin, lay.row_end) != (emb.vocab_start_idx,
                                                                                              emb.vocab_end_idx):
        return (f"engramd's shard (columns [{t.layout.col_begin}, {t.layout.col_end}), rows [{lay.row_begin}, "
                f"{lay.row_end})) is not vLLM's (columns [{window[0]}, {window[1]}), rows [{emb.vocab_start_idx}, "
                f"{emb.vocab_end_idx}))")
    if list(lay.column_rows[window[0]:window[1]]) != list(head_sizes[window[0]:window[1]]):
        return "engramd's bucket sizes (primes) differ from vLLM's layout: a different config.json"
    att.engine(li)  # now, at model construction: never first under a CUDA graph capture
    return emb


def _make_class(base):
    import torch

    class EngramdEmbedding(base):
        """vLLM's ParallelEngramEmbedding whose table is engramd's shared segment (see engram.vllm)."""

        def __init__(self, attachment, layer_index, *args, **kwargs):
            object.__setattr__(self, "_engramd", attachment)
            object.__setattr__(self, "_engramd_layer", layer_index)
            object.__setattr__(self, "_engramd_fast", set())
            super().__init__(*args, **kwargs)

        def _allocate_weights(self):
            rows, dim = self.part_num_embeddings, self.dim
            return (_plugin.placeholder(rows, dim, "float8_e4m3fn"),
                    _plugin.placeholder(rows, dim // self.block_size, "uint8"))

        def _storage(self):
            raise RuntimeError("engram.vllm: this Engram table is engramd's shared segment; use lookup()")

        def _weight_loader(self, param, loaded_weight):
            """Reads none of the table's bytes: compares a few rows of the checkpoint's tensor with the segment."""
            which = "weight" if param is self.weight else "scale"
            dim = self.dim if which == "weight" else self.dim // self.block_size
            if loaded_weight.dtype != torch.uint8:
                loaded_weight = loaded_weight.view(torch.uint8)
            if tuple(loaded_weight.shape[1:]) != (dim,) or loaded_weight.shape[0] < self.vocab_end_idx:
                raise RuntimeError(f"engram.vllm: the checkpoint's Engram {which} of layer index "
                                   f"{self._engramd_layer} has shape {tuple(loaded_weight.shape)}; the served "
                                   f"table needs rows up to {self.vocab_end_idx} of {dim} bytes")
            rec = self._engramd.table.records(self._engramd_layer)
            n = self.vocab_end_idx - self.vocab_start_idx
            rows = [self.vocab_start_idx + r
                    for r in _plugin.sample_rows(n, 1000003 * self._engramd_layer + (which == "scale"))]
            cols = slice(0, self.dim) if which == "weight" else slice(self.dim, self.dim + dim)
            bad = _plugin.mismatched_rows(loaded_weight, rec, self.vocab_start_idx, rows, cols)
            if bad:
                a = self._engramd
                raise RuntimeError(
                    f"engram.vllm: the checkpoint vLLM loads is not the one engramd serves: row {bad[0]} of the "
                    f"Engram {which} of layer index {self._engramd_layer} differs ({len(bad)} of {len(rows)} "
                    f"sampled rows) between vLLM's weights and engramd's segment of {a.checkpoint}; point vLLM "
                    "and engramd at the same files")
            self._engramd.checked.add((self._engramd_layer, which))

        def lookup(self, indices, out, background=False):
            if indices.shape[0] == 0:
                return
            eng = self._engramd.engine(self._engramd_layer)
            key = (tuple(indices.shape), indices.stride(), indices.dtype, tuple(out.shape), out.stride(), out.dtype,
                   indices.device, out.device, bool(background))
            if key in self._engramd_fast:
                # The same shapes, strides and dtypes as a call the engine's checks accepted: only the pointers
                # and the stream are new (the overlap check is redone with them).
                _lookup_fast(eng, self._engramd_layer, indices, out, self.head_start, self.part_n_hash_cols,
                             background)
                return
            if not self._engramd_fast:
                unchecked = [w for w in ("weight", "scale") if (self._engramd_layer, w) not in self._engramd.checked]
                if unchecked:
                    logger.warning("engram.vllm: event=rows_not_compared layer_index=%d tensors=%s: vLLM never "
                                   "called this table's weight loader (a dummy or custom load format?); its rows are "
                                   "engramd's served segment, unchecked against vLLM's checkpoint",
                                   self._engramd_layer, ",".join(unchecked))
            eng.lookup_into(self._engramd_layer, indices, out, col_begin=self.head_start,
                            num_cols=self.part_n_hash_cols, background=background)
            self._engramd_fast.add(key)

    return EngramdEmbedding


def _lookup_fast(eng, layer, indices, out, col_begin, num_cols, background):
    from . import _lib
    packed = out.element_size() == 1
    T = indices.shape[0]
    ids_stride = indices.stride(0) if T > 1 else indices.shape[1]
    row = out.shape[2]
    token_stride = out.stride(0) if T > 1 else num_cols * row
    isz = out.element_size()
    id_size = indices.element_size()
    ids_lo, ids_hi = indices.data_ptr(), indices.data_ptr() + ((T - 1) * ids_stride + indices.shape[1]) * id_size
    out_lo, out_hi = out.data_ptr(), out.data_ptr() + ((T - 1) * token_stride + num_cols * row) * isz
    if ids_lo < out_hi and out_lo < ids_hi:
        raise ValueError("out: overlaps ids")
    flags = (_lib.LOOKUP_PACKED if packed else 0) | (_lib.LOOKUP_BACKGROUND if background else 0) | \
        (_lib.LOOKUP_IDS64 if id_size == 8 else 0)
    eng._c(_lib.lib.engram_engine_lookup_into, layer, indices.data_ptr(), T, ids_stride, col_begin, num_cols,
           out.data_ptr(), token_stride, flags, eng.stream())
