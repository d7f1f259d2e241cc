"""engram.vllm against every stored vLLM layout (vllm_stubs.VERSIONS: the commits are in the test ids), through
vLLM's own plugin loader (vllm/plugins/__init__.py, load_general_plugins) and the model's own Engram class built
as the DeepSeek-V4.1 model builds it. Without a GPU (this file): the plugin patches the class the model builds,
and, configured, either serves (here: refuses with require, since there is no GPU, or keeps vLLM's own table with
one warning) or refuses naming the vLLM version and what differs; with require and no library, no engramd or an
unknown layout, vLLM's startup fails with the plugin's message. The GPU half (rows equal to vLLM's own kernel on
vLLM's own table, per version) is test_vllm_gpu.py. Skipped, with the reason, when ENGRAM_VLLM_SRC lacks a
version's files or torch is not installed."""
import logging
import os
import sys
import traceback

import pytest

import engram._lib as _lib
import engram.vllm as ev
import vllm_stubs
from vllm_stubs import no_dp_shm

VERSIONS = vllm_stubs.available_versions()
SERVED = [v for v, _ in VERSIONS if v.served]


def _torch_or_skip():
    try:
        import torch  # noqa: F401
        return torch
    except ImportError:
        pytest.skip("vLLM's Engram modules import torch, which is not installed here")


def _clean_plugin(monkeypatch):
    """No plugin setting from this process's environment (the test sets its own) and no earlier patch."""
    for k in [k for k in os.environ if k.startswith("ENGRAM_VLLM") and k not in ("ENGRAM_VLLM_SRC",
                                                                                  "ENGRAM_VLLM_VERSION")]:
        monkeypatch.delenv(k)
    ev.uninstall()


@pytest.fixture(params=[v for v, _ in VERSIONS], ids=lambda v: v.tag)
def vm(request, tmp_path, monkeypatch):
    """The version's real modules, loaded against the stand-ins, with the plugin's state clean around the test."""
    why = dict((v.tag, w) for v, w in VERSIONS)[request.param.tag]
    if why:
        pytest.skip(why)
    _torch_or_skip()
    _clean_plugin(monkeypatch)
    loaded = vllm_stubs.load_version(request.param, str(tmp_path))
    vllm_stubs.STATE.tp, vllm_stubs.STATE.engram_dp_size, vllm_stubs.STATE.plugins = (1, 0), 1, None
    monkeypatch.syspath_prepend(str(_dist_info(tmp_path)))
    yield loaded
    ev.uninstall()


def _dist_info(tmp_path):
    """A directory holding an installed distribution's metadata with the plugin's entry point (what the wheel
    installs), for importlib.metadata to find."""
    d = tmp_path / "site"
    info = d / "engram-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: engram\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nengram = engram.vllm:register\n")
    return d


def _load_plugins():
    """vLLM's own plugin loading, as every vLLM process runs it."""
    import importlib
    plugins = importlib.import_module("vllm.plugins")
    plugins.plugins_loaded = False
    plugins.load_general_plugins()


def _configure(vm, checkpoint, **keys):
    vllm_stubs.STATE.config = vllm_stubs.make_vllm_config(
        checkpoint, additional_config={"engram": keys},
        engram_fields=vm.engram_fields, **no_dp_shm(vm))


def _from_vllm(exc, vm):
    """Whether an exception was raised inside one of the version's own files (vLLM building its own table)."""
    return any(f.filename.startswith(vm.root) for f in traceback.extract_tb(exc.__traceback__))


def test_vllms_loader_registers_the_plugin_and_the_class_the_model_builds_is_patched(vm, caplog):
    with caplog.at_level(logging.INFO, logger="vllm.engram"):
        _load_plugins()
    own = vm.model_module.Engram.__dict__
    patched = own.get("_create_embedding") or own.get("__init__")  # __init__: guarded (nothing else to patch)
    assert getattr(patched, "_engram_plugin", False), "the model's own Engram class must be the one patched"
    installed = [r.getMessage() for r in caplog.records if "event=installed" in r.getMessage()
                 or "event=incompatible" in r.getMessage()]
    names = " ".join(installed)
    assert vm.model_module.__name__ in names and sys.modules["vllm"].__version__ in names, caplog.text
    surface = ev.layouts.Surface(vm.model_module)
    if vm.version.served:
        assert surface.served and surface.problems == [], surface.problems
        assert f"layout={surface.kind}" in names
    else:
        assert not surface.served or surface.problems


@pytest.mark.parametrize("version", [v for v, _ in VERSIONS], ids=lambda v: v.tag)
def test_a_module_imported_after_the_plugin_loaded_is_patched_then(version, tmp_path, monkeypatch, caplog):
    # vLLM loads plugins before it imports the model: an unconfigured process imports no Engram module because of
    # the plugin, and the module is patched when vLLM imports it.
    why = vllm_stubs.missing_files(version)
    if why:
        pytest.skip(why)
    _torch_or_skip()
    _clean_plugin(monkeypatch)
    try:
        root, pkg = vllm_stubs.prepare_version(version, str(tmp_path))
        monkeypatch.syspath_prepend(str(_dist_info(tmp_path)))
        with caplog.at_level(logging.INFO, logger="vllm.engram"):
            _load_plugins()
            assert not [n for n in sys.modules if n.endswith(".engram") and n.startswith("vllm.models.")], \
                "loading the plugin imported an Engram module"
            assert caplog.records == [], caplog.text  # unconfigured, before any model: nothing to say
            vm = vllm_stubs.LoadedVersion(version, root, pkg)
        own = vm.model_module.Engram.__dict__
        assert getattr(own.get("_create_embedding") or own.get("__init__"), "_engram_plugin", False)
        assert vm.model_module.__name__ in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        ev.uninstall()


def test_configured_with_require_fails_the_model_build_naming_the_reason(vm, checkpoint, tmp_path):
    _load_plugins()
    _configure(vm, checkpoint, socket=str(tmp_path / "none.sock"), require=True, timeout_ms=300)
    with pytest.raises(RuntimeError) as e:
        vm.build_layer(checkpoint, 0)
    msg = str(e.value)
    assert msg.startswith("engram.vllm:"), msg
    if vm.version.served:
        assert "require is true" in msg and "DAEMON_UNAVAILABLE" in msg, msg
    else:
        assert vm.version.refusal in msg and sys.modules["vllm"].__version__ in msg, msg


def test_configured_without_require_keeps_vllms_own_table_with_one_warning(vm, checkpoint, tmp_path, caplog):
    torch = _torch_or_skip()
    _load_plugins()
    _configure(vm, checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300)
    surface = ev.layouts.Surface(vm.model_module)
    if not vm.version.served and surface.problems:
        # A surface the plugin does not know: a configured engine refuses to start whatever require says.
        with pytest.raises(RuntimeError, match="fail closed"):
            vm.build_layer(checkpoint, 0)
        return
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        for li in (0, 1):
            try:
                layer, _ = vm.build_layer(checkpoint, li)
            except Exception as e:  # without a GPU vLLM cannot build its own table: it got as far as trying
                assert not torch.cuda.is_available() and _from_vllm(e, vm), traceback.format_exc()
            else:
                assert type(layer.embed_tokens).__name__ == "ParallelEngramEmbedding"
                assert type(layer.embed_tokens).__module__ == vm.model_module.__name__
    warnings = [r.getMessage() for r in caplog.records if "event=fallback" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "vLLM keeps its own" in warnings[0]
    assert ("DAEMON_UNAVAILABLE" if vm.version.served else vm.version.refusal) in warnings[0], warnings


def test_unconfigured_the_model_builds_vllms_own_layer_untouched(vm, checkpoint, caplog):
    torch = _torch_or_skip()
    _load_plugins()
    vllm_stubs.STATE.config = vllm_stubs.make_vllm_config(checkpoint, engram_fields=vm.engram_fields, **no_dp_shm(vm))
    caplog.clear()  # what installing said; building an unconfigured layer must add nothing
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        try:
            layer, _ = vm.build_layer(checkpoint, 0)
        except Exception as e:
            assert not torch.cuda.is_available() and _from_vllm(e, vm), traceback.format_exc()
        else:
            assert type(layer.embed_tokens).__name__ == "ParallelEngramEmbedding"
    assert "engram.vllm" not in caplog.text, caplog.text


@pytest.mark.parametrize("what", ["engramd", "library"])
def test_require_in_the_environment_fails_vllms_plugin_loading(vm, tmp_path, monkeypatch, what):
    monkeypatch.setenv("ENGRAM_VLLM_SOCKET", str(tmp_path / "none.sock"))
    monkeypatch.setenv("ENGRAM_VLLM_REQUIRE", "1")
    monkeypatch.setenv("ENGRAM_VLLM_TIMEOUT_MS", "300")
    if what == "library":
        bogus = tmp_path / "libengram_c.so"
        bogus.write_bytes(b"not a library")
        monkeypatch.setenv("ENGRAM_LIB", str(bogus))
        _lib._reset_for_tests()
    try:
        with pytest.raises(RuntimeError) as e:
            _load_plugins()
    finally:
        _lib._reset_for_tests()
    msg = str(e.value)
    assert msg.startswith("engram.vllm: require is true (environment)"), msg
    if what == "library":
        assert "the engram library" in msg and str(bogus) in msg, msg
    if not vm.version.served:
        assert "no Engram layer the plugin can serve" in msg and vm.model_module.__name__ in msg, msg
    elif what == "engramd":
        assert f"engramd at {tmp_path / 'none.sock'}" in msg, msg


def test_an_unloadable_library_does_not_stop_vllms_plugin_loading(vm, checkpoint, tmp_path, monkeypatch, caplog):
    bogus = tmp_path / "libengram_c.so"
    bogus.write_bytes(b"not a library")
    monkeypatch.setenv("ENGRAM_LIB", str(bogus))
    _lib._reset_for_tests()
    try:
        _load_plugins()  # vLLM logs, and goes on without the plugin, when the import fails: it must not
        own = vm.model_module.Engram.__dict__
        assert getattr(own.get("_create_embedding") or own.get("__init__"), "_engram_plugin", False)
        _configure(vm, checkpoint, socket=str(tmp_path / "none.sock"), require=True, timeout_ms=300)
        if vm.version.served:
            with pytest.raises(RuntimeError, match="require is true: .*cannot be loaded"):
                vm.build_layer(checkpoint, 0)
    finally:
        _lib._reset_for_tests()


def test_the_tested_versions_table_in_the_docs_lists_every_version():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "docs", "api.md")
    if not os.path.isfile(path):
        pytest.skip("no docs/api.md beside these tests (they run outside a source tree)")
    doc = open(path, encoding="utf-8").read()
    for v, _ in VERSIONS:
        for commit in v.files.values():
            short = commit.split("-")[-1][:8]  # a commit, or the search id of a file stored without one
            assert short in doc, f"docs/api.md's tested vLLM versions lack {short} ({v.tag})"
