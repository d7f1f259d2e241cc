"""The served table of the vLLM plugin: one attach to engramd per process (Attachment), and the
EngramdEmbedding each layer gets in place of vLLM's ParallelEngramEmbedding: a subclass of the class the layout's
`_create_embedding` builds, which allocates no table memory (its parameters are one-row views), whose weight
loader reads no table bytes (it compares a few rows of the loaded tensor with the served segment: a different
checkpoint is a startup error naming both), and whose `lookup(indices, out, background)` runs the engram engine on
torch's current stream straight into vLLM's `out` (bf16 or packed records, vLLM's column window and token stride):
no host synchronisation, no allocation, capturable in vLLM's CUDA graphs. vLLM's hashing, prefetch stream,
staging, wkv and gate stay vLLM's.

Thread-safety: the callers (engram.vllm's patch) hold the plugin's lock; one layer's lookups are one ordered
sequence on vLLM's streams.
"""
import logging
import os
import time

from .. import _plugin

logger = logging.getLogger("vllm.engram")


# The instance attributes vLLM's ParallelEngramEmbedding.__init__ must leave (checked on every EngramdEmbedding).
INSTANCE_ATTRS = ("head_start", "part_n_hash_cols", "n_hash_cols", "vocab_start_idx", "vocab_end_idx", "dim",
                  "block_size", "cpu_offload", "weight", "weight_scale_inv", "part_num_embeddings")


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


def attach(surface, vllm_config, cfg, max_tokens, attachments):
    """The process's Attachment (made once per checkpoint, rank and socket; kept in `attachments`)."""
    import engram
    pc = vllm_config.parallel_config
    tp_size = int(surface.fn("get_tensor_model_parallel_world_size")())
    tp_rank = int(surface.fn("get_tensor_model_parallel_rank")())
    dp_size = int(pc.data_parallel_size or 1)
    dp_rank = int(pc.data_parallel_rank or 0)
    local = pc.data_parallel_size_local
    elastic = bool(pc.enable_elastic_ep)
    ckpt = _model_dir(vllm_config, cfg)
    key = (ckpt, cfg.socket, tp_size, tp_rank, dp_size, dp_rank)
    att = attachments.get(key)
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
        except (engram.EngramError, ValueError) as e:
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
    attachments[key] = att
    if att.table is not None:
        t = att.table
        gib = sum((l.row_end - l.row_begin) for l in t.layout.layers) * t.layout.record_bytes / 2 ** 30
        logger.info("engram.vllm: event=attached layout=%s mode=%s backend=%s tp=%d/%d dp=%d/%d local_dp=%s "
                    "reasons=%s register_seconds=%.3f attach_seconds=%.3f table_gib=%.2f checkpoint=%s socket=%s "
                    "(vLLM allocates no Engram table; lookups run the engram engine)", surface.describe(), t.mode,
                    t.backend, tp_rank, tp_size, dp_rank, dp_size, local if local else "all",
                    ",".join(r.name for r in t.reasons) or "-", t.register_seconds, att.seconds, gib, ckpt,
                    cfg.socket)
    return att


_classes = {}  # vLLM's embedding class -> its EngramdEmbedding subclass


def embedding_class(base):
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = _make_class(base)
    return cls


def make_embedding(surface, att, layout, layer_hash_index, dp_shared, surface_error):
    """An EngramdEmbedding for one layer, or a sentence saying why this layer cannot take engramd's table."""
    t = att.table
    li = layer_hash_index
    if li >= len(t.layout.layers):
        return f"layer index {li}: engramd's table has {len(t.layout.layers)} layers"
    missing = [a for a in ("primes", "num_embeddings", "head_dim") if not hasattr(layout, a)]
    if missing:
        raise surface_error(f"EngramLayout has no {', '.join(missing)}")
    head_sizes = tuple(size for order in layout.primes[li] for size in order)
    emb = embedding_class(surface.embedding)(att, li, layout.num_embeddings[li], layout.head_dim, head_sizes,
                                             cpu_offload=True, dp_shared_memory=dp_shared)
    missing = [a for a in INSTANCE_ATTRS if not hasattr(emb, a)]
    if missing:
        raise surface_error(f"ParallelEngramEmbedding leaves no {', '.join(missing)}")
    if int(getattr(emb, "dp_size", 1)) != 1:
        return (f"vLLM's embedding splits its heads over an Engram DP group of {emb.dp_size} (its DP-sharded "
                "exchange): the rows are the exchange's, not one replica's lookup")
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
            object.__setattr__(self, "_engramd_allocated", False)
            super().__init__(*args, **kwargs)
            if not self._engramd_allocated:
                raise RuntimeError(f"engram.vllm: {base.__module__}.{base.__qualname__} allocated its table without "
                                   "calling _allocate_weights: this plugin cannot keep vLLM from holding a copy "
                                   "(fail closed)")

        def _allocate_weights(self):
            object.__setattr__(self, "_engramd_allocated", True)
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

        def lookup(self, indices, out, background=False, packed=None):
            # `packed` (where vLLM's lookup takes it) says what `out` holds: the raw records (uint8) or bf16 rows.
            if packed is not None and bool(packed) != (out.element_size() == 1):
                raise ValueError(f"engram.vllm: lookup(packed={packed}) into a {out.dtype} out")
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
    from .. import _lib
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
