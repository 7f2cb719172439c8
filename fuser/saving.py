"""Which forward values a CPU backward reads saved instead of recomputing: the cost model.

A group's backward recomputes the forward from its saved inputs (``fuser/backward.py``). On a GPU that is right:
its kernels are bound by memory, and a recompute costs no bytes. On a CPU a transcendental function costs more per
element than the bytes that would save it: one core computes tanh on float32 at about 2.5 ns per element where it
copies (reads and writes) 4 bytes in about 0.24 ns. An LSTM cell's backward recomputed three sigmoids and two tanhs
where eager's reads the saved activations, and was the slower for it.

The rule, for a group on the CPU without random ops or reductions: a transcendental value the backward recomputes
(``Backward.recomputed``) is read instead from the forward, where recomputing it costs more than saving it.
Recomputing costs ``COMPUTE_NS[op]`` per element (the function alone, on floats: the kernels compute a bfloat16
value in float). Saving costs nothing for a whole group output (the forward writes it anyway, as softmax's result
is read today), else an extra output: the forward writes it and the backward reads it, ``2 * itemsize`` bytes at
``NS_PER_BYTE``. What a saved value no longer needs (its inputs, read only to recompute it) is not counted: the
model errs toward recomputing. A value whose inputs broadcast to less than the group's full shape (a function of
a bias) stays recomputed: the kernel writes outputs of the full shape (``autodiff.prepare_call`` checks).

The figures were measured on the 2-core EPYC of the README, one thread, 4M elements (eager's ops at::vec: the
same vectorized functions the CPU kernels call), the function's time less a copy's. Double backward
(``create_graph``) recomputes as before: the extra outputs are not differentiable outputs of the forward.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .kernel_cache import KernelSpec

# per element, ns of one core for the function alone (measured: eager's op less a copy of the same bytes, float32).
# sigmoid: the kernels compute 1 / (1 + exp(-x)), exp's cost and a division (eager's own sigmoid measured 0.2; with
# 0.2 the LSTM cell's float32 backward recomputed its three sigmoids, and its step measured 11.6 ms against 11.15
# ms saving them)
COMPUTE_NS = {"tanh": 2.2, "erf": 1.0, "erfc": 1.5, "cos": 1.0, "sin": 0.9, "expm1": 0.9, "log": 0.7, "log2": 0.7,
              "exp": 0.5, "log1p": 0.5, "sigmoid": 0.6}
NS_PER_BYTE = 0.035  # one core's copy of 4M elements (read and write), float32 and bfloat16 measured 0.03-0.04


def chosen(spec: KernelSpec, recomputed: tuple, dtypes: dict) -> tuple[int, ...]:
    """The values of ``recomputed`` (forward value ids) that the backward should read saved, in group order.
    ``dtypes``: id -> dtype of the forward's values."""
    if spec.random or spec.has_reduction or not recomputed:
        return ()
    outputs = {v.id for v, p in zip(spec.group.outputs, spec.pieces) if p is None}
    wanted = set(recomputed)
    got = []
    for n in spec.group.nodes:
        if n.out.id not in wanted:
            continue
        cost = _compute_ns(n.op)
        if cost is None:
            continue
        dtype: Optional[torch.dtype] = dtypes.get(n.out.id)
        if dtype is None or not dtype.is_floating_point:
            continue
        saving = 0.0 if n.out.id in outputs else 2 * dtype.itemsize * NS_PER_BYTE
        if cost > saving:
            got.append(n.out.id)
    return tuple(got)


def _compute_ns(op: str) -> Optional[float]:
    entry = ops.of(op)
    return None if entry is None else COMPUTE_NS.get(entry.name)
