"""A differential fuzzer: random pointwise graphs over the op table, fused vs eager PyTorch.

``python -m fuser.fuzz --graphs N --seed S --device cpu|cuda [--time-budget SECONDS] [--out DIR] [--jobs J]``

Each graph is a random DAG of 1 to 40 ops drawn from every schema of :data:`fuser.ops._OPS` (scalar
arguments as constants, NaN/inf included, or as ``float`` graph inputs; optional clamp bounds as None; gelu
variants; 0-dim tensor constants), with several outputs, intermediate values among them. It runs as one
fusion group (what :func:`fuser.debug_launch_graph` does: register, then ``executor.run``, falling back to the
interpreter) on random inputs: float32/float64/float16/bfloat16 and integer/bool dtypes, mixed so that they
promote; shapes from 0-dim and zero-element to ~1e5 elements (several million on CUDA); broadcasting (size-1
dims, stride-0 expanded views, rank mismatch), transposes, steps, row slices and offset views; values with
NaN, +-inf, -0.0, huge and tiny magnitudes.

Judging (:func:`check`): the same outputs, dtypes, shapes and devices as eager PyTorch run op by op through
``torch.ops.aten``; values equal within the dtype's tolerance, or at least as close to a float64 reference
(the same graph on inputs upcast to float64) as eager is; NaN where eager has NaN. Elements downstream of a
discontinuity (a comparison, rounding, fmod, a domain edge, ...) whose argument is a *computed* value within
its error estimate of the edge are not judged (fusion keeps float intermediates for half dtypes, and libm and
eager's vectorized math differ in the last bits, so such elements can legitimately differ); the share of
judged elements is reported. Where eager raises, the fused path must raise the same type of exception.

Every mismatch is shrunk (outputs and ops dropped, shapes cut, layouts and dtypes simplified, while the same
kind of mismatch persists) and saved under ``--out`` as a runnable reproducer / regression test.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import dataclasses
import math
import multiprocessing
import os
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import compiler, executor, fallback, ops
from .kernel_cache import STORE

# ----------------------------------------------------------------------------------------------------------
# the op catalog: every schema of the op table


@dataclass(eq=False)
class OpSchema:
    op: ops.OpDef
    schema: str
    kind: str  # "aten::add"
    overload: str  # "Tensor", "" for the default overload
    args: list  # [(name, type str, kwarg_only)]

    @property
    def fn(self):
        return getattr(getattr(torch.ops.aten, self.kind.split("::")[1]), self.overload or "default")

    @property
    def id(self) -> str:
        return f"{self.kind.split('::')[1]}.{self.overload}" if self.overload else self.kind.split("::")[1]


def _catalog() -> list[OpSchema]:
    out = []
    for op in ops._OPS:
        if op.random or op.concat:  # rand_like's numbers are not eager's (tests/test_random.py checks them);
            continue  # cat takes a list, which the generator does not build (tests/test_concat.py)
        for schema in op.schemas:
            s = torch._C.parse_schema(schema)
            out.append(OpSchema(op, schema, s.name, s.overload_name,
                                [(a.name, str(a.type), a.kwarg_only) for a in s.arguments]))
    return out


CATALOG = _catalog()
BY_OP: dict[str, list[OpSchema]] = collections.defaultdict(list)
for _e in CATALOG:
    BY_OP[_e.op.name].append(_e)
OP_NAMES = sorted(BY_OP)

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool",
               torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16"}
_TCONST_TYPES = {torch.float64: "Double", torch.float32: "Float", torch.int64: "Long"}

# ----------------------------------------------------------------------------------------------------------
# programs: the structure the generator builds and the shrinker edits


@dataclass
class Arg:
    """One node argument. kind: "val" (v = ("t", k) a tensor input or ("n", j) a node), "float" (v = index of
    a float graph input), "const" (v = a Python int/float), "none", "str" (v = the string), "tconst" (a 0-dim
    tensor constant: v = its value, dtype)."""

    kind: str
    v: Any = None
    dtype: Optional[torch.dtype] = None


@dataclass
class PNode:
    schema: OpSchema
    args: list

    def __getstate__(self):
        return {"schema": self.schema.schema, "args": self.args}

    def __setstate__(self, st):
        self.schema = next(e for e in CATALOG if e.schema == st["schema"])
        self.args = st["args"]


class TensorInput:
    """A concrete input: a 1-d storage and the view over it (size, stride, offset). Pickled as bytes."""

    def __init__(self, storage: torch.Tensor, size, stride, offset: int, layout: str = "contiguous"):
        self.storage = storage
        self.recipe = None  # how the generator made it (not pickled)
        self.size, self.stride, self.offset = tuple(size), tuple(stride), int(offset)
        self.layout = layout

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def view(self, device="cpu") -> torch.Tensor:
        return self.storage.to(device).as_strided(self.size, self.stride, self.offset)

    def compacted(self) -> "TensorInput":
        if any(s == 0 for s in self.size):
            return TensorInput(self.storage[:0].clone(), self.size, self.stride, 0, self.layout)
        end = self.offset + sum((s - 1) * st for s, st in zip(self.size, self.stride)) + 1
        if self.offset == 0 and end == self.storage.numel():
            return self
        return TensorInput(self.storage[self.offset:end].clone(), self.size, self.stride, 0, self.layout)

    def __reduce__(self):
        s = torch.empty(self.storage.numel(), dtype=self.storage.dtype).copy_(self.storage.reshape(-1))
        raw = s.view(torch.uint8).numpy().tobytes() if s.numel() else b""
        return (_tensor_input_from_bytes, (raw, DTYPE_NAMES[s.dtype], self.size, self.stride, self.offset,
                                           self.layout))

    def describe(self) -> str:
        return (f"{DTYPE_NAMES[self.dtype]}{list(self.size)} stride={list(self.stride)} offset={self.offset} "
                f"({self.layout})")


def _tensor_input_from_bytes(raw, dtype_name, size, stride, offset, layout):
    dtype = getattr(torch, dtype_name)
    if raw:
        storage = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).clone()
    else:
        storage = torch.empty(0, dtype=dtype)
    return TensorInput(storage, size, stride, offset, layout)


def _broadcast(*shapes) -> tuple:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, x in enumerate(s):
            d = ndim - len(s) + i
            if x != 1:
                if out[d] not in (1, x):
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                out[d] = x
    return tuple(out)


def _contig(size) -> tuple:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@dataclass
class Program:
    tensors: list  # [TensorInput]
    floats: list  # [float]
    nodes: list  # [PNode]
    outputs: list  # [("n", j)]

    def copy(self) -> "Program":
        return Program(list(self.tensors), list(self.floats),
                       [PNode(n.schema, [dataclasses.replace(a) for a in n.args]) for n in self.nodes],
                       list(self.outputs))

    def args(self, device="cpu") -> list:
        return [t.view(device) for t in self.tensors] + [float(f) for f in self.floats]

    def compact(self) -> "Program":
        """Drop nodes no output needs and inputs nothing uses; renumber."""
        live = set()
        stack = [r for r in self.outputs if r[0] == "n"]
        while stack:
            r = stack.pop()
            if r in live:
                continue
            live.add(r)
            for a in self.nodes[r[1]].args:
                if a.kind == "val" and a.v[0] == "n":
                    stack.append(a.v)
        used_t, used_f = set(), set()
        for j, n in enumerate(self.nodes):
            if ("n", j) in live:
                for a in n.args:
                    if a.kind == "val" and a.v[0] == "t":
                        used_t.add(a.v[1])
                    elif a.kind == "float":
                        used_f.add(a.v)
        tmap = {k: i for i, k in enumerate(sorted(used_t))}
        fmap = {k: i for i, k in enumerate(sorted(used_f))}
        nmap, nodes = {}, []
        for j, n in enumerate(self.nodes):
            if ("n", j) not in live:
                continue
            args = []
            for a in n.args:
                if a.kind == "val":
                    a = Arg("val", ("t", tmap[a.v[1]]) if a.v[0] == "t" else ("n", nmap[a.v[1]]))
                elif a.kind == "float":
                    a = Arg("float", fmap[a.v])
                else:
                    a = dataclasses.replace(a)
                args.append(a)
            nmap[j] = len(nodes)
            nodes.append(PNode(n.schema, args))
        outs = []
        for r in self.outputs:
            if r[0] == "n" and ("n", nmap[r[1]]) not in outs:
                outs.append(("n", nmap[r[1]]))
        return Program([self.tensors[k] for k in sorted(used_t)], [self.floats[k] for k in sorted(used_f)],
                       nodes, outs)


# ----------------------------------------------------------------------------------------------------------
# rendering a program as TorchScript IR, and parsing IR (with NaN and exact 0-dim tensor constants)

_NAN_MARK = "0.0"


def _fmt_scalar(v) -> str:
    if isinstance(v, bool):
        raise TypeError("bool scalars do not match Scalar in TorchScript IR")
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    return repr(float(v))


def render(p: Program) -> str:
    """The TorchScript IR of ``p``: tensor inputs ``%t*`` first, then float inputs ``%f*``."""
    ins = [f"%t{k} : Tensor" for k in range(len(p.tensors))] + [f"%f{k} : float" for k in range(len(p.floats))]
    lines = []
    for j, n in enumerate(p.nodes):
        names = []
        for i, (a, (aname, atype, _)) in enumerate(zip(n.args, n.schema.args)):
            c = f"%c{j}_{i}"
            if a.kind == "val":
                names.append(f"%{a.v[0] if a.v[0] == 't' else 'v'}{a.v[1]}")
                continue
            if a.kind == "float":
                names.append(f"%f{a.v}")
                continue
            if a.kind == "const":
                ty = "int" if isinstance(a.v, int) else "float"
                lines.append(f"  {c} : {ty} = prim::Constant[value={_fmt_scalar(a.v)}]()")
            elif a.kind == "none":
                lines.append(f"  {c} : NoneType = prim::Constant()")
            elif a.kind == "str":
                lines.append(f'  {c} : str = prim::Constant[value="{a.v}"]()')
            elif a.kind == "tconst":
                lines.append(f"  {c} : {_TCONST_TYPES[a.dtype]}(requires_grad=0, device=cpu) = "
                             f"prim::Constant[value={{{_fmt_scalar(a.v)}}}]()")
            names.append(c)
        lines.append(f"  %v{j} : Tensor = {n.schema.kind}({', '.join(names)})")
    outs = ", ".join(f"%v{r[1]}" for r in p.outputs)
    return f"graph({', '.join(ins)}):\n" + "\n".join(lines) + f"\n  return ({outs})\n"


_CONST_RE = re.compile(r"^\s*%[\w.]+ : (\w+)(\([^)]*\))? = prim::Constant(\[value=(.*)\])?\(\)\s*$")
_TYPE_DTYPES = {v: k for k, v in _TCONST_TYPES.items()}


def _parse_number(s: str):
    s = s.strip()
    if s in ("nan", "-nan"):
        return float("nan")
    if s in ("inf", "-inf"):
        return float(s)
    try:
        return int(s)
    except ValueError:
        return float(s)


def parse_graph(text: str) -> torch._C.Graph:
    """``torch.parse_ir`` of ``text``, also accepting ``value=nan`` float constants and exact 0-dim tensor
    constants (``Double(requires_grad=0, device=cpu) = prim::Constant[value={-0.25}]()``; the IR parser
    itself drops a tensor constant's minus sign and has no NaN literal)."""
    patches, out_lines = [], []
    for line in text.splitlines():
        m = _CONST_RE.match(line)
        if m is None:
            out_lines.append(line)
            continue
        ty, _, _, value = m.groups()
        if ty == "float" and value is not None and value.strip() in ("nan", "-nan"):
            patches.append(("f", float("nan")))
            line = line.replace(f"[value={value}]", f"[value={_NAN_MARK}]")
        elif ty in _TYPE_DTYPES and value is not None and value.startswith("{"):
            v = _parse_number(value.strip("{}"))
            patches.append(("t", torch.tensor(v, dtype=_TYPE_DTYPES[ty])))
            line = line.replace(f"[value={value}]", "[value={0}]")
        else:
            patches.append(None)
        out_lines.append(line)
    g = torch.parse_ir("\n".join(out_lines), parse_tensor_constants=True)
    consts = [n for n in g.nodes() if n.kind() == "prim::Constant"]
    if len(consts) != len(patches):
        raise ValueError("constants of the parsed graph do not match the text")
    for n, patch in zip(consts, patches):
        if patch is None:
            continue
        if patch[0] == "f":
            n.f_("value", patch[1])
        else:
            n.t_("value", patch[1])
    return g


# ----------------------------------------------------------------------------------------------------------
# eager op by op, straight from a graph


def _resolve(node: torch._C.Node):
    s = torch._C.parse_schema(node.schema())
    fn = getattr(getattr(torch.ops.aten, s.name.split("::")[1]), s.overload_name or "default")
    return s, fn


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
                r = (r * (1 + size * u) + u * step).to(r.dtype)
        env[n.output().unique()] = r
        steps.append((n, r, ins))
    return steps, [env[v.unique()] for v in graph.outputs()]


# ----------------------------------------------------------------------------------------------------------
# judging

TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (2e-5, 2e-5),
       torch.float64: (1e-10, 1e-10)}


@dataclass
class Verdict:
    ok: bool
    kind: str  # ok | raises | count | dtype | shape | device | value | no_raise | raise_type | fused_raises | crash
    detail: str = ""
    fused: bool = False
    reason: str = ""  # why it fell back
    judged: int = 0  # output elements judged (not excused as near a discontinuity)
    total: int = 0  # output elements
    finite: int = 0  # output elements that are finite in eager (integer and bool ones count as finite)


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
            mask = torch.broadcast_to(mask, val.shape)
        masks[n.output().unique()] = mask
    return masks


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
    closer = dF <= 2 * dE + tol
    # eager is NaN or infinite where the float64 truth is finite (e.g. a float16 intermediate overflowed in
    # eager but not in the fused float intermediate): the fused value must then be near the truth
    wild = torch.isinf(dE) & torch.isfinite(r)
    return torch.where(wild, dF <= 10 * tol + 1e-3 * r.abs(), closer)


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
    from .descs import DTYPES
    if any(t.result not in DTYPES or t.compute not in DTYPES for t in types):
        return "unsupported intermediate dtype"
    return "codegen: not fusable (no integer expression)"


def check(graph: torch._C.Graph, args: list, device=None) -> Verdict:
    """Run ``graph`` as one fusion group on ``args`` and judge it against eager PyTorch."""
    e_exc = steps = e_outs = None
    try:
        steps, e_outs = eager_eval(graph, args)
    except Exception as ex:  # noqa: BLE001
        e_exc = ex
    f_exc, fused, reason, f_outs = None, False, "", None
    try:
        spec = STORE.get(STORE.register(graph))
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


# ----------------------------------------------------------------------------------------------------------
# generation

FLOAT_POOL = (0.5, -1.5, 2.0, 3.0, 0.0, -0.0, 1.0, -1.0, 0.1, 1e-3, -0.25, 7.0, 0.3333333333333333, 1e30, -1e30,
              math.inf, -math.inf, math.nan, 1e-40, 65504.0, 70000.0, 1e-7)
INT_POOL = (0, 1, 2, -1, 3, -7, 100, 5)
ARG_POOLS = {
    "alpha": (1, 2, -1, 0, 0.5, -2.0, 1.5),
    "value": (1, 2, -1, 0, 0.5, -0.25, 3.0),
    "exponent": (2, 3, 0, -1, 0.5, 2.0, -0.5, 1.5, 10.0, 0.0, math.inf, math.nan, -2.0),
    "weight": (0.3, 0.5, 0.7, 1.0, 0.0, -0.5, 1.5, 0.49999, math.nan),
    "min_val": (-1, -0.5, 0.0, 1.0, -math.inf, math.nan, 2),
    "max_val": (1, 0.5, 0.0, -1.0, math.inf, math.nan, 3),
    "threshold": (0.1, 0.0, 1, -0.5, math.nan, 1e30, 20),
    "negative_slope": (0.01, 0.2, 0, -0.5, 1, 1.5, math.nan),
    "beta": (1, 2, 0.5, -1, 0, 1e-3, 100.0),
    "scale": (1, 1.0507009873554805, 2, -1, 0.5),
    "input_scale": (1, 0.5, 2, -1.5, 0),
}


def _pick_scalar(rng: random.Random, name: str, int_only: bool):
    pool = ARG_POOLS.get(name)
    if pool is None or rng.random() < 0.25:
        pool = INT_POOL if (int_only or rng.random() < 0.3) else FLOAT_POOL
    if int_only and rng.random() < 0.9:
        ints = [v for v in pool if isinstance(v, int)]
        if ints:
            pool = ints
    return rng.choice(pool)


@dataclass
class Recipe:
    """How one tensor input is made, independent of the map shape (so a second input set can reuse it)."""

    dtype: torch.dtype
    zero_dim: bool
    rank_drop: int  # leading map dims the input lacks
    ones: tuple  # map dims (indices) where the input has size 1
    layout: str
    seed: int


def _log_uniform_int(rng, lo, hi) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _map_shape(rng: random.Random, rank: int, max_numel: int) -> tuple:
    if rank == 0:
        return ()
    total = _log_uniform_int(rng, 1, max_numel)
    # split log(total) at random into rank parts
    cuts = sorted(rng.random() for _ in range(rank - 1))
    parts = [b - a for a, b in zip([0.0] + cuts, cuts + [1.0])]
    dims = [max(1, int(round(total ** p))) for p in parts]
    for d in range(rank):
        r = rng.random()
        if r < 0.12:
            dims[d] = 1
        elif r < 0.22:
            dims[d] = rng.randint(2, 9)
    if rng.random() < 0.04:
        dims[rng.randrange(rank)] = 0
    while math.prod(dims) > max_numel:
        d = max(range(rank), key=lambda i: dims[i])
        dims[d] = max(1, dims[d] // 2)
    return tuple(dims)


_SPECIALS = {
    torch.float32: (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -3e38, 1e-30, 1e-40, 0.5, -1.0),
    torch.float64: (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e300, -1e30, 1e-300, 1e-310, 0.5, -1.0),
    torch.float16: (math.nan, math.inf, -math.inf, -0.0, 0.0, 6e4, -65504.0, 1e-4, 6e-8, 0.5, -1.0),
    torch.bfloat16: (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -3e38, 1e-30, 1e-39, 0.5, -1.0),
}


def _values(n: int, dtype: torch.dtype, rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) < rng.choice((0.1, 0.5, 0.9))
    if dtype.is_floating_point:
        prof = rng.choice(("normal", "normal", "wide", "int", "half", "small", "unit", "big"))
        if prof == "normal":
            t = torch.randn(n, generator=gen, dtype=torch.float64) * rng.choice((1.0, 2.0, 10.0, 0.1))
        elif prof == "wide":
            mag = torch.empty(n, dtype=torch.float64).uniform_(-30, 30, generator=gen)
            sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
            t = sign * torch.pow(10.0, mag)
        elif prof == "int":
            t = torch.round(torch.randn(n, generator=gen, dtype=torch.float64) * 5)
        elif prof == "half":
            t = torch.round(torch.randn(n, generator=gen, dtype=torch.float64) * 6) / 2
        elif prof == "small":
            t = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-4
        elif prof == "unit":
            t = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
        else:
            t = torch.randn(n, generator=gen, dtype=torch.float64) * 1e4
        if rng.random() < 0.6:
            k = min(n, rng.randint(1, 8))
            idx = torch.randperm(n, generator=gen)[:k]
            vals = [rng.choice(_SPECIALS[dtype]) for _ in range(k)]
            t[idx] = torch.tensor(vals, dtype=torch.float64)
        return t.to(dtype)
    info = torch.iinfo(dtype)
    prof = rng.choice(("small", "small", "medium", "extreme"))
    lo, hi = {"small": (-5, 6), "medium": (-1000, 1001), "extreme": (-1000, 1001)}[prof]
    lo, hi = max(lo, info.min), min(hi, info.max + 1)
    t = torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64)
    if prof == "extreme":
        k = min(n, rng.randint(1, 4))
        idx = torch.randperm(n, generator=gen)[:k]
        t[idx] = torch.tensor([rng.choice((info.min, info.max, 0, -1 if info.min < 0 else 1)) for _ in range(k)],
                              dtype=torch.int64)
    return t.to(dtype)


LAYOUTS = ("contiguous", "contiguous", "contiguous", "expand", "transpose", "step", "offset", "rows",
           "transpose_offset")


def _make_input(rec: Recipe, map_shape: tuple) -> TensorInput:
    rng = random.Random(rec.seed * 7919 + len(map_shape) * 31 + math.prod(map_shape))
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    if rec.zero_dim:
        size = ()
    else:
        size = tuple(1 if d in rec.ones else s for d, s in enumerate(map_shape))[rec.rank_drop:]
    layout = rec.layout
    meta = None
    big = [d for d, s in enumerate(size) if s > 1]
    if layout == "expand" and big:
        red = list(size)
        for d in big:
            if rng.random() < 0.6 or d == big[-1]:
                red[d] = 1
        meta = torch.empty(red, device="meta").expand(size)
    elif layout in ("transpose", "transpose_offset") and len(size) >= 2:
        perm = list(range(len(size)))
        while perm == sorted(perm):
            rng.shuffle(perm)
        inv = [perm.index(i) for i in range(len(size))]
        meta = torch.empty([size[p] for p in perm], device="meta").permute(inv)
        if layout == "transpose_offset":
            meta = torch.empty(meta.numel() + 1, device="meta")[1:].as_strided(meta.shape, meta.stride())
    elif layout == "step" and size:
        d = rng.randrange(len(size))
        k = rng.choice((2, 3))
        base = list(size)
        base[d] = size[d] * k
        meta = torch.empty(base, device="meta")
        meta = meta.narrow(d, 0, base[d])[(slice(None),) * d + (slice(None, None, k),)]
    elif layout == "offset":
        off = rng.choice((1, 3))
        n = math.prod(size)
        meta = torch.empty(n + off, device="meta")[off:].view(size)
    elif layout == "rows" and size:
        extra = rng.choice((1, 3, 8))
        base = list(size[:-1]) + [size[-1] + extra]
        start = rng.choice((0, extra))
        meta = torch.empty(base, device="meta")[..., start:start + size[-1]]
    if meta is None:
        layout = "contiguous"
        meta = torch.empty(size, device="meta")
    st, off = meta.stride(), meta.storage_offset()
    n_storage = 0 if meta.numel() == 0 else off + sum((s - 1) * x for s, x in zip(meta.shape, st)) + 1
    storage = _values(n_storage, rec.dtype, rng, gen)
    t = TensorInput(storage, meta.shape, st, off, layout)
    t.recipe = rec
    return t


def _sample(dtype: torch.dtype, zero_dim: bool) -> torch.Tensor:
    return torch.ones((), dtype=dtype) if zero_dim else torch.empty((0,), dtype=dtype)


def _pick_dtype(rng: random.Random) -> torch.dtype:
    r = rng.random()
    for p, dt in ((0.28, torch.float32), (0.43, torch.float16), (0.58, torch.bfloat16), (0.72, torch.float64),
                  (0.80, torch.int32), (0.87, torch.int64), (0.93, torch.bool)):
        if r < p:
            return dt
    return rng.choice((torch.int8, torch.uint8, torch.int16))


@dataclass
class Generated:
    program: Program
    recipes: list
    map_rank: int
    error_expected: bool


def generate(rng: random.Random, max_numel: int = 100_000, max_ops: int = 40) -> Generated:
    """A random program and its first input set."""
    main = _pick_dtype(rng)
    n_t = rng.choice((1, 1, 2, 2, 2, 3, 3, 4, 5))
    rank = rng.choice((0, 1, 1, 2, 2, 2, 3, 3, 4)) if rng.random() > 0.05 else 0
    map_shape = _map_shape(rng, rank, max_numel)
    recipes = []
    for k in range(n_t):
        dt = main if (k == 0 or rng.random() < 0.7) else _pick_dtype(rng)
        zero_dim = rank == 0 or (k > 0 and rng.random() < 0.12)
        rank_drop = 0 if (k == 0 or rank == 0 or rng.random() < 0.75) else rng.randint(1, rank)
        ones = () if k == 0 else tuple(d for d in range(rank) if rng.random() < 0.25)
        layout = rng.choice(LAYOUTS)
        recipes.append(Recipe(dt, zero_dim, rank_drop, ones, layout, rng.getrandbits(31)))
    tensors = [_make_input(r, map_shape) for r in recipes]
    floats: list = []

    # generation-time shadow values: zero-element (or 0-dim) tensors of each value's dtype
    shadow = {("t", k): _sample(r.dtype, r.zero_dim) for k, r in enumerate(recipes)}
    shapes = {("t", k): tuple(t.size) for k, t in enumerate(tensors)}
    full = _broadcast(*shapes.values())
    nodes: list = []
    n_ops = rng.choice((rng.randint(1, 3), rng.randint(4, 10), rng.randint(4, 10), rng.randint(11, 20),
                        rng.randint(21, max(21, max_ops))))
    n_ops = min(n_ops, max_ops)
    error_expected = False
    last = None

    def pick_val(cond=False):
        vals = list(shadow)
        if cond:
            bools = [v for v in vals if shadow[v].dtype == torch.bool]
            if bools:
                return rng.choice(bools)
            return None if rng.random() < 0.9 else rng.choice(vals)
        if last is not None and rng.random() < 0.5:
            return last
        return rng.choice(vals)

    for _ in range(n_ops):
        for attempt in range(10):
            entry = rng.choice(BY_OP[rng.choice(OP_NAMES)])
            args, sample_args, ok = [], [], True
            tensor_refs = []
            int_only = False
            for aname, atype, _ in entry.args:
                if atype in ("Tensor", "Optional[Tensor]"):
                    if atype == "Optional[Tensor]" and rng.random() < 0.3:
                        args.append(Arg("none"))
                        continue
                    if tensor_refs and rng.random() < 0.04:
                        dt = rng.choice(list(_TCONST_TYPES))
                        v = rng.choice((2, -3, 0)) if dt == torch.int64 else rng.choice((0.5, -2.25, 3.0, 1e-3))
                        args.append(Arg("tconst", v, dt))
                        continue
                    ref = pick_val(cond=(entry.op.keep_args and not args))
                    if ref is None:
                        ok = False
                        break
                    args.append(Arg("val", ref))
                    tensor_refs.append(ref)
                elif atype == "str":
                    args.append(Arg("str", rng.choice([k for k in entry.op.exprs if k is not None])))
                elif atype in ("Scalar", "Optional[number]", "number"):
                    if atype == "Optional[number]" and rng.random() < 0.3:
                        args.append(Arg("none"))
                        continue
                    int_only = bool(tensor_refs) and all(not shadow[r].is_floating_point() for r in tensor_refs)
                    if rng.random() < 0.35:
                        if floats and rng.random() < 0.5:
                            args.append(Arg("float", rng.randrange(len(floats))))
                        else:
                            floats.append(rng.choice(FLOAT_POOL) if rng.random() < 0.6 else
                                          rng.choice(ARG_POOLS.get(aname, FLOAT_POOL)) * 1.0)
                            args.append(Arg("float", len(floats) - 1))
                    else:
                        args.append(Arg("const", _pick_scalar(rng, aname, int_only)))
                else:
                    raise AssertionError(f"unexpected argument type {atype} in {entry.schema}")
            if not ok or not tensor_refs:
                continue
            # shadow evaluation: the result dtype, or eager's error
            pos, kw = [], {}
            for a, (aname, atype, kwo) in zip(args, entry.args):
                val = (shadow[a.v] if a.kind == "val" else floats[a.v] if a.kind == "float" else
                       a.v if a.kind in ("const", "str") else None if a.kind == "none" else
                       torch.tensor(a.v, dtype=a.dtype))
                if kwo:
                    kw[aname] = val
                else:
                    pos.append(val)
            try:
                res = entry.fn(*pos, **kw)
            except Exception:  # noqa: BLE001
                if rng.random() < 0.03:
                    error_expected = True
                    res = None
                else:
                    continue
            ref = ("n", len(nodes))
            nodes.append(PNode(entry, args))
            shapes[ref] = _broadcast(*(shapes[r] for r in tensor_refs))
            if res is not None:
                shadow[ref] = res
            last = ref
            break
        if error_expected:
            break
    if not nodes:
        # always something: neg works on every dtype but bool, abs... use add with itself
        entry = next(e for e in BY_OP["add"] if e.overload == "Tensor")
        nodes.append(PNode(entry, [Arg("val", ("t", 0)), Arg("val", ("t", 0)), Arg("const", 1)]))
        shapes[("n", 0)] = shapes[("t", 0)]
    used = {a.v for n in nodes for a in n.args if a.kind == "val"}
    sinks = [("n", j) for j in range(len(nodes)) if ("n", j) not in used]
    outs = list(sinks) + [("n", j) for j in range(len(nodes)) if ("n", j) in used and rng.random() < 0.2]
    if rng.random() < 0.9:  # outputs of the group's full shape, so that it can fuse
        outs = [r for r in outs if shapes[r] == full]
    if error_expected:
        outs = [("n", len(nodes) - 1)]
    if not outs:
        entry = next(e for e in BY_OP["add"] if e.overload == "Tensor")
        nodes.append(PNode(entry, [Arg("val", ("n", len(nodes) - 1)), Arg("val", ("t", 0)), Arg("const", 1)]))
        outs = [("n", len(nodes) - 1)]
    rng.shuffle(outs)
    outs = outs[:8]
    p = Program(tensors, floats, nodes, outs).compact()
    return Generated(p, recipes, rank, error_expected)


def graph_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 12_345) % (2 ** 62)


# ----------------------------------------------------------------------------------------------------------
# one graph of a campaign (runs in a worker process)


@dataclass
class GraphResult:
    index: int
    runs: int = 0
    fused: int = 0
    raises: int = 0
    reasons: dict = field(default_factory=dict)
    judged: int = 0
    total: int = 0
    finite: int = 0
    n_ops: int = 0
    ops: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # [(variant, Program, Verdict)]
    seconds: float = 0.0


def _inputs_for_variant(g: Generated, variant: int, seed: int, index: int, max_numel: int) -> Program:
    if variant == 0:
        return g.program
    rng = random.Random(graph_seed(seed, index) ^ (variant * 0x9E3779B97F4A7C15 % 2 ** 62))
    p = g.program
    map_shape = _map_shape(rng, g.map_rank, max_numel)
    tensors = []
    for t in p.tensors:
        rec = t.recipe
        tensors.append(_make_input(dataclasses.replace(rec, seed=rng.getrandbits(31)), map_shape))
    floats = [rng.choice(FLOAT_POOL) if rng.random() < 0.5 else f for f in p.floats]
    return Program(tensors, floats, p.nodes, p.outputs)


def run_graph(seed: int, index: int, device: str = "cpu", max_numel: int = 100_000, max_ops: int = 40,
              variants: int = 2) -> GraphResult:
    t0 = time.perf_counter()
    res = GraphResult(index)
    g = build_case(seed, index, max_numel, max_ops)
    res.n_ops = len(g.program.nodes)
    for n in g.program.nodes:
        res.ops[n.schema.id] = res.ops.get(n.schema.id, 0) + 1
    for v in range(variants):
        p = _inputs_for_variant(g, v, seed, index, max_numel)
        for t in p.tensors:
            res.dtypes[DTYPE_NAMES[t.dtype]] = res.dtypes.get(DTYPE_NAMES[t.dtype], 0) + 1
            res.layouts[t.layout] = res.layouts.get(t.layout, 0) + 1
        try:
            verdict = check_program(p, device)
        except Exception as ex:  # noqa: BLE001 (a bug of the fuzzer itself, or of parsing)
            verdict = Verdict(False, "fuzzer_error", "".join(traceback.format_exception(ex))[-3000:])
        res.runs += 1
        if verdict.kind == "raises":
            res.raises += 1
        elif verdict.fused:
            res.fused += 1
        else:
            res.reasons[verdict.reason] = res.reasons.get(verdict.reason, 0) + 1
        res.judged += verdict.judged
        res.total += verdict.total
        res.finite += verdict.finite
        if not verdict.ok:
            res.failures.append((v, p, verdict))
    res.seconds = time.perf_counter() - t0
    return res


def build_case(seed: int, index: int, max_numel: int = 100_000, max_ops: int = 40) -> Generated:
    """Generate graph ``index`` of campaign ``seed``, remembering each surviving input's recipe."""
    rng = random.Random(graph_seed(seed, index))
    g = generate(rng, max_numel, max_ops)
    return g


# ----------------------------------------------------------------------------------------------------------
# shrinking


def _replace_value(p: Program, old, new) -> Optional[Program]:
    q = p.copy()
    for n in q.nodes:
        for a in n.args:
            if a.kind == "val" and a.v == old:
                a.v = new
    if new[0] != "n":
        if old in q.outputs:
            return None
    q.outputs = [new if r == old else r for r in q.outputs]
    q.outputs = list(dict.fromkeys(q.outputs))
    # a node referring to itself or a later node is impossible here: ``new`` is an input of ``old``
    return q.compact()


def _map_shape_of(p: Program) -> tuple:
    return tuple(_broadcast(*(t.size for t in p.tensors))) if p.tensors else ()


def _slice_inputs(p: Program, dim_from_right: int, sl: slice) -> Program:
    tensors = []
    for t in p.tensors:
        d = len(t.size) - dim_from_right
        if d < 0 or t.size[d] == 1:
            tensors.append(t)
            continue
        v = t.view()[(slice(None),) * d + (sl,)]
        base = TensorInput(t.storage, v.shape, v.stride(), v.storage_offset(), t.layout).compacted()
        tensors.append(base)
    return Program(tensors, p.floats, p.nodes, p.outputs)


def _squeeze_inputs(p: Program, dim_from_right: int) -> Program:
    tensors = []
    for t in p.tensors:
        d = len(t.size) - dim_from_right
        if d < 0:
            tensors.append(t)
            continue
        tensors.append(TensorInput(t.storage, t.size[:d] + t.size[d + 1:], t.stride[:d] + t.stride[d + 1:],
                                   t.offset, t.layout))
    return Program(tensors, p.floats, p.nodes, p.outputs)


def _with_tensor(p: Program, k: int, t: TensorInput) -> Program:
    tensors = list(p.tensors)
    tensors[k] = t
    return Program(tensors, p.floats, p.nodes, p.outputs)


def _candidates(p: Program):
    # fewer outputs
    if len(p.outputs) > 1:
        for r in p.outputs:
            q = p.copy()
            q.outputs = [r]
            yield "keep one output", q.compact()
        for r in p.outputs:
            q = p.copy()
            q.outputs = [x for x in p.outputs if x != r]
            yield "drop an output", q.compact()
    # bypass a node: its users read one of its tensor arguments instead
    for j in reversed(range(len(p.nodes))):
        for a in p.nodes[j].args:
            if a.kind == "val":
                q = _replace_value(p, ("n", j), a.v)
                if q is not None:
                    yield "bypass a node", q
    # float inputs to constants, tensor constants to float constants
    for k, f in enumerate(p.floats):
        q = p.copy()
        for n in q.nodes:
            for a in n.args:
                if a.kind == "float" and a.v == k:
                    a.kind, a.v = "const", f
        yield "inline a float input", q.compact()
    # smaller shapes
    shape = _map_shape_of(p)
    for dr in range(1, len(shape) + 1):
        n = shape[-dr]
        if n > 1:
            h = n // 2
            for sl in (slice(0, h), slice(h, n), slice(0, 1), slice(n - 1, n)):
                yield "cut a dim", _slice_inputs(p, dr, sl)
    for dr in range(1, len(shape) + 1):
        if shape[-dr] == 1:
            yield "drop a size-1 dim", _squeeze_inputs(p, dr)
    # simpler layouts and dtypes
    for k, t in enumerate(p.tensors):
        if t.layout != "contiguous" or t.stride != _contig(t.size) or t.offset:
            v = t.view()
            flat = torch.empty(v.numel(), dtype=v.dtype).copy_(v.reshape(-1))
            yield "contiguous input", _with_tensor(p, k, TensorInput(flat, v.shape, _contig(v.shape), 0))
    for k, t in enumerate(p.tensors):
        if t.dtype in (torch.float16, torch.bfloat16, torch.float64):
            yield "float32 input", _with_tensor(p, k, TensorInput(t.storage.float(), t.size, t.stride, t.offset,
                                                                  t.layout))
    # simpler values: zero out elements of small tensors one by one (keeps specials that matter)
    for k, t in enumerate(p.tensors):
        if 1 < t.storage.numel() <= 16:
            for i in range(t.storage.numel()):
                x = t.storage[i].item()
                if x != 0 and not (isinstance(x, float) and x == 1.0):
                    s = t.storage.clone()
                    s[i] = 0
                    yield "zero a value", _with_tensor(p, k, TensorInput(s, t.size, t.stride, t.offset, t.layout))


class Evaluator:
    """Runs :func:`check_program` in a child process, so that a crashing kernel cannot take the caller with
    it (a crash is reported as the verdict kind ``crash``)."""

    def __init__(self, device: str):
        self.device = device
        self.pool = None

    def _pool(self):
        if self.pool is None:
            self.pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    def __call__(self, p: Program, timeout: float = 300) -> Verdict:
        try:
            return self._pool().submit(_check_worker, p, self.device).result(timeout=timeout)
        except cf.process.BrokenProcessPool:
            self.close()
            return Verdict(False, "crash", "the process running the fused kernel died")
        except cf.TimeoutError:
            self.close(kill=True)
            return Verdict(False, "hang", f"no result in {timeout} s")

    def close(self, kill: bool = False):
        if self.pool is not None:
            if kill:
                for proc in list(getattr(self.pool, "_processes", {}).values()):
                    proc.kill()
            self.pool.shutdown(wait=not kill, cancel_futures=True)
            self.pool = None


def _check_worker(p: Program, device: str) -> Verdict:
    _worker_init()
    try:
        return check_program(p, device)
    except Exception as ex:  # noqa: BLE001
        return Verdict(False, "fuzzer_error", "".join(traceback.format_exception(ex))[-3000:])


def shrink(p: Program, verdict: Verdict, evaluate: Callable[[Program], Verdict], budget_s: float = 120.0,
           log: Callable[[str], None] = lambda s: None) -> tuple:
    """Delta-debug ``p`` while ``evaluate`` keeps failing with ``verdict.kind``. Returns (program, verdict, steps)."""
    deadline = time.monotonic() + budget_s
    best, best_v, steps = p, verdict, 0
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for what, cand in _candidates(best):
            if time.monotonic() > deadline:
                break
            if not cand.nodes or not cand.outputs:
                continue
            v = evaluate(cand)
            if not v.ok and v.kind == verdict.kind:
                best, best_v, steps, progress = cand, v, steps + 1, True
                log(f"  shrink: {what}: {len(best.nodes)} ops, inputs "
                    f"{[list(t.size) for t in best.tensors]}")
                break
    best = Program([t.compacted() for t in best.tensors], best.floats, best.nodes, best.outputs)
    return best, best_v, steps


# ----------------------------------------------------------------------------------------------------------
# reproducers


def _py_value(x) -> str:
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return repr(x)
    return repr(x)


def eager_code(p: Program) -> list:
    """The program as eager Python, one torch.ops.aten call per line (for reading)."""
    lines = []
    for j, n in enumerate(p.nodes):
        pos, kw = [], []
        for a, (aname, atype, kwo) in zip(n.args, n.schema.args):
            s = (f"t{a.v[1]}" if a.kind == "val" and a.v[0] == "t" else f"v{a.v[1]}" if a.kind == "val" else
                 f"f{a.v}" if a.kind == "float" else _py_value(a.v) if a.kind == "const" else "None"
                 if a.kind == "none" else repr(a.v) if a.kind == "str" else
                 f"torch.tensor({_py_value(a.v)}, dtype=torch.{DTYPE_NAMES[a.dtype]})")
            (kw.append(f"{aname}={s}") if kwo else pos.append(s))
        lines.append(f"v{j} = torch.ops.aten.{n.schema.kind.split('::')[1]}.{n.schema.overload or 'default'}"
                     f"({', '.join(pos + kw)})")
    lines.append(f"outputs = [{', '.join(f'v{r[1]}' for r in p.outputs)}]")
    return lines


def reproducer(p: Program, verdict: Verdict, device: str, origin: str, out_dir: Optional[str] = None,
               stem: str = "repro") -> str:
    """A runnable Python file reproducing ``p`` (a pytest test and a script)."""
    ir = render(p)
    total = sum(t.storage.numel() for t in p.tensors)
    data_file = None
    if total > 4096 and out_dir is not None:
        data_file = f"{stem}.pt"
        torch.save([t.storage for t in p.tensors], os.path.join(out_dir, data_file))
    in_lines = []
    for k, t in enumerate(p.tensors):
        dt = f"torch.{DTYPE_NAMES[t.dtype]}"
        if data_file is None:
            vals = ", ".join(_py_value(x) for x in t.storage.tolist())
            src = (f"torch.tensor([{vals}], dtype=torch.float64).to({dt})" if t.dtype.is_floating_point
                   else f"torch.tensor([{vals}], dtype={dt})")
        else:
            src = f"_DATA[{k}]"
        in_lines.append(f"    t{k} = {src}.to(device).as_strided({list(t.size)}, {list(t.stride)}, {t.offset})"
                        f"  # {t.layout}")
    floats = ", ".join(_py_value(f) for f in p.floats)
    detail = "\n".join("#   " + ln for ln in verdict.detail.splitlines())
    eager = "\n".join("#   " + ln for ln in eager_code(p))
    names = [f"t{k}" for k in range(len(p.tensors))] + [f"f{k}" for k in range(len(p.floats))]
    float_lines = "".join(f"    f{k} = {_py_value(f)}\n" for k, f in enumerate(p.floats))
    load = (f"_DATA = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), {data_file!r}))\n"
            if data_file else "")
    how = "fused" if verdict.fused else "fell back: " + verdict.reason
    return f'''"""fuser differential fuzzer failure: {verdict.kind} ({how}).

{origin}
Run: python {stem}.py   or   pytest {stem}.py
"""
import math
import os

import torch

from fuser.fuzz import check, parse_graph

nan, inf = math.nan, math.inf
DEVICE = {device!r}
{load}
# What it found:
{detail}
#
# The same graph in eager PyTorch:
{eager}

IR = """{ir}"""


def make_inputs(device=DEVICE):
{chr(10).join(in_lines) if in_lines else "    pass"}
{float_lines}    return [{", ".join(names)}]


def test_fuzz_repro():
    verdict = check(parse_graph(IR), make_inputs())
    assert verdict.ok, verdict.kind + ": " + verdict.detail


if __name__ == "__main__":
    graph = parse_graph(IR)
    args = make_inputs()
    print(graph)
    for a in args:
        print(a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), a) if isinstance(a, torch.Tensor) else print(a)
    v = check(graph, args)
    print("OK" if v.ok else f"MISMATCH {{v.kind}} (fused={{v.fused}}): {{v.detail}}")
'''


# ----------------------------------------------------------------------------------------------------------
# campaigns


@dataclass
class Campaign:
    seed: int
    device: str
    graphs: int = 0
    runs: int = 0
    fused: int = 0
    raises: int = 0
    reasons: collections.Counter = field(default_factory=collections.Counter)
    judged: int = 0
    total: int = 0
    finite: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)
    dtypes: collections.Counter = field(default_factory=collections.Counter)
    layouts: collections.Counter = field(default_factory=collections.Counter)
    n_ops: collections.Counter = field(default_factory=collections.Counter)
    failures: list = field(default_factory=list)  # [(index, variant, Program, Verdict)]
    seconds: float = 0.0

    def add(self, r: GraphResult):
        self.graphs += 1
        self.runs += r.runs
        self.fused += r.fused
        self.raises += r.raises
        self.reasons.update(r.reasons)
        self.judged += r.judged
        self.total += r.total
        self.finite += r.finite
        self.ops.update(r.ops)
        self.dtypes.update(r.dtypes)
        self.layouts.update(r.layouts)
        self.n_ops[min(40, (r.n_ops + 4) // 5 * 5)] += 1
        for v, p, verdict in r.failures:
            self.failures.append((r.index, v, p, verdict))

    def summary(self) -> str:
        not_raising = self.runs - self.raises
        lines = [
            f"seed {self.seed} on {self.device}: {self.graphs} graphs, {self.runs} runs in {self.seconds:.0f} s",
            f"  fused {self.fused} of {not_raising} runs where eager does not raise "
            f"({100 * self.fused / max(1, not_raising):.1f}%); {self.raises} runs where eager raises",
            f"  fallback reasons: {dict(self.reasons.most_common())}",
            f"  output elements judged: {self.judged} of {self.total} "
            f"({100 * self.judged / max(1, self.total):.2f}%; the rest excused as near a discontinuity); "
            f"finite in eager: {100 * self.finite / max(1, self.total):.1f}%",
            f"  ops per graph (bucketed by 5): {dict(sorted(self.n_ops.items()))}",
            f"  schemas used: {len(self.ops)} of {len(CATALOG)}"
            + (f" (never: {sorted(set(e.id for e in CATALOG) - set(self.ops))})"
               if len(self.ops) < len(CATALOG) else ""),
            f"  input dtypes: {dict(self.dtypes.most_common())}",
            f"  input layouts: {dict(self.layouts.most_common())}",
            f"  mismatches: {len(self.failures)}",
        ]
        return "\n".join(lines)


_WORKER_READY = False


def _worker_init(threads: Optional[int] = None):
    global _WORKER_READY
    if _WORKER_READY:
        return
    _WORKER_READY = True
    if threads:
        torch.set_num_threads(threads)


def _run_graph_task(seed, index, device, max_numel, max_ops, variants, deadline, threads):
    _worker_init(threads)
    if deadline is not None and time.time() > deadline:
        return None
    return run_graph(seed, index, device, max_numel, max_ops, variants)


def run_campaign(graphs: int, seed: int, device: str = "cpu", time_budget: Optional[float] = None,
                 jobs: int = 1, max_numel: Optional[int] = None, max_ops: int = 40, variants: int = 2,
                 log: Callable[[str], None] = print, start: int = 0) -> Campaign:
    """Run graphs ``start .. start + graphs - 1`` of the campaign ``seed`` (stopping after ``time_budget``
    seconds); ``jobs`` worker processes (1: in this process)."""
    if max_numel is None:
        max_numel = 100_000 if device == "cpu" else 4_000_000
    camp = Campaign(seed, device)
    t0 = time.time()
    deadline = None if time_budget is None else t0 + time_budget
    indices = list(range(start, start + graphs))
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))

    def report(r: GraphResult):
        camp.add(r)
        for v, p, verdict in r.failures:
            log(f"MISMATCH graph {r.index} (seed {seed}) input set {v}: {verdict.kind}: "
                f"{verdict.detail.splitlines()[0] if verdict.detail else ''}")
        if camp.graphs % 100 == 0:
            log(f"  ... {camp.graphs} graphs, {camp.fused}/{camp.runs - camp.raises} fused, "
                f"{len(camp.failures)} mismatches, {time.time() - t0:.0f} s")

    if jobs <= 1:
        for i in indices:
            if deadline is not None and time.time() > deadline:
                break
            report(run_graph(seed, i, device, max_numel, max_ops, variants))
    else:
        ctx = multiprocessing.get_context("spawn")
        pending = collections.deque(indices)
        while pending:
            pool = cf.ProcessPoolExecutor(jobs, mp_context=ctx)
            inflight: dict = {}
            broken: list = []
            try:
                while pending or inflight:
                    while pending and len(inflight) < 2 * jobs:
                        i = pending.popleft()
                        inflight[pool.submit(_run_graph_task, seed, i, device, max_numel, max_ops, variants,
                                             deadline, threads)] = i
                    done, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        i = inflight.pop(fut)
                        try:
                            r = fut.result()
                        except cf.process.BrokenProcessPool:
                            broken.append(i)
                            continue
                        if r is not None:
                            report(r)
                        elif deadline is not None:
                            pending.clear()
                    if broken:
                        broken.extend(inflight.values())
                        inflight.clear()
                        break
            finally:
                pool.shutdown(wait=not broken, cancel_futures=True)
            for i in broken:  # isolate the graph(s) that crashed the worker
                ev = Evaluator(device)
                try:
                    r = ev._pool().submit(_run_graph_task, seed, i, device, max_numel, max_ops, variants,
                                          None, threads).result()
                    report(r)
                except cf.process.BrokenProcessPool:
                    g = build_case(seed, i, max_numel, max_ops)
                    r = GraphResult(i, runs=1)
                    r.failures.append((0, g.program, Verdict(False, "crash", "the worker process died")))
                    report(r)
                finally:
                    ev.close()
    camp.seconds = time.time() - t0
    return camp


def report_failures(camp: Campaign, out_dir: Optional[str], max_shrink: int = 8, shrink_budget: float = 120.0,
                    log: Callable[[str], None] = print) -> list:
    """Shrink (up to ``max_shrink``) mismatches, print their reproducers and save them under ``out_dir``.
    Returns the paths written."""
    if not camp.failures:
        return []
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    written = []
    ev = Evaluator(camp.device)
    seen = set()
    shrunk = 0
    per_kind: collections.Counter = collections.Counter()
    graphs_done = set()
    try:
        for index, variant, p, verdict in camp.failures:
            stem = f"fuzz_{camp.device}_s{camp.seed}_g{index}_v{variant}_{verdict.kind}"
            origin = (f"Found by: python -m fuser.fuzz --seed {camp.seed} --device {camp.device} --start {index} "
                      f"--graphs 1  (input set {variant})")
            # shrink up to max_shrink mismatches, at most 3 of one kind, one per graph and kind
            if (shrunk < max_shrink and per_kind[verdict.kind] < 3 and (index, verdict.kind) not in graphs_done):
                shrunk += 1
                per_kind[verdict.kind] += 1
                graphs_done.add((index, verdict.kind))
                log(f"shrinking graph {index} input set {variant} ({verdict.kind}, {len(p.nodes)} ops) ...")
                small, sv, steps = shrink(p, verdict, ev, shrink_budget, log)
            else:
                small, sv = p, verdict
            sig = (sv.kind, tuple(sorted({nd.schema.id for nd in small.nodes})),
                   tuple(DTYPE_NAMES[t.dtype] for t in small.tensors))
            dup = sig in seen
            seen.add(sig)
            src = reproducer(small, sv, camp.device, origin + ("\nShrunk from " + str(len(p.nodes)) + " ops."
                                                               if small is not p else ""), out_dir, stem)
            log("=" * 100)
            log(f"MISMATCH {sv.kind} graph {index} input set {variant}"
                + (" (same signature as an earlier one)" if dup else ""))
            log(sv.detail)
            log("IR:\n" + render(small))
            for k, t in enumerate(small.tensors):
                vals = t.view().tolist() if t.storage.numel() <= 64 else "(values in the reproducer)"
                log(f"  t{k}: {t.describe()} = {vals}")
            for k, f in enumerate(small.floats):
                log(f"  f{k} = {f!r}")
            if out_dir:
                path = os.path.join(out_dir, stem + ".py")
                with open(path, "w") as fh:
                    fh.write(src)
                written.append(path)
                log(f"saved {path}")
    finally:
        ev.close()
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuser.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", type=int, default=1000, help="graphs to generate (default 1000)")
    ap.add_argument("--seed", type=int, default=None, help="campaign seed (default: random)")
    ap.add_argument("--start", type=int, default=0, help="index of the first graph (to replay one: --start I "
                                                          "--graphs 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--time-budget", type=float, default=None, help="stop generating after this many seconds")
    ap.add_argument("--out", default="fuzz_failures", help="where reproducers go (default ./fuzz_failures)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                    help="worker processes (1: run in this process)")
    ap.add_argument("--max-numel", type=int, default=None, help="largest map (default 1e5 cpu, 4e6 cuda)")
    ap.add_argument("--max-ops", type=int, default=40)
    ap.add_argument("--variants", type=int, default=2, help="input sets per graph")
    ap.add_argument("--max-shrink", type=int, default=8, help="mismatches to shrink")
    ap.add_argument("--shrink-budget", type=float, default=120.0, help="seconds per shrink")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from . import settings
    if not settings.fusion_enabled(args.device):
        print(f"warning: {args.device} fusion is off here (no compiler / driver): everything falls back",
              file=sys.stderr)
    print(f"fuser fuzz: seed {seed}, device {args.device}, up to {args.graphs} graphs"
          + (f", {args.time_budget:.0f} s" if args.time_budget else ""), flush=True)
    camp = run_campaign(args.graphs, seed, args.device, args.time_budget, args.jobs, args.max_numel, args.max_ops,
                        args.variants, log=lambda s: print(s, flush=True), start=args.start)
    print(camp.summary(), flush=True)
    report_failures(camp, args.out, args.max_shrink, args.shrink_budget, log=lambda s: print(s, flush=True))
    return 1 if camp.failures else 0


if __name__ == "__main__":
    sys.exit(main())
