"""The library-owned memory the package hands out as arrays, and the rule that frees it: views that keep their
owner (a Table for records(), an Engine for its staging) alive while an array made from them lives, and the one
function that frees an owner once it is closed and unused. Also the small conversions the Table and Engine share."""
from ._lib import EngramError


def _s(b):
    return b.decode("utf-8", "replace") if b is not None else ""


def _check_rc(rc, what):
    if rc != 0:
        raise EngramError(rc, what)


def _free_if_unused(owner, users, leaving=None):
    """The one rule that frees what the library owns: `owner` (a Table or an Engine) is freed once it is closed
    and none of `users` (its live engines, or the staging views of an engine) is left but `leaving`, the one going
    now."""
    if owner._closed and not any(u is not leaving for u in list(users)):
        owner._free()


class _View:
    """Keeps its `owner` (an Engine, or a Table for records()) alive while an array made from it lives; the last
    view of a closed owner frees it."""

    def __del__(self):
        o = getattr(self, "_owner", None)
        if o is not None:
            try:
                o._release(leaving=self)
            except Exception:
                pass


class _HostView(_View):
    """Host memory owned by the library (a CPU engine's staging), described through __array_interface__ for
    np.asarray; it keeps `owner` (the Engine) alive for as long as any array made from it lives."""

    def __init__(self, ptr, shape, typestr, owner):
        self._owner = owner
        self.__array_interface__ = {"data": (int(ptr), False), "shape": tuple(shape), "typestr": typestr,
                                    "version": 3}


class _HostRecords(_View):
    """A table's host records (library-owned, read-only) through __array_interface__; keeps the Table, and its
    mapping, alive."""

    def __init__(self, ptr, shape, owner):
        self._owner = owner
        self.__array_interface__ = {"data": (int(ptr), True), "shape": tuple(shape), "typestr": "|u1", "version": 3}


class _DeviceBuffer(_View):
    """A device allocation owned by the library, described through __cuda_array_interface__ (for torch.as_tensor);
    it keeps `owner` (the Engine, when given) alive for as long as a tensor made from it lives."""

    def __init__(self, ptr, shape, typestr, device, owner=None):
        self._owner = owner
        self.__cuda_array_interface__ = {"data": (int(ptr), False), "shape": tuple(shape), "typestr": typestr,
                                         "version": 2, "strides": None}
