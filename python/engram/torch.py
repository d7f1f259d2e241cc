"""torch custom ops over an engram Engine (torch >= 2.4, torch.library.custom_op): fake (meta) implementations so
torch.compile traces them without touching the table, out-variants for code that runs between CUDA-graph segments,
and every op on torch's current stream, so CUDA graphs capture and replay them.

    import engram, engram.torch as et
    eid = et.register(engine)                       # ops name engines by an int (a torch op takes no Python object)
    ids = torch.ops.engram.hash(eid, tokens, positions, qsl, lookback, dead)        # int32 [T, L, C]
    ids = torch.ops.engram.hash(eid, ..., dead, lookback_dead)   # with the lookback's DEAD ids
    ticket = torch.ops.engram.prefetch(eid, ids)    # side-stream lookups of every layer; the ticket orders the waits
    rows = torch.ops.engram.wait_rows(eid, layer, ids, ticket)                      # bf16 [T, C, head_dim]
    out = torch.ops.engram.gate(eid, hidden, kv, q_weight, k_weight, dead, eps)

Ops: hash / hash_out, lookup / lookup_out, prefetch, wait_rows / wait_rows_out, gate / gate_out. A functional op
returns a fresh tensor; an `_out` op writes its `out` argument (mutates_args) and returns nothing. prefetch returns a
0-element ticket that wait_rows takes, so a compiler keeps prefetch before the waits (an unused ticket lets it drop
the prefetch). wait_rows copies the layer's rows out of the engine's staging buffer (T x C x head_dim bf16, one
device copy) so that nothing aliases library-owned memory. Importing this module without torch >= 2.4 raises
ImportError saying so.
"""
from typing import Optional

import torch

_v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if _v < (2, 4) or not hasattr(torch.library, "custom_op"):
    raise ImportError(f"engram.torch needs torch >= 2.4 (torch.library.custom_op); this is torch {torch.__version__}")

Tensor = torch.Tensor
_engines = {}


def register(engine):
    """The int an op uses to name `engine` (kept alive by this registry until unregister)."""
    eid = id(engine)
    _engines[eid] = engine
    return eid


def unregister(engine_or_id):
    _engines.pop(engine_or_id if isinstance(engine_or_id, int) else id(engine_or_id), None)


def _e(eid):
    try:
        return _engines[eid]
    except KeyError:
        raise ValueError(f"engram op: engine {eid} is not registered (engram.torch.register(engine))") from None


def _dims(eid):
    lay = _e(eid).layout
    return len(lay.layers), lay.n_cols, lay.head_dim, lay.record_bytes


@torch.library.custom_op("engram::hash", mutates_args=())
def hash(engine: int, tokens: Tensor, positions: Tensor, query_start_loc: Tensor, lookback: Optional[Tensor],
         dead: Optional[Tensor], lookback_dead: Optional[Tensor] = None) -> Tensor:
    return _e(engine).hash(tokens, positions, query_start_loc, lookback, dead, lookback_dead=lookback_dead)


@hash.register_fake
def _(engine, tokens, positions, query_start_loc, lookback, dead, lookback_dead=None):
    L, C, _, _ = _dims(engine)
    return tokens.new_empty((tokens.shape[0], L, C), dtype=torch.int32)


@torch.library.custom_op("engram::hash_out", mutates_args=("out",))
def hash_out(engine: int, tokens: Tensor, positions: Tensor, query_start_loc: Tensor, lookback: Optional[Tensor],
             dead: Optional[Tensor], out: Tensor, lookback_dead: Optional[Tensor] = None) -> None:
    _e(engine).hash(tokens, positions, query_start_loc, lookback, dead, lookback_dead=lookback_dead, out=out)


@hash_out.register_fake
def _(engine, tokens, positions, query_start_loc, lookback, dead, out, lookback_dead=None):
    return None


@torch.library.custom_op("engram::lookup", mutates_args=())
def lookup(engine: int, layer: int, ids: Tensor, packed: bool) -> Tensor:
    _, C, D, RB = _dims(engine)
    if packed:
        out = ids.new_empty((ids.shape[0], C, RB), dtype=torch.uint8)
    else:
        out = ids.new_empty((ids.shape[0], C, D), dtype=torch.bfloat16)
    return _e(engine).lookup(layer, ids, out, packed=packed)


@lookup.register_fake
def _(engine, layer, ids, packed):
    _, C, D, RB = _dims(engine)
    if packed:
        return ids.new_empty((ids.shape[0], C, RB), dtype=torch.uint8)
    return ids.new_empty((ids.shape[0], C, D), dtype=torch.bfloat16)


@torch.library.custom_op("engram::lookup_out", mutates_args=("out",))
def lookup_out(engine: int, layer: int, ids: Tensor, out: Tensor, packed: bool) -> None:
    _e(engine).lookup(layer, ids, out, packed=packed)


@lookup_out.register_fake
def _(engine, layer, ids, out, packed):
    return None


@torch.library.custom_op("engram::prefetch", mutates_args=())
def prefetch(engine: int, hash_ids: Tensor) -> Tensor:
    _e(engine).prefetch(hash_ids)
    return hash_ids.new_empty((0,), dtype=torch.int32)


@prefetch.register_fake
def _(engine, hash_ids):
    return hash_ids.new_empty((0,), dtype=torch.int32)


def _copy_rows(eng, layer, out):
    eng.wait(layer)
    s = eng.staging(layer)
    n = out.shape[0]
    if not isinstance(s, torch.Tensor):  # CPU backend: NumPy uint16 bits
        s = torch.from_numpy(s.view("int16")).view(torch.bfloat16)
    out.copy_(s[:n])


@torch.library.custom_op("engram::wait_rows", mutates_args=())
def wait_rows(engine: int, layer: int, hash_ids: Tensor, ticket: Tensor) -> Tensor:
    _, C, D, _ = _dims(engine)
    out = hash_ids.new_empty((hash_ids.shape[0], C, D), dtype=torch.bfloat16)
    _copy_rows(_e(engine), layer, out)
    return out


@wait_rows.register_fake
def _(engine, layer, hash_ids, ticket):
    _, C, D, _ = _dims(engine)
    return hash_ids.new_empty((hash_ids.shape[0], C, D), dtype=torch.bfloat16)


@torch.library.custom_op("engram::wait_rows_out", mutates_args=("out",))
def wait_rows_out(engine: int, layer: int, ticket: Tensor, out: Tensor) -> None:
    _copy_rows(_e(engine), layer, out)


@wait_rows_out.register_fake
def _(engine, layer, ticket, out):
    return None


@torch.library.custom_op("engram::gate", mutates_args=())
def gate(engine: int, hidden: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, dead: Optional[Tensor],
         eps: float) -> Tensor:
    return _e(engine).gate(hidden, kv, q_weight, k_weight, dead=dead, eps=eps)


@gate.register_fake
def _(engine, hidden, kv, q_weight, k_weight, dead, eps):
    return torch.empty_like(hidden)


@torch.library.custom_op("engram::gate_out", mutates_args=("out",))
def gate_out(engine: int, hidden: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, dead: Optional[Tensor],
             eps: float, out: Tensor) -> None:
    _e(engine).gate(hidden, kv, q_weight, k_weight, dead=dead, out=out, eps=eps)


@gate_out.register_fake
def _(engine, hidden, kv, q_weight, k_weight, dead, eps, out):
    return None
