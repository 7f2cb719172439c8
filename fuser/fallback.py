"""The fallback: run a group's subgraph through the TorchScript interpreter, op by op, as eager would.

Used whenever fusion is not possible for the inputs at hand (other devices, dtypes, shapes, autograd), so
results and errors are exactly eager's. ``_jit_interpret_graph`` runs the graph with no optimization
passes, so no other fuser can rewrite the group on the way.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .kernel_cache import KernelSpec


def run_graph(graph: torch._C.Graph, args: Sequence) -> list[torch.Tensor]:
    out = torch._C._jit_interpret_graph(graph, tuple(args))
    return list(out) if isinstance(out, tuple) else [out]


def run(spec: KernelSpec, args: Sequence) -> list[torch.Tensor]:
    """Outputs of the group ``spec`` for ``args`` (in the group's input order), computed op by op."""
    return run_graph(spec.graph, args)
