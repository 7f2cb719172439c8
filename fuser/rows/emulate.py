"""Run the CUDA row kernels on the CPU through the host emulation (``fuser.cuda.emulate``), for CI: the same plan
(target "cuda" on CPU tensors), the same source, the same ``FzArgs`` bytes the launcher fills; blocks run one
after another, each thread a fiber, ``__syncthreads`` and ``__shared__`` emulated, under the sanitizers."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from .. import codegen, ir
from ..cuda import emulate
from ..kernel_cache import STORE
from . import decompose, launch, outer_launch, outer_templates
from .outer import OuterPlan, column_level
from .plan import RowPlan, plan, sum_apart

N_SM = 132  # the column kernels' split is planned as for an H100's multiprocessors (fuser.rows.outer_launch)


def kernel_for(group: ir.Group, inputs: Sequence, emulator: Optional[emulate.Emulator] = None) -> Optional[str]:
    """Register the CUDA row kernel of ``group`` for ``inputs`` with the emulator (it compiles with the next
    batch); its name, or None where a GPU would fall back."""
    spec = STORE.get(STORE.register(group))
    p = _plan(spec, inputs)
    return None if isinstance(p, str) else _add(emulator or emulate.default(), spec, p)


def _plan(spec, inputs: Sequence):
    with torch.no_grad():
        return plan(spec, list(inputs), target="cuda")


def _add(emulator: emulate.Emulator, spec, p) -> Optional[str]:
    """Register the kernel of plan ``p``; its name, or None where it has no source (a GPU falls back)."""
    try:
        name, source = (outer_launch.source_for if isinstance(p, OuterPlan) else launch.source_for)(spec, p)
    except codegen.NotFusable:
        return None
    # a row kernel with column sums: its source's second kernel adds their partial rows
    emulator.add(name, source, (name + "_sum",) if not isinstance(p, OuterPlan) and p.key.sums else ())
    return name


def run(group: ir.Group, inputs: Sequence, emulator: Optional[emulate.Emulator] = None
        ) -> Optional[list[torch.Tensor]]:
    """The outputs of ``group`` on CPU ``inputs`` through its CUDA row kernel, emulated; None where a GPU would
    fall back (the plan says why: ``fuser.rows.plan``). A vectors-only kernel's launch whose pointers are not
    aligned runs the plan's other kernel, as ``launch.RowCudaKernel`` and ``outer_launch.OuterCudaKernel`` do."""
    emulator = emulator or emulate.default()
    spec = STORE.get(STORE.register(group))
    p = _plan(spec, inputs)
    if isinstance(p, str):
        return None
    outputs = [torch.empty(s, dtype=dt) for s, dt in zip(p.out_shapes, p.out_dtypes)]
    if isinstance(p, OuterPlan):
        if p.key.vectors and not launch.vector_ok(True, p.vec_align, p.tensors, outputs):
            p = outer_launch.any_plan(p)
    else:
        vec = launch.vector_ok(p.vec_ok, p.vec_align, p.tensors, outputs)
        if p.key.steps is not None and not vec:
            p = launch.any_plan(p)
    name = _add(emulator, spec, p)
    if name is None:
        return None
    if isinstance(p, OuterPlan):
        _run_columns(emulator, name, spec, p, outputs)
        return outputs
    if p.rows == 0:
        return sum_apart(p.apart, outputs)
    sums = p.key.sums
    struct = launch.args_struct(len(p.tensors), len(p.tensors) + len(outputs) + len(sums), len(p.scalars))
    block = p.key.shape.block
    grid = launch.grid_for(p.rows, p.key.shape, emulate.EMU_BLOCKS * p.key.shape.cluster)
    # column sums: the launcher's partial rows, one wave (here the emulated blocks) of slots
    _, slots, parts = launch.part_buffers(p.rows, p.cols, p.key.shape, sums, tuple(p.out_dtypes[m] for m in sums),
                                          emulate.EMU_BLOCKS, "cpu")
    args = launch.fill_args(struct, p.rows, p.cols, p.lead, p.strides, p.tensors, p.scalars, outputs, vec, parts,
                            slots)
    spans = _spans(p.tensors, empty=0) + [(o.data_ptr(), max(1, o.numel()) * o.element_size(), None)
                                          for o in (*outputs, *parts)]
    results = emulator.run(name, grid, block, bytes(args), spans, cluster=p.key.shape.cluster,
                           shared=launch.plan_stage_bytes(p))
    _copy_back([*outputs, *parts], results)
    if sums:  # the second kernel: reads the partial rows, writes the sums, leaves the other outputs alone
        spans = _spans(p.tensors, empty=0) + [
            (o.data_ptr(), max(1, o.numel()) * o.element_size(), None) if m in sums else _spans([o], empty=0)[0]
            for m, o in enumerate(outputs)] + _spans(parts)
        results = emulator.run(name + "_sum", min(emulate.EMU_BLOCKS, launch.parts_grid(p.cols)), launch.PARTS_BLOCK,
                               bytes(args), spans)
        _copy_back([outputs[m] for m in sums], results)
    return sum_apart(p.apart, outputs)


def _copy_back(tensors: list, results: list) -> None:
    for o, data in zip(tensors, results):
        if o.numel():
            o.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(o.dtype).view(o.shape))


def _spans(tensors, empty: int = 1) -> list:
    """(address, bytes, bytes to send) of input tensors. An empty one gets ``empty`` elements of memory: none for a
    row kernel (on CUDA an empty tensor's pointer is null: a kernel must not read it, and the harness's buffer of
    no bytes makes any read an ASan error), one for a column kernel's stage (a valid pointer it never reads)."""
    return [(x.data_ptr(), emulate._span(x) * x.element_size(), emulate._span_bytes(x)) if x.numel() else
            (x.data_ptr(), empty * x.element_size(), bytes(empty * x.element_size())) for x in tensors]


def _run_columns(emulator: emulate.Emulator, name: str, spec, p: OuterPlan, outputs: list) -> None:
    """A column kernel's launches as ``outer_launch.OuterCudaKernel`` makes them (stage 0, then stage 1 where the
    columns are split): the same grid decision, arguments and workspace. Stage 1 gets the element-level outputs
    and the workspace as inputs, so the harness checks it leaves them alone."""
    if p.cols == 0:
        return
    geo = SimpleNamespace(red=p.red, cols=p.cols, col_sizes=p.col_sizes, strides=p.strides)
    g = outer_launch.cuda_grid(p.red, p.cols, outer_launch.n_reductions(spec), N_SM, emulate.EMU_BLOCKS, p.key.cvec)
    vec = p.key.cvec > 1 and launch.vector_ok(True, p.vec_align, p.tensors, outputs)
    ws = torch.empty(max(1, g.workspace), dtype=torch.float64)
    struct = outer_launch.args_struct(len(p.tensors), len(p.tensors) + len(outputs) + 1, len(p.scalars))
    steps = decompose.expand(spec.group)
    col_level = [o.id in column_level(steps) for o in steps.outputs]
    for stage, grid in ((0, g.grid0), (1, g.grid1)):
        if not grid:
            continue
        args = outer_launch.fill_args(struct, geo, g, stage, p.tensors, p.scalars, outputs, ws.data_ptr(), vec)
        if stage == 0:
            spans = _spans(p.tensors) + [(o.data_ptr(), max(1, o.numel()) * o.element_size(), None)
                                         for o in (*outputs, ws)]
            written = [*outputs, ws]
        else:
            spans = _spans(p.tensors) + [(o.data_ptr(), max(1, o.numel()) * o.element_size(), None) if col else
                                         _spans([o])[0] for o, col in zip(outputs, col_level)] + _spans([ws])
            written = [o for o, col in zip(outputs, col_level) if col]
        results = emulator.run(name, grid, outer_templates.BLOCK_SIZE, bytes(args), spans)
        for o, data in zip(written, results):
            if o.numel():
                o.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8)[:o.numel() * o.element_size()]
                        .view(o.dtype).view(o.shape))


__all__ = ["kernel_for", "run"]
