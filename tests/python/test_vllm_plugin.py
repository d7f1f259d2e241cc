"""engram.vllm without a GPU: its configuration (additional_config and the environment), the version guard, and the
fallback rules, first on a stand-in of the surface the plugin touches (written here), then on vLLM's own Engram
module loaded from ENGRAM_VLLM_SRC (skipped, with the reason, when it is unset). The GPU half (rows equal to vLLM's
own kernel's on vLLM's own table) is test_vllm_gpu.py."""
import logging
import os
import re
import sys
import types
from types import SimpleNamespace

import pytest

import engram
import engram.vllm as ev
import vllm_stubs

STAND_IN_VERSION = "0.0-standin"


@pytest.fixture(autouse=True)
def clean_plugin():
    ev.uninstall()
    yield
    ev.uninstall()


# -- configuration -----------------------------------------------------------------------------------------------

def test_unconfigured_is_none():
    assert ev.plugin_config(None, {}) is None
    assert ev.plugin_config({}, {}) is None
    assert ev.plugin_config({"other_plugin": {}}, {}) is None
    assert ev.plugin_config("", {}) is None


def test_additional_config_and_environment():
    c = ev.plugin_config({"engram": {}}, {})
    assert (c.socket, c.require, c.checkpoint, c.timeout_ms) == (ev.DEFAULT_SOCKET, False, None, 10000)
    c = ev.plugin_config('{"engram": {"socket": "/s", "require": true, "timeout_ms": 5}}', {})
    assert (c.socket, c.require, c.timeout_ms, c.source) == ("/s", True, 5, "additional_config")
    env = {"ENGRAM_VLLM_SOCKET": "/e", "ENGRAM_VLLM_REQUIRE": "1", "ENGRAM_VLLM_CHECKPOINT": "/ck",
           "ENGRAM_VLLM_TIMEOUT_MS": "77"}
    c = ev.plugin_config(None, env)
    assert (c.socket, c.require, c.checkpoint, c.timeout_ms, c.source) == ("/e", True, "/ck", 77, "environment")
    # additional_config wins key by key over the environment.
    c = ev.plugin_config({"engram": {"socket": "/a"}}, env)
    assert (c.socket, c.require) == ("/a", True)
    assert ev.plugin_config(None, {"ENGRAM_VLLM": "1"}).socket == ev.DEFAULT_SOCKET
    assert ev.plugin_config(None, {"ENGRAM_VLLM": "0"}) is None


@pytest.mark.parametrize("bad, match", [
    ({"engram": {"sockett": "/s"}}, "unknown key"),
    ({"engram": {"require": "yes"}}, "require'\\] must be bool"),
    ({"engram": {"timeout_ms": True}}, "must be int"),
    ({"engram": {"timeout_ms": 0}}, r"in \[1, 2147483647\]"),
    ({"engram": {"timeout_ms": 2**32}}, r"in \[1, 2147483647\]"),
    ({"engram": {"socket": "/s\0x"}}, "socket contains a NUL byte"),
    ({"engram": "on"}, "must be an object"),
])
def test_bad_configuration_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        ev.plugin_config(bad, {})


@pytest.mark.parametrize("env, match", [({"ENGRAM_VLLM_SOCKET": "/s", "ENGRAM_VLLM_REQUIRE": "maybe"}, "true or false"),
                                        ({"ENGRAM_VLLM_SOCKET": "/s", "ENGRAM_VLLM_TIMEOUT_MS": "soon"}, "integer")])
def test_bad_environment_is_a_clear_error(env, match):
    with pytest.raises(ValueError, match=match):
        ev.plugin_config(None, env)


def test_register_without_vllm_is_idle_and_idempotent(caplog, monkeypatch):
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "vllm" not in p])
    with caplog.at_level(logging.INFO, logger="vllm.engram"):
        ev.register()
        ev.register()
    assert caplog.records == [], caplog.text  # unconfigured: nothing to say, nothing imported
    hooks = [f for f in sys.meta_path if type(f).__name__ == "_Watch"]
    assert len(hooks) == 1, sys.meta_path
    ev.uninstall()
    assert not [f for f in sys.meta_path if type(f).__name__ == "_Watch"]


def test_the_environment_alone_configures_the_plugin_and_bad_values_are_errors():
    assert ev.plugin_config(None, {"ENGRAM_VLLM_REQUIRE": "1"}).require is True
    assert ev.plugin_config(None, {"ENGRAM_VLLM_CHECKPOINT": "/m"}).checkpoint == "/m"
    with pytest.raises(ValueError, match="true or false"):
        ev.plugin_config(None, {"ENGRAM_VLLM_REQUIRE": "maybe"})
    with pytest.raises(ValueError, match="integer"):
        ev.plugin_config(None, {"ENGRAM_VLLM_TIMEOUT_MS": "ten"})
    # ENGRAM_VLLM=0 turns the environment's settings off; additional_config still configures the plugin.
    assert ev.plugin_config(None, {"ENGRAM_VLLM": "0", "ENGRAM_VLLM_SOCKET": "/s"}) is None
    assert ev.plugin_config({"engram": {}}, {"ENGRAM_VLLM": "0"}).socket == ev.DEFAULT_SOCKET


# -- a stand-in of the surface ---------------------------------------------------------------------------------

def stand_in(drop=None):
    """A module with the names and signatures the plugin touches; `drop` removes one of them."""
    m = types.ModuleType("standin_engram")
    calls = []

    class ParallelEngramEmbedding:
        _weight_loader = staticmethod(lambda p, w: None)

        def __init__(self, num_embeddings, dim, head_sizes, block_size=32, cpu_offload=False,
                     dp_shared_memory=False, use_thp=False):
            self.args = (num_embeddings, dim, head_sizes)

        def _allocate_weights(self):
            return None, None

        def _storage(self):
            return None, None

        def lookup(self, indices, out, background=False):
            return None

    class Engram:
        def _create_embedding(self, layout, layer_hash_index):
            calls.append(layer_hash_index)
            return ("vllm's own", layer_hash_index)

    m.Engram, m.ParallelEngramEmbedding, m.calls = Engram, ParallelEngramEmbedding, calls
    m.get_tensor_model_parallel_rank = lambda: 0
    m.get_tensor_model_parallel_world_size = lambda: 1
    m.get_engram_dp_size = lambda: 1
    m.config = None
    m.get_current_vllm_config = lambda: m.config
    if drop == "lookup":
        def lookup(self, indices, out):  # an older signature
            return None
        ParallelEngramEmbedding.lookup = lookup
    elif drop:
        delattr(m, drop)
    return m


@pytest.fixture
def fake_vllm(monkeypatch):
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # another test's stand-ins of vLLM's modules
    v = types.ModuleType("vllm")
    v.__version__ = STAND_IN_VERSION
    monkeypatch.setitem(sys.modules, "vllm", v)
    return v


def test_the_stand_in_has_the_surface_and_an_unconfigured_engine_keeps_its_own_storage(fake_vllm):
    m = stand_in()
    assert ev.check_surface(m) == []
    ev.install(m)
    ev.install(m)  # idempotent
    m.config = vllm_stubs.make_vllm_config("/nonexistent")
    assert m.Engram()._create_embedding(None, 1) == ("vllm's own", 1)
    assert m.calls == [1]


def test_engramd_unreachable_keeps_vllms_storage_and_logs_why(fake_vllm, tmp_path, checkpoint, caplog):
    m = stand_in()
    ev.install(m)
    m.config = vllm_stubs.make_vllm_config(checkpoint, additional_config={
        "engram": {"socket": str(tmp_path / "none.sock"), "timeout_ms": 300}})
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        for li in (0, 1):
            assert m.Engram()._create_embedding(None, li) == ("vllm's own", li)
    lines = [r.getMessage() for r in caplog.records if "event=fallback" in r.getMessage()]
    assert len(lines) == 1, caplog.text  # once per process, not once per layer
    assert "DAEMON_UNAVAILABLE" in lines[0] and "vLLM keeps its own" in lines[0], lines


def test_engramd_unreachable_and_required_is_a_startup_error(fake_vllm, tmp_path, checkpoint):
    m = stand_in()
    ev.install(m)
    m.config = vllm_stubs.make_vllm_config(checkpoint, additional_config={
        "engram": {"socket": str(tmp_path / "none.sock"), "timeout_ms": 300, "require": True}})
    with pytest.raises(RuntimeError, match="require is true: .*DAEMON_UNAVAILABLE"):
        m.Engram()._create_embedding(None, 0)
    assert m.calls == []


@pytest.mark.parametrize("field, value, group, match", [
    ("cpu_offload", False, 1, "cpu_offload is false"),
    # vLLM's node-local Engram DP group without dp_shared_memory: its DP-sharded exchange gathers every member's
    # hash ids, so one replica's lookup would serve another's tokens.
    ("dp_shared_memory", False, 2, "node-local Engram DP group without dp_shared_memory"),
])
def test_configurations_the_plugin_does_not_serve_keep_vllms_storage(fake_vllm, checkpoint, caplog, field, value,
                                                                     group, match, tmp_path):
    m = stand_in()
    m.get_engram_dp_size = lambda: group
    ev.install(m)
    m.config = vllm_stubs.make_vllm_config(checkpoint, dp_size=2, additional_config={
        "engram": {"socket": str(tmp_path / "none.sock")}})
    setattr(m.config.engram_config, field, value)
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        assert m.Engram()._create_embedding(None, 0) == ("vllm's own", 0)
    assert re.search(match, caplog.text), caplog.text
    m.config.additional_config["engram"]["require"] = True
    with pytest.raises(RuntimeError, match=match):
        m.Engram()._create_embedding(None, 0)


def test_a_shared_table_without_a_gpu_is_not_handed_to_vllm(fake_vllm, daemon, checkpoint, caplog):
    from conftest import torch_cuda
    if torch_cuda() is not None:
        pytest.skip("a GPU is usable here: the table is handed to vLLM (test_vllm_gpu.py)")
    m = stand_in()
    ev.install(m)
    m.config = vllm_stubs.make_vllm_config(checkpoint, additional_config={"engram": {"socket": daemon.socket}})
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        assert m.Engram()._create_embedding(None, 0) == ("vllm's own", 0)
    assert "no usable GPU" in caplog.text and "NO_CUDA_DEVICE" in caplog.text, caplog.text
    # Said as the machine's or the build's state (no driver, no device, a build without CUDA, as the sanitizer
    # builds are), not as CUDA's "driver version is insufficient".
    assert re.search(r"no GPU driver on this machine|no CUDA device|this build has no CUDA", caplog.text), caplog.text
    assert "insufficient" not in caplog.text, caplog.text
    # The probe left no lease behind: status lists no replica of this process.
    mine = [r for r in engram.status(daemon.socket)["replicas"] if r.get("own_pid") == os.getpid()]
    assert mine == [], mine


@pytest.mark.parametrize("drop, named", [("lookup", "ParallelEngramEmbedding.lookup"),
                                         ("get_engram_dp_size", "get_engram_dp_size"),
                                         ("ParallelEngramEmbedding", "no class ParallelEngramEmbedding")])
def test_a_different_surface_fails_closed_naming_the_version_and_the_difference(fake_vllm, checkpoint, drop, named,
                                                                                caplog):
    m = stand_in(drop)
    problems = ev.check_surface(m)
    assert any(named in p for p in problems), problems
    with caplog.at_level(logging.INFO, logger="vllm.engram"):  # WARNING only where the environment configures it
        ev.install(m)
    assert "event=incompatible" in caplog.text and STAND_IN_VERSION in caplog.text
    m.config = vllm_stubs.make_vllm_config(checkpoint)
    assert m.Engram()._create_embedding(None, 0) == ("vllm's own", 0)  # not configured: vLLM as it is
    m.config.additional_config = {"engram": {}}
    with pytest.raises(RuntimeError) as e:
        m.Engram()._create_embedding(None, 0)
    assert STAND_IN_VERSION in str(e.value) and named in str(e.value) and "fail closed" in str(e.value)


@pytest.mark.parametrize("drop, named", [(("engram_config", "dp_shared_memory"), "engram_config lacks dp_shared_memory"),
                                         (("engram_config", "cpu_offload"), "engram_config lacks cpu_offload"),
                                         (("parallel_config", "enable_elastic_ep"), "lacks enable_elastic_ep"),
                                         (("parallel_config", "data_parallel_size_local"),
                                          "lacks data_parallel_size_local"),
                                         (("scheduler_config", "max_num_batched_tokens"),
                                          "scheduler_config.max_num_batched_tokens")])
def test_an_engine_config_without_the_fields_the_plugin_reads_fails_closed(fake_vllm, checkpoint, drop, named):
    m = stand_in()
    ev.install(m)
    m.config = vllm_stubs.make_vllm_config(checkpoint, additional_config={"engram": {}})
    delattr(getattr(m.config, drop[0]), drop[1])
    with pytest.raises(RuntimeError, match=named):
        m.Engram()._create_embedding(None, 0)


def test_the_thp_field_under_either_name_is_not_required(fake_vllm, checkpoint, tmp_path, caplog):
    # vLLM has called its huge-page packing setting use_thp and thp_packing; the plugin reads neither to serve.
    m = stand_in()
    ev.install(m)
    for name in ("use_thp", "thp_packing", None):
        fields = {"cpu_offload": True, "dp_shared_memory": None, "embedding_across_dp": False}
        if name:
            fields[name] = True
        m.config = vllm_stubs.make_vllm_config(checkpoint, engram_fields=fields, additional_config={
            "engram": {"socket": str(tmp_path / "none.sock"), "timeout_ms": 200, "require": True}})
        with pytest.raises(RuntimeError, match="DAEMON_UNAVAILABLE"):  # got as far as attaching
            m.Engram()._create_embedding(None, 0)


def nvidia_stand_in(tmp_path):
    """A split layout written here: <pkg>.common.engram (the GPU-resident base) and <pkg>.nvidia.engram (the
    NVIDIA subclasses the model builds), as importable modules."""
    import importlib
    root = tmp_path / "split"
    for part in ("common", "nvidia"):
        (root / "splitpkg" / part).mkdir(parents=True)
        (root / "splitpkg" / part / "__init__.py").write_text("")
    (root / "splitpkg" / "__init__.py").write_text("")
    (root / "splitpkg" / "common" / "engram.py").write_text(
        "class ParallelEngramEmbedding:\n"
        "    def __init__(self, num_embeddings, dim, head_sizes, block_size=32):\n"
        "        self.args = (num_embeddings, dim, head_sizes)\n"
        "class Engram:\n"
        "    def _create_embedding(self, layout, layer_hash_index):\n"
        "        return ('common', layer_hash_index)\n"
        "get_tensor_model_parallel_rank = lambda: 0\n"
        "get_tensor_model_parallel_world_size = lambda: 1\n"
        "config = None\n"
        "get_current_vllm_config = lambda: config\n")
    (root / "splitpkg" / "nvidia" / "engram.py").write_text(
        "from splitpkg.common import engram as base\n"
        "from splitpkg.common.engram import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size\n"
        "def get_current_vllm_config():\n"
        "    return base.config\n"
        "get_engram_dp_size = lambda: 1\n"
        "class ParallelEngramEmbedding(base.ParallelEngramEmbedding):\n"
        "    _weight_loader = staticmethod(lambda p, w: None)\n"
        "    def __init__(self, num_embeddings, dim, head_sizes, block_size=32, cpu_offload=False,\n"
        "                 dp_shared_memory=False, disk_offload_dir=None):\n"
        "        super().__init__(num_embeddings, dim, head_sizes, block_size)\n"
        "    def _allocate_weights(self):\n"
        "        return None, None\n"
        "    def _storage(self):\n"
        "        return None, None\n"
        "    def lookup(self, indices, out, background=False, packed=False):\n"
        "        return None\n"
        "class Engram(base.Engram):\n"
        "    def _create_embedding(self, layout, layer_hash_index):\n"
        "        return ('nvidia', layer_hash_index)\n")
    sys.path.insert(0, str(root))
    try:
        common = importlib.import_module("splitpkg.common.engram")
        nvidia = importlib.import_module("splitpkg.nvidia.engram")
    finally:
        sys.path.remove(str(root))
    return common, nvidia


@pytest.fixture
def split(tmp_path):
    yield nvidia_stand_in(tmp_path)
    for n in [n for n in sys.modules if n == "splitpkg" or n.startswith("splitpkg.")]:
        del sys.modules[n]


def test_the_nvidia_class_of_a_split_layout_is_patched_and_served(fake_vllm, split, checkpoint, tmp_path, caplog):
    common, nvidia = split
    sc, sn = ev.layouts.Surface(common), ev.layouts.Surface(nvidia)
    assert (sc.kind, sc.served, sc.problems) == ("common", False, [])
    assert (sn.kind, sn.served, sn.problems) == ("nvidia", True, [])  # extra defaulted parameters are fine
    with caplog.at_level(logging.INFO, logger="vllm.engram"):
        ev.install(sn)
        ev.install(sc)
    assert "module=splitpkg.nvidia.engram layout=nvidia" in caplog.text and "served=yes" in caplog.text
    assert "module=splitpkg.common.engram layout=common" in caplog.text
    common.config = vllm_stubs.make_vllm_config(checkpoint, additional_config={
        "engram": {"socket": str(tmp_path / "none.sock"), "timeout_ms": 200, "require": True}})
    # The model builds the NVIDIA class: its own override is the one patched, and it attaches (here: to nothing).
    with pytest.raises(RuntimeError, match="require is true: .*DAEMON_UNAVAILABLE"):
        nvidia.Engram()._create_embedding(None, 0)
    # The GPU-resident base class, configured: refused with the reason, never silently its own table.
    with pytest.raises(RuntimeError, match="keeps its Engram table in GPU memory"):
        common.Engram()._create_embedding(None, 0)
    common.config.additional_config["engram"]["require"] = False
    with caplog.at_level(logging.WARNING, logger="vllm.engram"):
        assert common.Engram()._create_embedding(None, 3) == ("common", 3)
        assert common.Engram()._create_embedding(None, 4) == ("common", 4)
    assert caplog.text.count("keeps its Engram table in GPU memory") == 1, caplog.text
    ev.uninstall()
    assert nvidia.Engram()._create_embedding(None, 1) == ("nvidia", 1)


def test_an_engram_class_without_create_embedding_is_guarded(fake_vllm, checkpoint):
    m = stand_in()
    del m.Engram._create_embedding

    def __init__(self):
        self.built = True

    m.Engram.__init__ = __init__
    problems = ev.check_surface(m)
    assert any("no _create_embedding" in p for p in problems), problems
    ev.install(m)
    m.config = vllm_stubs.make_vllm_config(checkpoint)
    assert m.Engram().built  # unconfigured: vLLM as it is
    m.config.additional_config = {"engram": {}}
    with pytest.raises(RuntimeError, match="fail closed") as e:
        m.Engram()
    assert STAND_IN_VERSION in str(e.value)
    ev.uninstall()
    assert m.Engram().built


# -- vLLM's own module -------------------------------------------------------------------------------------------

def real_module_or_skip(path=None):
    src, why = vllm_stubs.src_dir_or_skip_reason()
    if src is None:
        pytest.skip(why)
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("vLLM's Engram module imports torch, which is not installed here")
    return vllm_stubs.load_engram_module(src, path)


def test_vllms_own_module_has_the_surface():
    mod = real_module_or_skip()
    assert ev.check_surface(mod) == []


@pytest.mark.parametrize("edit, named", [
    (("def lookup(\n        self, indices: torch.Tensor, out: torch.Tensor, background: bool = False",
      "def lookup(\n        self, indices: torch.Tensor, out: torch.Tensor"), "ParallelEngramEmbedding.lookup"),
    (("def _create_embedding(\n        self, layout: EngramLayout, layer_hash_index: int",
      "def _create_embedding(\n        self, layout: EngramLayout, layer_hash_index: int, extra=None"),
     "Engram._create_embedding"),
    (("def _allocate_weights(self)", "def _allocate_weights_v2(self)"), "ParallelEngramEmbedding._allocate_weights"),
])
def test_an_edited_copy_of_vllms_module_fails_closed(tmp_path, checkpoint, edit, named):
    src, why = vllm_stubs.src_dir_or_skip_reason()
    if src is None:
        pytest.skip(why)
    text = open(os.path.join(src, vllm_stubs.ENGRAM_FILE)).read()
    assert edit[0] in text, f"the saved vLLM file no longer has {edit[0]!r}: update this test's edit"
    copy = tmp_path / "engram_edited.py"
    copy.write_text(text.replace(edit[0], edit[1], 1))
    mod = real_module_or_skip(str(copy))
    problems = ev.check_surface(mod)
    assert any(named in p for p in problems), problems
    ev.install(mod)
    vllm_stubs.STATE.config = vllm_stubs.make_vllm_config(checkpoint, additional_config={"engram": {}})
    layout = mod.EngramLayout.from_config(vllm_stubs.hf_config(checkpoint))
    with pytest.raises(RuntimeError) as e:
        mod.Engram._create_embedding(SimpleNamespace(), layout, 0)
    assert sys.modules["vllm"].__version__ in str(e.value) and named in str(e.value)
