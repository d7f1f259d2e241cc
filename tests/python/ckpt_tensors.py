"""A checkpoint's Engram table tensors as an engine's weight loader is handed them (torch tensors read with
safetensors): shared by the plugins' GPU tests and their benchmarks. Test and benchmark helper; pure reads."""
import json
import os


def embed_tensors(ckpt, layer_id):
    """{"weight", "scale"}: layer `layer_id`'s Engram table tensors."""
    from safetensors import safe_open
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)["weight_map"]
    out = {}
    for suffix in ("weight", "scale"):
        name = f"layers.{layer_id}.engram.embed.{suffix}"
        with safe_open(os.path.join(ckpt, index[name]), framework="pt") as f:
            out[suffix] = f.get_tensor(name)
    return out
