"""Where the running vLLM keeps DeepSeek-V4.1's Engram layer, and whether its surface is the one the plugin knows.

vLLM's Engram code has lived in several shapes; the plugin patches every one the running vLLM has:
  nvidia   `<pkg>.nvidia.engram`: the NVIDIA `Engram(BaseEngram)` that the model builds on NVIDIA GPUs. It overrides
           `_create_embedding` and builds the NVIDIA `ParallelEngramEmbedding` (cpu_offload, dp_shared_memory, the
           prefetch stream). Served.
  merged   `<pkg>.common.engram` whose `ParallelEngramEmbedding` itself takes cpu_offload and dp_shared_memory (one
           file holding what the split layout puts in nvidia/). Served.
  common   `<pkg>.common.engram` of the split layout: the platform-neutral base, whose table lives in GPU memory
           (no cpu_offload). Not served (engramd shares host tables); patched so that a configured engine says so.
<pkg> is `vllm.models.deepseek_v41`, or `vllm.models.deepseek_v4_1` in vLLMs before the package's rename. The AMD
model (`<pkg>.amd`) builds no Engram table of these classes (docs/api.md says what it does instead).

`find()` imports the candidate modules and returns a Surface per module found; `Surface.problems` lists, in
sentences, what differs from what the plugin relies on (empty: the plugin can patch and serve it). Thread-safe
(reads only).
"""
import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import threading

PACKAGES = ("vllm.models.deepseek_v41", "vllm.models.deepseek_v4_1")
# The modules looked for, the NVIDIA one first: it is the class the model builds where it exists.
CANDIDATES = tuple(f"{pkg}.{part}.engram" for pkg in PACKAGES for part in ("nvidia", "common"))

EMBEDDING_PARAMS = ("num_embeddings", "dim", "head_sizes", "block_size", "cpu_offload", "dp_shared_memory")
BASE_EMBEDDING_PARAMS = ("num_embeddings", "dim", "head_sizes", "block_size")
LOOKUP_FORMS = (["self", "indices", "out", "background"],
                ["self", "indices", "out", "background", "packed"])
# Functions the plugin calls, and the vLLM module each comes from when the Engram module does not import it itself.
MODULE_FUNCTIONS = {"get_current_vllm_config": "vllm.config", "get_tensor_model_parallel_rank": "vllm.distributed",
                    "get_tensor_model_parallel_world_size": "vllm.distributed",
                    "get_engram_dp_size": "vllm.distributed"}


def params(fn):
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _required_extra(fn, known):
    """Parameters of `fn` beyond `known` that have no default (the plugin could not call it)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ["(no signature)"]
    return [n for n, p in sig.parameters.items()
            if n != "self" and n not in known and p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


class Surface:
    """One vLLM Engram module: its layout kind, the classes to patch and build on, and what differs."""

    def __init__(self, module):
        self.module = module
        self.name = module.__name__
        self.package = self.name.rsplit(".", 2)[0]
        self.engram = getattr(module, "Engram", None)
        self.embedding = getattr(module, "ParallelEngramEmbedding", None)
        self.kind = self._kind()
        self.problems = self._problems()

    def _kind(self):
        if self.name.endswith(".nvidia.engram"):
            return "nvidia"
        init = params(getattr(self.embedding, "__init__", None)) or []
        return "merged" if "cpu_offload" in init else "common"

    @property
    def served(self):
        """Whether a table of this layout can come from engramd (a host table vLLM reads through UVA)."""
        return self.kind in ("nvidia", "merged")

    def _problems(self):
        p = []
        if self.engram is None:
            p.append("no class Engram")
        elif "_create_embedding" not in self.engram.__dict__:
            p.append("Engram defines no _create_embedding of its own")
        elif params(self.engram.__dict__["_create_embedding"]) != ["self", "layout", "layer_hash_index"]:
            p.append("Engram._create_embedding is not (self, layout, layer_hash_index)")
        if self.embedding is None:
            p.append("no class ParallelEngramEmbedding")
            return p
        want = EMBEDDING_PARAMS if self.served else BASE_EMBEDDING_PARAMS
        init = params(self.embedding.__init__) or []
        if init[1:1 + len(want)] != list(want):
            p.append(f"ParallelEngramEmbedding.__init__ does not begin ({', '.join(want)})")
        else:
            extra = _required_extra(self.embedding.__init__, want)
            if extra:
                p.append(f"ParallelEngramEmbedding.__init__ requires {', '.join(extra)}")
        if not self.served:
            return p
        for name, forms in (("_allocate_weights", (["self"],)), ("_storage", (["self"],)), ("lookup", LOOKUP_FORMS)):
            got = params(getattr(self.embedding, name, None))
            if got not in forms:
                p.append(f"ParallelEngramEmbedding.{name} is not ({', '.join(forms[0][1:])})")
        if not hasattr(self.embedding, "_weight_loader"):
            p.append("ParallelEngramEmbedding has no _weight_loader")
        for name, home in MODULE_FUNCTIONS.items():
            if self.fn(name) is None:
                p.append(f"no function {name} (in the module or {home})")
        return p

    def fn(self, name):
        """vLLM's function `name` (one of MODULE_FUNCTIONS): the Engram module's own import of it, else the vLLM
        module it comes from; None where neither has it."""
        fn = getattr(self.module, name, None)
        if callable(fn):
            return fn
        try:
            fn = getattr(importlib.import_module(MODULE_FUNCTIONS[name]), name, None)
        except ImportError:
            return None
        return fn if callable(fn) else None

    def describe(self):
        return f"{self.kind}:{self.name}"


def check_surface(module):
    """What `module` (a vLLM Engram module) lacks of the surface the plugin relies on: sentences, empty when none."""
    return Surface(module).problems


def find(log):
    """A Surface for each candidate module the running vLLM can import; `log(module, error)` is told of one that
    exists but fails to import."""
    found = []
    for name in CANDIDATES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # the module (or its package) is not in this vLLM
                continue
            log(name, e)
            continue
        except Exception as e:  # the module is there but does not import here (another platform's dependencies)
            log(name, e)
            continue
        found.append(Surface(module))
    return found


class _Watch(importlib.abc.MetaPathFinder):
    """An import hook: after a CANDIDATES module executes, `callback(module)` runs (the plugin patches it)."""

    def __init__(self, callback):
        self.callback = callback
        self._local = threading.local()

    def find_spec(self, name, path=None, target=None):
        if name not in CANDIDATES or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = importlib.util.find_spec(name)  # how the import would go without this hook
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Then(spec.loader, self.callback)
        return spec


class _Then(importlib.abc.Loader):
    def __init__(self, loader, callback):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.callback(module)


_watch = {"hook": None}


def watch_imports(callback):
    """Runs `callback(module)` whenever a CANDIDATES module is imported from now on (None: stops)."""
    old = _watch["hook"]
    if old is not None and old in sys.meta_path:
        sys.meta_path.remove(old)
    _watch["hook"] = None
    if callback is not None:
        _watch["hook"] = _Watch(callback)
        sys.meta_path.insert(0, _watch["hook"])
