"""The column plan: a group whose reductions reduce the LEADING dims of one full shape F, viewed as [red, cols]
(issue 12's outer reductions: a bias gradient ``(x * y).sum(0)``), or the reason it must fall back.

``fuser.rows.plan.plan`` runs the group on meta tensors and classifies its values (element-level, or row-level:
here one value per column); where the reduced dims are not F's trailing dims it asks :func:`plan` here. The form
this supports: the reduced dims, size-1 dims aside, come before every kept dim of size > 1 (so an element's place
in F is ``r * cols + c``); every reduction is a sum, mean, amax or amin of an element-level value of shape F (no
variance: it needs the column's mean first). Column-level values (:func:`column_level`: the reductions and every
value computed from one) have F's kept dims (with the reduced dims kept as 1, or dropped: one value per column);
they form the epilogue, which may read inputs of that shape too (``(x * y).sum(0) + b``), and the column-level
outputs. A value of shape F never reads a column-level value (that needs a second pass over the column:
``x - x.mean(0)`` falls back). Each input
walks the reduced dims with one stride, and the kept dims in at most :data:`MAX_COL_DIMS` compressed dims.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import executor, ir, ops
from .passes import row_level
from .plan import broadcasts_to, index64 as wide_index

MAX_COL_DIMS = 8  # compressed column dims (the CUDA argument struct's arrays)


@dataclass(frozen=True)
class OuterKey:
    """What a column kernel's source depends on (as ``plan.RowKey``, a class of its own so that a row kernel and a
    column kernel of one group never share a cache entry)."""

    target: str
    device_index: Optional[int]
    inputs: tuple[tuple[torch.dtype, bool], ...]
    cvec: int = 1  # CUDA: consecutive columns a thread takes (a vector of each input where the launch allows)
    steps: tuple = ()  # CUDA with cvec > 1, per tensor input: it steps by 1 along the columns (else by 0)
    # CUDA with cvec > 1: the kernel loads and stores whole vectors only (a launch whose pointers do not allow them
    # goes to the kernel of the same plan with False, element by element, built on the first such launch:
    # outer_launch.build); two kernels of one loop each compile in less time than one kernel with both loops
    vectors: bool = False
    # the block index and the walks over the column dims divide in 64 bits (on CUDA only where columns and rows are
    # 2^31 elements or more: rows.templates.quotient)
    index64: bool = True
    # the columns span several dims after compression, so a column's offsets come from a divmod walk over them; on
    # CUDA False where they span one or none (column * stride)
    walk: bool = True


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
    vec_align: tuple = ()  # CUDA with cvec > 1, per pointer (inputs, outputs): bytes it must be aligned to for
    # whole vectors (0: any)


def column_level(group: ir.Group) -> frozenset:
    """ids of the values a column kernel computes once per column: ``passes.row_level``'s (the reductions, and nodes
    that read only such values) and every node that reads one of them (the plan checks that these have one value a
    column; their other operands are computed once a column too)."""
    got = group._cache.get("column_level")
    if got is None:
        cols = set(row_level(group))
        for n in group.nodes:
            if any(v.id in cols for v in n.values):
                cols.add(n.out.id)
        got = group._cache["column_level"] = frozenset(cols)
    return got


def plan(group: ir.Group, key: tuple, tensors: list, scalars: list, metas: list, shape: dict, dtype: dict,
         full: tuple, dims: list, types: list) -> Union[OuterPlan, str]:
    """The column plan of ``group`` (the row plan's group: composite ops expanded) for inputs of full shape ``full``
    (every tensor input broadcasts to it: the row plan checked)
    whose reductions reduce ``dims``; ``shape``/``dtype``: per value id, eager's; ``metas``: the tensor inputs as meta tensors; ``key``: (target, device index,
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

    cols_v = column_level(group)
    for n in group.nodes:
        s = shape[n.out.id]
        if n.out.id in cols_v:  # (right-aligned, keep and drop shapes index the columns alike)
            if s not in (keep, drop):
                what = "reads a reduced value per element (a second pass over the column)" if broadcasts_to(
                    s, full) and s != drop else f"gives shape {list(s)} (columns {list(drop)})"
                return f"{n.op} {what}"
        elif not broadcasts_to(s, full):
            return f"{n.op} gives shape {list(s)}, not the reduced shape {list(full)}"
        if ops.reduction(n.op) is not None and n.args[0].id in cols_v:
            return f"{n.op} of a column-level value (a reduction of a reduction)"
    for v in group.outputs:
        if v.id not in cols_v and shape[v.id] != full:
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
    strides = [cs + [rs[0] if rs else 0] for cs, rs in zip(col_st, red_st)]
    out_dtypes = [dtype[v.id] for v in group.outputs]
    cvec, vec_align = 1, ()
    if target == "cuda":
        cvec = _column_vector(col_sizes, strides, [t.element_size() for t in tensors]
                              + [torch.empty((), dtype=dt).element_size() for dt in out_dtypes],
                              any(v.id not in cols_v for v in group.outputs))
        if cvec > 1:
            vec_align = tuple(cvec * t.element_size() if st[-2] == 1 else 0 for t, st in zip(tensors, strides)) + tuple(
                cvec * torch.empty((), dtype=dt).element_size() if v.id not in cols_v else 0
                for v, dt in zip(group.outputs, out_dtypes))
    steps = tuple(st[-2] == 1 for st in strides) if cvec > 1 else ()
    red = math.prod(red_shape)
    # (cols + 32) * red bounds every block index (tiles * splits) and column of the kernel
    index64 = wide_index(target, (math.prod(drop) + 32) * max(1, red))
    return OuterPlan(OuterKey(target, index, inputs, cvec, steps, cvec > 1, index64,
                                    target != "cuda" or len(col_sizes) > 1), tensors, scalars, red,
                     math.prod(drop), col_sizes, strides, [shape[v.id] for v in group.outputs], out_dtypes, types, vec_align)


def _column_vector(col_sizes: list, strides: list, sizes: list, stores: bool = False) -> int:
    """Consecutive columns a CUDA thread takes: 4 (2 where a tensor holds 8-byte values: 16 bytes of it; 1 where
    every tensor holds 1-byte values; 8, 16 bytes, where the widest holds 2-byte values and the pass ``stores``
    element-level outputs) where every input steps by 0 or 1 along the innermost column dim, whose size they
    divide (else 4 where 8 do not), and a vector of each input stays aligned to its own size from one row and column
    group to the next (its other strides are multiples of it); else 1. H200, ``(x * y).sum(0)``, fraction of the
    copy floor, the column counts of one launch shape and its split side by side in one process (2026-11-28):
    bfloat16 over [16384, 4096] 0.76 with 1 column a thread, 0.94 with 2, 0.96 with 4, 0.88 with 8 (the loads of 8
    rows in flight: 8 rows of 16 bytes of two inputs a thread); [65536, 1024] 0.74 / 0.96 / 0.94, [4096, 16384]
    0.76 / - / 0.97 with 1 / 2 / 4 (Inductor 0.99-1.01 on these); float32 1.00-1.02 with 1, 2 or 4 on the same
    shapes. A pass that stores takes one row at a time (its stores keep the next row's loads behind them), so its
    accesses are what it has in flight: gelu(x + b)'s bfloat16 backward over [16384, 4096] (x's gradient stored,
    b's summed), 132 us with 4 columns, 121 us with 8 (each output stored as one vector in both; H200, 2026-12-01,
    two processes each). Measured on that kernel alone: 8 columns cost registers (sm_90 ptxas, a pass of 4 bfloat16
    inputs, 2 element-level outputs, 3 sums and an amax: 116 registers with 8, 80 with 4; the split then aims at
    the blocks an SM the kernel's occupancy allows, ``outer_launch``'s ``per_sm``)."""
    widest = max(sizes, default=4)
    wanted = 2 if widest >= 8 else 4 if widest >= 4 or (widest == 2 and not stores) else 8 if widest == 2 else 1
    for cv in (wanted, 4) if wanted == 8 else (wanted,):  # (8 columns, else 4 where 8 do not divide the sizes)
        if cv == 1 or not col_sizes or col_sizes[-1] % cv:
            continue
        if all(st[-2] in (0, 1) and (st[-2] == 0 or all(x % cv == 0 for x in (*st[:-2], st[-1]))) for st in strides):
            return cv  # (per input: its column strides, then its stride along the reduced dims)
    return 1


__all__ = ["MAX_COL_DIMS", "OuterKey", "OuterPlan", "column_level", "plan"]
