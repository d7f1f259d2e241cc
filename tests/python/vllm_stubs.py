"""Stand-ins, written here, for the `vllm.*` modules that vLLM's own Engram module imports, so that the real module
(vllm/models/deepseek_v41/common/engram.py, from the directory ENGRAM_VLLM_SRC names; never committed here) runs
without the rest of vLLM. Only vLLM's own modules are replaced: torch, triton (where it is installed) and NumPy are
the real ones. Without triton, `vllm.triton_utils` gets a placeholder whose kernels cannot be launched (the
module imports; a launch raises).

    mods = vllm_stubs.load_engram_module(src_dir)      # the real module, imported against these stubs
    vllm_stubs.STATE.config = make_vllm_config(...)      # what get_current_vllm_config() returns
    vllm_stubs.STATE.tp = (size, rank)

Test-only. Not thread-safe (one test at a time).
"""
import importlib
import importlib.util
import logging
import os
import sys
import types
from types import SimpleNamespace

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
ENGRAM_FILE = os.path.join("vllm", "models", "deepseek_v41", "common", "engram.py")


class _State:
    config = None
    tp = (1, 0)
    engram_dp_size = 1


STATE = _State()


def src_dir_or_skip_reason():
    """(directory, None) when ENGRAM_VLLM_SRC holds vLLM's Engram module, else (None, the reason to skip)."""
    src = os.environ.get("ENGRAM_VLLM_SRC")
    if not src:
        return None, ("ENGRAM_VLLM_SRC is unset: it names a directory holding vLLM's own source files "
                      f"({ENGRAM_FILE}), saved from the public vllm-project/vllm repository (never committed here)")
    if not os.path.isfile(os.path.join(src, ENGRAM_FILE)):
        return None, f"ENGRAM_VLLM_SRC={src} has no {ENGRAM_FILE}"
    return src, None


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


def _package(name, path=None):
    m = _module(name)
    m.__path__ = [path] if path else []
    return m


class _Logger(logging.LoggerAdapter):
    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})
        self._once = set()

    def warning_once(self, msg, *args, **kw):
        if msg not in self._once:
            self._once.add(msg)
            self.warning(msg, *args, **kw)

    def info_once(self, msg, *args, **kw):
        if msg not in self._once:
            self._once.add(msg)
            self.info(msg, *args, **kw)


def _triton_utils():
    try:
        import triton
        import triton.language as tl
        return triton, tl
    except ImportError:
        pass

    class _Constexpr:
        def __init__(self, v=None):
            self.value = v

        def __bool__(self):
            return bool(self.value)

    class _Kernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError("triton is not installed here: vLLM's Triton kernels cannot run")

    def jit(fn=None, **_):
        if fn is None:
            return lambda f: _Kernel(f)
        return _Kernel(fn)

    triton = SimpleNamespace(jit=jit, cdiv=lambda a, b: -(-a // b), __version__="0.0 (placeholder)",
                             next_power_of_2=lambda n: 1 << max(0, (n - 1).bit_length()))
    tl = SimpleNamespace(constexpr=_Constexpr, int1=None, int32=None, int64=None, float32=None, bfloat16=None,
                         uint8=None)
    return triton, tl


def _uva_view(cpu_tensor):
    """A CUDA tensor over a pinned host tensor's memory (what vLLM's get_accelerator_view_from_cpu_tensor gives):
    the device address of pinned memory under UVA, wrapped with __cuda_array_interface__."""
    import torch
    import ctypes
    cudart = _cudart()
    dev = ctypes.c_void_p()
    rc = cudart.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(cpu_tensor.data_ptr()), 0)
    if rc != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer failed ({rc}): the tensor is not pinned")
    nbytes = cpu_tensor.numel() * cpu_tensor.element_size()

    class _Cai:
        __cuda_array_interface__ = {"data": (dev.value, False), "shape": (nbytes,), "typestr": "|u1", "version": 2}

    flat = torch.as_tensor(_Cai(), device=f"cuda:{torch.cuda.current_device()}")
    return flat.view(cpu_tensor.dtype).view(cpu_tensor.shape)


_CUDART = None


def _cudart():
    global _CUDART
    if _CUDART is None:
        import ctypes
        import glob
        import torch
        names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        names += sorted(glob.glob(os.path.join(lib_dir, "libcudart*.so*")))
        for base in (os.path.dirname(torch.__file__), "/usr/local/cuda/lib64"):
            names += sorted(glob.glob(os.path.join(base, "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
            names += sorted(glob.glob(os.path.join(base, "libcudart.so*")))
        for n in names:
            try:
                _CUDART = ctypes.CDLL(n)
                break
            except OSError:
                continue
        if _CUDART is None:
            raise RuntimeError("no libcudart found for the UVA view stand-in")
    return _CUDART


def install_stubs(src):
    """Registers the stand-ins in sys.modules and makes `vllm.models.deepseek_v41.common` a package over
    src's files."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    vllm = _package("vllm", os.path.join(src, "vllm"))
    vllm.__version__ = os.environ.get("ENGRAM_VLLM_VERSION", "source files of " + os.path.basename(src.rstrip("/")))
    _package("vllm.compilation")
    _module("vllm.compilation.breakable_cudagraph", eager_break_during_capture=lambda fn: fn)
    _module("vllm.config", VllmConfig=type("VllmConfig", (), {}), get_current_vllm_config=lambda: STATE.config)
    _package("vllm.distributed")
    d = sys.modules["vllm.distributed"]

    def _no_collective(*a, **k):
        raise RuntimeError("stand-in vLLM: no collectives in this test")

    d.__dict__.update(get_dp_group=lambda: SimpleNamespace(rank_in_group=0, world_size=1),
                      get_engram_dp_group=lambda: None, get_engram_dp_size=lambda: STATE.engram_dp_size,
                      get_tensor_model_parallel_rank=lambda: STATE.tp[1],
                      get_tensor_model_parallel_world_size=lambda: STATE.tp[0],
                      tensor_model_parallel_all_gather=_no_collective)
    _package("vllm.distributed.device_communicators")
    _module("vllm.distributed.device_communicators.shm_broadcast", SHM_PATH="/dev/shm",
            check_shm_free_space=lambda n: None)
    _module("vllm.distributed.parallel_state", GroupCoordinator=type("GroupCoordinator", (), {}))
    _module("vllm.forward_context", get_forward_context=lambda: SimpleNamespace(dp_metadata=None),
            is_forward_context_available=lambda: False)
    _module("vllm.logger", init_logger=lambda name: _Logger(name))
    _package("vllm.model_executor")
    _package("vllm.model_executor.layers")
    _package("vllm.model_executor.layers.fusion")
    _module("vllm.model_executor.layers.fusion.quant_activation",
            QuantizedActivation=type("QuantizedActivation", (), {}))
    _module("vllm.model_executor.layers.linear", ColumnParallelLinear=type("ColumnParallelLinear", (), {}))
    _package("vllm.model_executor.layers.quantization")
    sys.modules["vllm.model_executor.layers.quantization"].QuantizationConfig = type("QuantizationConfig", (), {})
    _package("vllm.model_executor.layers.quantization.utils")
    _module("vllm.model_executor.layers.quantization.utils.quant_utils", kMxfp8Dynamic=object())

    def set_weight_attrs(param, attrs):
        for k, v in (attrs or {}).items():
            setattr(param, k, v)

    _module("vllm.model_executor.utils", set_weight_attrs=set_weight_attrs)
    _package("vllm.models", os.path.join(src, "vllm", "models"))
    _package("vllm.models.deepseek_v41", os.path.join(src, "vllm", "models", "deepseek_v41"))
    _package("vllm.models.deepseek_v41.common", os.path.join(src, "vllm", "models", "deepseek_v41", "common"))
    _package("vllm.models.deepseek_v41.common.ops")
    _module("vllm.models.deepseek_v41.common.ops.query_quant", can_fuse_query_quant=lambda *a, **k: False,
            mxfp8_scale_bytes=lambda tokens, width: tokens * (width // 32),
            mxfp8_scale_offset=lambda *a, **k: 0)
    _module("vllm.platforms", current_platform=SimpleNamespace(
        is_cuda=lambda: True, is_rocm=lambda: False, is_device_capability_family=lambda *a, **k: False))
    triton, tl = _triton_utils()
    _module("vllm.triton_utils", triton=triton, tl=tl)
    _package("vllm.utils")
    _module("vllm.utils.platform_utils", is_uva_available=lambda: True)
    _module("vllm.utils.torch_utils", get_accelerator_view_from_cpu_tensor=_uva_view)


def load_engram_module(src, path=None):
    """vLLM's Engram module imported from `path` (default: src's engram.py) against the stand-ins."""
    install_stubs(src)
    path = path or os.path.join(src, ENGRAM_FILE)
    spec = importlib.util.spec_from_file_location(ENGRAM_MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ENGRAM_MODULE] = mod
    spec.loader.exec_module(mod)
    sys.modules["vllm.models.deepseek_v41.common"].engram = mod
    return mod


def make_vllm_config(model, *, additional_config=None, cpu_offload=True, dp_shared_memory=None,
                     embedding_across_dp=False, use_thp=False, dp_size=1, dp_rank=0, dp_local=None,
                     elastic_ep=False, max_tokens=256):
    """A VllmConfig-shaped namespace with the fields the Engram module and the plugin read."""
    return SimpleNamespace(
        additional_config=additional_config or {},
        engram_config=SimpleNamespace(cpu_offload=cpu_offload, dp_shared_memory=dp_shared_memory,
                                      embedding_across_dp=embedding_across_dp, use_thp=use_thp),
        parallel_config=SimpleNamespace(data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                                        data_parallel_size_local=dp_local if dp_local is not None else dp_size,
                                        enable_elastic_ep=elastic_ep, tensor_parallel_size=STATE.tp[0]),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens),
        model_config=SimpleNamespace(model=model, revision=None))


def hf_config(checkpoint):
    """The checkpoint's config.json as the attribute object vLLM's EngramLayout reads."""
    import json
    with open(os.path.join(checkpoint, "config.json")) as f:
        return SimpleNamespace(**json.load(f))
