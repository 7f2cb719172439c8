"""Gradients of fusion groups with reductions (issue 12: fuser/derivatives.py's sum, mean, amax and amin,
fuser/backward.py's row backward, fuser/autodiff.py): groups built from the IR alone and groups the TorchScript
pass makes (softmax and layer_norm written out, (x * w + b).sum(-1), amax with ties) against eager's autograd on
seeded random inputs, in float64 and float32, keepdim on and off, with ties, NaN and inf, empty rows; each backward
asserted to run as a fused row kernel (:func:`_backwards`), on the CPU backend and as the CUDA row kernel
under the host emulation; double backward through gradcheck; and a transformer block's training losses against
eager's step by step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import (FUSED_BACKWARD, REDUCE_EAGER, REDUCE_OPS, affine_sums, backward_and_args, decomposed_group,
                     reduce_node, reduction_alone, row_backward_keys, train_block_alongside_eager,
                     written_layer_norm, written_softmax)

import fuser
from fuser import ir
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate

DTYPES = (torch.float64, torch.float32)


pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")  # (tests/conftest.py; _backwards too)


_rows = row_backward_keys


# ---------------------------------------------------------------------------------------------- the cases

@dataclass(frozen=True)
class Case:
    """A group, its inputs for a dtype (float tensors require grad), and eager's outputs for those inputs."""

    id: str
    group: Callable[[], ir.Group]
    inputs: Callable[[torch.dtype], list]
    eager: Callable[..., list]


def _ties(*shape) -> torch.Tensor:
    """Whole numbers in [0, 3): rows with ties at their max and min."""
    return torch.randint(0, 3, shape).double()


def _single(kind: str, dims, keepdim: bool) -> Case:
    group, eager = reduction_alone(kind, dims, keepdim)

    def inputs(dt):
        return [(_ties(4, 3, 9) if kind in ("amax", "amin") else torch.randn(4, 3, 9)).to(dt)]

    return Case(f"{kind}-{'_'.join(map(str, dims))}-{'keep' if keepdim else 'drop'}", group, inputs, eager)


def _affine_sum() -> Case:
    """sum and mean of x * w + b over the row, keepdim off: w and b broadcast across rows."""
    group, eager = affine_sums()
    return Case("affine_sum", group, lambda dt: [torch.randn(6, 50, dtype=dt), torch.randn(50, dtype=dt),
                                                 torch.randn(50, dtype=dt)], eager)


def _row_epilogue() -> Case:
    """Row-level ops after a reduction with keepdim off (2 * sum + 1), and an element-level output beside it."""
    def group():
        b = ir.Builder()
        x = b.input()
        s = reduce_node(b, "sum", x, (-1,), False)
        return b.build([b.call("aten::add", b.call("aten::mul", s, 2.0), 1.0, 1), b.call("aten::exp", x)])

    return Case("row_epilogue", group, lambda dt: [torch.randn(5, 3, 17, dtype=dt)],
                lambda x: [x.sum(-1) * 2 + 1, x.exp()])


def _softmax() -> Case:
    """softmax written out, and its row sums (a keepdim output) beside it."""
    group, eager = written_softmax()
    return Case("softmax", group, lambda dt: [3 * torch.randn(5, 70, dtype=dt)], eager)


def _layer_norm() -> Case:
    """layer norm written out with eps a float input; the mean and rstd are outputs too (row-level, keepdim)."""
    group, eager = written_layer_norm()
    return Case("layer_norm", group, lambda dt: [torch.randn(4, 3, 40, dtype=dt) + 2, torch.randn(40, dtype=dt),
                                                 torch.randn(40, dtype=dt), 1e-5], eager)


def _decomposed(kind: str) -> Case:
    """fuser/rows/decompose.py's steps against eager's own op."""
    def group():
        return decomposed_group(kind, (7, 16))

    if kind == "layer_norm":
        return Case("decomposed-layer_norm", group,
                    lambda dt: [torch.randn(5, 7, 16, dtype=dt) + 1, torch.randn(7, 16, dtype=dt),
                                torch.randn(7, 16, dtype=dt)],
                    lambda x, w, c: [F.layer_norm(x, (7, 16), w, c, 1e-5)])
    return Case(f"decomposed-{kind}", group, lambda dt: [2 * torch.randn(5, 7, 33, dtype=dt)],
                lambda x: [getattr(torch, kind)(x, -1)])


CASES = ([_single(k, d, keep) for k in REDUCE_OPS for d in ((-1,), (-2, -1)) for keep in (True, False)]
         + [_single("amax", (1, 2), True), _single("mean", (1, 2), False)]
         + [_affine_sum(), _row_epilogue(), _softmax(), _layer_norm()]
         + [_decomposed(k) for k in ("softmax", "log_softmax", "layer_norm")])
PARAMS = [(c, dt) for c in CASES for dt in DTYPES]
# cases whose backward is pointwise (a sum's or a mean's gradient broadcast back, and what follows): no row kernel
POINTWISE_BACKWARD = ("sum-", "mean-", "row_epilogue", "affine_sum")
IDS = [f"{c.id}-{str(dt)[6:]}" for c, dt in PARAMS]
_GROUPS = {c.id: c.group() for c in CASES}


def _spec(group: ir.Group):
    return STORE.get(STORE.register(group))


def _leaves(args: list) -> list:
    return [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]


def _tensors(args: list) -> list:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _assert_grads(got, want, dtype):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * scale, equal_nan=True)


def _grads_both_ways(case: Case, args: list, gen_grads=True):
    """The fused group's input gradients and eager's, for the same random output gradients."""
    spec = _spec(_GROUPS[case.id])
    outs = fuser.run_fusion(spec.key, args)
    assert all(o.grad_fn.name() in FUSED_BACKWARD for o in outs if o.grad_fn is not None)
    ref = case.eager(*args)
    grads = [torch.randn_like(r) for r in ref]
    ts = [t for t in _tensors(args) if t.requires_grad]
    return torch.autograd.grad(outs, ts, grads), torch.autograd.grad(ref, ts, grads)


# ------------------------------------------------------------------------------------------- the CPU backend

@pytest.mark.parametrize("case,dtype", PARAMS, ids=IDS)
def test_gradients_match_eagers_and_the_backward_is_a_row_kernel(case, dtype, _backwards):
    args = _leaves(case.inputs(dtype))
    if case.id.startswith(("amax", "amin")):  # the inputs hold ties: the gradient is split among them
        x = args[0].detach()
        best = REDUCE_EAGER[case.id[:4]](x, dim=(-1,), keepdim=True)
        assert (x == best).sum(-1).max() > 1
    got, want = _grads_both_ways(case, args)
    _assert_grads(got, want, dtype)
    assert _backwards, "the backward did not run as a fused kernel"
    if not case.id.startswith(POINTWISE_BACKWARD):
        assert _rows(_backwards), "the backward did not run as a fused row kernel"


HALF_CASES = [c for c in CASES if c.id in ("amax--1-drop", "mean--2_-1-keep", "affine_sum", "softmax", "layer_norm",
                                          "decomposed-log_softmax", "decomposed-layer_norm")]


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: c.id)
def test_half_gradients_as_close_to_float64_as_eagers(case, dtype, _backwards):
    """float16/bfloat16: the fused gradients within twice eager's own error (plus a unit of the dtype) of eager's
    gradients in float64, and of the same dtypes and shapes as eager's."""
    args = _leaves(case.inputs(dtype))
    args64 = _leaves([a.detach().double() if isinstance(a, torch.Tensor) else a for a in args])
    ref = case.eager(*args64)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(dtype) for r in ref]
    outs = fuser.run_fusion(_spec(_GROUPS[case.id]).key, args)
    assert outs[0].grad_fn.name() in FUSED_BACKWARD
    got = torch.autograd.grad(outs, _tensors(args), grads)
    want = torch.autograd.grad(case.eager(*args), _tensors(args), grads)
    want64 = torch.autograd.grad(ref, _tensors(args64), [g.double() for g in grads])
    unit = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for g, w, w64 in zip(got, want, want64):
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = max(1.0, w64.abs().max().item())
        err, eager_err = (g.double() - w64).abs().max().item(), (w.double() - w64).abs().max().item()
        assert err <= 2 * eager_err + unit * scale, (err, eager_err)
    assert _backwards, "the backward did not run as a fused kernel"
    if not case.id.startswith(POINTWISE_BACKWARD):
        assert _rows(_backwards), "the backward did not run as a fused row kernel"


@pytest.mark.parametrize("kind", ("softmax", "log_softmax"))
def test_the_max_softmax_subtracts_gets_no_gradient(kind, _backwards):
    """softmax and log_softmax from fuser/rows/decompose.py: as in eager's op, the max they subtract gets no
    gradient (no count of its ties), so the backward holds the forward's two reductions and one of the
    gradient; rows with ties at the max give torch.softmax's gradient."""
    case = _decomposed(kind)
    x = torch.randint(0, 4, (6, 7, 33)).double()
    got, want = _grads_both_ways(case, _leaves([x]))
    _assert_grads(got, want, torch.float64)
    (bw,) = {s.key: s for s in _backwards}.values()
    assert [n.op for n in bw.group.nodes if n.op in REDUCE_OPS.values()] == [
        "aten::amax", "aten::sum.dim_IntList", "aten::sum.dim_IntList"]


def test_a_softmax_max_read_outside_the_softmax_keeps_its_gradient():
    """The same max node as a softmax step and as an output of its own (one node, as a pass that shares equal
    nodes would make): its gradient is eager's amax gradient, not dropped."""
    b = ir.Builder()
    x = b.input()
    with b.steps_of("aten::softmax"):
        m = reduce_node(b, "amax", x, (-1,), True)
        e = b.call("aten::exp", b.call("aten::sub", x, m, 1))
        y = b.call("aten::div", e, reduce_node(b, "sum", e, (-1,), True))
    spec = _spec(b.build([y, m]))
    x = torch.randn(4, 30, dtype=torch.float64, requires_grad=True)
    y, m = fuser.run_fusion(spec.key, [x])
    assert y.grad_fn.name() in FUSED_BACKWARD
    gy, gm = torch.randn_like(y), torch.randn_like(m)
    got = torch.autograd.grad((y, m), x, (gy, gm))[0]
    want = torch.autograd.grad((torch.softmax(x, -1), x.amax(-1, keepdim=True)), x, (gy, gm))[0]
    _assert_grads([got], [want], torch.float64)


def test_nan_and_inf_rows_as_eager(_backwards):
    """amax and amin of rows with NaN (the whole row's gradient is NaN in eager), inf and -inf; softmax of a row
    holding inf (NaN forward and backward)."""
    for kind in ("amax", "amin"):
        case = _single(kind, (-1,), False)
        x = torch.randn(5, 9, dtype=torch.float64)
        x[0, 3], x[1, 2], x[2, :], x[3, 4], x[3, 5] = float("nan"), float("inf"), -float("inf"), 7.0, 7.0
        got, want = _grads_both_ways(case, _leaves([x]))
        assert got[0][0].isnan().all() and not got[0][1:].isnan().any()
        _assert_grads(got, want, torch.float64)
    x = torch.randn(3, 20, dtype=torch.float64)
    x[1, 5] = float("inf")
    got, want = _grads_both_ways(_softmax(), _leaves([x]))
    _assert_grads(got, want, torch.float64)
    assert len([s for s in _backwards if s.has_reduction]) == 3


def test_empty_rows_and_no_rows_as_eager():
    case = _single("sum", (-1,), False)
    for shape in ((0, 9), (4, 0)):
        got, want = _grads_both_ways(case, _leaves([torch.randn(shape, dtype=torch.float64)]))
        _assert_grads(got, want, torch.float64)


def test_only_wanted_gradients_and_the_eager_path_where_the_row_kernel_cannot_run():
    """A weight that does not require grad gets none; a reduction over a middle dim (neither a row nor a column
    kernel) is not wrapped: eager's autograd records the interpreter's ops, with eager's gradients (a leading-dim
    one runs as a column kernel and is wrapped: tests/test_grad_sums.py)."""
    case = _affine_sum()
    x, w, c = case.inputs(torch.float64)
    x.requires_grad_()
    got, want = _grads_both_ways(case, [x, w, c])
    _assert_grads(got, want, torch.float64)
    b = ir.Builder()
    x = b.input()
    spec = _spec(b.build([reduce_node(b, "sum", b.call("aten::exp", x), (1,), False)]))
    x = torch.randn(6, 4, 5, dtype=torch.float64, requires_grad=True)
    (y,) = fuser.run_fusion(spec.key, [x])
    assert y.grad_fn.name() not in FUSED_BACKWARD
    gy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, gy)[0], torch.autograd.grad(x.exp().sum(1), x, gy)[0])


_SMALL = [  # (case, small float64 inputs: gradgradcheck's cost grows with the square of the elements)
    (_softmax(), lambda: [3 * torch.randn(3, 7, dtype=torch.float64)]),
    (_layer_norm(), lambda: [torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64),
                             torch.randn(5, dtype=torch.float64), 1e-5]),
    (_decomposed("log_softmax"), lambda: [torch.randn(2, 3, 6, dtype=torch.float64)]),
    (_row_epilogue(), lambda: [torch.randn(2, 3, 5, dtype=torch.float64)]),
    (_single("amax", (-1,), False), lambda: [torch.randn(3, 4, 9, dtype=torch.float64)]),  # no ties: differentiable
    (_single("mean", (-2, -1), False), lambda: [torch.randn(3, 4, 5, dtype=torch.float64)]),
]


@pytest.mark.parametrize("case,inputs", _SMALL, ids=[c.id for c, _ in _SMALL])
def test_gradcheck_and_double_backward(case, inputs):
    """gradcheck and gradgradcheck in float64: the backward of a backward group is formed (fused) or falls back to
    eager's autograd, never wrong."""
    spec = _spec(_GROUPS[case.id])
    args = inputs()
    tensors = tuple(a.requires_grad_() for a in _tensors(args))

    def fn(*ts):
        it = iter(ts)
        return tuple(fuser.run_fusion(spec.key, [next(it) if isinstance(a, torch.Tensor) else a for a in args]))

    assert torch.autograd.gradcheck(fn, tensors)
    assert torch.autograd.gradgradcheck(fn, tensors)


def test_a_broadcast_weight_gets_the_gradient_of_its_own_shape(_backwards):
    """w of shape [cols] and c of shape [1]: their gradients are summed across rows (eager's sum_to_size after
    the kernel), x's is the kernel's."""
    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    y = b.call("aten::mul", b.call("aten::add", x, c, 1), w)
    m = reduce_node(b, "amax", y, (-1,), True)
    e = b.call("aten::exp", b.call("aten::sub", y, m, 1))
    spec = _spec(b.build([b.call("aten::div", e, reduce_node(b, "sum", e, (-1,), True))]))
    args = _leaves([torch.randn(2, 3, 30, dtype=torch.float64), torch.randn(30, dtype=torch.float64),
                    torch.randn(1, dtype=torch.float64)])
    (out,) = fuser.run_fusion(spec.key, args)
    ref = torch.softmax((args[0] + args[2]) * args[1], -1)
    gy = torch.randn_like(ref)
    got, want = torch.autograd.grad(out, args, gy), torch.autograd.grad(ref, args, gy)
    assert [g.shape for g in got] == [a.shape for a in args]
    _assert_grads(got, want, torch.float64)
    assert _rows(_backwards)


# ------------------------------------------------------------------------------------ CUDA, host-emulated

# (pointwise backwards: tests/test_cuda_emulated.py covers those kernels)
EMULATED = [(c, dt) for c, dt in PARAMS if not c.id.startswith(POINTWISE_BACKWARD)]


def _emulated_backward(case: Case, dtype):
    """The backward of ``case`` for its inputs in ``dtype``: (bw, its arguments, eager's gradients)."""
    return backward_and_args(_spec(_GROUPS[case.id]), case.inputs(dtype), case.eager)


@pytest.fixture(scope="module")
def emulated():
    """Every emulated backward's kernel registered first, so they compile together."""
    em = emulate.default()
    with torch.random.fork_rng():
        for case, dtype in EMULATED:
            bw, args, _ = _emulated_backward(case, dtype)
            assert row_emulate.kernel_for(bw.spec.group, args, em) is not None
    em.compile_pending()
    return em


@pytest.mark.parametrize("case,dtype", EMULATED, ids=[f"{c.id}-{str(dt)[6:]}" for c, dt in EMULATED])
def test_cuda_row_backward_emulated_matches_eager(case, dtype, emulated):
    bw, args, want = _emulated_backward(case, dtype)
    outs = row_emulate.run(bw.spec.group, args, emulated)
    assert outs is not None
    tensors = _tensors(case.inputs(dtype))
    got = [None] * len(tensors)
    t_index = [k for k, a in enumerate(case.inputs(dtype)) if isinstance(a, torch.Tensor)]
    for j, r in zip(bw.grad_inputs, outs):
        t = t_index.index(j)
        got[t] = r.sum_to_size(want[t].shape).to(want[t].dtype)
    _assert_grads(got, want, dtype)


# ---------------------------------------------------------------------------------------- the TorchScript pass

def _softmax_written_out(x, w):
    y = x * w
    e = torch.exp(y - y.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _layer_norm_written_out(x, w, b):
    mu = x.mean(-1, keepdim=True)
    d = x - mu
    var = (d * d).mean(-1, keepdim=True)
    return d * torch.rsqrt(var + 1e-5) * w + b


def _affine_row_sum(x, w, b):
    return (x * w + b).sum(-1)


def _amax_with_ties(x):
    return torch.tanh(x).amax(-1) * 3.0


_SCRIPTED = {
    "softmax": (_softmax_written_out, lambda dt: [3 * torch.randn(8, 60, dtype=dt), torch.randn(60, dtype=dt)]),
    "layer_norm": (_layer_norm_written_out, lambda dt: [torch.randn(4, 6, 32, dtype=dt) + 1,
                                                        torch.randn(32, dtype=dt), torch.randn(32, dtype=dt)]),
    "affine_row_sum": (_affine_row_sum, lambda dt: [torch.randn(10, 25, dtype=dt), torch.randn(25, dtype=dt),
                                                    torch.randn(25, dtype=dt)]),
    "amax_ties": (_amax_with_ties, lambda dt: [_ties(7, 12).to(dt)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(_SCRIPTED))
def test_scripted_functions_train_through_fused_backwards(name, dtype, _backwards):
    fn, inputs = _SCRIPTED[name]
    scripted = fuser.fuse(torch.jit.script(fn))
    for _ in range(3):  # the profiling executor's first calls record shapes; then the fused graph runs
        args = _leaves(inputs(dtype))
        out = scripted(*args)
        ref = fn(*args)
        gy = torch.randn_like(ref)
        _assert_grads(torch.autograd.grad(out, args, gy), torch.autograd.grad(ref, args, gy), dtype)
    assert out.grad_fn.name() in FUSED_BACKWARD
    assert _backwards, "the backward did not run as a fused kernel"
    if name != "affine_row_sum":  # (a sum's backward is pointwise: the gradient broadcast back, times w)
        assert _rows(_backwards), "the backward did not run as a fused row kernel"


# ----------------------------------------------------------------------------------------- training

def _block(x, wq, wk, wv, wo, g1, b1, w1, c1, w2, c2, g2, b2):
    """A transformer block: single-head attention (softmax written out), residual, layer norms written out with
    mean, a relu MLP. Matmuls stay eager's; the pass fuses the rest."""
    q, k, v = x @ wq, x @ wk, x @ wv
    s = (q @ k.transpose(-1, -2)) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    h = x + ((e / e.sum(-1, keepdim=True)) @ v) @ wo
    mu = h.mean(-1, keepdim=True)
    d = h - mu
    h = d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * g1 + b1
    h = h + torch.relu(h @ w1 + c1) @ w2 + c2
    mu = h.mean(-1, keepdim=True)
    d = h - mu
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * g2 + b2


def test_transformer_block_training_losses_match_eager_step_by_step(_backwards):
    block = fuser.fuse(torch.jit.script(_block))
    mine, x = train_block_alongside_eager(block, _block)
    g = fuser.graph_for(block, x, *mine[:-1])
    groups = g.findAllNodes("prim::FusionGroup")
    assert sum(any(n.kind() in ("aten::amax", "aten::mean") for n in fg.g("Subgraph").nodes()) for fg in groups) >= 3
    assert len(_rows(_backwards)) >= 3, "the softmax and layer norms' backwards did not run as row kernels"
