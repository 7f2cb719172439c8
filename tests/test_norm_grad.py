"""Gradients of the composite normalizations (issue 12: fuser/derivatives.py's softmax, log_softmax, layer_norm,
rms_norm, var and std; fuser/backward.py recomputes each as its row-kernel steps, reading the statistics the
forward saved where it saved them): groups holding the eager op
whole, as the TorchScript pass makes them, against eager's autograd on seeded random inputs (float32 against
eager's float64 gradients, float64 against eager's float64, bfloat16 within eager's own error of float64), rows of
1, 31, 32 and 1024 elements and a non-contiguous row; each backward asserted to run as a fused row kernel, on the
CPU backend and as the CUDA row kernel under the host emulation; and a transformer block written with
torch.layer_norm and torch.softmax training through the pass with eager's losses step by step."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import FUSED_BACKWARD, backward_and_args, row_backward_keys, tolerances, train_block_alongside_eager

import fuser
from fuser import bench, ir
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate

LENGTHS = (1, 31, 32, 1024)


pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")  # (tests/conftest.py; _backwards too)


@dataclass(frozen=True)
class Case:
    """A group per row length (a normalization's normalized_shape is a constant), its inputs (x first: [rows, n],
    the others broadcast along the row), eager's outputs for them."""

    id: str
    group: Callable[[int], ir.Group]
    inputs: Callable[[torch.dtype, int], list]
    eager: Callable[..., list]


def _x(dt, n, *lead):
    return torch.randn(*(lead or (3, 5)), n, dtype=dt)


def _softmax(log: bool) -> Case:
    """softmax(x * 0.125 + mask) over the last dim (log_softmax: times 2 after): the mask's gradient is summed
    over the rows."""
    op = "aten::log_softmax.int" if log else "aten::softmax.int"

    def group(n):
        b = ir.Builder()
        x, mask = b.input(), b.input()
        y = b.add(op, b.call("aten::add", b.call("aten::mul", x, 0.125), mask, 1), -1, None)
        return b.build([b.call("aten::mul", y, 2.0) if log else y])

    def eager(x, mask):
        if log:
            return [torch.log_softmax(x * 0.125 + mask, -1) * 2]
        return [torch.softmax(x * 0.125 + mask, -1)]

    return Case("log_softmax" if log else "softmax", group, lambda dt, n: [8 * _x(dt, n), torch.randn(n, dtype=dt)],
                eager)


def _layer_norm_block() -> Case:
    """x + bias -> layer_norm (weight and bias) -> gelu."""
    def group(n):
        b = ir.Builder()
        x, bias, w, c = (b.input() for _ in range(4))
        y = b.add("aten::layer_norm", b.call("aten::add", x, bias, 1), (n,), w, c, 1e-5, True)
        return b.build([b.call("aten::gelu", y, "none")])

    def eager(x, bias, w, c):
        return [F.gelu(F.layer_norm(x + bias, (x.shape[-1],), w, c, 1e-5))]

    return Case("layer_norm", group, lambda dt, n: [_x(dt, n) + 1] + [torch.randn(n, dtype=dt) for _ in range(3)],
                eager)


def _layer_norm_two_dims() -> Case:
    """layer_norm over the last two dims, no weight or bias, times 2."""
    def group(n):
        b = ir.Builder()
        x = b.input()
        return b.build([b.call("aten::mul", b.add("aten::layer_norm", x, (2, n), None, None, 1e-6, True), 2.0)])

    return Case("layer_norm_2d", group, lambda dt, n: [3 * _x(dt, n, 4, 2) - 1],
                lambda x: [F.layer_norm(x, x.shape[-2:], None, None, 1e-6) * 2])


def _rms_norm() -> Case:
    def group(n):
        b = ir.Builder()
        x, w = b.input(), b.input()
        return b.build([b.call("aten::mul", b.add("aten::rms_norm", x, (n,), w, 1e-6), 0.5)])

    return Case("rms_norm", group, lambda dt, n: [_x(dt, n), torch.randn(n, dtype=dt)],
                lambda x, w: [torch.rms_norm(x, (x.shape[-1],), w, 1e-6) * 0.5])


def _var(op: str, c, keepdim: bool) -> Case:
    """var or std over the last dim of x * 2 + 1 (correction c, or unbiased c for the .dim overloads), times 3."""
    def group(n):
        b = ir.Builder()
        x = b.input()
        y = b.call("aten::add", b.call("aten::mul", x, 2.0), 1.0, 1)
        return b.build([b.call("aten::mul", b.add(op, y, (-1,), c, keepdim), 3.0)])

    def eager(x):
        f = torch.var if op.startswith("aten::var") else torch.std
        kw = {"unbiased": c} if op.endswith(".dim") else {"correction": c}
        return [f(x * 2 + 1, -1, keepdim=keepdim, **kw) * 3]

    return Case(f"{op[6:]}-{c}-{'keep' if keepdim else 'drop'}", group, lambda dt, n: [_x(dt, n)], eager)


CASES = [_softmax(False), _softmax(True), _layer_norm_block(), _layer_norm_two_dims(), _rms_norm(),
         _var("aten::var.correction", 1, True), _var("aten::var.dim", False, False),
         _var("aten::std.correction", 0, True), _var("aten::std.dim", True, False)]
_GROUPS: dict = {}


def _spec(case: Case, n: int):
    if (case.id, n) not in _GROUPS:
        _GROUPS[case.id, n] = STORE.get(STORE.register(case.group(n)))
    return _GROUPS[case.id, n]


def _leaves(args: list) -> list:
    return [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]


def _assert_grads(got, want, dtype):
    """``got`` (of ``dtype``) within ``dtype``'s tolerance of ``want`` (float64), scaled by the largest gradient."""
    tol = tolerances(dtype)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape, (g.dtype, dtype, g.shape, w.shape)
        scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
        torch.testing.assert_close(g.double(), w.double(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   equal_nan=True)


def _assert_as_close_as_eagers(g, w, w64):
    """bfloat16 gradient ``g`` within twice eager's error (``w``: eager's bfloat16 gradient) of ``w64`` (float64),
    plus a unit of bfloat16 at the gradient's scale; NaN where float64 has NaN (a var of one element, correction 1)."""
    nan = w64.isnan()
    assert torch.equal(g.isnan(), nan)
    g, w, w64 = g.double()[~nan], w.double()[~nan], w64[~nan]
    scale = max(1.0, w64.abs().max().item()) if w64.numel() else 1.0
    err = (g - w64).abs().max().item() if g.numel() else 0.0
    eager_err = (w - w64).abs().max().item() if w.numel() else 0.0
    assert err <= 2 * eager_err + 8e-3 * scale, (err, eager_err)


def _assert_float32_as_close_as_eagers(g, w, w64):
    """float32 gradient ``g``, element by element, within float32's tolerance of ``w64`` (float64) or within twice
    eager's float32 error there (``w``): a row of nearly equal values (layer_norm over 2 elements) has a gradient
    that amplifies every rounding, eager's as much as the kernel's."""
    tol = tolerances(torch.float32)
    assert g.dtype == w.dtype == torch.float32 and g.shape == w64.shape
    nan = w64.isnan()
    assert torch.equal(g.isnan(), nan)
    g, w, w64 = g.double()[~nan], w.double()[~nan], w64[~nan]
    scale = max(1.0, w64.abs().max().item()) if w64.numel() else 1.0
    bad = (g - w64).abs() > 2 * (w - w64).abs() + tol["atol"] * scale + tol["rtol"] * w64.abs()
    assert not bool(bad.any()), (g[bad][:5], w[bad][:5], w64[bad][:5])


def _fused_and_eager64(case: Case, args: list, n: int):
    """The fused group's input gradients for ``args`` and eager's for the same values in float64 (the same output
    gradients, drawn in float64)."""
    args = _leaves(args)
    args64 = _leaves([a.detach().double() for a in args])
    outs = fuser.run_fusion(_spec(case, n).key, args)
    assert all(o.grad_fn is not None and o.grad_fn.name() in FUSED_BACKWARD for o in outs)
    ref = case.eager(*args64)
    grads = [torch.randn_like(r) for r in ref]
    got = torch.autograd.grad(outs, args, [g.to(o.dtype) for g, o in zip(grads, outs)])
    return got, torch.autograd.grad(ref, args64, grads)


# ------------------------------------------------------------------------------------------- the CPU backend

@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")  # var and std of a row of 1
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradients_match_eagers_in_float64_and_the_backward_is_a_row_kernel(case, dtype, _backwards):
    for n in LENGTHS:
        _backwards.clear()
        got, want = _fused_and_eager64(case, case.inputs(dtype, n), n)
        _assert_grads(got, want, dtype)
        assert row_backward_keys(_backwards), f"row {n}: the backward did not run as a fused row kernel"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_non_contiguous_row(case, _backwards):
    """x viewed transposed (its row walks a stride of 5), a weight of every second element; layer_norm over two
    dims (a row of two dims must walk one stride): every second row."""
    n = 33
    args = case.inputs(torch.float32, n)
    if args[0].dim() == 3:
        args[0] = torch.cat([args[0], args[0]])[::2]
        assert not args[0].is_contiguous()
    else:
        args[0] = args[0].transpose(-1, -2).contiguous().transpose(-1, -2)
        assert args[0].stride(-1) == 5
    args[1:] = [a.repeat_interleave(2)[::2] for a in args[1:]]
    assert all(a.stride(-1) == 2 for a in args[1:])
    got, want = _fused_and_eager64(case, args, n)
    _assert_grads(got, want, torch.float32)
    assert row_backward_keys(_backwards)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("softmax", "log_softmax", "layer_norm", "rms_norm",
                                                                "std.correction-0-keep")], ids=lambda c: c.id)
def test_bfloat16_gradients_as_close_to_float64_as_eagers(case, _backwards):
    """bfloat16: within twice eager's own error of float64 (plus a unit of bfloat16), eager's dtypes."""
    n = 64
    args = _leaves(case.inputs(torch.bfloat16, n))
    args64 = _leaves([a.detach().double() for a in args])
    ref = case.eager(*args64)
    grads = [torch.randn_like(r).to(torch.bfloat16) for r in ref]
    outs = fuser.run_fusion(_spec(case, n).key, args)
    assert outs[0].grad_fn.name() in FUSED_BACKWARD
    got = torch.autograd.grad(outs, args, grads)
    want = torch.autograd.grad(case.eager(*args), args, grads)
    want64 = torch.autograd.grad(ref, args64, [g.double() for g in grads])
    for g, w, w64 in zip(got, want, want64):
        assert g.dtype == w.dtype == torch.bfloat16 and g.shape == w.shape
        _assert_as_close_as_eagers(g, w, w64)
    assert row_backward_keys(_backwards)


def test_the_backward_holds_the_forwards_reductions_and_its_own():
    """layer_norm's backward that forms its statistics again (double backward's, and with FUSER_SAVE_STATISTICS=0;
    tests/test_saved_statistics.py has the one that reads them): its mean and variance recomputed from x, then the
    two means of its
    gradient, in one row group; the weight's and bias's gradients leave it element-level (in a call, fuser/grad_sums.py
    splits it: a column group sums them over the rows, tests/test_grad_sums.py)."""
    case = CASES[2]
    bw, args, want = backward_and_args(_spec(case, 40), case.inputs(torch.float64, 40), case.eager)
    assert [n.op for n in bw.spec.group.nodes if n.op == "aten::mean.dim"] == ["aten::mean.dim"] * 4
    assert not any(n.op == "aten::layer_norm" for n in bw.spec.group.nodes)
    assert bw.fwd_inputs == (0, 1, 2, 3)  # x, bias, weight and bias: the inputs, no saved statistics
    outs = fuser.run_fusion(bw.spec.key, args)
    assert [o.shape for o in outs] == [args[0].shape] * 3  # x's and the added bias's: one tensor (an alias)
    got = dict(zip(bw.grad_inputs, outs))
    got.update({j: outs[k] for j, k in bw.aliases})
    _assert_grads([got[j].sum_to_size(w.shape) for j, w in enumerate(want)], want, torch.float64)


def test_a_gradient_only_for_the_weight():
    """x does not require grad: only the weight's gradient is formed (rms_norm)."""
    case = CASES[4]
    x, w = case.inputs(torch.float64, 31)
    w.requires_grad_()
    (out,) = fuser.run_fusion(_spec(case, 31).key, [x, w])
    assert out.grad_fn.name() in FUSED_BACKWARD
    gy = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, w, gy)
    (want,) = torch.autograd.grad(case.eager(x, w)[0], w, gy)
    _assert_grads([got], [want], torch.float64)


def _special_rows(dt, n):
    """Rows holding inf, NaN and -inf, a constant row (variance 0), then ordinary rows."""
    x = 3 * torch.randn(6, n, dtype=dt)
    x[0, 3], x[1, 5], x[2, 2], x[3] = float("inf"), float("nan"), -float("inf"), 1.5
    return x


@pytest.mark.parametrize("op,eager", [
    ("aten::softmax.int", lambda x: torch.softmax(x, 1)), ("aten::log_softmax.int", lambda x: torch.log_softmax(x, 1)),
    ("aten::std.correction", lambda x: torch.std(x, (1,), correction=1)),
    ("aten::layer_norm", lambda x: F.layer_norm(x, (x.shape[-1],)))], ids=lambda a: a if isinstance(a, str) else "")
def test_special_values_and_constant_rows_as_eager(op, eager, _backwards):
    """NaN, inf and -inf in a row (softmax's positive dim), and a constant row (std's masked zero, layer_norm's
    zero variance): eager's gradients, NaN where eager's are."""
    def group(n):
        b = ir.Builder()
        x = b.input()
        args = {"aten::std.correction": ((1,), 1, False), "aten::layer_norm": ((n,), None, None, 1e-5, True)}
        return b.build([b.call("aten::mul", b.add(op, x, *args.get(op, (1, None))), 2.0)])

    case = Case(op, group, lambda dt, n: [_special_rows(dt, n)], lambda x: [eager(x) * 2])
    got, want = _fused_and_eager64(case, case.inputs(torch.float32, 9), 9)
    _assert_grads(got, want, torch.float32)
    assert row_backward_keys(_backwards)


def test_layer_norm_with_one_of_weight_and_bias_and_softmax_to_another_dtype(_backwards):
    """layer_norm with a weight and no bias, and with a bias and no weight; softmax of float16 computed in float32
    (its dtype argument: eager converts x first, and the gradient back)."""
    n = 40

    def group(w, c):
        b = ir.Builder()
        x, v = b.input(), b.input()
        return b.build([b.add("aten::layer_norm", x, (n,), v if w else None, v if c else None, 1e-5, True)])

    for w, c in ((True, False), (False, True)):
        case = Case(f"layer_norm-{w}-{c}", lambda _, w=w, c=c: group(w, c),
                    lambda dt, _: [torch.randn(3, n, dtype=dt), torch.randn(n, dtype=dt)],
                    lambda x, v, w=w, c=c: [F.layer_norm(x, (n,), v if w else None, v if c else None, 1e-5)])
        got, want = _fused_and_eager64(case, case.inputs(torch.float32, n), n)
        _assert_grads(got, want, torch.float32)
    b = ir.Builder()
    x = b.input()
    spec = STORE.get(STORE.register(b.build([b.add("aten::softmax.int", x, -1, 6)])))  # 6: float32
    x = torch.randn(3, n, dtype=torch.float16, requires_grad=True)
    (out,) = fuser.run_fusion(spec.key, [x])
    assert out.dtype == torch.float32 and out.grad_fn.name() in FUSED_BACKWARD
    gy = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, gy)
    (want,) = torch.autograd.grad(torch.softmax(x, -1, dtype=torch.float32), x, gy)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, **tolerances(torch.float16))
    assert len(row_backward_keys(_backwards)) == 3


_SMALL = [c for c in CASES if c.id in ("softmax", "log_softmax", "layer_norm", "rms_norm", "std.dim-True-drop")]


@pytest.mark.parametrize("case", _SMALL, ids=lambda c: c.id)
def test_gradcheck_and_double_backward(case):
    """float64 gradcheck and gradgradcheck: the backward of a backward group is formed (fused) or falls back to
    eager's autograd, never wrong."""
    n = 5
    args = [a[:2] if k == 0 else a for k, a in enumerate(case.inputs(torch.float64, n))]
    spec = _spec(case, n)

    def fn(*ts):
        return tuple(fuser.run_fusion(spec.key, list(ts)))

    ts = tuple(_leaves(args))
    assert torch.autograd.gradcheck(fn, ts)
    assert torch.autograd.gradgradcheck(fn, ts)


# ------------------------------------------------------------------------------------ CUDA, host-emulated

EMULATED = [(c, dt) for c in CASES for dt in (torch.float32, torch.bfloat16)]


@pytest.fixture(scope="module")
def emulated():
    """Every emulated backward's kernel registered first, so they compile together."""
    em = emulate.default()
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*degrees of freedom is <= 0", UserWarning)
        for case, dtype in EMULATED:
            for n in LENGTHS:
                bw, args, _ = backward_and_args(_spec(case, n), case.inputs(dtype, n), case.eager)
                assert row_emulate.kernel_for(bw.spec.group, args, em) is not None
    em.compile_pending()
    return em


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")
@pytest.mark.parametrize("case,dtype", EMULATED, ids=[f"{c.id}-{str(dt)[6:]}" for c, dt in EMULATED])
def test_cuda_row_backward_emulated_matches_eager(case, dtype, emulated):
    """The backward group's CUDA row kernel (emulated) against eager's gradients in float64 for the same output
    gradients (float32: within its tolerance; bfloat16: within twice eager's bfloat16 error plus a unit)."""
    for n in LENGTHS:
        inputs = case.inputs(dtype, n)
        bw, args, want = backward_and_args(_spec(case, n), inputs, case.eager)
        outs = row_emulate.run(bw.spec.group, args, emulated)
        assert outs is not None
        got = [None] * len(inputs)
        for j, r in [*zip(bw.grad_inputs, outs), *((j, outs[k]) for j, k in bw.aliases)]:
            got[j] = r.sum_to_size(want[j].shape).to(want[j].dtype)
        start = len(bw.fwd_inputs) + len(bw.saved_outputs)  # (softmax's backward reads its saved output)
        grads = args[start:start + len(bw.grad_outputs)]
        x64 = _leaves([a.detach().double() for a in inputs])
        ref = case.eager(*x64)
        want64 = torch.autograd.grad(ref, x64, [g.double().reshape(r.shape) for g, r in zip(grads, ref)])
        if dtype == torch.float32:
            for g, w, w64 in zip(got, want, want64):
                _assert_float32_as_close_as_eagers(g, w, w64)
            continue
        for g, w, w64 in zip(got, want, want64):
            _assert_as_close_as_eagers(g, w, w64)


# ----------------------------------------------------------------------------------------- training

def _block(x, wq, wk, wv, wo, g1, b1, w1, c1, w2, c2, g2, b2):
    """A transformer block with torch's own ops: single-head attention (torch.softmax of the scaled, masked
    scores), residual, F.layer_norm with weight and bias, a GELU MLP. Matmuls stay eager's; the pass fuses the
    rest (the softmax with its scale and mask, each layer norm with its residual add, the bias + gelu)."""
    q, k, v = x @ wq, x @ wk, x @ wv
    s = q @ k.transpose(-1, -2)
    mask = torch.triu(torch.full((s.shape[-1], s.shape[-1]), -1e4, device=x.device), 1)
    p = torch.softmax(s * 0.25 + mask, -1)
    h = F.layer_norm(x + (p @ v) @ wo, (32,), g1, b1, 1e-5)
    h = h + F.gelu(h @ w1 + c1) @ w2 + c2
    return F.layer_norm(h, (32,), g2, b2, 1e-5)


def _train(device: str, backwards: list, rtol: float):
    block = fuser.fuse(torch.jit.script(_block))
    mine, x = train_block_alongside_eager(block, _block, device, rtol=rtol, atol=rtol / 100)
    g = fuser.graph_for(block, x, *mine[:-1])
    kinds = [[n.kind() for n in fg.g("Subgraph").nodes()] for fg in g.findAllNodes("prim::FusionGroup")]
    assert sum("aten::layer_norm" in k for k in kinds) == 2 and sum("aten::softmax" in k for k in kinds) == 1, kinds
    assert len(row_backward_keys(backwards)) >= 3, "the softmax and layer norms' backwards did not run as row kernels"
    # the layer norms' backwards read their saved statistics, the softmax's its saved output: no step recomputed
    assert {n for s in backwards for n in ("aten::softmax", "aten::layer_norm")
            if any(m.origin == n for m in s.group.nodes)} == set()


def test_transformer_block_training_losses_match_eager_step_by_step(_backwards):
    _train("cpu", _backwards, 1e-5)


@pytest.mark.gpu
def test_transformer_block_training_losses_match_eager_step_by_step_on_the_gpu(_backwards):
    """(eager's CUDA layer_norm keeps Welford statistics, the row kernel two passes: rtol 1e-4, as the written-out
    block's CPU test in tests/test_reduction_grad.py)"""
    _train("cuda", _backwards, 1e-4)


# ------------------------------------------------------------------------------------------- the benchmark rows

@pytest.mark.parametrize("name", [w.name for w in bench.workloads.NORM_TRAIN_WORKLOADS
                                  if not w.name.endswith(("_r512_train", "_r16k_train", "_r64k_train"))])
def test_the_benchmarks_training_rows_run_fused_backwards(name, _backwards):
    """Each forward + backward normalization workload (row length 4096, its small shape) through the pass: eager's
    gradients (float64 reference), the backward a fused row kernel."""
    wl = next(w for w in bench.WORKLOADS if w.name == name)
    step = bench.workloads._train_step(fuser.fuse(bench._script_function(wl)))
    for _ in range(3):  # the profiling executor's first calls record shapes
        args = _leaves(wl.make_inputs(wl.shapes["small"], torch.float32, torch.device("cpu")))
        gy = torch.randn(args[0].shape, dtype=torch.float64)
        got = step(*args, (gy.float(),))
    args64 = _leaves([a.detach().double() for a in args])
    want = bench.workloads._train_step(bench._python_function(wl))(*args64, (gy,))
    _assert_grads(got, want, torch.float32)
    assert row_backward_keys(_backwards)
