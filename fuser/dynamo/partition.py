"""An ATen FX graph cut into regions, each one group: the torch.compile door's fusion pass.

Consumers pull in their producers, in graph order, as the TorchScript pass does (``fuser/graph_fuser.py``, whose
limits it shares): a node joins when :mod:`.support` takes it and the merged region

* spans no side effect (a mutation, a random op: see ``support.is_barrier``), whose order stays eager's (a
  random op may be the region's first or last node);
* closes no cycle: no path leaves the region and comes back (each region runs as one call, so a node that needs
  one of its values and feeds another of its nodes could run neither before nor after it);
* keeps every output at the region's one broadcast shape (a group's kernel writes each output over the whole
  map; an output of another shape would make every call fall back), with the strides eager gives it: the
  executor allocates outputs with the strides ``fuser/layout.py`` computes from the inputs' (TensorIterator's
  rule), so the region's layouts are computed from its inputs' fake strides and compared with its outputs'
  (a transposed or channels_last region fuses; one whose layouts would differ is refused). Where a size or
  stride is symbolic (reading it would install a guard), outputs must be contiguous in eager, as must a row
  kernel's;
* stays within the group's limit of inputs plus outputs.

Regions of fewer than ``MIN_GROUP_KERNELS`` ops are dropped (one op saves no launch). Every node left out keeps
its reason, for ``fuser.explain``. Regions are the same shape-free groups the executor specializes per call;
shapes are compared as symbols, never made concrete (that would install a guard and recompile per size).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx

from ..graph_fuser import MAX_GROUP_ARGS, MIN_GROUP_KERNELS
from .. import ir, layout, ops
from .support import Support, fake, is_barrier, overload_name, reduced_dims, tensor_constant

SUM = "aten::sum.dim_IntList"
MAX_MERGE_ROUNDS = 4  # passes over the graph's edges until a pass merges nothing


@dataclass
class Region:
    """Nodes that run as one group: ``nodes`` in graph order, the ``inputs`` (nodes outside, in first-use order)
    and the ``outputs`` (nodes inside that something outside reads)."""

    nodes: list
    inputs: list
    outputs: list


@dataclass
class Partition:
    regions: list[Region]
    left_out: dict = field(default_factory=dict)  # compute node -> why it is in no region


class _Group:
    __slots__ = ("members",)

    def __init__(self, node):
        self.members = {node}


def _dim(x):
    """A size or stride as something comparable without a guard: the int, or the symbol's expression."""
    if isinstance(x, int):
        return x
    node = getattr(x, "node", None)
    expr = getattr(node, "expr", None)
    if expr is not None:
        try:
            return int(expr)  # a symbolic int that is a number (no guard: it is one already)
        except TypeError:
            return expr
    return x


def _shape(node) -> Optional[tuple]:
    v = fake(node)
    return None if v is None else tuple(_dim(s) for s in v.shape)


def broadcast(shapes) -> Optional[tuple]:
    """The broadcast of shapes given as :func:`_dim` tuples; None where it is not known without a guard."""
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(nd):
        sizes = {s[len(s) - nd + d] for s in shapes if len(s) - nd + d >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _contiguous(node) -> bool:
    v = fake(node)
    shape, strides = [_dim(s) for s in v.shape], [_dim(s) for s in v.stride()]
    expect = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expect:
            return False
        expect = expect * size
    return True


def _concrete(node) -> Optional[tuple]:
    """(sizes, strides) of a node's fake tensor as ints; None where one is symbolic (or the node no tensor)."""
    v = fake(node)
    if v is None:
        return None
    sizes, strides = tuple(_dim(s) for s in v.shape), tuple(_dim(s) for s in v.stride())
    return (sizes, strides) if all(type(x) is int for x in sizes + strides) else None


def _layout_refusal(ordered: list, inputs: list, outs: list) -> Optional[str]:
    """Why the group of ``ordered`` would not give its outputs eager's strides, or None when it would. The
    executor's rule (``executor._output_layouts``): contiguous inputs give contiguous outputs; otherwise
    ``layout.group_layouts`` of the inputs' layouts. Those are the fake values' here (Dynamo guards on its inputs'
    strides, and every other value's follow from them), so with concrete shapes the run-time strides are these."""
    in_lays, out_lays = [_concrete(a) for a in inputs], [_concrete(o) for o in outs]
    if None in in_lays or None in out_lays:  # symbolic sizes: the conservative rule, no guard
        for o in outs:
            if not _contiguous(o):
                return (f"its value {o.name} is not contiguous in eager, and with symbolic sizes a group's "
                        "outputs must be")
        return None
    if all(st == layout.contiguous_strides(sz) for sz, st in in_lays):
        got = [(sz, layout.contiguous_strides(sz)) for sz, _ in out_lays]
    else:
        from .lower import lower  # lower.py imports this module
        try:
            group = lower(Region(ordered, inputs, outs))
            metas = [torch.empty_strided(sz, st, dtype=fake(a).dtype, device="meta")
                     for a, (sz, st) in zip(inputs, in_lays)]
            got = layout.group_layouts(group, metas)
        except Exception as e:  # noqa: BLE001 (an op the layout rule does not know: refused, never wrong)
            got = f"{type(e).__name__}: {e}"
        if isinstance(got, str):
            return f"its outputs' strides are not known before the call ({got})"
    for o, (sz, st), (want_sz, want_st) in zip(outs, got, out_lays):
        if (tuple(sz), tuple(st)) != (want_sz, want_st):
            return (f"its value {o.name} has strides {_pretty(want_st)} as traced (eager's meta kernels), and "
                    f"the group would write {_pretty(st)}")
    return None


class _Partitioner:
    def __init__(self, graph: torch.fx.Graph, support: Support):
        self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.barriers = [i for i, n in enumerate(self.nodes) if is_barrier(n)]
        self.support = support
        self.group_of: dict = {}
        self.refused: dict = {}  # node -> the last reason a merge with it was refused
        self.spans: dict = {}  # id of a group of several nodes -> (its first position, its last, the group)

    def group(self, node) -> _Group:
        g = self.group_of.get(node)
        if g is None:
            g = self.group_of[node] = _Group(node)
        return g

    @staticmethod
    def inputs(ordered: list) -> list:
        members, seen, out = set(ordered), set(), []
        for m in ordered:
            for a in m.all_input_nodes:
                if a not in members and a not in seen and tensor_constant(a) is None:
                    seen.add(a)
                    out.append(a)
        return out

    @staticmethod
    def outputs(ordered: list) -> list:
        members = set(ordered)
        return [m for m in ordered if any(u not in members for u in m.users)]

    def _bound(self, consumer: _Group) -> int:
        """A position no path into ``consumer`` passes at or after: walking such a path backwards, each step
        goes to an earlier position, except a jump inside a group, which stays below that group's last
        position; and a group it jumps in starts before the bound so far."""
        bound = max(self.pos[m] for m in consumer.members)
        grown = True
        while grown:
            grown = False
            for lo, hi, _ in self.spans.values():
                if lo < bound < hi:
                    bound, grown = hi, True
        return bound + 1

    def _closes_cycle(self, consumer: _Group, producer: _Group, merged: set) -> bool:
        """Whether a path leaves ``producer`` and reaches ``consumer`` through nodes outside both (other
        regions count as one node: their members run together)."""
        stack = [u for m in producer.members for u in m.users if u not in merged]
        seen = set()
        bound = self._bound(consumer)
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in consumer.members:
                return True
            if x in producer.members:
                continue
            g = self.group_of.get(x)
            if g is not None and len(g.members) > 1:
                if self.spans[id(g)][0] >= bound:
                    continue
                members = g.members
            elif self.pos[x] >= bound:
                continue
            else:
                members = (x,)
            for m in members:
                seen.add(m)
                stack.extend(u for u in m.users if u not in seen)
        return False

    def refusal(self, consumer: _Group, producer: _Group) -> Optional[str]:
        merged = consumer.members | producer.members
        ordered = sorted(merged, key=self.pos.__getitem__)
        lo, hi = self.pos[ordered[0]], self.pos[ordered[-1]]
        k = bisect.bisect_right(self.barriers, lo)
        if k < len(self.barriers) and self.barriers[k] < hi:
            b = self.nodes[self.barriers[k]]
            return f"a side effect between its ops ({b.name}: {getattr(b.target, '__name__', b.target)})"
        outs = self.outputs(ordered)
        n_args = len(self.inputs(ordered)) + len(outs)
        if n_args > MAX_GROUP_ARGS:
            return f"the input/output limit: joining would make {n_args} inputs and outputs (at most {MAX_GROUP_ARGS})"
        rows = _row_refusal(ordered, self.inputs(ordered), outs)
        if rows is not None:  # a region with reductions: a row kernel's shapes
            if rows:
                return rows
            if self._closes_cycle(consumer, producer, merged):
                return "a cycle: a node outside the group both needs a group value and feeds the group"
            return None
        shapes = [_shape(n) for n in ordered]
        full = broadcast(shapes)
        if full is None:
            return "shapes that do not broadcast to one known shape without fixing a size"
        for o in outs:
            if _shape(o) != full:
                return (f"its value {o.name} of shape {_pretty(_shape(o))} is needed outside, and a group's outputs "
                        f"have the group's shape {_pretty(full)}")
        why = _layout_refusal(ordered, self.inputs(ordered), outs)
        if why is not None:
            return why
        if self._closes_cycle(consumer, producer, merged):
            return "a cycle: a node outside the group both needs a group value and feeds the group"
        return None

    def _merge(self, g: _Group, other: _Group) -> None:
        g.members |= other.members
        for m in other.members:
            self.group_of[m] = g
        self.spans.pop(id(other), None)
        positions = [self.pos[m] for m in g.members]
        self.spans[id(g)] = (min(positions), max(positions), g)

    def _merge_column_sums(self) -> None:
        """Groups holding a sum over the leading dims joined to a group of row reductions that reads an input of
        theirs, where the merged group is one row kernel (``_row_refusal``): no edge joins them (a norm's backward,
        whose weight's gradient sums dy times the normalized rows, recomputed from x apart from x's gradient), and
        as one kernel they read x and dy once."""
        groups = list({id(g): g for g in self.group_of.values() if len(g.members) > 1}.values())
        rows = [g for g in groups if any(_row_reduction(m) for m in g.members)]
        sums = [g for g in groups if any(_leading_reduction(m) for m in g.members)] + [
            self.group(n) for n in self.nodes  # a sum of a graph input alone (a bias's gradient, dy summed)
            if _leading_reduction(n) and self.support.takes(n) and len(self.group(n).members) == 1]
        for a in sums:
            reads = set(self.inputs(list(a.members)))
            for b in rows:
                if a is b or self.group_of[next(iter(b.members))] is not b:  # (b merged into another already)
                    continue
                # (no edge joins them: a path may run either way through nodes outside both)
                if reads & set(self.inputs(list(b.members))) and self.refusal(b, a) is None and \
                        not self._closes_cycle(a, b, a.members | b.members):
                    self._merge(b, a)
                    break

    def run(self) -> Partition:
        takes = self.support.takes
        # reductions over leading dims (a column kernel's) join last: the row reductions and pointwise ops of a
        # backward (a norm's input gradient) group first, and a weight's gradient sum, which cannot share their
        # row kernel, joins what is left or stays ATen's
        late = {n for n in self.nodes if _leading_reduction(n)}
        pairs = [(n, p) for n in self.nodes for p in n.all_input_nodes if takes(n) and takes(p)]
        pairs = [(n, p) for n, p in pairs if n not in late and p not in late] + [
            (n, p) for n, p in pairs if n in late or p in late]
        # rounds until no merge: a merge refused early (its value needed by a node not yet in the group, or a
        # path through a node that later joins the other group) may be allowed once both groups have grown
        for _ in range(MAX_MERGE_ROUNDS):
            merged = False
            for n, p in pairs:
                g, other = self.group(n), self.group(p)
                if g is other:
                    continue
                why = self.refusal(g, other)
                if why is None:
                    self._merge(g, other)
                    self.refused.pop(n, None)
                    self.refused.pop(p, None)
                    merged = True
                else:
                    self.refused[n] = self.refused[p] = why
            if not merged:
                break
        self._merge_column_sums()
        regions, left_out, seen = [], {}, set()
        for n in self.nodes:
            why = self.support.reason(n)
            if why == "not a compute node":
                continue
            if why is not None:
                if tensor_constant(n) is None or any(not self.support.takes(u) for u in n.users):
                    left_out[n] = why
                continue
            g = self.group(n)
            if id(g) in seen:
                continue
            seen.add(id(g))
            ordered = sorted(g.members, key=self.pos.__getitem__)
            if len(ordered) < MIN_GROUP_KERNELS:
                for m in ordered:
                    left_out[m] = ("alone: " + self.refused[m]) if m in self.refused else (
                        "alone: no fusable op next to it (a group of one op saves no launch)")
                continue
            regions.append(Region(ordered, self.inputs(ordered), self.outputs(ordered)))
        return Partition(regions, left_out)


def _row_reduction(n) -> bool:
    """A reduction (or normalization) along the row: its constant dims do not start at 0."""
    name = overload_name(n) if n.op == "call_function" else None
    return name is not None and ops.reduction(name) is not None and not _leading_reduction(n)


def _leading_reduction(n) -> bool:
    name = overload_name(n) if n.op == "call_function" else None
    if name is None or ops.reduction(name) is None:
        return False
    dims = reduced_dims(n)
    return bool(dims) and dims[0] == 0


def _row_refusal(ordered: list, inputs: list, outs: list) -> Optional[str]:
    """For a region holding reductions (``fuser/rows/``): why its shapes are not a row kernel's, or "" when
    they are; None for a region without reductions. Every reduction reduces the same trailing dims of values of
    one shape F; every value broadcasts to F; the outputs are F-shaped, or row-shaped (F with the reduced dims
    kept as 1 or dropped) and computed from reductions only (``rows.passes.row_level``: a row-shaped value of the
    inputs alone is no row kernel's output), and contiguous. The executor checks the rest per call and falls
    back otherwise."""
    reds = [n for n in ordered if ops.reduction(overload_name(n) or "") is not None]
    if not reds:
        return None
    sums = column_sums(ordered, reds)
    reds = [n for n in reds if n not in sums]
    dims = {reduced_dims(n) for n in reds}
    fulls = {_shape(n.args[0]) for n in reds}
    if len(dims) > 1 or len(fulls) > 1 or None in dims or None in fulls:
        return "reductions of different dims or of values of different shapes (one row kernel each)"
    full, dims = fulls.pop(), dims.pop()
    lowered: list = []

    def group() -> ir.Group:  # the region lowered, once
        if not lowered:
            from .lower import lower  # lower.py imports this module
            lowered.append(lower(Region(ordered, inputs, outs)))
        return lowered[0]

    k = len(dims)
    leading = dims[0] == 0  # a column kernel's (fuser/rows/outer.py): a row here is a column, one value each
    rows = ((1,) * k + full[k:], full[k:]) if leading else (full[:len(full) - k] + (1,) * k, full[:len(full) - k])
    if sums:
        lead = len(full) - k
        columns = ((1,) * lead + full[lead:], full[lead:])
        for n in sums:
            if leading or _shape(n.args[0]) != full or reduced_dims(n) != tuple(range(lead)) or \
                    _shape(n) not in columns:
                return (f"{n.name}, a sum over the leading dims, beside reductions along the row that are not of its "
                        f"value's shape {_pretty(_shape(n.args[0]) or ())} (one row kernel each)")
        why = _cuda_sums_refusal(group, ordered, inputs, outs, sums, full[lead:])
        if why:
            return why
    for n in ordered:
        s = _shape(n)
        if n in sums:
            continue
        if s is None or (s not in rows and broadcast([s, full]) != full):
            return (f"{n.name} of shape {_pretty(s or ())} is neither the rows' elements {_pretty(full)} nor a row's "
                    "value")
    for o in outs:
        if o in sums:
            continue
        if _shape(o) != full and _shape(o) not in rows:
            return f"its value {o.name} of shape {_pretty(_shape(o))} is needed outside, and is no row kernel's output"
        if not _contiguous(o):
            return f"its value {o.name} is not contiguous in eager, and a group writes its outputs densely"
    if any(_shape(o) != full for o in outs):  # row-shaped outputs: a row kernel writes only row-level ones
        from ..rows.outer import column_level
        from ..rows.passes import row_level
        level = (column_level if leading else row_level)(group())
        for o, v in zip(outs, group().outputs):
            if _shape(o) != full and v.id not in level and o not in sums:
                return (f"its value {o.name} of shape {_pretty(_shape(o))} is needed outside, and a row kernel's "
                        f"outputs have the rows' elements' shape {_pretty(full)} unless computed from a reduction")
    return ""


def _cuda_sums_refusal(group, ordered: list, inputs: list, outs: list, sums: set, row: tuple) -> str:
    """Why a CUDA row kernel would not sum the column sums ``sums`` of this region (``group()``: lowered) itself (a
    row of several trips: it would write the summed values whole for eager's sum, where a column kernel of their own
    reads the inputs again, fewer bytes), or "" (the CPU's kernels always do)."""
    if fake(ordered[0]).device.type != "cuda":
        return ""
    if not all(type(d) is int for d in row):
        return "column sums beside reductions along a row of a symbolic length (a column kernel of their own)"
    from ..rows import decompose
    from ..rows.shape import cuda_sums_in_kernel
    sizes = [fake(a).element_size() for a in inputs if fake(a) is not None] + [fake(o).element_size() for o in outs]
    cols = math.prod(row)
    if cuda_sums_in_kernel(decompose.expand(group()), tuple(m for m, o in enumerate(outs) if o in sums), cols,
                           sizes, fake(ordered[0]).device):
        return ""
    return (f"column sums beside reductions along rows of {cols} elements, which a CUDA row kernel takes in several "
            "trips, their sums past its shared memory (a column kernel of their own sums them)")


def column_sums(ordered: list, reds: list) -> set:
    """The column sums among a region's reductions ``reds``, where it also holds reductions along the row (a norm's
    backward summing its weight's and bias's gradients; ``fuser.rows.passes.column_sum_form``): plain sums over
    leading dims, read by no node of the region (of a region input too: :func:`.lower.lower` gives the row kernel
    a copy of it to sum)."""
    members = set(ordered)
    sums = {n for n in reds if overload_name(n) == SUM and (reduced_dims(n) or (1,))[0] == 0
            and isinstance(n.args[0], torch.fx.Node) and n.kwargs.get("dtype") is None
            and not any(u in members for u in n.users)}
    others = [n for n in reds if n not in sums]
    return sums if others and all((reduced_dims(n) or (0,))[0] != 0 for n in others) else set()


def _pretty(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def partition(graph: torch.fx.Graph, support: Optional[Support] = None) -> Partition:
    """The regions of ``graph`` (an ATen graph from AOTAutograd) and the reasons for the nodes left out."""
    return _Partitioner(graph, support or Support()).run()
