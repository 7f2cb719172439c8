"""Row kernels: fusion groups holding reductions (issue 12).

A group whose reductions all reduce the same trailing dims of one shape runs as one kernel over [rows, cols]: a
pointwise prologue, reductions one after another over the same row (softmax: amax, then the sum of exp(x - max)),
and an epilogue that reads the row-level results broadcast back along the row. ``plan.py`` (the row view of the
inputs, or why not; ``passes.py``: the group's row-level values and the passes along the row, ``shape.py``: how a
CUDA row kernel lays a row over threads) → ``codegen/`` and ``templates.py`` (the kernel text per target) →
``launch.py`` (build and launch). ``fuser.executor`` plans, caches a :class:`RowGeometry` per input signature and
runs it for such groups, with the same checks as for pointwise groups. ``emulate.py`` runs the CUDA row kernels on
the CPU for CI.

Reductions over the leading dims instead ("outer" reductions: a bias gradient ``(x * y).sum(0)``) run as column
kernels: ``outer.py`` (the [red, cols] view, asked by ``plan.plan`` where the reduced dims are not trailing) →
``outer_codegen.py`` and ``outer_templates.py`` → ``outer_launch.py`` (its :class:`OuterGeometry`);
:func:`kernel_for` and :func:`geometry` take either kind of plan.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..cpu import pages
from ..kernel_cache import KernelSpec
from . import launch, outer_launch
from .outer import OuterPlan
from .plan import RowPlan, plan, sum_apart


class RowGeometry:
    """What a launch needs that depends only on the inputs' signature: computed once per signature. Holds what
    ``executor.run`` asks of a geometry (``kernel.scalar_limits``, ``requires_grad``, ``device``)."""

    __slots__ = ("kernel", "rows", "cols", "lead", "strides", "out_shapes", "out_dtypes", "device", "cpu_args",
                 "requires_grad", "vec_ok", "vec_align", "apart", "hot_path")

    def __init__(self, p: RowPlan, kernel: launch.RowKernel):
        self.kernel, self.rows, self.cols, self.lead, self.strides = kernel, p.rows, p.cols, p.lead, p.strides
        self.out_shapes, self.out_dtypes = p.out_shapes, p.out_dtypes
        self.vec_ok, self.vec_align = p.vec_ok, p.vec_align  # CUDA: whole vectors allowed (launch.vector_ok)
        self.device = p.tensors[0].device
        self.requires_grad = any(t.requires_grad for t in p.tensors)
        self.cpu_args = launch.CpuArgs(p) if kernel.target == "cpu" else None
        self.apart = p.apart  # column sums written whole, summed here after the kernel (RowKey.apart)
        self.hot_path = not p.apart  # the native hot path launches the kernel alone: these calls stay in Python

    def new_outputs(self) -> list[torch.Tensor]:
        """The outputs a launch writes, allocated (large CPU ones with huge pages asked for: fuser/cpu/pages.py)."""
        outputs = [torch.empty(s, dtype=dt, device=self.device) for s, dt in zip(self.out_shapes, self.out_dtypes)]
        if self.device.type == "cpu":
            pages.advise(outputs)
        return outputs

    def run(self, tensors, scalars) -> list[torch.Tensor]:
        """Allocate the outputs and launch (the executor checked everything else)."""
        outputs = self.new_outputs()
        if self.rows and self.cpu_args is not None:
            launch.launch_cpu(self.kernel, self.cpu_args, tensors, scalars, outputs)
        elif self.rows:
            self.kernel.backend.launch(self, tensors, scalars, outputs)
        return sum_apart(self.apart, outputs)


def kernel_for(spec: KernelSpec, p: Union[RowPlan, OuterPlan]) -> Optional[launch.RowKernel]:
    if isinstance(p, OuterPlan):  # (its key is of a class of its own: never a row kernel's cache entry)
        return spec.kernel_for(p.key, lambda: outer_launch.build(spec, p))
    return spec.kernel_for(p.key, lambda: launch.build(spec, p))


def geometry(p: Union[RowPlan, OuterPlan], kernel) -> Union[RowGeometry, outer_launch.OuterGeometry]:
    """The executor's cached geometry of a plan and its kernel."""
    if isinstance(p, OuterPlan):
        return outer_launch.OuterGeometry(p, kernel)
    return RowGeometry(p, kernel)


__all__ = ["OuterPlan", "RowGeometry", "RowPlan", "geometry", "kernel_for", "plan"]
