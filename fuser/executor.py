"""The executor: run a registered group on real inputs, or say why it cannot (the caller falls back).

Per call: check the inputs (one device with its fuser on, supported dtypes and layouts, no autograd),
broadcast the shapes, describe each input relative to the map (dense, scalar, strided over the compressed
dims), look up or compile the kernel for that arg spec, allocate the outputs with eager's dtypes and launch.
"""
from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch.autograd import forward_ad as _forward_ad

from . import codegen, compiler, layout, rng, settings, views
from .cpu import pages
from .cuda import templates as cuda_t
from .descs import DENSE, DTYPES, REPEAT, ROWS, SCALAR, STRIDED, STRIDED_LAYOUTS, ArgSpec, TensorDesc
from .kernel_cache import KernelSpec

# 32-bit index math while every offset stays below this: a grid-stride step (at most about the element
# count) added to the last index must not overflow a signed 32-bit int
_functorch_stack = torch._C._functorch.peek_interpreter_stack
_INF = float("inf")

INDEX32_LIMIT = 2 ** 30 - 2 ** 20


@dataclass
class Plan:
    """Everything one launch needs, computed from the inputs."""

    arg_spec: ArgSpec
    tensors: list
    scalars: list
    shape: torch.Size
    numel: int
    sizes: list  # compressed map dims
    strides: list  # per strided input, then per strided kernel output, its strides over ``sizes``
    # per graph output: None, or for a cat's result (its shape, the cat dim, pieces, piece size along it)
    concat: Optional[list] = None
    # per graph output, the sizes and strides eager gives it (a cat's result: the whole result's)
    out_sizes: Optional[list] = None
    out_strides: Optional[list] = None


def _compress(shape: Sequence[int], tensors: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Compressed map dims and, per tensor, its strides over them (0 where it is broadcast).

    Size-1 dims go; adjacent dims merge when every tensor (and so the contiguous output) walks them as one.
    """
    return _merge(shape, [_full_strides(t, len(shape)) for t in tensors])


def _full_strides(t: torch.Tensor, ndim: int) -> list:
    """``t``'s strides over the ``ndim`` dims of the broadcast shape (0 where it is broadcast or a size-1 dim)."""
    off = ndim - t.dim()
    st = [0] * ndim
    for d, (s, x) in enumerate(zip(t.shape, t.stride())):
        if s != 1:
            st[off + d] = x
    return st


def _merge(shape: Sequence[int], per: Sequence[list]) -> tuple[list, list]:
    """:func:`_compress` from each operand's strides over every dim of ``shape`` (in the map's order)."""
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in per]
    for d in range(len(shape)):
        if shape[d] == 1:
            continue
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


def check_inputs(spec: KernelSpec, args: Sequence, target: Optional[str] = None) -> Union[tuple, str]:
    """(tensors, float arguments, device, target) when a kernel may run on ``args`` (one device whose fusion is
    on, or the given target; supported dtypes and layouts; no autograd), else the reason to fall back."""
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
    for t in tensors:
        if t.device != device:
            return f"inputs on several devices ({device}, {t.device})"
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return f"unsupported layout {t.layout}"
        if t.dtype not in DTYPES:
            return f"unsupported dtype {t.dtype}"
        if t.is_neg() or t.is_conj() or t._is_zerotensor():
            return "a lazily negated, conjugated or zero tensor (its memory is not its values)"
    if device.type not in ("cpu", "cuda"):
        return f"no fuser for device type {device.type}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad (autograd needs the interpreter)"
    if target is None:
        target = device.type
        if not settings.fusion_enabled(device.type):
            return f"{device.type} fusion is off"
    return tensors, scalars, device, target


def plan(spec: KernelSpec, args: Sequence, target: Optional[str] = None) -> Union[Plan, str]:
    """A :class:`Plan` for running ``spec`` on ``args``, or the reason it must fall back (for a group with
    reductions, a ``fuser.rows.RowPlan``).

    target: the backend to plan for; None: the tensors' device's, if its fusion is on. The CUDA emulator
    (``fuser.cuda.emulate``) plans "cuda" kernels for CPU tensors.
    """
    if spec.has_reduction:  # a row kernel's plan (fuser/rows/)
        if spec.views is not None:
            return "a permute in a group with a reduction"
        from . import rows
        return rows.plan(spec, args, target)
    checked = check_inputs(spec, args, target)
    if isinstance(checked, str):
        return checked
    tensors, scalars, device, target = checked
    viewed = tensors  # each input as the map reads it: through its permutes (fuser/views.py), if the group has any
    if spec.views is not None:
        if isinstance(spec.views, str):
            return spec.views
        viewed = views.apply(spec.group, spec.views, tensors)
        if isinstance(viewed, str):
            return viewed

    shapes = [t.shape for t in viewed]
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
        for deps in spec.random_deps:  # numbers are drawn per map element: rand_like's input must span it
            if torch.broadcast_shapes(*(shapes[k] for k in deps)) != shape:
                return "rand_like of a value smaller than the group's broadcast shape"
    numel = math.prod(shape)
    concat = _concat_info(spec, shapes, shape) if spec.has_concat else None
    if isinstance(concat, str):
        return concat
    out_sizes, out_strides = _output_layouts(spec, args, tensors, shape, concat)
    if isinstance(out_sizes, str):
        return out_sizes

    out_layouts = []
    if not concat and all(t.is_contiguous() and t.shape == shape for t in viewed) and all(
            st == layout.contiguous_strides(sz) for sz, st in zip(out_sizes, out_strides)):
        sizes, layouts, strided = [numel], [DENSE] * len(tensors), []
    else:
        # per kernel output (a cat's result: one slice per piece), its strides over the map's dims
        kernel_out = [st for st, info in zip(out_strides, concat or [None] * len(out_strides))
                      for _ in range(1 if info is None else info[2])]
        order = map_order(spec, shape, out_strides)
        per = [_full_strides(t, len(shape)) for t in viewed]
        per += [[0 if shape[d] == 1 else st[d] for d in range(len(shape))] for st in kernel_out]
        sizes, per = _merge([shape[d] for d in order], [[p[d] for d in order] for p in per])
        dense = _contiguous_strides(sizes)
        layouts, strided, out_strided = [], [], []
        for st in per[:len(viewed)]:
            if all(x == 0 for x in st):
                layouts.append(SCALAR)
            elif st == dense:
                layouts.append(DENSE)
            else:
                layouts.append(ROWS if st[-1] == 1 else REPEAT if st[-1] == 0 else STRIDED)
                strided.append(st)
        for st in per[len(viewed):]:  # outputs are never broadcast: dense, rows or strided
            out_layouts.append(DENSE if st == dense else ROWS if st[-1] == 1 else STRIDED)
            if out_layouts[-1] != DENSE:
                out_strided.append(st)
        strided += out_strided
        if strided and target == "cuda" and len(sizes) > cuda_t.MAX_DIMS:
            return f"{len(sizes)} dims after compression (the CUDA kernels take {cuda_t.MAX_DIMS})"
    extent = max([numel] + [math.prod(c[0]) for c in concat or () if c is not None])
    for t, lay in zip(viewed, layouts):
        if lay in STRIDED_LAYOUTS:
            extent = max(extent, 1 + sum((s - 1) * x for s, x in zip(t.shape, t.stride())))
    descs = tuple(TensorDesc(t.dtype, lay, t.dim() == 0) for t, lay in zip(viewed, layouts))
    arg_spec = ArgSpec(target, device.index, descs, extent < INDEX32_LIMIT,
                       tuple(out_layouts) if any(lay != DENSE for lay in out_layouts) else ())
    return Plan(arg_spec, tensors, scalars, shape, numel, sizes or [1],
                [st or [0] for st in strided], concat, out_sizes, out_strides)


def _concat_info(spec: KernelSpec, shapes: list, shape) -> Union[list, str]:
    """For a group with cats: per graph output None or (cat shape, dim, pieces, piece size), or the reason to
    fall back. Every piece must have the map's shape: cat never broadcasts its inputs."""
    concat = []
    nd = len(shape)
    for c in spec.concats:
        if c is None:
            concat.append(None)
            continue
        dim, piece_deps = c
        if nd == 0 or not -nd <= dim < nd:
            return "a cat of 0-dim pieces or on a dim out of range (eager raises)"
        for deps in piece_deps:
            if torch.broadcast_shapes(*(shapes[k] for k in deps)) != shape:
                return "cat pieces of different shapes"
        d, m = dim % nd, len(piece_deps)
        full = list(shape)
        full[d] *= m
        concat.append((tuple(full), d, m, shape[d]))
    return concat


def _output_layouts(spec: KernelSpec, args: Sequence, tensors: Sequence[torch.Tensor], shape,
                    concat: Optional[list]) -> tuple:
    """Per graph output, the sizes and the strides eager gives it (``fuser.layout``), or (the reason it is
    not known, None). Contiguous inputs give contiguous outputs without asking (unless a permute inside
    reorders them)."""
    if spec.views is None and all(t.stride() == layout.contiguous_strides(t.shape) for t in tensors):
        sizes = [tuple(shape) if info is None else info[0] for info in concat or [None] * len(spec.output_deps)]
        return sizes, [layout.contiguous_strides(sz) for sz in sizes]
    got = layout.group_layouts(spec.group, args)
    if isinstance(got, str):
        return got, None
    return [sz for sz, _ in got], [st for _, st in got]


def map_order(spec: KernelSpec, shape, out_strides: Sequence[tuple]) -> list:
    """The map's dims, outermost first: the first output's memory order, so that outputs (and inputs of the
    same layout) are dense runs of the map (a channels_last group is one). A group that draws random numbers
    keeps the logical order: the numbers go by map element, and its backward must draw the same ones."""
    nd = len(shape)
    if spec.random or not out_strides or len(out_strides[0]) != nd:
        return list(range(nd))
    first = out_strides[0]
    return sorted(range(nd), key=lambda d: -first[d])


def kernel_for(spec: KernelSpec, p: Plan) -> Optional[compiler.CompiledKernel]:
    """The kernel of plan ``p`` (for a group with reductions, its ``fuser.rows`` row kernel), built once."""
    if spec.has_reduction:
        from . import rows
        return rows.kernel_for(spec, p)
    return spec.kernel_for(p.arg_spec, lambda: compiler.build(spec, p.arg_spec))


class Geometry:
    """What a launch needs that depends only on the inputs' dtypes, shapes and strides: computed once per
    such signature and reused by every later call with the same signature."""

    __slots__ = ("kernel", "shape", "numel", "sizes", "strides", "device", "out_dtypes", "cpu_args", "vec_shape",
                 "requires_grad", "out_like", "grid_vec", "grid_scalar", "concat", "out_sizes", "out_strides",
                 "tile_dim", "n_tiles")

    def __init__(self, p: Plan, kernel: compiler.CompiledKernel):
        self.kernel, self.shape, self.numel = kernel, p.shape, p.numel
        self.sizes, self.strides = p.sizes, p.strides
        # the vector path reads whole vectors inside one row: rows must hold whole vectors, and the row-contiguous
        # inputs' rows start aligned (a repeated input, a column, is read once per vector wherever it starts)
        vec = kernel.vec
        vector_read = [d.layout == ROWS for d in p.arg_spec.inputs if d.layout in STRIDED_LAYOUTS]
        vector_read += [lay == ROWS for lay in p.arg_spec.outputs if lay != DENSE]  # (p.strides: outputs' last)
        self.vec_shape = vec > 1 and (not p.strides or (p.sizes[-1] % vec == 0 and all(
            x % vec == 0 for st, rows in zip(p.strides, vector_read) if rows for x in st[:-1])))
        self.device = p.tensors[0].device
        self.requires_grad = any(t.requires_grad for t in p.tensors)
        self.out_dtypes = kernel.out_dtypes
        # per graph output, eager's sizes and strides (a cat's result: the whole result's): what the
        # outputs are allocated with (torch.empty_strided)
        self.out_sizes, self.out_strides = p.out_sizes, p.out_strides
        # or allocated like an input with those very strides when there is one (empty_like keeps the strides of
        # a non-overlapping and dense tensor): empty_like costs less than half of empty(shape, dtype=, device=)
        like = [next((k for k, t in enumerate(p.tensors) if t.shape == sz and t.dim() > 0 and t.stride() == st
                      and layout.non_overlapping_and_dense(t.shape, st)), None)
                for sz, st in zip(p.out_sizes, p.out_strides)]
        self.out_like = None if None in like or p.concat else [
            (k, None if dt == p.tensors[k].dtype else dt) for k, dt in zip(like, kernel.out_dtypes)]
        self.concat = p.concat
        # the CUDA tiled path: its second map dim (the innermost is the first), or -1; and its tile count
        self.tile_dim = tile_dim(p, kernel)
        sa, sb = p.sizes[-1], p.sizes[self.tile_dim]
        ta, tb = kernel.tile
        self.n_tiles = 0 if self.tile_dim < 0 else p.numel // (sa * sb) * -(-sa // ta) * -(-sb // tb)
        self.cpu_args = None
        self.grid_vec = self.grid_scalar = None  # CUDA launch grids, filled by the launcher on first use
        if self.device.type == "cpu":
            flat = [x for st in p.strides for x in st]
            sizes, strides = (ctypes.c_int64 * len(p.sizes))(*p.sizes), (ctypes.c_int64 * max(1, len(flat)))(*flat)
            n_out = sum(c[2] if c is not None else 1 for c in p.concat) if p.concat else len(kernel.out_dtypes)
            # everything but the pointers and float arguments: the arrays, their addresses, the per-call array types
            self.cpu_args = (sizes, strides, ctypes.addressof(sizes), ctypes.addressof(strides), len(p.sizes),
                             ctypes.c_void_p * (len(p.tensors) + n_out), ctypes.c_double * max(1, len(p.scalars) + (
                                 rng.N_STATE if kernel.random else 0)))


TILE_MIN = 16  # both tiled dims span at least this much: smaller ones would leave most of a tile's threads idle


def tile_dim(p: Plan, kernel) -> int:
    """The CUDA tiled path's second dim for plan ``p``, or -1 (no tiles): where a generically strided input is
    fastest (its smallest nonzero stride) when that is not the map's innermost dim, so that reading it along
    the innermost would scatter; chosen from the first such input."""
    spec = p.arg_spec
    if spec.device_type != "cuda" or kernel.vec > 1 or len(p.sizes) < 2 or not codegen.has_tiled_path(
            spec.inputs, "cuda", spec.outputs) or p.sizes[-1] < TILE_MIN:
        return -1
    rows = iter(p.strides)
    for d in spec.inputs:
        if d.layout not in STRIDED_LAYOUTS:
            continue
        st = next(rows)
        if d.layout == STRIDED:
            fastest = min((abs(x), k) for k, x in enumerate(st) if x)[1] if any(st) else len(st) - 1
            if fastest != len(st) - 1 and p.sizes[fastest] >= TILE_MIN:
                return fastest
    return -1


_NOT_FUSABLE = object()
MAX_SIGNATURES = 256  # per spec; past it, old signatures are dropped (a bounded cache, not a leak)


def signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """The key of a geometry: what a plan depends on. The neg bit and zero tensors change what data_ptr() means:
    part of the signature, planned away. Raises for what is not a strided tensor."""
    return tuple([(t.dtype, t.device, t.shape, t.stride(), t.requires_grad, t.is_neg(), t._is_zerotensor())
                  for t in tensors])


def run(spec: KernelSpec, args: Sequence, rng_state: Optional[list] = None) -> Optional[list[torch.Tensor]]:
    """Outputs of the fused kernel for ``args``, or None when the caller must fall back.

    The hot path: split the arguments, look the input signature (dtypes, devices, shapes, strides,
    requires_grad) up in the spec's geometry cache, check autograd and the device switch, allocate outputs,
    launch. Everything else happens once per signature. A random group draws with ``rng_state``
    (``rng.launch_state``'s four words) when given, so a backward replays its forward's numbers; with a fresh
    state otherwise.
    """
    if spec.all_tensors:
        tensors, scalars = args, ()
    else:
        tensors, scalars = [], []
        for a, is_t in zip(args, spec.input_is_tensor):
            if is_t:
                tensors.append(a)
            elif isinstance(a, (float, int)) and not isinstance(a, bool):
                scalars.append(float(a))
            else:
                return None
    if len(args) != len(spec.input_is_tensor) or not tensors:
        return None
    if _forward_ad._current_level >= 0 or _functorch_stack() is not None:
        return None  # dual tensors and functorch transforms need the ops themselves: the interpreter runs them
    try:
        sig = signature(tensors)
    except (AttributeError, RuntimeError, TypeError):  # not tensors, or layouts without strides
        return None
    geo = spec.geometries.get(sig)
    if geo is None:
        geo = _planned(spec, args, sig)
    if geo is None or geo is _NOT_FUSABLE:
        return None
    if scalars and geo.kernel.scalar_limits:
        for j, lo, hi, nonfinite in geo.kernel.scalar_limits:
            x = scalars[j]
            if not (lo <= x <= hi) and not (nonfinite and (x != x or x in (_INF, -_INF))):
                return None  # eager checks (and raises on) scalars its dtype cannot hold: let it
    if geo.requires_grad and torch.is_grad_enabled():
        return None  # autograd must record the ops: the interpreter runs them
    device = geo.device
    if not settings.enabled.get(device.type) and not settings.fusion_enabled(device.type):
        return None
    if spec.has_reduction:
        return geo.run(tensors, scalars)
    if geo.kernel.random and rng_state is None and not rng.can_draw(device):
        return None
    outputs, kernel_outputs = _allocated(geo, tensors, device)
    if geo.numel == 0:
        return outputs
    if geo.kernel.random:
        scalars = [*scalars, *(rng.launch_state(device) if rng_state is None else rng_state)]
    if geo.cpu_args is not None:
        _launch_cpu(geo, tensors, scalars, kernel_outputs)
    else:
        geo.kernel.backend.launch(geo, tensors, scalars, kernel_outputs)
    return outputs


def _planned(spec: KernelSpec, args: Sequence, sig: tuple):
    """The geometry of ``args`` (signature ``sig``), planned and cached, or ``_NOT_FUSABLE``; None where fusion is
    switched off (a switch, not a property of the inputs: not remembered)."""
    with torch.no_grad():  # the geometry is the same with or without grad; the caller's check decides
        p = plan(spec, args)
    if isinstance(p, str) and p.endswith("fusion is off"):
        return None
    kernel = None if isinstance(p, str) else kernel_for(spec, p)
    if kernel is None:
        geo = _NOT_FUSABLE
    elif spec.has_reduction:  # a row kernel (fuser/rows/)
        from . import rows
        geo = rows.geometry(p, kernel)
    else:
        geo = Geometry(p, kernel)
    if len(spec.geometries) >= MAX_SIGNATURES:
        spec.geometries.clear()
    spec.geometries[sig] = geo
    return geo


def kernel_builder(spec: KernelSpec, args: Sequence) -> Optional[Callable[[], object]]:
    """Plan ``spec`` on arguments like ``args``, and return a function that builds (once, as :func:`run` would) the
    kernel of that plan; None where they would fall back. Nothing is launched, no geometry kept, and the function
    reads no tensor: a front door plans a graph's groups ahead of its first call with stand-ins for the inputs
    (Dynamo's fake tensors: their dtypes, devices, shapes and strides are what a plan reads) and builds on other
    threads; the first call plans again with the real inputs and finds the kernel built, or being built."""
    with torch.no_grad():
        p = plan(spec, args)
    return None if isinstance(p, str) else functools.partial(kernel_for, spec, p)


def kernel_geometry(spec: KernelSpec, tensors: Sequence[torch.Tensor], args: Sequence):
    """The geometry of arguments like ``args`` (tensors ``tensors``) where a kernel (not the fallback) serves the
    group, planned and cached now, the kernel compiled, nothing launched; else None. The native hot path asks this
    when it prepares a backward before any backward ran."""
    try:
        sig = signature(tensors)
    except (AttributeError, RuntimeError, TypeError):
        return None
    geo = spec.geometries.get(sig)
    if geo is None:
        geo = _planned(spec, args, sig)
    return None if geo is None or geo is _NOT_FUSABLE else geo


_HUGE_NUMEL = pages.HUGE_MIN // 8  # (no output of fewer elements passes pages.HUGE_MIN bytes)


def _allocated(geo: Geometry, tensors: Sequence[torch.Tensor], device) -> tuple[list, list]:
    """A pointwise kernel's outputs for ``tensors``, and the tensors it writes (a cat's pieces); large CPU ones with
    huge pages asked for (fuser/cpu/pages.py)."""
    if geo.out_like is not None:
        empty_like = torch.empty_like
        outputs = written = [empty_like(tensors[k]) if dt is None else empty_like(tensors[k], dtype=dt)
                             for k, dt in geo.out_like]
    elif geo.concat is None:
        empty_strided = torch.empty_strided
        outputs = written = [empty_strided(sz, st, dtype=dt, device=device)
                             for sz, st, dt in zip(geo.out_sizes, geo.out_strides, geo.out_dtypes)]
    else:
        outputs, written = concat_outputs(geo, device)
    if geo.numel >= _HUGE_NUMEL:
        pages.advise(outputs)
    return outputs, written


def outputs_like(geo, tensors: Sequence[torch.Tensor]) -> list:
    """Outputs like the ones :func:`run` returns for a pointwise or a row kernel's geometry (allocated, not
    written): the native hot path prepares a backward of several groups with them."""
    if not isinstance(geo, Geometry):  # (fuser.rows.RowGeometry)
        return geo.new_outputs()
    return _allocated(geo, tensors, geo.device)[0]


def concat_outputs(geo: Geometry, device) -> tuple[list, list]:
    """The group's outputs, with eager's strides, and the tensors the kernel writes: a cat's result as one
    slice per piece."""
    outputs, kernel_outputs = [], []
    for info, sz, st, dt in zip(geo.concat or [None] * len(geo.out_dtypes), geo.out_sizes, geo.out_strides,
                                geo.out_dtypes):
        t = torch.empty_strided(sz, st, dtype=dt, device=device)
        if info is None:
            kernel_outputs.append(t)
        else:
            _, d, m, size = info
            kernel_outputs += [t.narrow(d, j * size, size) for j in range(m)]
        outputs.append(t)
    return outputs, kernel_outputs


def _launch_cpu(geo: Geometry, tensors, scalars, outputs: list[torch.Tensor]) -> None:
    _, _, sizes, strides, rank, ptr_array, scalar_array = geo.cpu_args
    ptrs = ptr_array(*[t.data_ptr() for t in tensors], *[o.data_ptr() for o in outputs])
    geo.kernel.backend.launch(geo.numel, rank, sizes, strides, ptrs, scalar_array(*scalars))
