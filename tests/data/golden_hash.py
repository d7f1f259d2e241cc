#!/usr/bin/env python3
"""Golden hash ids: an independent Python rendering of docs/math.md section 5 (not a port of the C++), fed by NumPy's
multipliers and the reference token map, over fixed cases with pad blocking, DEAD spans, lookback (with unknown and
DEAD lookback ids) and several requests. Usage: golden_hash.py CONFIG MULTIPLIER_GOLDEN TOKENMAP_BIN > hash-cases.json
"""
import json
import struct
import sys

import numpy as np


def main():
    cfg = json.load(open(sys.argv[1]))
    gold = json.load(open(sys.argv[2]))
    raw = open(sys.argv[3], "rb").read()
    tmap = list(struct.unpack("<%di" % (len(raw) // 4), raw))
    n = cfg["engram_max_ngram_size"]
    heads = cfg["engram_n_heads"]
    pad_c = tmap[cfg["engram_pad_token_id"]]
    layers = gold["layers"]
    # sanity: multipliers really are NumPy's
    for L in layers:
        bound = max(1, (np.iinfo(np.int64).max // cfg["engram_compressed_vocab_size"]) // 2)
        m = np.random.default_rng(10007 * L["layer"]).integers(0, bound, size=(n,), dtype=np.int64) * 2 + 1
        assert [int(x) for x in m] == L["multipliers"]

    rng = np.random.default_rng(20261129)
    V = len(tmap)

    def case(name, reqs):
        # reqs: list of (start_pos, tokens, dead flags, lookback list of n-1 raw ids or -1[, lookback dead flags])
        reqs = [req if len(req) == 5 else req + ([0] * (n - 1),) for req in reqs]
        tokens, positions, qsl, lookback, dead, lookback_dead = [], [], [0], [], [], []
        for start, toks, dflags, lb, lbdead in reqs:
            tokens += toks
            positions += list(range(start, start + len(toks)))
            dead += dflags
            lookback += lb
            lookback_dead += lbdead
            qsl.append(len(tokens))
        out = []
        for r, (start, toks, dflags, lb, lbdead) in enumerate(reqs):
            for i in range(len(toks)):
                pos = start + i
                per_layer = []
                for L in layers:
                    m = L["multipliers"]
                    rolling = 0
                    blocked = False
                    ids = []
                    for s in range(n):
                        q = pos - s
                        if q < 0:
                            src = None
                        elif q >= start:
                            j = q - start
                            src = None if dflags[j] else tmap[toks[j]]
                        else:
                            k = q - start + (n - 1)
                            # unknown lookback: the pad token, not a block (older known ids still count), whatever
                            # its dead flag; a known lookback id flagged dead is DEAD
                            if lb[k] == -1:
                                src = pad_c
                            else:
                                src = None if lbdead[k] else tmap[lb[k]]
                        blocked = blocked or src is None
                        v = pad_c if blocked else src
                        rolling ^= v * m[s]
                        assert rolling < 2 ** 63
                        if s > 0:
                            for h in range(heads):
                                c = (s - 1) * heads + h
                                ids.append(rolling % L["primes"][c] + L["offsets"][c])
                    per_layer.append(ids)
                out.append(per_layer)
        return {"name": name, "tokens": tokens, "positions": positions, "query_start_loc": qsl,
                "lookback": lookback, "dead": dead, "lookback_dead": lookback_dead, "ids": out}

    def rand_tokens(k):
        return [int(x) for x in rng.integers(0, V, size=k)]

    nl = n - 1
    cases = [
        case("one request from position 0", [(0, rand_tokens(9), [0] * 9, [-1] * nl)]),
        case("pad token inside the text", [(0, [5, cfg["engram_pad_token_id"], 7, 9, 11], [0] * 5, [-1] * nl)]),
        case("dead span blocks longer n-grams",
             [(0, rand_tokens(10), [0, 0, 0, 1, 1, 0, 0, 0, 0, 0], [-1] * nl)]),
        case("several requests with lookback", [
            (17, rand_tokens(5), [0] * 5, rand_tokens(nl)),
            (1, rand_tokens(3), [0, 0, 0], [-1] * (nl - 1) + rand_tokens(1)),
            (40, rand_tokens(1), [0], [rand_tokens(1)[0], -1] + rand_tokens(nl - 2)),
            (3, rand_tokens(4), [0, 1, 0, 0], rand_tokens(nl)),
        ]),
        case("empty and single-token requests", [
            (0, [], [], [-1] * nl), (0, rand_tokens(1), [0], [-1] * nl), (8, rand_tokens(1), [1], rand_tokens(nl)),
            (2, rand_tokens(2), [0, 0], rand_tokens(nl)),
        ]),
        case("every token id of the vocabulary", [(0, list(range(V)), [0] * V, [-1] * nl)]),
        # An unknown lookback id newer than known ones: it hashes as pad and the older known ids still count.
        case("unknown lookback newer than known", [
            (12, rand_tokens(3), [0] * 3, rand_tokens(nl - 1) + [-1]),
            (7, rand_tokens(1), [0], [-1] + rand_tokens(nl - 2) + [-1]),
            (30, rand_tokens(2), [0, 0], [-1] * nl),
        ]),
        # DEAD lookback ids: each blocks every n-gram that reaches back to it, as a dead token of the chunk does.
        case("dead lookback ids", [
            (20, rand_tokens(4), [0] * 4, rand_tokens(nl), [0] * (nl - 1) + [1]),      # the newest
            (9, rand_tokens(3), [0] * 3, rand_tokens(nl), [1] + [0] * (nl - 1)),       # the oldest
            (15, rand_tokens(2), [0, 0], rand_tokens(nl), [0, 1] + [0] * (nl - 2)),    # one in the middle
            (33, rand_tokens(2), [0, 0], rand_tokens(nl), [1] * nl),                   # all of them
            (6, rand_tokens(3), [0] * 3, rand_tokens(nl), [0] * nl),                   # none
        ]),
        # A dead flag on an unknown lookback id is not read: the id hashes as pad and blocks nothing.
        case("dead flags on unknown lookback ids", [
            (11, rand_tokens(3), [0] * 3, [-1] * nl, [1] * nl),
            (25, rand_tokens(2), [0, 0], rand_tokens(nl - 1) + [-1], [0] * (nl - 1) + [1]),
            (40, rand_tokens(2), [0, 0], [rand_tokens(1)[0], -1] + rand_tokens(nl - 2), [1, 1] + [0] * (nl - 2)),
            (8, rand_tokens(1), [0], [-1] + rand_tokens(nl - 1), [1] + [0] * (nl - 2) + [1]),
        ]),
        # With dead tokens in the chunk, requests near position 0 (flags on positions before 0 change nothing) and an
        # empty request.
        case("dead lookback ids beside dead tokens and position 0", [
            (14, rand_tokens(5), [1, 0, 0, 1, 0], rand_tokens(nl), [0, 1] + [0] * (nl - 2)),
            (1, rand_tokens(3), [0, 0, 0], [-1] * (nl - 1) + rand_tokens(1), [1] * (nl - 1) + [1]),
            (2, rand_tokens(2), [0, 1], [-1] * (nl - 2) + rand_tokens(2), [1] * (nl - 2) + [0, 1]),
            (5, [], [], rand_tokens(nl), [1] * nl),
            (3, rand_tokens(4), [0] * 4, rand_tokens(nl), [0] * (nl - 1) + [1]),
        ]),
    ]
    json.dump({"config": sys.argv[1].split("/")[-1], "cases": cases}, sys.stdout)


if __name__ == "__main__":
    main()
