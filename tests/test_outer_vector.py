"""The CPU column kernels' at::vec pass (fuser/rows/outer_codegen.py ``_cpu_vector_pass``; issues 11 and 12): the
kernels of reductions over leading dims, in float32, bfloat16 and float16, against a float64 reference on seeded
random inputs, at column counts that fill whole vectors, leave a scalar tail, and cross a chunk of
``outer_templates.CPU_CHUNK`` columns, reduced lengths around the fold of ``CPU_FOLD_ROWS`` rows, with strided,
broadcast and permuted inputs (the vector pass, the scalar tail and the odometer over several column dims); the
results are the same bits call after call and with one or two threads; the native hot path serves repeated calls of
a CPU column kernel with eager's results and hands over the calls autograd records and those with no rows."""
from __future__ import annotations

import pytest
import torch
from helpers import reduce_node

import fuser
from fuser import executor, ir, native, rows
from fuser.kernel_cache import STORE
from fuser.native import record
from fuser.rows import outer_launch
from fuser.rows import outer_templates as t

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (the tolerance relative to the size of what a column sums: float64 of the inputs' magnitudes)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
CHUNK = t.CPU_CHUNK
COLS = (8, 13, 64, CHUNK + 7, 2 * CHUNK + 24)  # whole vectors of 8 floats, a tail, several chunks with tails
REDS = (1, t.CPU_FOLD_ROWS - 1, t.CPU_FOLD_ROWS + 1, 300)


def _spec(group):
    return STORE.get(STORE.register(group))


def _sum_mul():
    b = ir.Builder()
    x, y = b.input(), b.input()
    return b.build([reduce_node(b, "sum", b.call("aten::mul", x, y), (0,), False)])


def _sigmoid_stats():
    """sigmoid(x) * y + 1: its mean (keepdim), amax and amin over dim 0, and the element-level value as an output
    (the vector pass stores it too); an epilogue on the mean."""
    b = ir.Builder()
    x, y = b.input(), b.input()
    p = b.call("aten::add", b.call("aten::mul", b.call("aten::sigmoid", x), y), 1, 1)
    m = reduce_node(b, "mean", p, (0,), True)
    return b.build([p, b.call("aten::mul", m, 3), reduce_node(b, "amax", p, (0,), False),
                    reduce_node(b, "amin", p, (0,), False)])


def _sum_mul_eager(x, y):
    return [(x * y).sum(0)]


def _sigmoid_stats_eager(x, y):
    p = torch.sigmoid(x) * y + 1
    return [p, p.mean(0, keepdim=True) * 3, p.amax(0), p.amin(0)]


GROUPS = {"sum_mul": (_sum_mul(), _sum_mul_eager), "sigmoid_stats": (_sigmoid_stats(), _sigmoid_stats_eager)}


def _check(outs, eager, args, dtype):
    """Against eager's dtypes and shapes exactly, and in value eager run in float64 (within ``dtype``'s tolerance
    relative to the size of the column's terms)."""
    ref = eager(*args)
    ref64 = eager(*[a.double() for a in args])
    size64 = eager(*[a.double().abs() for a in args])
    assert len(outs) == len(ref)
    for o, r, r64, m64 in zip(outs, ref, ref64, size64):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        scale = max(1.0, r64.abs().max().item(), m64.abs().max().item()) if r64.numel() else 1.0
        torch.testing.assert_close(o.double(), r64, rtol=TOL[dtype], atol=TOL[dtype] * scale, equal_nan=True)


def _run(name, args):
    group, _ = GROUPS[name]
    spec = _spec(group)
    p = rows.plan(spec, args)
    assert isinstance(p, rows.OuterPlan), p
    out = executor.run(spec, args)
    assert out is not None, executor.plan(spec, args)
    return spec, out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_vectorized_column_kernels_match_a_float64_reference(name, dtype):
    """Contiguous inputs: every chunk takes the vector pass for its whole vectors and the scalar loop for the rest;
    the kernel's source holds the vector pass."""
    _, eager = GROUPS[name]
    for red in REDS:
        for cols in COLS:
            args = [torch.randn(red, cols, dtype=dtype), torch.randn(red, cols, dtype=dtype)]
            spec, out = _run(name, args)
            _check(out, eager, args, dtype)
    kernels = [k for k in spec.kernels().values() if isinstance(k, outer_launch.OuterKernel)]
    assert kernels and all("vacc" in k.source for k in kernels)


def _layouts(dtype):
    """(id, x, y): inputs that step by 0 or 1 along the columns (the vector pass) or not (the scalar loop), and
    several column dims (chunks that cross a run of the innermost one: the odometer)."""
    c = CHUNK + 9
    yield "rows-strided", torch.randn(90, c, dtype=dtype)[::3], torch.randn(30, c, dtype=dtype)
    yield "y-row-vector", torch.randn(40, c, dtype=dtype), torch.randn(c, dtype=dtype)
    yield "y-one-per-row", torch.randn(40, c, dtype=dtype), torch.randn(40, 1, dtype=dtype)
    yield "x-broadcast-rows", torch.randn(1, c, dtype=dtype).expand(70, c), torch.randn(70, c, dtype=dtype)
    yield "cols-strided", torch.randn(50, 2 * c, dtype=dtype)[:, ::2], torch.randn(50, c, dtype=dtype)
    yield "transposed", torch.randn(c, 33, dtype=dtype).t(), torch.randn(33, c, dtype=dtype)
    yield "offset-view", torch.randn(41, c + 3, dtype=dtype)[1:, 3:], torch.randn(40, c, dtype=dtype)
    # column dims that do not merge: runs of 300 columns (chunks cross them), of 5 (shorter than a vector)
    yield "permuted-300", torch.randn(7, 60, 300, dtype=dtype).permute(1, 0, 2), torch.randn(7, 300, dtype=dtype)
    yield "permuted-5", torch.randn(140, 5, 60, dtype=dtype).permute(2, 0, 1), torch.randn(140, 5, dtype=dtype)
    yield "y-broadcast-both", torch.randn(8, 3, 200, dtype=dtype).permute(1, 0, 2), torch.randn(1, 8, 1,
                                                                                                dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_strided_and_broadcast_inputs(dtype):
    for name, (_, eager) in GROUPS.items():
        for what, x, y in _layouts(dtype):
            args = [x, y]
            _, out = _run(name, args)
            try:
                _check(out, eager, args, dtype)
            except AssertionError as e:
                raise AssertionError(f"{name}, {what}: {e}") from None


def test_results_are_the_same_bits_every_call_and_with_one_or_two_threads():
    """A column's sum is folded in a fixed order (chunks, vectors, the fold every CPU_FOLD_ROWS rows) whatever
    the threads: the same bits call after call, with one thread and with two."""
    x, y = torch.randn(1000, 4 * CHUNK + 5), torch.randn(1000, 4 * CHUNK + 5)
    _, first = _run("sum_mul", [x, y])
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            for _ in range(2):
                _, out = _run("sum_mul", [x, y])
                assert torch.equal(out[0], first[0]), threads
    finally:
        torch.set_num_threads(old)


def test_vector_pass_and_scalar_loop_agree_across_a_chunk():
    """The same values summed by the vector pass (a contiguous input) and by the scalar loop (the same values
    read through a stride of 2 along the columns): equal within float32's tolerance, column by column."""
    wide = torch.randn(200, 2 * (CHUNK + 3))
    x = wide[:, ::2]
    y = torch.randn(200, CHUNK + 3)
    _, vec = _run("sum_mul", [x.contiguous(), y])
    _, scalar = _run("sum_mul", [x, y])
    ref = (x.double() * y.double()).sum(0)
    scale = (x.double() * y.double()).abs().sum(0).max().item()
    for out in (vec[0], scalar[0]):
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_nan_and_inf_propagate_through_the_vector_pass_as_in_eager(dtype):
    """amax, sum and amin of columns holding NaN, inf and -inf, in the vector pass's lanes and in the tail."""
    b = ir.Builder()
    x = b.input()
    spec = _spec(b.build([reduce_node(b, "amax", x, (0,), False), reduce_node(b, "sum", x, (0,), False),
                          reduce_node(b, "amin", x, (0,), False)]))
    x = torch.randn(150, 21, dtype=dtype)
    for r, c, v in ((3, 1, "nan"), (100, 1, "inf"), (7, 2, "inf"), (9, 3, "inf"), (11, 3, "-inf"), (140, 4, "-inf"),
                    (70, 19, "nan"), (0, 20, "inf"), (149, 20, "-inf"), (80, 9, "nan"), (81, 9, "inf")):
        x[r, c] = float(v)
    out = executor.run(spec, [x])
    assert out is not None
    for o, r in zip(out, (x.amax(0), x.sum(0), x.amin(0))):
        assert torch.equal(o.isnan(), r.isnan()) and torch.equal(o.isinf(), r.isinf())
        torch.testing.assert_close(o, r, equal_nan=True, rtol=TOL[dtype], atol=TOL[dtype] * 30)


# ---------------------------------------------------------------------------------------------- the native hot path

def _sum0(x, y):
    return (x * y).sum(0)


@pytest.mark.skipif(not native.loaded(), reason=f"native hot path: {native.status()}")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
def test_the_native_hot_path_serves_cpu_column_kernels(dtype):
    """Repeated calls of a fused sum over dim 0 are served natively with the Python path's results (eager's
    within tolerance), for contiguous and strided inputs; a sum over no rows (the kernel must write its zeros) and
    the calls autograd records go to Python, with eager's results and gradients."""
    f = fuser.fuse(torch.jit.script(_sum0))
    for x, y in ((torch.randn(8, 4096, dtype=dtype), torch.randn(8, 4096, dtype=dtype)),
                 (torch.randn(64, 2 * 77, dtype=dtype)[:, ::2], torch.randn(77, dtype=dtype))):
        with torch.no_grad():
            for _ in range(3):  # (the profiling executor's first calls run unfused)
                f(x, y)
            before = native.stats()["hits"]
            outs = [f(x, y) for _ in range(3)]
            assert native.stats()["hits"] - before == 3
        for out in outs:
            _check([out], lambda a, b: [_sum0(a, b)], [x, y], dtype)
            assert torch.equal(out, outs[0])
    with torch.no_grad():
        empty = [torch.randn(0, 6, dtype=dtype), torch.randn(0, 6, dtype=dtype)]
        for _ in range(4):
            torch.testing.assert_close(f(*empty), _sum0(*empty))
    x = torch.randn(16, 40, dtype=dtype, requires_grad=True)
    y = torch.randn(16, 40, dtype=dtype)
    for _ in range(4):
        gy = torch.randn(40, dtype=dtype)
        got = torch.autograd.grad(f(x, y), x, gy)[0]
        torch.testing.assert_close(got, torch.autograd.grad(_sum0(x, y), x, gy)[0])


def test_launch_records_of_column_geometries():
    """A CPU column kernel's geometry gives a CPU record (the row kernels' CPU ABI: the reduced length, then the
    column dims and the columns); one with no rows or no columns gives none (Python runs it)."""
    spec = _spec(GROUPS["sum_mul"][0])
    for shape, served in (((20, 3), True), ((0, 3), False), ((4, 0), False)):
        args = [torch.randn(shape), torch.randn(shape)]
        outs = executor.run(spec, args)
        geo = spec.geometries[executor.signature(args)]
        assert isinstance(geo, outer_launch.OuterGeometry)
        got = record.launch_record(geo, args, [], outs)
        assert (got is not None) == served, shape
        if served:
            rec = got[0]
            assert rec[0] == record.KIND_CPU and rec[1] == shape[0]
