"""Normalizations as steps of the group IR: softmax, log_softmax, layer_norm, rms_norm and std written with
reductions and pointwise ops, built into an ``ir.Builder`` as steps of the eager op (``Node.origin``: held
unrounded between steps, as eager's one kernel computes them). Each returns the values eager's op returns.

Two users: a front door that meets the op as steps (the torch.compile door's ``native_layer_norm``), and
:func:`expand`, which gives the row kernel a group whose composite nodes (``ops.Reduction.composite``: the
TorchScript pass keeps ``aten::layer_norm`` whole in the group, so the fallback, the meta evaluation and
autograd run eager's own op with eager's checks and errors) are replaced by their steps.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import ir, ops

FLOAT32_EPS = float(torch.finfo(torch.float32).eps)  # rms_norm's eps when None, below float64 (see rms_norm)


def _dims(dim: int) -> tuple:
    return (dim,)


def _cast(b: ir.Builder, x: ir.Value, dtype) -> ir.Value:
    """``x.to(dtype)`` as eager's separate op does it before softmax(x, dtype=...): stored in ``dtype``."""
    with b.steps_of(""):
        return b.add("aten::_to_copy", x, dtype, None, None, None, False, None)


def softmax(b: ir.Builder, x: ir.Value, dim: int, dtype=None) -> ir.Value:
    """``aten::softmax.int(x, dim, dtype)``: exp(x - max) times the reciprocal of its sum (``x`` converted to
    ``dtype`` first)."""
    if dtype is not None:
        x = _cast(b, x, dtype)
    with b.steps_of("aten::softmax"):
        m = b.add("aten::amax", x, _dims(dim), True)
        e = b.call("aten::exp", b.call("aten::sub", x, m, 1))
        # times the sum's reciprocal (once a row, as CPU eager's kernel does; CUDA eager divides, within an ulp):
        # a division per element is a kernel's most costly step after exp
        return b.call("aten::mul", e, b.call("aten::reciprocal", b.add("aten::sum.dim_IntList", e, _dims(dim), True, None)))


def log_softmax(b: ir.Builder, x: ir.Value, dim: int, dtype=None) -> ir.Value:
    """``aten::log_softmax.int(x, dim, dtype)``: (x - max) - log(sum(exp(x - max)))."""
    if dtype is not None:
        x = _cast(b, x, dtype)
    with b.steps_of("aten::log_softmax"):
        m = b.add("aten::amax", x, _dims(dim), True)
        d = b.call("aten::sub", x, m, 1)
        s = b.add("aten::sum.dim_IntList", b.call("aten::exp", d), _dims(dim), True, None)
        return b.call("aten::sub", d, b.call("aten::log", s), 1)


def layer_norm_stats(b: ir.Builder, x: ir.Value, normalized_shape: Sequence[int], weight: Optional[ir.Value],
                     bias: Optional[ir.Value], eps, origin: str = "aten::layer_norm",
                     stats: Optional[Sequence[ir.Value]] = None, dtype: Optional[torch.dtype] = None) -> tuple:
    """(y, mean, rstd) of layer norm over the last ``len(normalized_shape)`` dims (mean and rstd keepdim, as
    ``native_layer_norm`` returns them). ``stats``: (mean, rstd) as read from the forward (a backward's,
    :func:`saved_stat`; ``dtype`` the op's), not formed again."""
    dims = tuple(range(-len(normalized_shape), 0))
    with b.steps_of(origin):
        if stats is not None:
            mu, r = (saved_stat(b, s, dtype) for s in stats)
            d = b.call("aten::sub", x, mu, 1)
        else:
            mu = b.add("aten::mean.dim", x, dims, True, None)
            d = b.call("aten::sub", x, mu, 1)
            var = b.add("aten::mean.dim", b.call("aten::mul", d, d), dims, True, None)
            r = b.call("aten::rsqrt", b.call("aten::add", var, eps, 1))
        y = b.call("aten::mul", d, r)
        if weight is not None:
            y = b.call("aten::mul", y, weight)
        if bias is not None:
            y = b.call("aten::add", y, bias, 1)
        return y, mu, r


def layer_norm(b: ir.Builder, x: ir.Value, normalized_shape: Sequence[int], weight: Optional[ir.Value],
               bias: Optional[ir.Value], eps) -> ir.Value:
    """``aten::layer_norm``: (x - mean) * rsqrt(mean((x - mean)^2) + eps), times weight, plus bias (each when
    given), over the last ``len(normalized_shape)`` dims (eager checks they are ``normalized_shape``)."""
    return layer_norm_stats(b, x, normalized_shape, weight, bias, eps)[0]


def rms_norm_stats(b: ir.Builder, x: ir.Value, normalized_shape: Sequence[int], weight: Optional[ir.Value],
                   eps: Optional[float], stats: Optional[Sequence[ir.Value]] = None,
                   dtype: Optional[torch.dtype] = None) -> tuple:
    """(y, rstd) of rms_norm (rstd keepdim: what its backward reads). ``stats``: (rstd,) as read from the forward
    (:func:`saved_stat`; ``dtype`` the op's)."""
    dims = tuple(range(-len(normalized_shape), 0))
    with b.steps_of("aten::rms_norm"):
        if stats is not None:
            r = saved_stat(b, stats[0], dtype)
        else:
            ms = b.add("aten::mean.dim", b.call("aten::mul", x, x), dims, True, None)
            r = b.call("aten::rsqrt", b.call("aten::add", ms, FLOAT32_EPS if eps is None else eps, 1))
        y = b.call("aten::mul", x, r)
        if weight is not None:
            y = b.call("aten::mul", y, weight)
        return y, r


def saved_stat(b: ir.Builder, s: ir.Value, dtype: Optional[torch.dtype]) -> ir.Value:
    """A statistic the forward wrote (in float32 for a float16/bfloat16 input, :func:`stat_output`) as the step
    that forms it has it: of the normalization's ``dtype``, held unrounded (a step: called within ``b.steps_of``).
    The cast reads no element-level value, so the statistic stays one value a row (a row-level input of the row
    kernel: ``fuser.rows.passes.row_inputs``)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return s
    return b.add("aten::_to_copy", s, ir.SCALAR_TYPE_CODE[dtype], None, None, None, False, None)


def stat_output(b: ir.Builder, s: ir.Value, reduced: bool) -> ir.Value:
    """A statistic (a step's value) as a group output: in float32 where the input is float16/bfloat16 (``reduced``),
    as eager's CUDA kernels save it, so that it reaches the backward unrounded (the step holds it in float)."""
    if not reduced:
        return s
    with b.steps_of(""):
        return b.add("aten::_to_copy", s, ir.SCALAR_TYPE_CODE[torch.float32], None, None, None, False, None)


def rms_norm(b: ir.Builder, x: ir.Value, normalized_shape: Sequence[int], weight: Optional[ir.Value],
             eps: Optional[float]) -> ir.Value:
    """``aten::rms_norm``: x * rsqrt(mean(x * x) + eps), times weight when given, over the last
    ``len(normalized_shape)`` dims, computed in float for float16/bfloat16. ``eps`` None: eager takes the
    machine epsilon of the computation dtype, float32's below float64 (``FLOAT32_EPS``; the row plan falls back
    for a float64 one, see ``fuser.rows.plan``)."""
    return rms_norm_stats(b, x, normalized_shape, weight, eps)[0]


def std(b: ir.Builder, op: str, x: ir.Value, dim, c, keepdim) -> ir.Value:
    """``aten::std.correction`` / ``aten::std.dim``: the square root of the variance of the same arguments."""
    with b.steps_of("aten::std"):
        return b.call("aten::sqrt", b.add(op.replace("std", "var"), x, dim, c, keepdim))


def _step(b: ir.Builder, n: ir.Node, args: list) -> ir.Value:
    kind = ops.reduction(n.op).kind
    if kind in ("softmax", "log_softmax"):
        return globals()[kind](b, args[0], args[1], args[2])
    if kind == "layer_norm":
        return layer_norm(b, args[0], args[1], args[2], args[3], args[4])
    if kind == "rms_norm":
        return rms_norm(b, args[0], args[1], args[2], args[3])
    if kind == "std":
        return std(b, n.op, *args)
    raise ValueError(f"no steps for {n.op}")


def expand(group: ir.Group) -> ir.Group:
    """``group`` with each composite node replaced by its steps (the same inputs, in order, and outputs); the
    group itself when it has none. Cached on the group."""
    got = group._cache.get("expanded")
    if got is not None:
        return got
    if not any(getattr(ops.reduction(n.op), "composite", False) for n in group.nodes):
        got = group._cache["expanded"] = _shared_steps(group)
        return got
    b = ir.Builder()
    env = {v.id: b.input(v.kind, v.dtype, v.rank) for v in group.inputs}

    def arg(a):
        if isinstance(a, ir.Value):
            return env[a.id]
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        return a

    for n in group.nodes:
        args = [arg(a) for a in n.args]
        red = ops.reduction(n.op)
        if red is not None and red.composite:
            env[n.out.id] = _step(b, n, args)
        else:
            with b.steps_of(n.origin):
                env[n.out.id] = b.add(n.op, *args)
    got = group._cache["expanded"] = _shared_steps(b.build([env[v.id] for v in group.outputs]))
    return got


def _shared_steps(g: ir.Group) -> ir.Group:
    """``g`` with each step that repeats an earlier one (the same op and arguments, both steps of eager ops:
    ``Node.origin`` set, so both held unrounded) read from the earlier one, so that the kernel forms it once. A
    forward that writes a normalization's statistics forms them as steps beside the op's own
    (``fuser.backward.forward_group``); a backward recomputes a normalization's steps (``x - mean``, its product with
    rstd) and its gradient's formula forms them again (``fuser.backward``). A step of ``aten::std`` stays apart (the
    CPU kernel roots its variance in double: ``codegen.rooted_variances``), as do nodes that are no step, random
    ones, and a repeat where both are the group's outputs (each output its own value)."""
    seen: dict = {}
    same: dict[int, ir.Value] = {}
    outputs = {v.id for v in g.outputs}

    def arg(a):
        if isinstance(a, ir.Value):
            return same.get(a.id, a)
        return tuple(arg(x) for x in a) if isinstance(a, tuple) else a

    nodes = []
    for n in g.nodes:
        args = tuple(arg(a) for a in n.args)
        key = None
        if n.origin and not getattr(ops.of(n.op), "random", False):
            try:
                key = (n.op, args, n.origin if n.origin == "aten::std" else "")
                hash(key)
            except TypeError:
                key = None
        if key is not None and key in seen and not (n.out.id in outputs and seen[key].id in outputs):
            same[n.out.id] = seen[key]
            continue
        if key is not None:
            seen[key] = n.out
        nodes.append(n if args == n.args else ir.Node(n.op, args, n.out, n.origin))
    if not same:
        return g
    return ir.Group(g.inputs, tuple(nodes), tuple(same.get(v.id, v) for v in g.outputs))
