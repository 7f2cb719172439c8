"""``fuser.explain(fn, *inputs)``: what fuser fuses in ``fn`` under ``torch.compile(backend="fuser")``, and why not
the rest.

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
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def explain(fn: Callable, *inputs, **kwargs) -> "Explanation":
    """Compile ``fn`` (a function or ``torch.nn.Module``) with the fuser backend, run it on ``inputs`` (and
    ``kwargs``), and return what was fused and why the rest was not: a list of records whose ``str()`` is a
    table. Graph breaks give several graphs; each is reported."""
    from . import executor
    from .dynamo import aot, lower  # imports torch._dynamo: only when asked
    from .dynamo.report import FALLS_BACK, Explanation, Record, graph_records

    records = Explanation()
    current = {}  # spec key -> graph name, for run-time records

    def listen(graph, gm, part, specs):
        records.extend(graph_records(graph, part, specs))
        for s in specs:
            current[s.key] = graph

    seen = set()

    def observe(spec, args):
        sig = (spec.key, tuple((a.dtype, a.device, a.dim()) if isinstance(a, torch.Tensor) else type(a)
                               for a in args))
        if sig in seen:
            return
        seen.add(sig)
        plan = executor.plan(spec, list(args))
        why = plan if isinstance(plan, str) else (
            None if executor.kernel_for(spec, plan) is not None else
            "the code generator has no form for these inputs (an op or dtype), or eager rejects them")
        if why is not None:
            ops = tuple(n.op for n in spec.group.nodes)
            records.append(Record(current.get(spec.key, ""), FALLS_BACK, ops, why, (), spec.key))

    def fresh_backend(gm, example_inputs, **kw):  # a new backend object: Dynamo compiles anew for it
        return aot.backend(gm, example_inputs, **kw)

    aot.listeners.append(listen)
    outer, lower.observer = lower.observer, observe
    try:
        compiled = torch.compile(fn, backend=fresh_backend, dynamic=False)
        out = compiled(*inputs, **kwargs)
        outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
        if outs and torch.is_grad_enabled():
            leaves = [t for t in _tensors(inputs) + _tensors(kwargs) if t.requires_grad]
            if isinstance(fn, torch.nn.Module):
                leaves += [p for p in fn.parameters() if p.requires_grad]
            if leaves:
                torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)
    finally:
        aot.listeners.remove(listen)
        lower.observer = outer
    return records
