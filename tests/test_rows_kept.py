"""The CPU row kernel's kept values (issues 11 and 12: fuser/rows/passes.py kept_values, fuser/rows/codegen/kernel.py):
a costly element value (exp, tanh...) that a later pass along the row reads is written to a per-thread scratch row by
the pass that computes it and read back by the later ones, rather than computed again. Softmax's output pass reads
exp(x - max) and multiplies (as eager's CPU kernel does); the backward of a softmax read further (which recomputes
the forward from x) computes exp once rather than three times, and one of a softmax output none at all. Against eager in float64 on seeded random inputs, float32 and bfloat16,
at row lengths that end in whole vector trips and in scalar tails, on rows split across threads and on strided
rows (the scalar loop alone fills the scratch row); and the generated source computing exp in one pass only."""
from __future__ import annotations

import re

import pytest
import torch
from helpers import FUSED_BACKWARD, check_against_float64, fused_run, row_backward_keys, row_kernels, tolerances

import fuser
from fuser import ir
from fuser.kernel_cache import STORE

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")  # (tests/conftest.py)

DTYPES = (torch.float32, torch.bfloat16)
# 1 and 31: the scalar loop alone; 32 (4 AVX2 vectors of 8: one trip) and 64: trips only; 33, 77, 1031: trips and
# a tail (AVX-512's 16 lanes: 64 is one trip)
LENGTHS = (1, 31, 32, 33, 64, 77, 1031)
TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 2.4e-2}


def _softmax_group():
    b = ir.Builder()
    x = b.input()
    return b.build([b.add("aten::softmax.int", b.call("aten::mul", x, 0.125), -1, None)])


def _softmax_eager(x):
    return [torch.softmax(x * 0.125, -1)]


def _softmax_times_group():
    """softmax(x * 0.125) * 2: the softmax is not an output, so its backward recomputes it from x."""
    b = ir.Builder()
    x = b.input()
    return b.build([b.call("aten::mul", b.add("aten::softmax.int", b.call("aten::mul", x, 0.125), -1, None), 2.0)])


def _softmax_times_eager(x):
    return [torch.softmax(x * 0.125, -1) * 2]


def _chain_group():
    """Two costly values kept across passes: e = exp(x / 2) read by the two passes after its own, t = tanh(e * s1)
    by the one after its own; the log of a row-level sum is computed once a row (not kept)."""
    b = ir.Builder()
    x = b.input()
    e = b.call("aten::exp", b.call("aten::mul", x, 0.5))
    s1 = b.add("aten::mean.dim", e, (-1,), True, None)
    t = b.call("aten::tanh", b.call("aten::div", e, s1))
    s2 = b.add("aten::sum.dim_IntList", b.call("aten::mul", t, e), (-1,), True, None)
    out = b.call("aten::add", b.call("aten::mul", t, s2), e, 1)
    return b.build([out, b.call("aten::sub", out, b.call("aten::log", s2), 1)])


def _chain_eager(x):
    e = torch.exp(x * 0.5)
    t = torch.tanh(e / e.mean(-1, keepdim=True))
    s2 = (t * e).sum(-1, keepdim=True)
    out = t * s2 + e
    return [out, out - torch.log(s2)]


def _spec(group):
    return STORE.get(STORE.register(group))


def _check(outs, eager, args):
    check_against_float64(outs, eager, args, TOL)


def _kernel_source(spec, dtype) -> str:
    """The source of ``spec``'s row kernel that has run for inputs of ``dtype``."""
    (kernel,) = [k for k in row_kernels(spec) if k.out_dtypes == (dtype,) * len(k.out_dtypes)]
    return kernel.source


def _passes(source: str) -> list[str]:
    """The kernel's loops along the row, split where each pass starts (``int64_t c0_...`` declarations)."""
    body = source[re.search(r"for \(int64_t row|\(int64_t row\)", source).start():]
    return re.split(r"\n\s*(?:const )?int64_t c0_", body)[1:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_matches_eager_at_trips_and_tails(dtype):
    group = _softmax_group()
    for n in LENGTHS:
        for rows in ((3,), (64, 9)):  # 576 rows of 1031: split across the threads (each its own scratch row)
            args = [8 * torch.randn(*rows, n, dtype=dtype)]
            _check(fused_run(_spec(group), args), _softmax_eager, args)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
def test_values_kept_across_several_passes_match_eager(dtype):
    group = _chain_group()
    for n in LENGTHS:
        args = [torch.randn(5, n, dtype=dtype)]
        _check(fused_run(_spec(group), args), _chain_eager, args)


def test_strided_rows_fill_the_scratch_row_in_the_scalar_loop():
    """x transposed: its rows step by 40 (no vector loads); also a row of every second element."""
    for group, eager in ((_softmax_group(), _softmax_eager), (_chain_group(), _chain_eager)):
        for x in (torch.randn(77, 40).t(), torch.randn(6, 154)[:, ::2]):
            assert not x.is_contiguous()
            _check(fused_run(_spec(group), [x]), eager, [x])


def test_softmax_computes_exp_in_one_pass_and_the_others_read_it():
    spec = _spec(_softmax_group())
    fused_run(spec, [torch.randn(4, 100)])
    passes = _passes(_kernel_source(spec, torch.float32))
    assert len(passes) == 3  # max, sum of exp, output
    assert [("exp" in p) for p in passes] == [False, True, False]
    assert "fz_s_" in passes[1] and "fz_s_" in passes[2]


def test_the_chain_computes_each_costly_value_once():
    spec = _spec(_chain_group())
    fused_run(spec, [torch.randn(4, 100)])
    passes = _passes(_kernel_source(spec, torch.float32))
    assert len(passes) == 3
    assert [p.count("expf(") > 0 for p in passes] == [True, False, False]
    assert [p.count("tanhf(") > 0 for p in passes] == [False, True, False]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("saved", (False, True), ids=("recomputed", "saved"))
def test_softmax_backward_matches_eager_and_computes_exp_once(dtype, saved, _backwards):
    """softmax(x * 0.125) * 2: the backward group recomputes softmax from x, its kernel computes exp in one of its
    four passes. softmax(x * 0.125) itself: the backward reads the saved output (fuser/backward.py), two passes (the
    sum of grad * out, the gradient) and no exp."""
    spec = _spec(_softmax_group() if saved else _softmax_times_group())
    eager_fn = _softmax_eager if saved else _softmax_times_eager
    for n in LENGTHS:
        _backwards.clear()
        x = (8 * torch.randn(3, 7, n, dtype=dtype)).requires_grad_()
        x64 = x.detach().double().requires_grad_()
        (out,) = fuser.run_fusion(spec.key, [x])
        assert out.grad_fn is not None and out.grad_fn.name() in FUSED_BACKWARD
        g64 = torch.randn(out.shape, dtype=torch.float64)
        (got,) = torch.autograd.grad(out, x, g64.to(dtype))
        (want,) = torch.autograd.grad(eager_fn(x64), x64, g64)
        (eager,) = torch.autograd.grad(eager_fn(x), x, g64.to(dtype))
        assert got.dtype == dtype and got.shape == x.shape
        scale = max(1.0, want.abs().max().item())
        tol = tolerances(dtype)
        if dtype == torch.bfloat16:  # within twice eager's own error of float64, plus a unit at the scale
            err, eager_err = (got.double() - want).abs().max().item(), (eager.double() - want).abs().max().item()
            assert err <= 2 * eager_err + 8e-3 * scale, (n, err, eager_err)
        else:
            torch.testing.assert_close(got.double(), want, rtol=tol["rtol"], atol=tol["atol"] * scale)
        keys = row_backward_keys(_backwards)
        assert keys, f"row {n}: the backward did not run as a fused row kernel"
    (bw,) = [STORE.get(k) for k in keys]
    passes = _passes(_kernel_source(bw, dtype))
    if saved:
        assert len(passes) == 2 and not any("exp" in p for p in passes)  # sum of grad * out, the gradient
        return
    assert len(passes) == 4  # max, sum of exp, sum of grad * out, the gradient
    assert [("exp" in p) for p in passes] == [False, True, False, False]


def _sum_layer_norm_group(n):
    """layer_norm(x + bias + residual) times w: the sum reads three inputs (kept), the norm's passes read it."""
    b = ir.Builder()
    x, bias, res, w = (b.input() for _ in range(4))
    h = b.call("aten::add", b.call("aten::add", x, bias, 1), res, 1)
    return b.build([b.call("aten::mul", b.add("aten::layer_norm", h, (n,), None, None, 1e-5, True), w)])


def _sum_layer_norm_eager(x, bias, res, w):
    return [torch.layer_norm(x + bias + res, (x.shape[-1],), None, None, 1e-5) * w]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_sum_of_inputs_kept_for_the_norms_passes_matches_eager(dtype):
    for n in LENGTHS:
        group = _sum_layer_norm_group(n)
        for rows in ((3,), (64, 9)):
            args = [torch.randn(*rows, n, dtype=dtype) + 1, torch.randn(n, dtype=dtype),
                    torch.randn(*rows, n, dtype=dtype), torch.randn(n, dtype=dtype)]
            _check(fused_run(_spec(group), args), _sum_layer_norm_eager, args)
        x = torch.randn(n, 5, dtype=dtype).t()  # strided rows: the scalar loop fills the scratch row
        args = [x, torch.randn(n, dtype=dtype), torch.randn(5, n, dtype=dtype), torch.randn(n, dtype=dtype)]
        _check(fused_run(_spec(group), args), _sum_layer_norm_eager, args)
    spec = _spec(group)
    passes = _passes(_kernel_source(spec, dtype))
    assert len(passes) == 3  # mean, variance, output
    # the first pass reads x, bias and residual; the others read the kept sum instead
    assert all(f"t{k}[" in passes[0] for k in range(3))
    assert not any(f"t{k}[" in p or f"t{k} +" in p for p in passes[1:] for k in range(3))
