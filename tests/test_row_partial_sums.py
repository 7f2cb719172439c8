"""Weight and bias gradients summed inside the backward row kernel (fuser/rows/passes.py's column_sum_form, the fused
form of fuser/grad_sums.py): the row kernel that writes x's gradient adds dy * xhat and dy into a partial row per
part of the rows, and a second stage adds the parts in a fixed order; no column kernel reads x and dy again.
layer_norm with weight and bias, with a weight only, rms_norm with a weight; rows of 1, 7, 1000 and 4097, row
lengths 1, 31, 32, 1024 and 65537 (some combinations); float32 and float64 against eager's float64 gradients,
bfloat16 within twice eager's own error of float64; each asserted to take the fused form (it ran, no column kernel,
no sum_to_size). The same sums for one and two threads (the parts are fixed by the row count); the forms that
keep the column kernel (a mask summed over some row dims only; float32 past CPU_MAX_SUMMED elements where that is
set; a CUDA row of several trips) asserted to keep it; through the TorchScript pass and the native hot path; the CUDA kernels (a
thread's columns summed in registers, the slots' partial rows added by a second kernel) under the host
emulation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import FUSED_BACKWARD, SumsWatch, scripted_training_steps, tolerances

import fuser
from fuser import autodiff, executor, grad_sums, ir, settings
from fuser.kernel_cache import STORE
from fuser.rows.plan import RowPlan, plan as row_plan

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")  # (tests/conftest.py)


@dataclass(frozen=True)
class Case:
    id: str
    group: Callable[[int], ir.Group]
    n_params: int  # inputs besides x, each [n]
    eager: Callable[..., torch.Tensor]


def _layer_norm(bias: bool):
    def group(n):
        b = ir.Builder()
        x, w = b.input(), b.input()
        c = b.input() if bias else None
        return b.build([b.add("aten::layer_norm", x, (n,), w, c, 1e-5, True)])
    return group


def _rms_norm(n):
    b = ir.Builder()
    x, w = b.input(), b.input()
    return b.build([b.add("aten::rms_norm", x, (n,), w, 1e-6)])


CASES = [
    Case("layer_norm", _layer_norm(True), 2, lambda x, w, c: F.layer_norm(x, x.shape[-1:], w, c, 1e-5)),
    Case("layer_norm_weight", _layer_norm(False), 1, lambda x, w: F.layer_norm(x, x.shape[-1:], w, None, 1e-5)),
    Case("rms_norm", _rms_norm, 1, lambda x, w: torch.rms_norm(x, x.shape[-1:], w, 1e-6)),
]
# (rows..., n): rows of 3, 7, 250, 1000, 4097 (and [1, 7], a row dim of size 1) by lengths 1, 31, 32, 1024, 65537, up
# to 2^18 elements (where fuser.rows.plan.CPU_MAX_SUMMED is set, float32 and float64 take the split beyond). (One row is not summed: the
# weight's gradient is the row's, reshaped; test_one_row_through_the_fused_kernel runs it.)
SHAPES = [(7, 31), (3, 65537), (1000, 32), (250, 1024), (4097, 31), (4097, 1), (1, 7, 32)]
SHAPES_SHORT = [(7, 1024), (1000, 32), (4097, 1)]
SHAPES_BF16 = SHAPES_SHORT + [(1000, 1024), (7, 65537)]  # (past CPU_MAX_SUMMED too: no split for them)
_SPECS: dict = {}


def _spec(case: Case, n: int):
    if (case.id, n) not in _SPECS:
        _SPECS[case.id, n] = STORE.get(STORE.register(case.group(n)))
    return _SPECS[case.id, n]


def _inputs(case: Case, shape, dtype):
    n = shape[-1]
    return [(torch.randn(shape, dtype=dtype) + 0.5).requires_grad_()] + [
        (1 + 0.5 * torch.randn(n, dtype=dtype)).requires_grad_() for _ in range(case.n_params)]


@pytest.fixture
def watch(monkeypatch):
    return SumsWatch(monkeypatch)


def _grads(case, args, gy, watch=None):
    """The fused group's gradients of ``args`` for output gradient ``gy`` (``watch`` cleared just before)."""
    out = fuser.run_fusion(_spec(case, args[0].shape[-1]).key, args)[0]
    assert out.grad_fn is not None and out.grad_fn.name() in FUSED_BACKWARD
    if watch is not None:
        watch.clear()
    return torch.autograd.grad(out, args, gy)


def _eager(case, args, gy):
    leaves = [a.detach().clone().requires_grad_() for a in args]
    return torch.autograd.grad(case.eager(*leaves), leaves, gy)


def _assert_close(got, want64, dtype):
    tol = tolerances(dtype)
    for g, w in zip(got, want64):
        assert g.dtype == dtype and g.shape == w.shape, (g.dtype, g.shape, w.shape)
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.double(), w, rtol=tol["rtol"], atol=tol["atol"] * scale)


def _assert_as_close_as_eagers(got, want, want64, shape):
    """bfloat16 gradients ``got`` within twice eager's (``want``) error of float64 (``want64``), plus a unit of
    bfloat16 at the gradient's scale."""
    for g, w, w64 in zip(got, want, want64):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        scale = max(1.0, w64.abs().max().item())
        err, eager_err = (g.double() - w64).abs().max().item(), (w.double() - w64).abs().max().item()
        assert err <= 2 * eager_err + 8e-3 * scale, (shape, err, eager_err)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_weight_and_bias_gradients_are_summed_in_the_row_kernel(case, dtype, watch):
    """eager's float64 gradients within the dtype's tolerance; one kernel (the fused group), no column kernel."""
    for shape in SHAPES if dtype == torch.float32 else SHAPES_SHORT:
        args = _inputs(case, shape, dtype)
        gy = torch.randn(shape, dtype=torch.float64)
        got = _grads(case, args, gy.to(dtype), watch)
        assert watch.took() == (1, 0, 0), (shape, watch.took())
        _assert_close(got, _eager(case, [a.double() for a in args], gy), dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bfloat16_sums_are_as_close_to_float64_as_eagers(case, watch):
    """bfloat16: the sums accumulate in float (the statistics never leave the kernel, so this form runs where the
    split into a row and a column kernel would not); each gradient within twice eager's error of float64, plus a
    unit of bfloat16 at its scale."""
    for shape in SHAPES_BF16:
        args = _inputs(case, shape, torch.bfloat16)
        gy = torch.randn(shape, dtype=torch.bfloat16)
        got = _grads(case, args, gy, watch)
        assert watch.took() == (1, 0, 0), (shape, watch.took())
        _assert_as_close_as_eagers(got, _eager(case, args, gy), _eager(case, [a.double() for a in args], gy.double()),
                                   shape)


@pytest.mark.parametrize("shape", ((1000, 256), (12, 20000)))  # parts of 16 rows; of 4 (long rows)
def test_the_sums_do_not_depend_on_the_threads(shape):
    """The rows are split into parts by their count and length, not by the threads: one thread and two give the
    same bits, and so do two runs."""
    case = CASES[0]
    args = _inputs(case, shape, torch.float32)
    gy = torch.randn(shape)
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            got.append(_grads(case, args, gy))
    finally:
        torch.set_num_threads(threads)
    for other in got[1:]:
        for g, h in zip(got[0], other):
            assert torch.equal(g, h)


def _large_float32(watch, rows: int, took: tuple) -> None:
    """layer_norm's gradients over [rows, 1024] float32: the forms ``watch`` saw (fused, columns, sum_to_size), and
    eager's float64 gradients within float32's tolerance."""
    case = CASES[0]
    args = _inputs(case, (rows, 1024), torch.float32)
    gy = torch.randn(rows, 1024, dtype=torch.float64)
    got = _grads(case, args, gy.float(), watch)
    assert watch.took() == took, watch.took()
    _assert_close(got, _eager(case, [a.double() for a in args], gy), torch.float32)


def test_float32_past_the_bound_takes_the_split(watch, monkeypatch):
    """float32 over more than CPU_MAX_SUMMED elements, where that is set (none by default: fuser/rows/plan.py): a
    row kernel then a column kernel, eager's gradients."""
    import sys
    monkeypatch.setattr(sys.modules["fuser.rows.plan"], "CPU_MAX_SUMMED", 1 << 18)
    _large_float32(watch, 600, (0, 1, 0))


def test_float32_of_any_size_takes_the_fused_form_by_default(watch):
    """No bound by default (fuser.rows.plan.CPU_MAX_SUMMED None: the split measured slower at every size of the CPU
    benchmark's): float32 over 2^19 elements sums in the row kernel, eager's gradients. (Rows of their own: a
    signature whose fused plan fell back keeps the split.)"""
    _large_float32(watch, 520, (1, 0, 0))


def test_the_plan_takes_sums_over_the_row_dims_only(watch):
    """The fused group's row plan: its sums are the weight's and the bias's gradients, [1, 1, n] (keepdim); on CUDA the
    same where the row takes one trip, otherwise the plan says why not (the split runs). A mask of [5, n]
    against [3, 5, n] is summed over dim 0 alone, not over every row dim: the column kernel sums it, as before."""
    case = CASES[0]
    args = _inputs(case, (3, 5, 40), torch.float32)
    spec = _spec(case, 40)
    sig = tuple((a.dtype, False) for a in args)
    bw = autodiff.backward_for(spec, (True,) * 3, (True,), sig)
    shapes = [a.shape for a in args]
    bargs = autodiff.backward_args(spec, bw, [a.detach() for a in args], [torch.randn(3, 5, 40)], shapes)
    dims = grad_sums.plan(spec, bw, shapes, args[0].shape, sig, bargs)
    fused = grad_sums.fused_for(bw, dims)
    assert fused is grad_sums.fused_for(bw, dims) and fused.whole == (0, None, None) and fused.summed == (None, 1, 2)
    with torch.no_grad():
        p = row_plan(fused.spec, bargs)
        assert isinstance(p, RowPlan) and p.key.sums == (1, 2), p
        assert p.out_shapes == [(3, 5, 40), (1, 1, 40), (1, 1, 40)] and p.rows == 15 and p.cols == 40
        p = row_plan(fused.spec, bargs, target="cuda")
        assert isinstance(p, RowPlan) and p.key.sums == (1, 2) and p.key.shape.held, p
        # a row of several trips: the plan says why (the split: a row kernel, then a column kernel)
        long = [torch.randn(3, 5, 65537), torch.randn(65537), torch.randn(3, 5, 65537)]
        why = row_plan(fused.spec, long, target="cuda")
        assert isinstance(why, str) and "several trips" in why, why

    b = ir.Builder()
    x, mask = b.input(), b.input()
    g = b.build([b.add("aten::softmax.int", b.call("aten::add", x, mask, 1), -1, None)])
    spec = STORE.get(STORE.register(g))
    x, mask = torch.randn(3, 5, 40, requires_grad=True), torch.randn(5, 40, requires_grad=True)
    out = fuser.run_fusion(spec.key, [x, mask])[0]
    gy = torch.randn(3, 5, 40)
    watch.clear()
    got = torch.autograd.grad(out, [x, mask], gy)
    assert watch.took() == (0, 1, 0), watch.took()
    x64, m64 = (a.detach().double().requires_grad_() for a in (x, mask))
    _assert_close(got, torch.autograd.grad(torch.softmax(x64 + m64, -1), [x64, m64], gy.double()), torch.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_row_through_the_fused_kernel(case):
    """The fused group run by itself on one row and on 7 (float32): its outputs, the sums included, those of eager's
    ops on the same arguments in float64."""
    from fuser import fallback
    n = 33
    args = _inputs(case, (7, n), torch.float32)
    spec = _spec(case, n)
    sig = tuple((a.dtype, False) for a in args)
    bw = autodiff.backward_for(spec, (True,) * len(args), (True,), sig)
    shapes = [a.shape for a in args]
    bargs = autodiff.backward_args(spec, bw, [a.detach() for a in args], [torch.randn(7, n)], shapes)
    fused = grad_sums.fused_for(bw, grad_sums.plan(spec, bw, shapes, args[0].shape, sig, bargs))
    for rows in (1, 7):
        one = [a[:rows] if a.dim() == 2 else a for a in bargs]
        with torch.no_grad():
            p = row_plan(fused.spec, one)
            assert isinstance(p, RowPlan) and p.key.sums and p.rows == rows, p
            got = executor.run(fused.spec, one)
        want = fallback.evaluate(fused.spec.group, [a.double() for a in one])
        assert got is not None and len(got) == len(want)
        _assert_close(got, want, torch.float32)


def test_a_sum_along_the_row_stays_a_row_reduction():
    """An output summed along the row (its trailing dim) is the row kernel's own reduction, not a column sum."""
    b = ir.Builder()
    x = b.input()
    y = b.call("aten::mul", x, 2.0)
    g = b.build([b.add("aten::softmax.int", y, -1, None), b.add("aten::sum.dim_IntList", y, (-1,), False, None)])
    spec = STORE.get(STORE.register(g))
    x = torch.randn(6, 33)
    p = row_plan(spec, [x])
    assert isinstance(p, RowPlan) and p.key.sums == ()
    got = executor.run(spec, [x])
    assert got is not None
    torch.testing.assert_close(got[0], torch.softmax(x * 2, -1))
    torch.testing.assert_close(got[1], (x * 2).sum(-1))


def _ln_train(x, w, b):
    return torch.layer_norm(x, [64], w, b, 1e-5) * 2.0


def _rms_train(x, w):
    return torch.rms_norm(x, [64], w, 1e-6) * 0.5


@pytest.mark.parametrize("fn", (_ln_train, _rms_train), ids=lambda f: f.__name__)
def test_the_pass_and_the_native_hot_path_take_the_fused_form(fn, watch):
    """Through torch.jit.script and the pass: the repeated calls (the native hot path serves them, their backward
    included: it runs the fused group) sum the weight's and bias's gradients in the row kernel; eager's gradients."""
    n_params = 2 if fn is _ln_train else 1

    def make_args():
        return [torch.randn(33, 64, requires_grad=True)] + [torch.randn(64, requires_grad=True)
                                                            for _ in range(n_params)]

    for step, y, args, gy, got in scripted_training_steps(fn, make_args, watch):
        if step >= 2:  # (the profiling executor's first calls run unfused)
            assert y.grad_fn.name() in FUSED_BACKWARD
            assert watch.took() == (1, 0, 0), (step, watch.took())
        args64 = [a.detach().double().requires_grad_() for a in args]
        _assert_close(got, torch.autograd.grad(fn(*args64), args64, gy.double()), torch.float32)


# ------------------------------------------------------------------------------------ CUDA, host-emulated

def _emulated(spec, args):
    """A backward's kernels through the CUDA host emulation (row, column or pointwise); None where a GPU would
    fall back."""
    from fuser.cuda import emulate
    from fuser.rows import emulate as row_emulate
    return row_emulate.run(spec.group, args) if spec.has_reduction else emulate.run_graph(spec.group, args)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_kernels_emulated_sum_in_the_row_kernel(case, dtype, monkeypatch):
    """The fused group's CUDA row kernel (each thread's columns summed in registers over its rows, written as its
    slot's partial row) and the second kernel adding the slots, under the host emulation's sanitizers: rows of 7,
    50, 300 (more than the emulated blocks hold: grid-strided slots) and [1, 7]; lengths 1, 31, 33, 1024 (a
    partial last vector, whole vectors), and 4096 (layer_norm's row not held in registers, read again by each pass
    in one trip). eager's float64 gradients (bfloat16: within twice eager's error)."""
    monkeypatch.setattr(grad_sums, "_no_fused", set())  # (a decline of these CPU tensors would be this test's)
    ran = []

    def launch(spec, args):
        out = _emulated(spec, args)
        ran.append((spec.key in grad_sums.fused_keys, out is not None))
        return out

    shapes = ((7, 31), (50, 1), (300, 33), (1, 7, 1024)) if dtype != torch.bfloat16 else ((300, 33),)
    if dtype == torch.float32 and case.id != "rms_norm":  # (a row not held in registers, in one trip: 1024 threads)
        shapes += ((5, 4096),)
    for shape in shapes:
        args = _inputs(case, shape, dtype)
        gy = torch.randn(shape, dtype=torch.float64)
        spec = _spec(case, shape[-1])
        sig = tuple((a.dtype, False) for a in args)
        bw = autodiff.backward_for(spec, (True,) * len(args), (True,), sig)
        shapes = [a.shape for a in args]
        bargs = autodiff.backward_args(spec, bw, [a.detach() for a in args], [gy.to(dtype)], shapes)
        ran.clear()
        got = grad_sums.run(spec, bw, bargs, shapes, args[0].shape, sig, launch=launch)
        assert ran == [(True, True)], (shape, ran)
        got = [g.reshape(args[j].shape) for j, g in sorted(got, key=lambda jg: jg[0])]
        want64 = _eager(case, [a.double() for a in args], gy)
        if dtype != torch.bfloat16:
            _assert_close(got, want64, dtype)
            continue
        want = _eager(case, args, gy.to(dtype))
        _assert_as_close_as_eagers(got, want, want64, shape)


# ------------------------------------------------------------------------------------------- on a GPU

# (eager's rms_norm on CUDA over rows not a multiple of 4 is not ours to match: fuser/rows/plan.py leaves it to eager)
GPU_SHAPES = ((7, 32), (300, 36), (4096, 1024), (16384, 4096), (64, 65536), (7, 31), (300, 33))
GPU_CASES = [(c, shape) for c in CASES for shape in GPU_SHAPES if c.id != "rms_norm" or shape[-1] % 4 == 0]


@pytest.mark.gpu
@pytest.mark.parametrize("in_row", (True, False), ids=("in_row", "column_kernel"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case,shape", GPU_CASES, ids=[f"{c.id}-{r}x{n}" for c, (r, n) in GPU_CASES])
def test_the_sums_in_the_row_kernel_on_the_gpu(case, shape, dtype, in_row, watch, monkeypatch):
    """As on the CPU and under the emulation: the fused form where the row takes one trip (the plan says),
    the column kernel otherwise; eager's float64 gradients (bfloat16: within twice eager's error); two runs give
    the same bits (no atomics). Both settings of ``settings.cuda_column_sums`` (the fused form on CUDA, on by
    default). scripts/gpu_check.sh runs the small shapes under racecheck."""
    monkeypatch.setattr(settings, "cuda_column_sums", in_row)
    args = [a.detach().cuda().requires_grad_() for a in _inputs(case, shape, dtype)]
    gy = torch.randn(shape, dtype=torch.float64, device="cuda")
    got = _grads(case, args, gy.to(dtype), watch)
    took = watch.took()  # (bfloat16 without the fused form: the old path, sum_to_size)
    assert took in ((1, 0, 0), (0, 1, 0)) or (dtype == torch.bfloat16 and took[:2] == (0, 0)), (shape, took)
    assert in_row or took[0] == 0, (shape, took)
    again = _grads(case, args, gy.to(dtype))
    assert all(torch.equal(g, h) for g, h in zip(got, again)), shape
    want64 = _eager(case, [a.double() for a in args], gy)
    if dtype == torch.float32:
        _assert_close(got, want64, dtype)
        return
    want = _eager(case, args, gy.to(dtype))
    _assert_as_close_as_eagers(got, want, want64, shape)


def _apart_group() -> ir.Group:
    """A row reduction and, beside it, a column sum of a value it makes (the torch.compile door's layer_norm
    backward has this form: its weight's gradient): outputs sum(dy * (x - mean(x)), dim 0, keepdim) and
    (x - mean(x)) * dy * w."""
    b = ir.Builder()
    x, dy, w = b.input(), b.input(), b.input()
    centered = b.call("aten::sub", x, b.add("aten::mean.dim", x, (-1,), True, None), 1)
    g = b.call("aten::mul", dy, centered)
    return b.build([b.add("aten::sum.dim_IntList", g, (0,), True, None), b.call("aten::mul", g, w)])


def _apart_inputs(rows: int, n: int, dtype=torch.float32):
    return [torch.randn(rows, n, dtype=dtype), torch.randn(rows, n, dtype=dtype), torch.randn(n, dtype=dtype)]


def _check_apart(got, args):
    from fuser import fallback
    want = fallback.evaluate(_apart_group(), [a.double() for a in args])
    assert [tuple(o.shape) for o in got] == [tuple(r.shape) for r in want]
    for o, r in zip(got, want):
        assert o.dtype == args[0].dtype
        scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4 * scale)


def test_column_sums_the_kernel_cannot_take_are_summed_after_it(monkeypatch):
    """Where a row kernel cannot sum its column sums (float32 past CPU_MAX_SUMMED elements where that is set, a
    CUDA row of several trips), the plan keeps them apart (RowKey.apart): the kernel writes the summed values
    whole and eager's sum adds them up after it, rather than the whole group falling back to the interpreter. Run
    three times through run_fusion (the native hot path hands such calls to Python) against eager's ops in
    float64. A spec in SUMS_IN_KERNEL_ONLY (grad_sums' fused backwards, which split their own way) is refused."""
    import sys
    plan_module = sys.modules["fuser.rows.plan"]  # (fuser.rows.plan is also the function's name there)
    spec = STORE.get(STORE.register(_apart_group()))
    args = _apart_inputs(70, 48)
    with torch.no_grad():
        p = row_plan(spec, args)
        assert isinstance(p, RowPlan) and p.key.sums == (0,) and not p.key.apart, p
    monkeypatch.setattr(plan_module, "CPU_MAX_SUMMED", 16)
    with torch.no_grad():
        p = row_plan(spec, args)
        assert isinstance(p, RowPlan) and p.key.sums == () and p.key.apart == (0,), p
        assert p.apart == ((0, (0,), True),) and p.out_shapes[0] == (70, 48)
    for _ in range(3):
        _check_apart(fuser.run_fusion(spec.key, args), args)
    monkeypatch.setattr(plan_module, "SUMS_IN_KERNEL_ONLY", {spec.key})
    with torch.no_grad():
        why = row_plan(spec, args)
    assert isinstance(why, str) and "a column kernel sums them" in why, why


@pytest.mark.parametrize("rows,n", [(5, 65537), (3, 40), (0, 65537), (5, 20000)])
def test_column_sums_apart_in_the_cuda_emulation(rows, n):
    """The same group's CUDA row kernel under the host emulation: a row of 65,537 float32 elements takes several
    trips and its sums would pass a block's shared memory, so the column sum is kept apart (and over no rows it is
    zeros, eager's); a row of 40 sums it in the kernel, and so does a row of 20,000 (several trips, a slot a column
    in shared memory: CudaShape.trip_sums)."""
    from fuser.rows import decompose, emulate as row_emulate
    from fuser.rows.shape import cuda_sums_in_kernel
    spec = STORE.get(STORE.register(_apart_group()))
    args = _apart_inputs(rows, n)
    with torch.no_grad():
        p = row_plan(spec, args, target="cuda")
    assert isinstance(p, RowPlan), p
    assert p.key.apart == ((0,) if n > 20000 else ()) and p.key.sums == (() if n > 20000 else (0,)), p.key
    assert p.key.shape.trip_sums == (n == 20000), p.key.shape
    # what the torch.compile door's partition asks before any call: the plan's choice
    sizes = [a.element_size() for a in args] + [4, 4]
    assert cuda_sums_in_kernel(decompose.expand(spec.group), (0,), n, sizes, torch.device("cpu")) == (not p.key.apart)
    _check_apart(row_emulate.run(spec.group, args), args)
