"""Chains of multiplications differentiated as one product (a monomial), for ``fuser/backward.py``.

Op by op, the gradient of ``0.044715 * y * y * y`` is three product-rule terms, each a chain of multiplications by
the chain's other values (eager's autograd forms them so: ten kernel steps where one product of four would do).
A backward kernel recomputes and differentiates every element, so those steps are its instructions: GELU's
backward on a GPU was bound by them, not by its bytes. Here a chain of ``mul`` nodes whose intermediate results
nothing else reads is taken as one product ``c * x1^e1 * ... * xn^en`` (``c`` the product of its number
arguments), and each factor's gradient is formed directly: ``g * (the other factors) * (c * e_i)``.

The values differ from eager's op-by-op sum only by rounding (the terms' sum is one product here), well inside a
dtype's tolerance; the factors a gradient multiplies are the same as in eager's terms, so zeros, infinities and
NaNs meet as they do there. A chain is folded only where its numbers' product is a finite normal float32 (no
overflow or underflow that multiplying them one by one would not have) and it saves steps: it absorbs a ``mul``
node or repeats a factor. Groups with reductions keep the op-by-op form (a row-level factor's gradient is summed
along the row per node there).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from . import ir

MULS = frozenset(("aten::mul.Tensor", "aten::mul.Scalar"))
_FLOAT32_MAX, _FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


@dataclass(frozen=True)
class Product:
    """A root ``mul`` node's value as ``coefficient * prod(f ** e for f, e in factors)``: ``factors`` are graph
    values or tensor constants in the order the chain first reads them."""

    coefficient: float
    factors: tuple[tuple[object, int], ...]


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _foldable(n: ir.Node) -> bool:
    return n.op in MULS and all(isinstance(a, (ir.Value, ir.TensorConst)) or _number(a) for a in n.args)


def find(fwd: ir.Group, floating: frozenset) -> dict[int, Product]:
    """The products of ``fwd`` worth folding, by the id of their root node's output. An intermediate of a chain is
    a floating ``mul`` result read once, by another floating ``mul`` node, and not a group output."""
    uses = Counter(v.id for n in fwd.nodes for v in n.values)
    uses.update(v.id for v in fwd.outputs)
    user = {v.id: n for n in fwd.nodes for v in n.values}
    absorbed = set()
    for n in fwd.nodes:
        u = user.get(n.out.id)
        if (_foldable(n) and n.out.id in floating and uses[n.out.id] == 1 and u is not None and _foldable(u)
                and u.out.id in floating):
            absorbed.add(n.out.id)

    def flatten(n: ir.Node, factors: dict, numbers: list) -> int:
        steps = 0
        for a in n.args:
            p = fwd.producer(a) if isinstance(a, ir.Value) else None
            if p is not None and a.id in absorbed:
                steps += 1 + flatten(p, factors, numbers)
            elif _number(a):
                numbers.append(a)
            else:
                key = a.id if isinstance(a, ir.Value) else ("const", id(a))
                f, e = factors.get(key, (a, 0))
                factors[key] = (f, e + 1)
        return steps

    found = {}
    for n in fwd.nodes:
        if not _foldable(n) or n.out.id in absorbed or n.out.id not in floating:
            continue
        factors: dict = {}
        numbers: list = []
        steps = flatten(n, factors, numbers)
        coefficient = math.prod(numbers)
        repeated = any(e > 1 for _, e in factors.values())
        if (steps or repeated) and _finite_normal(numbers, coefficient, factors):
            found[n.out.id] = Product(coefficient, tuple(factors.values()))
    return found


def _finite_normal(numbers: list, coefficient, factors: dict) -> bool:
    """Every number, and the coefficient times each exponent, a finite float32 of normal magnitude (or 1)."""
    ks = [coefficient * e for _, e in factors.values()] + numbers
    return all(k == 1 or (math.isfinite(k) and _FLOAT32_TINY <= abs(k) <= _FLOAT32_MAX) for k in ks)


def gradients(p: Product, g, value: Callable, wanted: Callable[[object], bool]) -> list[tuple[object, object]]:
    """(factor, its gradient) for each graph-value factor of ``p`` that ``wanted`` names: ``g`` times the other
    factors (this one's exponent less one times) times ``coefficient * exponent``. ``value(f)`` is the
    backward's value of factor ``f`` (a :class:`fuser.derivatives.V`), ``g`` the product's gradient."""
    out = []
    for i, (f, e) in enumerate(p.factors):
        if not isinstance(f, ir.Value) or not wanted(f):
            continue
        r = g
        for j, (h, k) in enumerate(p.factors):
            for _ in range(k - 1 if j == i else k):
                r = r * value(h)
        scale = p.coefficient * e
        out.append((f, r if scale == 1 else r * scale))
    return out

