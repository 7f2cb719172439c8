"""float16/bfloat16 results inside a group with ``settings.round_reduced`` on: each op that is an eager op of its own
is rounded to its dtype before the next op reads it, as eager stores it, so a chain gives eager's numbers; the steps
of one decomposed eager op (``ir.Node.origin``) stay unrounded in float, as eager's single kernel holds them. Off
(the default), every intermediate is held in float. On the CPU backend and through the CUDA host emulation
(tests/test_gpu.py has the GPU twins). The setting is read when a kernel is built: each graph here is used in one
setting only."""
import math

import pytest
import torch
from helpers import ARITH_IR, CHAIN_IR, EDGE_IRS, STEPS_IR, chain_tolerance, interpret

from fuser import executor, settings
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

REDUCED = (torch.float16, torch.bfloat16)


@pytest.fixture
def rounding(monkeypatch):
    monkeypatch.setattr(settings, "round_reduced", True)

def _run_cpu(ir_text, args):
    g = torch.parse_ir(ir_text)
    out = executor.run(STORE.get(STORE.register(lower(g))), args)
    assert out is not None, "fell back"
    return g, out


def _same(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0)), (got, ref)


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("n", (7, 4099))  # the scalar loop alone; the vector loop and its tail
def test_a_chain_of_reduced_precision_ops_gives_eagers_numbers_on_the_cpu(dtype, n, rounding):
    x, y, z, w = (torch.randn(n, dtype=dtype) for _ in range(4))
    y = y.abs() + 0.5
    g, out = _run_cpu(CHAIN_IR, [x, y, z, w])
    ref = interpret(g, [x, y, z, w])[0]
    diff = (out[0].float() - ref.float()).abs()
    assert bool((diff <= chain_tolerance(x, y, z, w)).all())
    assert (out[0] != ref).float().mean().item() < 0.01
    g, out = _run_cpu(ARITH_IR, [x, y, z])
    _same(out[0], interpret(g, [x, y, z])[0])


@pytest.mark.parametrize("name", sorted(EDGE_IRS))
def test_fuzzer_findings_of_unrounded_intermediates_follow_eager_when_rounding_on_the_cpu(name, rounding):
    text, dtype, values = EDGE_IRS[name]
    x = torch.tensor(values * 5, dtype=dtype)
    g, out = _run_cpu(text, [x])
    _same(out[0], interpret(g, [x])[0])


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_steps_of_one_eager_op_stay_unrounded_on_the_cpu(dtype, rounding):
    x = torch.tensor([100.0, -3.0, 0.5, 60.0] * 5, dtype=dtype)
    g, out = _run_cpu(STEPS_IR, [x])
    ref = ((x.float() * 1000.0) * 0.001).to(dtype)  # one kernel in float, rounded once
    torch.testing.assert_close(out[0], ref, rtol=0, atol=0)
    if dtype == torch.float16:  # rounded after the first step, 1e5 is inf in float16
        assert math.isinf(interpret(g, [x])[0][0].item()) and out[0][0].item() == 100.0


def test_cuda_kernels_round_as_eager_does_under_emulation(rounding):
    torch.manual_seed(5)
    for dtype in REDUCED:
        x, y, z, w = (torch.randn(4099, dtype=dtype) for _ in range(4))
        y = y.abs() + 0.5
        g = torch.parse_ir(CHAIN_IR)
        got, ref = emulate.run_graph(g, [x, y, z, w])[0], interpret(g, [x, y, z, w])[0]
        assert bool(((got.float() - ref.float()).abs() <= chain_tolerance(x, y, z, w)).all())
        g = torch.parse_ir(ARITH_IR)
        assert torch.equal(emulate.run_graph(g, [x, y, z])[0], interpret(g, [x, y, z])[0])
    for name, (text, dtype, values) in sorted(EDGE_IRS.items()):
        g, x = torch.parse_ir(text), torch.tensor(values * 5, dtype=dtype)
        got, ref = emulate.run_graph(g, [x])[0], interpret(g, [x])[0]
        assert torch.equal(got.isnan(), ref.isnan()), name
        torch.testing.assert_close(got, ref, equal_nan=True, rtol=1e-2, atol=0, msg=name)
    g, x = torch.parse_ir(STEPS_IR), torch.tensor([100.0, -3.0, 0.5, 60.0] * 5, dtype=torch.float16)
    assert emulate.run_graph(g, [x])[0][0].item() == 100.0


def test_by_default_intermediates_are_held_in_float():
    """Without the setting, (x * 1000) * 0.001 of float16 100 is 100 (held in float), where eager's stored 1e5 is inf;
    the fused result is the float64 truth rounded once."""
    text = STEPS_IR.replace('[fuser_origin="aten::some_op"]', "").replace("1000.", "1024.").replace("0.001", "0.0009765625")
    x = torch.tensor([100.0, -3.0, 0.5, 70.0] * 5, dtype=torch.float16)
    g, out = _run_cpu(text, [x])
    torch.testing.assert_close(out[0], ((x.double() * 1024.0) * 0.0009765625).half(), rtol=0, atol=0)
    assert math.isinf(interpret(g, [x])[0][0].item())
    assert emulate.run_graph(g, [x])[0][0].item() == 100.0


def test_row_kernels_follow_the_setting(monkeypatch):
    """A row kernel's pointwise nodes round as the setting says: sum((x * 2^k) * 2^-k) of float16 100s is inf
    rounded (102400 is inf in float16), 100 per element unrounded."""
    text = """graph(%x : Tensor):
  %k : float = prim::Constant[value=K]()
  %m : float = prim::Constant[value=M]()
  %dims : int[] = prim::Constant[value=[-1]]()
  %keep : bool = prim::Constant[value=0]()
  %none : NoneType = prim::Constant()
  %a : Tensor = aten::mul(%x, %k)
  %b : Tensor = aten::mul(%a, %m)
  %s : Tensor = aten::sum(%b, %dims, %keep, %none)
  return (%s)"""
    x = torch.full((3, 4), 100.0, dtype=torch.float16)
    # one group per setting: the setting is read when a kernel is built
    for on, k in ((False, 1024.0), (True, 2048.0)):
        monkeypatch.setattr(settings, "round_reduced", on)
        g = torch.parse_ir(text.replace("K]", f"{k}]").replace("M]", f"{1 / k}]"))
        spec = STORE.get(STORE.register(lower(g)))
        out = executor.run(spec, [x])
        assert out is not None and spec.has_reduction
        if on:
            torch.testing.assert_close(out[0], interpret(g, [x])[0])  # eager: inf
            assert math.isinf(out[0][0].item())
        else:
            torch.testing.assert_close(out[0], torch.full((3,), 400.0, dtype=torch.float16))
