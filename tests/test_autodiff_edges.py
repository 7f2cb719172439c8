"""Fused gradients (fuser/autodiff.py, fuser/derivatives.py) against eager autograd at the edges: every formula at
NaN, +-inf, +-0, ties with scalar bounds, huge and tiny values, with finite and non-finite output gradients, in
float32 and float64 (and double backward in float64); mixed dtypes, casts, broadcast reductions, zero-gradient
ops inside a group, multi-output groups, complex inputs. Every expected value comes from eager on the same inputs.

To keep compilation cheap, the one-op cases run as a few wide groups (one output per case, separate inputs): a
group's forward and backward are compiled once per dtype and each test checks the slice of its own case."""
import functools
import itertools
import re

import pytest
import torch
from helpers import FUSED_BACKWARD

import fuser
from fuser import autodiff
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

F32, F64 = torch.float32, torch.float64
TOL = {F32: dict(rtol=2e-5, atol=1e-30), F64: dict(rtol=1e-10, atol=1e-300)}
NAN, INF = float("nan"), float("inf")

# One node per case. %x %y %z: floating tensors, %c: a bool tensor, %s=v / %w=v: float graph inputs (kernel
# arguments) of value v; other arguments are constants.
_U = ["abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "exp", "expm1", "erf", "erfc", "floor", "frac", "log",
      "log10", "log1p", "log2", "neg", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "tan",
      "tanh", "trunc", "silu"]
_ALPHAS = ["1", "2", "-1.5", "0", "%s=2.0", "%s=1.0", "%s=0.0"]
CALLS = (
    [f"aten::{u}(%x)" for u in _U]
    + ['aten::gelu(%x, "none")', 'aten::gelu(%x, "tanh")']
    + ["aten::hardtanh(%x, -0.5, 0.5)", "aten::hardtanh(%x, %s=-0.5, %w=0.5)"]
    + [f"aten::{op}(%x, %y, {a})" for op in ("add", "sub", "rsub") for a in _ALPHAS]
    + [f"aten::{op}(%x, 2.5, {a})" for op in ("add", "sub", "rsub") for a in ("1", "-2", "%s=0.5")]
    + ["aten::mul(%x, %y)", "aten::mul(%x, -0.75)", "aten::mul(%x, %s=2.5)", "aten::div(%x, %y)",
       "aten::div(%x, 0.0)", "aten::div(%x, -0.0)", "aten::div(%x, %s=0.0)", "aten::div(%x, 2.5)"]
    + ["aten::atan2(%x, %y)", "aten::fmod(%x, %y)", "aten::fmod(%x, 1.5)", "aten::remainder(%x, 1.5)"]
    + [f"aten::{op}(%x, %y)" for op in ("maximum", "minimum", "max", "min")]
    + ["aten::pow(%x, %y)"] + [f"aten::pow(%x, {e})" for e in
                               ("0", "0.0", "1", "0.5", "-0.5", "-1.0", "2", "2.0", "3.0", "-2.0", "1.5", "-1.5")]
    + ["aten::pow(2.0, %x)", "aten::pow(0.5, %x)", "aten::pow(1.0, %x)"]
    + ["aten::where(%c, %x, %y)", "aten::where(%c, %x, 0.5)", "aten::where(%c, -1.5, %y)",
       "aten::where(%c, %x, %s=2.0)", "aten::type_as(%x, %y)"]
    + ["aten::clamp(%x, -0.5, 0.5)", "aten::clamp(%x, None, 0.5)", "aten::clamp(%x, -0.5, None)",
       "aten::clamp(%x, 0.5, -0.5)", "aten::clamp(%x, %s=-0.5, %w=0.5)",
       "aten::clamp(%x, 0, 1)"]
    + [f"aten::{op}(%x, {m})" for op in ("clamp_min", "clamp_max") for m in ("0.5", "%s=-0.5", "%y")]
    + ["aten::threshold(%x, 0.1, 20.0)", "aten::threshold(%x, -0.5, -1.0)", "aten::threshold(%x, %s=0.5, %w=2.0)"]
    + [f"aten::lerp(%x, %y, {w})" for w in ("0.0", "0.3", "0.5", "0.7", "1.0", "-0.5", "1.5", "%w=0.3", "%w=0.7",
                                            "%w=0.9999999990686774", "%w=2.0", "%z")]
    + [f"aten::addcmul(%x, %y, %z, {v})" for v in ("1", "2", "-0.5", "0", "%s=2.5", "%s=1.0")]
    # activations (their fixed boundaries, +-3 and 6, join the inputs: _BOUNDARIES)
    + ["aten::hardswish(%x)", "aten::hardsigmoid(%x)", "aten::relu6(%x)", "aten::mish(%x)"]
    + [f"aten::leaky_relu(%x, {s})" for s in ("0.01", "-0.2", "0", "1.5", "%s=0.3")]
    + [f"aten::elu(%x, {a})" for a in ("1, 1, 1", "0.5, 2, 1.5", "-1.5, 1, 1", "1.6732632423543772, 1.0507009873554805, 1",
                                       "%s=0.5, %w=2.0, 1.5")]
    # ties x * beta == threshold at x = 0.5, 0, 2 and 0.5
    + [f"aten::softplus(%x, {a})" for a in ("1, 20", "2, 1", "0.5, 0", "1, 2.0", "-1, -0.5", "%s=2.0, %w=1.0")]
)
N_CHUNKS = 7


def _values(dtype, huge=True):
    fi = torch.finfo(dtype)
    return [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.5, 0.1, -1.5, fi.tiny ** 0.5 / 8,
            fi.max / 2 if huge else 1e4]


# the activations' fixed boundaries, where their gradients switch formulas, and each one's neighbours in the dtype
_BOUNDARIES = {"aten::hardswish": (-3.0, 3.0), "aten::hardsigmoid": (-3.0, 3.0), "aten::relu6": (6.0,)}


def _boundaries(name: str, dtype) -> list:
    out = []
    for b in _BOUNDARIES.get(name, ()):
        t = torch.tensor(b, dtype=dtype)
        out += [b] + [torch.nextafter(t, torch.tensor(v, dtype=dtype)).item() for v in (-INF, INF)]
    return out


class Case:
    def __init__(self, k: int, call: str):
        self.k, self.call = k, call
        self.name, argstr = call[:-1].split("(", 1)
        self.args = []  # (kind, name or value): kind t (tensor), c (condition), f (float input), k (constant)
        for a in (s.strip() for s in argstr.split(",")):
            if a.startswith("%c"):
                self.args.append(("c", "c"))
            elif a.startswith("%") and "=" in a:
                n, v = a[1:].split("=")
                self.args.append(("f", (n, float(v))))
            elif a.startswith("%"):
                self.args.append(("t", a[1:]))
            elif a == "None":
                self.args.append(("k", None))
            elif a.startswith('"'):
                self.args.append(("k", a.strip('"')))
            else:
                self.args.append(("k", int(a) if re.fullmatch(r"-?\d+", a) else float(a)))
        self.id = re.sub(r"[%\" ]", "", call[6:])

    def ir(self, inputs: list, floats: list) -> list:
        p, lines, names = f"k{self.k}_", [], []
        for j, (kind, v) in enumerate(self.args):
            if kind in "tc":
                inputs.append(f"%{p}{v} : Tensor")
                names.append(f"%{p}{v}")
            elif kind == "f":
                floats.append(f"%{p}{v[0]} : float")
                names.append(f"%{p}{v[0]}")
            else:
                ty = {type(None): "NoneType", str: "str", int: "int", float: "float"}[type(v)]
                val = "" if v is None else f'[value="{v}"]' if isinstance(v, str) else f"[value={v!r}]"
                lines.append(f"  %{p}a{j} : {ty} = prim::Constant{val}()")
                names.append(f"%{p}a{j}")
        lines.append(f"  %{p}r : Tensor = {self.name}({', '.join(names)})")
        return lines


CASES = [Case(k, c) for k, c in enumerate(CALLS)]
CHUNKS = [CASES[i::N_CHUNKS] for i in range(N_CHUNKS)]


def _group(cases) -> tuple[int, torch._C.Graph]:
    inputs, floats, body = [], [], []
    for c in cases:
        body += c.ir(inputs, floats)
    outs = ", ".join(f"%k{c.k}_r" for c in cases)
    g = torch.parse_ir(f"graph({', '.join(inputs + floats)}):\n" + "\n".join(body) + f"\n  return ({outs})\n")
    return STORE.register(lower(g)), g


def _inputs(case: Case, dtype, n: int, huge=True) -> dict:
    """Every combination of special values for the floating tensors (tiled over n elements), the condition
    alternating per tile."""
    names = [v for kind, v in case.args if kind == "t"]
    grid = list(itertools.product(_values(dtype, huge) + _boundaries(case.name, dtype), repeat=len(names)))
    out = {}
    for j, name in enumerate(names):
        col = torch.tensor([p[j] for p in grid], dtype=F64).to(dtype)
        out[name] = col.repeat(n // len(grid) + 1)[:n]
    out["c"] = (torch.arange(n) // len(grid)) % 2 == 0
    return out


def _eager(case: Case, node, tensors: dict):
    s = torch._C.parse_schema(node.schema())
    fn = getattr(getattr(torch.ops.aten, s.name.split("::")[1]), s.overload_name or "default")
    pos, kw = [], {}
    for a, (kind, v) in zip(s.arguments, case.args):
        val = tensors[v] if kind in "tc" else v[1] if kind == "f" else v
        (kw.__setitem__(a.name, val) if a.kwarg_only else pos.append(val))
    return fn(*pos, **kw)


N = 4 * 15 ** 3 + 4  # each ternary combination 4 times; a multiple of 64: eager's CPU loops stay vectorized
_G_SPECIAL = [INF, -INF, NAN, 0.0, -0.0, 1.0, -2.0]


def _grad_outputs(gmode, dtype, shape, gen):
    if gmode == "randn":
        return torch.randn(shape, generator=gen, dtype=F64).to(dtype)
    return torch.tensor(_G_SPECIAL, dtype=dtype)[torch.arange(N) % len(_G_SPECIAL)].reshape(shape)


def _fused_backward(outs) -> bool:
    return any(o.grad_fn.name() in FUSED_BACKWARD for o in outs if o.grad_fn is not None)


def _differentiable_alone(case: Case, dtype) -> bool:
    """Whether the derivative table forms this case's gradient (else its group runs in the interpreter, and one
    such case would send a whole wide group there)."""
    key, graph = _group([case])
    kinds = [kind for kind, _ in case.args if kind in "tcf"]
    needs = tuple(kind == "t" for kind in kinds if kind != "f") + (False,) * kinds.count("f")
    sig = tuple((torch.bool if kind == "c" else dtype, False) for kind in kinds if kind != "f")
    return autodiff.backward_for(STORE.get(key), needs, (True,), sig) is not None


@functools.lru_cache(maxsize=None)
def _chunk_results(chunk: int, dtype, gmode: str, order: int):
    """For each case of the chunk: (inputs, grad output, fused gradients, eager gradients by input name, whether
    the fused backward ran). The cases the table differentiates run as one group, the others one by one.
    order 2: the gradients of sum(w * first gradients) with respect to the inputs and the grad output."""
    fused_cases = [c for c in CHUNKS[chunk] if _differentiable_alone(c, dtype)]
    results = {}
    for cases in [fused_cases] + [[c] for c in CHUNKS[chunk] if c not in fused_cases]:
        results.update(_group_results(cases, dtype, gmode, order, 1234 + chunk * 1000 + cases[0].k,
                                      expect_fused=cases is fused_cases))
    return results


# eager implements no derivative of hardsigmoid_backward (grad / 6 inside (-3, 3), else 0). It is linear in grad
# and piecewise constant in x: the exact double backward is 0 for x and eager's own kernel on the weights for grad.
_NO_EAGER_DOUBLE_BACKWARD = {
    "aten::hardsigmoid": lambda x, w: [torch.zeros_like(x), torch.ops.aten.hardsigmoid_backward(w, x)],
}


def _group_results(cases, dtype, gmode, order, seed, expect_fused):
    key, graph = _group(cases)
    nodes = [n for n in graph.nodes() if n.kind() != "prim::Constant"]
    gen = torch.Generator().manual_seed(seed)
    data = [_inputs(c, dtype, N, huge=order == 1) for c in cases]
    args, floats, leaves = [], [], []
    for c, d in zip(cases, data):
        for kind, v in c.args:
            if kind in "tc":
                t = d[v].clone().requires_grad_(kind == "t")
                args.append(t)
                leaves.append((c.k, v, t))
            elif kind == "f":
                floats.append(v[1])
    outs = fuser.run_fusion(key, args + floats)
    fused_used = _fused_backward(outs)
    gouts = [_grad_outputs(gmode, dtype, o.shape, gen).requires_grad_(order == 2) for o in outs]
    diff = [t for _, _, t in leaves if t.requires_grad]
    mine = torch.autograd.grad(outs, diff, gouts, allow_unused=True, create_graph=order == 2)
    weights = [torch.linspace(0.5, 1.5, N, dtype=dtype) * (1 + j / 7) for j in range(3)]
    if order == 2:
        pos = {(c.k, v): j for c in cases for j, v in enumerate(v for kind, v in c.args if kind == "t")}
        wanted = [(k, v) for k, v, t in leaves if t.requires_grad]
        s = sum((m * weights[pos[kv]]).sum() for m, kv in zip(mine, wanted) if m is not None and m.requires_grad)
        mine = torch.autograd.grad(s, diff + gouts, allow_unused=True) if torch.is_tensor(s) else \
            [None] * (len(diff) + len(gouts))
    mine_by = dict(zip([(k, v) for k, v, t in leaves if t.requires_grad], mine))
    mine_g = dict(zip([c.k for c in cases], mine[len(diff):]))
    results = {}
    for c, d, node, g in zip(cases, data, nodes, gouts):
        ts = {v: d[v].clone().requires_grad_(v != "c") for v in d}
        names = [v for kind, v in c.args if kind == "t"]
        ref = _eager(c, node, ts)
        g = g.detach().requires_grad_(order == 2)
        theirs = torch.autograd.grad(ref, [ts[v] for v in names], g, allow_unused=True, create_graph=order == 2)
        fused = {v: mine_by[(c.k, v)] for v in names}
        if order == 2:
            s = sum((m * w).sum() for m, w in zip(theirs, weights) if m is not None and m.requires_grad)
            if c.name in _NO_EAGER_DOUBLE_BACKWARD:
                theirs = _NO_EAGER_DOUBLE_BACKWARD[c.name](d["x"], weights[0])
            elif torch.is_tensor(s):
                theirs = torch.autograd.grad(s, [ts[v] for v in names] + [g], allow_unused=True)
            else:
                theirs = [None] * (len(names) + 1)
            fused["grad_output"] = mine_g[c.k]
            names = names + ["grad_output"]
        results[c.k] = (d, g.detach(), fused, dict(zip(names, theirs)), fused_used or not expect_fused)
    return results


def _compare(case: Case, res, dtype, what="", atol=None):
    d, g, fused, eager, fused_used = res
    assert fused_used, f"{case.call}: the group did not run as a fused differentiable op"
    problems = []
    for name, e in eager.items():
        m = fused[name]
        if m is None or e is None:  # no gradient on one side: the other must be zeros (eager's zeros_like)
            z = e if m is None else m
            if z is not None and not bool((z == 0).all()):
                problems.append(f"{name}: fused {'None' if m is None else 'zeros'}, eager "
                                f"{'None' if e is None else 'nonzero'}")
            continue
        ok = torch.isclose(m, e, equal_nan=True, **dict(TOL[dtype], **({"atol": atol} if atol else {})))
        if not bool(ok.all()):
            idx = (~ok).nonzero().flatten()[:4].tolist()
            names = [v for kind, v in case.args if kind in "tc"]
            at = "; ".join(f"({', '.join(f'{v}={d[v][i].item():.4g}' for v in names)}, g={g[i].item():.4g}): "
                           f"fused {m[i].item():.6g} eager {e[i].item():.6g}" for i in idx)
            problems.append(f"d{name}{what} differs at {int((~ok).sum())} points, e.g. {at}")
    assert not problems, f"{case.call} [{dtype}]: " + " | ".join(problems)


_PARAMS = [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("gmode", ["randn", "nonfinite"])
@pytest.mark.parametrize("dtype", [F64, F32], ids=str)
@pytest.mark.parametrize("case", _PARAMS)
def test_formula_at_special_points(case, dtype, gmode):
    """All combinations of NaN, +-inf, +-0, ties with the case's scalars, huge and tiny values; output gradients
    random or non-finite."""
    res = _chunk_results(CASES.index(case) % N_CHUNKS, dtype, gmode, 1)[case.k]
    _compare(case, res, dtype)


@pytest.mark.parametrize("case", _PARAMS)
def test_double_backward_at_special_points(case):
    res = _chunk_results(CASES.index(case) % N_CHUNKS, F64, "randn", 2)[case.k]
    _compare(case, res, F64, " (double backward)", atol=1e-13)  # sums of terms near 1 may cancel


# groups the derivative table does not differentiate run in the interpreter, which records eager's autograd
@pytest.mark.parametrize("call, ref", [
    ("aten::lgamma(%x)", lambda x, y, z: torch.lgamma(x)),
    ("aten::remainder(%x, %y)", lambda x, y, z: torch.remainder(x, y)),
    ("aten::clamp(%x, %y, %z)", lambda x, y, z: torch.clamp(x, y, z)),
    ("aten::pow(%x, %s=1.5)", lambda x, y, z: torch.pow(x, 1.5)),
    ("aten::pow(0.0, %x)", lambda x, y, z: torch.pow(0.0, x)),
    ("aten::pow(-2.0, %x)", lambda x, y, z: torch.pow(-2.0, x)),
], ids=lambda v: re.sub(r"[%\" ]", "", v[6:]) if isinstance(v, str) else "")
def test_unsupported_formulas_fall_back_to_eager_autograd(call, ref):
    c = Case(0, call)
    names = [v for kind, v in c.args if kind == "t"]
    floats = [v[1] for kind, v in c.args if kind == "f"]
    ir = f"graph({', '.join([f'%{n} : Tensor' for n in names] + ['%s : float'] * len(floats))}):\n"
    ir += "\n".join(line.replace("%k0_", "%") for line in c.ir([], [])) + "\n  return (%r)\n"
    d = _inputs(c, F64, 15 ** len(names) * 4 + 4)
    xs = [d[n].clone().requires_grad_() for n in names]
    out = fuser.run_fusion(STORE.register(lower(torch.parse_ir(ir))), xs + floats)[0]
    assert not _fused_backward([out])
    g = torch.randn_like(out)
    refs = [t.detach().clone().requires_grad_() for t in xs]
    full = dict(zip(names, refs))
    mine = torch.autograd.grad(out, xs, g)
    theirs = torch.autograd.grad(ref(*(full.get(n) for n in "xyz")), refs, g)
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m, t, equal_nan=True, **TOL[F64])


# ---------------------------------------------------------------------------------------------------------------


def _run(ir: str, args: list):
    outs = fuser.run_fusion(STORE.register(lower(torch.parse_ir(ir))), args)
    return outs


def _leaves(ts):
    return [t.detach().clone().requires_grad_(t.is_floating_point() or t.is_complex()) for t in ts]


def _assert_grads(mine, theirs, dtype=None):
    assert len(mine) == len(theirs)
    for m, t in zip(mine, theirs):
        assert (m is None) == (t is None), (m, t)
        if m is None:
            continue
        assert m.dtype == t.dtype and m.shape == t.shape, (m.dtype, t.dtype, m.shape, t.shape)
        torch.testing.assert_close(m, t, equal_nan=True, **TOL[dtype or (F64 if t.dtype == F64 else F32)])


CAST_IR = """graph(%x : Tensor, %s : Tensor):
  %a : Tensor = aten::type_as(%x, %s)
  %b : Tensor = aten::sin(%a)
  %r : Tensor = aten::mul(%b, %x)
  return (%r)
"""


@pytest.mark.parametrize("xd, sd", [(F64, F32), (F32, F64), (F64, torch.int32), (F32, torch.bool)], ids=str)
def test_type_as_gradient_in_each_dtype(xd, sd):
    """Eager's autograd casts the gradient of type_as's result back to self's dtype at the cast: a gradient that
    a narrower intermediate dtype cannot hold overflows or underflows there (float->int casts stop it).
    (float16/bfloat16 intermediates are left out: fused kernels compute them in float, by design.)"""
    x = torch.tensor([0.1, 1.0, 2.0, -3.0, 0.25, 0.0], dtype=xd)
    s = torch.zeros(6, dtype=sd)
    g = torch.tensor([1 / 3, 1e300, 1e-300, 7e4, 1e-8, -2.0], dtype=F64).to(torch.promote_types(xd, sd)
                                                                          if sd.is_floating_point else xd)
    mine_in = _leaves([x, s])
    out = _run(CAST_IR, mine_in)[0]
    assert _fused_backward([out])
    ref_in = _leaves([x, s])
    ref = torch.sin(ref_in[0].type_as(ref_in[1])) * ref_in[0]
    g = g.to(ref.dtype)
    _assert_grads(torch.autograd.grad(out, mine_in[:1], g), torch.autograd.grad(ref, ref_in[:1], g))


@pytest.mark.parametrize("body, ref", [
    ("%a : Tensor = aten::mul(%x, %y)\n  %r : Tensor = aten::floor(%a)", lambda x, y: torch.floor(x * y)),
    ("%a : Tensor = aten::sin(%x)\n  %b : Tensor = aten::round(%a)\n  %r : Tensor = aten::add(%b, %y, %one)",
     lambda x, y: torch.round(torch.sin(x)) + y),
    ("%a : Tensor = aten::div(%x, %y)\n  %r : Tensor = aten::trunc(%a)", lambda x, y: torch.trunc(x / y)),
], ids=["floor_of_product", "round_of_sin", "trunc_of_quotient"])
def test_zero_gradient_op_inside_a_group(body, ref):
    """floor/round/trunc/ceil of an intermediate: eager propagates zeros_like(grad) through the ops before it
    (zeros, and NaN where 0 * inf), and every input gets a tensor, not None."""
    ir = f"graph(%x : Tensor, %y : Tensor):\n  %one : int = prim::Constant[value=1]()\n  {body}\n  return (%r)\n"
    x = torch.tensor([1.0, 2.0, INF, 0.0, -1.5, NAN], dtype=F64)
    y = torch.tensor([0.5, INF, 1.0, 0.0, 2.0, 1.0], dtype=F64)
    mine_in, ref_in = _leaves([x, y]), _leaves([x, y])
    out = _run(ir, mine_in)[0]
    assert _fused_backward([out])
    out.backward(torch.ones_like(out))
    ref(*ref_in).backward(torch.ones_like(out))
    _assert_grads([t.grad for t in mine_in], [t.grad for t in ref_in])


MUL_IR = """graph(%x : Tensor, %y : Tensor):
  %r : Tensor = aten::mul(%x, %y)
  return (%r)
"""


@pytest.mark.parametrize("x, y", [
    # the float64 products cancel in the sum: cast to float32 first, they no longer do
    (torch.ones(1, dtype=F32), torch.tensor([1e8, 1.0, -1e8], dtype=F64)),
    (torch.ones(2, 1, dtype=F32), torch.tensor([[3e38, 3e38, -3e38, 1.0]], dtype=F64)),
    # a 0-dim float64 times float32: eager sums the float32 gradient (overflowing), then casts
    (torch.tensor(1.0, dtype=F64), torch.full((4,), 3e38, dtype=F32)),
], ids=["f32_1_x_f64_3", "f32_2x1_x_f64_1x4", "f64_0dim_x_f32_4"])
def test_broadcast_gradient_is_summed_before_the_cast(x, y):
    """The engine reduces a broadcast gradient to the input's shape in the gradient's dtype, then casts it."""
    mine_in, ref_in = _leaves([x, y]), _leaves([x, y])
    out = _run(MUL_IR, mine_in)[0]
    assert _fused_backward([out])
    g = torch.ones_like(out)
    _assert_grads(torch.autograd.grad(out, mine_in, g), torch.autograd.grad(ref_in[0] * ref_in[1], ref_in, g))


@pytest.mark.parametrize("op", ["pow", "atan2", "div", "maximum", "fmod"])
@pytest.mark.parametrize("da, db", [(F32, F64), (F64, F32)], ids=str)
def test_mixed_dtypes_same_shape(op, da, db):
    """float32 with float64 operands (no broadcast): eager computes every gradient in the promoted dtype."""
    ir = f"graph(%x : Tensor, %y : Tensor):\n  %r : Tensor = aten::{op}(%x, %y)\n  return (%r)\n"
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(64, generator=gen, dtype=F64) * 2 + 0.25).to(da)
    y = (torch.randn(64, generator=gen, dtype=F64) * 2).to(db)
    mine_in, ref_in = _leaves([x, y]), _leaves([x, y])
    out = _run(ir, mine_in)[0]
    assert _fused_backward([out])
    g = torch.randn(64, generator=gen, dtype=F64)
    _assert_grads(torch.autograd.grad(out, mine_in, g),
                  torch.autograd.grad(getattr(torch, op)(*ref_in), ref_in, g))


MULTI_IR = """graph(%x : Tensor, %y : Tensor, %z : Tensor, %s : float):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %x)
  %b : Tensor = aten::sin(%x)
  %c : Tensor = aten::add(%a, %b, %s)
  %d : Tensor = aten::maximum(%c, %y)
  %e : Tensor = aten::lt(%x, %y)
  %f : Tensor = aten::where(%e, %d, %z)
  %k : Tensor = aten::cos(%z)
  %h : Tensor = aten::mul(%k, %x)
  return (%c, %d, %c, %e, %f, %h, %b)
"""


def _multi_ref(x, y, z, s):
    a = x * x
    b = torch.sin(x)
    c = torch.add(a, b, alpha=s)
    d = torch.maximum(c, y)
    e = x < y
    return c, d, c, e, torch.where(e, d, z), torch.cos(z) * x, b


@pytest.mark.parametrize("which", [(0,), (1, 5), (0, 2), (2, 4, 6), (0, 1, 2, 4, 5, 6)], ids=str)
@pytest.mark.parametrize("dtype", [F64, F32], ids=str)
def test_multi_output_groups(which, dtype):
    """Gradients for some outputs only; an output returned twice; x used by four ops and a 0-dim z by two
    (accumulation); ties of maximum; non-contiguous and expanded output gradients."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=gen, dtype=F64).to(dtype)
    y = torch.randn(4, generator=gen, dtype=F64).to(dtype)
    x[0, :] = torch.tensor([NAN, INF, 0.0, -1.0])
    y[1] = float(x[1, 1] * x[1, 1] + torch.sin(x[1, 1]) * 0.5)  # a tie of maximum (x[1,1] below y[1] or not)
    z = torch.tensor(0.7, dtype=dtype)
    mine_in, ref_in = _leaves([x, y, z]), _leaves([x, y, z])
    outs = _run(MULTI_IR, mine_in + [0.5])
    refs = _multi_ref(*ref_in, 0.5)
    assert _fused_backward(outs)
    assert [o.requires_grad for o in outs] == [r.requires_grad for r in refs]
    gs = [torch.randn(4, 5, generator=gen, dtype=F64).to(dtype).t(),  # non-contiguous
          torch.randn(4, generator=gen, dtype=F64).to(dtype).expand(5, 4),  # expanded
          torch.randn(5, 8, generator=gen, dtype=F64).to(dtype)[:, ::2],  # strided
          None, torch.randn(5, 4, generator=gen, dtype=F64).to(dtype),
          torch.randn(5, 1, generator=gen, dtype=F64).to(dtype).expand(5, 4),
          torch.randn(5, 4, generator=gen, dtype=F64).to(dtype)]
    mine = torch.autograd.grad([outs[i] for i in which], mine_in, [gs[i] for i in which], allow_unused=True)
    theirs = torch.autograd.grad([refs[i] for i in which], ref_in, [gs[i] for i in which], allow_unused=True)
    _assert_grads(mine, theirs)


@pytest.mark.parametrize("ir, ref", [
    ("""graph(%x : Tensor, %b : Tensor):
      %one : int = prim::Constant[value=1]()
      %p : Tensor = aten::add(%x, %b, %one)
      %q : Tensor = aten::tanh(%b)
      return (%p, %q)""", lambda x, b: (x + b, torch.tanh(b))),
    ("""graph(%x : Tensor, %b : Tensor):
      %one : int = prim::Constant[value=1]()
      %v : Tensor = aten::sin(%b)
      %p : Tensor = aten::add(%x, %v, %one)
      %q : Tensor = aten::mul(%v, %v)
      return (%p, %q)""", lambda x, b: (x + torch.sin(b), torch.sin(b) * torch.sin(b))),
], ids=["bias_used_twice", "intermediate_used_twice"])
@pytest.mark.parametrize("bshape", [(3,), ()], ids=str)
def test_outputs_of_different_shapes(ir, ref, bshape):
    """b (or a value of b's shape) reaches a (4, 3) output and a smaller one: eager reduces each gradient to b's
    shape before adding them; the smaller gradient must not be broadcast and summed over the other's shape."""
    gen = torch.Generator().manual_seed(5)
    x, b = torch.randn(4, 3, generator=gen, dtype=F64), torch.randn(bshape, generator=gen, dtype=F64)
    mine_in, ref_in = _leaves([x, b]), _leaves([x, b])
    outs = _run(ir, mine_in)
    refs = ref(*ref_in)
    gs = [torch.randn(r.shape, generator=gen, dtype=F64) for r in refs]
    _assert_grads(torch.autograd.grad(outs, mine_in, gs), torch.autograd.grad(refs, ref_in, gs))


def test_outputs_that_depend_on_no_input_requiring_grad_do_not_require_grad():
    """As in eager: cos(y) with y not requiring grad, and where() selecting between such tensors, have no
    grad_fn, even when another output of the group does."""
    ir = """graph(%x : Tensor, %y : Tensor, %z : Tensor):
      %a : Tensor = aten::sin(%x)
      %b : Tensor = aten::cos(%y)
      %c : Tensor = aten::gt(%x, %y)
      %w : Tensor = aten::where(%c, %y, %z)
      return (%a, %b, %w)
    """
    x = torch.randn(6, requires_grad=True)
    y, z = torch.randn(6), torch.randn(6)
    outs = _run(ir, [x, y, z])
    assert _fused_backward(outs)
    refs = (torch.sin(x), torch.cos(y), torch.where(x > y, y, z))
    assert [o.requires_grad for o in outs] == [r.requires_grad for r in refs]


def test_complex_inputs_keep_their_gradients():
    """A complex input (or output) is not something the float formulas differentiate: eager's autograd must
    still record the group (the output requires grad and both inputs get gradients)."""
    x = torch.randn(4, dtype=F32)
    z = torch.randn(4, dtype=torch.complex64)
    mine_in, ref_in = _leaves([x, z]), _leaves([x, z])
    out = _run(MUL_IR, mine_in)[0]
    ref = ref_in[0] * ref_in[1]
    assert out.requires_grad == ref.requires_grad
    g = torch.randn(4, dtype=torch.complex64)
    _assert_grads(torch.autograd.grad(out, mine_in, g), torch.autograd.grad(ref, ref_in, g), F32)


def test_one_tensor_passed_as_two_inputs():
    """The engine adds the gradients of both arguments; with broadcasting one of them is summed first."""
    x = torch.tensor([[NAN, 0.0, -0.0], [INF, 1.5, -2.0]], dtype=F64)
    (m,), (e,) = _leaves([x]), _leaves([x])
    out = _run(MUL_IR, [m, m])[0]
    assert _fused_backward([out])
    g = torch.randn(2, 3, dtype=F64)
    _assert_grads(torch.autograd.grad(out, m, g), torch.autograd.grad(e * e, e, g))
