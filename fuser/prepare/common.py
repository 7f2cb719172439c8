"""What the rewrites share: walking a graph's blocks, reading constants, creating nodes."""
from __future__ import annotations

from typing import Iterable

import torch

from ..ts_ir import ORIGIN

_TENSOR = torch._C.TensorType.get()


def all_nodes(block: torch._C.Block) -> Iterable[torch._C.Node]:
    for n in list(block.nodes()):
        yield n
        for b in n.blocks():
            yield from all_nodes(b)


def constant(v: torch._C.Value):
    """(True, value) for a constant, (False, None) otherwise."""
    if v.node().kind() != "prim::Constant":
        return False, None
    return True, v.toIValue()


def create(graph: torch._C.Graph, kind: str, inputs: list, before: torch._C.Node,
            n_out: int = 1, origin: str = "") -> torch._C.Node:
    """``kind(inputs)`` inserted before ``before``, which it replaces (in part); Python numbers and None become
    constants. ``origin``: the eager op this node is one step of (``ts_ir.ORIGIN``; the group IR's
    ``Node.origin``)."""
    vals = []
    for a in inputs:
        if isinstance(a, torch._C.Value):
            vals.append(a)
        else:
            c = graph.insertConstant(a)
            c.node().moveBefore(before)
            vals.append(c)
    node = graph.create(kind, vals, n_out)
    node.insertBefore(before)
    node.copyMetadata(before)  # the replaced node's source range and scope: errors point at the model's line
    if origin:
        node.s_(ORIGIN, origin)
    for o in node.outputs():
        o.setType(_TENSOR)
    return node
