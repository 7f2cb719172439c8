"""Eager PyTorch op by op, straight from a graph: the judge's reference (as is, upcast to float64, or with
perturbed intermediates)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops


def _resolve(node: torch._C.Node):
    s = torch._C.parse_schema(node.schema())
    fn = getattr(getattr(torch.ops.aten, s.name.split("::")[1]), s.overload_name or "default")
    return s, fn


def _accumulated(s, pos: list) -> Optional[torch.Tensor]:
    """For a sum or mean (schema ``s``, positional arguments ``pos``): the sum of its terms' magnitudes (over the
    count, for a mean), the scale of the rounding its accumulator adds, whatever the order of the additions (which
    differs between kernels: a row of terms that cancel to a small sum moves by units of the largest partial sum);
    None for other ops."""
    name = s.name + ("." + s.overload_name if s.overload_name else "")
    red = ops.reduction(name)
    x = pos[0] if pos else None
    if red is None or red.kind not in ("sum", "mean") or not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    dims = ops.reduced_dims(name, pos)
    dims = tuple(range(x.dim())) if dims is None else dims
    mag = x.double().abs().sum(dims, keepdim=bool(pos[2]))
    return mag / max(1, x.numel() // max(1, mag.numel())) if red.mean else mag


def eager_eval(graph: torch._C.Graph, args, upcast: bool = False, perturb=None):
    """Run ``graph`` op by op through ``torch.ops.aten``. Returns (per non-constant node: (node, its value,
    its inputs' values), outputs). ``upcast``: floating tensors (inputs and tensor constants) in float64.
    ``perturb``: (per non-constant node, a relative size or 0; a torch.Generator): each floating node result is
    multiplied by 1 +- size (a random sign per element), to measure how much rounding of intermediates moves
    the outputs. (A uniform factor in [-1, 1] underestimated it: remainder(x, atan2(b, b)) turns atan2's 1-ulp
    libm difference into about 6000 ulps of the result for x near 5000, and three uniform draws missed that.)"""
    env = {}
    for v, a in zip(graph.inputs(), args):
        if upcast and isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.double()
        env[v.unique()] = a
    steps = []
    for n in graph.nodes():
        if n.kind() == "prim::Constant":
            val = n.output().toIValue()
            if upcast and isinstance(val, torch.Tensor) and val.is_floating_point():
                val = val.double()
            env[n.output().unique()] = val
            continue
        s, fn = _resolve(n)
        pos, kw, ins = [], {}, []
        for a, v in zip(s.arguments, n.inputs()):
            val = env[v.unique()]
            ins.append(val)
            if a.kwarg_only:
                kw[a.name] = val
            else:
                pos.append(val)
        r = fn(*pos, **kw)
        if upcast and isinstance(r, torch.Tensor) and r.is_floating_point() and r.dtype != torch.float64:
            r = r.double()  # a float32 result of integer inputs (sinh of an int16 tensor)
        if perturb is not None and isinstance(r, torch.Tensor) and r.is_floating_point():
            size, sub = perturb[0][len(steps)]
            if size:
                if len(perturb) > 2:  # one sign for every element (the size carries it)
                    u = torch.ones((), dtype=torch.float64, device=r.device)
                else:
                    u = (torch.rand(r.shape, generator=perturb[1]) < 0.5).to(device=r.device, dtype=torch.float64) * 2 - 1
                # a nonzero subnormal rounds in steps of the smallest subnormal, not relative ones (erfc(10) is 1 or
                # 2 such steps in float32 depending on the libm); zeros stay exact
                step = torch.where((r != 0) & (r.abs() < abs(sub / size)), sub, 0.0) if sub else 0.0
                acc = _accumulated(s, pos)
                r = (r * (1 + size * u) + u * step + (0.0 if acc is None else size * u * acc)).to(r.dtype)
        env[n.output().unique()] = r
        steps.append((n, r, ins))
    return steps, [env[v.unique()] for v in graph.outputs()]
