"""The judge: a graph run as one fusion group against eager PyTorch (:func:`check`), with per-dtype
tolerances, a float64 reference and the excuses of :mod:`.edges`."""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

import torch

from .. import compiler, executor, fallback
from ..integration import register_graph
from ..kernel_cache import STORE
from .eager import eager_eval
from .edges import _dist, _eps, uncertainty
from .ir import parse_graph, render
from .program import Program


TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (2e-5, 2e-5),
       torch.float64: (1e-10, 1e-10)}


@dataclass
class Verdict:
    ok: bool
    kind: str  # ok | raises | count | dtype | shape | device | value | no_raise | raise_type | fused_raises | crash
    # | oom (the fused run found no room beside eager's outputs)
    detail: str = ""
    fused: bool = False
    reason: str = ""  # why it fell back
    judged: int = 0  # output elements judged (not excused as near a discontinuity)
    total: int = 0  # output elements
    finite: int = 0  # output elements that are finite in eager (integer and bool ones count as finite)


def _close(F: torch.Tensor, E: torch.Tensor, tol: tuple) -> torch.Tensor:
    """Elements equal within the tolerance (NaN where eager has NaN; infinities equal)."""
    if not E.dtype.is_floating_point:
        return F == E
    rtol, atol = tol
    e, f = E.double(), F.double()
    big = torch.finfo(E.dtype).max * (1 - 2 * rtol)
    ok = (f == e) | ((f - e).abs() <= atol + rtol * e.abs())
    ok |= f.isnan() & e.isnan()
    # at the edge of the dtype's range, inf and the largest finite values are alike
    ok |= (f.abs() >= big) & (e.abs() >= big) & (f.sign() == e.sign())
    return ok


def _closer(F: torch.Tensor, E: torch.Tensor, R: torch.Tensor, spread: torch.Tensor, tol: tuple) -> torch.Tensor:
    """(1-d tensors of the elements in question) the fused value is at least as close to the float64
    reference as eager's, within the dtype's tolerance plus twice the reference's ``spread`` (how far it moves
    when every intermediate is perturbed by a few units of rounding of its eager dtype: ill-conditioned
    outputs, sin of a huge computed argument say, differ between any two ways of rounding)."""
    rtol, atol = tol
    e, f, r = E.double(), F.double(), R.double()
    # the truth rounded to the output dtype is as right as the truth (90443 is inf in float16)
    dE, dF = _dist(e, r), torch.minimum(_dist(f, r), _dist(f, R.to(E.dtype).double()))
    tol = atol + rtol * torch.nan_to_num(r.abs(), nan=0.0, posinf=0.0) + 2 * spread
    # the fused value is the truth itself (say -inf where eager's stored intermediate made NaN): always as close
    closer = (dF == 0) | (dF <= 2 * dE + tol)
    # eager is NaN or infinite where the float64 truth is finite (e.g. a float16 intermediate overflowed in
    # eager but not in the fused float intermediate): the fused value must then be near the truth
    wild = torch.isinf(dE) & torch.isfinite(r)
    # a reference that moves past the dtype's largest value when the intermediates move by a few units of rounding:
    # any value, inf and NaN among them, is one rounding away (float16 (-0 - 5e-41) / 1e-40: eager's stored
    # intermediate is -0 and 1 / 1e-40 is inf, NaN; the fused float intermediate is -5e-41, -inf; the CUDA fuzzer)
    beyond = spread >= torch.finfo(E.dtype).max
    return torch.where(wild, dF <= 10 * tol + 1e-3 * r.abs(), closer) | beyond


def _wild(steps, ref_steps, out, shape, device) -> torch.Tensor:
    """Elements of output value ``out`` (of ``shape``) downstream (by broadcast) of a floating eager intermediate
    on its way that is infinite or NaN where its float64 reference is finite."""
    got = torch.zeros(shape, dtype=torch.bool, device=device)
    if ref_steps is None:
        return got
    index = {n.output().unique(): k for k, (n, _, _) in enumerate(steps)}
    upstream, todo = set(), [out.unique()]
    while todo:
        k = index.get(todo.pop())
        if k is not None and k not in upstream:
            upstream.add(k)
            todo.extend(v.unique() for v in steps[k][0].inputs())
    for k, ((_, val, _), (_, ref, _)) in enumerate(zip(steps, ref_steps)):
        if k not in upstream:
            continue
        if not (isinstance(val, torch.Tensor) and isinstance(ref, torch.Tensor) and val.is_floating_point()
                and ref.shape == val.shape):
            continue
        w = (~torch.isfinite(val) & torch.isfinite(ref.to(val.device))).to(device)
        try:
            got = got | torch.broadcast_to(w, shape)
        except RuntimeError:  # not of the output's shape: no element-wise tie to it
            continue
    return got


def _perturbation(dtype: torch.dtype) -> tuple:
    """(relative size, subnormal step) by which an intermediate of ``dtype`` is perturbed: 4 ulps either way."""
    fi = torch.finfo(dtype)
    return 4 * _eps(dtype), 4 * fi.smallest_normal * fi.eps


def _step_spreads(graph, args, steps, ref_steps) -> dict:
    """value unique -> a first-order bound of how far each floating value of the float64 reference (intermediates
    and outputs) moves when the intermediates before it move by 4 ulps of their eager dtype (``steps``): each
    intermediate perturbed alone, both ways, and the moves summed. (Random joint perturbations could cancel:
    fmod(a / b, erf(a)) hardly moves when a / b and erf(a) move together.)"""
    if ref_steps is None:
        return {}
    sizes = [_perturbation(v.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else (0.0, 0.0)
             for _, v, _ in steps]
    gen = torch.Generator().manual_seed(4321)
    out: dict = {}
    for j, size in enumerate(sizes):
        if not size[0]:
            continue
        moved: dict = {}
        for sign in (1.0, -1.0):
            alone = [(sign * sz[0], sign * sz[1]) if k == j else (0.0, 0.0) for k, sz in enumerate(sizes)]
            try:
                p_steps, _ = eager_eval(graph, args, upcast=True, perturb=(alone, gen, True))
            except Exception:  # noqa: BLE001
                continue
            for (n, p, _), (_, r, _) in zip(p_steps, ref_steps):
                if isinstance(p, torch.Tensor) and isinstance(r, torch.Tensor) and p.is_floating_point() \
                        and p.shape == r.shape:
                    d = _dist(p.double(), r.double())
                    u = n.output().unique()
                    moved[u] = d if u not in moved else torch.maximum(moved[u], d)
        for u, d in moved.items():
            out[u] = d if u not in out else out[u] + d
    return out


def _weakest_dtypes(graph, args, steps) -> dict:
    """value unique -> the least precise floating dtype on its way from the inputs: a float32 intermediate
    promoted to a float64 output carries float32 rounding (libm's coshf and eager's differ in the last float32
    bit), so the output is judged at float32 tolerance."""
    weak: dict = {}

    def looser(a, b):
        return b if a is None or (b is not None and TOL[b][0] > TOL[a][0]) else a
    for v, a in zip(graph.inputs(), args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            weak[v.unique()] = a.dtype
    for n, val, _ in steps:
        t = None
        for v in n.inputs():
            t = looser(t, weak.get(v.unique()))
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            t = looser(t, val.dtype)
        if t is not None:
            weak[n.output().unique()] = t
    return weak


def _fallback_reason(spec, args) -> str:
    p = executor.plan(spec, args)
    if isinstance(p, str):
        return "plan: " + re.sub(r"\d+", "N", p.split(":")[0])[:80]
    try:
        types = compiler.infer_types(spec, p.arg_spec)
    except Exception:  # noqa: BLE001
        return "eager rejects the dtypes"
    from ..descs import DTYPES
    if any(t.result not in DTYPES or t.compute not in DTYPES for t in types):
        return "unsupported intermediate dtype"
    return "codegen: not fusable (no integer expression)"


def _no_room(exc: BaseException, e_outs: list) -> bool:
    """The fused run ran out of CUDA memory where eager's outputs, which the judge still holds, take half the
    device or more (a broadcast in a generated graph can make an output of 10^10 elements): eager's own run would
    find no room beside them either."""
    if not isinstance(exc, torch.OutOfMemoryError):
        return False
    held = [E for E in e_outs or () if isinstance(E, torch.Tensor) and E.is_cuda]
    if not held:
        return False
    total = torch.cuda.get_device_properties(held[0].device).total_memory
    return 2 * sum(E.numel() * E.element_size() for E in held) >= total


def check(graph: torch._C.Graph, args: list, device=None) -> Verdict:
    """Run ``graph`` as one fusion group on ``args`` and judge it against eager PyTorch."""
    e_exc = steps = e_outs = None
    try:
        steps, e_outs = eager_eval(graph, args)
    except Exception as ex:  # noqa: BLE001
        e_exc = ex
    f_exc, fused, reason, f_outs = None, False, "", None
    try:
        spec = STORE.get(register_graph(graph))
        f_outs = executor.run(spec, args)
        fused = f_outs is not None
        if not fused:
            reason = _fallback_reason(spec, args)
            f_outs = fallback.run(spec, args)
    except Exception as ex:  # noqa: BLE001
        f_exc = ex
    if e_exc is not None:
        if f_exc is None:
            return Verdict(False, "no_raise", f"eager raised {type(e_exc).__name__}: {str(e_exc)[:300]}; "
                           "the fused path returned", fused, reason)
        if not isinstance(f_exc, type(e_exc)):
            return Verdict(False, "raise_type", f"eager raised {type(e_exc).__name__}: {str(e_exc)[:300]}; "
                           f"fused raised {type(f_exc).__name__}: {str(f_exc)[:300]}", fused, reason)
        return Verdict(True, "raises", type(e_exc).__name__, fused, reason or "eager raises")
    if f_exc is not None and _no_room(f_exc, e_outs):
        return Verdict(True, "oom", str(f_exc)[:300], fused, reason or "out of device memory beside eager's outputs")
    if f_exc is not None:
        return Verdict(False, "fused_raises", "".join(traceback.format_exception_only(type(f_exc), f_exc))[-3000:],
                       fused, reason)
    if len(f_outs) != len(e_outs):
        return Verdict(False, "count", f"{len(f_outs)} outputs, eager {len(e_outs)}", fused, reason)
    device = device or next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    outs = list(graph.outputs())
    weak = _weakest_dtypes(graph, args, steps)
    tols = {u: TOL[d] for u, d in weak.items()}
    total = sum(E.numel() for E in e_outs)
    finite = sum(int(torch.isfinite(E).sum()) if E.dtype.is_floating_point else E.numel() for E in e_outs)
    differ = []
    for k, (v, F, E) in enumerate(zip(outs, f_outs, e_outs)):
        where = f"output {k} (%{v.debugName()})"
        if F.dtype != E.dtype:
            return Verdict(False, "dtype", f"{where}: dtype {F.dtype}, eager {E.dtype}", fused, reason)
        if F.shape != E.shape:
            return Verdict(False, "shape", f"{where}: shape {tuple(F.shape)}, eager {tuple(E.shape)}", fused, reason)
        if F.device != E.device:
            return Verdict(False, "device", f"{where}: device {F.device}, eager {E.device}", fused, reason)
        ok = _close(F, E, tols.get(v.unique(), TOL.get(E.dtype, (0.0, 0.0))))
        if not bool(ok.all()):
            differ.append((k, ~ok))
    if not differ:
        return Verdict(True, "ok", "", fused, reason, total, total, finite)
    # some elements differ beyond tolerance: judge them against the float64 reference, and excuse those
    # downstream of a discontinuity at a computed value
    try:
        ref_steps, r_outs = eager_eval(graph, args, upcast=True)
        if len(ref_steps) != len(steps):
            ref_steps = r_outs = None
    except Exception:  # noqa: BLE001
        ref_steps = r_outs = None
    step_spreads = _step_spreads(graph, args, steps, ref_steps)
    masks = uncertainty(steps, ref_steps, device, weak, step_spreads)
    spreads = {k: step_spreads.get(outs[k].unique(), torch.zeros(r_outs[k].shape, dtype=torch.float64,
                                                               device=r_outs[k].device))
               for k, _ in differ} if r_outs is not None else {}
    excused = 0
    for k, off in differ:
        v, F, E = outs[k], f_outs[k], e_outs[k]
        mask = masks.get(v.unique())
        bad = off if mask is None else off & ~mask
        if mask is not None:
            excused += int((off & mask).sum())
        R = r_outs[k] if r_outs is not None and r_outs[k].shape == E.shape else None
        if E.dtype.is_floating_point and R is not None and bool(bad.any()):
            flat = bad.reshape(-1).nonzero().reshape(-1)
            still = ~_closer(F.reshape(-1)[flat], E.reshape(-1)[flat], R.reshape(-1)[flat],
                             spreads[k].reshape(-1)[flat], tols.get(v.unique(), TOL[E.dtype]))
            bad = torch.zeros(bad.numel(), dtype=torch.bool, device=bad.device)
            bad[flat[still]] = True
            bad = bad.reshape(E.shape)
        if not E.dtype.is_floating_point and R is not None and bool(bad.any()):
            # a bool or integer output where eager's float16/bfloat16 intermediate overflowed (inf or NaN where
            # the float64 truth is finite) and the fused float intermediate did not: the fused value must then be
            # the truth's (mish of an overflowed product compared with itself, the CUDA fuzzer)
            bad = bad & ~((F == R.to(F.dtype)) & _wild(steps, ref_steps, v, E.shape, F.device))
        if bool(bad.any()):
            rows = []
            for i in bad.nonzero()[:6].tolist():
                i = tuple(i)
                r = R[i].item() if R is not None else None
                s = spreads[k][i].item() if k in spreads else None
                rows.append(f"    at {list(i)}: fused {F[i].item()!r}, eager {E[i].item()!r}, float64 ref {r!r}"
                            + (f" (spread {s:.3g})" if s is not None else ""))
            return Verdict(False, "value", f"output {k} (%{v.debugName()}) {E.dtype}: {int(bad.sum())} of "
                           f"{E.numel()} elements differ\n" + "\n".join(rows), fused, reason, total - excused, total,
                           finite)
    return Verdict(True, "ok", "", fused, reason, total - excused, total, finite)


def check_program(p: Program, device="cpu") -> Verdict:
    return check(parse_graph(render(p)), p.args(device), torch.device(device))
