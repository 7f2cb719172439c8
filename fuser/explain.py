"""``fuser.explain(fn, *inputs)``: what fuser fuses in ``fn``, and why not the rest: under
``torch.compile(backend="fuser")`` for a function or module, through the TorchScript pass for a scripted or traced
one (``torch.jit.script``/``trace``: the pass is applied with ``fuser.fuse`` if it was not, which edits a module's
methods in place, as ``fuse`` does; it runs the code a few times, for the profiling executor, so inputs it
mutates change more than once).

It compiles ``fn`` with the fuser backend (a fresh compile, whatever was compiled before), runs it on ``inputs``,
and, when an output requires grad, runs a backward too (``torch.autograd.grad`` with respect to the inputs and
a module's parameters, so no ``.grad`` changes), so that the backward graph is compiled and explained. Each
graph compiled gives records (``fuser/dynamo/report.py``): every group made (its ops), every compute node left
out with its reason (an op not in the table, a dtype or device the kernels do not take, a mutation, a view, the
input/output limit, a shape, a cycle, an op alone), and every group that fell back to the interpreter when it
ran, with the executor's reason (``executor.plan``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .dynamo.report import Explanation


def _tensors(x) -> list:
    """The tensors in ``x`` (nested lists, tuples, dicts), a module's parameters included."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, torch.nn.Module):
        return list(x.parameters())
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def explain(fn: Callable, *inputs, **kwargs) -> "Explanation":
    """Compile ``fn`` (a function or ``torch.nn.Module``) with the fuser backend, run it on ``inputs`` (and
    ``kwargs``), and return what was fused and why the rest was not: a list of records whose ``str()`` is a
    table. Graph breaks give several graphs; each is reported."""
    from .dynamo import aot, lower  # imports torch._dynamo: only when asked
    from .dynamo.report import Explanation, graph_records

    records = Explanation()
    if isinstance(fn, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        return _explain_torchscript(fn, inputs, kwargs, records)
    current = {}  # spec key -> graph name, for run-time records

    def listen(graph, gm, part, specs):
        records.extend(graph_records(graph, part, specs))
        for s in specs:
            current[s.key] = graph

    observe = _run_time_observer(records, current)

    def fresh_backend(gm, example_inputs, **kw):  # a new backend object: Dynamo compiles anew for it
        return aot.backend(gm, example_inputs, **kw)

    aot.listeners.append(listen)
    outer, lower.observer = lower.observer, observe
    try:
        compiled = torch.compile(fn, backend=fresh_backend, dynamic=False)
        out = compiled(*inputs, **kwargs)
        outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
        if outs and torch.is_grad_enabled():
            leaves = list({id(t): t for t in _tensors([fn, inputs, kwargs]) if t.requires_grad}.values())
            if leaves:
                torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)
    finally:
        aot.listeners.remove(listen)
        lower.observer = outer
    return records


def _run_time_observer(records, graph_of: dict, default: str = "") -> Callable:
    """A function of (spec, args) that adds a "falls back" record, once per group and input signature, when the
    executor would not run the group as a kernel: its own reason (``executor.plan``), or the code generator's."""
    from . import executor
    from .dynamo.report import FALLS_BACK, Record
    seen = set()

    def observe(spec, args):
        sig = (spec.key, tuple((a.dtype, a.device, a.dim()) if isinstance(a, torch.Tensor) else type(a)
                               for a in args))
        if sig in seen:
            return
        seen.add(sig)
        with torch.no_grad():
            plan = executor.plan(spec, list(args))
        why = plan if isinstance(plan, str) else (
            None if executor.kernel_for(spec, plan) is not None else
            "the code generator has no form for these inputs (an op without an expression for their dtypes), "
            "or eager rejects them")
        if why is not None:
            ops = tuple(n.op for n in spec.group.nodes)
            records.append(Record(graph_of.get(spec.key, default), FALLS_BACK, ops, why, (), spec.key))

    return observe


def _ts_reason(node: torch._C.Node, fusable_neighbour: bool) -> str:
    """Why the TorchScript pass left ``node`` out of every group."""
    from . import graph_fuser, ops
    kind = node.kind()
    try:
        schema = node.schema()
    except RuntimeError:
        schema = "(no schema)"
    if graph_fuser._has_side_effects(node):
        return f"{kind} has a side effect (it mutates): groups never cross one"
    if schema == "(no schema)":
        return f"{kind} is not an ATen op with a schema"
    name = _ts_name(node)
    if ops.lookup(schema) is None:
        return f"{name} is not in fuser's op table"
    if graph_fuser.fusable_op(node) is None:
        return f"{name}: an argument is neither a tensor, a float nor a constant, or a list it cannot take"
    if not fusable_neighbour:
        return "alone: no fusable op next to it (a group of one op saves no launch)"
    return ("alone: joining its neighbours' group would cross a side effect, close a cycle or pass the input/output "
            "limit, or it and they make one op")


def _ts_name(node: torch._C.Node) -> str:
    from . import ir
    try:
        return ir.name_of(torch._C.parse_schema(node.schema()))
    except RuntimeError:
        return node.kind()


def _explain_torchscript(scripted, inputs, kwargs, records):
    """The TorchScript door: the pass's groups in the graph that runs (``graph_for``), each other ATen op with
    its reason, and groups that fall back when they run."""
    from . import autodiff, graph_fuser, integration, ts_ir
    from .dynamo.report import GROUP, LEFT_OUT, Record
    from .kernel_cache import STORE
    if kwargs:
        raise TypeError("fuser.explain of TorchScript code takes positional inputs only")
    if not _has_fusion_groups(scripted):
        scripted = integration.fuse(scripted)
    graph_of: dict = {}
    observe = _run_time_observer(records, graph_of, "torchscript")
    run = autodiff.run
    start = len(records)  # groups and nodes go before the run-time records

    def observed_run(spec, args, *rest):  # the TorchScript operator calls autodiff.run: watch it while we run
        observe(spec, args)
        return run(spec, args, *rest)

    autodiff.run = observed_run
    try:
        graph = integration.graph_for(scripted, *inputs)
    finally:
        autodiff.run = run
    groups = graph_fuser.fusion_groups(graph)
    for g in groups:
        sub = g.g("Subgraph")
        key = STORE.register(ts_ir.lower(sub))
        graph_of[key] = "torchscript"
        nodes = [n for n in sub.nodes() if n.kind().startswith("aten::")]
        records.insert(start, Record("torchscript", GROUP, tuple(_ts_name(n) for n in nodes), "", (), key))
        start += 1
    for n in graph_fuser._all_nodes(graph.block()):
        if not n.kind().startswith("aten::"):
            continue
        neighbours = [v.node() for v in n.inputs()] + [u.user for o in n.outputs() for u in o.uses()]
        fusable = any(m.kind() == "prim::FusionGroup" or (m.kind().startswith("aten::") and m is not n and
                                                          graph_fuser.fusable_op(m) is not None) for m in neighbours)
        name = n.output().debugName() if n.outputsSize() == 1 else n.kind()
        records.insert(start, Record("torchscript", LEFT_OUT, (_ts_name(n),), _ts_reason(n, fusable), (name,)))
        start += 1
    return records


def _has_fusion_groups(scripted) -> bool:
    graphs = ([scripted.graph] if isinstance(scripted, torch.jit.ScriptFunction) else
              [m.graph for m in scripted.modules() if hasattr(m, "graph")])
    from . import graph_fuser
    return any(g.findAllNodes(kind) for g in graphs for kind in graph_fuser.GROUP_CALLS)
