"""engram.sglang without a GPU: its configuration (environment variables), the version guard and the fallback rules,
on a stand-in of the surface the plugin touches (written here) and on SGLang's own Engram module loaded from
ENGRAM_SGLANG_SRC (skipped, with the reason, when it is unset). The GPU half (rows equal to SGLang's own gather on
its own shared host table) is test_sglang_gpu.py."""
import logging
import os
import sys
import types
from types import SimpleNamespace

import pytest

import engram.sglang as es
import sglang_stubs

STAND_IN_VERSION = "0.0-standin"


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    es.uninstall()
    for k in [k for k in os.environ if k.startswith("ENGRAM_SGLANG") and k not in ("ENGRAM_SGLANG_SRC", "ENGRAM_SGLANG_VERSION")]:
        monkeypatch.delenv(k)
    yield
    es.uninstall()


def test_configuration_from_the_environment():
    assert es.plugin_config({}) is None
    assert es.plugin_config({"ENGRAM_SGLANG": "0"}) is None
    c = es.plugin_config({"ENGRAM_SGLANG": "1"})
    assert (c.socket, c.require, c.checkpoint, c.timeout_ms) == (es.DEFAULT_SOCKET, False, None, 10000)
    c = es.plugin_config({"ENGRAM_SGLANG_SOCKET": "/s", "ENGRAM_SGLANG_REQUIRE": "true",
                          "ENGRAM_SGLANG_CHECKPOINT": "/ck", "ENGRAM_SGLANG_TIMEOUT_MS": "50"})
    assert (c.socket, c.require, c.checkpoint, c.timeout_ms) == ("/s", True, "/ck", 50)
    for env, match in (({"ENGRAM_SGLANG": "maybe"}, "true or false"),
                       ({"ENGRAM_SGLANG_SOCKET": "/s", "ENGRAM_SGLANG_TIMEOUT_MS": "x"}, "integer"),
                       ({"ENGRAM_SGLANG_SOCKET": "/s", "ENGRAM_SGLANG_TIMEOUT_MS": "0"}, ">= 1")):
        with pytest.raises(ValueError, match=match):
            es.plugin_config(env)


def stand_in(drop=None):
    m = types.ModuleType("standin_sglang_engram")

    class EngramEmbedding:
        def __init__(self, num_embeddings, dim, layer_id):
            self.own = (num_embeddings, dim, layer_id)

        def _load_rows(self, param, loaded_weight):
            return None

        def finish_load(self, label=""):
            return None

        def forward(self, indices, forward_batch=None, *, cp_all_tokens=False):
            return ("sglang's own", indices)

    class Engram:
        pass

    m.EngramEmbedding, m.Engram = EngramEmbedding, Engram
    m.get_parallel = lambda: SimpleNamespace(tp_size=2, tp_rank=1)
    m.model = SimpleNamespace(model_path=None)
    m.get_model = lambda: m.model
    if drop == "forward":
        def forward(self, indices, forward_batch=None, cp_all_tokens=False):  # not keyword-only
            return None
        EngramEmbedding.forward = forward
    elif drop:
        delattr(EngramEmbedding if hasattr(EngramEmbedding, drop) else m, drop)
    return m


@pytest.fixture
def fake_sglang(monkeypatch):
    s = types.ModuleType("sglang")
    s.__version__ = STAND_IN_VERSION
    monkeypatch.setitem(sys.modules, "sglang", s)
    return s


def test_unconfigured_is_sglangs_own_class_behaviour(fake_sglang):
    m = stand_in()
    assert es.check_surface(m) == []
    es.install(m)
    es.install(m)  # idempotent
    e = m.EngramEmbedding(100, 256, 3)
    assert e.own == (100, 256, 3) and e.forward(5) == ("sglang's own", 5)


def test_engramd_unreachable_keeps_sglangs_storage_and_logs_why(fake_sglang, checkpoint, tmp_path, monkeypatch,
                                                                 caplog):
    m = stand_in()
    m.model.model_path = checkpoint
    es.install(m)
    monkeypatch.setenv("ENGRAM_SGLANG_SOCKET", str(tmp_path / "none.sock"))
    monkeypatch.setenv("ENGRAM_SGLANG_TIMEOUT_MS", "300")
    with caplog.at_level(logging.WARNING, logger="sglang.engram"):
        for layer in (1, 3):
            e = m.EngramEmbedding(100, 256, layer)
            assert e.own == (100, 256, layer) and e.forward(7) == ("sglang's own", 7)
    lines = [r.getMessage() for r in caplog.records if "event=fallback" in r.getMessage()]
    assert len(lines) == 1 and "DAEMON_UNAVAILABLE" in lines[0] and "SGLang keeps its own" in lines[0], caplog.text
    monkeypatch.setenv("ENGRAM_SGLANG_REQUIRE", "1")
    with pytest.raises(RuntimeError, match="ENGRAM_SGLANG_REQUIRE is set: .*DAEMON_UNAVAILABLE"):
        m.EngramEmbedding(100, 256, 1)


def test_a_model_path_that_is_not_a_directory_is_a_reason(fake_sglang, monkeypatch, caplog):
    m = stand_in()
    m.model.model_path = "deepseek-ai/DeepSeek-V4.1-Flash"
    es.install(m)
    monkeypatch.setenv("ENGRAM_SGLANG", "1")
    with caplog.at_level(logging.WARNING, logger="sglang.engram"):
        assert m.EngramEmbedding(10, 256, 1).own == (10, 256, 1)
    assert "ENGRAM_SGLANG_CHECKPOINT" in caplog.text


def test_a_shared_table_without_a_gpu_is_not_handed_to_sglang(fake_sglang, daemon, checkpoint, monkeypatch, caplog):
    from conftest import torch_cuda
    if torch_cuda() is not None:
        pytest.skip("a GPU is usable here: the table is handed to SGLang (test_sglang_gpu.py)")
    m = stand_in()
    m.model.model_path = checkpoint
    es.install(m)
    monkeypatch.setenv("ENGRAM_SGLANG_SOCKET", daemon.socket)
    with caplog.at_level(logging.WARNING, logger="sglang.engram"):
        assert m.EngramEmbedding(10, 256, 1).own == (10, 256, 1)
    assert "no usable GPU" in caplog.text, caplog.text


@pytest.mark.parametrize("drop, named", [("forward", "EngramEmbedding.forward"), ("finish_load", "finish_load"),
                                         ("get_parallel", "get_parallel")])
def test_a_different_surface_fails_closed(fake_sglang, monkeypatch, drop, named, caplog):
    m = stand_in(drop)
    assert any(named in p for p in es.check_surface(m))
    with caplog.at_level(logging.WARNING, logger="sglang.engram"):
        es.install(m)
    assert "event=incompatible" in caplog.text and STAND_IN_VERSION in caplog.text
    assert m.EngramEmbedding(10, 256, 1).own == (10, 256, 1)  # unconfigured: SGLang as it is
    monkeypatch.setenv("ENGRAM_SGLANG", "1")
    with pytest.raises(RuntimeError) as e:
        m.EngramEmbedding(10, 256, 1)
    assert STAND_IN_VERSION in str(e.value) and named in str(e.value) and "fail closed" in str(e.value)


def real_module_or_skip(path=None):
    src, why = sglang_stubs.src_dir_or_skip_reason()
    if src is None:
        pytest.skip(why)
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("SGLang's Engram module imports torch, which is not installed here")
    return sglang_stubs.load_engram_module(src, path)


def test_sglangs_own_module_has_the_surface():
    assert es.check_surface(real_module_or_skip()) == []


def test_an_edited_copy_of_sglangs_module_fails_closed(tmp_path, monkeypatch):
    src, why = sglang_stubs.src_dir_or_skip_reason()
    if src is None:
        pytest.skip(why)
    text = open(os.path.join(src, sglang_stubs.ENGRAM_FILE)).read()
    old = "    def __init__(self, num_embeddings: int, dim: int, layer_id: int):"
    assert old in text, "the saved SGLang file no longer has EngramEmbedding.__init__ as this test edits it"
    copy = tmp_path / "engram_edited.py"
    copy.write_text(text.replace(old, "    def __init__(self, num_embeddings: int, dim: int, layer_id: int, tp=None):", 1))
    mod = real_module_or_skip(str(copy))
    assert any("EngramEmbedding.__init__" in p for p in es.check_surface(mod))
    es.install(mod)
    monkeypatch.setenv("ENGRAM_SGLANG", "1")
    with pytest.raises(RuntimeError, match="EngramEmbedding.__init__"):
        mod.EngramEmbedding(10, 256, 1)
