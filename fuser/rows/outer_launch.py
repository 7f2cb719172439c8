"""Build a column kernel for a plan (``fuser/rows/outer.py``) and launch it: on the CPU (g++ through
``fuser.cpu.compiler``) or on CUDA (NVRTC and the driver through ``fuser.cuda``); ``fuser.rows.emulate`` runs the
CUDA one through the host emulation with the same arguments (:func:`fill_args`, :func:`cuda_grid`).

:class:`OuterGeometry` is what the executor caches per input signature. The native hot path
(``fuser.native.record``) launches them for calls autograd does not record (``hot_path``, ``hot_path_grad``).
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import os
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from .. import compiler, settings
from . import decompose, launch
from . import outer_codegen
from . import outer_templates as t
from .outer import OuterPlan

BLOCKS_PER_SM = 4  # stage 0 blocks the split aims at, per multiprocessor (256 threads each)
MIN_ROWS_PER_LANE = 16  # a split gives each lane of a block at least this many rows
# long columns are split further, until a lane reads about this many rows. H200, (x * y).sum(0) over [16384, 4096],
# fuser alone, two runs, fraction of the copy floor by rows a lane: float32 (4 columns a thread) 0.99 at 120, 0.90
# at 31, 0.85 at 16; bfloat16 (one column a thread, before 2-byte values took 4) 0.62 at 410, 0.72 at 128, 0.61 at 62
LANE_ROWS = 128


@dataclass
class OuterKernel:
    name: str
    source: str
    target: str
    out_dtypes: tuple
    backend: object  # fuser.cpu.compiler.CpuKernel or OuterCudaKernel
    scalar_limits: tuple = ()  # as compiler.CompiledKernel's
    build_ms: float = 0.0


def source_for(spec, p: OuterPlan) -> tuple[str, str]:
    """(name, source) of the column kernel of ``spec`` for plan ``p``; raises codegen.NotFusable."""
    name = "fused_cols_" + hashlib.sha256(f"{spec.text}\n{p.key!r}".encode()).hexdigest()[:16]
    source = outer_codegen.generate(decompose.expand(spec.group), [dt for dt, _ in p.key.inputs], p.types,
                                    p.key.target, name, len(p.scalars), round_reduced=settings.round_reduced,
                                    cvec=p.key.cvec, steps=p.key.steps, vectors=p.key.vectors, index64=p.key.index64,
                                    walk=p.key.walk,
                                    vectorize=p.key.target == "cpu" and compiler._cpu_vectorize())
    if os.environ.get("PYTORCH_FUSION_DEBUG", "0") not in ("", "0"):
        print(f"fuser: column kernel {name} for {p.key}\n{source}", file=sys.stderr)
    return name, source


def build(spec, p: OuterPlan) -> Optional[OuterKernel]:
    """Compile the column kernel for ``p`` on its device; None where it cannot be generated (the caller falls
    back). A kernel of whole vectors only (``OuterKey.vectors``) gets the plan's element by element kernel, built on
    the first launch whose pointers are not aligned for vectors (``launch.AnyLaunch``). The two loops in one kernel
    (a branch on the launch's ``args.vec``, until 2026-12-02) took NVRTC 1.8 s for gelu(x + b)'s bfloat16 backward,
    its vector loop alone 0.6 s (this machine's NVRTC 13.0, sm_90, a median of three)."""
    def load_cuda(source: str, name: str, p: OuterPlan):
        return _load_cuda(source, name, p, n_reductions(spec))

    kernel = launch.build_kernel(spec, p, source_for, load_cuda, OuterKernel)
    if kernel is not None and p.key.vectors:
        kernel.backend.any_launch = launch.AnyLaunch(spec, any_plan(p), build)
    return kernel


def any_plan(p: OuterPlan) -> OuterPlan:
    """The plan of a whole-vector kernel (``OuterKey.vectors``) for its element by element kernel."""
    return dataclasses.replace(p, key=dataclasses.replace(p.key, vectors=False))


class OuterGeometry:
    """What a launch of a column kernel needs that depends only on the inputs' signature (as
    ``fuser.rows.RowGeometry``: ``kernel``, ``requires_grad``, ``device`` for ``executor.run``)."""

    hot_path_grad = False  # calls autograd records go to Python (their backward is formed for a column kernel:
    # autodiff._Call.columns, which the native hot path's backward does not carry)

    def __init__(self, p: OuterPlan, kernel: OuterKernel):
        self.kernel, self.red, self.cols, self.col_sizes, self.strides = kernel, p.red, p.cols, p.col_sizes, p.strides
        # fuser.native.record launches column kernels (on the CPU with the CPU ABI of row kernels: red, then the
        # column dims and the columns; on CUDA both stages and the workspace) where there is a column and a row:
        # the hot path skips a launch of no work, and a sum over no rows must still write its zeros
        self.hot_path = p.red > 0 and p.cols > 0
        self.out_shapes, self.out_dtypes = p.out_shapes, p.out_dtypes
        self.cvec, self.vec_align = p.key.cvec, p.vec_align
        self.device = p.tensors[0].device
        self.requires_grad = any(t.requires_grad for t in p.tensors)
        self.cpu_args = None
        if kernel.target == "cpu":
            rank = len(p.col_sizes)
            flat = [x for st in p.strides for x in st]
            self.cpu_args = ((ctypes.c_int64 * (rank + 1))(*p.col_sizes, p.cols),
                             (ctypes.c_int64 * max(1, len(flat)))(*flat), rank,
                             ctypes.c_void_p * max(1, len(p.tensors) + len(p.out_shapes)),
                             ctypes.c_double * max(1, len(p.scalars)))

    def run(self, tensors, scalars) -> list[torch.Tensor]:
        """Allocate the outputs and launch (the executor checked everything else: with inputs that require grad
        under grad mode it declines; ``autodiff`` runs this under no_grad, then forms the backward for a column
        kernel, ``fuser.backward._Rows``)."""
        outputs = [torch.empty(s, dtype=dt, device=self.device) for s, dt in zip(self.out_shapes, self.out_dtypes)]
        if self.cols == 0:
            return outputs
        if self.cpu_args is not None:
            sizes, strides, rank, ptr_array, scalar_array = self.cpu_args
            ptrs = ptr_array(*[x.data_ptr() for x in tensors], *[o.data_ptr() for o in outputs])
            self.kernel.backend.launch(self.red, rank, ctypes.addressof(sizes), ctypes.addressof(strides), ptrs,
                                       scalar_array(*scalars))
        else:
            self.kernel.backend.launch(self, tensors, scalars, outputs)
        return outputs


# ---- CUDA

def args_struct(n_inputs: int, n_ptrs: int, n_scalars: int):
    """ctypes mirror of the column kernel's ``FzArgs`` (``fuser/rows/outer_templates.py``)."""
    i64, i32 = ctypes.c_int64, ctypes.c_int32

    class FzColArgs(ctypes.Structure):
        _fields_ = [("red", i64), ("cols", i64), ("splits", i64), ("rows_per_split", i64),
                    ("sizes", i64 * t.MAX_DIMS), ("strides", (i64 * (t.MAX_DIMS + 1)) * max(1, n_inputs)),
                    ("rank", i32), ("stage", i32), ("tile", i32), ("vec", i32),
                    ("ptrs", ctypes.c_void_p * n_ptrs), ("scalars", ctypes.c_double * max(1, n_scalars))]

    return FzColArgs


@dataclass(frozen=True)
class CudaGrid:
    """A launch's shape: ``tile`` columns a block, each column in ``splits`` parts of ``rows_per_split`` rows;
    ``grid0`` blocks for stage 0, ``grid1`` for stage 1 (0: no second stage); ``workspace``: doubles."""

    tile: int
    splits: int
    rows_per_split: int
    grid0: int
    grid1: int
    workspace: int


def cuda_grid(red: int, cols: int, n_reductions: int, n_sm: int, max_blocks: int, cvec: int = 1,
              per_sm: int = BLOCKS_PER_SM) -> CudaGrid:
    """The split of a [red, cols] column kernel whose threads take ``cvec`` columns each: as many stage 0 blocks as
    ``n_sm`` multiprocessors hold at once (``per_sm`` each, at most :data:`BLOCKS_PER_SM`) where the columns alone do
    not give them, never more (a second wave of a few blocks doubles those blocks' time: H200, a float32 column
    kernel with an element-level output over [16384, 4096], four blocks an SM, 17 splits of 32 column tiles, 544
    blocks, took 262 us, 16 splits 201 us), or splits of about :data:`LANE_ROWS` rows a lane where that makes more,
    each lane of a split still reading :data:`MIN_ROWS_PER_LANE` rows or more."""
    threads = cols // cvec  # along the columns (cols: a multiple of cvec)
    tile = 32 if threads >= 32 else 1 << max(0, threads - 1).bit_length()
    tiles = max(1, math.ceil(threads / tile))
    lanes = t.BLOCK_SIZE // tile
    aim = max(min(BLOCKS_PER_SM, per_sm) * n_sm // tiles, red // (lanes * LANE_ROWS))
    splits = max(1, min(aim, red // (lanes * MIN_ROWS_PER_LANE)))
    rows_per_split = max(1, math.ceil(red / splits))
    splits = max(1, math.ceil(red / rows_per_split))
    grid0 = max(1, min(tiles * splits, max_blocks))
    if splits == 1:
        return CudaGrid(tile, 1, rows_per_split, grid0, 0, 0)
    grid1 = max(1, min(math.ceil(cols / t.BLOCK_SIZE), max_blocks))
    return CudaGrid(tile, splits, rows_per_split, grid0, grid1, splits * n_reductions * cols)


def fill_args(struct, geo, g: CudaGrid, stage: int, tensors, scalars, outputs, workspace: int, vec: bool = False):
    """An ``FzArgs`` for one launch of a stage (``workspace``: its address, 0 when there is none; ``vec``: every
    pointer suits the kernel's column vectors, :func:`fuser.rows.launch.vector_ok`)."""
    a = struct()
    a.red, a.cols, a.splits, a.rows_per_split = geo.red, geo.cols, g.splits, g.rows_per_split
    a.rank, a.stage, a.tile, a.vec = len(geo.col_sizes), stage, g.tile, int(vec)
    for d, s in enumerate(geo.col_sizes):
        a.sizes[d] = s
    for k, st in enumerate(geo.strides):
        for d, x in enumerate(st[:-1]):
            a.strides[k][d] = x
        a.strides[k][t.MAX_DIMS] = st[-1]
    a.ptrs[:] = [x.data_ptr() for x in (*tensors, *outputs)] + [workspace]
    if scalars:
        a.scalars[:len(scalars)] = scalars
    return a


def n_reductions(spec) -> int:
    from .. import ops
    return sum(1 for n in decompose.expand(spec.group).nodes if ops.reduction(n.op) is not None)


def _load_cuda(source: str, name: str, p: OuterPlan, n_red: int):
    from ..cuda import launch as cuda_launch
    index = p.key.device_index if p.key.device_index is not None else torch.cuda.current_device()
    fmad = cuda_launch.contracts([dt for dt, _ in p.key.inputs], p.out_dtypes)
    image, compiled = cuda_launch.cached_image(source, name, index, fmad)
    n_in, n_out = len(p.key.inputs), len(p.out_dtypes)
    kernel = cuda_launch.CudaKernel(name, image, index, False, 0, n_in + n_out + 1, len(p.scalars), 1,
                                    (0,) * (n_in + n_out + 1))
    return OuterCudaKernel(kernel, args_struct(n_in, n_in + n_out + 1, len(p.scalars)), n_red), compiled


class OuterCudaKernel:
    """A loaded column kernel: the pointwise kernel's loading and launch, with the column kernel's arguments and
    its one or two stages on the current stream (the workspace comes from the caching allocator)."""

    any_launch = None  # a whole-vector kernel's: its element by element kernel (launch.AnyLaunch)

    def __init__(self, kernel, struct, n_red: int):
        from ..cuda import launch as cuda_launch
        if cuda_launch.BLOCK_SIZE != t.BLOCK_SIZE:  # the kernel's shared arrays and its tree assume its block size
            raise RuntimeError(f"column kernels are written for {t.BLOCK_SIZE} threads a block, the launcher "
                               f"launches {cuda_launch.BLOCK_SIZE}")
        self.kernel, self.struct, self.n_red = kernel, struct, n_red
        self.max_blocks = kernel.max_blocks if kernel.max_blocks < 2 ** 31 - 1 else 65535 * 32
        self.n_sm = torch.cuda.get_device_properties(kernel.device_index).multi_processor_count
        self.per_sm = kernel.per_sm
        self._local = threading.local()
        self._grids: dict = {}

    def grid_for(self, geo) -> CudaGrid:
        """The launch shape for ``geo`` (made once per shape; the native hot path records it)."""
        g = self._grids.get((geo.red, geo.cols))
        if g is None:
            g = self._grids[(geo.red, geo.cols)] = cuda_grid(geo.red, geo.cols, self.n_red, self.n_sm,
                                                             self.max_blocks, geo.cvec, self.per_sm)
        return g

    def launch(self, geo, tensors, scalars, outputs) -> None:
        from ..cuda import launch as cuda_launch
        vec = geo.cvec > 1 and launch.vector_ok(True, geo.vec_align, tensors, outputs)
        if not vec and self.any_launch is not None:
            self.any_launch().launch(geo, tensors, scalars, outputs)
            return
        g = self.grid_for(geo)
        index = self.kernel.device_index
        ws = torch.empty(g.workspace, dtype=torch.float64, device=geo.device) if g.workspace else None
        loc = getattr(self._local, "loc", None)
        if loc is None:
            loc = self._local.loc = SimpleNamespace(context_ready=False)
        with torch.cuda.device(index):
            stream = cuda_launch._raw_stream(index)
            for stage, grid in ((0, g.grid0), (1, g.grid1)):
                if not grid:
                    continue
                a = fill_args(self.struct, geo, g, stage, tensors, scalars, outputs, ws.data_ptr() if ws is not None
                              else 0, vec)
                params = (ctypes.c_void_p * 1)(ctypes.addressof(a))
                loc.args, loc.params, loc.params_addr = a, params, ctypes.addressof(params)
                self.kernel._do_launch(loc, grid, stream)
