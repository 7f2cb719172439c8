"""``DataType``: nvFuser's dtype enum, its torch dtypes, and nvFuser's type promotion.

nvFuser's promotion differs from eager's in two ways the frontend reproduces (so a script written for nvFuser
gets nvFuser's dtypes): scalars are typed (a ``Double`` scalar times an int tensor is ``Double``; eager's Python
float would give float32), and float16/bfloat16 operands are computed in float32 and the result stays float32
(except ``where``), until the user casts back.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ir import SCALAR_TYPE_CODE  # noqa: F401 (the frontend's lowering and the torch.compile door read it here)


class DataType:
    """One nvFuser data type (``DataType.Float``); ``torch_dtype`` is its torch dtype (None for ``Null``)."""

    __slots__ = ("name", "torch_dtype")

    def __init__(self, name: str, torch_dtype: Optional[torch.dtype]):
        self.name, self.torch_dtype = name, torch_dtype

    def __repr__(self) -> str:
        return f"DataType.{self.name}"

    def __reduce__(self):
        return (getattr, (DataType, self.name))


_TABLE = (("Double", torch.float64), ("Float", torch.float32), ("Half", torch.float16), ("BFloat16", torch.bfloat16),
          ("Int", torch.int64), ("Int32", torch.int32), ("Bool", torch.bool), ("ComplexFloat", torch.complex64),
          ("ComplexDouble", torch.complex128), ("Null", None))
for _name, _dt in _TABLE:
    setattr(DataType, _name, DataType(_name, _dt))
ALL = tuple(getattr(DataType, n) for n, _ in _TABLE)
_BY_TORCH = {d.torch_dtype: d for d in ALL if d.torch_dtype is not None}


def from_torch(dtype: torch.dtype) -> DataType:
    got = _BY_TORCH.get(dtype)
    if got is None:
        raise TypeError(f"{dtype} has no nvFuser DataType (supported: "
                        f"{', '.join(str(d.torch_dtype) for d in ALL if d.torch_dtype is not None)})")
    return got


def of_python(value) -> DataType:
    """The DataType nvFuser gives a Python constant."""
    if isinstance(value, bool):
        return DataType.Bool
    if isinstance(value, int):
        return DataType.Int
    if isinstance(value, float):
        return DataType.Double
    if isinstance(value, complex):
        return DataType.ComplexDouble
    raise TypeError(f"not a scalar constant: {value!r} ({type(value).__name__})")


def as_datatype(dtype, what: str) -> DataType:
    """``dtype`` (a DataType or a torch dtype) as a DataType; a TypeError naming ``what`` otherwise."""
    if isinstance(dtype, DataType):
        return dtype
    if isinstance(dtype, torch.dtype):
        return from_torch(dtype)
    raise TypeError(f"{what}: expected a DataType (e.g. DataType.Float), got {dtype!r}")


def category(dt: DataType) -> int:
    t = dt.torch_dtype
    return 0 if t == torch.bool else 3 if t.is_complex else 2 if t.is_floating_point else 1


REDUCED = (torch.float16, torch.bfloat16)


def promote(tensors: list[DataType], scalars: list[DataType]) -> DataType:
    """nvFuser's common dtype: the tensors' promoted dtype, raised to a scalar's dtype where the scalar is of a
    higher category (complex > float > int > bool)."""
    common = None
    for d in tensors:
        common = d if common is None else from_torch(torch.promote_types(common.torch_dtype, d.torch_dtype))
    best = None  # the scalars' own promotion, used where they outrank the tensors' category
    for d in scalars:
        best = d if best is None else from_torch(torch.promote_types(best.torch_dtype, d.torch_dtype))
    if common is None:
        return best
    if best is not None and category(best) > category(common):
        if category(best) == 3 and category(common) == 2 and common.torch_dtype == torch.float64:
            return DataType.ComplexDouble
        return best
    return common


def compute_dtype(common: DataType, float_op: bool = False, half_to_float: bool = True) -> DataType:
    """The dtype an op computes (and returns) in: float16/bfloat16 in float32; ints and bools in float32 for
    float ops (exp, truediv...)."""
    if half_to_float and common.torch_dtype in REDUCED:
        return DataType.Float
    if float_op and category(common) < 2:
        return DataType.Float
    return common
