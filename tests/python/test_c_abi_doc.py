"""docs/api.md's table of the C ABI names every function include/engram/engram_c.h declares, and nothing it does not
(`_name` in a row stands for the row's last full name's prefix, e.g. `_num_cols` after `engram_table_num_layers`)."""
import os
import re

from conftest import REPO


def declared():
    text = open(os.path.join(REPO, "include", "engram", "engram_c.h"), encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return set(re.findall(r"\b(engram_[a-z0-9_]+)\s*\(", text)) - {"engram_log_fn"}


def documented():
    out, in_table = set(), False
    for line in open(os.path.join(REPO, "docs", "api.md"), encoding="utf-8"):
        if line.startswith("| group | functions |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if not in_table:
            continue
        prefix = None
        for tok in re.findall(r"`([a-z_][a-z0-9_]*)", line):
            if tok.startswith("engram_"):
                out.add(tok)
                prefix = "_".join(tok.split("_")[:2])
            elif tok.startswith("_") and prefix:
                out.add(prefix + tok)
    return out


def test_every_c_function_is_in_the_api_table():
    have, doc = declared(), documented()
    assert len(have) > 40, have
    missing = sorted(have - doc)
    assert not missing, f"docs/api.md's C ABI table lacks {', '.join(missing)}"
    extra = sorted(f for f in doc - have if not f.startswith(("engram_attach_request", "engram_engine_flags")))
    assert not extra, f"docs/api.md's C ABI table names functions engram_c.h does not declare: {', '.join(extra)}"
