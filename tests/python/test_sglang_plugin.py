"""engram.sglang without a GPU: its configuration (environment variables), the version guard and the fallback rules,
on a stand-in of the surface the plugin touches (written here), and on SGLang's own files loaded from ENGRAM_SGLANG_SRC
(one source tree, or one per SGLang commit; skipped, with the reason, when it is unset or lacks a commit): its Engram
module at each commit saved there (served at 4be612a4, refused at 00604d28: TESTED below, the table of docs/api.md)
and its real plugin loader and hook registry, so that the plugin is loaded, run and installed by SGLang's own code.
The GPU half (rows equal to SGLang's own gather on its own shared host table) is test_sglang_gpu.py."""
import importlib
import json
import logging
import os
import subprocess
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


# SGLang commits and what the plugin does on each (docs/api.md, "Tested SGLang versions").
TESTED = {"4be612a4": "served", "00604d28": "refused"}


def _commits(want=None):
    found = sglang_stubs.sources()
    if not found:
        return [pytest.param(None, marks=pytest.mark.skip(reason=sglang_stubs.skip_reason()), id="no-sglang-src")]
    out = []
    for commit, src in found:
        verdict = TESTED.get(commit, "untested")
        if want is None or verdict == want:
            out.append(pytest.param(src, id=commit))
    if not out:
        missing = [c for c, v in TESTED.items() if v == want]
        return [pytest.param(None, marks=pytest.mark.skip(
            reason=f"ENGRAM_SGLANG_SRC={os.environ.get('ENGRAM_SGLANG_SRC')} has no tree of a {want} SGLang commit "
                   f"({', '.join(missing)})"), id=f"no-{want}-commit")]
    return out


@pytest.fixture
def sglang_tree(monkeypatch):
    """Loads SGLang's tree given by the test's parameter (see _commits) against the stand-ins; afterwards no sglang
    module stays behind. torch < 2.1 has no float8 dtypes: SGLang's own table is then uint8 (same bytes)."""
    import torch
    for name in ("float8_e4m3fn", "float8_e8m0fnu"):
        if not hasattr(torch, name):
            monkeypatch.setattr(torch, name, torch.uint8, raising=False)
    sglang_stubs.STATE.env = {}
    sglang_stubs.STATE.model.model_path = None
    yield
    es.uninstall()
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def load_sglang(src, tmp_path, monkeypatch, loader=True):
    """(SGLang's Engram module, its plugin loader or None) from src; our entry point is declared as the wheel
    declares it, where importlib.metadata (SGLang's discovery) finds it."""
    if src is None:
        pytest.skip(sglang_stubs.skip_reason())
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("SGLang's Engram module imports torch, which is not installed here")
    mod = sglang_stubs.load_engram_module(src)
    plugins = sglang_stubs.load_plugin_loader(src) if loader else None
    if loader and plugins is None:
        pytest.skip(f"ENGRAM_SGLANG_SRC has no SGLang plugin loader ({sglang_stubs.PLUGINS}/__init__.py and "
                    "hook_registry.py) for the commit's tree or another")
    d = tmp_path / "entry-point"
    d.mkdir(exist_ok=True)
    monkeypatch.syspath_prepend(sglang_stubs.write_entry_point(str(d)))
    importlib.invalidate_caches()
    return mod, plugins


def engram_config(ckpt=None):
    """The config SGLang's Engram reads, from the checkpoint's config.json (a small default without one)."""
    c = {"engram_layer_ids": [1, 3], "engram_num_embeddings": [100, 100], "engram_head_dim": 256,
         "engram_max_ngram_size": 3, "engram_n_heads": 4, "hidden_size": 256, "hc_mult": 4, "rms_norm_eps": 1e-6}
    if ckpt:
        with open(os.path.join(ckpt, "config.json")) as f:
            c.update(json.load(f))
    return SimpleNamespace(**c)


def build_engram(mod, cfg, li=0):
    """SGLang's own Engram layer for layer index li, built by SGLang's code (as its model builds it)."""
    layout = mod.EngramLayout(max_ngram_size=cfg.engram_max_ngram_size, layer_ids=tuple(cfg.engram_layer_ids),
                              num_embeddings=tuple(cfg.engram_num_embeddings), primes=(), n_heads=cfg.engram_n_heads,
                              head_dim=cfg.engram_head_dim)
    return mod.Engram(cfg, cfg.engram_layer_ids[li], layout)


def plugin_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "sglang.engram" and r.levelno >= logging.WARNING]


def configure(monkeypatch, socket, require=False, timeout_ms=2000):
    monkeypatch.setenv("ENGRAM_SGLANG_SOCKET", socket)
    monkeypatch.setenv("ENGRAM_SGLANG_TIMEOUT_MS", str(timeout_ms))
    if require:
        monkeypatch.setenv("ENGRAM_SGLANG_REQUIRE", "1")


@pytest.mark.parametrize("src", _commits())
def test_the_surface_at_each_commit(src, sglang_tree, tmp_path, monkeypatch):
    mod, _ = load_sglang(src, tmp_path, monkeypatch, loader=False)
    commit = sglang_stubs.commit_of(src)
    problems = es.check_surface(mod)
    if commit not in TESTED:
        pytest.skip(f"SGLang {commit} is not in the tested-versions table; the plugin would "
                    f"{'serve it' if not problems else 'refuse it: ' + '; '.join(problems)}")
    if TESTED[commit] == "served":
        assert problems == []
    else:
        assert problems, f"SGLang {commit} is listed as refused but has the surface"


@pytest.mark.parametrize("src", _commits("served"))
def test_unconfigured_register_leaves_sglang_as_it_is(src, sglang_tree, tmp_path, monkeypatch, caplog):
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)
    own = mod.EngramEmbedding
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
    assert mod.EngramEmbedding is own and type(build_engram(mod, engram_config()).embed) is own
    assert "event=idle" in caplog.text and "not configured" in caplog.text, caplog.text
    assert plugin_warnings(caplog) == []


@pytest.mark.parametrize("src", _commits("served"))
def test_sglangs_loader_installs_ours_through_its_hook_registry(src, sglang_tree, daemon, checkpoint, tmp_path,
                                                                 monkeypatch, caplog):
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)
    own, model = mod.EngramEmbedding, sys.modules[sglang_stubs.MODEL_MODULE]
    assert model.EngramEmbedding is own
    sglang_stubs.STATE.model.model_path = checkpoint
    configure(monkeypatch, daemon.socket)
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()  # SGLang's own: discovers the entry point, runs register(), applies the hooks
        layer = build_engram(mod, engram_config(checkpoint))
    ours = mod.EngramEmbedding
    assert ours is not own and issubclass(ours, own) and ours.__name__ == "EngramdEmbedding"
    # The copy SGLang's model module took with `from sglang.srt.layers.engram import EngramEmbedding` is ours too.
    assert model.EngramEmbedding is ours
    assert type(layer.embed) is ours
    version = sys.modules["sglang"].__version__
    assert f"event=installed via=hook_registry sglang={version}" in caplog.text, caplog.text
    assert "Applied 1 hook(s) to sglang.srt.layers.engram.EngramEmbedding" in caplog.text, caplog.text
    assert "Failed to" not in caplog.text, caplog.text
    from conftest import torch_cuda
    if torch_cuda() is None:  # here SGLang keeps its own rows in our class, and says why
        assert layer.embed._engramd is None and "no usable GPU" in caplog.text, caplog.text


@pytest.mark.parametrize("src", _commits("served"))
def test_without_a_hook_registry_the_modules_class_is_replaced(src, sglang_tree, daemon, checkpoint, tmp_path,
                                                                monkeypatch, caplog):
    mod, _ = load_sglang(src, tmp_path, monkeypatch, loader=False)  # a SGLang without sglang.srt.plugins
    own = mod.EngramEmbedding
    sglang_stubs.STATE.model.model_path = checkpoint
    configure(monkeypatch, daemon.socket)
    with caplog.at_level(logging.INFO):
        es.register()
        layer = build_engram(mod, engram_config(checkpoint))
    assert mod.EngramEmbedding is not own and type(layer.embed) is mod.EngramEmbedding
    assert f"event=installed via=module_attribute sglang={sys.modules['sglang'].__version__}" in caplog.text


@pytest.mark.parametrize("src", _commits("refused"))
def test_a_refused_commit_keeps_sglangs_own_or_fails_when_required(src, sglang_tree, tmp_path, monkeypatch, caplog):
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)
    own, version = mod.EngramEmbedding, sys.modules["sglang"].__version__
    configure(monkeypatch, str(tmp_path / "none.sock"))
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
        layer = build_engram(mod, engram_config())
    assert mod.EngramEmbedding is own and type(layer.embed) is own
    warnings = plugin_warnings(caplog)
    assert len(warnings) == 1, caplog.text
    assert "event=refused" in warnings[0] and version in warnings[0] and "EngramEmbedding.__init__ is not" in \
        warnings[0] and "SGLang keeps its own" in warnings[0]

    es.uninstall()
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)  # a fresh process's SGLang
    configure(monkeypatch, str(tmp_path / "none.sock"), require=True)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
    assert "Executed general plugin: engram" in caplog.text, caplog.text  # register() raised nothing
    with pytest.raises(RuntimeError) as e:
        build_engram(mod, engram_config())
    msg = str(e.value)
    assert msg.startswith("engram.sglang: ") and "ENGRAM_SGLANG_REQUIRE is set" in msg and version in msg
    assert "EngramEmbedding.__init__ is not (num_embeddings, dim, layer_id)" in msg and "fail closed" in msg


@pytest.mark.parametrize("src", _commits("served"))
def test_engramd_down_keeps_sglangs_own_once_or_fails_when_required(src, sglang_tree, checkpoint, tmp_path,
                                                                    monkeypatch, caplog):
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)
    own = mod.EngramEmbedding
    sock = str(tmp_path / "none.sock")
    sglang_stubs.STATE.model.model_path = checkpoint
    configure(monkeypatch, sock)
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
        layers = [build_engram(mod, engram_config(checkpoint), li) for li in (0, 1)]
    assert mod.EngramEmbedding is own and all(type(l.embed) is own for l in layers)
    warnings = plugin_warnings(caplog)
    assert len(warnings) == 1, caplog.text
    assert "event=fallback" in warnings[0] and f"engramd does not answer on {sock}" in warnings[0] and \
        "SGLang keeps its own" in warnings[0]

    es.uninstall()
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)  # a fresh process's SGLang
    configure(monkeypatch, sock, require=True)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
    assert "Executed general plugin: engram" in caplog.text, caplog.text
    assert "via=hook_registry" in caplog.text and sys.modules[sglang_stubs.MODEL_MODULE].EngramEmbedding is \
        mod.EngramEmbedding, caplog.text  # the failing class reached the model module's copy too
    with pytest.raises(RuntimeError, match=f"ENGRAM_SGLANG_REQUIRE is set: engramd does not answer on {sock}"):
        build_engram(mod, engram_config(checkpoint))


@pytest.mark.parametrize("src", _commits("served"))
def test_register_outside_sglangs_loader_applies_its_hook_itself(src, sglang_tree, tmp_path, monkeypatch, caplog):
    mod, plugins = load_sglang(src, tmp_path, monkeypatch)
    own = mod.EngramEmbedding
    configure(monkeypatch, str(tmp_path / "none.sock"), require=True)
    with caplog.at_level(logging.INFO):
        es.register()  # not from SGLang's load_plugins: no one else would call apply_hooks
    assert mod.EngramEmbedding is not own and sys.modules[sglang_stubs.MODEL_MODULE].EngramEmbedding is \
        mod.EngramEmbedding
    assert "Applied 1 hook(s) to sglang.srt.layers.engram.EngramEmbedding" in caplog.text, caplog.text
    with pytest.raises(RuntimeError, match="ENGRAM_SGLANG_REQUIRE is set"):
        build_engram(mod, engram_config())
    es.uninstall()
    assert mod.EngramEmbedding is own and sys.modules[sglang_stubs.MODEL_MODULE].EngramEmbedding is own


# Run in a process whose ENGRAM_LIB names a file that is not a library: SGLang's loader, then a layer.
_UNLOADABLE = r"""
import json, logging, os, sys
sys.path[:0] = [os.environ["T_HERE"], os.environ["T_PYTHON"], os.environ["T_EP"]]
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append((r.name, r.levelno, r.getMessage()))
logging.getLogger().addHandler(H()); logging.getLogger().setLevel(logging.INFO)
import torch
for n in ("float8_e4m3fn", "float8_e8m0fnu"):
    if not hasattr(torch, n):
        setattr(torch, n, torch.uint8)
import sglang_stubs, test_sglang_plugin as t
mod = sglang_stubs.load_engram_module(os.environ["T_SRC"])
own = mod.EngramEmbedding
plugins = sglang_stubs.load_plugin_loader(os.environ["T_SRC"])
plugins.load_plugins()
out = {"own": mod.EngramEmbedding is own, "error": None}
try:
    out["layer_is_own"] = type(t.build_engram(mod, t.engram_config()).embed) is own
except RuntimeError as e:
    out["error"] = str(e)
out["warnings"] = [m for n, l, m in records if n == "sglang.engram" and l >= logging.WARNING]
out["executed"] = any("Executed general plugin: engram" in m for _, _, m in records)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("src", _commits("served"))
@pytest.mark.parametrize("require", [False, True], ids=["own", "required"])
def test_an_unloadable_library_keeps_sglangs_own_once_or_fails_when_required(src, require, tmp_path):
    if src is None:
        pytest.skip(sglang_stubs.skip_reason())
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("SGLang's Engram module imports torch, which is not installed here")
    if None in sglang_stubs.plugin_loader_files(src):
        pytest.skip(f"ENGRAM_SGLANG_SRC has no SGLang plugin loader ({sglang_stubs.PLUGINS}/__init__.py and "
                    "hook_registry.py) for the commit's tree or another")
    bad = tmp_path / "libengram_c.so"
    bad.write_text("not a shared library\n")
    ep = tmp_path / "ep"
    ep.mkdir()
    sglang_stubs.write_entry_point(str(ep))
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_SGLANG")}
    env.update(ENGRAM_LIB=str(bad), ENGRAM_SGLANG_SRC=os.environ["ENGRAM_SGLANG_SRC"], T_SRC=src, T_HERE=here,
               T_PYTHON=os.path.join(os.path.dirname(os.path.dirname(here)), "python"), T_EP=str(ep),
               ENGRAM_SGLANG_SOCKET=str(tmp_path / "none.sock"), ENGRAM_SGLANG_TIMEOUT_MS="500")
    if require:
        env["ENGRAM_SGLANG_REQUIRE"] = "1"
    p = subprocess.run([sys.executable, "-c", _UNLOADABLE], env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout + p.stderr
    out = json.loads(lines[0][len("RESULT "):])
    assert out["executed"], out  # SGLang loaded and ran the plugin: `import engram.sglang` needed no library
    if require:
        assert out["error"] and "ENGRAM_SGLANG_REQUIRE is set: the engram library cannot be loaded" in out["error"] \
            and str(bad) in out["error"], out
    else:
        assert out["own"] and out["layer_is_own"] and out["error"] is None, out
        assert len(out["warnings"]) == 1 and "the engram library cannot be loaded" in out["warnings"][0], out


@pytest.mark.parametrize("src", _commits("served"))
def test_an_edited_copy_of_sglangs_module_fails_closed(src, sglang_tree, tmp_path, monkeypatch):
    if src is None:
        pytest.skip(sglang_stubs.skip_reason())
    text = open(os.path.join(src, sglang_stubs.ENGRAM_FILE), encoding="utf-8").read()
    old = "    def __init__(self, num_embeddings: int, dim: int, layer_id: int):"
    assert old in text, "the saved SGLang file no longer has EngramEmbedding.__init__ as this test edits it"
    copy = tmp_path / "engram_edited.py"
    copy.write_text(text.replace(old, "    def __init__(self, num_embeddings: int, dim: int, layer_id: int, tp=None):", 1))
    load_sglang(src, tmp_path, monkeypatch, loader=False)
    mod = sglang_stubs.load_engram_module(src, str(copy))
    assert any("EngramEmbedding.__init__" in p for p in es.check_surface(mod))
    es.install(mod)
    monkeypatch.setenv("ENGRAM_SGLANG", "1")
    with pytest.raises(RuntimeError, match="EngramEmbedding.__init__"):
        mod.EngramEmbedding(10, 256, 1)
