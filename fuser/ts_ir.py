"""The TorchScript door's bridge to the group IR: a fusion group's subgraph lowered to a :class:`fuser.ir.Group`
once, at registration, and a group raised back to a TorchScript graph where TorchScript users look
(``graph_for``, ``debug_get_fused_kernel_code``'s callers, the fuzzer's reproducers).
"""
from __future__ import annotations

import torch

from . import ir

# the TorchScript node attribute that carries ``ir.Node.origin`` (set by the pass's decompositions, fuser/prepare/)
ORIGIN = "fuser_origin"


def _kind(v: torch._C.Value) -> str:
    t = v.type()
    if isinstance(t, torch._C.TensorType):
        return ir.TENSOR
    if t.kind() == "FloatType":
        return ir.FLOAT
    raise ValueError(f"a fusion group's inputs are tensors and floats; input %{v.debugName()} is {t} "
                     f"(make it a constant of the graph instead)")


def _constant(v: torch._C.Value):
    val = v.toIValue()
    if isinstance(val, torch.Tensor):
        return ir.TensorConst.of(val)
    if val is None or isinstance(val, (bool, int, float, str)):
        return val
    if isinstance(val, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in val):
        return tuple(val)  # a reduction's dims
    raise ValueError(f"a constant of type {v.type()} cannot be part of a fusion group")


def lower(graph: torch._C.Graph) -> ir.Group:
    """The group of a ``prim::FusionGroup`` subgraph (or any straight-line graph of ATen ops over tensor and
    float inputs). Raises ValueError for what a group cannot hold: blocks, several outputs per node, inputs of
    other types."""
    b = ir.Builder()
    env: dict[int, object] = {}
    for v in graph.inputs():
        env[v.unique()] = b.input(_kind(v))
    for n in graph.nodes():
        kind = n.kind()
        if list(n.blocks()):
            raise ValueError(f"a fusion group cannot hold a node with blocks: {kind}")
        if kind == "prim::Constant":
            env[n.output().unique()] = _constant(n.output())
            continue
        if kind == "prim::ListConstruct":
            env[n.output().unique()] = tuple(env[i.unique()] for i in n.inputs())
            continue
        if n.outputsSize() != 1:
            raise ValueError(f"a fusion group's nodes have one output: {kind} has {n.outputsSize()}")
        try:
            s = n.schema()
        except RuntimeError:
            s = "(no schema)"
        if s == "(no schema)":
            raise ValueError(f"a fusion group's nodes are ATen ops with a schema: {kind}")
        op = ir.name_of(torch._C.parse_schema(s))
        with b.steps_of(n.s(ORIGIN) if n.hasAttribute(ORIGIN) else ""):
            env[n.output().unique()] = b.add(op, *(env[i.unique()] for i in n.inputs()))
    outs = []
    for v in graph.outputs():
        got = env[v.unique()]
        if not isinstance(got, ir.Value):
            raise ValueError("a fusion group's outputs are values it computes or takes")
        outs.append(got)
    return b.build(outs)


def _insert_constant(g: torch._C.Graph, c) -> torch._C.Value:
    if isinstance(c, ir.TensorConst):
        c = c.tensor()
    return g.insertConstant(list(c) if isinstance(c, tuple) else c)


def raise_group(group: ir.Group) -> torch._C.Graph:
    """A TorchScript graph computing ``group`` (generic Tensor types), for display and the interpreter."""
    g = torch._C.Graph()
    env: dict[int, torch._C.Value] = {}
    for v in group.inputs:
        x = g.addInput()
        x.setType(torch._C.TensorType.get() if v.is_tensor else torch._C.FloatType.get())
        env[v.id] = x
    for n in group.nodes:
        vals = []
        for a in n.args:
            if isinstance(a, ir.Value):
                vals.append(env[a.id])
            elif isinstance(a, tuple) and not all(isinstance(x, int) for x in a):  # cat's list of values
                lst = g.create("prim::ListConstruct", [env[x.id] for x in a], 1)
                g.insertNode(lst)
                lst.output().setType(torch._C.ListType.ofTensors())
                vals.append(lst.output())
            else:
                vals.append(_insert_constant(g, a))
        node = g.create(n.op.split(".")[0], vals, 1)
        if n.origin:
            node.s_(ORIGIN, n.origin)
        g.insertNode(node)
        node.output().setType(torch._C.TensorType.get())
        env[n.out.id] = node.output()
    for v in group.outputs:
        g.registerOutput(env[v.id])
    return g
