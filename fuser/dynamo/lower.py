"""Regions of an FX graph lowered to the group IR, registered, and put back into the graph as one call each.

``lower(region)`` builds an :class:`fuser.ir.Group` with :class:`fuser.ir.Builder`: the region's inputs become
group inputs (tensors), each node one IR node with every schema argument (kwargs and defaults placed), Python
numbers kept as constants (they are Python scalars in Tensor slots: ``add.Tensor(x, 1.0)`` promotes as a wrapped
number, as in eager), ``scalar_tensor`` constants held as 0-dim tensor constants. A node that a decomposition
made from an eager op (``meta["original_aten"]``) carries that op as its ``origin``: eager computes such steps in
one kernel, without rounding between them.

``rewrite(gm, regions)`` returns a new GraphModule in which each region is one call of its registered group,
through ``autodiff.run``, the entry the TorchScript door's operator uses: the kernel, or the fallback. AOTAutograd
has differentiated the graph already, and runs the forward and backward graphs with grad mode off, so no
autograd happens inside a group call.
"""
from __future__ import annotations

import heapq
import operator
from typing import Callable, Optional

import torch
import torch.fx

from .. import autodiff, ir, native, ops, torch_ops  # noqa: F401 (torch_ops defines fuser::fusion_group)
from ..kernel_cache import STORE, KernelSpec
from .partition import Region, column_sums
from .support import constant, full_args, is_barrier, overload_name, tensor_constant

# fuser.explain sets this while it runs: called with (spec, args) on each group call, to see run-time fallbacks
observer: Optional[Callable] = None


def _origin(node: torch.fx.Node, op: str) -> str:
    orig = node.meta.get("original_aten")
    if isinstance(orig, torch._ops.OpOverload) and orig.name() != op:
        return orig.name()
    return ""


def lower(region: Region) -> ir.Group:
    b = ir.Builder()
    env = {n: b.input() for n in region.inputs}
    # a column sum of a region input beside reductions along the row (a bias's gradient, dy summed over the rows, in
    # a norm's backward): the row kernel sums values it computes, so it sums a copy of the input (_to_copy, no dtype)
    copied = {n for n in column_sums(region.nodes, [m for m in region.nodes if ops.reduction(
        overload_name(m) or "") is not None]) if n.args[0] in env}
    for n in region.nodes:
        op = overload_name(n)
        args = []
        for a in full_args(n, op):
            if isinstance(a, torch.fx.Node):
                args.append(env[a] if a in env else tensor_constant(a))
            else:
                args.append(constant(a))
        if n in copied:
            args[0] = b.add("aten::_to_copy", args[0], None, None, None, None, False, None)
        with b.steps_of(_origin(n, op)):
            env[n] = b.add(op, *args)
    return b.build([env[o] for o in region.outputs])


def group_call(spec: KernelSpec) -> Callable:
    """The function a rewritten graph calls for ``spec``: its outputs as a list, or its one output alone
    (``single_output``: no list built and no getitem; the operator alone took 5.4 µs a call against 6.3 on the
    development machine, and whole compile_fuser calls on an H200 moved within their noise). A group
    of tensor inputs calls the TorchScript door's operator (``fusion_group1`` for one output), so that the native
    hot path (fuser/native) serves its repeated calls once loaded; its Python kernel is ``autodiff.run``, as here
    otherwise."""
    run = autodiff.run
    single = single_output(spec)
    op = (torch.ops.fuser.fusion_group1 if single else torch.ops.fuser.fusion_group).default
    key, digest = spec.key, spec.digest
    native.ensure()  # load it, or start building it (calls run in Python meanwhile)

    def call(*args):
        if observer is not None:
            observer(spec, args)
        elif spec.all_tensors and native.loaded():
            return op(list(args), [], key, digest, "")
        out = run(spec, list(args))
        return out[0] if single else out

    call.__name__ = call.__qualname__ = f"fuser_group_{spec.key}"
    call.fuser_spec = spec
    return call


def single_output(spec: KernelSpec) -> bool:
    """Whether the graph calls ``spec``'s group for its one output alone (not a list of one)."""
    return len(spec.group.outputs) == 1


def rewrite(gm: torch.fx.GraphModule, regions: list[Region]) -> tuple[torch.fx.GraphModule, list[KernelSpec]]:
    """``gm`` with each region replaced by one call of its registered group; and the groups' specs."""
    specs = [STORE.get(STORE.register(lower(r))) for r in regions]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    region_of = {n: k for k, r in enumerate(regions) for n in r.nodes}

    # one item per node outside the regions and per region; emitted in a topological order of the items that
    # keeps the graph's order where it can (a region stands where its first node stood)
    def item(n):
        k = region_of.get(n)
        return ("r", k) if k is not None else ("n", n)

    deps, users, first = {}, {}, {}
    for n in nodes:
        it = item(n)
        first.setdefault(it, pos[n])
        deps.setdefault(it, set())
        users.setdefault(it, set())
        for a in n.all_input_nodes:
            src = item(a)
            if src != it:
                deps[it].add(src)
                users.setdefault(src, set()).add(it)
    # side effects keep their order against everything: each one after every item before it, every item after it
    # after it (regions never span one, so these edges close no cycle)
    last, since = None, []
    for n in nodes:
        it = item(n)
        if is_barrier(n):
            for before in since + ([last] if last is not None else []):
                if before != it:
                    deps[it].add(before)
                    users[before].add(it)
            last, since = it, []
        else:
            if last is not None and first[it] == pos[n] and it != last:
                deps[it].add(last)
                users[last].add(it)
            if first[it] == pos[n]:
                since.append(it)
    waiting = {it: len(d) for it, d in deps.items()}
    ready = [(first[it], it) for it, c in waiting.items() if c == 0]
    heapq.heapify(ready)
    graph = torch.fx.Graph()
    env: dict = {}
    emitted = 0
    while ready:
        _, it = heapq.heappop(ready)
        emitted += 1
        if it[0] == "n":
            env[it[1]] = graph.node_copy(it[1], lambda x: env[x])
        else:
            k = it[1]
            r = regions[k]
            call = graph.call_function(group_call(specs[k]), tuple(env[a] for a in r.inputs))
            if single_output(specs[k]):  # the call is its output
                call.meta = dict(r.outputs[0].meta)
                env[r.outputs[0]] = call
            else:
                for j, o in enumerate(r.outputs):
                    got = graph.call_function(operator.getitem, (call, j))
                    got.meta = dict(o.meta)
                    env[o] = got
        for u in users.get(it, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (first[u], u))
    if emitted != len(deps):
        raise RuntimeError("fuser: the regions of this graph form a cycle (a partitioner bug); running it unfused")
    for n in reversed(list(graph.nodes)):  # constants folded into groups and now read by no one
        if not n.users and tensor_constant(n) is not None:
            graph.erase_node(n)
    graph.lint()
    return torch.fx.GraphModule(gm, graph), specs
