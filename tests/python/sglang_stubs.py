"""Stand-ins, written here, for the `sglang.*` modules that SGLang's own Engram module imports, so that the real
module (python/sglang/srt/layers/engram.py from the directory ENGRAM_SGLANG_SRC names; never committed here) runs
without the rest of SGLang. SGLang's own Engram kernels (python/sglang/kernels/ops/embeddings/*.py) are the real
files where triton is installed, stand-ins that cannot launch elsewhere. torch and NumPy are the real ones; msgspec
(a dependency of SGLang's, not part of it) is the real one where installed, else a minimal frozen-struct shim.

    mod = sglang_stubs.load_engram_module(src)
    sglang_stubs.STATE.parallel / .model / .env     # what get_parallel(), get_model() and envs.X.get() give

Test-only. Not thread-safe.
"""
import importlib.util
import os
import sys
from types import SimpleNamespace

from vllm_stubs import _module, _package  # the same module-building helpers

ENGRAM_MODULE = "sglang.srt.layers.engram"
ENGRAM_FILE = os.path.join("python", "sglang", "srt", "layers", "engram.py")
KERNELS = os.path.join("python", "sglang", "kernels", "ops", "embeddings")


class _State:
    parallel = SimpleNamespace(tp_size=1, tp_rank=0, attn_cp_size=1, attn_cp_rank=0)
    model = SimpleNamespace(model_path=None, trust_remote_code=False, revision=None)
    serving = SimpleNamespace(tokenizer_path=None, tokenizer_mode="auto")
    env = {}


STATE = _State()

_ENV_DEFAULTS = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": False, "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "auto",
                 "SGLANG_DSV41_ENGRAM_HOST_TABLE_PIN": True, "SGLANG_ENABLE_DSV41_ENGRAM_DROP_PAGE_CACHE": False,
                 "SGLANG_ENABLE_DSV41_ENGRAM_KV_PREFETCH": False}


def src_dir_or_skip_reason():
    src = os.environ.get("ENGRAM_SGLANG_SRC")
    if not src:
        return None, ("ENGRAM_SGLANG_SRC is unset: it names a directory holding SGLang's own source files "
                      f"({ENGRAM_FILE}), saved from the public sgl-project/sglang repository (never committed here)")
    if not os.path.isfile(os.path.join(src, ENGRAM_FILE)):
        return None, f"ENGRAM_SGLANG_SRC={src} has no {ENGRAM_FILE}"
    return src, None


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


def install_stubs(src):
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    _msgspec()
    root = os.path.join(src, "python", "sglang")
    sg = _package("sglang", root)
    sg.__version__ = os.environ.get("ENGRAM_SGLANG_VERSION", "source files of " + os.path.basename(src.rstrip("/")))
    _package("sglang.srt", os.path.join(root, "srt"))
    _package("sglang.srt.layers", os.path.join(root, "srt", "layers"))
    _module("sglang.srt.distributed", tensor_model_parallel_all_reduce=lambda t: t)
    _module("sglang.srt.distributed.parallel_state", get_tp_group=lambda: _TpGroup())
    _module("sglang.srt.environ", envs=_Envs())
    _package("sglang.srt.layers.attention")
    _package("sglang.srt.layers.attention.dsv4")
    _module("sglang.srt.layers.attention.dsv4.torch_quant", FP8_BLOCK_SIZE=32)
    _module("sglang.srt.layers.dp_attention", attn_cp_all_gather_into_tensor=_no, dp_gather_replicate=_no,
            dp_reduce_scatter_tensor=_no, dp_scatter=_no, get_attention_dp_size=lambda: 1,
            get_global_dp_buffer_len=lambda: 0, is_dp_gatherv_active=lambda: False)
    _module("sglang.srt.layers.linear", ReplicatedLinear=type("ReplicatedLinear", (), {}))
    _package("sglang.srt.layers.quantization")
    _module("sglang.srt.layers.quantization.base_config", QuantizationConfig=type("QuantizationConfig", (), {}))
    _package("sglang.srt.managers")
    _module("sglang.srt.managers.schedule_batch", MM_PAD_SHIFT_VALUE=1_000_000)
    _package("sglang.srt.model_executor")
    _module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=type("ForwardBatch", (), {}))
    _module("sglang.srt.runtime_context", get_model=lambda: STATE.model, get_parallel=lambda: STATE.parallel,
            get_serving=lambda: STATE.serving)
    _package("sglang.srt.utils")
    sys.modules["sglang.srt.utils"].add_prefix = lambda name, prefix: f"{prefix}.{name}" if prefix else name
    _package("sglang.srt.utils.hf_transformers")
    _module("sglang.srt.utils.hf_transformers.tokenizer", get_tokenizer=_no)
    _package("sglang.kernels", os.path.join(root, "kernels"))
    _package("sglang.kernels.ops", os.path.join(root, "kernels", "ops"))
    _package("sglang.kernels.ops.embeddings", os.path.join(root, "kernels", "ops", "embeddings"))
    try:
        import triton  # noqa: F401
    except ImportError:  # the module imports; its kernels cannot run here
        _module("sglang.kernels.ops.embeddings.engram_gather", engram_gather=_no)
        _module("sglang.kernels.ops.embeddings.engram_gate", fused_engram_gate=_no)
        _module("sglang.kernels.ops.embeddings.engram_hash", MODE_DECODE=0, MODE_EXTEND=1, MODE_VERIFY=2,
                engram_commit_history=_no, engram_hash_ids=_no, engram_hash_ids_and_commit=_no)


def load_engram_module(src, path=None):
    """SGLang's Engram module imported from `path` (default: src's engram.py) against the stand-ins."""
    install_stubs(src)
    path = path or os.path.join(src, ENGRAM_FILE)
    spec = importlib.util.spec_from_file_location(ENGRAM_MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ENGRAM_MODULE] = mod
    spec.loader.exec_module(mod)
    sys.modules["sglang.srt.layers"].engram = mod
    return mod
