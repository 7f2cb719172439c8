"""Fusion groups under autograd (fuser/autodiff.py, fuser/derivatives.py) on the CPU backend: gradcheck in
float64 for every op of the table, broadcast, chunked and mixed-dtype groups, double backward, and a short
training run whose losses match eager's step by step."""
import pytest
import torch
from helpers import FUSED_BACKWARD, assert_same, build, cases, eager, tolerances

import fuser
from fuser import autodiff, derivatives, executor, ops
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

# (where.Scalar has no floating tensor argument: nothing to differentiate)
CASES = [c for c in cases() if c.op not in derivatives.NOT_DIFFERENTIABLE
         and any(n != "condition" for n in build(c).tensor_args)]
# ops whose domain is not the whole line, and inputs that keep finite differences away from poles
POSITIVE = {"log", "log10", "log2", "log1p", "sqrt", "rsqrt", "lgamma", "pow", "pow_scalar", "reciprocal",
            "fmod", "remainder"}  # (fmod: a divisor near 0 puts jumps within the finite-difference step)
UNIT = {"acos", "asin"}


@pytest.fixture(autouse=True)
def _needs_cpu_fusion():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


def _inputs(case, b, shape=(4, 3), dtype=torch.float64):
    out = []
    for n in b.tensor_args:
        if n == "condition":
            out.append(torch.rand(shape) > 0.5)
        elif case.op in POSITIVE:
            out.append((torch.rand(shape, dtype=dtype) + 0.5).requires_grad_())
        elif case.op in UNIT:
            out.append((torch.rand(shape, dtype=dtype) * 1.6 - 0.8).requires_grad_())
        else:
            out.append((torch.randn(shape, dtype=dtype) * 2).requires_grad_())
    return out


def _fused_backward(outputs) -> bool:
    return any(o.grad_fn.name() in FUSED_BACKWARD for o in outputs if o.grad_fn is not None)


def _supported(case) -> bool:
    """Whether the derivative table forms this case's gradient (else the interpreter must run it)."""
    b = build(case)
    needs = tuple(n != "condition" for n in b.tensor_args) + (False,) * len(b.float_args)
    sig = tuple((torch.bool if n == "condition" else torch.float64, False) for n in b.tensor_args)
    spec = STORE.get(STORE.register(lower(b.graph)))
    return autodiff.backward_for(spec, needs, (True,), sig) is not None


def test_every_op_has_a_derivative_or_none():
    """(cat has no formula: autodiff passes its gradient's slices straight to the pieces)"""
    concat = {n for n, op in ops.OPS_BY_NAME.items() if op.concat}
    # reductions and normalizations: fuser/rows/; tests/test_reduction_grad.py, tests/test_norm_grad.py
    reductions = {r.kind for r in ops.REDUCTIONS.values()}
    assert set(ops.OPS_BY_NAME) | reductions == (set(derivatives.DERIVATIVES) | derivatives.NOT_DIFFERENTIABLE | concat)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradcheck_every_op(case):
    b = build(case)
    key = STORE.register(lower(b.graph))
    floats = [{"exponent": 2.0, "weight": 0.3}.get(n, 0.75) for n in b.float_args]
    tensors = _inputs(case, b)

    def f(*ts):
        return fuser.run_fusion(key, [*ts, *floats])[0]
    out = f(*tensors)
    unsupported_by_table = case.op == "lgamma" or (case.op == "remainder" and b.tensor_args[-1] == "other") \
        or case.op == "clamp_tensor" \
        or (case.op in ("pow_scalar", "pow") and b.float_args)
    assert _fused_backward([out]) == (not unsupported_by_table), case.id
    if case.id == "remainder-Scalar_Tensor":  # eager has no derivative: its error, from the interpreter
        with pytest.raises(RuntimeError, match="not implemented"):
            out.sum().backward()
        return
    assert torch.autograd.gradcheck(f, tuple(tensors))


@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("sigmoid", "tanh", "mul", "div", "gelu", "silu",
                                                               "lerp", "addcmul", "maximum", "exp", "hardswish",
                                                               "hardsigmoid", "relu6", "leaky_relu", "elu",
                                                               "softplus", "mish")],
                         ids=lambda c: c.id)
def test_gradients_equal_eagers_in_float32(case):
    """Against eager autograd (independent of our formulas), float32."""
    b = build(case)
    key = STORE.register(lower(b.graph))
    tensors = _inputs(case, b, shape=(64, 33), dtype=torch.float32)
    fl = {n: 0.75 for n in b.float_args}
    out = fuser.run_fusion(key, [*tensors, *fl.values()])[0]
    assert _fused_backward([out])
    gout = torch.randn_like(out)
    mine = torch.autograd.grad(out, [t for t in tensors if t.requires_grad], gout)
    eager_tensors = dict(zip(b.tensor_args, [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]))
    ref = eager(b, eager_tensors, fl)
    theirs = torch.autograd.grad(ref, [t for t in eager_tensors.values() if t.requires_grad], gout)
    for m, t in zip(mine, theirs):
        assert_same(m, t)


def _group(ir: str) -> int:
    return STORE.register(lower(torch.parse_ir(ir)))


BROADCAST_IR = """graph(%x : Tensor, %y : Tensor, %z : Tensor, %s : float):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::add(%a, %z, %s)
  %c : Tensor = aten::tanh(%b)
  %d : Tensor = aten::sigmoid(%a)
  %e : Tensor = aten::gt(%c, %d)
  return (%c, %d, %e)
"""


def _broadcast_ref(x, y, z, s):
    a = x * y
    c, d = torch.tanh(torch.add(a, z, alpha=s)), torch.sigmoid(a)
    return c, d, c > d


@pytest.mark.parametrize("shapes", [((5, 1, 3), (4, 3), ()), ((4, 3), (4, 3), (1, 3)), ((2, 3), (3,), (2, 1))])
def test_broadcast_inputs_get_gradients_of_their_own_shape(shapes):
    key = _group(BROADCAST_IR)
    xs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]

    def f(*ts):
        c, d, e = fuser.run_fusion(key, [*ts, 0.5])
        assert not e.requires_grad and e.dtype == torch.bool
        return c, d
    assert _fused_backward(f(*xs))
    assert torch.autograd.gradcheck(f, tuple(xs))
    # against eager, one output's gradient only (the other is None in the backward)
    c, _ = f(*xs)
    mine = torch.autograd.grad(c.sum(), xs)
    refs = [x.detach().clone().requires_grad_() for x in xs]
    theirs = torch.autograd.grad(_broadcast_ref(*refs, 0.5)[0].sum(), refs)
    for m, t, x in zip(mine, theirs, xs):
        assert m.shape == x.shape
        assert_same(m, t)


def test_only_inputs_that_require_grad_get_one():
    key = _group(BROADCAST_IR)
    x = torch.randn(4, 3, requires_grad=True)
    y, z = torch.randn(4, 3), torch.randn(3)
    c, d, _ = fuser.run_fusion(key, [x, y, z, 2.0])
    (c * d).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    c2, d2, _ = _broadcast_ref(x2, y, z, 2.0)
    (c2 * d2).sum().backward()
    assert_same(x.grad, x2.grad)
    assert y.grad is None and z.grad is None


def test_double_backward():
    key = _group(BROADCAST_IR)
    xs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((3, 4), (4,), (3, 1))]
    assert torch.autograd.gradgradcheck(lambda *ts: fuser.run_fusion(key, [*ts, 0.5])[:2], tuple(xs))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64, torch.float32),
                                    (torch.bfloat16, torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float16, torch.float16)], ids=str)
def test_mixed_dtypes_get_gradients_in_their_own_dtype(dtypes):
    key = _group(BROADCAST_IR)
    xs = [torch.randn(6, 5).to(dt).requires_grad_() for dt in dtypes]
    c, d, _ = fuser.run_fusion(key, [*xs, 0.5])
    gc, gd = torch.randn_like(c), torch.randn_like(d)
    mine = torch.autograd.grad((c, d), xs, (gc, gd))
    refs = [x.detach().clone().requires_grad_() for x in xs]
    c2, d2, _ = _broadcast_ref(*refs, 0.5)
    theirs = torch.autograd.grad((c2, d2), refs, (gc, gd))
    # float64 truth: eager rounds every intermediate to float16/bfloat16, the fused kernels keep them in float,
    # so at reduced precision the fused gradient must be as close to the truth as eager's (or within tolerance)
    r64 = [x.detach().double().requires_grad_() for x in xs]
    c3, d3, _ = _broadcast_ref(*r64, 0.5)
    truth = torch.autograd.grad((c3, d3), r64, (gc.double(), gd.double()))
    for m, t, x in zip(mine, theirs, truth):
        assert m.dtype == t.dtype
        tol = tolerances(m.dtype)
        err_m, err_t = (m.double() - x).abs(), (t.double() - x).abs()
        bad = err_m > err_t + tol["atol"] + tol["rtol"] * x.abs()
        assert not bool(bad.any()), (m[bad][:5], t[bad][:5], x[bad][:5])


def test_integer_casts_stop_gradients_as_in_eager():
    """``x.type_as(i)`` with an integer ``i`` is not differentiable in eager: no gradient flows through it."""
    key = _group("""graph(%x : Tensor, %i : Tensor):
      %t : Tensor = aten::type_as(%x, %i)
      %f : Tensor = aten::mul(%t, %x)
      %r : Tensor = aten::sigmoid(%f)
      return (%r)
    """)
    x = (torch.randn(5, 4, dtype=torch.float64) * 3).requires_grad_()
    i = torch.randint(-3, 4, (5, 4))
    (g,) = torch.autograd.grad(fuser.run_fusion(key, [x, i])[0].sum(), [x])
    x2 = x.detach().clone().requires_grad_()
    (g2,) = torch.autograd.grad(torch.sigmoid(x2.type_as(i) * x2).sum(), [x2])
    assert_same(g, g2)


def test_zero_gradient_ops_give_zeros_like_eager():
    key = _group("""graph(%x : Tensor):
      %r : Tensor = aten::floor(%x)
      return (%r)
    """)
    x = torch.randn(7, requires_grad=True)
    fuser.run_fusion(key, [x])[0].sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros(7))


def test_no_grad_and_inference_mode_keep_the_forward_kernel():
    key = _group(BROADCAST_IR)
    x, y, z = (torch.randn(8, 8, requires_grad=True) for _ in range(3))
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            out = executor.run(STORE.get(key), [x, y, z, 1.0])
            assert out is not None and out[0].grad_fn is None


def test_saved_input_modified_in_place_raises_like_eager():
    key = _group(BROADCAST_IR)
    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4)
    c, _, _ = fuser.run_fusion(key, [x, y, y, 1.0])
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()


def test_backward_is_a_fused_kernel():
    key = _group(BROADCAST_IR)
    x, y, z = (torch.randn(16, 16, requires_grad=True) for _ in range(3))
    c, d, _ = fuser.run_fusion(key, [x, y, z, 1.0])
    (c + d).sum().backward()
    spec = STORE.get(key)
    bws = [bw for (k, *_), bw in autodiff._backwards.items() if k == spec.key and bw is not None and bw.spec]
    assert bws
    assert any(isinstance(geo, executor.Geometry) for bw in bws for geo in bw.spec.geometries.values())


def _lstm_cell(x, hx, cx, w_ih, w_hh, b_ih, b_hh):
    gates = torch.mm(x, w_ih.t()) + torch.mm(hx, w_hh.t()) + b_ih + b_hh
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    cy = f * cx + i * g
    hy = o * torch.tanh(cy)
    return hy, cy


def test_lstm_cell_gradcheck_through_chunk_motion():
    cell = fuser.fuse(torch.jit.script(_lstm_cell))
    b, n, h = 3, 5, 4
    args = [torch.randn(s, dtype=torch.float64, requires_grad=True)
            for s in ((b, n), (b, h), (b, h), (4 * h, n), (4 * h, h), (4 * h,), (4 * h,))]
    assert torch.autograd.gradcheck(cell, tuple(args))


def test_lstm_training_losses_match_eager_step_by_step():
    torch.manual_seed(0)
    b, n, h, steps = 8, 16, 32, 20
    cell = fuser.fuse(torch.jit.script(_lstm_cell))
    params = [torch.randn(4 * h, n) * 0.2, torch.randn(4 * h, h) * 0.2, torch.randn(4 * h) * 0.1,
              torch.randn(4 * h) * 0.1, torch.randn(h, 1) * 0.3]
    mine = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    xs = torch.randn(steps, b, n)
    target = torch.randn(steps, b, 1)
    opt_m, opt_r = torch.optim.SGD(mine, lr=0.1), torch.optim.SGD(ref, lr=0.1)
    used_fused = False
    for step in range(steps):
        losses = []
        for fn, p, opt in ((cell, mine, opt_m), (_lstm_cell, ref, opt_r)):
            hx = cx = torch.zeros(b, h)
            loss = 0
            for t in range(steps):
                hx, cx = fn(xs[t], hx, cx, p[0], p[1], p[2], p[3])
                if fn is cell and t == 0:
                    used_fused |= _fused_backward([hx, cx])
                loss = loss + ((hx @ p[4] - target[t]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-5), (step, losses)
    assert used_fused, "the LSTM's group did not run as a fused differentiable op"


def test_operands_sharing_a_gradient_are_written_once():
    """y = x + b: both inputs' gradient is y's; the backward group writes it once (the broadcast b's is summed
    from it), and both gradients equal eager's."""
    from fuser.backward import build_backward
    from fuser.kernel_cache import STORE
    from fuser.ts_ir import lower
    g = torch.parse_ir("graph(%x : Tensor, %b : Tensor):\n  %one : int = prim::Constant[value=1]()\n"
                       "  %y : Tensor = aten::add(%x, %b, %one)\n  %t : Tensor = aten::tanh(%y)\n"
                       "  %z : Tensor = aten::mul(%t, %y)\n  return (%z)\n")
    spec = STORE.get(STORE.register(lower(g)))
    floating = frozenset(v.id for v in (*spec.group.inputs, *(n.out for n in spec.group.nodes)))
    bw = build_backward(spec, (True, True), (True,), floating)
    assert len(bw.spec.group.outputs) == 1 and bw.aliases == ((1, 0),)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        (out,) = fuser.run_fusion(spec.key, [x, b])
        gx, gb = torch.autograd.grad(out.sum(), (x, b))
    xr, br = x.detach().requires_grad_(), b.detach().requires_grad_()
    y = xr + br
    rx, rb = torch.autograd.grad((torch.tanh(y) * y).sum(), (xr, br))
    assert_same(gx, rx)
    assert_same(gb, rb)
