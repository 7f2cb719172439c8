"""A float16/bfloat16 value that a group computes and reduces (``x / y - sum(x / y, -1, keepdim=True)``, the CUDA
differential fuzzer's case) is rounded to its dtype where it is computed, as eager stores it
(``fuser.rows.codegen.analysis.rounded_operands``): the kernel held ``x / y`` unrounded in float beside its rounded sum,
and over a one-element row gave the rounding error of ``x / y`` (1.98) where eager and the float64 truth give 0. On the
CPU backend and through the CUDA host emulation, the row kernel (dim -1, rows of 1, 37 and 1024), in float16 and
bfloat16. The column kernel keeps such a value in float: it takes a per-element use of its own sum only over columns
of one row, and rounding each element cost ``(x * y).sum(0)`` in bfloat16 a third of its speed (H200, [16384 x 4096],
64 -> 86 us)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same, fused_run
from fuser import ir, rows
from fuser.kernel_cache import STORE
from fuser.rows import codegen, decompose
from fuser.rows import emulate as row_emulate

DTYPES = (torch.float16, torch.bfloat16)


def _group(op: str, dim: int) -> ir.Group:
    """``v - sum(v, dim, keepdim=True)`` with ``v = op(x, y)``."""
    b = ir.Builder()
    x, y = b.input(), b.input()
    v = b.call(op, x, y)
    return b.build([b.call("aten::sub", v, b.add("aten::sum.dim_IntList", v, (dim,), True, None), 1)])


def _eager(op: str, dim: int, x, y) -> torch.Tensor:
    v = x / y if op == "aten::div" else x * y
    return v - v.sum(dim, keepdim=True)


def _inputs(dtype, shape):
    gen = torch.Generator().manual_seed(7)
    x = 8 * torch.randn(*shape, generator=gen).to(dtype)
    y = (torch.rand(*shape, generator=gen) * 0.9 + 0.1).to(dtype)  # away from 0: x / y in range
    return [x, y]


# (op, dim, shape, plan): the row kernel over rows of 1, 37, 1024; the column kernel over one row
SHAPES = [("aten::div", -1, (5, 1), rows.RowPlan), ("aten::div", -1, (5, 37), rows.RowPlan),
          ("aten::div", -1, (3, 1024), rows.RowPlan)]
IDS = ["row-1", "row-37", "row-1024"]
RUNNERS = [pytest.param("cpu", id="cpu"), pytest.param("emulated", id="emulated")]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("op,dim,shape,plan", SHAPES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_reduced_value_is_rounded_as_eager_stores_it(runner, op, dim, shape, plan, dtype):
    g = _group(op, dim)
    args = _inputs(dtype, shape)
    spec = STORE.get(STORE.register(g))
    assert isinstance(rows.plan(spec, args, "cuda" if runner == "emulated" else None), plan)
    out = fused_run(spec, args) if runner == "cpu" else row_emulate.run(g, args)
    assert out is not None
    want = _eager(op, dim, *args)
    if shape[dim] == 1:  # r - sum(r) over one element: exactly eager's 0
        assert want.eq(0).all()
        assert torch.equal(out[0], want), (out[0] - want).abs().max()
    else:
        assert_same(out[0], want)


def test_a_composites_steps_stay_in_float():
    """The steps of softmax and layer_norm (``n.origin``: eager's one kernel holds them in float) are no reduction's
    operand to round; the product that the user's own sum reduces is."""
    b = ir.Builder()
    x, y, w = b.input(), b.input(), b.input()
    p = b.call("aten::mul", x, y)
    g = b.build([b.add("aten::softmax.int", p, -1, None), b.add("aten::layer_norm", p, (8,), w, w, 1e-5, True)])
    steps = decompose.expand(g)
    assert any(n.origin for n in steps.nodes) and not codegen.rounded_operands(steps)
    s = b.add("aten::sum.dim_IntList", p, (-1,), True, None)
    g = b.build([b.add("aten::softmax.int", p, -1, None), s])
    assert codegen.rounded_operands(decompose.expand(g)) == {decompose.expand(g).nodes[0].out.id}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("runner", ("cpu", "cuda_emulated"))
def test_an_integer_tensor_exponent_is_cast_to_the_reduced_dtype_first(runner, dtype):
    """``pow(x, e)`` for a float16/bfloat16 x and an int32 tensor e (0-dim, as the fuzzer's, and not): eager casts e
    to x's dtype before the op (259 is 260 in bfloat16, so (-2)^259 came out -inf where eager's (-2)^260 is inf: the
    CUDA fuzzer), and the kernels do too, on the CPU's vector and scalar loops and through the CUDA host emulation.
    (Not add, sub, mul, div: their eager kernels read a 0-dim operand in its own dtype.)"""
    from fuser.cuda import emulate
    b = ir.Builder()
    x, e = b.input(), b.input()
    group = b.build([b.call("aten::pow", x, e)])
    gen = torch.Generator().manual_seed(5)
    e_ = torch.randint(250, 3000, (3, 67), generator=gen, dtype=torch.int32)
    x_ = (torch.rand(3, 67, generator=gen) * 0.5 + 0.75).to(dtype)  # x^e near 1 where e rounds: a finite result
    x_[0, :4] = torch.tensor([-2.0, 2.0, -1.0, 0.5], dtype=dtype)
    e_[0, :4] = torch.tensor([259, 259, 1025, 3001], dtype=torch.int32)
    for args in ([x_, e_], [torch.tensor(-2.0, dtype=dtype), torch.tensor(259, dtype=torch.int32)]):
        want = torch.pow(*args)
        if runner == "cpu":
            got, = fused_run(STORE.get(STORE.register(group)), args)
        else:
            got, = emulate.run_graph(group, args)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
