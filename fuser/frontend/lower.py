"""Lowering: a finished definition's records -> one ``ir.Group`` and the plans that feed it.

nvFuser's ``broadcast_in_dim`` has no op in the group IR. A value is lowered under a *view*: the rank it is
wanted at, where its own dims go, and the sizes its new dims are expanded to. Views travel from a broadcast
down to the inputs of its cone: each input gets its own view (``unsqueeze`` + ``expand``, made at execute: a
stride-0 view, no copy), one group input per (tensor, view), and the pointwise ops in between run at the
broadcast shape. A reduction in the cone is computed once at its own shape (its input is not expanded); its
result then has size 1 where the broadcast is wider, which the pointwise ops after it broadcast like eager.
A random op under a broadcast would draw numbers per element where nvFuser repeats one: refused. Outputs whose
computed value is still narrower than the definition says are expanded (as views) after the run.

Dtypes: each op's operands are cast to nvFuser's compute dtype first (``aten::_to_copy``, which fuses), and
the result's eager dtype is checked against the definition's; a cast fixes any difference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import ir
from ..fallback import _overload
from .datatype import SCALAR_TYPE_CODE, DataType, category
from .handles import Tensor

View = tuple  # (rank R, pos: tuple (target dim of each own dim), exp: tuple of R (extent or None))


class LoweringError(NotImplementedError):
    pass


@dataclass(frozen=True)
class LV:
    value: object  # ir.Value (a tensor or a float input)
    dtype: Optional[DataType]  # None: a float input
    phys: tuple  # the value's sizes as computed (extents), its own rank


def identity(rank: int) -> View:
    return (rank, tuple(range(rank)), (None,) * rank)


def canonical(view: View) -> View:
    """Leading dims that are neither the value's own nor expanded add nothing under trailing broadcasting."""
    r, pos, exp = view
    k = 0
    while k < r and k not in pos and exp[k] is None:
        k += 1
    return (r - k, tuple(p - k for p in pos), exp[k:]) if k else view


def logical(t: Tensor, view: View) -> tuple:
    r, pos, exp = view
    out = [1 if e is None else e for e in exp]
    for i, p in enumerate(pos):
        if exp[p] is None:
            out[p] = t.extents[i]
    return tuple(out)


def broadcast_phys(shapes) -> tuple:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(rank):
        cur = 1
        for s in shapes:
            k = d - (rank - len(s))
            if k < 0 or s[k] == 1:
                continue
            if cur == 1 or (isinstance(s[k], int) and not isinstance(cur, int)):
                cur = s[k]
        out.append(cur)
    return tuple(out)


def _py(value, dt: DataType):
    t = dt.torch_dtype
    if t == torch.bool:
        return bool(value)
    if t.is_complex:
        return complex(value)
    if t.is_floating_point:
        return float(value)
    return int(value)


class Lowerer:
    def __init__(self, handles: dict, producers: dict, input_order: list):
        self.h = handles  # index -> handle
        self.producers = producers  # tensor index -> (record, output position)
        self.input_order = input_order  # handles of the inputs, in execute order
        self.ordinal = {h.index: k for k, h in enumerate(input_order)}
        self.b = ir.Builder()
        self.in_plans: list = []  # per group input: ("tensor", ordinal, view) | ("scalar", ordinal) | ("carrier", ext, dt)
        self._memo: dict = {}
        self._inputs: dict = {}
        self._casts: dict = {}
        self._ranks: dict = {}  # value id -> rank (a node's out Value does not carry one)

    def _mk(self, value, dtype, phys) -> LV:
        self._ranks[value.id] = len(phys)
        return LV(value, dtype, tuple(phys))

    # ---- inputs ------------------------------------------------------------------------------------------
    def _tensor_input(self, t: Tensor, view: View) -> LV:
        key = ("in", t.index, view)
        got = self._inputs.get(key)
        if got is None:
            v = self.b.input(ir.TENSOR, t.dtype.torch_dtype, view[0])
            self.in_plans.append(("tensor", self.ordinal[t.index], view))
            got = self._inputs[key] = self._mk(v, t.dtype, logical(t, view))
        return got

    def _scalar_input(self, index: int, op: str, comp: DataType) -> LV:
        s = self.h[index]
        if category(comp) < 2 or category(s.dtype) == 3:
            raise LoweringError(f"fd.ops.{op}: the symbolic {s.dtype} scalar S{index} meets {comp} values; symbolic "
                                "scalars are float arguments of the kernel, so only floating-point ops take them "
                                "(not supported yet: use a constant, or cast the tensor to a floating type)")
        key = ("scalar", index)
        got = self._inputs.get(key)
        if got is None:
            v = self.b.input(ir.FLOAT)
            self.in_plans.append(("scalar", self.ordinal[index]))
            got = self._inputs[key] = self._mk(v, None, ())
        return got

    # ---- values ------------------------------------------------------------------------------------------
    def tensor(self, index: int, view: Optional[View] = None) -> LV:
        t = self.h[index]
        view = canonical(identity(t.ndim) if view is None else view)
        key = (index, view)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._lower(t, view)
        return got

    def _lower(self, t: Tensor, view: View) -> LV:
        if t.index in self.ordinal:
            return self._tensor_input(t, view)
        rec, k = self.producers[t.index]
        plan = rec.plan
        kind = plan[0]
        if kind == "node":
            return self._node(rec.name, t, view, *plan[1:])
        if kind == "cast":
            return self.cast(self.tensor(plan[1], view), plan[2])
        if kind == "bcast":
            return self._bcast(t, view, *plan[1:])
        if kind == "reduce":
            return self._reduce(rec.name, t, view, k, *plan[1:])
        if kind == "rand_like":
            return self._rand_like(t, view, plan[1])
        if kind == "uniform":
            return self._uniform(t, view, *plan[1:])
        raise AssertionError(f"no lowering for {rec.name}")

    def cast(self, lv: LV, dt: DataType) -> LV:
        if lv.dtype is dt:
            return lv
        key = (lv.value.id, dt.name)
        got = self._casts.get(key)
        if got is None:
            v = self.b.add("aten::_to_copy", lv.value, SCALAR_TYPE_CODE[dt.torch_dtype], None, None, None, False, None,
                           dtype=dt.torch_dtype)
            got = self._casts[key] = self._mk(v, dt, lv.phys)
        return got

    def _operand_view(self, t: Tensor, view: View, operand: Tensor) -> View:
        r, pos, exp = view
        off = t.ndim - operand.ndim
        return (r, tuple(pos[off + i] for i in range(operand.ndim)), exp)

    def _node(self, op: str, t: Tensor, view: View, aten: str, specs: tuple, comp: DataType, out_dt: DataType,
              swapped: Optional[str], raw: tuple) -> LV:
        where = aten == "aten::where"
        branch_tensors = any(s[0] == "T" for s in (specs[1:] if where else specs))
        args, lvs = [], []
        for i, s in enumerate(specs):
            if s[0] == "T":
                lv = self.tensor(s[1], self._operand_view(t, view, self.h[s[1]]))
                if not (where and i == 0):
                    lv = self.cast(lv, comp)
                lvs.append(lv)
                args.append(lv.value)
            elif s[0] == "S":
                lvs.append(self._scalar_input(s[1], op, comp))
                args.append(lvs[-1].value)
            else:
                value = _py(s[1], comp)
                args.append(ir.TensorConst(comp.torch_dtype, (), (value,)) if where and not branch_tensors else value)
        extra = []
        for s in raw:
            if s[0] == "raw":
                extra.append(s[1])
            elif s[0] == "S":
                extra.append(self._scalar_input(s[1], op, DataType.Double).value)
            else:
                extra.append(s[1])
        first_is_tensor = specs[0][0] == "T"
        if not first_is_tensor and swapped is not None and len(args) == 2:
            aten, args = swapped, [args[1], args[0]]
        try:
            name, full = ir.resolve(aten, args + extra)
        except TypeError:
            consts = [ir.TensorConst(comp.torch_dtype, (), (a,)) if isinstance(a, (bool, int, float)) and j < len(args)
                      else a for j, a in enumerate(args)]
            try:
                name, full = ir.resolve(aten, consts + extra)
            except TypeError:
                raise LoweringError(f"fd.ops.{op} with these operand kinds ({', '.join(s[0] for s in specs)}: T tensor, "
                                    "S symbolic scalar, c constant) is not supported yet") from None
        operands = ", ".join(f"{s[0]}{s[1]}" + (f" ({self.h[s[1]].dtype})" if s[0] in "TS" else "")
                             for s in specs if s[0] != "c")
        got = self._probe(op, name, full, f" for {operands}")
        v = self.b.add(name, *full, dtype=got)
        lv = self._mk(v, DataType.Bool if got == torch.bool else _dt(got), broadcast_phys([x.phys for x in lvs]))
        if lv.dtype is not out_dt:
            lv = self.cast(lv, out_dt)
        return lv

    def _probe(self, op: str, name: str, args: tuple, what: str = "") -> torch.dtype:
        """The dtype eager gives ``name(*args)`` (run on meta tensors); eager's error names the op otherwise."""
        fn, kw, n_pos = _overload(name)
        vals = []
        for a in args:
            if isinstance(a, ir.Value):
                if a.is_tensor:
                    vals.append(torch.empty((1,) * self._ranks.get(a.id, a.rank or 0), dtype=a.dtype, device="meta"))
                else:
                    vals.append(1.0)
            elif isinstance(a, ir.TensorConst):
                vals.append(torch.empty((), dtype=a.dtype, device="meta"))
            elif isinstance(a, tuple):
                vals.append(list(a))
            else:
                vals.append(a)
        try:
            out = fn(*vals[:n_pos], **dict(zip(kw, vals[n_pos:])))
        except Exception as e:  # noqa: BLE001 - eager's own message, for the user
            raise TypeError(f"fd.ops.{op}: eager PyTorch rejects {name}{what}: {e}") from None
        return out.dtype

    def _bcast(self, t: Tensor, view: View, x_index: int, ext: tuple, bdims: tuple) -> LV:
        x = self.h[x_index]
        r, pos, exp = view
        exp = list(exp)
        for j in range(t.ndim):
            p = pos[j]
            if exp[p] is not None or ext[j] == 1:
                continue
            if j not in bdims or x.extents[bdims.index(j)] == 1:
                exp[p] = ext[j]
        xv = (r, tuple(pos[d] for d in bdims), tuple(exp))
        return self.tensor(x_index, xv)

    def _reduce(self, op: str, t: Tensor, view: View, k: int, aten: str, x_index: int, rd: tuple, keepdim: bool,
                dt: DataType, extra: tuple) -> LV:
        x = self.h[x_index]
        r, pos, exp = view
        if keepdim:
            xv = (r, pos, (None,) * r)
            red = [pos[d] - r for d in rd]
        else:
            axes = [("old", p) for p in range(r)]
            last, j, xpos = -1, 0, []
            for i in range(x.ndim):
                if i in rd:
                    axes.insert(last + 1, ("red", i))
                    last += 1
                else:
                    last = axes.index(("old", pos[j]))
                    j += 1
            j = 0
            for i in range(x.ndim):
                if i in rd:
                    xpos.append(axes.index(("red", i)))
                else:
                    xpos.append(axes.index(("old", pos[j])))
                    j += 1
            rr = len(axes)
            xv = (rr, tuple(xpos), (None,) * rr)
            red = [xpos[d] - rr for d in rd]
        lvx = self.tensor(x_index, xv)
        want = logical(x, canonical(xv))
        for d, p in zip(rd, red):
            if len(lvx.phys) + p < 0 or (lvx.phys[p] == 1 and want[p] != 1):
                raise LoweringError(f"fd.ops.{op}: T{x_index} dim {d} is broadcast from another reduction's result; "
                                    "a reduction over such a dim is not supported yet")
        dims = tuple(red)
        if aten == "var_mean":
            aten = "aten::var.correction" if k == 0 else "aten::mean.dim"
        if aten in ("aten::sum.dim_IntList", "aten::mean.dim"):
            code = None if dt is DataType.Null else SCALAR_TYPE_CODE[dt.torch_dtype]
            args = (lvx.value, dims, keepdim, code)
        elif aten == "aten::var.correction":
            args = (lvx.value, dims, extra[0], keepdim)
        else:
            args = (lvx.value, dims, keepdim)
        got = self._probe(op, aten, args)
        v = self.b.add(aten, *args, dtype=got)
        phys = list(lvx.phys)
        n = len(phys)
        for p in sorted(red, reverse=True):
            if keepdim:
                phys[n + p] = 1
            else:
                del phys[n + p]
        lv = self._mk(v, _dt(got), tuple(phys))
        return lv if lv.dtype is t.dtype else self.cast(lv, t.dtype)

    def _rand_like(self, t: Tensor, view: View, x_index: int) -> LV:
        if view != canonical(identity(t.ndim)):
            raise LoweringError(f"fd.ops.rand_like: T{t.index} is broadcast later; a broadcast random value would "
                                "repeat its numbers, which is not supported yet")
        lv = self.tensor(x_index, view)
        if tuple(lv.phys) != logical(t, view)[len(logical(t, view)) - len(lv.phys):] or len(lv.phys) != t.ndim:
            raise LoweringError(f"fd.ops.rand_like: T{x_index} is narrower than its definition (a reduction's "
                                "broadcast result): not supported yet")
        v = self.b.add("aten::rand_like", lv.value, None, None, None, None, None, dtype=t.dtype.torch_dtype)
        return self._mk(v, t.dtype, lv.phys)

    def _uniform(self, t: Tensor, view: View, lo, hi, ext: tuple, dt: DataType) -> LV:
        if view != canonical(identity(t.ndim)):
            raise LoweringError(f"fd.ops.uniform: T{t.index} is broadcast later; a broadcast random value would "
                                "repeat its numbers, which is not supported yet")
        if lo[0] != "c" or hi[0] != "c":
            raise LoweringError("fd.ops.uniform with symbolic bounds: not supported yet (give constants)")
        carrier = self.b.input(ir.TENSOR, dt.torch_dtype, len(ext))
        self.in_plans.append(("carrier", ext, dt))
        r = self.b.add("aten::rand_like", carrier, None, None, None, None, None, dtype=dt.torch_dtype)
        lo_v, hi_v = float(lo[1]), float(hi[1])
        scaled = self.b.add("aten::mul.Scalar", r, hi_v - lo_v, dtype=dt.torch_dtype)
        out = self.b.add("aten::add.Scalar", scaled, lo_v, 1, dtype=dt.torch_dtype)
        return self._mk(out, dt, ext)


def _dt(t: torch.dtype) -> DataType:
    from .datatype import from_torch
    return from_torch(t)
