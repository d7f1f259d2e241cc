"""Stand-ins, written here, for the `vllm.*` modules that vLLM's own Engram modules import, so that the real modules
(from the directory ENGRAM_VLLM_SRC names; never committed here) run without the rest of vLLM. Only vLLM's own
modules are replaced: torch, triton (where it is installed) and NumPy are the real ones. Without triton,
`vllm.triton_utils` gets a placeholder whose kernels cannot be launched (the module imports; a launch raises).

ENGRAM_VLLM_SRC holds one directory per stored commit (`<40-hex commit>/vllm/...`, the files at their repository
paths), or is itself one such tree. VERSIONS names the vLLM layouts the tests build, each from the stored files of
the commits it lists (a split layout's NVIDIA file over a common file of the same package):

    for v in vllm_stubs.available_versions():            # [(Version, None)] or [(Version, why it is missing)]
    vm = vllm_stubs.load_version(v)                      # the real modules, imported against these stand-ins
    vllm_stubs.STATE.config = make_vllm_config(..., engram_fields=vm.engram_fields)
    layer = vm.build_layer(hf_config, layout, layer_index)   # the model's own Engram class, as the model builds it

Test-only. Not thread-safe (one test at a time).
"""
import ast
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import types
from types import SimpleNamespace

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
ENGRAM_FILE = os.path.join("vllm", "models", "deepseek_v41", "common", "engram.py")


class Version:
    """One vLLM layout to test: the stored files (repository path -> commit) it is made of, and what the plugin is
    expected to do with it."""

    def __init__(self, tag, files, served, refusal=None, config_extra=None):
        self.tag, self.files, self.served, self.refusal = tag, files, served, refusal
        # EngramConfig fields the version's engram file reads that its stored config file lacks (the files come
        # from different commits): their off values.
        self.config_extra = config_extra or {}

    def __repr__(self):
        return self.tag


_C = "vllm/models/deepseek_v41/common/engram.py"
_N = "vllm/models/deepseek_v41/nvidia/engram.py"
_CONFIG = "vllm/config/engram.py"
VERSIONS = (
    Version("nvidia-0130d488-over-common-6da05d38", {_N: "0130d4883fefd6ce2e6b8a61e68346d3626ea5dc",
                                                     _C: "6da05d383c3414420ccab3b477424bae03123441",
                                                     _CONFIG: "13ab20ecf72666374e58f0b199eb95ebde02460b"}, True),
    Version("nvidia-d444c3d1-over-common-0e205574", {_N: "d444c3d1d33e93cdcca818ceed95c1dfb2401c2a",
                                                     _C: "0e205574ebeaf1e5654ca138413144111917d88c",
                                                     _CONFIG: "13ab20ecf72666374e58f0b199eb95ebde02460b"}, True),
    Version("merged-70069513795", {_C: "merged-70069513795"}, True),
    Version("common-6da05d38", {_C: "6da05d383c3414420ccab3b477424bae03123441"}, False,
            "keeps its Engram table in GPU memory"),
    Version("common-0e205574", {_C: "0e205574ebeaf1e5654ca138413144111917d88c",
                                _CONFIG: "13ab20ecf72666374e58f0b199eb95ebde02460b"}, False,
            "keeps its Engram table in GPU memory"),
    Version("v4_1-common-053c340a", {"vllm/models/deepseek_v4_1/common/engram.py":
                                     "053c340ae7cd52c4cc8d683dc8c7cb907a5f1b84",
                                     _CONFIG: "280f7520edbc300238089e87677ef0c4313bc005"}, False,
            "Engram defines no _create_embedding of its own",
            config_extra={"lookup_overlap": False, "lookup_overlap_max_seq_len": 0}),
)
PLUGINS_FILE = ("vllm/plugins/__init__.py", "01425553bdbed63400efa72ff14a8f4ffe20bada")


class _State:
    config = None
    tp = (1, 0)
    engram_dp_size = 1
    plugins = None  # VLLM_PLUGINS


STATE = _State()


def src_root_or_skip_reason():
    """(ENGRAM_VLLM_SRC, None), or (None, the reason to skip)."""
    src = os.environ.get("ENGRAM_VLLM_SRC")
    if not src:
        return None, ("ENGRAM_VLLM_SRC is unset: it names a directory of vLLM's own source files, one directory per "
                      "commit, saved from the public vllm-project/vllm repository (never committed here)")
    if not os.path.isdir(src):
        return None, f"ENGRAM_VLLM_SRC={src} is not a directory"
    return src, None


def stored(rel, commit):
    """The stored file of `rel` at `commit` under ENGRAM_VLLM_SRC, or None."""
    src, _ = src_root_or_skip_reason()
    if src is None:
        return None
    for cand in (os.path.join(src, commit, rel), os.path.join(src, rel) if commit == "-" else None):
        if cand and os.path.isfile(cand):
            return cand
    return None


def missing_files(version):
    """The files of `version` not stored under ENGRAM_VLLM_SRC, as a sentence (None when all are there)."""
    src, why = src_root_or_skip_reason()
    if src is None:
        return why
    gone = [f"{rel} at {commit}" for rel, commit in version.files.items() if stored(rel, commit) is None]
    return f"ENGRAM_VLLM_SRC={src} lacks {', '.join(gone)}" if gone else None


def src_dir_or_skip_reason():
    """(a tree holding the merged common/engram.py, None), else (None, the reason to skip): the single-module
    tests' file."""
    v = next(v for v in VERSIONS if v.tag.startswith("merged"))
    why = missing_files(v)
    if why:
        return None, why
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        stored(_C, v.files[_C])))))), None


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


def install_stubs(root, packages=("deepseek_v41",)):
    """Registers the stand-ins in sys.modules and makes `vllm` a package over root's files (the real modules of
    a version are imported from there)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    vllm = _package("vllm", os.path.join(root, "vllm"))
    vllm.__version__ = os.environ.get("ENGRAM_VLLM_VERSION", "source files of " + os.path.basename(root.rstrip("/")))
    _package("vllm.compilation")
    _module("vllm.compilation.breakable_cudagraph", eager_break_during_capture=lambda fn: fn,
            BreakableCUDAGraphCapture=type("BreakableCUDAGraphCapture", (), {}))
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
            check_shm_free_space=lambda *a, **k: None)
    _module("vllm.distributed.parallel_state", GroupCoordinator=type("GroupCoordinator", (), {}))
    _module("vllm.envs", VLLM_PLUGINS=None)
    sys.modules["vllm.envs"].__class__ = _Envs
    _module("vllm.forward_context", get_forward_context=lambda: SimpleNamespace(dp_metadata=None),
            is_forward_context_available=lambda: False)
    _module("vllm.logger", init_logger=lambda name: _Logger(name))
    _package("vllm.model_executor")
    _package("vllm.model_executor.layers")
    _package("vllm.model_executor.layers.fusion")
    _module("vllm.model_executor.layers.fusion.quant_activation",
            QuantizedActivation=type("QuantizedActivation", (), {}))
    linear = _linear()
    _module("vllm.model_executor.layers.linear", ColumnParallelLinear=linear, ReplicatedLinear=linear)
    _package("vllm.model_executor.layers.quantization")
    sys.modules["vllm.model_executor.layers.quantization"].QuantizationConfig = type("QuantizationConfig", (), {})
    _package("vllm.model_executor.layers.quantization.utils")
    _module("vllm.model_executor.layers.quantization.utils.quant_utils", kMxfp8Dynamic=object())

    def set_weight_attrs(param, attrs):
        for k, v in (attrs or {}).items():
            setattr(param, k, v)

    _module("vllm.model_executor.utils", set_weight_attrs=set_weight_attrs)
    _package("vllm.models", os.path.join(root, "vllm", "models"))
    for pkg in packages:
        base = os.path.join(root, "vllm", "models", pkg)
        _package(f"vllm.models.{pkg}", base)
        for part in ("common", "nvidia"):
            if os.path.isdir(os.path.join(base, part)):
                _package(f"vllm.models.{pkg}.{part}", os.path.join(base, part))
        if f"vllm.models.{pkg}.common" in sys.modules:
            _package(f"vllm.models.{pkg}.common.ops")
            _module(f"vllm.models.{pkg}.common.ops.query_quant", can_fuse_query_quant=lambda *a, **k: False,
                    mxfp8_scale_bytes=lambda tokens, width: tokens * (width // 32),
                    mxfp8_scale_offset=lambda *a, **k: 0)
    _module("vllm.platforms", current_platform=SimpleNamespace(
        is_cuda=lambda: True, is_rocm=lambda: False, is_xpu=lambda: False, is_cuda_alike=lambda: True,
        is_device_capability_family=lambda *a, **k: False))
    triton, tl = _triton_utils()
    _module("vllm.triton_utils", triton=triton, tl=tl)
    _package("vllm.utils")
    _module("vllm.utils.platform_utils", is_uva_available=lambda: True)
    _module("vllm.utils.torch_utils", get_accelerator_view_from_cpu_tensor=_uva_view)
    _package("vllm.v1")
    _package("vllm.v1.worker")
    _module("vllm.v1.worker.ubatching", dbo_current_ubatch_id=lambda: 0)


class _Envs(types.ModuleType):
    """vllm.envs: VLLM_PLUGINS as the test sets it (STATE.plugins)."""

    @property
    def VLLM_PLUGINS(self):
        return STATE.plugins


def _linear():
    import torch

    class Linear(torch.nn.Module):
        """vLLM's ReplicatedLinear / ColumnParallelLinear as the Engram layer builds them (wkv); the weight is
        never used by these tests, so it lives on the meta device."""

        def __init__(self, input_size, output_size, bias=True, quant_config=None, return_bias=True, prefix="",
                     **_):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=torch.bfloat16,
                                                         device="meta"), requires_grad=False)

    return Linear


class LoadedVersion:
    """A version's real modules, imported: `common`, `nvidia` (None where the version has none), `model_module`
    (the module whose Engram the model builds: the NVIDIA one where it exists), and the version's EngramConfig
    field names and defaults (`engram_fields`, read from its config/engram.py without importing it)."""

    def __init__(self, version, root, pkg):
        self.version, self.root, self.pkg = version, root, pkg
        self.common = importlib.import_module(f"vllm.models.{pkg}.common.engram")
        nv = f"vllm.models.{pkg}.nvidia.engram"
        self.nvidia = importlib.import_module(nv) if os.path.isfile(
            os.path.join(root, *nv.split(".")) + ".py") else None
        self.model_module = self.nvidia or self.common
        self.engram_fields = dict(engram_config_fields(os.path.join(root, "vllm", "config", "engram.py")),
                                  **version.config_extra)

    def layout(self, checkpoint):
        return self.common.EngramLayout.from_config(hf_config(checkpoint))

    def build_layer(self, checkpoint, layer_index, prefix="model.layers.0.engram"):
        """The Engram layer as vLLM's DeepSeek-V4.1 model builds it: the model module's `Engram(config,
        quant_config, layout, layer_hash_index, use_sequence_parallel, prefix)`, under the CUDA device where
        there is one (vLLM builds its model under the device's context)."""
        import contextlib
        import torch
        layout = self.layout(checkpoint)
        where = torch.device("cuda") if torch.cuda.is_available() else contextlib.nullcontext()
        with where:
            return self.model_module.Engram(hf_config(checkpoint), None, layout, layer_index, False, prefix), layout


def engram_config_fields(path):
    """{field: default} of the EngramConfig class in a stored vllm/config/engram.py (read with ast: the file needs
    pydantic), or the fields every version has when the version has no stored config file."""
    if not os.path.isfile(path):  # the merged layout's vLLM (its file reads use_thp)
        return {"cpu_offload": True, "dp_shared_memory": None, "embedding_across_dp": False, "use_thp": False}
    tree = ast.parse(open(path, encoding="utf-8").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngramConfig")
    fields = {}
    for st in cls.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            default = None
            if isinstance(st.value, ast.Constant):
                default = st.value.value
            elif isinstance(st.value, ast.Call) and st.target.id == "cpu_offload":
                default = True  # Field(default_factory=...): vLLM's environment default, on
            fields[st.target.id] = default
    return fields


def load_version(version, tmp_root=None):
    """A LoadedVersion of `version`: its stored files copied into one tree (under tmp_root, or a new temporary
    directory), the stand-ins installed over it, the modules imported."""
    root, pkg = prepare_version(version, tmp_root)
    return LoadedVersion(version, root, pkg)


def prepare_version(version, tmp_root=None):
    """(root, package name): `version`'s tree with the stand-ins installed over it, nothing of it imported yet."""
    root = tempfile.mkdtemp(prefix=f"vllm-{version.tag[:40]}-", dir=tmp_root)
    pkgs = set()
    for rel, commit in list(version.files.items()) + [PLUGINS_FILE]:
        src = stored(rel, commit)
        if src is None:
            continue
        dst = os.path.join(root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        if rel.startswith("vllm/models/"):
            pkgs.add(rel.split("/")[2])
    (pkg,) = pkgs
    install_stubs(root, (pkg,))
    return root, pkg


def available_versions():
    """[(Version, None when its files are stored, else why not)] for every entry of VERSIONS."""
    return [(v, missing_files(v)) for v in VERSIONS]


def load_engram_module(src, path=None):
    """The merged single-file module imported from `path` (default: src's common/engram.py) against the
    stand-ins."""
    install_stubs(src)
    path = path or os.path.join(src, ENGRAM_FILE)
    spec = importlib.util.spec_from_file_location(ENGRAM_MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ENGRAM_MODULE] = mod
    spec.loader.exec_module(mod)
    sys.modules["vllm.models.deepseek_v41.common"].engram = mod
    return mod


def make_vllm_config(model, *, additional_config=None, engram_fields=None, dp_size=1, dp_rank=0, dp_local=None,
                     elastic_ep=False, max_tokens=256, **engram_values):
    """A VllmConfig-shaped namespace with the fields the Engram module and the plugin read. engram_config has the
    fields of `engram_fields` ({name: default}: a version's EngramConfig, see engram_config_fields; default the
    fields of the merged layout's vLLM) with `engram_values` over them (a name the version lacks is an error)."""
    fields = dict(engram_fields) if engram_fields is not None else {
        "cpu_offload": True, "dp_shared_memory": None, "embedding_across_dp": False, "use_thp": False}
    if fields.get("cpu_offload") is None:
        fields["cpu_offload"] = True
    for k, v in engram_values.items():
        if k not in fields:
            raise TypeError(f"this vLLM's EngramConfig has no field {k} (it has {', '.join(fields)})")
        fields[k] = v
    return SimpleNamespace(
        additional_config=additional_config or {},
        engram_config=SimpleNamespace(**fields),
        parallel_config=SimpleNamespace(data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                                        data_parallel_size_local=dp_local if dp_local is not None else dp_size,
                                        enable_elastic_ep=elastic_ep, tensor_parallel_size=STATE.tp[0],
                                        enable_dbo=False, use_ubatching=False, num_ubatches=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens),
        model_config=SimpleNamespace(model=model, revision=None, enforce_eager=False),
        use_v2_model_runner=True)


def no_dp_shm(vm):
    """The keyword that turns vLLM's dp_shared_memory off, for a version whose EngramConfig has it."""
    return {"dp_shared_memory": False} if "dp_shared_memory" in vm.engram_fields else {}


def hf_config(checkpoint):
    """The checkpoint's config.json as the attribute object vLLM's EngramLayout reads."""
    import json
    with open(os.path.join(checkpoint, "config.json")) as f:
        return SimpleNamespace(**json.load(f))
