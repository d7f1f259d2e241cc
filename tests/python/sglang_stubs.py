"""Stand-ins, written here, for the `sglang.*` modules that SGLang's own files import, so that the real files
(saved from the public sgl-project/sglang repository under the directory ENGRAM_SGLANG_SRC names; never committed
here) run without the rest of SGLang: python/sglang/srt/layers/engram.py (the Engram module), its kernels
(python/sglang/kernels/ops/embeddings/*.py) and SGLang's plugin loader and hook registry
(python/sglang/srt/plugins/__init__.py, hook_registry.py).

ENGRAM_SGLANG_SRC is either one source tree (it holds python/sglang/...) or a directory of trees, one per SGLang
commit (<commit>/python/sglang/...), as .cache/sglang-src of a checkout keeps them. `sources()` lists the trees that
hold the Engram module, by commit; a file that a tree lacks (the plugin loader, a kernel) is taken from another tree
of the same directory that holds it (`find_file`).

    for commit, src in sglang_stubs.sources(): ...
    mod = sglang_stubs.load_engram_module(src)
    plugins = sglang_stubs.load_plugin_loader(src)     # SGLang's own loader and hook registry, or None
    sglang_stubs.STATE.parallel / .model / .env     # what get_parallel(), get_model() and envs.X.get() give

SGLang's kernels are the real files where triton is installed and a tree has them, stand-ins that cannot launch
elsewhere. torch and NumPy are the real ones; msgspec (a dependency of SGLang's, not part of it) is the real one where
installed, else a minimal frozen-struct shim. Test-only. Not thread-safe.
"""
import importlib.util
import os
import sys
from types import SimpleNamespace

from vllm_stubs import _module, _package  # the same module-building helpers

ENGRAM_MODULE = "sglang.srt.layers.engram"
ENGRAM_FILE = os.path.join("python", "sglang", "srt", "layers", "engram.py")
KERNELS = os.path.join("python", "sglang", "kernels", "ops", "embeddings")
PLUGINS = os.path.join("python", "sglang", "srt", "plugins")
# A module of SGLang's model code that holds `from sglang.srt.layers.engram import ...` copies, as the DeepSeek-V4.1
# model file (python/sglang/srt/models/deepseek_v4.py) does: stood in here, with the names it copies.
MODEL_MODULE = "sglang.srt.models.deepseek_v4"


class _State:
    parallel = SimpleNamespace(tp_size=1, tp_rank=0, attn_cp_size=1, attn_cp_rank=0)
    model = SimpleNamespace(model_path=None, trust_remote_code=False, revision=None)
    serving = SimpleNamespace(tokenizer_path=None, tokenizer_mode="auto")
    env = {}


STATE = _State()

_ENV_DEFAULTS = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": False, "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "auto",
                 "SGLANG_DSV41_ENGRAM_HOST_TABLE_PIN": True, "SGLANG_ENABLE_DSV41_ENGRAM_DROP_PAGE_CACHE": False,
                 "SGLANG_ENABLE_DSV41_ENGRAM_KV_PREFETCH": False, "SGLANG_OPT_ENGRAM_HOST_OFFLOAD": False}


def _unset_reason():
    return ("ENGRAM_SGLANG_SRC is unset: it names a directory holding SGLang's own source files "
            f"({ENGRAM_FILE}), or one such tree per SGLang commit (<commit>/{ENGRAM_FILE}), saved from the public "
            "sgl-project/sglang repository (never committed here)")


def _root():
    src = os.environ.get("ENGRAM_SGLANG_SRC")
    return os.path.abspath(src) if src else None


def _trees(root):
    """Every source tree of root: root itself when it holds python/sglang, else its subdirectories that do."""
    if os.path.isdir(os.path.join(root, "python", "sglang")):
        return [root]
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n, "python", "sglang"))]


def commit_of(src):
    """The name a tree is known by in test ids: its directory's name (a commit hash: its first 8 digits)."""
    name = os.path.basename(src.rstrip("/"))
    if len(name) == 40 and all(c in "0123456789abcdef" for c in name):
        return name[:8]
    return name


def sources():
    """[(commit, tree)] of the trees of ENGRAM_SGLANG_SRC that hold SGLang's Engram module (empty when unset)."""
    root = _root()
    if root is None:
        return []
    return [(commit_of(t), t) for t in _trees(root) if os.path.isfile(os.path.join(t, ENGRAM_FILE))]


def skip_reason():
    """Why there is no SGLang tree to test (None when there is one)."""
    root = _root()
    if root is None:
        return _unset_reason()
    if not sources():
        return (f"ENGRAM_SGLANG_SRC={root} has no {ENGRAM_FILE}, neither itself nor in a <commit>/ subdirectory")
    return None


def src_dir_or_skip_reason(commit=None):
    """(tree, None) for the tree of `commit` (default: the first), else (None, the reason to skip)."""
    why = skip_reason()
    if why:
        return None, why
    for c, t in sources():
        if commit is None or c == commit or os.path.basename(t).startswith(commit):
            return t, None
    return None, f"ENGRAM_SGLANG_SRC={_root()} has no tree of SGLang commit {commit}"


def find_file(src, rel):
    """rel (a repo path) from the tree src, else from another tree of the same directory (sorted; None: none)."""
    p = os.path.join(src, rel)
    if os.path.isfile(p):
        return p
    root = _root()
    for t in (_trees(root) if root else []):
        p = os.path.join(t, rel)
        if os.path.isfile(p):
            return p
    return None


class _Var:
    def __init__(self, name):
        self.name = name

    def get(self):
        return STATE.env.get(self.name, _ENV_DEFAULTS.get(self.name))


class _Envs:
    def __getattr__(self, name):
        return _Var(name)


class _TpGroup:
    rank_in_group, world_size = 0, 1

    def broadcast_object(self, obj, src=0):
        return obj

    def barrier(self):
        return None


def _msgspec():
    try:
        import msgspec  # noqa: F401
        return
    except ImportError:
        pass

    class Struct:
        def __init_subclass__(cls, frozen=False, **kw):
            super().__init_subclass__()

        def __init__(self, *args, **kwargs):
            names = list(getattr(type(self), "__annotations__", {}))
            for n, v in zip(names, args):
                object.__setattr__(self, n, v)
            for n, v in kwargs.items():
                object.__setattr__(self, n, v)

    _module("msgspec", Struct=Struct)


def _no(*a, **k):
    raise RuntimeError("stand-in SGLang: not available in this test")


def _replicated_linear():
    """SGLang's ReplicatedLinear as far as the Engram module builds one: a module of the given shape, no weights."""
    from torch import nn

    class ReplicatedLinear(nn.Module):
        def __init__(self, input_size, output_size, bias=True, quant_config=None, prefix="", **kw):
            super().__init__()
            self.input_size, self.output_size, self.prefix = input_size, output_size, prefix

        def forward(self, x):
            raise RuntimeError("stand-in SGLang: ReplicatedLinear does not run in this test")

    return ReplicatedLinear


def _load_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


KERNEL_FILES = {"engram_gather": {"engram_gather": _no},
                "engram_gate": {"fused_engram_gate": _no},
                "engram_hash": {"MODE_DECODE": 0, "MODE_EXTEND": 1, "MODE_VERIFY": 2, "engram_commit_history": _no,
                                "engram_hash_ids": _no, "engram_hash_ids_and_commit": _no}}


def kernel_file(src, name):
    """The real kernel file `name` (engram_gather, ...) for src (see find_file), or None."""
    return find_file(src, os.path.join(KERNELS, name + ".py"))


def install_stubs(src):
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    _msgspec()
    root = os.path.join(src, "python", "sglang")
    sg = _package("sglang", root)
    sg.__version__ = os.environ.get("ENGRAM_SGLANG_VERSION", "source files of " + commit_of(src))
    _package("sglang.srt", os.path.join(root, "srt"))
    _package("sglang.srt.layers", os.path.join(root, "srt", "layers"))
    _module("sglang.srt.distributed", tensor_model_parallel_all_reduce=lambda t: t,
            get_tensor_model_parallel_rank=lambda: STATE.parallel.tp_rank,
            get_tensor_model_parallel_world_size=lambda: STATE.parallel.tp_size)
    _module("sglang.srt.distributed.parallel_state", get_tp_group=lambda: _TpGroup())
    _module("sglang.srt.environ", envs=_Envs())
    _package("sglang.srt.hardware_backend")
    _package("sglang.srt.hardware_backend.npu")
    _module("sglang.srt.hardware_backend.npu.utils", is_npu_arch35=lambda: False)
    _package("sglang.srt.layers.attention")
    _package("sglang.srt.layers.attention.dsv4")
    _module("sglang.srt.layers.attention.dsv4.torch_quant", FP8_BLOCK_SIZE=32)
    _module("sglang.srt.layers.dp_attention", attn_cp_all_gather_into_tensor=_no, dp_gather_replicate=_no,
            dp_reduce_scatter_tensor=_no, dp_scatter=_no, get_attention_dp_size=lambda: 1,
            get_global_dp_buffer_len=lambda: 0, is_dp_gatherv_active=lambda: False)
    _module("sglang.srt.layers.engram_offload", get_engram_offload_manager=_no)
    _module("sglang.srt.layers.linear", ReplicatedLinear=_replicated_linear())
    _package("sglang.srt.layers.quantization")
    _module("sglang.srt.layers.quantization.base_config", QuantizationConfig=type("QuantizationConfig", (), {}))
    _package("sglang.srt.managers")
    _module("sglang.srt.managers.schedule_batch", MM_PAD_SHIFT_VALUE=1_000_000)
    _package("sglang.srt.model_executor")
    _module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=type("ForwardBatch", (), {}))
    _module("sglang.srt.runtime_context", get_model=lambda: STATE.model, get_parallel=lambda: STATE.parallel,
            get_serving=lambda: STATE.serving, get_exec=_no, get_schedule=_no)
    _package("sglang.srt.utils")
    sys.modules["sglang.srt.utils"].add_prefix = lambda name, prefix: f"{prefix}.{name}" if prefix else name
    sys.modules["sglang.srt.utils"].is_npu = lambda: False
    _package("sglang.srt.utils.hf_transformers")
    _module("sglang.srt.utils.hf_transformers.tokenizer", get_tokenizer=_no)
    _package("sglang.kernels", os.path.join(root, "kernels"))
    _package("sglang.kernels.ops", os.path.join(root, "kernels", "ops"))
    _package("sglang.kernels.ops.embeddings")
    try:
        import triton  # noqa: F401
        real = True
    except ImportError:  # the module imports; its kernels cannot run here
        real = False
    for name, attrs in KERNEL_FILES.items():
        path = kernel_file(src, name) if real else None
        full = "sglang.kernels.ops.embeddings." + name
        if path:
            _load_file(full, path)
        else:
            _module(full, **attrs)


def load_engram_module(src, path=None):
    """SGLang's Engram module imported from `path` (default: src's engram.py) against the stand-ins, and a stand-in
    of the model module that copies its names (MODEL_MODULE: `from sglang.srt.layers.engram import Engram,
    EngramEmbedding, ...`)."""
    install_stubs(src)
    mod = _load_file(ENGRAM_MODULE, path or os.path.join(src, ENGRAM_FILE))
    _package("sglang.srt.models")
    _module(MODEL_MODULE, Engram=mod.Engram, EngramEmbedding=mod.EngramEmbedding)
    return mod


def plugin_loader_files(src):
    """(plugins/__init__.py, plugins/hook_registry.py) of SGLang for src (see find_file); None for a missing one."""
    return (find_file(src, os.path.join(PLUGINS, "__init__.py")),
            find_file(src, os.path.join(PLUGINS, "hook_registry.py")))


def load_plugin_loader(src):
    """SGLang's own plugin loader (`sglang.srt.plugins`, with `load_plugins()`) and hook registry
    (`sglang.srt.plugins.hook_registry`) imported from their real files against the stand-ins, or None when the
    directory holds neither. Call after load_engram_module."""
    init, registry = plugin_loader_files(src)
    if init is None or registry is None:
        return None
    _package("sglang.srt.plugins", os.path.dirname(registry))
    hooks = _load_file("sglang.srt.plugins.hook_registry", registry)
    spec = importlib.util.spec_from_file_location("sglang.srt.plugins", init,
                                                  submodule_search_locations=[os.path.dirname(registry)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["sglang.srt.plugins"] = pkg
    sys.modules["sglang.srt"].plugins = pkg
    pkg.hook_registry = hooks
    spec.loader.exec_module(pkg)
    return pkg


def write_entry_point(directory, name="engram", value="engram.sglang:register"):
    """A distribution's metadata under `directory` (put it on sys.path) that declares `name = value` in SGLang's
    plugin group, as the wheel's pyproject.toml declares it: what importlib.metadata.entry_points finds."""
    d = os.path.join(directory, "engram_sglang_test-0.0.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: engram-sglang-test\nVersion: 0.0\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write(f"[sglang.srt.plugins]\n{name} = {value}\n")
    return directory
