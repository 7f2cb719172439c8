"""The column plan: a group whose reductions reduce the LEADING dims of one full shape F, viewed as [red, cols]
(issue 12's outer reductions: a bias gradient ``(x * y).sum(0)``), or the reason it must fall back.

``fuser.rows.plan.plan`` runs the group on meta tensors and classifies its values (element-level, or row-level:
here one value per column); where the reduced dims are not F's trailing dims it asks :func:`plan` here. The form
this supports: the reduced dims, size-1 dims aside, come before every kept dim of size > 1 (so an element's place
in F is ``r * cols + c``); every reduction is a sum, mean, amax or amin of an element-level value of shape F (no
variance: it needs the column's mean first); element-level values are the prologue and never read a column-level
value (that needs a second pass over the column: ``x - x.mean(0)`` falls back); column-level values have F's kept
dims (with the reduced dims kept as 1, or dropped) and feed the epilogue and the column-level outputs. Each input
walks the reduced dims with one stride, and the kept dims in at most :data:`MAX_COL_DIMS` compressed dims.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import executor, ir, ops
from .plan import broadcasts_to

MAX_COL_DIMS = 8  # compressed column dims (the CUDA argument struct's arrays)


@dataclass(frozen=True)
class OuterKey:
    """What a column kernel's source depends on (as ``plan.RowKey``, a class of its own so that a row kernel and a
    column kernel of one group never share a cache entry)."""

    target: str
    device_index: Optional[int]
    inputs: tuple[tuple[torch.dtype, bool], ...]


@dataclass
class OuterPlan:
    key: OuterKey
    tensors: list
    scalars: list
    red: int  # elements each column reduces
    cols: int  # columns: the product of F's kept dims
    col_sizes: list  # the compressed sizes of the kept dims (row-major)
    strides: list  # per tensor input: its strides over ``col_sizes``, then its one stride along the reduced dims
    out_shapes: list  # per group output
    out_dtypes: list
    types: list  # codegen.NodeTypes per node


def plan(group: ir.Group, key: tuple, tensors: list, scalars: list, metas: list, shape: dict, dtype: dict,
         rows_v: frozenset, full: tuple, dims: list, types: list) -> Union[OuterPlan, str]:
    """The column plan of ``group`` (the row plan's group: composite ops expanded) for inputs of full shape ``full``
    (every tensor input broadcasts to it: the row plan checked)
    whose reductions reduce ``dims``; ``shape``/``dtype``: per value id, eager's; ``rows_v``: the column-level
    values (``plan.row_level``); ``metas``: the tensor inputs as meta tensors; ``key``: (target, device index,
    per input (dtype, 0-dim)); ``types``: the nodes' ``codegen.NodeTypes``. Or why not."""
    nd = len(full)
    big = [d for d in range(nd) if full[d] != 1]
    if any(d in dims for d in big[sum(1 for d in big if d in dims):]):
        return f"reduced dims {dims} of a rank-{nd} value are neither its trailing nor its leading dims"
    for n in group.nodes:
        red = ops.reduction(n.op)
        if red is None:
            continue
        if red.variance or red.composite:
            return f"{n.op} over leading dims (a column kernel makes one pass over the column)"
    kept = [d for d in range(nd) if d not in dims]
    keep = tuple(1 if d in dims else full[d] for d in range(nd))
    drop = tuple(full[d] for d in kept)

    for n in group.nodes:
        s = shape[n.out.id]
        col_args = [shape[v.id] for v in n.values if v.id in rows_v]
        if n.out.id in rows_v:
            if s not in (keep, drop) or any(a != s for a in col_args):
                return f"a column-level value of shape {list(s)} (columns {list(drop)})"
        elif col_args:
            return f"{n.op} reads a reduced value per element (a second pass over the column)"
        elif not broadcasts_to(s, full):
            return f"{n.op} gives shape {list(s)}, not the reduced shape {list(full)}"
    for v in group.outputs:
        if v.id not in rows_v and shape[v.id] != full:
            return f"an output of shape {list(shape[v.id])} (the elements are {list(full)})"

    # each input's strides: views of it broadcast to F, over the reduced dims (one stride) and the kept dims
    # (compressed as the pointwise map compresses its dims)
    wide = [m.expand(full).stride() for m in metas]
    base = torch.empty(0, device="meta")
    red_shape = tuple(full[d] for d in dims)
    _, red_st = executor._compress(red_shape, [base.as_strided(red_shape, [w[d] for d in dims]) for w in wide])
    if any(len(st) > 1 for st in red_st):
        return "an input does not walk the reduced dims with one stride"
    col_sizes, col_st = executor._compress(drop, [base.as_strided(drop, [w[d] for d in kept]) for w in wide])
    if len(col_sizes) > MAX_COL_DIMS:
        return f"{len(col_sizes)} column dims after compression (column kernels take {MAX_COL_DIMS})"
    target, index, inputs = key
    return OuterPlan(OuterKey(target, index, inputs), tensors, scalars, math.prod(red_shape), math.prod(drop),
                     col_sizes, [cs + [rs[0] if rs else 0] for cs, rs in zip(col_st, red_st)],
                     [shape[v.id] for v in group.outputs], [dtype[v.id] for v in group.outputs], types)


__all__ = ["MAX_COL_DIMS", "OuterKey", "OuterPlan", "plan"]
