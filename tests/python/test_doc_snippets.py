"""The ```python snippets of README.md, docs/*.md and python/README.md run, against a real engramd serving the test
checkpoint: the socket and checkpoint they name are the test's, the arrays they take as given are small NumPy arrays
of the checkpoint's shapes (the CPU backend), and any call, argument or key that is not the package's fails here.
The C++ snippets are compiled, linked and run by tests/package/run_consumer.py."""
import os
import re

import numpy as np
import pytest

import engram
from conftest import REPO

DOCS = ["README.md", "python/README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                                                  if f.endswith(".md"))


def snippets():
    out = []
    for doc in DOCS:
        body, start = None, 0
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if body is None and re.match(r"^```python\s*$", line):
                    body, start = [], n + 1
                elif body is not None and line.startswith("```"):
                    out.append(pytest.param("".join(body), doc, start, id=f"{doc}:{start}"))
                    body = None
                elif body is not None:
                    body.append(line)
    return out


def given(layout, T=5):
    """The names the snippets take as given: one request of T tokens, and the layer's dense inputs (zeros)."""
    N, C, D, HC = layout.max_ngram, layout.n_cols, layout.hidden_size, layout.hc_mult
    return {
        "input_ids": np.arange(3, 3 + T, dtype=np.int32),
        "positions": np.arange(T, dtype=np.int64),
        "query_start_loc": np.array([0, T], dtype=np.int32),
        "lookback": np.full((1, N - 1), -1, dtype=np.int32),
        "dead": np.zeros(T, dtype=np.uint8),
        "wkv_t": np.zeros((C * layout.head_dim, (HC + 1) * D), dtype=np.uint16),   # bf16 bits
        "hidden": np.zeros((T, HC, D), dtype=np.uint16),
        "q_weight": np.zeros((HC, D), dtype=np.uint16),
        "k_weight": np.zeros((HC, D), dtype=np.uint16),
    }


@pytest.mark.parametrize("code, doc, line", snippets())
def test_the_snippet_runs(code, doc, line, daemon, checkpoint, monkeypatch):
    code = code.replace("/run/engramd/engramd.sock", daemon.socket).replace("/models/DeepSeek-V4.1-Flash", checkpoint)
    attach = engram.attach

    def attach_here(*a, **kw):  # the daemon's socket where the snippet relies on the default; the CPU backend
        kw.setdefault("socket", daemon.socket)
        kw.setdefault("backend", "cpu")
        return attach(*a, **kw)

    monkeypatch.setattr(engram, "attach", attach_here)  # `import engram` in the snippet finds this module
    with attach(checkpoint, socket=daemon.socket, backend="cpu") as t:
        names = given(t.layout)
    exec(compile(code, f"{doc}:{line}", "exec"), names)
    if "table" in names:
        assert names["table"].mode == "SHARED", names["table"].reasons


def test_the_docs_have_python_snippets():
    assert len(snippets()) >= 2, "README.md and docs/api.md each show the package"
