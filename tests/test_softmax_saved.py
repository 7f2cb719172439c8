"""softmax and log_softmax backward reads the forward's saved output (fuser/backward.py's ``saved_outputs``): where the
group's output is the softmax itself, the backward group takes that output and the output gradient and forms eager's
formula ((g - sum(g * y)) * y, g - exp(y) * sum(g)) without recomputing the max and sum over x. Gradients against
eager's in float64 on fresh random inputs (rows of 1, 31, 32, 1024 and 65537; float32 and bfloat16), the backward
group's inputs and nodes, a softmax read further in the group (recomputed where it is not an output), inputs that
need no gradient, the native hot path's recorded calls (the saved output, and Python's backward for another
output-gradient pattern), and an in-place change of the saved output raising eager's error."""
from __future__ import annotations

import pytest
import torch
from helpers import FUSED_BACKWARD, assert_close_to_float64, row_backward_keys, tolerances

import fuser
from fuser import autodiff, ir, native
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")

LENGTHS = (1, 31, 32, 1024, 65537)
SOFTMAX, LOG_SOFTMAX = "aten::softmax.int", "aten::log_softmax.int"
_SPECS: dict = {}


def _spec(kind: str, op: str):
    """Groups: "plain" op(x, -1); "prologue" op(x * 0.125 + mask, -1); "times" op(x, -1) * v alone (the softmax not
    an output: recomputed); "both" op(x, -1) and op(x, -1) * v."""
    if (kind, op) not in _SPECS:
        b = ir.Builder()
        x = b.input()
        if kind == "prologue":
            mask = b.input()
            y = b.add(op, b.call("aten::add", b.call("aten::mul", x, 0.125), mask, 1), -1, None)
            outs = [y]
        else:
            y = b.add(op, x, -1, None)
            if kind == "plain":
                outs = [y]
            else:
                v = b.input()
                outs = [b.call("aten::mul", y, v)] if kind == "times" else [y, b.call("aten::mul", y, v)]
        _SPECS[kind, op] = STORE.get(STORE.register(b.build(outs)))
    return _SPECS[kind, op]


def _eager(kind: str, op: str, x, *rest):
    f = torch.softmax if op == SOFTMAX else torch.log_softmax
    if kind == "prologue":
        return [f(x * 0.125 + rest[0], -1)]
    y = f(x, -1)
    return [y] if kind == "plain" else [y * rest[0]] if kind == "times" else [y, y * rest[0]]


def _inputs(kind: str, dtype, n: int, rows: int = 6):
    x = 4 * torch.randn(rows, n, dtype=dtype)
    if kind == "plain":
        return [x]
    if kind == "prologue":  # an additive mask broadcast along the rows, -1e4 above the diagonal as attention's
        return [x, torch.triu(torch.full((rows, n), -1e4), 1).to(dtype)]
    return [x, torch.randn(rows, n, dtype=dtype)]


def _grads(kind, op, inputs, needs, dtype):
    """(fused gradients, eager's in float64, eager's in ``dtype``) of the inputs in ``needs`` for the same random
    output gradients; the fused outputs' grad_fn checked to be the fused group's."""
    args = [a.clone().requires_grad_(w) for a, w in zip(inputs, needs)]
    outs = fuser.run_fusion(_spec(kind, op).key, args)
    a64 = [a.detach().double().requires_grad_(w) for a, w in zip(inputs, needs)]
    ref = _eager(kind, op, *a64)
    # (an output no wanted gradient reaches does not require grad, as in eager: softmax(x) where only v needs one)
    assert [o.requires_grad for o in outs] == [r.requires_grad for r in ref]
    assert all(o.grad_fn.name() in FUSED_BACKWARD for o in outs if o.requires_grad)
    gys = [torch.randn_like(r) for r in ref]
    pick = [k for k, r in enumerate(ref) if r.requires_grad]
    got = torch.autograd.grad([outs[k] for k in pick], [a for a in args if a.requires_grad],
                              [gys[k].to(dtype) for k in pick])
    want64 = torch.autograd.grad([ref[k] for k in pick], [a for a in a64 if a.requires_grad], [gys[k] for k in pick])
    ae = [a.detach().requires_grad_(w) for a, w in zip(inputs, needs)]
    want = torch.autograd.grad([_eager(kind, op, *ae)[k] for k in pick], [a for a in ae if a.requires_grad],
                               [gys[k].to(dtype) for k in pick])
    return got, want64, want


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("op", (SOFTMAX, LOG_SOFTMAX), ids=("softmax", "log_softmax"))
@pytest.mark.parametrize("kind", ("plain", "prologue"))
def test_gradients_match_eager_and_the_backward_reads_the_saved_output(kind, op, dtype, _backwards):
    for n in LENGTHS:
        _backwards.clear()
        inputs = _inputs(kind, dtype, n, rows=2 if n > 4096 else 6)
        got, want64, want = _grads(kind, op, inputs, [True] + [False] * (len(inputs) - 1), dtype)
        assert_close_to_float64(got, want64, want, dtype)
        ran = [s for s in _backwards if s.key in row_backward_keys(_backwards)]
        assert ran, f"row {n}: the backward did not run as a fused row kernel"
        assert all(not _recomputes(s.group) for s in ran), f"row {n}: the backward recomputes the softmax"


def _recomputes(g: ir.Group) -> bool:
    """Whether a backward group holds a softmax's recompute: a row max (the stabilizer) or a step of the op."""
    return any(n.op == "aten::amax" or n.origin in ("aten::softmax", "aten::log_softmax") for n in g.nodes)


def _backward(kind, op, inputs, needs):
    spec = _spec(kind, op)
    sig = tuple((t.dtype, t.dim() == 0) for t in inputs)
    return autodiff.backward_for(spec, tuple(needs), spec.all_outputs_defined, sig)


@pytest.mark.parametrize("op", (SOFTMAX, LOG_SOFTMAX), ids=("softmax", "log_softmax"))
def test_the_backward_group_takes_the_output_and_the_gradient_only(op):
    """softmax(x * 0.125 + mask) whose output is the softmax: the backward reads y and its gradient, not x or the
    mask, and holds no max (log_softmax's: its exp of y and a row sum; softmax's: a row sum of g * y)."""
    for kind in ("plain", "prologue"):
        inputs = _inputs(kind, torch.float32, 40)
        bw = _backward(kind, op, inputs, [True] + [False] * (len(inputs) - 1))
        assert bw.saved_outputs == (0,) and bw.fwd_inputs == () and bw.grad_outputs == ((0, None),)
        g = bw.spec.group
        assert len(g.inputs) == 2 and not _recomputes(g)
        assert [n.op for n in g.nodes if n.op.startswith("aten::sum")] == ["aten::sum.dim_IntList"]
    # the mask requiring grad too: its gradient is x's (an add), still from y and the gradient alone
    bw = _backward("prologue", op, _inputs("prologue", torch.float32, 40), [True, True])
    assert bw.saved_outputs == (0,) and bw.fwd_inputs == () and not _recomputes(bw.spec.group)


@pytest.mark.parametrize("op", (SOFTMAX, LOG_SOFTMAX), ids=("softmax", "log_softmax"))
def test_a_softmax_read_further_in_the_group(op, _backwards):
    """op(x) * v alone: the softmax is not an output, so the backward recomputes it from x (as before); op(x) and
    op(x) * v: it is one, and the backward reads it for both gradients. Gradients for x and v, for v only, for x
    only, against eager's in float64."""
    for n in (1, 33, 1024):
        inputs = _inputs("times", torch.float32, n)
        bw = _backward("times", op, inputs, [True, True])
        assert bw.saved_outputs == () and 0 in bw.fwd_inputs and _recomputes(bw.spec.group)
        bw = _backward("both", op, inputs, [True, True])
        assert bw.saved_outputs == (0,) and 0 not in bw.fwd_inputs and not _recomputes(bw.spec.group)
        for kind in ("times", "both"):
            for needs in ([True, True], [False, True], [True, False]):
                got, want64, want = _grads(kind, op, inputs, needs, torch.float32)
                assert_close_to_float64(got, want64, want, torch.float32)


def test_only_some_output_gradients_defined():
    """softmax(x) and softmax(x) * v with a gradient for one of the two outputs only (the other unused): the
    backward of that pattern reads the saved output too."""
    inputs = _inputs("both", torch.float32, 65)
    for used in (0, 1):
        args = [a.clone().requires_grad_() for a in inputs]
        outs = fuser.run_fusion(_spec("both", SOFTMAX).key, args)
        a64 = [a.detach().double().requires_grad_() for a in inputs]
        ref = _eager("both", SOFTMAX, *a64)
        gy = torch.randn_like(ref[used])
        got = torch.autograd.grad(outs[used], args, gy.float(), allow_unused=True)
        want = torch.autograd.grad(ref[used], a64, gy, allow_unused=True)
        for g, w in zip(got, want):
            if w is None:
                assert g is None or not g.any()
            else:
                torch.testing.assert_close(g.double(), w, **tolerances(torch.float32))


@pytest.mark.parametrize("op", (SOFTMAX, LOG_SOFTMAX), ids=("softmax", "log_softmax"))
def test_the_saved_output_modified_in_place_raises_as_in_eager(op):
    x = torch.randn(4, 16, requires_grad=True)
    (y,) = fuser.run_fusion(_spec("plain", op).key, [x])
    assert y.grad_fn.name() in FUSED_BACKWARD
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    ye = (torch.softmax if op == SOFTMAX else torch.log_softmax)(x, -1)  # eager raises too
    ye.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ye.sum().backward()


def test_double_backward_through_the_saved_output():
    """create_graph: the backward group reads y, whose own gradient flows back into the forward's node (gradgradcheck
    against finite differences, float64)."""
    for kind, op in (("plain", SOFTMAX), ("prologue", LOG_SOFTMAX), ("both", SOFTMAX)):
        spec = _spec(kind, op)
        ts = tuple(a.requires_grad_() for a in _inputs(kind, torch.float64, 5, rows=2))

        def fn(*args):
            return tuple(fuser.run_fusion(spec.key, list(args)))

        assert torch.autograd.gradcheck(fn, ts)
        assert torch.autograd.gradgradcheck(fn, ts)


# ------------------------------------------------------------------------------------------- native hot path

def _attention_probs(s, mask):
    return torch.softmax(s * 0.125 + mask, -1)


def _probs_and_mix(x, v):
    p = torch.log_softmax(x, -1)
    return p, p * v


@pytest.mark.skipif(not native.loaded(), reason=f"native hot path: {native.status()}")
def test_native_training_calls_save_the_output():
    """Repeated training calls served by the hot path: the recorded node saves the softmax output and its backward
    group reads it (and the gradient); gradients as eager's; an in-place change of the output raises."""
    ff = fuser.fuse(torch.jit.script(_attention_probs))
    mask = torch.triu(torch.full((48, 48), -1e4), 1)
    for _ in range(4):
        s = torch.randn(3, 48, 48, dtype=torch.float64, requires_grad=True)
        before = native.stats()["hits"]
        y = ff(s, mask)
        served = native.stats()["hits"] > before
        gy = torch.randn_like(y)
        before = native.stats()["hits"]
        (got,) = torch.autograd.grad(y, s, gy)
        backward_served = native.stats()["hits"] > before  # the recorded backward group, run by the hot path
        sr = s.detach().requires_grad_()
        (want,) = torch.autograd.grad(_attention_probs(sr, mask), sr, gy)
        torch.testing.assert_close(got, want, **tolerances(torch.float64))
    assert served and backward_served and y.grad_fn.name() == "FusedGroupBackward"
    y = ff(s, mask)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.skipif(not native.loaded(), reason=f"native hot path: {native.status()}")
def test_native_other_gradient_patterns_take_the_saved_output_to_python():
    """log_softmax(x) and log_softmax(x) * v: every output's gradient (the recorded backward group), then one
    output's only (Python's backward, which gets the saved output from the node)."""
    ff = fuser.fuse(torch.jit.script(_probs_and_mix))
    for weights in [(1.0, 2.0), (None, 1.5), (0.5, None), (1.0, 2.0)]:
        for _ in range(3):
            x = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
            v = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
            before = native.stats()["hits"]
            outs = ff(x, v)
            served = native.stats()["hits"] > before
            loss = sum((o * w).sum() for o, w in zip(outs, weights) if w is not None)
            got = torch.autograd.grad(loss, [x, v], allow_unused=True)
            xr, vr = x.detach().requires_grad_(), v.detach().requires_grad_()
            ref = _probs_and_mix(xr, vr)
            loss = sum((o * w).sum() for o, w in zip(ref, weights) if w is not None)
            want = torch.autograd.grad(loss, [xr, vr], allow_unused=True)
            for g, w in zip(got, want):
                if w is None:
                    assert g is None or not g.any()
                else:
                    torch.testing.assert_close(g, w, **tolerances(torch.float64))
        assert served and outs[0].grad_fn.name() == "FusedGroupBackward"


# ------------------------------------------------------------------------------------ CUDA, host-emulated

EMULATED = [(kind, op, dt) for kind in ("plain", "prologue") for op in (SOFTMAX, LOG_SOFTMAX)
            for dt in (torch.float32, torch.bfloat16)]
_EM_LENGTHS = (1, 31, 32, 1024, 4099)


def _emulated_case(kind, op, dtype, n):
    """(backward, its arguments, x, eager's output, the output gradient, the inputs): x alone requires grad, the
    backward group's arguments are eager's output and the gradient."""
    inputs = _inputs(kind, dtype, n)
    x = inputs[0].requires_grad_()
    y = _eager(kind, op, *inputs)[0]
    gy = torch.randn_like(y)
    spec = _spec(kind, op)
    bw = autodiff.backward_for(spec, (True,) + (False,) * (len(inputs) - 1), spec.all_outputs_defined,
                               tuple((t.dtype, False) for t in inputs))
    assert bw.saved_outputs == (0,) and bw.fwd_inputs == ()
    args = autodiff.backward_args(spec, bw, inputs, [gy], [t.shape for t in inputs], {0: y.detach()})
    return bw, args, x, y, gy, inputs


@pytest.fixture(scope="module")
def emulated():
    """Every emulated backward's kernel registered first, so they compile together."""
    em = emulate.default()
    with torch.random.fork_rng():
        for kind, op, dt in EMULATED:
            for n in _EM_LENGTHS:
                bw, args, *_ = _emulated_case(kind, op, dt, n)
                assert row_emulate.kernel_for(bw.spec.group, args, em) is not None
    em.compile_pending()
    return em


@pytest.mark.parametrize("kind,op,dtype", EMULATED, ids=[f"{k}-{o[6:-4]}-{str(d)[6:]}" for k, o, d in EMULATED])
def test_cuda_backward_reading_the_saved_output_emulated(kind, op, dtype, emulated):
    """The backward group's CUDA row kernel (emulated) on eager's forward output and random output gradients,
    against eager's gradient in float64 (float32: within its tolerance; bfloat16: twice eager's error)."""
    for n in _EM_LENGTHS:
        bw, args, x, y, gy, inputs = _emulated_case(kind, op, dtype, n)
        (got,) = row_emulate.run(bw.spec.group, args, emulated)
        (want,) = torch.autograd.grad(y, x, gy)
        x64 = x.detach().double().requires_grad_()
        (want64,) = torch.autograd.grad(_eager(kind, op, x64, *[a.double() for a in inputs[1:]])[0], x64,
                                        gy.double())
        assert_close_to_float64([got.to(dtype)], [want64], [want], dtype)
