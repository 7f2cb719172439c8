"""The activation entries of the op table (hardswish, hardsigmoid, relu6, leaky_relu, elu, softplus, mish) at
their boundaries against eager on the CPU backend: the switch points and their neighbours in each dtype, ties
x * beta == threshold, signed zeros, NaN, infinities, huge and tiny values (gradients too; with special output
gradients and double backward: test_autodiff_edges.py); the per-target expressions they carry for CUDA; double
backward at random points."""
import dataclasses

import pytest
import torch
from helpers import FLOAT_DTYPES, assert_same

import fuser
from fuser import codegen, compiler, executor, ops
from fuser.descs import DENSE, ArgSpec, TensorDesc
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

NAN, INF = float("nan"), float("inf")

# (call with %x the input and constants inline, eager, boundaries); eager's kernels are plain arithmetic for the
# first four, so the fused results must be bit-equal; elu, softplus and mish call libm (glibc here, SLEEF in eager)
CALLS = [
    ("aten::hardswish(%x)", torch.nn.functional.hardswish, (-3.0, 3.0)),
    ("aten::hardsigmoid(%x)", torch.nn.functional.hardsigmoid, (-3.0, 3.0)),
    ("aten::relu6(%x)", torch.nn.functional.relu6, (0.0, 6.0)),
    ("aten::leaky_relu(%x, 0.01)", lambda x: torch.nn.functional.leaky_relu(x, 0.01), (0.0,)),
    ("aten::leaky_relu(%x, -0.2)", lambda x: torch.nn.functional.leaky_relu(x, -0.2), (0.0,)),
    ("aten::leaky_relu(%x, 0)", lambda x: torch.nn.functional.leaky_relu(x, 0), (0.0,)),
    ("aten::elu(%x, 1, 1, 1)", torch.nn.functional.elu, (0.0,)),
    ("aten::elu(%x, -1.5, 1, 1)", lambda x: torch.ops.aten.elu(x, -1.5, 1, 1), (0.0,)),
    ("aten::elu(%x, 1.6732632423543772, 1.0507009873554805, 1)", torch.selu, (0.0,)),
    ("aten::elu(%x, 0.5, 2, 1.5)", lambda x: torch.ops.aten.elu(x, 0.5, 2, 1.5), (0.0,)),
    ("aten::softplus(%x, 1, 20)", torch.nn.functional.softplus, (20.0,)),
    ("aten::softplus(%x, 2, 1)", lambda x: torch.nn.functional.softplus(x, 2, 1), (0.5,)),
    ("aten::softplus(%x, 0.5, 0)", lambda x: torch.nn.functional.softplus(x, 0.5, 0), (0.0,)),
    ("aten::softplus(%x, -1, -0.5)", lambda x: torch.nn.functional.softplus(x, -1, -0.5), (0.5,)),
    ("aten::mish(%x)", torch.nn.functional.mish, ()),
]
EXACT = ("hardswish", "hardsigmoid", "relu6", "leaky_relu")


@pytest.fixture(autouse=True)
def _needs_cpu_fusion():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


def _name(call: str) -> str:
    return call[6:].split("(")[0]


def _graph(call: str) -> torch._C.Graph:
    name, args = call[:-1].split("(", 1)
    consts, names = [], ["%x"]
    for j, a in enumerate(s.strip() for s in args.split(",")[1:]):
        ty = "int" if a.lstrip("-").isdigit() else "float"
        consts.append(f"  %c{j} : {ty} = prim::Constant[value={a}]()")
        names.append(f"%c{j}")
    return torch.parse_ir(f"graph(%x : Tensor):\n" + "\n".join(consts)
                          + f"\n  %r : Tensor = {name}({', '.join(names)})\n  return (%r)\n")


def _around(b: float, dtype) -> list:
    """b and its neighbours in ``dtype`` (b +- 0.75 ulp rounds to the next value either way)."""
    fi = torch.finfo(dtype)
    step = 0.75 * fi.eps * (abs(b) if b else fi.tiny)
    return [b - step, b, b + step]


def boundary_points(boundaries, dtype) -> torch.Tensor:
    """Each boundary, its negation and their neighbours in ``dtype``, signed zeros, NaN, infinities, the largest and
    smallest values, a spread of ordinary ones; 64 copies, so that eager's CPU loops stay vectorized."""
    fi = torch.finfo(dtype)
    vals = [NAN, INF, -INF, 0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny * fi.eps, fi.max, -fi.max, 1.0, -1.0, 1e4, -1e4,
            -100.0, 100.0, 30.0, -30.0]
    vals += [v for b in boundaries for v in _around(b, dtype) + _around(-b, dtype)]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    t = torch.cat([t, torch.linspace(-8, 8, 64 - t.numel() % 64 + 64, dtype=dtype)])
    return t.repeat(64)


def check_at_boundaries(call, ref, boundaries, dtype, device="cpu", grads=False):
    """The fused op against eager on :func:`boundary_points`: the same NaNs and signs of zeros, bit-equal values
    for the piecewise-linear ops, others within the dtype's tolerance; with ``grads``, also the gradient for a
    random output gradient (at non-NaN points)."""
    x = boundary_points(boundaries, dtype).to(device)
    key = STORE.register(lower(_graph(call)))
    out = executor.run(STORE.get(key), [x])
    assert out is not None, f"{call} on {dtype} fell back"
    y, expected = out[0], ref(x)
    assert torch.equal(y.isnan(), expected.isnan()), (x[y.isnan() != expected.isnan()][:8])
    zeros = (y == 0) & (expected == 0)
    assert torch.equal(y.signbit()[zeros], expected.signbit()[zeros]), x[zeros & (y.signbit() != expected.signbit())]
    if _name(call) in EXACT:
        same = (y == expected) | (y.isnan() & expected.isnan())
        assert bool(same.all()), [(a.item(), b.item(), c.item()) for a, b, c in zip(x[~same], y[~same], expected[~same])][:6]
    else:
        assert_same(y, expected)
    if grads:
        x = x[~x.isnan()]
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = fuser.run_fusion(key, [mine])[0]
        g = torch.randn_like(out)
        assert_same(torch.autograd.grad(out, mine, g)[0], torch.autograd.grad(ref(theirs), theirs, g)[0])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("call, ref, boundaries", CALLS, ids=[c[0][6:] for c in CALLS])
def test_at_boundaries(call, ref, boundaries, dtype):
    check_at_boundaries(call, ref, boundaries, dtype, grads=dtype in (torch.float32, torch.float64))


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64, torch.uint8, torch.int8), ids=str)
def test_relu6_of_integers_like_eager(dtype):
    """eager's relu6 is hardtanh(x, 0, 6), a clamp that takes integers (uint8 wraps before it clamps)"""
    x = torch.arange(-300, 300, dtype=torch.int64).to(dtype)
    out = executor.run(STORE.get(STORE.register(lower(_graph("aten::relu6(%x)")))), [x])
    assert out is not None and torch.equal(out[0], torch.nn.functional.relu6(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("call", [c for c, _, _ in CALLS if ops.OPS_BY_NAME[_name(c)].targets], ids=lambda c: c[6:])
def test_target_expressions_reach_that_target_only(call, dtype, monkeypatch):
    """An op whose eager CUDA kernel computes differently gets its own expression in CUDA kernels, and CPU kernels
    keep the common one. (Their values against eager's CUDA kernels: tests/test_gpu.py, on a GPU.)"""
    spec = STORE.get(STORE.register(lower(_graph(call))))
    descs = (TensorDesc(dtype, DENSE),)
    types = compiler.infer_types(spec, ArgSpec("cpu", None, descs, True))
    sources = {t: codegen.generate(spec.group, descs, types, t, "k") for t in codegen.TARGETS}
    op = ops.OPS_BY_NAME[_name(call)]
    monkeypatch.setitem(ops.OPS_BY_OVERLOAD, op.schemas[0].split("(")[0], dataclasses.replace(op, targets={}))
    without = {t: codegen.generate(spec.group, descs, types, t, "k") for t in codegen.TARGETS}
    assert sources["cpu"] == without["cpu"]
    assert sources["cuda"] != without["cuda"]


@pytest.mark.parametrize("call", [c for c, _, _ in CALLS if "hardsigmoid" not in c], ids=lambda c: c[6:])
def test_double_backward_at_random_points(call):
    """(hardsigmoid: eager has no double backward; test_autodiff_edges.py checks the fused one against the exact one)"""
    key = STORE.register(lower(_graph(call)))
    x = (torch.randn(40, dtype=torch.float64) * 4).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: fuser.run_fusion(key, [t])[0], (x,))
