"""The passes of a CUDA row kernel and where its column sums live (fuser/rows/passes.py, fuser/rows/shape.py):
reductions that do not read each other's results share one pass along the row (``passes.reduction_passes``; a
layer_norm backward's two sums load dy and x together), those that do (softmax's max, then its sum) and variances
keep passes of their own, and the CPU kernels keep a pass a reduction; a held row's column sums go to shared memory
where a block's fit (``shape.SUMS_SHARED_BYTES``), in registers otherwise. Groups of sibling reductions (also past a
held row: read again, and a cluster's) and both homes of the column sums run through the CUDA host emulation against
eager in float64; on a GPU, the same groups through the executor."""
from __future__ import annotations

import importlib

import pytest
import torch
from helpers import check_against_float64, fused_run, reduce_node

from fuser import autodiff, backward, fallback, grad_sums, ir, ops
from fuser.kernel_cache import STORE
from fuser.rows import codegen as row_codegen, decompose, emulate as row_emulate, launch as row_launch
from fuser.rows.passes import held_values, reduction_passes, row_passes
from fuser.rows.plan import plan

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


def _siblings() -> ir.Group:
    """s = sum(x * w), m = amax(x), q = mean(x * x) over the last dim (keepdim): none reads another; the outputs
    x * s - m + q and s."""
    b = ir.Builder()
    x, w = b.input(), b.input()
    s = reduce_node(b, "sum", b.call("aten::mul", x, w), (-1,), True)
    m = reduce_node(b, "amax", x, (-1,), True)
    q = reduce_node(b, "mean", b.call("aten::mul", x, x), (-1,), True)
    y = b.call("aten::add", b.call("aten::sub", b.call("aten::mul", x, s), m, 1), q, 1)
    return b.build([y, s])


def _siblings_eager(x, w):
    s, m, q = (x * w).sum(-1, keepdim=True), x.amax(-1, keepdim=True), (x * x).mean(-1, keepdim=True)
    return [x * s - m + q, s]


def _chained() -> ir.Group:
    """softmax written out (the sum reads the max), a variance, a sum of x, a sum of x times the variance."""
    b = ir.Builder()
    x = b.input()
    m = reduce_node(b, "amax", x, (-1,), True)
    e = b.call("aten::exp", b.call("aten::sub", x, m, 1))
    s = reduce_node(b, "sum", e, (-1,), True)
    v = b.add("aten::var.correction", x, (-1,), 1, True)
    t = reduce_node(b, "sum", x, (-1,), True)
    u = reduce_node(b, "sum", b.call("aten::mul", x, v), (-1,), True)
    return b.build([b.call("aten::div", e, s), t, u])


def _kinds(sets) -> list:
    return [[n.op.split("::")[1].split(".")[0] for n in members] for members in sets]


def test_sibling_reductions_share_a_cuda_pass():
    g = _siblings()
    assert _kinds(reduction_passes(g, merge=True)) == [["sum", "amax", "mean"]]
    assert _kinds(reduction_passes(g, merge=False)) == [["sum"], ["amax"], ["mean"]]
    assert len(row_passes(g, merge=True)) == 2 and len(row_passes(g)) == 4  # (and the output pass)
    c = _chained()  # the sum reads the max; a variance keeps its passes; x * var's sum reads only what is done
    assert _kinds(reduction_passes(c, merge=True)) == [["amax"], ["sum"], ["var"], ["sum", "sum"]]
    assert len(row_passes(c, merge=True)) == 6


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("n", (1, 31, 1024, 4097, 65537))
def test_sibling_reductions_emulated_match_eager(n, dtype):
    """Held rows (1 to 4097 elements), and rows of 65537 (a cluster's in float32, read again in bfloat16): one pass
    accumulates the three sums: the source has one trip loop for them and one for the outputs."""
    g = _siblings()
    args = [torch.randn(5, n, dtype=dtype), torch.randn(n, dtype=dtype)]
    out = row_emulate.run(g, args)
    assert out is not None
    check_against_float64(out, _siblings_eager, args, TOL)
    spec = STORE.get(STORE.register(g))
    p = plan(spec, args, "cuda")
    source = row_launch.source_for(spec, p)[1]
    trips = source.count("for (int tb = ")
    assert trips == 2, (trips, p.key.shape)


def _norm_backward(n: int, dtype):
    """layer_norm(x) * w + b's backward as the executor forms it (statistics saved by the forward) with the
    weight's and bias's gradients summed in its row kernel: (the fused group's spec, its arguments)."""
    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    y = b.add("aten::layer_norm", x, (n,), None, None, 1e-5, True)
    spec = STORE.get(STORE.register(b.build([b.call("aten::add", b.call("aten::mul", y, w), c, 1)])))
    args = [torch.randn(37, n, dtype=dtype), 1 + 0.5 * torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)]
    sig = tuple((a.dtype, False) for a in args)
    save = backward.statistics(spec)
    bw = autodiff.backward_for(spec, (True,) * 3, (True,), sig, False, (), save)
    dtypes = autodiff._value_dtypes(spec, sig)
    reduced = frozenset(nd.out.id for nd in spec.group.nodes if ops.reduction(nd.op) is not None
                        and dtypes.get(nd.out.id) in (torch.float16, torch.bfloat16))
    outs = fallback.run(autodiff.extended_spec(spec, save, reduced), args)
    shapes = [a.shape for a in args]
    gy = torch.randn(37, n, dtype=dtype)
    bargs = autodiff.backward_args(spec, bw, args, [gy], shapes, dict(enumerate(outs)))
    fused = grad_sums.fused_for(bw, grad_sums.plan(spec, bw, shapes, args[0].shape, sig, bargs))
    return fused, bargs, args, gy


def test_repeated_steps_formed_once():
    """decompose.expand: a step that repeats an earlier one (same op and arguments, both steps of eager ops, whatever
    those ops) is read from the earlier one; an op of its own (rounded where a step is not), a step of aten::std
    (rooted in double on the CPU) and a repeat where both are outputs keep their nodes."""
    b = ir.Builder()
    x = b.input()
    with b.steps_of("aten::softmax"):
        e1 = b.call("aten::exp", x)
    with b.steps_of("autograd"):
        e2 = b.call("aten::exp", x)
        o1 = b.call("aten::neg", x)
        o2 = b.call("aten::neg", x)
    e3 = b.call("aten::exp", x)
    with b.steps_of("aten::std"):
        s1 = b.call("aten::sqrt", x)
    with b.steps_of("autograd"):
        s2 = b.call("aten::sqrt", x)
    g = b.build([b.call("aten::add", e1, e2, 1), e3, b.call("aten::mul", s1, s2), o1, o2])
    got = decompose.expand(g)
    count = lambda op: sum(n.op.startswith(op) for n in got.nodes)
    assert (count("aten::exp"), count("aten::sqrt"), count("aten::neg")) == (2, 2, 2), got.text()
    assert len({v.id for v in got.outputs}) == 5
    add = next(n for n in got.nodes if n.op.startswith("aten::add"))
    assert add.args[0].id == add.args[1].id
    args = [torch.randn(6, 5).abs()]
    torch.testing.assert_close(fallback.run(STORE.get(STORE.register(got)), args),
                               fallback.run(STORE.get(STORE.register(g)), args))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_norm_backward_holds_three_values(dtype):
    """layer_norm's backward row kernel: x - mean and its product with rstd formed once (the recomputed forward and
    the gradient's formula both form them), type_as(dy, y) reading only y's dtype and dy's cast formed again rather
    than held, so after the pass of its two sums a row holds three values an element (x-hat, dy, dy * w); those two
    sums are plain (a backward's means are not centered) and cross the block's barriers together."""
    fused, bargs, _, _ = _norm_backward(4096, dtype)
    p = plan(fused.spec, bargs, "cuda")
    g = row_launch.kernel_group(fused.spec, p)
    assert p.key.shape.held and [len(h) for h in held_values(g)] == [0, 3], held_values(g)
    assert not row_codegen.centered_means(g)
    source = row_launch.source_for(fused.spec, p)[1]
    assert source.count("fz_row_reduce2<fz_rsum") == 1 and "fz_row_reduce<" not in source.split("__global__")[1]


def test_forward_means_stay_centered():
    """A forward layer_norm's mean is centered (a row of equal values gives zeros, as eager's Welford does)."""
    b = ir.Builder()
    x = b.input()
    g = decompose.expand(b.build([b.add("aten::layer_norm", x, (8,), None, None, 1e-5, True)]))
    assert len(row_codegen.centered_means(g)) == 1


@pytest.mark.parametrize("shared", (True, False), ids=("shared", "registers"))
@pytest.mark.parametrize("dtype,n", [(torch.float32, 1024), (torch.bfloat16, 4096), (torch.float64, 96),
                                     (torch.bfloat16, 33)], ids=str)
def test_column_sums_in_shared_memory_or_registers(dtype, n, shared, monkeypatch):
    """The backward's row kernel with its two column sums (the weight's and the bias's gradients) in shared memory
    (each thread's slots, a vector at a time) or in registers (SUMS_SHARED_BYTES 0), through the emulation:
    x's gradient and the two sums against eager's float64 autograd."""
    if not shared:
        monkeypatch.setattr(importlib.import_module("fuser.rows.shape"), "SUMS_SHARED_BYTES", 0)
    fused, bargs, args, gy = _norm_backward(n, dtype)
    p = plan(fused.spec, bargs, "cuda")
    assert not isinstance(p, str), p
    assert p.key.shape.sums_shared == shared and len(p.key.sums) == 2
    got = row_emulate.run(fused.spec.group, bargs)
    assert got is not None
    x64, w64, c64 = (a.double().requires_grad_() for a in args)
    (torch.layer_norm(x64, (n,), None, None, 1e-5) * w64 + c64).backward(gy.double())
    want = {"x": x64.grad, "w": w64.grad, "b": c64.grad}
    outs = {"x": got[fused.whole[0]]} if fused.whole[0] is not None else {}
    for k, name in ((1, "w"), (2, "b")):
        if fused.summed[k] is not None:
            outs[name] = got[fused.summed[k]].reshape(n)
    assert set(outs) == {"x", "w", "b"}, fused
    tol = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 5e-2}[dtype]
    for name, o in outs.items():
        scale = max(1.0, want[name].abs().max().item())
        torch.testing.assert_close(o.double(), want[name], rtol=tol, atol=tol * scale, msg=name)


def test_shared_sums_only_where_they_fit(monkeypatch):
    """A float64 row of 2048 held by 256 threads: two double sums of 16 KB each a block, in shared memory within
    SUMS_SHARED_BYTES, in registers below 32 KB."""
    fused, bargs, _, _ = _norm_backward(2048, torch.float64)
    p = plan(fused.spec, bargs, "cuda")
    assert p.key.shape.held and p.key.shape.sums_shared
    assert p.key.shape.block * p.key.shape.items * 2 * 8 == 32 * 1024
    monkeypatch.setattr(importlib.import_module("fuser.rows.shape"), "SUMS_SHARED_BYTES", 32 * 1024 - 1)
    fused, bargs, _, _ = _norm_backward(2048, torch.float64)
    p = plan(fused.spec, bargs, "cuda")
    assert isinstance(p, str) or not p.key.shape.sums_shared


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("n", (31, 1024, 4097, 65537))
def test_sibling_reductions_on_the_gpu(n, dtype):
    spec = STORE.get(STORE.register(_siblings()))
    args = [torch.randn(300, n, dtype=dtype, device="cuda"), torch.randn(n, dtype=dtype, device="cuda")]
    out = fused_run(spec, args)
    check_against_float64([o.cpu() for o in out], _siblings_eager, [a.cpu() for a in args], TOL)
