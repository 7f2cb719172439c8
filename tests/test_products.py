"""Chains of multiplications differentiated as one product (fuser/products.py, used by fuser/backward.py): which
chains fold, the backward groups they give, and their gradients against eager's autograd (float64 truth, and
eager's own dtype) on the CPU backend and through the CUDA kernels' host emulation, special values included."""
import math

import pytest
import torch
from helpers import FUSED_BACKWARD, tolerances

import fuser
from fuser import autodiff, backward, ir, products
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower


def _fused(fn):
    return fuser.fuse(torch.jit.script(fn))


def cube(x):
    return 0.044715 * x * x * x


def two_leaves(x, y):
    return x * y * 2.0 * x


def broadcast_bias(x, b):
    return (x * b) * (x * 0.5) + b


def intermediate_out(x, y, z):
    t = x * y
    return t, t * z * 3.0


def intermediate_twice(x, y, z):
    t = x * y * 0.5
    return t * z + t


def gelu_bias(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def huge(x):
    return x * 1e30 * 1e30 * x


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FUNCTIONS = [cube, two_leaves, broadcast_bias, intermediate_out, intermediate_twice, gelu_bias]  # (huge: below)
SHAPES = {"broadcast_bias": [(33, 40), (40,)], "gelu_bias": [(33, 40), (40,)]}


def _inputs(fn, dtype, scale=1.0):
    n = fn.__code__.co_argcount
    shapes = SHAPES.get(fn.__name__, [(33, 40)] * n)
    return [(torch.randn(s, dtype=torch.float64) * scale).to(dtype) for s in shapes]


def _grads(fn, xs, gs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    out = list(out) if isinstance(out, tuple) else [out]
    return out, torch.autograd.grad(out, xs, gs)


def _group_of(fn):
    return lower(torch.jit.script(fn).graph)


# ------------------------------------------------------------------------------------------- which chains fold

def _products(fn):
    g = _group_of(fn)
    floating = frozenset([v.id for v in g.inputs] + [n.out.id for n in g.nodes])
    return g, products.find(g, floating)


def test_a_cube_folds_into_one_product():
    g, found = _products(cube)
    (root, p), = found.items()
    assert root == g.outputs[0].id
    assert p.coefficient == 0.044715
    assert [(f.id, e) for f, e in p.factors] == [(g.inputs[0].id, 3)]


def test_an_intermediate_read_elsewhere_ends_a_chain():
    b = ir.Builder()
    x, y, z = b.input(), b.input(), b.input()
    t = b.call("aten::mul", x, y)
    u = b.call("aten::mul", b.call("aten::mul", t, z), 3.0)  # t is an output: the chain stops at it
    w = b.call("aten::mul", b.call("aten::mul", x, 0.5), y)  # read twice: the chain stops at it
    v = b.call("aten::add", b.call("aten::mul", w, z), w, 1)
    g = b.build([t, u, v])
    found = products.find(g, frozenset([x.id, y.id, z.id] + [n.out.id for n in g.nodes]))
    assert t.id not in found  # x * y: one step, no repeat: the op-by-op formula
    assert [f.id for f, _ in found[u.id].factors] == [t.id, z.id] and found[u.id].coefficient == 3.0
    assert [f.id for f, _ in found[w.id].factors] == [x.id, y.id] and found[w.id].coefficient == 0.5
    assert len(found) == 2  # w * z: a two-factor product of its own
    assert not products.find(g, frozenset([x.id, y.id, z.id]))  # integer results: nothing folds


def test_numbers_whose_product_leaves_float32_are_not_folded():
    _, found = _products(huge)
    assert found == {}


def test_the_gelu_backward_has_fewer_steps(monkeypatch):
    """GELU's backward group: the cube's three product-rule terms become one product (a GPU's instruction count)."""
    g = _group_of(gelu_bias)
    spec = STORE.get(STORE.register(g))
    floating = frozenset([v.id for v in g.inputs] + [n.out.id for n in g.nodes])

    def steps():
        bw = backward.build_backward(spec, (True, True), (True,), floating)
        return sum(n.op != "aten::type_as" for n in bw.spec.group.nodes)  # (a cast in float: no instruction)
    folded = steps()
    monkeypatch.setattr(products, "find", lambda *a: {})
    assert (folded, steps()) == (21, 25)


# --------------------------------------------------------------------------------- gradients against eager's

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_fused_gradients_match_eager(fn, dtype, device):
    fused = _fused(fn)
    xs = [x.to(device) for x in _inputs(fn, dtype)]
    gs = [torch.randn(o.shape, dtype=dtype, device=device) for o in _as_list(fn(*xs))]
    for _ in range(3):  # the profiling executor fuses from the second call
        got_out, got = _grads(fused, xs, gs)
    assert any(o.grad_fn is not None and o.grad_fn.name() in FUSED_BACKWARD for o in got_out)
    _, eager = _grads(fn, xs, gs)
    _, truth = _grads(fn, [x.double() for x in xs], [g.double() for g in gs])
    tol = tolerances(dtype)
    for m, e, t in zip(got, eager, truth):
        assert m.dtype == dtype and m.shape == t.shape
        scale = max(1.0, t.abs().max().item())
        if dtype == torch.bfloat16:  # eager rounds every step: as close to the truth as eager, within a unit
            bad = (m.double() - t).abs() > (e.double() - t).abs() + tol["atol"] * scale + tol["rtol"] * t.abs()
            assert not bool(bad.any()), (m[bad][:5], e[bad][:5], t[bad][:5])
        else:
            torch.testing.assert_close(m.double(), t, rtol=tol["rtol"], atol=tol["atol"] * scale)


def _as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


def test_gradcheck_of_folded_chains():
    for fn in (cube, two_leaves, broadcast_bias, gelu_bias):
        key = STORE.register(_group_of(fn))
        xs = [x.requires_grad_() for x in _inputs(fn, torch.float64)]
        assert torch.autograd.gradcheck(lambda *ts: fuser.run_fusion(key, list(ts))[0], xs), fn.__name__


@pytest.mark.parametrize("device", DEVICES)
def test_special_values_meet_as_in_eager(device):
    """Zeros, infinities and NaNs: the same factors meet in each gradient as in eager's terms."""
    fused = _fused(two_leaves)
    x = torch.tensor([0.0, math.inf, -math.inf, math.nan, 1.0, 0.0, 2.0, 1e20])
    y = torch.tensor([math.inf, 0.0, 1.0, 2.0, math.nan, 0.0, -3.0, 1e20])
    g = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    x, y, g = x.to(device), y.to(device), g.to(device)
    for _ in range(3):
        _, got = _grads(fused, [x, y], [g])
    _, want = _grads(two_leaves, [x, y], [g])
    for m, e in zip(got, want):
        torch.testing.assert_close(m, e, equal_nan=True, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_huge_numbers_keep_eagers_zero_gradient(device):
    fused = _fused(huge)
    x = torch.tensor([1.0, -2.0, 0.0, 3.0], device=device)
    g = torch.tensor([0.0, 1.0, 0.0, 0.0], device=device)
    for _ in range(3):
        _, got = _grads(fused, [x], [g])
    _, want = _grads(huge, [x], [g])
    torch.testing.assert_close(got[0], want[0], equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_backward_kernels_emulated(dtype):
    """The backward groups' CUDA kernels, through the host emulation, against float64 eager."""
    for fn in (cube, two_leaves, gelu_bias):
        g = _group_of(fn)
        spec = STORE.get(STORE.register(g))
        n = len(g.inputs)
        bw = autodiff.backward_for(spec, (True,) * n, (True,), tuple((dtype, False) for _ in range(n)))
        xs = _inputs(fn, dtype)
        grad = torch.randn(_as_list(fn(*xs))[0].shape, dtype=dtype)
        args = [xs[j] for j in bw.fwd_inputs] + [grad]
        outs = emulate.run_graph(bw.spec.group, args)
        _, truth = _grads(fn, [x.double() for x in xs], [grad.double()])
        tol = tolerances(dtype)
        for j, r in zip(bw.grad_inputs, outs):
            t = truth[j]
            scale = max(1.0, t.abs().max().item())
            torch.testing.assert_close(r.sum_to_size(t.shape).double(), t, rtol=tol["rtol"] * 4,
                                       atol=tol["atol"] * 4 * scale)
