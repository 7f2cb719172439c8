"""Broadcast inputs' gradients summed by generated column groups (issue 12, fuser/grad_sums.py): a bias or a norm's
weight broadcast over the leading dims gets its gradient from a column kernel that computes the per-element gradient
in its prologue and sums it, not from eager's sum_to_size of a full-size tensor the backward wrote. Groups built from
the IR alone (gelu(x + b), x * w + b, layer_norm with weight and bias, rms_norm with weight, softmax with a mask),
against eager's float64 gradients on seeded random inputs, float32 and float64, rows of 1, 31, 32 and 1024 elements;
each asserted to take the new path (the column kernel ran, sum_to_size was not called), on the CPU backend, through
the TorchScript pass and the native hot path, and the CUDA kernels under the host emulation; the forms that keep the
old path (dims that are not leading, bfloat16 statistics, double backward, a column kernel that does not run)
asserted to keep it, with eager's gradients. Column groups under autograd ((x * y).sum(0), mean over two leading
dims, amax, keepdim both ways, an epilogue + c, an element-level output beside): wrapped with their generated
backward, eager's gradients in float32/float64 (float64 reference), float16/bfloat16 (within eager's own error),
mixed dtypes, gradcheck and gradgradcheck. The GPU twins are marked gpu."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import FUSED_BACKWARD, SumsWatch, scripted_training_steps, tolerances, trip_sums_fit

import fuser
from fuser import autodiff, executor, grad_sums, ir, settings
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate

LENGTHS = (1, 31, 32, 1024)


@pytest.fixture(autouse=True)
def _needs_cpu_fusion():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


@dataclass(frozen=True)
class Case:
    """A group per row length (a normalization's normalized_shape is a constant); its inputs (x first, [lead..., n];
    the others [n], broadcast over the leading dims); eager's outputs."""

    id: str
    group: Callable[[int], ir.Group]
    n_inputs: int
    eager: Callable[..., list]
    scale: float = 1.0  # x's scale (the mask case's softmax wants a spread)
    row_backward: bool = False  # its backward is a row kernel: on the CPU the sums are added up inside it


def _gelu_bias(n):
    b = ir.Builder()
    x, c = b.input(), b.input()
    return b.build([b.call("aten::gelu", b.call("aten::add", x, c, 1), "none")])


def _mul_add(n):
    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    return b.build([b.call("aten::add", b.call("aten::mul", x, w), c, 1)])


def _layer_norm(n):
    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    return b.build([b.add("aten::layer_norm", x, (n,), w, c, 1e-5, True)])


def _rms_norm(n):
    b = ir.Builder()
    x, w = b.input(), b.input()
    return b.build([b.call("aten::mul", b.add("aten::rms_norm", x, (n,), w, 1e-6), 0.5)])


def _softmax_mask(n):
    b = ir.Builder()
    x, mask = b.input(), b.input()
    return b.build([b.add("aten::softmax.int", b.call("aten::add", b.call("aten::mul", x, 0.125), mask, 1), -1, None)])


CASES = [
    Case("gelu_bias", _gelu_bias, 2, lambda x, c: [F.gelu(x + c)]),
    Case("mul_add", _mul_add, 3, lambda x, w, c: [x * w + c]),
    Case("layer_norm", _layer_norm, 3, lambda x, w, c: [F.layer_norm(x, (x.shape[-1],), w, c, 1e-5)], 1.0, True),
    Case("rms_norm", _rms_norm, 2, lambda x, w: [torch.rms_norm(x, (x.shape[-1],), w, 1e-6) * 0.5], 1.0, True),
    Case("softmax_mask", _softmax_mask, 2, lambda x, m: [torch.softmax(x * 0.125 + m, -1)], 8.0, True),
]
MAIN = [c for c in CASES if c.id != "softmax_mask"]
_SPECS: dict = {}


def _spec(case: Case, n: int):
    if (case.id, n) not in _SPECS:
        _SPECS[case.id, n] = STORE.get(STORE.register(case.group(n)))
    return _SPECS[case.id, n]


def _inputs(case: Case, dtype, n, lead=(3, 5), device="cpu"):
    x = case.scale * torch.randn(*lead, n, dtype=dtype, device=device) + 0.5
    return [x] + [torch.randn(n, dtype=dtype, device=device) for _ in range(case.n_inputs - 1)]


@pytest.fixture
def watch(monkeypatch):
    return SumsWatch(monkeypatch)


def _leaves(args, which=None):
    return [a.requires_grad_() if which is None or k in which else a for k, a in enumerate(args)]


def _assert_grads(got, want, dtype):
    tol = tolerances(dtype)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape, (g.dtype, dtype, g.shape, w.shape)
        scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
        torch.testing.assert_close(g.double(), w.double(), rtol=tol["rtol"], atol=tol["atol"] * scale)


def _fused_and_eager64(case, spec, args, watch=None):
    """The fused group's gradients for the inputs that require grad and eager's in float64 for the same values
    and output gradients; ``watch`` cleared just before the fused backward (it sees only that)."""
    wants = [k for k, a in enumerate(args) if a.requires_grad]
    args64 = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    outs = fuser.run_fusion(spec.key, args)
    assert all(o.grad_fn is not None and o.grad_fn.name() in FUSED_BACKWARD for o in outs)
    ref = case.eager(*args64)
    grads = [torch.randn_like(r) for r in ref]
    if watch is not None:
        watch.clear()
    got = torch.autograd.grad(outs, [args[k] for k in wants], [g.to(o.dtype) for g, o in zip(grads, outs)])
    return got, torch.autograd.grad(ref, [args64[k] for k in wants], grads)


# ------------------------------------------------------------------------------------------- the CPU backend

@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_broadcast_gradients_are_summed_by_a_column_kernel(case, dtype, watch):
    """Every input's gradient within the dtype's tolerance of eager's float64 ones; the weight's and bias's from a
    column kernel (one for both), or for a row backward from its row kernel; sum_to_size never called."""
    for n in LENGTHS:
        for lead in ((3, 5), (40,)):
            got, want = _fused_and_eager64(case, _spec(case, n), _leaves(_inputs(case, dtype, n, lead)), watch)
            _assert_grads(got, want, dtype)
            assert watch.summed(case.row_backward), (n, lead, watch.columns, watch.fused, watch.sum_to_size)


def test_the_backward_is_split_once_per_pattern_and_the_statistics_are_read_not_recomputed():
    """layer_norm: the main group (a row kernel) writes x's gradient, mean and rstd; one column group reads x, the
    output gradient, mean and rstd and sums the weight's and the bias's gradients (no reduction along the row)."""
    case = CASES[2]
    spec = _spec(case, 40)
    args = _leaves(_inputs(case, torch.float64, 40))
    sig = tuple((a.dtype, False) for a in args)
    bw = autodiff.backward_for(spec, (True,) * 3, (True,), sig)
    shapes = [a.shape for a in args]
    bargs = autodiff.backward_args(spec, bw, [a.detach() for a in args], [torch.randn_like(args[0])], shapes)
    dims = grad_sums.plan(spec, bw, shapes, args[0].shape, sig, bargs)
    assert dims == ((True, None, False), (False, (0, 1), False), (False, (0, 1), False))
    split = grad_sums.split_for(bw, dims)
    assert split is grad_sums.split_for(bw, dims)
    assert split.kept == (0,) and split.n_rows == 2 and len(split.columns) == 1
    col = split.columns[0]
    assert [n.op for n in col.spec.group.nodes].count("aten::sum.dim_IntList") == 2
    assert not any(n.op == "aten::mean.dim" for n in col.spec.group.nodes)
    assert sorted(kind for kind, _ in col.inputs) == [0, 0, 1, 1]
    main_ops = [n.op for n in split.main.group.nodes]
    assert main_ops.count("aten::mean.dim") == 4  # the forward's two and the gradient's two, as before


@pytest.mark.parametrize("which,case", [((1,), "gelu_bias"), ((0, 2), "mul_add"), ((1,), "layer_norm"),
                                        ((2,), "layer_norm"), ((1,), "rms_norm"), ((0,), "gelu_bias")])
def test_some_inputs_want_gradients(which, case, watch):
    """Only the bias (gelu(x + b): no main group, the column group recomputes gelu's derivative), only a
    normalization's weight or bias (the forward saved its statistics: the gradient needs no reduction along the
    row, one column group sums it), or only x (no column group)."""
    case = next(c for c in CASES if c.id == case)
    n = 33
    got, want = _fused_and_eager64(case, _spec(case, n), _leaves(_inputs(case, torch.float64, n), which), watch)
    _assert_grads(got, want, torch.float64)
    if which == (0,):
        assert not watch.columns and not watch.fused and watch.sum_to_size == 0
    else:  # (no row backward: the bias's gradient is dy summed; the weight's, dy * xhat from the saved statistics)
        assert watch.summed(False)


def test_other_broadcasts_keep_sum_to_size(watch):
    """A bias of [3, 1, n] against [3, 5, n] (broadcast over a middle dim: not a column kernel's form) keeps the old
    path; one of [1, 5, n] or [5, n] (its leading dim only) is a column sum over dim 0; the weight ([n]) is summed
    over (0, 1) by a column group of its own; eager's gradients for all."""
    case = CASES[1]
    spec = _spec(case, 16)
    sig = ((torch.float64, False),) * 3
    bw = autodiff.backward_for(spec, (True,) * 3, (True,), sig)
    for shape, want_dims in (((3, 1, 16), (True, None, False)), ((1, 5, 16), (False, (0,), False)),
                             ((5, 16), (False, (0,), False))):
        x, w, c = (torch.randn(s, dtype=torch.float64) for s in ((3, 5, 16), (16,), shape))
        args = _leaves([x, w, c])
        shapes = [a.shape for a in args]
        bargs = autodiff.backward_args(spec, bw, [a.detach() for a in args], [torch.randn_like(x)], shapes)
        dims = grad_sums.plan(spec, bw, shapes, x.shape, sig, bargs)
        assert dims[bw.grad_inputs.index(2)] == want_dims and dims[bw.grad_inputs.index(1)] == (False, (0, 1), False)
        got, want = _fused_and_eager64(case, spec, args, watch)
        _assert_grads(got, want, torch.float64)
        # one column group per summed dims: w's, and c's where it is summed over dim 0
        assert watch.took()[1] == (1 if want_dims[1] is None else 2)
        assert watch.sum_to_size == (1 if want_dims[1] is None else 0)


def test_a_column_kernel_that_does_not_run_gives_eagers_result_then_the_old_path(monkeypatch):
    """The column group's kernel declines (its executor run says None): that call and the later ones of that
    signature take the backward group and sum_to_size (the same values every time: gradcheck asks that)."""
    real = executor.run
    declined = []

    def run(spec, args, rng_state=None):
        if spec.key in grad_sums.column_keys:
            declined.append(spec)
            return None
        return real(spec, args, rng_state)

    monkeypatch.setattr(executor, "run", run)
    case = CASES[1]
    spec = _spec(case, 24)
    w = SumsWatch(monkeypatch)
    for k in range(2):
        got, want = _fused_and_eager64(case, spec, _leaves(_inputs(case, torch.float32, 24, (7, 3))), w)
        _assert_grads(got, want, torch.float32)
        assert len(declined) == 1 and w.sum_to_size == 2


def test_bfloat16_statistics_keep_the_old_path_and_pointwise_sums_are_as_close_as_eagers(watch, monkeypatch):
    """bfloat16 layer_norm: summed inside its row kernel; where that kernel does not run (declined here, as where
    its form is not generated) the split, which reads the statistics the forward saved in float32; with the saving
    off the split would pass the statistics it forms through memory rounded, so the old path. bfloat16
    gelu(x + b): the column kernel. Each gradient within eager's own error of float64 (plus a unit)."""
    real = executor.run
    decline = []

    def run(spec, args, rng_state=None):
        if decline and spec.key in grad_sums.fused_keys:
            return None
        return real(spec, args, rng_state)

    monkeypatch.setattr(executor, "run", run)
    seen = SumsWatch(monkeypatch)
    for case, path, lead in ((CASES[2], "fused", (40,)), (CASES[2], "split", (24,)), (CASES[2], "old", (23,)),
                             (CASES[0], "column", (40,))):
        decline[:] = [True] if path in ("split", "old") else []  # (a declined signature stays declined: own shape)
        monkeypatch.setattr(settings, "save_statistics", path != "old")
        n = 64
        args = _leaves(_inputs(case, torch.bfloat16, n, lead))
        args64 = _leaves([a.detach().double() for a in args])
        ref = case.eager(*args64)
        gy = [torch.randn_like(r).to(torch.bfloat16) for r in ref]
        outs = fuser.run_fusion(_spec(case, n).key, args)
        seen.clear()
        got = torch.autograd.grad(outs, args, gy)
        if path == "old":
            assert not seen.columns and not seen.fused and seen.sum_to_size == 2
        else:
            assert seen.summed(path == "fused"), (path, seen.columns, seen.fused, seen.sum_to_size)
        want = torch.autograd.grad(case.eager(*args), args, gy)
        want64 = torch.autograd.grad(ref, args64, [g.double() for g in gy])
        for g, w, w64 in zip(got, want, want64):
            assert g.dtype == torch.bfloat16 and g.shape == w.shape
            scale = max(1.0, w64.abs().max().item())
            err, eager_err = (g.double() - w64).abs().max().item(), (w.double() - w64).abs().max().item()
            assert err <= 2 * eager_err + 8e-3 * scale, (case.id, err, eager_err)


@pytest.mark.parametrize("case", MAIN, ids=lambda c: c.id)
def test_gradcheck_and_double_backward(case):
    """gradcheck takes the column path (grad mode off in the backward); gradgradcheck's create_graph the old one."""
    n = 5
    spec = _spec(case, n)

    def fn(*ts):
        return tuple(fuser.run_fusion(spec.key, list(ts)))

    ts = tuple(_leaves(_inputs(case, torch.float64, n, (2, 3))))
    assert torch.autograd.gradcheck(fn, ts)
    assert torch.autograd.gradgradcheck(fn, ts)


def _bias_gelu_mlp(x, w, c):
    return F.gelu(x @ w + c) * 2.0


def test_the_pass_and_the_native_hot_path_sum_with_the_column_kernel(watch):
    """gelu(x @ w + c) * 2 through the TorchScript pass: the repeated calls the native hot path serves run the
    backward's main group and the column kernel that sums c's gradient in its own backward; eager's gradients every
    call."""
    for step, y, args, gy, got in scripted_training_steps(
            _bias_gelu_mlp, lambda: _leaves([torch.randn(33, 16), torch.randn(16, 24) / 4, torch.randn(24)]), watch):
        if step >= 2:  # (the profiling executor's first calls run unfused)
            assert y.grad_fn.name() in FUSED_BACKWARD
            assert watch.took()[1] == 1 and watch.sum_to_size == 0, step
        want = torch.autograd.grad(_bias_gelu_mlp(*args), args, gy)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ CUDA, host-emulated

def _emulated(spec, args):
    """The main group's and the column groups' CUDA kernels (emulated): row or column kernels through
    fuser.rows.emulate, a pointwise main group through fuser.cuda.emulate."""
    if spec.has_reduction:
        out = row_emulate.run(spec.group, args)
    else:
        out = emulate.run_graph(spec.group, args)
    assert out is not None, spec.group.text()
    return out


def _check_emulated_sums(case, n: int, lead: tuple, launch, dtype=torch.float32) -> None:
    """grad_sums.run on ``dtype`` inputs of ``case`` ([*lead, n]) with ``launch`` running its groups: eager's float64
    gradients."""
    args = _leaves(_inputs(case, dtype, n, lead))
    args64 = _leaves([a.detach().double() for a in args])
    ref = case.eager(*args64)
    grads = [torch.randn_like(r) for r in ref]
    want = torch.autograd.grad(ref, args64, grads)
    spec = _spec(case, n)
    sig = tuple((a.dtype, False) for a in args)
    bw = autodiff.backward_for(spec, (True,) * len(args), (True,), sig)
    shapes = [a.shape for a in args]
    outputs = {k: r.detach().to(dtype) for k, r in enumerate(ref)}  # (a softmax's backward reads its output)
    bargs = autodiff.backward_args(spec, bw, [a.detach() for a in args], [g.to(dtype) for g in grads], shapes, outputs)
    got = grad_sums.run(spec, bw, bargs, shapes, args[0].shape, sig, launch=launch)
    assert got is not None
    got = dict(got)
    for j, w in enumerate(want):
        g = got[j]
        g = g.reshape(w.shape) if g.shape != w.shape else g
        assert g.shape == w.shape and g.numel() == w.numel()
        _assert_grads([g], [w], dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_kernels_emulated_sum_as_eager(case, monkeypatch):
    """The CUDA kernels (emulated) on float32 inputs, the split or a row backward's fused form (the sums in its row
    kernel: tests/test_row_partial_sums.py): eager's float64 gradients."""
    monkeypatch.setattr(grad_sums, "_no_fused", set())  # (a decline of these CPU tensors would be this test's)
    for n in (31, 1024):
        _check_emulated_sums(case, n, (3, 5), _emulated)


@pytest.mark.parametrize("n,dtype", [(12289, torch.float32), (16384, torch.float32), (4100, torch.float64)],
                         ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.row_backward], ids=lambda c: c.id)
def test_cuda_row_backward_sums_over_rows_of_several_trips_emulated(case, n, dtype, monkeypatch):
    """A row backward's fused form over rows its CUDA row kernel takes in several trips (16384 float32 elements
    past one trip of this form's, 12289 not a whole number of trips; float64 rows of 4100, double slots): the column
    sums in the row kernel, a slot per column in shared memory (CudaShape.trip_sums), where they were written whole
    for a column kernel before; eager's float64 gradients."""
    from fuser.rows.plan import plan as row_plan
    monkeypatch.setattr(grad_sums, "_no_fused", set())
    shapes = []

    def launch(sp, a):
        if sp.has_reduction:
            with torch.no_grad():
                p = row_plan(sp, list(a), target="cuda")
            shapes.append((p.key.shape, p.key.sums, p.key.apart))
        return _emulated(sp, a)

    _check_emulated_sums(case, n, (3, 5), launch, dtype)
    assert len(shapes) == 1 and shapes[0][0].trip_sums and shapes[0][1] and not shapes[0][2], shapes
    assert n > shapes[0][0].tpr * shapes[0][0].items, shapes  # (several trips)


@pytest.mark.parametrize("n,dtype,items,vec,several", [(16384, torch.bfloat16, 8, 8, True),
                                                       (12296, torch.bfloat16, 8, 8, True),
                                                       (16384, torch.bfloat16, 16, 8, False)], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.row_backward], ids=lambda c: c.id)
def test_trip_sums_of_vectors_past_16_bytes_emulated(case, n, dtype, items, vec, several, monkeypatch):
    """Trip sums whose vector of a thread's sums passes 16 bytes (8 float sums of bfloat16 rows in 16-byte vectors:
    the plan is made to take them; 12296 elements not a whole number of trips; 16 elements a thread: the row of
    16384 in one trip of 1024 threads) add them in 16-byte chunks, each chunk of the vectors in a region of its own
    (rows.codegen.sum_slots.trip_slot_chunk), and write column c's slot back as column c: eager's float64 gradients."""
    import importlib
    from dataclasses import replace
    from fuser.rows import codegen as row_codegen
    from fuser.rows import shape as row_shape
    plan_mod = importlib.import_module("fuser.rows.plan")  # (fuser.rows.plan, the name, is its plan function)
    monkeypatch.setattr(grad_sums, "_no_fused", set())
    orig = row_shape._cuda_sums_shape

    def wide(*a, **k):
        sh = orig(*a, **k)
        return replace(sh, items=items, vec=vec, full=a[1] % (sh.tpr * items) == 0) if sh.trip_sums else sh

    monkeypatch.setattr(row_shape, "_cuda_sums_shape", wide)
    shapes = []

    def launch(sp, a):
        if sp.has_reduction:
            with torch.no_grad():
                p = plan_mod.plan(sp, list(a), target="cuda")
            shapes.append(p.key.shape)
        return _emulated(sp, a)

    _check_emulated_sums(case, n, (3, 5), launch, dtype)
    sh, = shapes
    assert sh.trip_sums and sh.vec == vec and (n > sh.tpr * sh.items if several else n == sh.tpr * sh.items), sh
    assert row_codegen.trip_slot_chunk(sh, "float") < vec


def _ln_16k(x, w, b):
    return torch.layer_norm(x, [16384], w, b, 1e-5) * 2.0


def _ln_12292(x, w, b):
    return torch.layer_norm(x, [12292], w, b, 1e-5) * 2.0


def _rms_16k(x, w):
    return torch.rms_norm(x, [16384], w, 1e-6) * 0.5


def _door_sums_plans(fn, door: str, n: int, monkeypatch) -> list:
    """``fn``'s groups as a door runs its training steps (``door``: "script", the TorchScript pass, or "compile",
    torch.compile's fuser backend) on bfloat16 rows of ``n``, planned for CUDA on fresh random inputs of the shapes
    the door gave them (the statistics positive, as an rstd is): (spec, inputs, plan) of those with column sums."""
    import importlib
    from fuser import rows
    plan_fn = importlib.import_module("fuser.rows.plan").plan
    seen = {}

    def spy(spec, args, target=None, *a, **k):  # (the groups and their arguments' shapes; values: fresh below)
        seen[spec.key] = (spec, [x.detach() if isinstance(x, torch.Tensor) else x for x in args])
        return plan_fn(spec, args, target, *a, **k)

    monkeypatch.setattr(rows, "plan", spy)
    f = fuser.fuse(torch.jit.script(fn)) if door == "script" else torch.compile(fn, backend="fuser", dynamic=False)
    n_params = 1 if fn is _rms_16k else 2
    for _ in range(3):
        args = [torch.randn(4, n, dtype=torch.bfloat16, requires_grad=True)] + [
            torch.randn(n, dtype=torch.bfloat16, requires_grad=True) for _ in range(n_params)]
        y = f(*args)
        torch.autograd.grad(y, args, torch.randn_like(y))
    monkeypatch.setattr(rows, "plan", plan_fn)
    summed = []
    for spec, shaped in seen.values():
        a = [(torch.rand_like(t) + 0.5 if t.shape[-1:] == (1,) else torch.randn_like(t))
             if isinstance(t, torch.Tensor) else t for t in shaped]
        p = plan_fn(spec, a, "cuda")
        if not isinstance(p, str) and p.key.sums:
            summed.append((spec, a, p))
    assert len(summed) == 1, [spec.group for spec, _ in seen.values()]
    return summed


@pytest.mark.parametrize("fn", (_ln_16k, _rms_16k), ids=lambda f: f.__name__)
def test_a_norm_backward_of_bfloat16_rows_takes_their_vectors_emulated(fn, monkeypatch):
    """The backward of layer_norm / rms_norm as the TorchScript door runs it (bfloat16 rows of 16384, the float32
    mean and rstd its forward saved), planned for CUDA: trip sums in 16-byte vectors of the rows (8 elements), the
    statistics read once a row not narrowing them to 4 (shape.TRIP_SUMS_ELEMENT_VECTORS); its kernel emulated on
    fresh random inputs of the shapes the door gave it, against eager's ops on them (fallback.evaluate) in float64
    and in bfloat16."""
    from fuser import fallback
    from fuser.rows import emulate as row_emulate
    from tests.helpers import assert_close_to_float64
    for spec, a, p in _door_sums_plans(fn, "script", 16384, monkeypatch):
        assert p.key.shape.trip_sums and p.key.shape.vec == 8, p.key
        assert any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (4, 1) for t in a)
        got = row_emulate.run(spec.group, a)
        want64 = fallback.evaluate(spec.group, [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point()
                                                 else t for t in a])
        want = fallback.evaluate(spec.group, a)
        assert got is not None and len(got) == len(want)
        for g, w64, w in zip(got, want64, want):
            assert_close_to_float64([g.reshape(w.shape)], [w64.reshape(w.shape).double()], [w], w.dtype)


def test_trip_sums_keep_vectors_the_row_takes(monkeypatch):
    """The TorchScript door's layer_norm backward over bfloat16 rows of 12292 elements (a whole number of 4-element
    vectors, not of 8) keeps the 16 bytes of its float32 statistics' vectors (4 elements), so its rows are still read
    in vectors and staged; with 8 they would be read an element at a time, unstaged."""
    (_, _, p), = _door_sums_plans(_ln_12292, "script", 12292, monkeypatch)
    sh = p.key.shape
    assert sh.trip_sums and sh.vec == 4 and sh.staged and p.vec_ok, sh


@pytest.mark.parametrize("case", [c for c in CASES if not c.row_backward], ids=lambda c: c.id)
def test_cuda_fused_pointwise_backward_emulated(case, monkeypatch):
    """The fused form of a pointwise backward as CUDA takes it (grad_sums._fused_first: on CUDA a pointwise backward
    too), its column kernel emulated: one kernel writes x's gradient and sums the bias's (and the weight's), eager's
    float64 gradients over rows of 31, 1024 and 8 elements and 15 to 600 of them."""
    monkeypatch.setattr(grad_sums, "_no_fused", set())
    monkeypatch.setattr(grad_sums, "_fused_first", lambda bw, device: True)
    for n, lead in ((31, (3, 5)), (1024, (67,)), (8, (600,))):
        ran = []
        _check_emulated_sums(case, n, lead, lambda sp, a: ran.append(sp.key) or _emulated(sp, a))
        assert len(ran) == 1 and ran[0] in grad_sums.fused_keys, (n, lead, ran)


# ------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_broadcast_gradients_are_summed_by_a_column_kernel_on_the_gpu(case, dtype, watch):
    """As on the CPU, but a pointwise backward's sums in the column kernel that writes x's gradient (the fused form,
    on CUDA only: grad_sums._fused_first); a row backward's in its row kernel where the row takes one trip, by the
    split's column kernel otherwise (fuser/rows/plan.py). (rms_norm's forward is left to eager on CUDA in float64 and over row
    lengths that are not a multiple of 4: its gradients are eager's own there, checked against float64 without
    asking the path.)"""
    for n in LENGTHS + (4096,):
        for lead in ((3, 5), (4096,)):
            args = _leaves(_inputs(case, dtype, n, lead, "cuda"))
            spec = _spec(case, n)
            # (eager's on CUDA in float64 and over row lengths eager's kernel does not vectorize: rows/plan.py)
            if case.id == "rms_norm" and (dtype == torch.float64 or n % 4):
                args64 = _leaves([a.detach().double() for a in args])
                ref = case.eager(*args64)
                gy = [torch.randn_like(r) for r in ref]
                got = torch.autograd.grad(fuser.run_fusion(spec.key, args), args, [g.to(dtype) for g in gy])
                _assert_grads(got, torch.autograd.grad(ref, args64, gy), dtype)
                continue
            got, want = _fused_and_eager64(case, spec, args, watch)
            _assert_grads(got, want, dtype)
            assert watch.summed(True) or (case.row_backward and watch.summed(False)), (n, lead, watch.took())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.row_backward], ids=lambda c: c.id)
def test_row_backward_sums_rows_of_several_trips_in_its_row_kernel_on_the_gpu(case, dtype, watch):
    """Rows of 16384 and 12292 elements (several trips of a CUDA row kernel; rms_norm's rows a multiple of 4, as
    its forward is fused on CUDA): the weight's and bias's gradients summed in the row kernel (CudaShape.trip_sums,
    a slot a column in shared memory) over 64 and 1000 rows, within the dtype's tolerance of eager's float64
    gradients for the same values."""
    n_sums = case.n_inputs - 1  # (the weight's and bias's, or the mask's)
    for n in (16384, 12292):
        for lead in ((64,), (1000,)):
            args = _leaves(_inputs(case, dtype, n, lead, "cuda"))
            got, want = _fused_and_eager64(case, _spec(case, n), args, watch)
            _assert_grads(got, want, dtype)
            # (a device with less shared memory a block than an H100's takes the split)
            assert watch.summed(trip_sums_fit(n_sums, 16384)), (n, lead, watch.took())  # (12292: 16384 slots)


# ------------------------------------------------------------------------- column groups under autograd

def _column_group(kind: str, dims, keepdim: bool, epilogue: bool, element_output: bool = False):
    """kind(x * y, dims, keepdim) (y: [cols], broadcast down the columns), times 2 plus c ([cols]) where
    ``epilogue``; the product beside it as an output where ``element_output``."""
    b = ir.Builder()
    x, y, c = b.input(), b.input(), b.input()
    p = b.call("aten::mul", x, y)
    op = {"sum": "aten::sum.dim_IntList", "mean": "aten::mean.dim", "amax": "aten::amax"}[kind]
    s = b.add(op, p, tuple(dims), keepdim, *((None,) if kind != "amax" else ()))
    if epilogue:
        s = b.call("aten::add", b.call("aten::mul", s, 2.0), c, 1)
    return b.build([s, p] if element_output else [s])


def _column_eager(kind, dims, keepdim, epilogue, element_output=False):
    def f(x, y, c):
        p = x * y
        s = getattr(p, kind)(dims, keepdim=keepdim)
        s = s * 2 + c if epilogue else s
        return [s, p] if element_output else [s]
    return f


COLUMN_CASES = [("sum", (0,), False, False, False), ("sum", (0,), True, True, False), ("mean", (0, 1), False, True, False),
                ("mean", (0,), True, False, True), ("amax", (0,), False, True, False)]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("form", COLUMN_CASES, ids=lambda f: "-".join(map(str, f)))
def test_a_column_group_under_autograd_runs_its_generated_backward(form, dtype, monkeypatch):
    """A reduction over leading dims with inputs that require grad: the column kernel runs the forward, the
    generated backward the gradients (x's as a pointwise kernel, y's summed by a column kernel, c's by a group
    of its own), eager's float64 gradients; amax's backward (a mask per element of the column's max) runs
    through the interpreter, eager's gradients too."""
    from helpers import record_backward_runs
    ran = record_backward_runs(monkeypatch)
    for shape in ((50, 7), (31, 1), (1024, 3)) if form[1] == (0,) else ((4, 6, 5), (3, 1, 33)):
        _check_column_autograd(form, dtype, shape, "cpu", ran)
        if form[0] != "amax":
            assert all(s.key in grad_sums.column_keys or not s.has_reduction for s in ran), shape


def _check_column_autograd(form, dtype, shape, device, ran):
    """The group of ``form`` on fresh inputs of ``shape``: wrapped, eager's float64 gradients; ``ran`` (backward
    groups that ran as kernels) holds a column kernel that sums y's gradient where the form is not amax's (a column
    group's, or on CUDA the fused form's)."""
    spec = STORE.get(STORE.register(_column_group(*form)))
    args = _leaves([torch.randn(s, dtype=dtype, device=device) for s in (shape, shape[-1:], shape[-1:])])
    args64 = _leaves([a.detach().double() for a in args])
    outs = fuser.run_fusion(spec.key, args)
    assert outs[0].grad_fn.name() in FUSED_BACKWARD, shape
    ref = _column_eager(*form)(*args64)
    grads = [torch.randn_like(r) for r in ref]
    ran.clear()
    got = torch.autograd.grad(outs, args, [g.to(dtype) for g in grads], allow_unused=True)
    want = torch.autograd.grad(ref, args64, grads, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            _assert_grads([g], [w], dtype)
    if form[0] != "amax":  # (on CUDA the fused form's column kernel where no gradient is computed apart)
        assert any(s.key in grad_sums.column_keys | grad_sums.fused_keys for s in ran), shape


def test_a_column_group_with_mixed_dtypes_and_double_backward():
    """(x * y).sum(0) * 2 + c with x and y float32 and c float64: the gradient cast back to float32 through the
    product's dtype; float64 gradcheck and gradgradcheck of the mean over (0, 1) with its epilogue."""
    spec = STORE.get(STORE.register(_column_group("sum", (0,), False, True)))
    args = _leaves([torch.randn(40, 6), torch.randn(6), torch.randn(6, dtype=torch.float64)])
    outs = fuser.run_fusion(spec.key, args)
    assert outs[0].dtype == torch.float64 and outs[0].grad_fn.name() in FUSED_BACKWARD
    gy = torch.randn(6, dtype=torch.float64)
    got = torch.autograd.grad(outs, args, gy)
    args64 = _leaves([a.detach().double() for a in args])
    want = torch.autograd.grad(_column_eager("sum", (0,), False, True)(*args64), args64, gy)
    for g, w, a in zip(got, want, args):
        assert g.dtype == a.dtype
        _assert_grads([g], [w.to(a.dtype)], a.dtype)
    spec = STORE.get(STORE.register(_column_group("mean", (0, 1), False, True)))

    def fn(*ts):
        return tuple(fuser.run_fusion(spec.key, list(ts)))

    ts = tuple(_leaves([torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
                        torch.randn(4, dtype=torch.float64)]))
    assert torch.autograd.gradcheck(fn, ts)
    assert torch.autograd.gradgradcheck(fn, ts)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_a_column_group_under_autograd_in_half_is_as_close_as_eagers(dtype):
    """float16/bfloat16: each gradient within twice eager's own error of float64 (plus a unit), eager's dtypes."""
    for form in COLUMN_CASES:
        spec = STORE.get(STORE.register(_column_group(*form)))
        shape = (64, 9) if form[1] == (0,) else (4, 8, 9)
        args = _leaves([torch.randn(shape, dtype=dtype), torch.randn(9, dtype=dtype), torch.randn(9, dtype=dtype)])
        args64 = _leaves([a.detach().double() for a in args])
        eager = _column_eager(*form)
        outs = fuser.run_fusion(spec.key, args)
        assert outs[0].grad_fn.name() in FUSED_BACKWARD
        ref, ref64 = eager(*args), eager(*args64)
        gy = [torch.randn_like(r) for r in ref]
        got = torch.autograd.grad(outs, args, gy, allow_unused=True)
        want = torch.autograd.grad(ref, args, gy, allow_unused=True)
        want64 = torch.autograd.grad(ref64, args64, [g.double() for g in gy], allow_unused=True)
        for g, w, w64 in zip(got, want, want64):
            assert (g is None) == (w is None)
            if g is None:
                continue
            assert g.dtype == w.dtype == dtype and g.shape == w.shape
            scale = max(1.0, w64.abs().max().item())
            err, eager_err = (g.double() - w64).abs().max().item(), (w.double() - w64).abs().max().item()
            assert err <= 2 * eager_err + 8e-3 * scale, (form, err, eager_err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("form", COLUMN_CASES, ids=lambda f: "-".join(map(str, f)))
def test_a_column_group_under_autograd_on_the_gpu(form, dtype, monkeypatch):
    """As on the CPU: the forward a column kernel, the generated backward's kernels, eager's float64 gradients."""
    from helpers import record_backward_runs
    ran = record_backward_runs(monkeypatch)
    for shape in ((65537, 7), (1024, 4096)) if form[1] == (0,) else ((64, 64, 300),):
        _check_column_autograd(form, dtype, shape, "cuda", ran)
