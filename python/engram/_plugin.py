"""What the engine plugins (engram.vllm, engram.sglang) share: reading a boolean setting, the parameter that holds
no table, and the check a weight loader makes instead of loading (a few rows of the checkpoint's tensor against the
served segment's records). Pure functions; thread-safe."""
import random

# Rows a weight loader compares with the segment: the first, the last and a few between (fixed per layer).
SAMPLES = 8


def env_bool(name, text):
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={text!r}: expected true or false")


def placeholder(rows, cols, dtype_name):
    """A [rows, cols] CPU tensor that holds one row of memory (every row is the same zero row): the parameter an
    engine sees, which no kernel reads."""
    import torch
    return torch.zeros((1, cols), dtype=getattr(torch, dtype_name), device="cpu").expand(rows, cols)


def sample_rows(n, seed):
    """Up to SAMPLES row indices in [0, n): 0, n - 1 and a few between, the same for the same seed."""
    if n <= 0:
        return []
    rng = random.Random(seed)
    return sorted({0, n - 1} | {rng.randrange(n) for _ in range(SAMPLES - 2)})


def mismatched_rows(loaded, records, first_row, rows, cols):
    """The sampled rows of `loaded` (a checkpoint tensor, any dtype of 1-byte elements: [table rows, width]) whose
    bytes differ from records[row - first_row][cols] (the served segment); `rows`: global row indices."""
    import numpy as np
    import torch
    if loaded.dtype != torch.uint8:
        loaded = loaded.view(torch.uint8)
    idx = torch.tensor(rows, dtype=torch.long, device=loaded.device)
    got = loaded.index_select(0, idx).cpu().numpy()
    want = np.asarray(records[[r - first_row for r in rows]][:, cols])
    return [r for r, g, w in zip(rows, got, want) if not np.array_equal(g, w)]
