"""Value types that key the kernel store: what a compiled kernel is specialized on.

A kernel is specialized on the device and, per tensor input, its dtype and its layout *relative to the
broadcast map* (not on sizes, so one kernel serves every shape):

* ``DENSE``: the input has the map's shape and is contiguous, so element ``i`` of the map is element ``i``
  of the input;
* ``SCALAR``: one element broadcast to the whole map (every stride is 0);
* ``ROWS``: strided, but contiguous along the innermost map dim (a chunk of a wider tensor, a row slice);
* ``REPEAT``: strided with stride 0 along the innermost dim (a column broadcast across it);
* ``STRIDED``: anything else (transposes, steps); strides of every strided class over the compressed map
  dims are kernel arguments.

``ROWS`` and ``REPEAT`` differ from ``STRIDED`` only for the CUDA vector path, which reads a row-contiguous
input with 16-byte loads and a repeated one with one load per vector.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

DENSE, SCALAR, ROWS, REPEAT, STRIDED = "dense", "scalar", "rows", "repeat", "strided"
STRIDED_LAYOUTS = (ROWS, REPEAT, STRIDED)  # layouts whose strides are kernel arguments

# dtype -> (C storage type, C compute type, compute family of fuser.ops)
DTYPES: dict[torch.dtype, tuple[str, str, str]] = {
    torch.float32: ("float", "float", "f"),
    torch.float64: ("double", "double", "d"),
    torch.float16: ("fz_half", "float", "f"),
    torch.bfloat16: ("fz_bf16", "float", "f"),
    torch.int8: ("int8_t", "int8_t", "i"),
    torch.uint8: ("uint8_t", "uint8_t", "i"),
    torch.int16: ("int16_t", "int16_t", "i"),
    torch.int32: ("int32_t", "int32_t", "i"),
    torch.int64: ("int64_t", "int64_t", "i"),
    torch.bool: ("bool", "bool", "i"),
}


def storage_type(dtype: torch.dtype) -> str:
    return DTYPES[dtype][0]


def compute_type(dtype: torch.dtype) -> str:
    return DTYPES[dtype][1]


def family(dtype: torch.dtype) -> str:
    return DTYPES[dtype][2]


@dataclass(frozen=True)
class TensorDesc:
    """One tensor input as a kernel sees it: dtype, layout class, and whether it is 0-dim (which changes
    type promotion: a 0-dim float64 tensor added to a float32 tensor gives float32)."""

    dtype: torch.dtype
    layout: str
    zero_dim: bool = False


@dataclass(frozen=True)
class ArgSpec:
    """The specialization key of a compiled kernel within one kernel spec.

    index32: every offset fits in 32 bits (CUDA uses cheaper index math then; the CPU ignores it).
    outputs: layout class of each kernel output when some are not dense (the slices a fused concat writes);
    empty: all dense.
    """

    device_type: str
    device_index: Optional[int]
    inputs: tuple[TensorDesc, ...]
    index32: bool = True
    outputs: tuple[str, ...] = ()

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.device_index)
