"""A normalization's statistics saved by its forward for its backward (issue 12: "save mean and rstd where eager
does"; fuser/backward.py's ``statistics``): the forward group writes layer_norm's mean and rstd, rms_norm's rstd, as
extra outputs (float32 for float16/bfloat16), and the backward reads them as row-level inputs of its row kernel
(``fuser.rows.passes.with_row_inputs``: loaded once a row) instead of forming them again from the row. Gradients
against eager's in float64 on fresh random inputs, on the CPU backend and as the CUDA row kernels under the host
emulation; the row-level inputs of any row group against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FUSED_BACKWARD, tolerances

import fuser
from fuser import autodiff, backward, ir, rows, settings
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")

LENGTHS = (1, 31, 1024)


def _layer_norm_group(n: int, affine: bool) -> ir.Group:
    """x + residual -> layer_norm (weight and bias where ``affine``) -> gelu."""
    b = ir.Builder()
    x, res, w, c = (b.input() for _ in range(4))
    y = b.add("aten::layer_norm", b.call("aten::add", x, res, 1), (n,), w if affine else None,
              c if affine else None, 1e-5, True)
    return b.build([b.call("aten::gelu", y, "none")]).with_inputs((0, 1, 2, 3) if affine else (0, 1))


def _layer_norm_eager(affine: bool):
    def eager(x, res, w=None, c=None):
        return [F.gelu(F.layer_norm(x + res, (x.shape[-1],), w, c, 1e-5))]
    return eager


def _rms_norm_group(n: int) -> ir.Group:
    b = ir.Builder()
    x, w = b.input(), b.input()
    return b.build([b.call("aten::mul", b.add("aten::rms_norm", x, (n,), w, 1e-6), 0.5)])


def _rms_norm_eager(x, w):
    return [torch.rms_norm(x, (x.shape[-1],), w, 1e-6) * 0.5]


CASES = {
    "layer_norm_affine": (lambda n: _layer_norm_group(n, True), _layer_norm_eager(True), 4),
    "layer_norm": (lambda n: _layer_norm_group(n, False), _layer_norm_eager(False), 2),
    "rms_norm": (_rms_norm_group, _rms_norm_eager, 2),
}


def _inputs(name: str, dtype, n: int) -> list:
    k = CASES[name][2]
    x = torch.randn(3, 5, n, dtype=dtype) * 2 + 1
    rest = [torch.randn(3, 5, n, dtype=dtype)] if name.startswith("layer_norm") else []
    rest += [torch.randn(n, dtype=dtype) for _ in range(k - 1 - len(rest))]
    return [x, *rest]


def _spec(name: str, n: int):
    return STORE.get(STORE.register(CASES[name][0](n)))


def _leaves(args):
    return [a.detach().requires_grad_() for a in args]


def _check(got, args, name, dtype, grads):
    """``got`` against eager's gradients in float64 (float32: within its tolerance; bfloat16: within twice eager's
    own bfloat16 error, plus a unit at the gradient's scale)."""
    eager = CASES[name][1]
    a64 = [a.detach().double().requires_grad_() for a in args]
    want64 = torch.autograd.grad(eager(*a64), a64, [g.double() for g in grads])
    ab = _leaves(args)
    want = torch.autograd.grad(eager(*ab), ab, grads)
    for g, w, w64 in zip(got, want, want64):
        assert g.dtype == dtype and g.shape == w64.shape
        scale = max(1.0, w64.abs().max().item())
        if dtype == torch.float32:
            tol = tolerances(dtype)
            torch.testing.assert_close(g.double(), w64, rtol=tol["rtol"], atol=tol["atol"] * scale)
        else:
            err, eager_err = (g.double() - w64).abs().max().item(), (w.double() - w64).abs().max().item()
            assert err <= 2 * eager_err + 8e-3 * scale, (err, eager_err)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", CASES)
def test_the_backward_reads_the_forwards_statistics(name, dtype, _backwards):
    for n in LENGTHS:
        spec = _spec(name, n)
        args = _leaves(_inputs(name, dtype, n))
        call = autodiff.prepare_call(spec, list(args))
        assert call is not None and call.save == backward.statistics(spec) and len(call.save) == (
            1 if name == "rms_norm" else 2)
        stats = call.outputs[len(spec.group.outputs):]
        assert [s.dtype for s in stats] == [torch.float32 if dtype == torch.bfloat16 else dtype] * len(stats)
        assert all(s.shape == (3, 5, 1) for s in stats)
        _backwards.clear()
        outs = fuser.run_fusion(spec.key, args)
        assert outs[0].grad_fn.name() in FUSED_BACKWARD
        grads = [torch.randn_like(outs[0])]
        got = torch.autograd.grad(outs, args, grads)
        _check(got, args, name, dtype, grads)
        bws = [s for s in _backwards if s.has_reduction]
        assert bws, f"row {n}: the backward did not run as a row kernel"
        # it reads the statistics: no reduction of the input's row is formed again (the formula's reductions only:
        # layer_norm's mean(gw) and mean(gw * xhat), rms_norm's mean(gw * x))
        want = 1 if name == "rms_norm" else 2
        assert any(sum(1 for m in rows.decompose.expand(s.group).nodes if m.op == "aten::mean.dim") <= want
                   for s in bws)


def test_the_statistics_are_not_saved_when_turned_off(monkeypatch):
    monkeypatch.setattr(settings, "save_statistics", False)
    spec = _spec("layer_norm_affine", 31)
    args = _leaves(_inputs("layer_norm_affine", torch.float32, 31))
    call = autodiff.prepare_call(spec, list(args))
    assert call.save == () and call.forward is spec and len(call.outputs) == 1
    outs = fuser.run_fusion(spec.key, args)
    grads = [torch.randn_like(outs[0])]
    _check(torch.autograd.grad(outs, args, grads), args, "layer_norm_affine", torch.float32, grads)


def test_double_backward_recomputes_the_statistics():
    """create_graph: the saved statistics have no history; the backward forms them again, differentiably."""
    spec = _spec("layer_norm_affine", 7)
    args = [a.double() for a in _inputs("layer_norm_affine", torch.float64, 7)]

    def fn(*ts):
        return fuser.run_fusion(spec.key, list(ts))[0]
    assert torch.autograd.gradgradcheck(fn, tuple(_leaves(args)))


# ------------------------------------------------------------------------- row-level inputs of a row kernel

def _row_input_group() -> ir.Group:
    """(x - mean(x)) * r + s * 2 over the last dim, r and s one value a row ([rows, 1])."""
    b = ir.Builder()
    x, r, s = b.input(), b.input(), b.input()
    d = b.call("aten::sub", x, b.add("aten::mean.dim", x, (-1,), True, None), 1)
    return b.build([b.call("aten::add", b.call("aten::mul", d, r), b.call("aten::mul", s, 2.0), 1)])


def _row_input_eager(x, r, s):
    return (x - x.mean(-1, keepdim=True)) * r + s * 2


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_row_level_inputs_load_once_a_row(dtype):
    spec = STORE.get(STORE.register(_row_input_group()))
    for n in (1, 5, 100):
        x, r, s = torch.randn(4, 6, n, dtype=dtype), torch.randn(4, 6, 1, dtype=dtype), torch.randn(4, 6, 1, dtype=dtype)
        p = rows.plan(spec, [x, r, s])
        assert not isinstance(p, str), p
        assert p.key.row_inputs == (() if n == 1 else (1, 2))
        got = fuser.run_fusion(spec.key, [x, r, s])[0]
        want = _row_input_eager(x.double(), r.double(), s.double())
        tol = tolerances(dtype)
        torch.testing.assert_close(got.double(), want, rtol=tol["rtol"], atol=tol["atol"] * 4)
    # an input of the row's shape but broadcast along the leading dims stays element-level
    x, r, s = torch.randn(4, 6, 9, dtype=dtype), torch.randn(1, 6, 1, dtype=dtype), torch.randn(4, 6, 1, dtype=dtype)
    assert rows.plan(spec, [x, r, s]).key.row_inputs == (2,)


# ------------------------------------------------------------------------------------ CUDA, host-emulated

EMULATED = [(name, dt) for name in ("layer_norm_affine", "rms_norm") for dt in (torch.float32, torch.bfloat16)]


def _saved_backward(name, dtype, n):
    """The backward that reads the statistics, its arguments (the statistics from the CPU forward kernel) and the
    output gradients."""
    spec = _spec(name, n)
    args = _leaves(_inputs(name, dtype, n))
    call = autodiff.prepare_call(spec, list(args))
    save = backward.statistics(spec)
    assert call.save == save
    sig = tuple((a.dtype, False) for a in args)
    bw = autodiff.backward_for(spec, call.needs, spec.all_outputs_defined, sig, False, (), save)
    assert bw is not None and bw.spec.has_reduction and bw.saved_outputs
    grads = [torch.randn_like(call.outputs[0])]
    outputs = {k: o.detach() for k, o in enumerate(call.outputs)}
    detached = [a.detach() for a in args]
    return bw, autodiff.backward_args(spec, bw, detached, grads, [a.shape for a in args], outputs), args, grads


@pytest.fixture(scope="module")
def emulated():
    em = emulate.default()
    with torch.random.fork_rng():
        for name, dtype in EMULATED:
            for n in LENGTHS[1:]:
                bw, bargs, _, _ = _saved_backward(name, dtype, n)
                assert row_emulate.kernel_for(bw.spec.group, bargs, em) is not None
        spec = STORE.get(STORE.register(_row_input_group()))
        assert row_emulate.kernel_for(spec.group, [torch.randn(4, 6, 33), torch.randn(4, 6, 1),
                                                   torch.randn(4, 6, 1)], em) is not None
    em.compile_pending()
    return em


@pytest.mark.parametrize("name,dtype", EMULATED, ids=[f"{n}-{str(dt)[6:]}" for n, dt in EMULATED])
def test_cuda_backward_reading_the_statistics_emulated(name, dtype, emulated):
    for n in LENGTHS[1:]:
        bw, bargs, args, grads = _saved_backward(name, dtype, n)
        p = row_emulate._plan(bw.spec, bargs)
        assert not isinstance(p, str) and p.key.row_inputs, "the statistics are not row-level inputs"
        outs = row_emulate.run(bw.spec.group, bargs, emulated)
        assert outs is not None
        got = [None] * len(args)
        for j, r in [*zip(bw.grad_inputs, outs), *((j, outs[k]) for j, k in bw.aliases)]:
            got[j] = r.sum_to_size(args[j].shape).to(dtype)
        _check(got, args, name, dtype, grads)


def test_cuda_row_level_inputs_emulated(emulated):
    spec = STORE.get(STORE.register(_row_input_group()))
    x, r, s = torch.randn(4, 6, 33), torch.randn(4, 6, 1), torch.randn(4, 6, 1)
    got = row_emulate.run(spec.group, [x, r, s], emulated)[0]
    torch.testing.assert_close(got, _row_input_eager(x, r, s), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", ("layer_norm_affine", "rms_norm"))
def test_the_backward_reads_the_forwards_statistics_on_the_gpu(name, dtype):
    # (rms_norm on CUDA runs as a row kernel where eager's kernel vectorizes: rows of a multiple of 4, fuser.rows.plan)
    for n in (31 if name.startswith("layer_norm") else 32, 1024, 16384):
        spec = _spec(name, n)
        args = [a.cuda() for a in _inputs(name, dtype, n)]
        leaves = _leaves(args)
        call = autodiff.prepare_call(spec, list(leaves))
        assert call is not None and call.save == backward.statistics(spec)
        outs = fuser.run_fusion(spec.key, leaves)
        assert outs[0].grad_fn.name() in FUSED_BACKWARD
        grads = [torch.randn_like(outs[0])]
        got = torch.autograd.grad(outs, leaves, grads)
        _check([g.cpu() for g in got], [a.cpu() for a in args], name, dtype, [g.cpu() for g in grads])
