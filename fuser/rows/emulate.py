"""Run the CUDA row kernels on the CPU through the host emulation (``fuser.cuda.emulate``), for CI: the same plan
(target "cuda" on CPU tensors), the same source, the same ``FzArgs`` bytes the launcher fills; blocks run one
after another, each thread a fiber, ``__syncthreads`` and ``__shared__`` emulated, under the sanitizers."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import codegen, ir
from ..cuda import emulate
from ..kernel_cache import STORE
from . import launch
from .plan import plan


def kernel_for(group: ir.Group, inputs: Sequence, emulator: Optional[emulate.Emulator] = None) -> Optional[str]:
    """Register the CUDA row kernel of ``group`` for ``inputs`` with the emulator (it compiles with the next
    batch); its name, or None where a GPU would fall back."""
    emulator = emulator or emulate.default()
    spec = STORE.get(STORE.register(group))
    with torch.no_grad():
        p = plan(spec, list(inputs), target="cuda")
    if isinstance(p, str):
        return None
    try:
        name, source = launch.source_for(spec, p)
    except codegen.NotFusable:
        return None
    emulator.add(name, source)
    return name


def run(group: ir.Group, inputs: Sequence, emulator: Optional[emulate.Emulator] = None
        ) -> Optional[list[torch.Tensor]]:
    """The outputs of ``group`` on CPU ``inputs`` through its CUDA row kernel, emulated; None where a GPU would
    fall back (the plan says why: ``fuser.rows.plan``)."""
    emulator = emulator or emulate.default()
    name = kernel_for(group, inputs, emulator)
    if name is None:
        return None
    spec = STORE.get(STORE.register(group))
    with torch.no_grad():
        p = plan(spec, list(inputs), target="cuda")
    outputs = [torch.empty(s, dtype=dt) for s, dt in zip(p.out_shapes, p.out_dtypes)]
    if p.rows == 0:
        return outputs
    struct = launch.args_struct(len(p.tensors), len(p.tensors) + len(outputs), len(p.scalars))
    vec = launch.vector_ok(p.vec_ok, p.vec_align, p.tensors, outputs)
    args = launch.fill_args(struct, p.rows, p.cols, p.lead, p.strides, p.tensors, p.scalars, outputs, vec)
    # an empty tensor (a row of no elements: the kernel never reads or writes it) gets one element of memory,
    # as a GPU allocation would be a valid pointer, where the harness cannot copy nothing from a null pointer
    spans = [(x.data_ptr(), emulate._span(x) * x.element_size(), emulate._span_bytes(x)) if x.numel() else
             (x.data_ptr(), x.element_size(), bytes(x.element_size())) for x in p.tensors]
    spans += [(o.data_ptr(), max(1, o.numel()) * o.element_size(), None) for o in outputs]
    block = p.key.shape.block
    grid = min(emulate.EMU_BLOCKS, -(-p.rows // (block // p.key.shape.tpr)))
    results = emulator.run(name, grid, block, bytes(args), spans)
    for o, data in zip(outputs, results):
        if o.numel():
            o.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(o.dtype).view(o.shape))
    return outputs


__all__ = ["kernel_for", "run"]
