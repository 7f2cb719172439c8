"""The executor: run a registered group on real inputs, or say why it cannot (the caller falls back).

Per call: check the inputs (one device with its fuser on, supported dtypes and layouts, no autograd),
broadcast the shapes, describe each input relative to the map (dense, scalar, strided over the compressed
dims), look up or compile the kernel for that arg spec, allocate the outputs with eager's dtypes and launch.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from . import compiler, settings
from .cuda import templates as cuda_t
from .descs import DENSE, DTYPES, SCALAR, STRIDED, ArgSpec, TensorDesc
from .kernel_cache import KernelSpec

INDEX32_LIMIT = 2 ** 31 - 2 ** 24  # leaves room for a grid-stride step past the last element


@dataclass
class Plan:
    """Everything one launch needs, computed from the inputs."""

    arg_spec: ArgSpec
    tensors: list
    scalars: list
    shape: torch.Size
    numel: int
    sizes: list  # compressed map dims
    strides: list  # per strided input, its strides over ``sizes``


def _compress(shape: Sequence[int], tensors: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Compressed map dims and, per tensor, its strides over them (0 where it is broadcast).

    Size-1 dims go; adjacent dims merge when every tensor (and so the contiguous output) walks them as one.
    """
    ndim = len(shape)
    per = []
    for t in tensors:
        off = ndim - t.dim()
        st = [0] * ndim
        for d, (s, x) in enumerate(zip(t.shape, t.stride())):
            if s != 1:
                st[off + d] = x
        per.append(st)
    dims = [d for d in range(ndim) if shape[d] != 1]
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in tensors]
    for d in dims:
        if sizes and all(st[-1] == p[d] * shape[d] for st, p in zip(strides, per)):
            sizes[-1] *= shape[d]
            for st, p in zip(strides, per):
                st[-1] = p[d]
            continue
        sizes.append(shape[d])
        for st, p in zip(strides, per):
            st.append(p[d])
    return sizes, strides


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return out[::-1]


def plan(spec: KernelSpec, args: Sequence) -> Union[Plan, str]:
    """A :class:`Plan` for running ``spec`` on ``args``, or the reason it must fall back."""
    if len(args) != len(spec.input_is_tensor):
        return f"expected {len(spec.input_is_tensor)} inputs, got {len(args)}"
    tensors, scalars = [], []
    for a, is_t in zip(args, spec.input_is_tensor):
        if is_t:
            if not isinstance(a, torch.Tensor):
                return f"expected a tensor, got {type(a).__name__}"
            tensors.append(a)
        elif isinstance(a, (float, int)) and not isinstance(a, bool):
            scalars.append(float(a))
        else:
            return f"expected a float argument, got {type(a).__name__}"
    if not tensors:
        return "no tensor inputs"
    device = tensors[0].device
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.device != device:
            return f"inputs on several devices ({device}, {t.device})"
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return f"unsupported layout {t.layout}"
        if t.dtype not in DTYPES:
            return f"unsupported dtype {t.dtype}"
        if grad and t.requires_grad:
            return "an input requires grad"
    if device.type == "cpu":
        if not settings.can_fuse_on_cpu():
            return "CPU fusion is off"
    elif device.type == "cuda":
        if not settings.can_fuse_on_gpu():
            return "GPU fusion is off"
    else:
        return f"no fuser for device type {device.type}"

    shapes = [t.shape for t in tensors]
    first = shapes[0]
    if all(s == first for s in shapes):
        shape = first
    else:
        try:
            shape = torch.broadcast_shapes(*shapes)
        except RuntimeError as e:
            return f"shapes do not broadcast: {e}"
        for deps in spec.output_deps:
            if torch.broadcast_shapes(*(shapes[k] for k in deps)) != shape:
                return "an output's shape differs from the group's broadcast shape"
    numel = math.prod(shape)

    if all(t.is_contiguous() and t.shape == shape for t in tensors):
        sizes, layouts, strided = [numel], [DENSE] * len(tensors), []
    else:
        sizes, per = _compress(shape, tensors)
        dense = _contiguous_strides(sizes)
        layouts, strided = [], []
        for st in per:
            if all(x == 0 for x in st):
                layouts.append(SCALAR)
            elif st == dense:
                layouts.append(DENSE)
            else:
                layouts.append(STRIDED)
                strided.append(st)
        if strided and device.type == "cuda" and len(sizes) > cuda_t.MAX_DIMS:
            return f"{len(sizes)} dims after compression (the CUDA kernels take {cuda_t.MAX_DIMS})"
    extent = numel
    for t, layout in zip(tensors, layouts):
        if layout == STRIDED:
            extent = max(extent, 1 + sum((s - 1) * x for s, x in zip(t.shape, t.stride())))
    descs = tuple(TensorDesc(t.dtype, lay, t.dim() == 0) for t, lay in zip(tensors, layouts))
    arg_spec = ArgSpec(device.type, device.index, descs, extent < INDEX32_LIMIT)
    return Plan(arg_spec, tensors, scalars, shape, numel, sizes or [1],
                [st or [0] for st in strided])


def kernel_for(spec: KernelSpec, p: Plan) -> Optional[compiler.CompiledKernel]:
    return spec.kernel_for(p.arg_spec, lambda: compiler.build(spec, p.arg_spec))


def run(spec: KernelSpec, args: Sequence) -> Optional[list[torch.Tensor]]:
    """Outputs of the fused kernel for ``args``, or None when the caller must fall back."""
    p = plan(spec, args)
    if isinstance(p, str):
        return None
    kernel = kernel_for(spec, p)
    if kernel is None:
        return None
    device = p.tensors[0].device
    outputs = [torch.empty(p.shape, dtype=dt, device=device) for dt in kernel.out_dtypes]
    if p.numel == 0:
        return outputs
    if device.type == "cpu":
        _launch_cpu(kernel, p, outputs)
    else:
        kernel.backend.launch(p, outputs)
    return outputs


def _launch_cpu(kernel: compiler.CompiledKernel, p: Plan, outputs: list[torch.Tensor]) -> None:
    rank = len(p.sizes)
    sizes = (ctypes.c_int64 * rank)(*p.sizes)
    flat = [x for st in p.strides for x in st]
    strides = (ctypes.c_int64 * max(1, len(flat)))(*flat)
    ptrs = (ctypes.c_void_p * (len(p.tensors) + len(outputs)))(
        *[t.data_ptr() for t in p.tensors], *[o.data_ptr() for o in outputs])
    scalars = (ctypes.c_double * max(1, len(p.scalars)))(*p.scalars)
    kernel.backend.launch(p.numel, rank, ctypes.addressof(sizes), ctypes.addressof(strides),
                          ctypes.addressof(ptrs), ctypes.addressof(scalars))
