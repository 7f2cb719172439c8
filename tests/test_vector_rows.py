"""CUDA row kernels that take whole vectors only (fuser.rows.plan.RowKey.steps, settings.cuda_vector_rows): where a
signature's strides allow vectors, the kernel's loads and stores make no choice at run time; a launch whose pointers
are not aligned for vectors runs the plan's kernel with the choice, built then. Through the host emulation against
eager in float64 (contiguous rows, a row-broadcast vector, a one-value-a-row input, rows that do not fill their
trips, a misaligned view), the plan's choice, the kernel text, ptxas's registers for sm_90; on a GPU, the same
through the executor and the native hot path."""
from __future__ import annotations

import sys

import pytest
import torch

import fuser
from helpers import check_against_float64, ptxas_registers
from fuser import executor, ir, rows
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate

TOL = {torch.float32: 2e-5, torch.bfloat16: 2.4e-2, torch.float64: 1e-12}


def _ln_residual(n: int) -> ir.Group:
    """layer_norm(x + bias + residual) * w + b: a row-broadcast bias, weight and bias (the bench's row)."""
    b = ir.Builder()
    x, bias, res, w, c = (b.input() for _ in range(5))
    h = b.call("aten::add", b.call("aten::add", x, bias, 1), res, 1)
    return b.build([b.add("aten::layer_norm", h, (n,), w, c, 1e-5, True)])


def _ln_residual_eager(x, bias, res, w, c):
    return [torch.layer_norm(x + bias + res, (x.shape[-1],), w, c, 1e-5)]


def _softmax_row_shift(n: int) -> ir.Group:
    """softmax(x * 0.5 - s): s holds one value a row ([rows, 1]: step 0 along the row)."""
    b = ir.Builder()
    x, s = b.input(), b.input()
    return b.build([b.add("aten::softmax.int", b.call("aten::sub", b.call("aten::mul", x, 0.5), s, 1), -1, None)])


def _softmax_row_shift_eager(x, s):
    return [torch.softmax(x * 0.5 - s, -1)]


def _ln_inputs(rows: int, n: int, dtype):
    return [torch.randn(rows, n, dtype=dtype) + 1, torch.randn(n, dtype=dtype), torch.randn(rows, n, dtype=dtype),
            torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)]


def _softmax_inputs(rows: int, n: int, dtype):
    return [4 * torch.randn(rows, n, dtype=dtype), torch.randn(rows, 1, dtype=dtype)]


CASES = {"ln_residual": (_ln_residual, _ln_residual_eager, _ln_inputs),
         "softmax_row_shift": (_softmax_row_shift, _softmax_row_shift_eager, _softmax_inputs)}


def _spec(group):
    return STORE.get(STORE.register(group))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view one element into a buffer: the same strides, a pointer not aligned for vectors."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def test_the_plan_takes_vectors_only_where_the_strides_allow_them(monkeypatch):
    spec = _spec(_ln_residual(1024))
    args = _ln_inputs(6, 1024, torch.float32)
    assert rows.plan(spec, args, "cuda").key.steps == (1, 1, 1, 1, 1)
    assert rows.plan(spec, args, "cpu").key.steps is None
    sm = _spec(_softmax_row_shift(1024))
    assert rows.plan(sm, _softmax_inputs(6, 1024, torch.float32), "cuda").key.steps == (1, 0)
    # a transposed residual, rows whose starts are not whole vectors apart, a row length that is not whole vectors
    t = [args[0], args[1], torch.randn(1024, 6).t(), *args[3:]]
    assert rows.plan(spec, t, "cuda").key.steps is None
    wide = torch.randn(6, 1025)
    assert rows.plan(spec, [wide[:, 1:], *args[1:]], "cuda").key.steps is None
    odd = _spec(_ln_residual(1023))
    assert rows.plan(odd, [a[..., :1023] for a in _ln_inputs(6, 1024, torch.float32)], "cuda").key.steps is None
    monkeypatch.setattr(fuser.settings, "cuda_vector_rows", False)
    assert rows.plan(spec, args, "cuda").key.steps is None


def test_a_vectors_only_kernel_makes_no_choice_at_run_time():
    """Its loads are fz_row_vec and its stores whole vectors: args.vec is never read; the kernel with the choice
    (the plan without steps) reads it in every load and store."""
    spec = _spec(_ln_residual(4096))
    p = rows.plan(spec, _ln_inputs(4, 4096, torch.bfloat16), "cuda")
    _, source = rows.launch.source_for(spec, p)
    body = source[source.index('extern "C"'):]
    assert "fz_row_vec<" in body and "fz_row_trip<" not in body and "args.vec" not in body
    any_plan = rows.launch.AnyLaunch(spec, rows.launch.any_plan(p), rows.launch.build).plan
    assert any_plan.key.steps is None and any_plan.key.shape == p.key.shape
    assert any_plan.tensors == []  # (the kernel keeps it: not the planning call's inputs)
    _, source = rows.launch.source_for(spec, any_plan)
    body = source[source.index('extern "C"'):]
    assert "fz_row_vec<" not in body and body.count("args.vec") >= 6


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_vectors_only_kernel_holds_the_row_in_fewer_registers(dtype):
    """ptxas for sm_90, layer_norm(x + bias + residual) * w + b over rows of 4096 (bfloat16: 128 threads a row, 32
    elements a thread held; float32: 256 threads of 16, ``rows.shape.HELD_BYTES``): with 32 elements the kernel with
    the run-time choice took 118-128 registers a thread, so an SM held 4 of its blocks; the vectors-only one at most
    80, no spills (measured: 68 and 72)."""
    spec = _spec(_ln_residual(4096))
    p = rows.plan(spec, _ln_inputs(4, 4096, dtype), "cuda")
    assert p.key.shape.held and p.key.shape.block == (256 if dtype == torch.float32 else 128)
    regs, spill = ptxas_registers(rows.launch.source_for(spec, p)[1])
    any_regs, _ = ptxas_registers(rows.launch.source_for(spec, rows.launch.AnyLaunch(spec, rows.launch.any_plan(p), rows.launch.build).plan)[1])
    assert regs <= 80 and spill == 0 and any_regs > regs, (regs, spill, any_regs)


@pytest.mark.parametrize("n", (1024, 1000, 4096, 20000))
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_vectors_only_rows_against_float64(case, n):
    """Aligned inputs run the vectors-only kernel; a misaligned x the kernel with the choice (AnyLaunch), with the
    same results. 1000: rows that do not fill their trip; 20000: a row read again by each pass (float32) or held by
    a cluster; bfloat16 at 1024."""
    group, eager, inputs = CASES[case]
    spec = _spec(group(n))
    for dtype in ((torch.float32, torch.bfloat16) if n == 1024 else (torch.float32,)):
        args = inputs(3, n, dtype)
        assert rows.plan(spec, args, "cuda").key.steps is not None
        check_against_float64(row_emulate.run(group(n), args), eager, args, TOL)
        args = [_misaligned(args[0]), *args[1:]]
        assert rows.plan(spec, args, "cuda").key.steps is not None  # (the signature's strides: vectors allowed)
        check_against_float64(row_emulate.run(group(n), args), eager, args, TOL)


def test_the_emulation_runs_the_kernel_with_the_choice_for_a_misaligned_launch(monkeypatch):
    made = []
    launch = sys.modules["fuser.rows.launch"]
    real = launch.any_plan

    def spy(p):
        made.append(p.key)
        return real(p)

    monkeypatch.setattr(launch, "any_plan", spy)
    args = _ln_inputs(3, 1024, torch.float32)
    row_emulate.run(_ln_residual(1024), args)
    assert made == []
    row_emulate.run(_ln_residual(1024), [args[0], args[1], _misaligned(args[2]), *args[3:]])
    assert len(made) == 1 and made[0].steps is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cuda_vectors_only_rows_and_misaligned_launches(dtype):
    """Through the executor on a GPU: aligned calls launch the vectors-only kernel, a misaligned one the kernel
    with the choice (built once, then kept), both within tolerance of eager in float64."""
    for case, n, n_rows in (("ln_residual", 4096, 300), ("softmax_row_shift", 1000, 300), ("ln_residual", 65536, 9)):
        group, eager, inputs = CASES[case]
        spec = _spec(group(n))
        for _ in range(2):
            args = [a.cuda() for a in inputs(n_rows, n, dtype)]
            p = executor.plan(spec, args)
            assert p.key.steps is not None
            check_against_float64(executor.run(spec, args), eager, args, TOL)
            bad = [_misaligned(args[0]), *args[1:]]
            check_against_float64(executor.run(spec, bad), eager, bad, TOL)
        built = [k for k in spec.kernels() if getattr(k, "steps", 0) is None and k.inputs[0][0] == dtype]
        assert len(built) == 1, spec.kernels()


def _block(x, bias, res, w, b):
    return torch.layer_norm(x + bias + res, [256], w, b, 1e-5)


@pytest.mark.gpu
def test_cuda_native_hot_path_hands_a_misaligned_call_to_python():
    """The native hot path launches the vectors-only kernel for aligned calls and hands a call with a misaligned
    pointer to Python (which launches the kernel with the choice): every result eager's within tolerance."""
    from fuser import native
    f = fuser.fuse(torch.jit.script(_block))
    with torch.no_grad():
        for step in range(8):
            args = [a.cuda() for a in _ln_inputs(64, 256, torch.float32)]
            if step >= 4:
                args[2] = _misaligned(args[2])
            before = native.stats()
            check_against_float64([f(*args)], lambda *a: [_block(*a)], args, TOL)
            after = native.stats()
            if step == 3:  # (the first calls may profile and prepare)
                assert after["hits"] == before["hits"] + 1
            if step >= 5:
                assert after["hits"] == before["hits"] and after["handed"] > before["handed"]


def _ln_affine(x, w, b):
    return torch.layer_norm(x, [256], None, None, 1e-5) * w + b


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cuda_misaligned_training_steps_of_a_norm(dtype):
    """layer_norm(x) * w + b training steps on a GPU whose x is, from the fourth step on, a misaligned view: the
    forward and the backward row kernel (with the weight's and bias's sums) run the kernels with the run-time
    choice there; every gradient within tolerance of eager's in float64."""
    f = fuser.fuse(torch.jit.script(_ln_affine))
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for step in range(7):
        x = torch.randn(64, 256, dtype=dtype, device="cuda")
        if step >= 3:
            x = _misaligned(x)
        x.requires_grad_()
        w = torch.randn(256, dtype=dtype, device="cuda", requires_grad=True)
        b = torch.randn(256, dtype=dtype, device="cuda", requires_grad=True)
        gy = torch.randn(64, 256, dtype=dtype, device="cuda")
        got = torch.autograd.grad(f(x, w, b), (x, w, b), gy)
        leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
        want = torch.autograd.grad(_ln_affine(*leaves), leaves, gy.double())
        for g, r in zip(got, want):
            assert g.dtype == dtype
            torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol * max(1.0, r.abs().max().item()))


@pytest.mark.parametrize("n", (4096, 1000))
def test_a_forward_writing_float32_statistics_keeps_the_rows_vectors(n):
    """The training forward of a bfloat16 layer_norm writes the row's mean and rstd in float32 beside its bfloat16
    rows (``autodiff.extended_spec``); those are stored once a row, so the kernel takes the shape of the forward
    without them (16-byte vectors of 8 elements, where the float32 statistics had halved them: 98 against 71 us on
    an H200 at [16384 x 4096]); its outputs against eager's native_layer_norm in float64."""
    from fuser import autodiff, backward, ops
    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    ln = b.add("aten::layer_norm", x, (n,), None, None, 1e-5, True)
    group = b.build([b.call("aten::add", b.call("aten::mul", ln, w), c, 1)])
    spec = _spec(group)
    reduced = frozenset(m.out.id for m in spec.group.nodes if ops.reduction(m.op) is not None)
    forward = autodiff.extended_spec(spec, backward.statistics(spec), reduced)
    gen = torch.Generator().manual_seed(11)
    args = [torch.randn(5, n, generator=gen).to(torch.bfloat16) for _ in range(1)] + [
        torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(2)]
    inference, training = rows.plan(spec, args, "cuda"), rows.plan(forward, args, "cuda")
    assert training.out_dtypes[1:] == [torch.float32, torch.float32]
    assert training.key.shape == inference.key.shape and training.key.shape.vec == 8
    y, mean, rstd = row_emulate.run(forward.group, args)
    x64 = args[0].double()
    want_mean, want_var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(mean.double().view(5, 1), want_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double().view(5, 1), (want_var + 1e-5).rsqrt(), rtol=1e-5, atol=1e-6)
    check_against_float64([y], lambda x, w, c: [torch.layer_norm(x, (n,), None, None, 1e-5) * w + c], args, TOL)
