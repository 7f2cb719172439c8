"""Build a row kernel for a plan and launch it: on the CPU (g++ through ``fuser.cpu.compiler``), on CUDA (NVRTC and
the driver through ``fuser.cuda``), or through the CUDA host emulation (``fuser.cuda.emulate``, for CI)."""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import codegen, ir, settings
from . import codegen as row_codegen
from . import decompose
from . import templates as t
from .passes import column_sum_form, with_row_inputs
from .plan import RowPlan
from .shape import stage_bytes, sum_sizes


@dataclass
class RowKernel:
    name: str
    source: str
    target: str
    out_dtypes: tuple
    backend: object  # fuser.cpu.compiler.CpuKernel or RowCudaKernel
    # per float argument: (index, lowest, highest, non-finite allowed), as compiler.CompiledKernel's
    scalar_limits: tuple = ()
    build_ms: float = 0.0  # wall time of build(): codegen, compile (or disk-cache load), load


def kernel_name(spec_text: str, key) -> str:
    return "fused_rows_" + hashlib.sha256(f"{spec_text}\n{key!r}".encode()).hexdigest()[:16]


def kernel_group(spec, p) -> ir.Group:
    """The group whose nodes a row or column kernel of ``spec`` computes (``p.types``' nodes): its composite ops'
    steps, less a row plan's column sums (``passes.column_sum_form``), those it sums and those it writes whole."""
    return with_row_inputs(column_sum_form(decompose.expand(spec.group),
                                           tuple(sorted(getattr(p.key, "sums", ()) + getattr(p.key, "apart", ())))),
                           getattr(p.key, "row_inputs", ()))


def source_for(spec, p: RowPlan) -> tuple[str, str]:
    """(name, source) of the row kernel of ``spec`` for plan ``p``; raises codegen.NotFusable."""
    name = kernel_name(spec.text, p.key)
    from .. import compiler
    source = row_codegen.generate(kernel_group(spec, p), [dt for dt, _ in p.key.inputs], p.types, p.key.target,
                                  name, len(p.scalars), vectorize=p.key.target == "cpu" and compiler._cpu_vectorize(),
                                  round_reduced=settings.round_reduced, shape=p.key.shape, sums=p.key.sums,
                                  steps=p.key.steps, index64=p.key.index64, walk=p.key.walk)
    if os.environ.get("PYTORCH_FUSION_DEBUG", "0") not in ("", "0"):
        print(f"fuser: row kernel {name} for {p.key}\n{source}", file=sys.stderr)
    return name, source


def build(spec, p: RowPlan) -> Optional[RowKernel]:
    """Compile the row kernel for ``p`` on its device; None where it cannot be generated (the caller falls back).
    A kernel that takes whole vectors only (``RowKey.steps``) gets the plan's kernel with the run-time choice, built
    on the first launch whose pointers are not aligned for vectors (:class:`AnyLaunch`)."""
    kernel = build_kernel(spec, p, source_for, _load_cuda, RowKernel)
    if kernel is not None and p.key.steps is not None and p.key.target == "cuda":
        kernel.backend.any_launch = AnyLaunch(spec, any_plan(p), build)
    return kernel


def any_plan(p: RowPlan) -> RowPlan:
    """The plan of a vectors-only kernel (``RowKey.steps``) for the kernel with the launch's ``args.vec`` checked
    (which keeps no input in shared memory: ``CudaShape.staged``)."""
    shape = p.key.shape and dataclasses.replace(p.key.shape, staged=())
    return dataclasses.replace(p, key=dataclasses.replace(p.key, steps=None, shape=shape))


def element_sizes(dtypes) -> tuple:
    return tuple(torch.empty((), dtype=dt).element_size() for dt in dtypes)


def plan_stage_bytes(p: RowPlan) -> int:
    """The dynamic shared memory of a launch of ``p``'s CUDA row kernel (``shape.stage_bytes``: staged rows, trip
    sums)."""
    sh = p.key.shape
    return stage_bytes(sh, p.cols, element_sizes(p.key.inputs[k][0] for k in sh.staged),
                       sum_sizes(p.out_dtypes, p.key.sums)) if sh else 0


class AnyLaunch:
    """For the launches of a vectors-only kernel whose pointers are not aligned for vectors, the kernel of plan
    ``p`` (a row plan's :func:`any_plan`, with the launch's ``args.vec`` checked; a column plan's
    ``outer_launch.any_plan``, element by element) by ``build(spec, p)``: built once, on the first such launch,
    through the spec's kernel table like any other (one compile however many threads ask). It keeps the plan
    without the tensors of the call that planned it (the kernel lives as long as its spec: they would too)."""

    def __init__(self, spec, p, build: Callable):
        self.spec, self.plan, self.build = spec, dataclasses.replace(p, tensors=[]), build

    def __call__(self):
        kernel = self.spec.kernel_for(self.plan.key, lambda: self.build(self.spec, self.plan))
        if kernel is None:  # (the same group as the vectors-only kernel: it generates, so this does too)
            raise RuntimeError(f"fuser: no kernel with any strides for {self.plan.key}")
        return kernel.backend


def build_kernel(spec, p, source: Callable, load_cuda: Callable, kernel: type):
    """Compile the kernel of ``spec`` for ``p`` (a row or a column plan: ``fuser.rows.outer_launch`` builds with
    this too) on its device: ``source(spec, p)`` gives (name, source) or raises codegen.NotFusable (then None:
    the caller falls back); on CUDA ``load_cuda(source, name, p)`` loads it as (backend, whether it was
    compiled); ``kernel``: the class of the result (:class:`RowKernel`'s fields)."""
    t0 = time.perf_counter()
    try:
        name, text = source(spec, p)
    except codegen.NotFusable:
        return None
    from .. import compiler
    if p.key.target == "cpu":
        from ..cpu import compiler as cpu_compiler
        backend, compiled = cpu_compiler.compile_kernel(text, name)
    else:
        try:
            backend, compiled = load_cuda(text, name, p)
        except ClustersUnavailable:
            return None
    if compiled:
        compiler._count_compile()
    limits = compiler._scalar_limits(_Steps(kernel_group(spec, p)), p.types)
    return kernel(name, text, p.key.target, tuple(p.out_dtypes), backend, limits, (time.perf_counter() - t0) * 1e3)


@dataclass
class _Steps:
    """What ``compiler._scalar_limits`` reads of a spec: the group whose nodes the plan's types describe."""
    group: object


# ---- CPU

class CpuArgs:
    """The CPU kernel's arrays for one geometry (sizes: the row dims then the row length; strides per input)."""

    def __init__(self, p: RowPlan):
        self.rows, self.rank = p.rows, len(p.lead)
        self.sizes = (ctypes.c_int64 * (self.rank + 1))(*p.lead, p.cols)
        flat = [x for st in p.strides for x in st]
        self.strides = (ctypes.c_int64 * max(1, len(flat)))(*flat)
        self.addresses = ctypes.addressof(self.sizes), ctypes.addressof(self.strides)
        # the per-call array types, made once per geometry (as executor.Geometry does)
        self.ptr_array = ctypes.c_void_p * max(1, len(p.tensors) + len(p.out_shapes))
        self.scalar_array = ctypes.c_double * max(1, len(p.scalars))


def launch_cpu(kernel: RowKernel, args: CpuArgs, tensors, scalars, outputs) -> None:
    ptrs = args.ptr_array(*[t.data_ptr() for t in tensors], *[o.data_ptr() for o in outputs])
    kernel.backend.launch(args.rows, args.rank, *args.addresses, ptrs, args.scalar_array(*scalars))


# ---- CUDA

def args_struct(n_inputs: int, n_ptrs: int, n_scalars: int):
    """ctypes mirror of the row kernel's ``FzArgs`` (``fuser/rows/templates.py``); ``n_ptrs``: the inputs, the
    outputs and a column sum's partial rows."""
    i64 = ctypes.c_int64

    class FzRowArgs(ctypes.Structure):
        _fields_ = [("rows", i64), ("cols", i64), ("sizes", i64 * t.MAX_DIMS),
                    ("strides", (i64 * (t.MAX_DIMS + 1)) * max(1, n_inputs)), ("rank", ctypes.c_int32),
                    ("vec", ctypes.c_int32), ("ptrs", ctypes.c_void_p * n_ptrs),
                    ("scalars", ctypes.c_double * max(1, n_scalars)), ("slots", i64)]

    return FzRowArgs


def vector_ok(vec_ok: bool, vec_align: tuple, tensors, outputs) -> bool:
    """Whether a launch may take whole vectors: the geometry allows them (``RowPlan.vec_ok``) and every pointer
    that is read or written in vectors is aligned for them."""
    return vec_ok and all(not a or x.data_ptr() % a == 0 for a, x in zip(vec_align, (*tensors, *outputs)))


def fill_args(struct, p_rows: int, p_cols: int, lead, strides, tensors, scalars, outputs, vec: bool = False,
              parts: tuple = (), slots: int = 0):
    """An ``FzArgs`` for one launch: the rows, the row dims and each input's strides (the row stride last);
    ``parts``: column sums' partial rows ([``slots``, cols] each, :func:`part_buffers`)."""
    a = struct()
    a.rows, a.cols, a.rank, a.vec, a.slots = p_rows, p_cols, len(lead), int(vec), slots
    for d, s in enumerate(lead):
        a.sizes[d] = s
    for k, st in enumerate(strides):
        for d, x in enumerate(st[:-1]):
            a.strides[k][d] = x
        a.strides[k][t.MAX_DIMS] = st[-1]
    a.ptrs[:] = [x.data_ptr() for x in (*tensors, *outputs, *parts)]
    if scalars:
        a.scalars[:len(scalars)] = scalars
    return a


def part_buffers(p_rows: int, p_cols: int, shape, sums: tuple, sum_dtypes: tuple, max_blocks: int, device
                 ) -> tuple[int, int, list]:
    """A row kernel with column sums (``passes.column_sum_form``): (its grid, its slots, a partial-row buffer
    [slots, cols] per sum in its accumulator's dtype). One wave of blocks at most (``max_blocks``), every slot (a
    block's row) writing its partial row; float64 sums in double, the others in float."""
    if not sums:
        return 0, 0, []
    grid, slots = part_layout(p_rows, shape, max_blocks)
    return grid, slots, part_tensors(slots, p_cols, [part_dtype(dt) for dt in sum_dtypes], device)


def part_tensors(slots: int, p_cols: int, dtypes, device) -> list:
    """The partial-row buffers, [slots, cols] of each dtype."""
    return [torch.empty((slots, p_cols), dtype=dt, device=device) for dt in dtypes]


def part_layout(p_rows: int, shape, max_blocks: int) -> tuple[int, int]:
    """(grid, slots) of a row kernel with column sums: ``max_blocks`` blocks at most, a slot per block's row, or
    per block where the block adds its rows' slots first (``codegen.block_parts``)."""
    rpb = shape.block // shape.tpr
    grid = max(1, min(-(-p_rows // rpb), max_blocks))
    return grid, grid * (1 if row_codegen.block_parts(shape) else rpb)


def part_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a column sum's partial rows: its accumulator's (double for float64 sums, else float)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


PARTS_BLOCK = 256  # threads a block of the column sums' second kernel (templates.CUDA_PARTS_KERNEL): 32 columns


def parts_grid(p_cols: int) -> int:
    return max(1, min(-(-p_cols // 32), 65535))


def _load_cuda(source: str, name: str, p: RowPlan):
    from ..cuda import launch as cuda_launch
    index = p.key.device_index if p.key.device_index is not None else torch.cuda.current_device()
    fmad = cuda_launch.contracts([dt for dt, _ in p.key.inputs], p.out_dtypes)
    image, compiled = cuda_launch.cached_image(source, name, index, fmad)
    n_in, n_out, n_sums = len(p.key.inputs), len(p.out_dtypes), len(p.key.sums)
    kernel = cuda_launch.CudaKernel(name, image, index, False, 0, n_in + n_out, len(p.scalars), 1,
                                    (0,) * (n_in + n_out))
    second = cuda_launch.CudaKernel(name + "_sum", image, index, False, 0, n_in + n_out, len(p.scalars), 1,
                                    (0,) * (n_in + n_out)) if n_sums else None
    return RowCudaKernel(kernel, args_struct(n_in, n_in + n_out + n_sums, len(p.scalars)), p.key.shape,
                         p.key.sums, second, element_sizes(p.key.inputs[k][0] for k in p.key.shape.staged)), compiled


def grid_for(rows: int, shape, max_blocks: int) -> int:
    """The blocks of a row kernel's launch: a block per ``block // tpr`` rows, at most ``max_blocks``; a cluster
    kernel (``CudaShape.cluster``) a cluster of blocks per row, the grid a whole number of clusters."""
    n = shape.cluster
    return n * max(1, min(-(-rows // (shape.block // shape.tpr)), max_blocks // n))


ROW_WAVES = 8  # blocks a launch holds at most, in waves of the device's resident blocks (the kernel grid-strides)


# a cluster kernel's launch: this many times the clusters the device holds at once, each looping over its rows.
# H200, float32 rows of 65536 (softmax, layer_norm(x) * w + b, rms_norm, softmax's training step), 1 against 8, two
# rounds alternating: 174 / 176, 181 / 191, 155 / 161, 389 / 394 us (clusters launched anew cost more than a loop)
CLUSTER_WAVES = 1


def max_active_clusters(kernel, shape) -> int:
    """The clusters of a cluster row kernel (``CudaShape.cluster``) the device runs at once
    (``cuOccupancyMaxActiveClusters``: the CTAs of a cluster share a GPC), or -1 where the driver does not say
    (the grid then counts blocks an SM)."""
    from cuda.bindings import driver
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = shape.cluster, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = shape.block, 1, 1
    config.sharedMemBytes, config.numAttrs = 0, 0
    with torch.cuda.device(kernel.device_index):
        err, n = driver.cuOccupancyMaxActiveClusters(kernel._function, config)
    return int(n) if err == driver.CUresult.CUDA_SUCCESS else -1


class ClustersUnavailable(RuntimeError):
    """The device runs no cluster of a cluster row kernel at once (it would fail to launch): the build falls back."""


class RowCudaKernel:
    """A loaded row kernel: the pointwise kernel's loading (``fuser.cuda.launch.CudaKernel``), with the row
    kernel's arguments, block (``shape.CudaShape.block``) and grid (a block per ``block // tpr`` rows, at most
    :data:`ROW_WAVES` waves of resident blocks; a cluster kernel :data:`CLUSTER_WAVES` waves of the clusters the
    device holds at once)."""

    any_launch = None  # a vectors-only kernel's: the kernel for launches without vectors (AnyLaunch)
    stage_sizes: tuple = ()  # a staged kernel's: its staged inputs' element sizes (CudaShape.staged)

    def __init__(self, kernel, struct, shape, sums: tuple = (), second=None, stage_sizes: tuple = ()):
        from cuda.bindings import driver
        from ..cuda import launch as cuda_launch
        self.kernel, self.struct, self.shape = kernel, struct, shape
        self.sums, self.second = sums, second  # column sums, and the kernel adding their partial rows
        self.block, self.rows_per_block = shape.block, shape.block // shape.tpr
        self.stage_sizes = stage_sizes  # the staged inputs' element sizes (CudaShape.staged)
        self._stage_blocks: dict = {}  # a wave's blocks by a launch's dynamic shared memory (staged rows, trip sums)
        with torch.cuda.device(kernel.device_index):
            if shape.staged or shape.trip_sums:  # up to the device's opt-in limit less the kernel's static arrays
                static = cuda_launch.call(driver.cuFuncGetAttribute,
                                          driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                          kernel._function)
                optin = torch.cuda.get_device_properties(kernel.device_index).shared_memory_per_block_optin
                cuda_launch.call(driver.cuFuncSetAttribute, kernel._function,
                                 driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 optin - static)
            per_sm = cuda_launch.call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, kernel._function,
                                      self.block, 0)
        sms = self.sms = torch.cuda.get_device_properties(kernel.device_index).multi_processor_count
        self.max_blocks = 2 ** 31 - 1 if shape.uncapped else max(1, per_sm) * sms * ROW_WAVES
        if shape.cluster > 1:  # the clusters that fit the device at once (GPCs bound them), in CLUSTER_WAVES
            clusters = max_active_clusters(kernel, shape)
            if clusters == 0:  # none fits: no more cluster plans for this device, and this build falls back
                settings.cuda_no_clusters.add(kernel.device_index)
                raise ClustersUnavailable(f"CUDA device {kernel.device_index} runs no cluster of {shape.cluster} "
                                          f"blocks of {shape.block} threads of row kernel {kernel.name}")
            if clusters > 0:
                self.max_blocks = clusters * shape.cluster * CLUSTER_WAVES
        self.parts_blocks = max(1, per_sm) * sms  # column sums: one wave, a partial row per slot
        self._local = threading.local()

    def smem(self, geo) -> int:
        """The dynamic shared memory of a launch over ``geo``'s rows (a staged kernel's rows, trip sums' slots;
        else 0)."""
        return stage_bytes(self.shape, geo.cols, self.stage_sizes, sum_sizes(geo.out_dtypes, self.sums))

    def _wave(self, smem: int) -> int:
        """The blocks of one wave with ``smem`` bytes of dynamic shared memory a block."""
        top = self._stage_blocks.get(smem)
        if top is None:
            from cuda.bindings import driver
            from ..cuda import launch as cuda_launch
            with torch.cuda.device(self.kernel.device_index):
                # (a thread's first launch may come here first, as a backward's on autograd's thread: the driver's
                # call needs the context current)
                cuda_launch._primary_context(self.kernel.device_index)
                per_sm = cuda_launch.call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, self.kernel._function,
                                          self.block, smem)
            top = self._stage_blocks[smem] = max(1, per_sm) * self.sms
        return top

    def grid(self, geo) -> int:
        if not self.shape.staged:
            return grid_for(geo.rows, self.shape, self.max_blocks)
        # the blocks an SM holds with this launch's shared memory, in ROW_WAVES waves
        return grid_for(geo.rows, self.shape, self._wave(self.smem(geo)) * ROW_WAVES)

    def parts(self, geo) -> tuple[int, int, tuple]:
        """Column sums: (the row kernel's grid, its slots, the partial-row buffers' dtypes; each [slots, cols]), as
        :meth:`launch` allocates them (the native hot path allocates them per call the same way): one wave, with
        the launch's shared memory where it has trip sums."""
        blocks = self._wave(self.smem(geo)) if self.shape.trip_sums else self.parts_blocks
        grid, slots = part_layout(geo.rows, self.shape, blocks)
        return grid, slots, tuple(part_dtype(geo.out_dtypes[m]) for m in self.sums)

    def launch(self, geo, tensors, scalars, outputs) -> None:
        vec = vector_ok(geo.vec_ok, geo.vec_align, tensors, outputs)
        if not vec and self.any_launch is not None:
            self.any_launch().launch(geo, tensors, scalars, outputs)
            return
        if self.sums:
            self._launch_sums(geo, tensors, scalars, outputs, vec)
            return
        a = fill_args(self.struct, geo.rows, geo.cols, geo.lead, geo.strides, tensors, scalars, outputs, vec)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(a))
        loc = getattr(self._local, "loc", None)
        if loc is None:
            loc = self._local.loc = _Loc()
        loc.args, loc.params, loc.params_addr = a, params, ctypes.addressof(params)
        index = self.kernel.device_index
        with torch.cuda.device(index):
            self._do_launch(loc, self.grid(geo), index, self.smem(geo))

    def _launch_sums(self, geo, tensors, scalars, outputs, vec: bool) -> None:
        """The row kernel on one wave of blocks, each slot writing its partial rows, then the second kernel adding
        them (the same stream: the buffers go back to the caching allocator after both)."""
        from ..cuda import launch as cuda_launch
        index = self.kernel.device_index
        smem = self.smem(geo)
        grid, slots, dtypes = self.parts(geo)
        parts = part_tensors(slots, geo.cols, dtypes, geo.device)
        a = fill_args(self.struct, geo.rows, geo.cols, geo.lead, geo.strides, tensors, scalars, outputs, vec,
                      parts, slots)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(a))
        loc = getattr(self._local, "loc", None)
        if loc is None:
            loc = self._local.loc = _Loc()
        with torch.cuda.device(index):
            if not loc.context_ready:
                cuda_launch._primary_context(index)
                loc.context_ready = True
            stream = cuda_launch._raw_stream(index)
            for kernel, g, block, sh in ((self.kernel, grid, self.block, smem),
                                         (self.second, parts_grid(geo.cols), PARTS_BLOCK, 0)):
                err, = kernel._launch(kernel._function, g, 1, 1, block, 1, 1, sh, stream, ctypes.addressof(params), 0)
                if err != kernel._success:
                    from cuda.bindings import driver
                    cuda_launch.check(driver.CUresult(err), "cuLaunchKernel")

    def _do_launch(self, loc, grid: int, index: int, smem: int = 0) -> None:
        from ..cuda import launch as cuda_launch
        k = self.kernel
        if not loc.context_ready:
            cuda_launch._primary_context(index)
            loc.context_ready = True
        stream = cuda_launch._raw_stream(index)
        if k._raw_launch is not None:
            err = k._raw_launch(k._function_ptr, grid, 1, 1, self.block, 1, 1, smem, stream, loc.params_addr, None)
        else:
            err, = k._launch(k._function, grid, 1, 1, self.block, 1, 1, smem, stream, loc.params_addr, 0)
            err = 0 if err == k._success else int(err)
        if err:
            from cuda.bindings import driver
            cuda_launch.check(driver.CUresult(err), "cuLaunchKernel")


class _Loc:
    __slots__ = ("args", "params", "params_addr", "context_ready")

    def __init__(self):
        self.context_ready = False

