#!/usr/bin/env python3
"""Golden hash multipliers, primes and offsets of docs/math.md sections 3-4, drawn by NumPy itself (the reference
library).

    /usr/bin/python3 tests/data/golden_multipliers.py CONFIG_JSON [COMPRESSED_VOCAB] > golden.json

Multipliers: numpy.random.default_rng(10007 * layer).integers(0, bound, size=N, dtype=int64) * 2 + 1 with
bound = max(1, (INT64_MAX // compressed_vocab) // 2). Primes: for each layer (config order) and order n = 2..N,
n_heads times the smallest prime above the previous one (starting from engram_vocab_size - 1) that no earlier column
took. Needs NumPy (Debian: python3-numpy). This program shares no code with the C++ under test.
"""
import json
import sys

import numpy as np

WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for every n < 3.3e24


def probably_prime(n):
    if n < 2:
        return False
    for w in WITNESSES:
        if n % w == 0:
            return n == w
    odd, twos = n - 1, 0
    while odd % 2 == 0:
        odd, twos = odd // 2, twos + 1
    for w in WITNESSES:
        y = pow(w, odd, n)
        if y == 1 or y == n - 1:
            continue
        for _ in range(twos - 1):
            y = y * y % n
            if y == n - 1:
                break
        else:
            return False
    return True


def text_config(cfg):
    return cfg if "engram_layer_ids" in cfg else cfg.get("text_config", cfg)


def golden(cfg, compressed):
    order = cfg["engram_max_ngram_size"]
    bound = max(1, (int(np.iinfo(np.int64).max) // compressed) // 2)
    taken = set()
    layers = []
    for layer in cfg["engram_layer_ids"]:
        draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(order,), dtype=np.int64)
        primes = []
        for _ in range(2, order + 1):
            candidate = cfg["engram_vocab_size"] - 1
            for _ in range(cfg["engram_n_heads"]):
                candidate += 1
                while candidate in taken or not probably_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                primes.append(candidate)
        offsets = [sum(primes[:i]) for i in range(len(primes))]
        layers.append({"layer": layer, "multipliers": [int(2 * d + 1) for d in draws], "primes": primes,
                       "offsets": offsets, "rows": sum(primes)})
    return {"compressed_vocab": compressed, "bound": bound, "layers": layers}


def main(argv):
    if len(argv) < 2:
        sys.exit("usage: golden_multipliers.py CONFIG_JSON [COMPRESSED_VOCAB]")
    with open(argv[1]) as f:
        cfg = text_config(json.load(f))
    compressed = int(argv[2]) if len(argv) > 2 else int(cfg["engram_compressed_vocab_size"])
    print(json.dumps(golden(cfg, compressed), indent=1))


if __name__ == "__main__":
    main(sys.argv)
