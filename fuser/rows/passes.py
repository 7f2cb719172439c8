"""The analysis of a row group's values and of the passes a row kernel makes along the row.

Every value of the group is element-level (one per (row, col): the tensor inputs, and nodes that read one) or
row-level (one per row: a reduction's result, and nodes that read only row-level values): :func:`row_level`, which
also counts the tensor inputs :func:`with_row_inputs` makes row-level (:func:`row_inputs`: a normalization's
statistics saved by its forward). A row kernel runs the group in passes along the row (:func:`reduction_passes`,
:func:`row_passes`); per pass, the values it computes (:func:`needed`), those it finds in registers (a CUDA row held:
:func:`held_values`) or in scratch rows (the CPU's: :func:`kept_values`), and the row values it holds per element
(:func:`pass_width`, which the CUDA shape takes: ``shape.py``). A row kernel with column sums runs the group's
:func:`column_sum_form` (:func:`column_sum_candidates`: the sums that may be column sums; the plan decides by the
values' shapes which are).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from .. import ir, ops


def row_level(group: ir.Group) -> frozenset:
    """ids of the row-level values (see the module's doc); every other value is element-level. A group made by
    :func:`with_row_inputs` counts those inputs among them."""
    got = group._cache.get("row_level")
    if got is None:
        rows: set = set(group._cache.get("row_inputs", ()))
        floats = {v.id for v in group.inputs if not v.is_tensor}  # the same for every row and element
        for n in group.nodes:
            ids = {v.id for v in n.values} - floats
            red = ops.reduction(n.op)
            if (red is not None and red.kind not in ops.NORMALIZATIONS) or (red is None and ids and ids <= rows):
                rows.add(n.out.id)
        got = group._cache["row_level"] = frozenset(rows)
    return got


def with_row_inputs(group: ir.Group, positions: tuple[int, ...]) -> ir.Group:
    """``group`` (a copy) whose tensor inputs at ``positions`` are row-level values: one value a row, as a
    [rows..., 1...] input gives them (a normalization's statistics saved by its forward, ``RowKey.row_inputs``). The
    kernel loads each once a row and computes what depends only on them and the reductions once a row too, where
    an element-level input of that shape was loaded, and what it reads computed, at every element."""
    if not positions:
        return group
    copy = ir.Group(group.inputs, group.nodes, group.outputs)
    copy._cache["row_inputs"] = frozenset(group.inputs[j].id for j in positions)
    return copy


def row_inputs(group: ir.Group, shape: dict, full: tuple, k: int) -> tuple[int, ...]:
    """The positions of ``group``'s tensor inputs that hold one value a row (of shape [rows..., 1...], the row's
    dims all 1, where the row is longer than 1), where no reduction then reads a row-level value."""
    keep = tuple(full[:len(full) - k]) + (1,) * k
    if keep == tuple(full):
        return ()
    got = tuple(j for j, v in enumerate(group.inputs) if v.is_tensor and shape[v.id] == keep)
    if not got:
        return ()
    rows = row_level(with_row_inputs(group, got))
    return () if any(ops.reduction(n.op) is not None and n.args[0].id in rows for n in group.nodes) else got


SUM = "aten::sum.dim_IntList"


def column_sum_candidates(group: ir.Group) -> frozenset:
    """ids of the nodes that may be column sums (:func:`column_sum_form`): a sum that is an output, read by no
    node, of a value a node computes, with no dtype argument. The plan decides by the shapes which are."""
    got = group._cache.get("column_sum_candidates")
    if got is None:
        read = {v.id for n in group.nodes for v in n.values}
        outs = {v.id for v in group.outputs}
        computed = {n.out.id for n in group.nodes}
        got = group._cache["column_sum_candidates"] = frozenset(
            n.out.id for n in group.nodes if n.op == SUM and n.out.id in outs and n.out.id not in read
            and isinstance(n.args[0], ir.Value) and n.args[0].id in computed and n.args[1] and n.args[3] is None)
    return got


def column_sum_form(group: ir.Group, sums: tuple[int, ...]) -> ir.Group:
    """The group a row kernel with column sums runs: ``group`` without the sum nodes that make its outputs ``sums``
    (positions), each of those outputs replaced by the value it sums. The kernel computes that value element by
    element in its output pass, as any element-level output, and adds it into a partial row (a sum over the rows
    of each column: a weight's or a bias's gradient in a norm's backward) instead of storing it; a second stage
    adds the partial rows. So the backward reads x and dy once, where a column kernel would read them again.
    Cached on the group."""
    if not sums:
        return group
    cache = group._cache.setdefault("column_sum_form", {})
    got = cache.get(sums)
    if got is None:
        drop = {group.outputs[m].id for m in sums}
        summed = {n.out.id: n.args[0] for n in group.nodes if n.out.id in drop}
        got = cache[sums] = ir.Group(group.inputs, tuple(n for n in group.nodes if n.out.id not in drop),
                                     tuple(summed.get(v.id, v) for v in group.outputs))
    return got


TYPE_AS = "aten::type_as"


def needed(group: ir.Group, wanted: Sequence[ir.Value], held: frozenset = frozenset(),
           level: Optional[frozenset] = None) -> set:
    """ids of the element-level values (inputs and nodes) that computing ``wanted`` reads, ``wanted`` included; the
    walk stops at the values in ``held`` (kept in registers: read, not computed) and leaves out those of ``level``
    (computed once a row: :func:`row_level`'s; a column kernel's are ``outer.column_level``'s)."""
    level = row_level(group) if level is None else level
    producer = group._cache.get("producer")
    if producer is None:
        producer = group._cache["producer"] = {n.out.id: n for n in group.nodes}
    need, stack = set(), list(wanted)
    while stack:
        v = stack.pop()
        if v.id in need or v.id in level:
            continue
        need.add(v.id)
        if v.id in producer and v.id not in held:
            stack.extend(read_values(producer[v.id]))
    return need


def read_values(n: ir.Node) -> list:
    """The group values whose elements ``n`` reads: its values, less ``type_as``'s ``other``, of which it takes
    only the dtype (a backward's ``type_as(dy, y)``: y is neither computed nor held for it)."""
    if n.op == TYPE_AS:
        return [a for a in n.args[:1] if isinstance(a, ir.Value)]
    return n.values


def reduction_passes(group: ir.Group, merge: bool) -> list[list[ir.Node]]:
    """The group's reduction nodes in the passes along the row that accumulate them, in order: one each, or
    (``merge``, the CUDA kernels') consecutive ones whose inputs do not read each other's results in one pass: a
    layer_norm backward's sum(dy * w) and sum(dy * w * xhat) load dy and x together and wait for memory once a row,
    where a pass each loaded x only after the first sum's block reduction. A variance (a pass for its mean, one
    for the squared deviations) is a pass set of its own."""
    got = group._cache.get(("reduction_passes", merge))
    if got is not None:
        return got
    got, current = [], []
    for n in group.nodes:
        red = ops.reduction(n.op)
        if red is None:
            continue
        if (merge and current and not red.variance and not ops.reduction(current[0].op).variance
                and not {m.out.id for m in current} & needed(group, [n.args[0]], level=frozenset())):
            current.append(n)
            continue
        current = [n]
        got.append(current)
    group._cache[("reduction_passes", merge)] = got
    return got


def row_passes(group: ir.Group, merge: bool = False) -> list:
    """The passes of a row kernel along the row, in order: per set of :func:`reduction_passes` the values it
    accumulates (its reductions' inputs; a variance takes two passes, the mean's and the squared deviations'),
    then the element-level outputs'. ``merge``: the CUDA kernels' passes (sibling reductions share one)."""
    rows_v = row_level(group)
    passes = []
    for members in reduction_passes(group, merge):
        passes += [[n.args[0] for n in members]] * (2 if ops.reduction(members[0].op).variance else 1)
    elem_out = [o for o in group.outputs if o.id not in rows_v]
    if elem_out:
        passes.append(elem_out)
    return passes


def held_values(group: ir.Group) -> list:
    """For a row held in registers (``CudaShape.held``): per pass of :func:`row_passes`, the ids of the element-level
    values it finds in registers, kept by the passes before it. After each pass, what later passes read of what it
    computed or read is kept: walking back from each later pass's values, the first values met that this pass
    has (the cut). So a pass computes only what depends on the row-level values it is the first to see: softmax's
    output pass reads exp(x - max) from registers and divides, layer_norm's keeps x + bias + residual, then x - mean."""
    got = group._cache.get("held_values")
    if got is not None:
        return got
    passes = row_passes(group, merge=True)
    held: frozenset = frozenset()
    got = []
    for i, wanted in enumerate(passes):
        got.append(held)
        has = frozenset(needed(group, wanted, held) | held)  # what this pass reads or computes, and finds held
        keep: set = set()
        for later in passes[i + 1:]:
            keep |= needed(group, later, has) & has
        held = _without_casts(group, keep)
    group._cache["held_values"] = got
    return got


CASTS = frozenset((TYPE_AS, "aten::_to_copy"))


def _without_casts(group: ir.Group, keep: set) -> frozenset:
    """``keep`` less each cast of another value in it: the later pass converts again (an instruction or none)
    rather than holding both (a backward holds dy and ``type_as(dy, y)``, one more register an element)."""
    keep = set(keep)
    for vid in sorted(keep, reverse=True):
        n = group.producer(ir.Value(vid))
        if n is not None and n.op in CASTS and isinstance(n.args[0], ir.Value) and n.args[0].id in keep:
            keep.discard(vid)
    return frozenset(keep)


def kept_values(group: ir.Group, keepable: Callable[[int], bool]) -> list:
    """The CPU row kernel's values kept in a row-long scratch array (one per value and thread) rather than computed
    again: per pass of :func:`row_passes`, (the ids it reads from scratch, the ids it writes there). A pass keeps
    the ``keepable`` values (the codegen's: costly ones, exp, log..., and those reading several inputs) it computes
    that a later pass reads, walking back from that pass's values to the first values met that this pass computes.
    So softmax's output pass reads exp(x - max) from scratch and multiplies, as eager's kernel does; its backward
    computes exp once rather than three times; layer_norm(x + bias + residual) reads the sum from scratch in its
    variance and output passes. Other values are computed again (the row's inputs are in cache by then)."""
    passes = row_passes(group)
    held: frozenset = frozenset()
    got = []
    for i, wanted in enumerate(passes):
        computed = frozenset(v for v in needed(group, wanted, held) - held if keepable(v))
        keep: set = set()
        for later in passes[i + 1:]:
            keep |= needed(group, later, held | computed) & computed
        got.append((held, frozenset(keep)))
        held = held | keep
    return got


def pass_width(group: ir.Group, held: bool) -> tuple[int, int]:
    """(the most row values a pass of a CUDA row kernel holds per element, the inputs its first pass loads). A held
    row (``held``): the values a pass finds held or holds for later passes (a later pass loads its inputs a
    vector at a time); otherwise every pass loads what it reads, a trip at a time."""
    passes = row_passes(group, merge=True)
    holds = held_values(group) if held else [frozenset()] * len(passes)
    tensors = {v.id for v in group.inputs if v.is_tensor}
    width, first = 0, 0
    for i, wanted in enumerate(passes):
        now = holds[i]
        loads = tensors & needed(group, wanted, now) - now
        later = holds[i + 1] - now if i + 1 < len(holds) else frozenset()
        if i == 0:
            first = len(loads)
        # a pass's held values replace those it found element by element
        width = max(width, len(now), len(later)) if held else max(width, len(loads))
    return width, first
