"""The FusionDefinition frontend (fuser/frontend/): nvFuser-style definitions against eager PyTorch on fresh seeded
inputs, on the CPU backend (CUDA twins marked gpu), the definition cache (the same definition written twice
compiles once), repro scripts re-run in a fresh process, and the errors the frontend promises."""
import functools
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fuser
from fuser.frontend import DataType, FusionCache, FusionDefinition, FusionManager

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.bool: 0,
       torch.int64: 0, torch.int32: 0}


def close(outs, refs):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        assert o.shape == r.shape and o.device == r.device
        tol = TOL[r.dtype]
        torch.testing.assert_close(o, r, rtol=tol, atol=tol, equal_nan=True)


# ---- the issue's example, with only the import changed ------------------------------------------------------
ISSUE_EXAMPLE = '''
import torch
from fuser.frontend import FusionDefinition, FusionManager, DataType
fm = FusionManager.get()                 # the legacy API: one global manager
with FusionDefinition(fm) as fd:
    t0 = fd.define_tensor(symbolic_sizes=[-1, 1, -1], contiguous=[True, True, True], dtype=DataType.Float)
    t1 = fd.define_tensor(3)
    c0 = fd.define_constant(3.0)
    t2 = fd.ops.add(t0, t1)
    t3 = fd.ops.mul(t2, c0)
    t4 = fd.ops.sum(t3, [-1], False, DataType.Float)
    fd.add_output(t4)
out = fm.execute([torch.ones(2, 1, 8, device="cuda"), torch.ones(2, 4, 8, device="cuda")])[0]
'''


@pytest.mark.parametrize("device", DEVICES)
def test_the_issue_example_runs_with_only_the_import_changed(device):
    # on the CPU backend the example's "cuda" tensors are made on the CPU (the only other change)
    env = {}
    exec(ISSUE_EXAMPLE.replace('device="cuda"', f'device="{device}"'), env)
    ref = ((torch.ones(2, 1, 8) + torch.ones(2, 4, 8)) * 3.0).sum(-1, dtype=torch.float32)
    close([env["out"].cpu()], [ref])
    out = FusionManager.get().execute([x := torch.randn(2, 1, 8, device=device), y := torch.randn(2, 4, 8, device=device)])
    close(out, [((x + y) * 3.0).sum(-1)])


def test_both_spellings_give_one_cached_fusion():
    with FusionDefinition(FusionManager.get()) as legacy:
        t0 = legacy.define_tensor(symbolic_sizes=[-1, 1, -1], contiguous=[True, True, True], dtype=DataType.Float)
        t1 = legacy.define_tensor(3)
        t2 = legacy.ops.mul(legacy.ops.add(t0, t1), legacy.define_constant(3.0))
        legacy.add_output(legacy.ops.sum(t2, [-1], False, DataType.Float))
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, 1, -1], contiguity=[True, None, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1, -1, -1], contiguity=False, dtype=DataType.Float)
        t2 = fd.ops.mul(fd.ops.add(t0, t1), fd.define_scalar(3.0))
        fd.add_output(fd.ops.sum(t2, dims=[-1], keepdim=False, dtype=DataType.Float))
    assert fd.id() == legacy.id() is not None
    assert repr(fd) == repr(legacy)


# ---- examples in nvFuser's style ----------------------------------------------------------------------------
EXAMPLES = {}


def example(fused: bool):
    """An example: (define(fd, inputs), inputs(device), eager(*inputs) -> list). ``fused``: whether it runs as a
    compiled kernel today (a reduction fuses when every reduction of the group reduces the same trailing dims:
    fuser/rows/; the other forms run through the fallback: issue 12)."""
    def deco(f):
        EXAMPLES[f.__name__] = (f, fused)
        return f
    return deco


def _rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


@example(fused=True)
def pointwise_chain():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        t2 = fd.ops.add(t0, t1)
        t3 = fd.ops.mul(fd.ops.sigmoid(t2), fd.ops.tanh(t0))
        t4 = fd.ops.sub(fd.ops.exp(fd.ops.neg(fd.ops.abs(t3))), 0.25)
        fd.add_output(t4)
        fd.add_output(t2)
    return define, lambda d: [_rand(5, 33, device=d), _rand(33, device=d)], \
        lambda x, b: [torch.exp(-(torch.sigmoid(x + b) * torch.tanh(x)).abs()) - 0.25, x + b]


@example(fused=True)
def basic_fp16():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Half)
        t1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Half)
        t2 = fd.ops.mul(fd.ops.add(t0, t1), fd.define_scalar(3.0))
        fd.add_output(fd.ops.cast(t2, DataType.Half))
        fd.add_output(t2)  # nvFuser computes and returns half math in float
    return define, lambda d: [_rand(7, 16, dtype=torch.half, device=d), _rand(7, 16, dtype=torch.half, device=d)], \
        lambda x, y: [((x.float() + y.float()) * 3.0).half(), (x.float() + y.float()) * 3.0]


@example(fused=True)
def cast_double_to_half():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
        t1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
        t2 = fd.ops.add(fd.ops.cast(t0, DataType.Half), fd.ops.cast(t1, DataType.Half))
        fd.add_output(fd.ops.cast(fd.ops.relu(t2), DataType.Half))
    return define, lambda d: [_rand(4, 9, dtype=torch.double, device=d), _rand(4, 9, dtype=torch.double, device=d)], \
        lambda x, y: [torch.relu(x.half().float() + y.half().float()).half()]


@example(fused=True)
def promote_to_double():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Half)
        t1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
        fd.add_output(fd.ops.relu(fd.ops.add(t0, t1)))
    return define, lambda d: [_rand(3, 8, dtype=torch.half, device=d), _rand(3, 8, dtype=torch.double, device=d)], \
        lambda x, y: [torch.relu(x + y)]


@example(fused=True)
def broadcast_in_dim_of_an_input():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        t1b = fd.ops.broadcast_in_dim(t1, shape=list(x[0].shape), broadcast_dims=[0])  # a column
        fd.add_output(fd.ops.mul(t0, t1b))
    return define, lambda d: [_rand(6, 10, device=d), _rand(6, device=d)], lambda x, c: [x * c[:, None]]


@example(fused=True)
def broadcast_in_dim_of_an_intermediate():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        t2 = fd.ops.sigmoid(fd.ops.add(t1, 1.5))  # [A, C]
        t3 = fd.ops.broadcast_in_dim(t2, shape=list(x[0].shape), broadcast_dims=[0, 2])
        fd.add_output(fd.ops.sub(t0, t3))
        fd.add_output(t3)  # the broadcast value itself, at its full shape
    return define, lambda d: [_rand(3, 4, 5, device=d), _rand(3, 5, device=d)], \
        lambda x, y: [x - torch.sigmoid(y + 1.5)[:, None, :], torch.sigmoid(y + 1.5)[:, None, :].expand(3, 4, 5)]


@example(fused=True)
def broadcast_and_expand():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        t2 = fd.ops.expand(t0, shape=[-1, 7])
        t3 = fd.ops.broadcast(t1, [True, False])  # [1, N]
        fd.add_output(fd.ops.add(t2, t3))
        fd.add_output(fd.ops.mul(t2, 2.0))
    return define, lambda d: [_rand(7, 1, device=d), _rand(7, device=d)], \
        lambda a, b: [a.expand(7, 7) + b[None, :], a.expand(7, 7) * 2.0]


@example(fused=True)
def where_and_comparisons():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        c = fd.ops.gt(t0, 0.0)
        fd.add_output(fd.ops.where(c, t0, t1))
        fd.add_output(fd.ops.cast(fd.ops.le(t0, t1), DataType.Float))
        fd.add_output(fd.ops.ne(t0, t1))
    return define, lambda d: [_rand(5, 6, device=d), _rand(5, 6, device=d)], \
        lambda a, b: [torch.where(a > 0, a, b), (a <= b).float(), a != b]


@example(fused=True)
def where_scalar_dtypes():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Bool)
        fd.add_output(fd.ops.where(t0, 0.1, 5.0))  # Double constants: a float64 result, as nvFuser
        fd.add_output(fd.ops.where(t0, fd.define_scalar(0.1, dtype=DataType.Float),
                                   fd.define_scalar(5.0, dtype=DataType.Float)))
        fd.add_output(fd.ops.where(t0, 3, 4))
    return define, lambda d: [torch.rand(9, device=d) > 0.5], lambda c: [
        torch.where(c, torch.tensor(0.1, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64)).to(c.device),
        torch.where(c, 0.1, 5.0), torch.where(c, 3, 4)]


@example(fused=True)
def int_tensor_times_double_scalar():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Int)
        fd.add_output(fd.ops.mul(t0, 2.5))  # nvFuser: Double
        fd.add_output(fd.ops.add(t0, 3))  # stays Int
        fd.add_output(fd.ops.exp(fd.ops.cast(t0, DataType.Float)))
    return define, lambda d: [torch.randint(-5, 6, (11,), device=d)], \
        lambda a: [a.double() * 2.5, a + 3, torch.exp(a.float())]


@example(fused=True)
def sum_of_squares_over_the_last_dim():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        t1 = fd.ops.mul(t0, t0)
        fd.add_output(fd.ops.sum(t1, dims=[-1], keepdim=False, dtype=DataType.Float))
    return define, lambda d: [_rand(9, 130, device=d)], lambda a: [(a * a).sum(-1)]


@example(fused=False)
def integer_division():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Int)
        t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Int)
        fd.add_output(fd.ops.div(t0, t1))  # truncates, as nvFuser
        fd.add_output(fd.ops.truediv(t0, t1))
    return define, lambda d: [torch.randint(-20, 21, (13,), device=d), torch.randint(1, 6, (13,), device=d)], \
        lambda a, b: [torch.div(a, b, rounding_mode="trunc"), torch.true_divide(a, b)]


@example(fused=True)
def activations_from_the_op_table():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        fd.add_output(fd.ops.gelu(t0, approximate="tanh"))
        fd.add_output(fd.ops.leaky_relu(t0, 0.2))
        fd.add_output(fd.ops.clamp(fd.ops.silu(t0), -0.5, 0.75))
        fd.add_output(fd.ops.threshold(t0, 0.1, 20.0))
        fd.add_output(fd.ops.hardtanh(t0, min_val=-0.3, max_val=0.4))
    return define, lambda d: [_rand(8, 16, device=d)], lambda x: [
        torch.nn.functional.gelu(x, approximate="tanh"), torch.nn.functional.leaky_relu(x, 0.2),
        torch.clamp(torch.nn.functional.silu(x), -0.5, 0.75), torch.threshold(x, 0.1, 20.0),
        torch.nn.functional.hardtanh(x, -0.3, 0.4)]


@example(fused=True)
def lerp_addcmul_pow():
    def define(fd, x):
        a, b, c = (fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float) for _ in range(3))
        fd.add_output(fd.ops.lerp(a, b, 0.3))
        fd.add_output(fd.ops.addcmul(a, b, c, 0.5))
        fd.add_output(fd.ops.pow(fd.ops.abs(a), 1.5))
        fd.add_output(2.0 - a * b / c)
    return define, lambda d: [_rand(4, 5, device=d) for _ in range(3)], lambda a, b, c: [
        torch.lerp(a, b, 0.3), torch.addcmul(a, b, c, value=0.5), a.abs() ** 1.5, 2.0 - a * b / c]


@example(fused=True)
def bfloat16_chain():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
        t1 = fd.define_tensor(shape=[1, -1], contiguity=[None, True], dtype=DataType.BFloat16)
        t2 = fd.ops.mul(fd.ops.tanh(t0), t1)
        fd.add_output(fd.ops.cast(t2, DataType.BFloat16))
    return define, lambda d: [_rand(6, 32, dtype=torch.bfloat16, device=d), _rand(1, 32, dtype=torch.bfloat16, device=d)], \
        lambda x, y: [(torch.tanh(x.float()) * y.float()).bfloat16()]


@example(fused=True)
def symbolic_scalar_input():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        s0 = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.add(fd.ops.mul(t0, s0), s0))
    return define, lambda d: [_rand(3, 7, device=d), 0.625], lambda x, s: [x * s + s]


@example(fused=True)
def strided_inputs():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[False, False], dtype=DataType.Float)
        t1 = fd.from_pytorch(x[1])
        fd.add_output(fd.ops.add(fd.ops.relu(t0), t1))
    return define, lambda d: [_rand(9, 6, device=d).t(), _rand(6, 9, device=d)], lambda a, b: [torch.relu(a) + b]


@example(fused=False)
def sum_keepdim_and_dtype():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=DataType.Half)
        fd.add_output(fd.ops.sum(t0, dims=[0, 2], keepdim=True, dtype=DataType.Float))
        fd.add_output(fd.ops.sum(t0, dims=[-1], keepdim=False, dtype=DataType.Double))
        fd.add_output(fd.ops.sum(fd.ops.relu(t0), 1))
    return define, lambda d: [_rand(3, 4, 5, dtype=torch.half, device=d)], lambda x: [
        x.sum([0, 2], keepdim=True, dtype=torch.float32), x.sum(-1, dtype=torch.float64), torch.relu(x.float()).sum(1)]


@example(fused=False)
def mean_amax_amin():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        fd.add_output(fd.ops.mean(t0, dims=[1]))
        fd.add_output(fd.ops.amax(t0, dims=[0], keepdim=True))
        fd.add_output(fd.ops.amin(fd.ops.mul(t0, 2.0), dims=[0, 1]))
    return define, lambda d: [_rand(6, 10, device=d)], lambda x: [
        x.mean(1), x.amax(0, keepdim=True), (x * 2.0).amin([0, 1])]


@example(fused=False)
def var_and_var_mean():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
        fd.add_output(fd.ops.var(t0, dims=[1], correction=0))
        v, m = fd.ops.var_mean(t0, dims=[0], correction=1, keepdim=True)
        fd.add_output(v)
        fd.add_output(m)
    return define, lambda d: [_rand(5, 8, dtype=torch.double, device=d)], lambda x: [
        x.var(1, correction=0), *torch.var_mean(x, 0, correction=1, keepdim=True)]


@example(fused=False)
def layer_norm_written_out():
    def define(fd, x):
        n, h = x[0].shape
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        var, mean = fd.ops.var_mean(t0, dims=[1], correction=0, keepdim=False)
        mean_b = fd.ops.broadcast_in_dim(mean, shape=[n, h], broadcast_dims=[0])
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        rstd_b = fd.ops.broadcast_in_dim(rstd, shape=t0.shape(), broadcast_dims=[0])
        y = fd.ops.mul(fd.ops.sub(t0, mean_b), rstd_b)
        fd.add_output(fd.ops.add(fd.ops.mul(y, w), b))
        fd.add_output(rstd_b)  # a reduction's broadcast as an output: its full shape
    return define, lambda d: [_rand(6, 32, device=d), _rand(32, device=d), _rand(32, device=d)], lambda x, w, b: [
        torch.nn.functional.layer_norm(x, (32,), w, b, 1e-5),
        torch.rsqrt(x.var(1, correction=0) + 1e-5)[:, None].expand(6, 32)]


@example(fused=False)
def softmax_written_out():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Half)
        t1 = fd.ops.cast(t0, DataType.Float)
        mx = fd.ops.broadcast_in_dim(fd.ops.amax(t1, dims=[1]), shape=t1.shape(), broadcast_dims=[0])
        e = fd.ops.exp(fd.ops.sub(t1, mx))
        s = fd.ops.broadcast_in_dim(fd.ops.sum(e, dims=[1]), shape=t1.shape(), broadcast_dims=[0])
        fd.add_output(fd.ops.cast(fd.ops.div(e, s), DataType.Half))
    return define, lambda d: [_rand(4, 50, dtype=torch.half, device=d)], \
        lambda x: [torch.softmax(x.float(), 1).half()]


@example(fused=True)
def legacy_ranks_and_constants():
    def define(fd, x):
        t0 = fd.define_tensor(2)
        t1 = fd.define_tensor(1, DataType.Double)
        c = fd.define_constant(2)
        fd.add_output(fd.ops.sub(fd.ops.mul(t0, c), t1))
    return define, lambda d: [_rand(3, 4, device=d), _rand(4, dtype=torch.double, device=d)], \
        lambda x, y: [x * 2 - y]


@example(fused=True)
def broadcast_outputs_and_folded_constants():
    def define(fd, x):
        t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        fd.add_output(fd.ops.broadcast(t1, [True, False]))  # an input's view as an output: [1, N]
        fd.add_output(fd.ops.add(fd.ops.broadcast(t1, [True, False]), fd.ops.div(7, -2)))  # constants fold: -3
    return define, lambda d: [_rand(5, device=d)], lambda x: [x[None].clone(), x[None] + (-3)]


@example(fused=False)
def reductions_of_broadcasts_and_rebroadcasts():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        x0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        y0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        t2 = fd.ops.broadcast_in_dim(t0, [4, 5], [1])
        fd.add_output(fd.ops.sum(t2, [0]))  # over a broadcast (stride-0) dim: 4 * t0
        sb = fd.ops.broadcast_in_dim(fd.ops.sum(x0, [0]), y0.shape(), [0])  # re-broadcast at another dim
        fd.add_output(fd.ops.add(sb, y0))
    return define, lambda d: [_rand(5, device=d), _rand(3, 4, device=d), _rand(4, 6, device=d)], \
        lambda t, x, y: [t.expand(4, 5).sum(0), x.sum(0)[:, None] + y]


@example(fused=False)
def logical_bitwise_and_alpha_ops():
    def define(fd, x):
        t0 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Int32)
        nan = fd.ops.isnan(fd.ops.log(t0))
        fd.add_output(fd.ops.logical_and(nan, fd.ops.logical_not(fd.ops.isinf(t0))))
        fd.add_output(fd.ops.bitwise_xor(t1, 5))
        fd.add_output(fd.ops.sign(t0))
        fd.add_output(fd.ops.add_alpha(t0, t0, 2.0))
    return define, lambda d: [_rand(12, device=d), torch.randint(-9, 10, (12,), dtype=torch.int32, device=d)], \
        lambda x, i: [torch.isnan(torch.log(x)) & ~torch.isinf(x), i ^ 5, torch.sign(x), torch.add(x, x, alpha=2.0)]


def _run_example(name, device):
    build, fused = EXAMPLES[name]
    define, make, eager = build()
    inputs = make(device)
    with FusionDefinition() as fd:
        define(fd, inputs)
    outs = fd.execute(inputs)
    close(outs, eager(*inputs))
    return fd, inputs, fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_matches_eager(name, device):
    fd, inputs, fused = _run_example(name, device)
    assert fd.last_run_fused() is fused, fd.fusion_ir()
    if fused:
        assert "extern" in fd.last_cuda_code()
    else:
        with pytest.raises(RuntimeError, match="fallback"):
            fd.last_cuda_code()
    # fresh values through the same fusion (the checked input signature is reused)
    again = EXAMPLES[name][0]()[1](device)
    close(fd.execute(again), EXAMPLES[name][0]()[2](*again))


def test_there_are_twenty_examples():
    assert len(EXAMPLES) >= 20


# ---- caching ------------------------------------------------------------------------------------------------
def _def_a():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        y = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        fd.add_output(fd.ops.tanh(fd.ops.mul(fd.ops.add(x, y), 0.375)))
    return fd


def _def_b():  # the same definition, written again with other names
    with FusionDefinition() as other:
        a = other.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        b = other.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        s = other.ops.add(a, b)
        other.add_output(other.ops.tanh(other.ops.mul(s, 0.375)))
    return other


def test_the_same_definition_written_twice_compiles_once():
    x, y = torch.randn(4, 9), torch.randn(9)
    hits, misses = FusionCache.hits, FusionCache.misses
    fa = _def_a()
    out_a = fa.execute([x, y])
    compiled = fuser.n_compiled_kernels()
    fb = _def_b()
    out_b = fb.execute([x, y])
    assert fb.id() == fa.id()
    assert FusionCache.hits == hits + 1 and FusionCache.misses in (misses, misses + 1)
    assert fuser.n_compiled_kernels() == compiled  # nothing compiled for the second definition
    assert fa.last_run_fused() and fb.last_run_fused()
    close(out_b, out_a)
    close(out_a, [torch.tanh((x + y) * 0.375)])


def test_constants_are_part_of_a_records_identity():
    ids = []
    for c in (2, 2.0, 3.0, -0.0, 0.0, float("nan")):
        with FusionDefinition() as fd:
            t = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
            fd.add_output(fd.ops.mul(t, c))
        ids.append(fd.id())
    assert len(set(ids)) == len(ids)
    with FusionDefinition() as fd:  # NaN equals NaN: a hit
        t = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(t, float("nan")))
    assert fd.id() == ids[-1]
    rebound = FusionDefinition(ids[2])
    x = torch.randn(5)
    close(rebound.execute([x]), [x * 3.0])


# ---- repros -------------------------------------------------------------------------------------------------
def test_repro_scripts_rerun_in_a_fresh_process_give_equal_outputs(tmp_path):
    runs = []
    for name in sorted(EXAMPLES):
        fd, inputs, _ = _run_example(name, "cpu")
        outs = fd.execute(inputs)
        script = tmp_path / f"{name}.py"
        script.write_text(fd.repro_script_for(inputs))
        torch.save(inputs, tmp_path / f"{name}_in.pt")
        runs.append((name, outs))
    # one fresh process runs every script on its saved inputs (none of these fusions exists there before)
    driver = ("import runpy, sys\n"
              f"for name in {[n for n, _ in runs]!r}:\n"
              f"    d = {str(tmp_path)!r}\n"
              "    sys.argv = ['repro', f'{d}/{name}_in.pt', f'{d}/{name}_out.pt']\n"
              "    runpy.run_path(f'{d}/{name}.py', run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, outs in runs:
        got = torch.load(tmp_path / f"{name}_out.pt")
        assert len(got) == len(outs)
        for g, o in zip(got, outs):
            assert g.dtype == o.dtype and g.shape == o.shape
            assert torch.equal(g, o) or torch.allclose(g, o, equal_nan=True, rtol=0, atol=0), name


def test_a_repro_script_runs_standalone_on_random_inputs_like_the_given_ones(tmp_path):
    fd, inputs, _ = _run_example("strided_inputs", "cpu")
    text = fd.repro_script_for(inputs)
    assert "as_strided((6, 9), (1, 6))" in text and "torch.float32" in text and "'cpu'" in text
    (tmp_path / "r.py").write_text(text)
    proc = subprocess.run([sys.executable, str(tmp_path / "r.py")], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tensor(" in proc.stdout


def test_print_and_the_dump_variable_give_a_runnable_definition(monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_NVFUSER_DUMP", "python_definition")
    fd = _def_a()
    dumped = capsys.readouterr().out
    assert dumped.strip() == repr(fd).strip()
    assert dumped.startswith(f"def nvfuser_fusion_id{fd.id()}(fd : FusionDefinition) -> None :")
    assert "T3 = fd.ops.mul(T2, 0.375)" in dumped
    env = {}
    exec(repr(fd), {"FusionDefinition": FusionDefinition, "DataType": DataType}, env)
    with FusionDefinition() as again:
        env[f"nvfuser_fusion_id{fd.id()}"](again)
    assert again.id() == fd.id()


def test_print_ir_and_help_list_the_ops(capsys):
    with FusionDefinition(FusionManager.get()) as fd:
        t = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(t))
    FusionManager.print_ir()
    out = capsys.readouterr().out
    assert "aten::exp" in out and "fd.ops.exp(T0)" in out
    text = pydoc.render_doc(FusionDefinition.Operators, renderer=pydoc.plaintext)
    for op in ("sum", "var_mean", "broadcast_in_dim", "cast", "where", "gelu", "uniform", "rand_like", "lt", "add"):
        assert f"{op}(" in text, op
    assert all(getattr(FusionDefinition.Operators, n).__doc__ for n in dir(FusionDefinition.Operators)
               if not n.startswith("_"))


# ---- random numbers -----------------------------------------------------------------------------------------
def test_rand_like_and_uniform():
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        fd.add_output(fd.ops.add(fd.ops.rand_like(t), t))
    x = torch.zeros(50, 40)
    r, = fd.execute([x])
    assert fd.last_run_fused()
    with FusionDefinition() as fu:
        t = fu.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        fu.add_output(fu.ops.uniform(-2.0, 3.0, t.shape(), dtype=DataType.Double))
    u, = fu.execute([x])
    assert fu.last_run_fused()
    assert r.shape == x.shape and u.shape == x.shape and u.dtype == torch.float64
    assert 0 <= r.min() and r.max() < 1 and -2 <= u.min() and u.max() < 3
    assert abs(r.mean().item() - 0.5) < 0.05 and abs(u.mean().item() - 0.5) < 0.1
    r2, = fd.execute([x])
    assert not torch.equal(r, r2)
    # outputs of two shapes are not one kernel's map: the fallback runs the group (honestly reported)
    with FusionDefinition() as both:
        t = both.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        both.add_output(both.ops.rand_like(t))
        both.add_output(both.ops.uniform(0.0, 1.0, [64, 128], dtype=DataType.Float))
    a, b = both.execute([x])
    assert a.shape == x.shape and b.shape == (64, 128) and 0 <= b.min() and b.max() < 1
    assert both.last_run_fused() is False


# ---- errors -------------------------------------------------------------------------------------------------
def _simple():
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, 1, 4], contiguity=[True, None, True], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=DataType.Float)
        fd.add_output(fd.ops.add(t0, t1))
    return fd


@pytest.mark.parametrize("inputs, match", [
    (lambda: [torch.randn(2, 1, 4)], "has 2 inputs"),
    (lambda: [torch.randn(2, 4), torch.randn(2, 3, 4)], "T0 has rank 2"),
    (lambda: [torch.randn(2, 1, 4, dtype=torch.double), torch.randn(2, 3, 4)], "T0 has dtype torch.float64"),
    (lambda: [torch.randn(2, 3, 4), torch.randn(2, 3, 4)], "T0 dim 1 has size 3.*broadcast dim"),
    (lambda: [torch.randn(2, 1, 5), torch.randn(2, 3, 5)], "T0 dim 2 has size 5.*size 4"),
    (lambda: [torch.randn(2, 1, 4), torch.randn(2, 3, 4, device="meta")], "T1 is on meta.*one device"),
    (lambda: [torch.randn(2, 1, 4), torch.randn(2, 4, 3).transpose(1, 2)], "T1 has strides"),
    (lambda: [torch.randn(2, 1, 4), torch.randn(3, 3, 4)], "equal sizes"),
    (lambda: [2.0, torch.randn(2, 3, 4)], "T0 must be a tensor"),
])
def test_execute_names_the_input_that_does_not_match(inputs, match):
    fd = _simple()
    with pytest.raises(ValueError, match=match):
        fd.execute(inputs())
    x, y = torch.randn(2, 1, 4), torch.randn(2, 3, 4)
    close(fd.execute([x, y]), [x + y])  # the fusion is intact


def test_scalar_inputs_are_checked():
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        s = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(t, s))
    with pytest.raises(ValueError, match="S1 must be a Python number"):
        fd.execute([torch.randn(3), torch.randn(3)])
    with pytest.raises(ValueError, match="S1 must be a Python number of DataType.Double"):
        fd.execute([torch.randn(3), 1j])


def _definition_error(build, exc, match):
    _def_a_tensor()  # defined (and cached) before counting
    n = FusionCache.num_fusions()
    fd = FusionDefinition()
    with pytest.raises(exc, match=match):
        with fd:
            build(fd)
    assert FusionCache.num_fusions() == n and fd.id() is None  # nothing cached, nothing half-built
    with pytest.raises(NotImplementedError):
        fd.execute([])


def _t(fd, shape, dtype=DataType.Float):
    return fd.define_tensor(shape=shape, contiguity=[True if s != 1 else None for s in shape], dtype=dtype)


@pytest.mark.parametrize("build, exc, match", [
    (lambda fd: fd.ops.where(_t(fd, [-1]), _t(fd, [-1]), 1.0), TypeError, "condition must be a Bool tensor"),
    (lambda fd: fd.ops.add(_t(fd, [2, 3]), _t(fd, [4, 3])), ValueError, "cannot broadcast T0 .* with T1"),
    (lambda fd: fd.ops.broadcast_in_dim(_t(fd, [-1, -1]), [3, 4, 5], [0]), ValueError, "broadcast_dims has 1"),
    (lambda fd: fd.ops.broadcast_in_dim(_t(fd, [-1, -1]), [3, 4, 5], [2, 1]), ValueError, "strictly increasing"),
    (lambda fd: fd.ops.broadcast_in_dim(_t(fd, [2]), [3, 4], [1]), ValueError, "size 2 and cannot broadcast"),
    (lambda fd: fd.ops.sum(_t(fd, [-1, -1]), dims=[2]), IndexError, "out of range for T0"),
    (lambda fd: fd.ops.mean(_t(fd, [-1], DataType.Int), dims=[0]), TypeError, "T0 .* must be a floating-point"),
    (lambda fd: fd.ops.exp(_t(fd, [-1], DataType.Bool)) and fd.ops.gcd, NotImplementedError, "does not support"),
    (lambda fd: fd.ops.no_such_op, AttributeError, "no op 'no_such_op'"),
    (lambda fd: fd.add_output(_def_a_tensor()), ValueError, "never defined in this definition"),
    (lambda fd: _t(fd, [-1]), RuntimeError, "no outputs"),
    (lambda fd: fd.add_output(fd.define_scalar(1.0)), TypeError, "Scalar"),
    (lambda fd: fd.define_tensor(shape=[-1, -2]), ValueError, "value -2 at index 1"),
    (lambda fd: fd.add_output(fd.ops.broadcast_in_dim(fd.ops.rand_like(_t(fd, [-1])), [3, 4], [1])),
     NotImplementedError, "broadcast random"),
    (lambda fd: fd.add_output(fd.ops.cat), NotImplementedError, "fd.ops.cat is an nvFuser op"),
])
def test_definition_errors_name_the_argument_and_cache_nothing(build, exc, match):
    _definition_error(lambda fd: build(fd), exc, match)


@functools.lru_cache(maxsize=None)
def _def_a_tensor():
    with FusionDefinition() as other:
        t = other.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        other.add_output(t)
    return t


def test_an_error_inside_a_definition_leaves_the_next_one_intact():
    fd = FusionDefinition()
    with pytest.raises(ValueError):
        with fd:
            t = fd.define_tensor(shape=[2], contiguity=[True], dtype=DataType.Float)
            fd.ops.add(t, fd.define_tensor(shape=[3], contiguity=[True], dtype=DataType.Float))
    with fd:  # the same object, defined again
        t = fd.define_tensor(shape=[2], contiguity=[True], dtype=DataType.Float)
        fd.add_output(fd.ops.add(t, 1.0))
    x = torch.randn(2)
    close(fd.execute([x]), [x + 1.0])
    with pytest.raises(RuntimeError, match="completed definition"):
        fd.ops.add(t, 1.0)


def test_inputs_that_require_grad_get_eagers_gradients():
    fd = _def_a()
    x = torch.randn(3, 4, dtype=torch.float32, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    out, = fd.execute([x, y])
    ref = torch.tanh((x + y) * 0.375)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, y), g), torch.autograd.grad(ref, (x, y), g)):
        torch.testing.assert_close(a, b)
