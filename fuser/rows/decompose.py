"""Normalizations as steps of the group IR: softmax, log_softmax and layer_norm written with reductions and
pointwise ops, built into an ``ir.Builder`` as steps of the eager op (``Node.origin``: held unrounded between
steps, as eager's one kernel computes them), so a front door that meets one emits these and the row kernel runs
it. Each returns the values eager's op returns."""
from __future__ import annotations

from typing import Optional, Sequence

from .. import ir


def _dims(dim: int) -> tuple:
    return (dim,)


def softmax(b: ir.Builder, x: ir.Value, dim: int) -> ir.Value:
    """``aten::softmax.int(x, dim)`` (no dtype argument): exp(x - max) over its sum."""
    with b.steps_of("aten::softmax"):
        m = b.add("aten::amax", x, _dims(dim), True)
        e = b.call("aten::exp", b.call("aten::sub", x, m, 1))
        return b.call("aten::div", e, b.add("aten::sum.dim_IntList", e, _dims(dim), True, None))


def log_softmax(b: ir.Builder, x: ir.Value, dim: int) -> ir.Value:
    """``aten::log_softmax.int(x, dim)`` (no dtype argument): (x - max) - log(sum(exp(x - max)))."""
    with b.steps_of("aten::log_softmax"):
        m = b.add("aten::amax", x, _dims(dim), True)
        d = b.call("aten::sub", x, m, 1)
        s = b.add("aten::sum.dim_IntList", b.call("aten::exp", d), _dims(dim), True, None)
        return b.call("aten::sub", d, b.call("aten::log", s), 1)


def layer_norm(b: ir.Builder, x: ir.Value, normalized_shape: Sequence[int], weight: Optional[ir.Value],
               bias: Optional[ir.Value], eps: float) -> ir.Value:
    """``aten::layer_norm``: (x - mean) * rsqrt(mean((x - mean)^2) + eps), times weight, plus bias (each when
    given), over the last ``len(normalized_shape)`` dims (eager checks they are ``normalized_shape``)."""
    dims = tuple(range(-len(normalized_shape), 0))
    with b.steps_of("aten::layer_norm"):
        mu = b.add("aten::mean.dim", x, dims, True, None)
        d = b.call("aten::sub", x, mu, 1)
        var = b.add("aten::mean.dim", b.call("aten::mul", d, d), dims, True, None)
        y = b.call("aten::mul", d, b.call("aten::rsqrt", b.call("aten::add", var, eps, 1)))
        if weight is not None:
            y = b.call("aten::mul", y, weight)
        if bias is not None:
            y = b.call("aten::add", y, bias, 1)
        return y
