"""The served table of the SGLang plugin: one attach to engramd per process, to the TP 1 segment (Attachment: the
table and a lookup-only engine per layer, or why there is none), and the EngramdEmbedding each Engram layer gets in
place of SGLang's: a subclass of SGLang's EngramEmbedding that allocates no table memory (one-row parameters), whose
weight loader reads no table bytes (it compares a few rows of the loaded tensor with the served segment), and whose
`forward(indices, ...)` runs the engram engine on the current stream into a bf16 result (no host synchronisation,
capturable in SGLang's CUDA graphs). Without a served table (unconfigured, or a fallback) a layer is SGLang's own.

Thread-safety: the attach and the layer's checks hold the plugin's lock (engram.sglang.state); one layer's lookups
are one ordered sequence on SGLang's stream.
"""
import os
import time

from .. import _plugin
from .config import plugin_config
from .state import _lock, _state, logger
from .surface import _surface_error

# Ids per engine call: a larger batch (a long prefill) is looked up in pieces of this many ids.
_MAX_IDS = 1 << 16


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
                    from .. import _lib
                    eng._c(_lib.lib.engram_engine_lookup_into, layer, ids_part.data_ptr(), ids_part.shape[0], 1, 0,
                           1, rows_part.data_ptr(), self.dim,
                           _lib.LOOKUP_IDS64 if ids_part.element_size() == 8 else 0, eng.stream())
                else:
                    eng.lookup_into(layer, ids_part, rows_part, num_cols=1)
                    self._engramd_fast.add(key)
            return out

    EngramdEmbedding.__name__ = EngramdEmbedding.__qualname__ = "EngramdEmbedding"
    return EngramdEmbedding
