"""The handles a definition hands out: ``Tensor`` (``T3``), ``Scalar`` (``S1``), ``Vector`` (``V2``, a shape), and
the extents that describe a tensor's sizes while it is being defined.

An extent is an ``int`` (a size known at definition time: ``1`` is a broadcast dim) or a :class:`Sym`, the run-time
size of dim ``dim`` of input tensor ``T{tensor}`` (a ``-1`` of ``define_tensor``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .datatype import DataType


@dataclass(frozen=True)
class Sym:
    tensor: int
    dim: int

    def __repr__(self) -> str:
        return f"T{self.tensor}.size({self.dim})"


Extent = Union[int, Sym]


def show_extent(e: Extent) -> int:
    """As nvFuser prints a shape: -1 for a run-time size."""
    return -1 if isinstance(e, Sym) else e


class _Handle:
    __slots__ = ("fd", "index")
    kind = "?"

    def __repr__(self) -> str:
        return f"{self.kind}{self.index}"

    def _ops(self):
        return self.fd.ops

    # operator sugar (nvFuser's): / is fd.ops.div, which truncates integers
    def __add__(self, o): return self._ops().add(self, o)
    def __radd__(self, o): return self._ops().add(o, self)
    def __sub__(self, o): return self._ops().sub(self, o)
    def __rsub__(self, o): return self._ops().sub(o, self)
    def __mul__(self, o): return self._ops().mul(self, o)
    def __rmul__(self, o): return self._ops().mul(o, self)
    def __truediv__(self, o): return self._ops().div(self, o)
    def __rtruediv__(self, o): return self._ops().div(o, self)
    def __pow__(self, o): return self._ops().pow(self, o)
    def __rpow__(self, o): return self._ops().pow(o, self)
    def __mod__(self, o): return self._ops().fmod(self, o)
    def __neg__(self): return self._ops().neg(self)
    def __abs__(self): return self._ops().abs(self)
    def __eq__(self, o): return self._ops().eq(self, o)
    def __ne__(self, o): return self._ops().ne(self, o)
    def __lt__(self, o): return self._ops().lt(self, o)
    def __le__(self, o): return self._ops().le(self, o)
    def __gt__(self, o): return self._ops().gt(self, o)
    def __ge__(self, o): return self._ops().ge(self, o)
    __hash__ = object.__hash__


class Tensor(_Handle):
    """A tensor of a definition: ``ndim``, ``dtype`` and the extents of its dims."""

    __slots__ = ("dtype", "extents")
    kind = "T"

    def __init__(self, fd, index: int, dtype: DataType, extents: tuple):
        self.fd, self.index, self.dtype, self.extents = fd, index, dtype, tuple(extents)

    @property
    def ndim(self) -> int:
        return len(self.extents)

    def shape(self) -> "Vector":
        """This tensor's sizes as a Vector (for ``broadcast_in_dim``'s shape)."""
        return self.fd.ops.shape(self)

    def size(self, dim: int) -> Extent:
        return self.extents[dim]


class Scalar(_Handle):
    """A scalar of a definition: a constant (``value``) or a symbolic input given at execute (``value`` None)."""

    __slots__ = ("dtype", "value")
    kind = "S"

    def __init__(self, fd, index: int, dtype: DataType, value=None):
        self.fd, self.index, self.dtype, self.value = fd, index, dtype, value

    @property
    def symbolic(self) -> bool:
        return self.value is None


class Vector(_Handle):
    """A shape: one extent per entry."""

    __slots__ = ("extents",)
    kind = "V"

    def __init__(self, fd, index: int, extents: tuple):
        self.fd, self.index, self.extents = fd, index, tuple(extents)

    def __len__(self) -> int:
        return len(self.extents)


def describe(h) -> str:
    if isinstance(h, Tensor):
        return f"T{h.index} (rank {h.ndim}, {h.dtype}, shape {[show_extent(e) for e in h.extents]})"
    if isinstance(h, Scalar):
        return f"S{h.index} ({h.dtype})"
    return repr(h)


def ref_of(h) -> Optional[object]:
    from .records import Ref
    return Ref(h.kind, h.index) if isinstance(h, _Handle) else None
