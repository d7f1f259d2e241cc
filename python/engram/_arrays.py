"""Array adapters: NumPy arrays, torch tensors and CUDA arrays (`__cuda_array_interface__`: CuPy, Numba; other
DLPack producers through torch.from_dlpack) become a raw pointer after their dtype, shape, strides and device are
checked here, in Python, so that a wrong array is a TypeError/ValueError and never reaches C as a bad pointer.

View: what a checked array is (pointer, shape, strides in elements, dtype name, device). Pure functions.
"""
import sys

_NP_NAMES = {"int32": "int32", "int64": "int64", "uint8": "uint8", "bool": "bool", "uint16": "uint16",
             "float32": "float32", "int16": "int16", "float64": "float64"}
_CAI_TYPES = {"<i4": "int32", "<i8": "int64", "|u1": "uint8", "<u1": "uint8", "|b1": "bool", "<u2": "uint16",
              "<i2": "int16", "<f4": "float32", "<f8": "float64"}
_SIZES = {"int32": 4, "int64": 8, "uint8": 1, "bool": 1, "uint16": 2, "bfloat16": 2, "int16": 2, "float32": 4,
          "float64": 8}


def torch_module():
    """torch when it is already imported or importable, else None (never an import error here)."""
    t = sys.modules.get("torch")
    if t is not None:
        return t
    try:
        import torch  # noqa: F401
        return sys.modules["torch"]
    except Exception:  # absent or broken: the NumPy path still works
        return None


class View:
    __slots__ = ("obj", "ptr", "shape", "strides", "dtype", "device", "kind", "readonly")

    def __init__(self, obj, ptr, shape, strides, dtype, device, kind, readonly=False):
        self.obj, self.ptr, self.shape, self.strides = obj, ptr, tuple(shape), tuple(strides)
        self.dtype, self.device, self.kind, self.readonly = dtype, device, kind, readonly

    def span(self):
        """[first, last) byte addresses the array's elements occupy (strides as they are; an empty array: none)."""
        if 0 in self.shape:
            return (self.ptr, self.ptr)
        size = _SIZES[self.dtype]
        lo = hi = 0
        for d, st in zip(self.shape, self.strides):
            if st >= 0:
                hi += (d - 1) * st
            else:
                lo += (d - 1) * st
        return (self.ptr + lo * size, self.ptr + (hi + 1) * size)

    def contiguous(self):
        expect, s = [], 1
        for d in reversed(self.shape):
            expect.append(s)
            s *= d
        expect = tuple(reversed(expect))
        if 0 in self.shape:  # an empty array holds no element to be out of place (NumPy may give it 0 strides)
            return True
        return all(d == 1 or st == e for d, st, e in zip(self.shape, self.strides, expect))


def _is_torch(x):
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def view(x, name):
    """A View of x, or TypeError for something that is not an array we can pass."""
    if _is_torch(x):
        t = sys.modules["torch"]
        if x.requires_grad and t.is_grad_enabled():
            raise TypeError(f"{name}: a tensor that requires grad (engram's ops are inference-only)")
        dt = str(x.dtype).replace("torch.", "")
        dev = ("cuda", x.device.index if x.device.index is not None else 0) if x.device.type == "cuda" else \
            (x.device.type, None)
        # A CPU tensor over memory torch does not own (from_numpy, frombuffer, DLPack) may be a read-only array or
        # a mapping of someone else's: as an output it is refused (pass a tensor torch allocated, or the array).
        readonly = False
        if x.device.type == "cpu":
            try:
                readonly = not x.untyped_storage().resizable()
            except (AttributeError, RuntimeError):
                readonly = False
        return View(x, x.data_ptr(), x.shape, x.stride(), dt, dev, "torch", readonly)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        dt = _NP_NAMES.get(x.dtype.name)
        if dt is None:
            raise TypeError(f"{name}: NumPy dtype {x.dtype} is not one engram takes")
        if not x.dtype.isnative:
            raise TypeError(f"{name}: byte-swapped NumPy array")
        strides = []
        for s in x.strides:
            if s % x.itemsize:
                raise ValueError(f"{name}: strides {x.strides} are not multiples of the item size")
            strides.append(s // x.itemsize)
        return View(x, x.ctypes.data, x.shape, strides, dt, ("cpu", None), "numpy", not x.flags.writeable)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        dt = _CAI_TYPES.get(cai["typestr"])
        if dt is None:
            raise TypeError(f"{name}: CUDA array type {cai['typestr']} is not one engram takes")
        size = _SIZES[dt]
        shape = tuple(cai["shape"])
        if cai.get("strides") is None:
            strides, s = [], 1
            for d in reversed(shape):
                strides.append(s)
                s *= d
            strides = tuple(reversed(strides))
        else:
            strides = tuple(s // size for s in cai["strides"])
        dev = getattr(getattr(x, "device", None), "id", None)
        return View(x, cai["data"][0], shape, strides, dt, ("cuda", dev), "cai", bool(cai["data"][1]))
    if hasattr(x, "__dlpack__"):
        t = torch_module()
        if t is not None:
            return view(t.from_dlpack(x), name)
    raise TypeError(f"{name}: expected a NumPy array, a torch tensor or a CUDA array, got {type(x).__name__}")


def check(v, name, dtypes, shape, device, contiguous=True, writable=False):
    """dtypes: accepted dtype names; shape: tuple of ints or None (any); device: ('cpu', None) or ('cuda', index);
    writable: an output, which a read-only array (NumPy writeable=False, a read-only memmap) may not be."""
    if writable and v.readonly:
        raise ValueError(f"{name}: a read-only array cannot take the output")
    if v.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {v.dtype}, expected {' or '.join(dtypes)}")
    if len(v.shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, v.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name}: shape {list(v.shape)}, expected {want}")
    if device[0] == "cpu":
        if v.device[0] != "cpu":
            raise ValueError(f"{name}: on {v.device[0]}, but this engine runs on the CPU backend (host arrays only)")
    else:
        if v.device[0] != "cuda":
            raise ValueError(f"{name}: on {v.device[0]}, but this engine runs on CUDA device {device[1]}")
        if v.device[1] is not None and device[1] is not None and v.device[1] != device[1]:
            raise ValueError(f"{name}: on cuda:{v.device[1]}, but this engine runs on cuda:{device[1]}")
    if contiguous and not v.contiguous():
        raise ValueError(f"{name}: strides {list(v.strides)} for shape {list(v.shape)}: a contiguous array is needed")
    if any(st < 0 for st in v.strides):
        raise ValueError(f"{name}: negative strides {list(v.strides)}")
    return v


def no_overlap(out, out_name, inputs):
    """ValueError when the output's bytes overlap any input's (a write over data the call is still reading).
    inputs: (View or None, name) pairs."""
    lo, hi = out.span()
    for v, name in inputs:
        if v is None:
            continue
        a, b = v.span()
        if lo < b and a < hi and lo < hi and a < b:
            raise ValueError(f"{out_name}: overlaps {name}")
