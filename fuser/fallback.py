"""The fallback: run a group op by op through eager's own ATen ops, so results and errors are exactly eager's.

Used whenever fusion is not possible for the inputs at hand (other devices, dtypes, shapes, autograd). Each node
calls its ATen overload (``torch.ops.aten.add.Tensor``) with the node's arguments, as TorchScript's interpreter
would, and autograd records those ops as eager's would. The compiler's type probe runs groups the same way.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from . import ir
from .kernel_cache import KernelSpec


@functools.lru_cache(maxsize=None)
def _overload(op: str) -> tuple[Callable, tuple[str, ...], int]:
    """The callable of an overload name, its keyword-only argument names and its positional count."""
    base, _, overload = op.partition(".")
    ns, name = base.split("::")
    fn = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
    ps = ir.params(op)
    n_pos = sum(1 for p in ps if not p.kwarg_only)
    return fn, tuple(p.name for p in ps[n_pos:]), n_pos


def _program(group: ir.Group) -> list:
    """Per node: (callable, argument makers, keyword names, positional count, output id); cached per group."""
    got = group._cache.get("eager")
    if got is None:
        steps = []
        for n in group.nodes:
            fn, kw, n_pos = _overload(n.op)
            args = []
            for a in n.args:
                if isinstance(a, ir.Value):
                    args.append((0, a.id))
                elif isinstance(a, tuple) and all(isinstance(x, ir.Value) for x in a):
                    args.append((1, tuple(x.id for x in a)))
                elif isinstance(a, tuple):  # a constant int list (dims)
                    args.append((3, list(a)))
                elif isinstance(a, ir.TensorConst):
                    args.append((2, a))
                else:
                    args.append((3, a))
            steps.append((fn, tuple(args), kw, n_pos, n.out.id))
        got = group._cache["eager"] = steps
    return got


def evaluate(group: ir.Group, args: Sequence, every_value: bool = False) -> list:
    """The group's outputs for ``args`` (in its input order); with ``every_value``, also every node's result
    after them (the compiler's type probe)."""
    if len(args) != len(group.inputs):
        raise TypeError(f"the group takes {len(group.inputs)} arguments, got {len(args)}")
    env = {v.id: a for v, a in zip(group.inputs, args)}
    for fn, spec, kw, n_pos, out in _program(group):
        vals = []
        for how, a in spec:
            if how == 0:
                vals.append(env[a])
            elif how == 1:
                vals.append([env[x] for x in a])
            elif how == 2:
                vals.append(a.tensor())
            else:
                vals.append(a)
        env[out] = fn(*vals[:n_pos], **dict(zip(kw, vals[n_pos:]))) if kw else fn(*vals)
    outs = [env[v.id] for v in group.outputs]
    if every_value:
        outs += [env[n.out.id] for n in group.nodes]
    return outs


def run(spec: KernelSpec, args: Sequence) -> list[torch.Tensor]:
    """Outputs of the group ``spec`` for ``args`` (in the group's input order), computed op by op."""
    return evaluate(spec.group, args)
