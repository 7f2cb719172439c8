"""Which output elements the judge excuses: those downstream of a discontinuity (a comparison, rounding,
fmod, a domain edge, ...) whose argument is a computed value within its error margin of the edge."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import ops


def _dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float64, 0 where equal (infinities too) or both NaN, inf where only one is NaN."""
    d = (a - b).abs()
    same = (a == b) | (a.isnan() & b.isnan())
    d = torch.where(same, torch.zeros_like(d), d)
    return torch.where(d.isnan(), torch.full_like(d, math.inf), d)


def _as64(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float64)
    return torch.tensor(float(x), dtype=torch.float64, device=device)


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _dist_int(a: torch.Tensor) -> torch.Tensor:
    return (a - torch.round(a)).abs()


_ROUNDING = {"floor", "ceil", "trunc", "frac"}
_ZERO_EDGE = {"sqrt", "rsqrt", "log", "log2", "log10", "reciprocal"}


def _near_edge(name: str, E: list, M: list, out_dtype: torch.dtype, in_dtypes: list) -> Optional[torch.Tensor]:
    """Where the op's result may jump for an argument within its margin ``M`` of the eager value ``E`` (both
    float64 tensors per input; margin 0 for inputs and constants, so exact inputs are never excused)."""
    def pos(m):
        return m > 0
    A, mA = E[0], M[0]
    if name in _ROUNDING:
        return pos(mA) & (_dist_int(A) <= mA)
    if name == "round":
        return pos(mA) & ((A - torch.floor(A) - 0.5).abs() <= mA)
    if name in _ZERO_EDGE:
        return pos(mA) & (A.abs() <= mA)
    if name == "log1p":
        return pos(mA) & ((A + 1).abs() <= mA)
    if name in ("acos", "asin"):
        return pos(mA) & ((A.abs() - 1).abs() <= mA)
    if name == "lgamma":
        return pos(mA) & (A <= mA) & (_dist_int(A) <= mA)
    if name in ("sinh", "cosh") and out_dtype.is_floating_point:
        # eager's vectorized sinh/cosh overflow early, as exp(|x|) / 2 (inf for 88.72 < |x| < 89.42 in
        # float32, while its own scalar path and libm are finite there): eager disagrees with itself
        big = math.log(torch.finfo(torch.float64 if out_dtype == torch.float64 else torch.float32).max)
        return torch.isfinite(A) & (A.abs() >= big - 0.01) & (A.abs() <= big + math.log(2) + 0.01)
    if name in ("sin", "cos", "tan"):
        # a computed argument known to less than about a radian (sin of 1e29 say): any value is right
        chaos = pos(mA) & (mA >= 0.5)
        if name == "tan":
            return chaos | (pos(mA) & (_dist_int(A / math.pi - 0.5) * math.pi <= mA))
        return chaos
    if name in ("eq", "ne", "ge", "gt", "le", "lt"):
        B, mB = E[1], M[1]
        m = mA + mB
        return pos(m) & (_dist(A, B) <= m)  # inf == inf counts as a tie
    if name == "threshold":
        return pos(mA) & (_dist(A, E[1]) <= mA)
    if name == "softplus":  # x * beta > threshold takes x itself
        return pos(mA) & (_dist(A * E[1], E[2]) <= mA * E[1].abs())
    if name == "div":
        B, mB = E[1], M[1]
        return pos(mB) & (B.abs() <= mB)
    if name in ("fmod", "remainder"):
        B, mB = E[1], M[1]
        q = A / B
        edge = _dist_int(q) * B.abs() <= mA + q.abs() * mB
        near = (pos(mA) | pos(mB)) & (edge | (B.abs() <= mB))
        if out_dtype.is_floating_point:
            # eager's vectorized fmod/remainder compute a - b * trunc(a / b) (floor for remainder): NaN where
            # the quotient overflows and inexact where it has more digits than the dtype, while its scalar tail
            # (and libm, which the fused kernel uses) is exact, so eager disagrees with itself there
            digits = 53 if out_dtype == torch.float64 else 24
            near = near | (torch.isfinite(A) & (B != 0) & (q.abs() >= 2.0 ** digits))
        return near
    if name == "atan2":
        B, mB = E[1], M[1]
        return pos(mA) & (A.abs() <= mA) & (B <= mB)
    if name in ("pow", "pow_scalar"):
        B, mB = E[1], M[1]
        nan_edge = pos(mB) & (A <= mA) & (_dist_int(B) <= mB)
        if name == "pow_scalar":  # a Python exponent: ambiguous only if its conversion can land on an integer
            nan_edge &= _dist_int(B) > 0
        zero_edge = pos(mA) & (A.abs() <= mA) & (B <= mB)
        # an infinite exponent jumps at |base| = 1: pow(0.99999994, inf) is 0, pow(1, inf) is 1 (tan(pi/4) is
        # one or the other by libm; fuzzer)
        one_edge = pos(mA) & B.isinf() & ((A.abs() - 1).abs() <= mA)
        return nan_edge | zero_edge | one_edge
    if name == "type_as" and not out_dtype.is_floating_point and in_dtypes[0].is_floating_point:
        if out_dtype == torch.bool:
            return pos(mA) & (A.abs() <= mA)
        info = torch.iinfo(out_dtype)
        # float -> integer conversion of NaN, inf or out-of-range values is undefined (in eager too)
        ub = ~torch.isfinite(A) | (A <= float(info.min) - 1) | (A >= float(info.max) + 1)
        return ub | (pos(mA) & (_dist_int(A) <= mA))
    return None


_COMPARISONS = {"eq", "ne", "ge", "gt", "le", "lt"}
_ZERO_TIE_OPS = {"maximum", "minimum", "clamp", "clamp_min", "clamp_max", "clamp_tensor", "clamp_min_tensor",
                 "clamp_max_tensor"}
# ops whose Python-scalar arguments fuser rounds exactly as eager does (``OpDef.round_operands``): judged exactly
_EXACT_SCALAR_OPS = _COMPARISONS | {"threshold", "softplus"}
_EDGE_OPS = _ROUNDING | _ZERO_EDGE | _ZERO_TIE_OPS | {"round", "log1p", "acos", "asin", "lgamma", "sin", "cos", "tan", "sinh",
                                     "cosh", "eq", "ne",
                                     "ge", "gt", "le", "lt", "threshold", "div", "fmod", "remainder", "atan2",
                                     "pow", "pow_scalar", "type_as", "softplus"}


# ops computed as x * f(x) with f bounded (the CDF in gelu, the sigmoid in silu): f's absolute rounding error,
# not the result's size, sets how far two libms' results may lie apart (gelu(-7) is 0 in one and -4e-16 in another)
_TIMES_BOUNDED = {"gelu", "silu"}


def uncertainty(steps, ref_steps, device, weak: Optional[dict] = None, spreads: Optional[dict] = None) -> dict:
    """value unique -> bool mask of elements that may legitimately differ between fused and eager (None: none).

    An element is excused when it depends on an op at a discontinuity (see :func:`_near_edge`) whose computed
    argument lies within its margin of the edge. A computed value's margin is 4x its distance from the float64
    reference plus 4 ulps of the least precise dtype on its way (``weak``): the fused kernel's value (float
    intermediates for half dtypes, libm instead of eager's vectorized math) is within about that of eager's;
    plus twice how far it moves when the intermediates before it move by 4 ulps (``spreads``, from
    :func:`_step_spreads`): for float64 graphs the reference is eager itself, and an ill-conditioned op
    (pow(1e-40, y) multiplies y's rounding by 90) turns a 1-ulp libm difference upstream into many ulps.
    """
    masks: dict[int, Optional[torch.Tensor]] = {}
    index = {n.output().unique(): k for k, (n, _, _) in enumerate(steps)}
    margins: dict[int, torch.Tensor] = {}
    zero = torch.zeros((), dtype=torch.float64, device=device)

    def margin(u: int) -> torch.Tensor:
        m = margins.get(u)
        if m is None:
            k = index.get(u)
            if k is None:
                return zero  # a graph input or a constant: exact in both
            val = steps[k][1]
            e = _as64(val, device)
            err = _dist(e, _as64(ref_steps[k][1], device)) if ref_steps is not None else torch.zeros_like(e)
            scale = torch.nan_to_num(e.abs(), nan=0.0, posinf=math.inf)
            dt = (weak or {}).get(u, val.dtype)
            # no absolute floor: a value eager computes exactly (err 0), a zero from relu say, must come out of
            # the fused kernel exactly, sign of zero included
            m = 4 * err + 4 * _eps(dt) * scale
            if spreads is not None and u in spreads and spreads[u].shape == m.shape:
                m = m + 2 * spreads[u]
            node, _, ins = steps[k]
            op = ops.lookup(node.schema())
            if op is not None and op.name in _TIMES_BOUNDED and isinstance(ins[0], torch.Tensor):
                m = m + 4 * _eps(dt) * torch.nan_to_num(_as64(ins[0], device).abs(), nan=0.0, posinf=math.inf)
            margins[u] = m
        return m

    for k, (n, val, ins) in enumerate(steps):
        mask = None
        for v in n.inputs():
            mk = masks.get(v.unique())
            if mk is not None:
                mask = mk if mask is None else (mask | mk)
        if mask is not None and n.kind() == "aten::permute" and isinstance(ins[0], torch.Tensor):
            # a permute moves its input's uncertain elements with the rest (the generator's view after a group)
            mask = torch.broadcast_to(mask, ins[0].shape).permute(list(ins[1]))
        op = ops.lookup(n.schema())
        name = op.name if op is not None else ""
        if isinstance(val, torch.Tensor) and name in _EDGE_OPS:
            in_ids = [v.unique() for v in n.inputs()]
            same = len(in_ids) > 1 and in_ids[0] == in_ids[1] and name in _COMPARISONS
            E, M, in_dtypes = [], [], []
            for i, (u, x) in enumerate(zip(in_ids, ins)):
                if isinstance(x, torch.Tensor):
                    in_dtypes.append(x.dtype)
                elif isinstance(x, (int, float)) and not isinstance(x, bool):
                    in_dtypes.append(torch.float64 if isinstance(x, float) else torch.int64)
                else:
                    in_dtypes.append(None)
                if x is None or isinstance(x, str):
                    E.append(None)
                    M.append(None)
                    continue
                E.append(_as64(x, device))
                # the same value on both sides of a comparison (eq(x, x)): the fused kernel computes it once,
                # so its rounding cannot move one side against the other
                if same and i < 2:
                    M.append(zero)
                elif isinstance(x, float) and name not in _EXACT_SCALAR_OPS and val.is_floating_point():
                    # a Python float argument is converted to the op's compute type (float32 for half dtypes
                    # on the CPU, the half dtype itself in some CUDA kernels): fmod(x, 1/3) depends on which
                    M.append(torch.tensor(4 * _eps(val.dtype) * abs(x) if math.isfinite(x) else 0.0,
                                          dtype=torch.float64, device=device))
                else:
                    M.append(margin(u))
            near = _near_edge(name, E, M, val.dtype, in_dtypes)
            if name in _ZERO_TIE_OPS and val.is_floating_point():
                # +0 vs -0 ties: eager's scalar path returns the first operand and its vector path the second
                # (maximum, minimum, and clamps with tensor bounds), so the sign of such a zero is unspecified
                for i in (1, 2):
                    if i < len(ins) and isinstance(ins[i], torch.Tensor) and isinstance(ins[0], torch.Tensor):
                        tie = (E[0] == 0) & (E[i] == 0)
                        near = tie if near is None else (near | tie)
            if near is not None and bool(near.any()):
                mask = near if mask is None else (mask | near)
        if mask is not None and isinstance(val, torch.Tensor):
            if mask.dim() == val.dim() and any(m != v and v == 1 for m, v in zip(mask.shape, val.shape)):
                # a reduction with keepdim: an uncertain element makes its whole row's result uncertain
                dims = [d for d, (m, v) in enumerate(zip(mask.shape, val.shape)) if m != v and v == 1]
                mask = mask.any(dim=dims[0], keepdim=True) if len(dims) == 1 else mask.flatten(dims[0]).any(
                    dim=dims[0], keepdim=True).reshape([1 if d in dims else s for d, s in enumerate(mask.shape)])
            elif mask.dim() > val.dim() or (mask.dim() == val.dim() and mask.shape != val.shape and any(
                    m != v and m != 1 for m, v in zip(mask.shape, val.shape))):
                mask = mask.any().expand(val.shape)  # a reduction without keepdim: the row is unknown
            mask = torch.broadcast_to(mask, val.shape)
        masks[n.output().unique()] = mask
    return masks
