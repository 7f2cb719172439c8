"""Permutes inside a group: each input read through a view, so the kernel stays one element-by-element map.

ConvNeXt's block ends in ``residual + (gamma * x).permute(0, 3, 1, 2)``: the layer scale and the residual add are
one map once the permute is part of the group. A permute moves elements; it computes nothing. So an op under a
permute may be computed in the permute's output order instead, reading each of its operands through the same
permute: ``permute(op(a, b))`` is ``op(a', b')`` where ``a'`` is ``a`` with the missing leading dims added (size
1: broadcast) and then permuted. Those are views: nothing is copied, and the kernel's launch takes the original
tensors' data pointers (a view has its base's), only the strides over the map change.

Every value of the group lives in one *space*: the chain of permutes between it and the group's outputs
(outermost first; the outputs' space is the empty chain). :func:`spaces` finds each input's chain once per group;
the pass gives an input that is read in two spaces two group inputs (``graph_fuser``), and a group in which a
computed value would be needed in two spaces is not formed (the executor falls back if one is registered).

At run time, per input signature (``executor.plan``), :func:`apply` takes the actual ranks: a permute's operand
rank is the broadcast rank of the operands under it, so nothing recorded at trace time is trusted, and a permute
whose dims do not match that rank falls back (eager raises). A 0-dim input stays 0-dim in every space: it
broadcasts from anywhere, and type promotion treats a 0-dim tensor differently from one with dims.

What stays eager's by construction:

* the values: the same ops on the same elements;
* the dtypes: the kernel is generated from :func:`flat`, the group with its permutes taken out, for inputs of the
  same dtypes and the same 0-dim-ness;
* the output strides: ``fuser.layout`` walks the group with its permutes, op by op, on the inputs as given.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import ir, ops

PERMUTE = "aten::permute"

Chain = tuple  # node positions of permutes in the group, outermost first


def has_permute(group: ir.Group) -> bool:
    return any(n.op == PERMUTE for n in group.nodes)


def spaces(group: ir.Group) -> Union[tuple, str]:
    """Per group input, its chain (empty for a float argument, or an input read where the outputs are); or the
    reason the group cannot run as one map: a value needed in two spaces, or an op under a permute that is not
    computed element by element (a reduction, a cat, a random op: their results depend on element order or dims)."""
    where: dict[int, Chain] = {v.id: () for v in group.outputs}
    for pos in range(len(group.nodes) - 1, -1, -1):
        n = group.nodes[pos]
        chain = where.get(n.out.id)
        if chain is None:
            continue  # nothing reads it
        if chain or n.op == PERMUTE:
            op = ops.of(n.op)
            if n.op != PERMUTE and (op is None or op.random or op.concat):
                return f"{n.op} under a permute"
            if ops.reduction(n.op) is not None:
                return f"{n.op} under a permute"
        inner = chain + (pos,) if n.op == PERMUTE else chain
        for i, a in enumerate(n.args):
            if n.op == PERMUTE and i > 0:
                break
            if isinstance(a, ir.TensorConst) and inner and a.shape:
                return "a constant tensor with dims under a permute"
            for v in (a if isinstance(a, tuple) else (a,)):
                if not isinstance(v, ir.Value):
                    continue
                seen = where.setdefault(v.id, inner)
                if seen != inner:
                    return "a value read both through a permute and without it (or through two)"
    return tuple(where.get(v.id, ()) if v.is_tensor else () for v in group.inputs)


def flat(group: ir.Group) -> ir.Group:
    """``group`` with every permute taken out (its result replaced by its operand): the kernel's computation once
    each input is read through its view."""
    alias: dict[int, ir.Value] = {}

    def sub(a):
        if isinstance(a, ir.Value):
            return alias.get(a.id, a)
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        return a

    nodes = []
    for n in group.nodes:
        if n.op == PERMUTE:
            alias[n.out.id] = sub(n.args[0])
            continue
        nodes.append(ir.Node(n.op, tuple(sub(a) for a in n.args), n.out, n.origin))
    outputs = tuple(sub(v) for v in group.outputs)
    return ir.Group(group.inputs, tuple(nodes), outputs)


def _rank_of_node(n: ir.Node, rank: dict) -> int:
    op = ops.of(n.op)
    args = n.args if op is None or op.shape_args is None else [n.args[i] for i in op.shape_args]
    r = 0
    for a in args:
        for x in (a if isinstance(a, tuple) else (a,)):
            if isinstance(x, ir.Value) and x.id in rank:
                r = max(r, rank[x.id])
            elif isinstance(x, ir.TensorConst):
                r = max(r, len(x.shape))
    return r


def permute_dims(dims: Sequence[int], rank: int) -> Optional[tuple]:
    """``dims`` made non-negative, when they are a permutation of ``rank`` dims (else None: eager raises)."""
    if len(dims) != rank:
        return None
    out = tuple(d % rank if -rank <= d < rank else -1 for d in dims) if rank else tuple(dims)
    return out if sorted(out) == list(range(rank)) else None


def apply(group: ir.Group, chains: tuple, tensors: Sequence[torch.Tensor]) -> Union[list, str]:
    """The tensor inputs viewed in the outputs' space (``chains`` from :func:`spaces`), or the reason to fall
    back. Ranks come from ``tensors`` themselves."""
    rank: dict[int, int] = {}
    k = 0
    for v in group.inputs:
        if v.is_tensor:
            rank[v.id] = tensors[k].dim()
            k += 1
    perms: dict[int, tuple] = {}  # permute position -> (operand rank, dims)
    for pos, n in enumerate(group.nodes):
        if n.op == PERMUTE:
            r = rank.get(n.args[0].id, 0)
            dims = permute_dims(n.args[1], r)
            if dims is None:
                return f"permute dims {list(n.args[1])} for a tensor of {r} dims (eager raises)"
            perms[pos] = (r, dims)
            rank[n.out.id] = r
        else:
            rank[n.out.id] = _rank_of_node(n, rank)
    out = []
    k = 0
    for v, chain in zip(group.inputs, chains):
        if not v.is_tensor:
            continue
        t = tensors[k]
        k += 1
        for pos in reversed(chain):  # the innermost permute first
            if t.dim() == 0:
                break  # a 0-dim tensor stays one: it broadcasts from anywhere, and promotes as 0-dim
            r, dims = perms[pos]
            if t.dim() > r:  # (only an operand that gives no shape, type_as's other, can be larger)
                return "an operand of more dims than the permute's under it"
            if t.dim() < r:
                t = t[(None,) * (r - t.dim())]
            t = t.permute(dims)
        out.append(t)
    return out
