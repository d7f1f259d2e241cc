#!/usr/bin/env python3
"""Writes the small tokenizer.json files of tests/data/tokenizers (committed; rerun only to change them).

Each exercises a part of docs/math.md section 2 against the real Hugging Face library (goldens: scripts/gen-goldens.sh):
byte-level BPE with accents, case, NFKC, whitespace runs, lossy byte pieces, added tokens and a hole in the ids;
a Llama-style Metaspace + ByteFallback + Fuse + Strip pipeline; a Unigram model with a Metaspace decoder; and a
WordLevel model without a decoder.
"""
import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers")


def bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()


def bl(s):
    """byte-level piece of a str (UTF-8) or of raw bytes"""
    data = s if isinstance(s, bytes) else s.encode("utf-8")
    return "".join(B2U[b] for b in data)


def write(name, obj):
    with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)


def added(i, content, special=True, normalized=False):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": normalized, "special": special}


def bytelevel():
    vocab = {}
    for b in range(256):
        vocab[B2U[b]] = len(vocab)
    words = [" The", "the", "THE", " the", "The", " ", "  ", "   ", "\n", "\n\n", " \n ", "\t", "\r\n", "café", "CAFÉ",
             "cafe", " Café", "Ａ", "ａ", "한국어", " 한", "ﬁ", "fi", "Σ", "ΟΣ", "ος", "İ", "i̇", "\u00a0", " \u00a0 ",
             "ा", "का", "\u0301", "e\u0301", "\ufffd", "x\ufffdy", "\ue000", " \ue000 ", "①", "²", "Ⅻ", "ß", "ẞ",
             "Ǆ", "ǅ", "ǆ", "\u200b", "\u3000", "　x", "µ", "μ", "Å", "Å", "\u2028", "ǰ", "ŉ", "ﬀ", "Ω", "Ω"]
    for w in words:
        p = bl(w)
        if p not in vocab:
            vocab[p] = len(vocab)
    # Lossy pieces: incomplete or invalid UTF-8 sequences.
    for raw in [b"\xed\x95", b"\xe0", b"\xff", b" \xc3", b"\xc3\x28", b"\xf0\x9f\x98"]:
        p = bl(raw)
        if p not in vocab:
            vocab[p] = len(vocab)
    n = len(vocab)
    toks = [added(n + 1, "<|bos|>"), added(n + 2, "<｜tool▁sep｜>", special=False, normalized=True),
            added(n + 3, " spaced  added "), added(n + 4, "ĠThe", special=False), added(n + 5, "<|EOS|>"),
            added(vocab[bl("the")], bl("the"), special=False)]
    # id n is a hole: no token has it.
    write("bytelevel-mixed", {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": toks,
        "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                               "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": []}})


def llama():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for w in ["▁the", "▁The", "The", "▁", "▁▁", "é", "▁café", "CAFÉ", "▁Ａ", "한", "▁한국", "▁▁x", "x▁", "▁\t",
              "<0xZZ>", "<0x4>", "ﬁ", "▁Σ"]:
        vocab[w] = len(vocab)
    write("llama-bytefallback", {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "▁"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "vocab": vocab,
                  "merges": []}})


def unigram():
    pieces = ["<pad>", "</s>", "<unk>", "▁", "▁the", "▁The", "THE", "▁▁", "é", "▁é", "x▁y", "▁Ｋ", "ǅ", "▁a▁"]
    write("unigram-metaspace", {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(0, "<pad>"), added(1, "</s>"), added(2, "<unk>")],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 2, "vocab": [[p, -float(i)] for i, p in enumerate(pieces)],
                  "byte_fallback": False}})


def wordlevel():
    words = ["[UNK]", "Hello", "hello", "HÉLLO", "  spaced", "Straße", "STRASSE", "ﬁne", "x"]
    write("wordlevel-nodecoder", {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [added(0, "[UNK]")],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "[UNK]"}})


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    bytelevel()
    llama()
    unigram()
    wordlevel()
