"""Reductions over the leading dims (issue 12's outer reductions, fuser/rows/outer*.py): groups built from the IR
alone (sum, mean, amax, amin over dim 0 or dims 0 and 1, keepdim both ways, sum's and mean's dtype argument, a
pointwise prologue, an epilogue on the reduced value that may read inputs of one value a column, an element-level
output beside the reduction) run as one column kernel on the CPU backend and through the CUDA host emulation (both
of its stages), against eager on seeded random inputs and a float64 reference, at reduced lengths 1, 31, 32, 1024
and 65537 and 1, 3 and 4096 columns, with non-contiguous, broadcast and permuted inputs, empty dims (eager's result
or eager's error) and the forms the column kernel does not take (eager's result); the TorchScript pass makes one
group of a leading reduction and its pointwise neighbours. The CUDA twins are marked gpu."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import fuser
from helpers import REDUCE_EAGER, on_cuda_aligned_alike, ptx_instructions, ptxas_registers, reduce_node
from fuser import executor, ir, rows
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.native import record
from fuser.rows import emulate as row_emulate
from fuser.rows import outer_launch, outer_templates

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SHORT_DTYPES = (torch.float32, torch.bfloat16)
CPU_SIZES = [(r, c) for r in (1, 31, 32, 1024, 65537) for c in (1, 3, 4096) if r * c < 2 ** 26]
EMULATED_SIZES = [(r, c) for r in (1, 31, 32, 1024) for c in (1, 3)] + [(65537, 1), (8192, 3), (1024, 4096)]


@dataclass(frozen=True)
class Case:
    """A group, its inputs for (dtype, reduced length, columns), and eager's outputs for those inputs."""

    id: str
    group: Callable[[], ir.Group]
    inputs: Callable[[torch.dtype, int, int], list]
    eager: Callable[..., list]
    dtypes: tuple = SHORT_DTYPES


def _single(kind: str, keepdim: bool, dtypes=SHORT_DTYPES, dtype_arg=None) -> Case:
    def group():
        b = ir.Builder()
        x = b.input()
        return b.build([reduce_node(b, kind, x, (0,), keepdim, dtype_arg)])

    wanted = {7: torch.float64, 6: torch.float32, None: None}[dtype_arg]

    def eager(x):
        extra = {"dtype": wanted} if wanted is not None else {}
        return [REDUCE_EAGER[kind](x, dim=(0,), keepdim=keepdim, **extra)]

    suffix = f"-dtype{dtype_arg}" if dtype_arg is not None else ""
    return Case(f"{kind}-0-{'keep' if keepdim else 'drop'}{suffix}", group,
                lambda dt, r, c: [torch.randn(r, c, dtype=dt)], eager, dtypes)


def _prologue_epilogue() -> Case:
    """s = sum((x * y), 0) with y broadcast along the reduced dim, then s * f and s - s * f on the column (f a float
    argument; not s * s, which overflows float16 where a float64 reference does not)."""
    def group():
        b = ir.Builder()
        x, y, f = b.input(), b.input(), b.input(ir.FLOAT)
        s = reduce_node(b, "sum", b.call("aten::mul", x, y), (0,), False)
        sf = b.call("aten::mul", s, f)
        return b.build([sf, b.call("aten::sub", s, sf, 1)])

    def eager(x, y, f):
        s = (x * y).sum(0)
        return [s * f, s - s * f]

    return Case("prologue-epilogue", group, lambda dt, r, c: [torch.randn(r, c, dtype=dt), torch.randn(c, dtype=dt),
                                                              0.75], eager, ALL_DTYPES)


def _bias_epilogue() -> Case:
    """Inputs of one value a column in the epilogue: (x * y).sum(0) + b, and sigmoid(w) * amax(x, 0, keepdim) with
    w of shape [1, cols] (an element-level op of an input, computed once a column)."""
    def group():
        b = ir.Builder()
        x, y, c, w = b.input(), b.input(), b.input(), b.input()
        s = reduce_node(b, "sum", b.call("aten::mul", x, y), (0,), False)
        m = reduce_node(b, "amax", x, (0,), True)
        return b.build([b.call("aten::add", s, c, 1), b.call("aten::mul", b.call("aten::sigmoid", w), m)])

    def eager(x, y, c, w):
        return [(x * y).sum(0) + c, torch.sigmoid(w) * x.amax(0, keepdim=True)]

    return Case("bias-epilogue", group, lambda dt, r, c: [torch.randn(r, c, dtype=dt), torch.randn(r, c, dtype=dt),
                                                          torch.randn(c, dtype=dt), torch.randn(1, c, dtype=dt)],
                eager)


def _element_output() -> Case:
    """The prologue's value as an output beside the amax and the mean of it (keepdim): one pass stores all."""
    def group():
        b = ir.Builder()
        x, y = b.input(), b.input()
        p = b.call("aten::sub", b.call("aten::mul", x, 2), y, 1)
        return b.build([p, reduce_node(b, "amax", p, (0,), True), reduce_node(b, "mean", p, (0,), True)])

    def eager(x, y):
        p = x * 2 - y
        return [p, p.amax(0, keepdim=True), p.mean(0, keepdim=True)]

    return Case("element-output", group, lambda dt, r, c: [torch.randn(r, c, dtype=dt), torch.randn(r, c, dtype=dt)],
                eager)


def _two_dims() -> Case:
    """amin over dims 0 and 1 of a rank-3 value (2r elements a column), keepdim off."""
    def group():
        b = ir.Builder()
        x = b.input()
        return b.build([reduce_node(b, "amin", b.call("aten::neg", x), (0, 1), False)])

    return Case("amin-01", group, lambda dt, r, c: [torch.randn(2, r, c, dtype=dt)],
                lambda x: [torch.amin(-x, dim=(0, 1))])


CASES = [_single("sum", True, ALL_DTYPES), _single("mean", False), _single("amax", False), _single("amin", True),
         _single("sum", False, (torch.float32, torch.float16), 7), _single("mean", True, (torch.bfloat16,), 6),
         _prologue_epilogue(), _bias_epilogue(), _element_output(), _two_dims()]
PARAMS = [(c, dt) for c in CASES for dt in c.dtypes]
IDS = [f"{c.id}-{str(dt)[6:]}" for c, dt in PARAMS]
_GROUPS = {c.id: c.group() for c in CASES}


def _spec(group: ir.Group):
    return STORE.get(STORE.register(group))


def _check(outs, eager: Callable, args):
    """Against eager (dtypes and shapes exactly) and, in value, eager run in float64 (within the dtype's tolerance,
    relative to the outputs' magnitude)."""
    ref = eager(*args)
    ref64 = eager(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    # the size of what a column sums (eager on the inputs' magnitudes): a sum that cancels to near 0 still carries
    # the rounding of its terms
    size64 = eager(*[a.double().abs() if isinstance(a, torch.Tensor) else a for a in args])
    assert len(outs) == len(ref)
    for o, r, r64, m64 in zip(outs, ref, ref64, size64):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        tol = max(TOL[r.dtype], TOL[args[0].dtype])  # (a float64 sum of float16 inputs: exact to their tolerance)
        scale = max(1.0, r64.abs().max().item(), m64.abs().max().item()) if r64.numel() else 1.0
        torch.testing.assert_close(o.double(), r64.double(), rtol=tol, atol=tol * scale, equal_nan=True)


def _is_column_plan(spec, args, target=None) -> bool:
    p = rows.plan(spec, args, target)
    assert isinstance(p, rows.OuterPlan), p
    return True


# ---------------------------------------------------------------------------------------------- CPU backend

@pytest.mark.parametrize("case,dtype", PARAMS, ids=IDS)
def test_column_kernel_on_the_cpu_matches_eager(case, dtype):
    spec = _spec(_GROUPS[case.id])
    for r, c in CPU_SIZES:
        args = case.inputs(dtype, r, c)
        assert _is_column_plan(spec, args)
        out = executor.run(spec, args)
        assert out is not None, executor.plan(spec, args)
        _check(out, case.eager, args)


def _layouts(dtype):
    """(id, x, y) for the prologue case: x [red, cols] non-contiguous in several ways, y of shape [cols]."""
    yield "transposed", torch.randn(37, 300, dtype=dtype).t(), torch.randn(37, dtype=dtype)
    yield "sliced", torch.randn(300, 80, dtype=dtype)[::3, 1::2], torch.randn(40, dtype=dtype)
    yield "y-expanded", torch.randn(65, 33, dtype=dtype), torch.randn(1, 33, dtype=dtype).expand(65, 33)
    yield "x-broadcast-rows", torch.randn(1, 40, dtype=dtype).expand(50, 40), torch.randn(40, dtype=dtype)
    yield "y-column", torch.randn(64, 5, dtype=dtype), torch.randn(64, 1, dtype=dtype)
    # two column dims that do not merge: the kernel walks them (shape (red, 6, 7), strides (6, 1, 6 * red))
    yield "permuted", torch.randn(7, 50, 6, dtype=dtype).permute(1, 2, 0), torch.randn(6, 7, dtype=dtype)


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=lambda d: str(d)[6:])
def test_non_contiguous_and_broadcast_inputs(dtype):
    case = _prologue_epilogue()
    spec = _spec(_GROUPS[case.id])
    for what, x, y in _layouts(dtype):
        args = [x, y, 1.5]
        assert _is_column_plan(spec, args), what
        _check(executor.run(spec, args), case.eager, args)
        _check(row_emulate.run(_GROUPS[case.id], args), case.eager, args)


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=lambda d: str(d)[6:])
def test_cuda_column_kernels_index_in_32_bits_below_2_31_and_in_64_above(dtype, monkeypatch):
    """The block index and the walk over the column dims divide in 32 bits where (columns + 32) * rows < 2^31
    (``rows.templates.quotient``), in 64 bits above (here by a lowered limit): both forms through the emulation, on
    column dims that do not merge (the walk divides), on long columns (the second stage) and on one column of size 1
    (no column dims left after compression: column 0's offsets alone), against eager."""
    import importlib
    row_plan = importlib.import_module("fuser.rows.plan")
    case = _prologue_epilogue()
    spec = _spec(_GROUPS[case.id])
    layouts = [(x, y) for what, x, y in _layouts(dtype) if what == "permuted"]
    layouts.append((torch.randn(8192, 3, dtype=dtype), torch.randn(3, dtype=dtype)))
    layouts.append((torch.randn(300, 1, dtype=dtype), torch.randn(1, dtype=dtype)))
    for wide in (False, True):
        if wide:
            monkeypatch.setattr(row_plan, "INDEX32_LIMIT", 1)
        for x, y in layouts:
            args = [x, y, 1.5]
            p = rows.plan(spec, args, "cuda")
            assert isinstance(p, rows.OuterPlan) and p.key.index64 == wide
            assert p.key.walk == (len(p.col_sizes) > 1)  # the column dims walked where they do not merge
            assert len(p.col_sizes) == (0 if x.shape[1:] == (1,) else 1 if x.dim() == 2 else 2)
            source = outer_launch.source_for(spec, p)[1]
            assert ("for (long long b = " in source) == wide
            assert ("for (int d = (int)rank - 1;" in source) == p.key.walk
            _check(row_emulate.run(_GROUPS[case.id], args), case.eager, args)


def test_empty_dims_give_eagers_result_or_error():
    """No rows: a sum is 0 and a mean NaN in each column, an amax raises as eager does; no columns: empty results."""
    for kind in ("sum", "mean"):
        case = _single(kind, False)
        spec = _spec(case.group())
        for shape in ((0, 5), (4, 0), (0, 0)):
            x = torch.randn(shape)
            out = executor.run(spec, [x])
            assert out is not None, executor.plan(spec, [x])
            torch.testing.assert_close(out[0], case.eager(x)[0], equal_nan=True)
            torch.testing.assert_close(row_emulate.run(case.group(), [x])[0], case.eager(x)[0], equal_nan=True)
    case = _single("amax", True)
    spec = _spec(case.group())
    x = torch.randn(0, 5)
    with pytest.raises((RuntimeError, IndexError)) as want:
        case.eager(x)
    assert isinstance(rows.plan(spec, [x]), str)
    with pytest.raises(want.type) as got:
        fuser.run_fusion(spec.key, [x])
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]
    out = executor.run(spec, [torch.randn(3, 0)])
    assert out is not None and out[0].shape == (1, 0)


def test_nan_and_inf_propagate_as_in_eager():
    b = ir.Builder()
    x = b.input()
    g = b.build([reduce_node(b, "amax", x, (0,), False), reduce_node(b, "sum", x, (0,), False),
                 reduce_node(b, "amin", x, (0,), False)])
    x = torch.randn(40, 6)
    x[3, 1], x[7, 2], x[9, 3], x[11, 3] = float("nan"), float("inf"), float("inf"), float("-inf")
    spec = _spec(g)
    for out in (executor.run(spec, [x]), row_emulate.run(g, [x])):
        for o, r in zip(out, (x.amax(0), x.sum(0), x.amin(0))):
            torch.testing.assert_close(o, r, equal_nan=True)


def test_one_group_takes_a_row_kernel_or_a_column_kernel_by_shape():
    """A sum over dim 0 of a rank-1 input reduces its trailing dim (a row kernel); of a rank-2 input, its leading
    dim (a column kernel): one spec, two kernels in its cache, each right."""
    case = _single("sum", False)
    spec = _spec(case.group())
    for x in (torch.randn(50), torch.randn(50, 3), torch.randn(20), torch.randn(7, 9)):
        p = rows.plan(spec, [x])
        assert isinstance(p, rows.OuterPlan if x.dim() == 2 else rows.RowPlan)
        torch.testing.assert_close(executor.run(spec, [x])[0], x.sum(0))
    kinds = {type(k).__name__ for k in spec.kernels().values()}
    assert kinds == {"RowKernel", "OuterKernel"}


def test_forms_the_column_kernel_does_not_take_fall_back_to_eager():
    """An element-level use of a reduced value (x - x.mean(0)), a variance over dim 0, reduced dims that are
    neither leading nor trailing, softmax over dim 0: each falls back (the plan says why) with eager's result."""
    def centered(b, x):
        return [b.call("aten::sub", x, reduce_node(b, "mean", x, (0,), False), 1)]

    def variance(b, x):
        return [b.add("aten::var.correction", x, (0,), 1, False)]

    def middle(b, x):
        return [reduce_node(b, "sum", x, (1,), False)]

    def softmax(b, x):
        return [b.add("aten::softmax.int", x, 0, None)]

    x3 = torch.randn(4, 5, 6)
    x = torch.randn(9, 7)
    cases = [(centered, x, lambda x: [x - x.mean(0)]), (variance, x, lambda x: [x.var(0)]),
             (middle, x3, lambda x: [x.sum(1)]), (softmax, x, lambda x: [torch.softmax(x, 0)])]
    for build, arg, eager in cases:
        b = ir.Builder()
        v = b.input()
        spec = _spec(b.build(build(b, v)))
        assert isinstance(rows.plan(spec, [arg]), str), build.__name__
        assert executor.run(spec, [arg]) is None
        for o, r in zip(fuser.run_fusion(spec.key, [arg]), eager(arg)):
            torch.testing.assert_close(o, r)


def test_inputs_that_require_grad_get_the_fused_backward():
    """With inputs that require grad the column kernel runs the forward and the group is wrapped with its generated
    backward (tests/test_grad_sums.py has the cases); the gradients are eager's."""
    case = _prologue_epilogue()
    spec = _spec(_GROUPS[case.id])
    x, y = torch.randn(30, 4, dtype=torch.float64, requires_grad=True), torch.randn(4, dtype=torch.float64)
    outs = fuser.run_fusion(spec.key, [x, y, 0.5])
    assert outs[0].grad_fn.name() == "_FusedGroupBackward"
    refs = case.eager(x, y, 0.5)
    grads = [torch.randn_like(r) for r in refs]
    torch.testing.assert_close(torch.autograd.grad(outs, x, grads)[0], torch.autograd.grad(refs, x, grads)[0])
    with torch.no_grad():
        assert executor.run(spec, [x.detach(), y, 0.5]) is not None


def test_the_native_hot_path_takes_cpu_column_kernels_without_autograd():
    """``record.launch_record`` gives a CPU record for a CPU column kernel's geometry; calls autograd records go to
    Python (``hot_path_grad``: their backward is formed for a column kernel). tests/test_outer_vector.py runs
    them through the hot path."""
    case = _single("sum", True)
    spec = _spec(_GROUPS[case.id])
    x = torch.randn(20, 3)
    outs = executor.run(spec, [x])
    geo = next(g for g in spec.geometries.values() if isinstance(g, outer_launch.OuterGeometry))
    assert record.launch_record(geo, [x], [], outs)[0][0] == record.KIND_CPU
    assert not geo.hot_path_grad


# ---------------------------------------------------------------------------------------------- the TorchScript pass

def _sum_over_dim0(x):
    return (x * 2 + 1).sum(0) * 3


def _bias_grad(x, y):
    p = x * y
    return p.sum((0, 1)), torch.amax(p, (0, 1), keepdim=True)


def _column_kernels_of(g) -> list:
    from fuser import ts_ir
    spec = _spec(ts_ir.lower(g.findNode("prim::FusionGroup").g("Subgraph")))
    return [k for k in spec.kernels().values() if isinstance(k, outer_launch.OuterKernel)]


@pytest.mark.parametrize("fn", (_sum_over_dim0, _bias_grad), ids=("sum0", "bias_grad"))
def test_the_pass_fuses_a_reduction_over_leading_dims_with_its_prologue_and_epilogue(fn):
    """One group, run as a column kernel; another rank takes the same group (a rank-1 input: dim 0 is trailing,
    a row kernel; a reduction over dims 0 and 1 of a rank-2 input reduces everything, also a row kernel)."""
    scripted = fuser.fuse(torch.jit.script(fn))
    shapes = [(9, 20)] if fn is _sum_over_dim0 else [(6, 5, 20), (6, 5, 20)]
    args = [torch.randn(s) for s in shapes]
    for _ in range(2):  # the profiling executor's first call records shapes
        torch.testing.assert_close(scripted(*args), fn(*args))
    g = fuser.graph_for(scripted, *args)
    assert [n.kind() for n in g.nodes() if n.kind() not in ("prim::Constant", "prim::TupleConstruct")] == [
        "prim::FusionGroup"]
    assert _column_kernels_of(g)
    other = [torch.randn(s[1:]) for s in shapes]
    torch.testing.assert_close(scripted(*other), fn(*other))


def test_the_pass_leaves_a_leading_variance_and_softmax_to_eager():
    def fn(x):
        return torch.var(x * 2, 0) + torch.softmax(x + 1, 0)

    scripted = fuser.fuse(torch.jit.script(fn))
    x = torch.randn(9, 9)
    for _ in range(2):
        torch.testing.assert_close(scripted(x), fn(x))
    kinds = [n.kind() for n in fuser.graph_for(scripted, x).nodes()]
    assert "aten::var" in kinds and "aten::softmax" in kinds


# ---------------------------------------------------------------------------------------------- the CUDA split

@pytest.mark.parametrize("n_sm", (1, 132))
def test_the_cuda_split_covers_every_row_once(n_sm):
    """For any [red, cols]: tile a power of two up to 32 covering the columns; splits of rows_per_split rows that
    cover the reduced rows exactly (no empty split); a workspace only with a second stage."""
    for red in (0, 1, 31, 32, 1024, 4097, 65537, 16384):
        for cols in (1, 2, 3, 31, 33, 4096):
            g = outer_launch.cuda_grid(red, cols, 2, n_sm, 1000)
            assert g.tile in (1, 2, 4, 8, 16, 32) and (g.tile >= cols or g.tile == 32)
            assert (g.splits - 1) * g.rows_per_split < max(red, 1) <= g.splits * g.rows_per_split
            assert 1 <= g.grid0 <= 1000
            assert (g.grid1 > 0) == (g.splits > 1) and g.workspace == (2 * g.splits * cols if g.splits > 1 else 0)


# ---------------------------------------------------------------------------------------------- CUDA emulated

@pytest.fixture(scope="module")
def emulated():
    """Every emulated case's kernels registered first, so they compile together."""
    em = emulate.default()
    with torch.random.fork_rng():
        for case, dtype in PARAMS:
            row_emulate.kernel_for(_GROUPS[case.id], case.inputs(dtype, 3, 2), em)
    em.compile_pending()
    return em


@pytest.mark.parametrize("case,dtype", PARAMS, ids=IDS)
def test_cuda_column_kernel_emulated_matches_eager(case, dtype, emulated):
    for r, c in EMULATED_SIZES:
        if (r * c > 2 ** 16 or r > 1024) and (case.id, dtype) not in (("sum-0-keep", torch.float32),
                                                                      ("prologue-epilogue", torch.bfloat16)):
            continue  # the long and the wide sizes once per path, not per case (the emulation is slow)
        args = case.inputs(dtype, r, c)
        assert _is_column_plan(_spec(_GROUPS[case.id]), args, "cuda")
        out = row_emulate.run(_GROUPS[case.id], args, emulated)
        assert out is not None
        _check(out, case.eager, args)


def test_the_emulated_sizes_take_both_stages():
    """Long columns and few columns are split (the second stage runs), the others are not, as planned for an H100."""
    split = {(r, c) for r, c in EMULATED_SIZES
             if outer_launch.cuda_grid(r, c, 1, row_emulate.N_SM, emulate.EMU_BLOCKS).splits > 1}
    assert split == {(65537, 1), (8192, 3), (1024, 4096)}


@pytest.mark.parametrize("arch", (80, 90))
def test_cuda_column_kernels_compile_with_nvrtc(arch):
    """What the emulation runs is CUDA: NVRTC compiles each case's source."""
    from fuser.cuda import driver
    for case, dtype in PARAMS:
        spec = _spec(_GROUPS[case.id])
        p = rows.plan(spec, case.inputs(dtype, 5, 3), "cuda")
        name, source = outer_launch.source_for(spec, p)
        driver.compile_source(source, name, driver.NvrtcOptions(arch))


# ---------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", PARAMS, ids=IDS)
def test_cuda_column_kernel_matches_eager(case, dtype):
    spec = _spec(_GROUPS[case.id])
    for r, c in CPU_SIZES + [(16384, 4096)]:
        args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in case.inputs(dtype, r, c)]
        out = executor.run(spec, args)
        assert out is not None, executor.plan(spec, args)
        _check(out, case.eager, args)


@pytest.mark.gpu
def test_cuda_column_kernel_is_deterministic_and_non_contiguous_inputs_work():
    case = _prologue_epilogue()
    spec = _spec(_GROUPS[case.id])
    x, y = torch.randn(65537, 40, device="cuda"), torch.randn(40, device="cuda")
    first = executor.run(spec, [x, y, 1.0])
    for _ in range(3):
        for a, b in zip(first, executor.run(spec, [x, y, 1.0])):
            assert torch.equal(a, b)
    for what, xc, yc in _layouts(torch.float32):
        args = [xc.cuda(), yc.cuda(), 1.5]
        out = executor.run(spec, args)
        assert out is not None, (what, executor.plan(spec, args))
        _check(out, case.eager, args)


def _vector_layouts(dtype, stores: bool = False):
    """(id, args, cvec wanted, whole vectors at launch) for a column case on CUDA: x [40, 64] in layouts that
    keep or lose the column vectors (4 columns, 2 of 8-byte values, 8 of 2-byte values in a pass that ``stores``
    element-level outputs: outer._column_vector), y of shape [64] or a column of x's rows."""
    size = torch.empty((), dtype=dtype).element_size()
    cv = 2 if size == 8 else 8 if size == 2 and stores else 4
    x, y = torch.randn(40, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    yield "contiguous", [x, y, 1.5], cv, True
    flat = torch.randn(40 * 64 + 1, dtype=dtype)
    yield "pointer-off-by-one", [flat[1:].view(40, 64), y, 1.5], cv, False  # strides suit vectors, the pointer not
    flat = torch.randn(40 * 64 + 4, dtype=dtype)
    yield "pointer-off-by-four", [flat[4:].view(40, 64), y, 1.5], cv, cv <= 4  # aligned to 4 elements, not 8
    yield "row-stride-off", [torch.randn(40, 65, dtype=dtype)[:, :64], y, 1.5], 1, False
    yield "y-per-row", [x, torch.randn(40, 1, dtype=dtype), 1.5], cv, True  # steps by 0 along the columns
    yield "x-broadcast-rows", [torch.randn(1, 64, dtype=dtype).expand(40, 64), y, 1.5], cv, True
    yield "no-rows", [torch.randn(0, 64, dtype=dtype), y, 1.5], cv, True
    # 68 columns: 4 divide them, 8 do not
    yield "68-columns", [torch.randn(40, 68, dtype=dtype), torch.randn(68, dtype=dtype), 1.5], min(cv, 4), True


def _vector_cases(dtype):
    """(case, args) of :func:`_vector_layouts` for the prologue case and for the element-level output case (its
    [40, 64] output written by the vector path's loop and by the element by element one)."""
    for case in (_prologue_epilogue(), _element_output()):
        for what, args, cvec, whole in _vector_layouts(dtype, stores=case.id == "element-output"):
            if what != "no-rows" or case.id == "prologue-epilogue":  # (the amax of no rows raises, as eager's)
                yield case, (what, args if case.id == "prologue-epilogue" else args[:2], cvec, whole)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=lambda d: str(d)[6:])
def test_cuda_column_vectors(dtype):
    """A CUDA column kernel's thread takes 4 consecutive columns (2 of 8-byte values, 8 of 2-byte values where it
    stores element-level outputs, each as one vector a row) where every input steps by 0 or 1 along them and its
    other strides keep vectors aligned (``outer.OuterKey.cvec``): a kernel of whole vectors only
    (``OuterKey.vectors``), and for launches whose pointers do not allow them the plan's element by element kernel
    (``outer_launch.any_plan``); otherwise one column a thread. Through the host emulation, against eager; the
    emulator is asked for the kernel of the launch's form only."""
    from fuser.rows import launch
    for case, (what, args, cvec, whole) in _vector_cases(dtype):
        spec = _spec(_GROUPS[case.id])
        p = rows.plan(spec, args, "cuda")
        assert isinstance(p, rows.OuterPlan) and p.key.cvec == cvec and p.key.vectors == (cvec > 1), (what, p)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        outs = [torch.empty(s, dtype=dt) for s, dt in zip(p.out_shapes, p.out_dtypes)]
        assert (cvec > 1 and launch.vector_ok(True, p.vec_align, tensors, outs)) == (whole and cvec > 1), what
        em = emulate.Emulator()
        _check(row_emulate.run(_GROUPS[case.id], args, em), case.eager, args)
        vec_name = outer_launch.source_for(spec, p)[0]
        any_name = outer_launch.source_for(spec, outer_launch.any_plan(p))[0] if cvec > 1 else None
        assert (vec_name in em._sources, any_name in em._sources) == ((True, False) if whole or cvec == 1 else
                                                                       (False, True)), what


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=lambda d: str(d)[6:])
def test_cuda_column_vectors_on_the_gpu(dtype):
    """The layouts of :func:`test_cuda_column_vectors` on the GPU: a misaligned pointer reads element by element,
    through the plan's second kernel (built by the launch that needs it)."""
    for case, (what, args, cvec, whole) in _vector_cases(dtype):
        spec = _spec(_GROUPS[case.id])
        args = [on_cuda_aligned_alike(a) for a in args]
        out = executor.run(spec, args)
        assert out is not None, (what, executor.plan(spec, args))
        _check(out, case.eager, args)
        if cvec > 1:
            p = rows.plan(spec, args, "cuda")
            built = spec.kernels()
            assert (outer_launch.any_plan(p).key if not whole else p.key) in built, what


# ------------------------------------------------------------------------------------- a long element pass

def _gelu_bias(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def _gelu_bias_backward_with_sums() -> ir.Group:
    """gelu(x + b)'s backward group (x's gradient from x, b and the output's gradient) with b's gradient summed over
    the rows beside it: the column kernel of its training step on CUDA (fuser/grad_sums.py's fused form)."""
    from fuser import autodiff
    from fuser.ts_ir import lower
    spec = _spec(lower(torch.jit.script(_gelu_bias).graph))
    bw = autodiff.backward_for(spec, (True, True), (True,), ((torch.float32, False), (torch.float32, False)))
    g = bw.spec.group
    assert [v.id for v in g.inputs] and len(g.outputs) == 1 and bw.fwd_inputs == (0, 1)
    total = ir.Node("aten::sum.dim_IntList", (g.outputs[0], (0,), True, None),
                    ir.Value(1 + max([v.id for v in g.inputs] + [n.out.id for n in g.nodes])))
    return ir.Group(g.inputs, g.nodes + (total,), (g.outputs[0], total.out))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=lambda d: str(d)[6:])
def test_gelu_backward_column_kernels_store_vectors_without_spilling(dtype):
    """The column kernels of gelu(x + b)'s 2-byte backward: 8 columns a thread; the whole-vector kernel loads whole
    vectors and stores x's gradient as one 16-byte vector a row, the plan's element by element kernel neither; by
    sm_90 ptxas, contracted or not (``settings.cuda_contract``): the whole-vector one leaves room for
    ``VECTOR_BLOCKS_AN_SM`` blocks of 256 threads an SM (its __launch_bounds__ asks for them: a spill of at most 8
    registers), the element by element one spills nothing."""
    group = _gelu_bias_backward_with_sums()
    spec = _spec(group)
    x, b, g = torch.randn(64, 256, dtype=dtype), torch.randn(256, dtype=dtype), torch.randn(64, 256, dtype=dtype)
    p = rows.plan(spec, [x, b, g], "cuda")
    assert p.key.cvec == 8 and p.key.vectors
    whole = outer_launch.source_for(spec, p)[1]
    single = outer_launch.source_for(spec, outer_launch.any_plan(p))[1]
    for source, vectors in ((whole, True), (single, False)):
        body = source.split("if (live) {")[1].split("fz_lane_reduce")[0]
        assert "args.vec" not in body
        assert (body.count("*reinterpret_cast<fz_vec<"), "o0[r * cols + c + v] =" in body) == (
            (1, False) if vectors else (0, True))
        assert body.count("fz_col_load<8, 1>") == (3 if vectors else 0)
        assert body.count("fz_col_load<8, 2>") == (0 if vectors else 3)
        assert (f"__launch_bounds__(256, {outer_templates.VECTOR_BLOCKS_AN_SM})" in source) == vectors
        for fmad in (False, True):
            regs, spill = ptxas_registers(source, fmad)
            if vectors:
                assert 65536 // (256 * regs) >= outer_templates.VECTOR_BLOCKS_AN_SM and spill <= 32, (fmad, regs, spill)
            else:
                assert spill == 0, (fmad, regs, spill)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=lambda d: str(d)[6:])
def test_a_column_kernels_element_outputs_are_stored_a_16_byte_vector_a_row(dtype):
    """In PTX (sm_90, NVRTC), the whole-vector kernel of gelu(x + b)'s backward stores x's gradient as one 16-byte
    vector a row: one ``st.global.v4`` for each row a trip unrolls. Its first column written ``b - split * tiles``
    left NVVM storing each vector in pieces (2-byte elements: six 2-byte stores and a 4-byte one; float32: four
    4-byte stores): no ``st.global.v4`` at all."""
    group = _gelu_bias_backward_with_sums()
    spec = _spec(group)
    x, b, g = torch.randn(64, 256, dtype=dtype), torch.randn(256, dtype=dtype), torch.randn(64, 256, dtype=dtype)
    p = rows.plan(spec, [x, b, g], "cuda")
    assert p.key.cvec * dtype.itemsize == 16 and p.key.vectors
    _, source = outer_launch.source_for(spec, p)
    unrolled = [int(n) for n in re.findall(r"FZ_COL_ROWS\((\d+), int\) \{", source)]
    assert len(unrolled) == 1
    stores = [ln for ln in ptx_instructions(source) if ln.startswith("st.global")]
    assert sum(ln.startswith("st.global.v4") for ln in stores) == unrolled[0], stores


@pytest.mark.parametrize("dtype,unrolled", [(torch.float32, 1), (torch.bfloat16, 8)], ids=["float32", "bfloat16"])
def test_a_long_element_pass_over_4_byte_values_unrolls_one_row(dtype, unrolled):
    """The column kernel of gelu(x + b)'s backward: its rows unrolled once over float32 (the registers go to the
    work), 8 times over bfloat16 (``outer_templates.ROWS_UNROLLED``; once in the element by element twin); through the host emulation against float64
    eager: the whole-vector kernel, the element by element one (x one element past an aligned address), and one
    column a thread (an odd column count)."""
    group = _gelu_bias_backward_with_sums()
    spec = _spec(group)
    for rows_, cols, skew in ((37, 64, 0), (37, 64, 1), (300, 20, 0), (9, 33, 0)):
        x = torch.randn(rows_ * cols + skew, dtype=dtype)[skew:].view(rows_, cols)
        b, g = torch.randn(cols, dtype=dtype), torch.randn(rows_, cols, dtype=dtype)
        p = rows.plan(spec, [x, b, g], "cuda")
        assert p.key.vectors == (cols % 4 == 0)
        if skew:
            p = outer_launch.any_plan(p)
        _, source = outer_launch.source_for(spec, p)
        # (and its #define; the element by element twin of a whole-vector kernel takes a row a trip)
        assert source.count("FZ_COL_ROWS(") == 2 and f"FZ_COL_ROWS({1 if skew else unrolled}, int) {{" in source
        dx, db = row_emulate.run(group, [x, b, g])
        x64, b64 = x.double().requires_grad_(), b.double().requires_grad_()
        want_dx, want_db = torch.autograd.grad(_gelu_bias(x64, b64), (x64, b64), g.double())
        tol = 2e-5 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(dx.double(), want_dx, rtol=tol, atol=tol)
        torch.testing.assert_close(db.double().reshape(-1), want_db, rtol=tol, atol=tol * rows_ ** 0.5)
