"""rand_like inside fusion groups (fuser/rng.py): distribution, seeding, layout independence, dropout, and the
fallbacks (broadcast inputs, autograd). Run on the CPU backend here; tests/test_gpu.py repeats the core on CUDA."""
import math

import pytest
import torch
from helpers import DROPOUT_IR, assert_same, fused_graph

import fuser
from fuser import executor, rng
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def grid_moments(dtype: torch.dtype) -> tuple[float, float]:
    """Mean and variance of the uniform distribution on the grid {k / 2^b : 0 <= k < 2^b} that rand_like of
    ``dtype`` draws from (b = 8 for bfloat16: the mean is 0.5 - 2^-9, not 0.5). Eager's bfloat16 rand_like has
    the same mean on both devices (tests/test_gpu.py checks it on CUDA, test_eager_bfloat16_mean here)."""
    step = 2.0 ** -rng.BITS.get(dtype, 53)
    return 0.5 - step / 2, (1 - step * step) / 12


def check_distribution(r: torch.Tensor) -> None:
    """Uniform on [0, 1) on the dtype's grid: range, mean, variance and a 16-bin histogram, each within 6
    standard errors."""
    n = r.numel()
    v = r.double().flatten()
    mean, var = grid_moments(r.dtype)
    assert float(v.min()) >= 0.0 and float(v.max()) < 1.0
    assert abs(float(v.mean()) - mean) < 6 * math.sqrt(var / n), (float(v.mean()), mean)
    assert abs(float(v.var()) - var) < 6 * math.sqrt(1 / 180 / n)
    counts = torch.histc(v, bins=16, min=0.0, max=1.0)
    expected = n / 16
    assert float((counts - expected).abs().max()) < 6 * math.sqrt(expected), counts


def _run(x, p=0.3, device_seed=None):
    key = STORE.register(lower(torch.parse_ir(DROPOUT_IR)))
    if device_seed is not None:
        torch.manual_seed(device_seed)
    return executor.run(STORE.get(key), [x, p, 1 / (1 - p)])


@pytest.fixture(autouse=True)
def _needs_cpu_fusion():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_uniform_on_zero_one(dtype):
    x = torch.randn(512, 768, dtype=dtype)
    out = _run(x)
    assert out is not None
    assert out[1].dtype == dtype and out[1].shape == x.shape
    check_distribution(out[1])


def test_eager_bfloat16_mean_is_the_grids(device="cpu"):
    """Which side is right about bfloat16's mean: eager's own rand_like (values rounded to bfloat16, 1.0
    folded to 0) has the grid's mean 0.5 - 2^-9, which the fused kernel's exact grid draws share."""
    n = 1_500_000
    v = torch.rand(n, dtype=torch.bfloat16, device=device).double()
    mean, var = grid_moments(torch.bfloat16)
    assert abs(float(v.mean()) - mean) < 6 * math.sqrt(var / n), float(v.mean())
    assert abs(float(v.mean()) - 0.5) > 6 * math.sqrt(var / n)  # 0.5 itself is out of reach at this n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_keeps_the_right_fraction_scaled(dtype):
    p = 0.3
    x = torch.randn(256, 1000, dtype=dtype)
    z, r = _run(x, p)
    kept = r > p
    assert torch.equal(z != 0, kept & (x != 0))
    # values lie on a grid of 2^-bits (eager's grid too: float16 11 bits, bfloat16 8), and the comparison
    # sees p rounded to the dtype as eager's does: the exact keep probability of that grid
    bits = {torch.float32: 24, torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}[dtype]
    p_rounded = torch.tensor(p, dtype=dtype).item()
    keep = (2 ** bits - (math.floor(p_rounded * 2 ** bits) + 1)) / 2 ** bits
    sigma = math.sqrt(keep * (1 - keep) / x.numel())
    assert abs(float(kept.double().mean()) - keep) < 6 * sigma
    assert abs(float((torch.rand_like(x) > p).double().mean()) - keep) < 6 * sigma  # eager agrees
    assert_same(z, torch.where(kept, x * (1 / (1 - p)), torch.zeros_like(x)))


def test_manual_seed_repeats_and_calls_differ():
    x = torch.randn(100, 100)
    a = _run(x, device_seed=7)[1]
    b = _run(x, device_seed=7)[1]
    c = _run(x)[1]
    d = _run(x, device_seed=8)[1]
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    # two draws are independent: correlation near zero
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), c.flatten()]))[0, 1])) < 6 / math.sqrt(a.numel())


def test_values_do_not_depend_on_the_input_layout():
    x = torch.randn(300, 200)
    xt = x.t().contiguous().t()  # same values and shape, column-major: another kernel (strided input)
    a = _run(x, device_seed=3)[1]
    b = _run(xt, device_seed=3)[1]
    assert torch.equal(a, b)


def test_two_random_ops_in_one_group_draw_different_numbers():
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor):
      %none : NoneType = prim::Constant()
      %a : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
      %b : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
      %one : int = prim::Constant[value=1]()
      %s : Tensor = aten::add(%a, %b, %one)
      return (%a, %b, %s)
    """)))
    a, b, s = executor.run(STORE.get(key), [torch.empty(200, 300)])
    assert not torch.equal(a, b)
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 6 / math.sqrt(a.numel())
    assert_same(s, a + b)


def test_dtype_argument_and_options():
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor):
      %none : NoneType = prim::Constant()
      %dt : int = prim::Constant[value=7]()
      %a : Tensor = aten::rand_like(%x, %dt, %none, %none, %none, %none)
      return (%a)
    """)))
    out = executor.run(STORE.get(key), [torch.empty(64, 64)])
    assert out is not None and out[0].dtype == torch.float64
    check_distribution(out[0])


def test_broadcast_after_rand_like_fuses():
    """rand_like of a value that spans the map: other inputs may broadcast (a bias vector)."""
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor, %b : Tensor):
      %none : NoneType = prim::Constant()
      %r : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
      %one : int = prim::Constant[value=1]()
      %s : Tensor = aten::add(%r, %b, %one)
      return (%s, %r)
    """)))
    x, b = torch.randn(300, 40), torch.randn(40)
    out = executor.run(STORE.get(key), [x, b])
    assert out is not None
    check_distribution(out[1])
    assert_same(out[0], out[1] + b)


def test_rand_like_of_a_broadcast_input_falls_back():
    """rand_like(y) with y (40,) broadcast over x (50, 40): eager draws 40 numbers and repeats them per row."""
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %none : NoneType = prim::Constant()
      %r : Tensor = aten::rand_like(%y, %none, %none, %none, %none, %none)
      %s : Tensor = aten::mul(%r, %x)
      return (%s)
    """)))
    x, y = torch.randn(50, 40).abs() + 0.5, torch.randn(40)
    assert executor.run(STORE.get(key), [x, y]) is None
    out = fuser.run_fusion(key, [x, y])[0]
    assert out.shape == (50, 40)
    r = out / x
    assert bool(((r >= 0) & (r < 1)).all())
    torch.testing.assert_close(r, r[:1].expand_as(r))  # one draw, broadcast over rows


def test_integer_input_raises_eagers_error():
    key = STORE.register(lower(torch.parse_ir(DROPOUT_IR)))
    with pytest.raises(RuntimeError):
        fuser.run_fusion(key, [torch.ones(4, dtype=torch.int64), 0.3, 1.0])


def test_dropout_under_autograd_replays_its_mask_in_the_backward_kernel(monkeypatch):
    """The backward kernel recomputes the forward with the forward's launch state: the same Philox numbers,
    so the gradient is the forward's mask times the scale (and no interpreter runs)."""
    from fuser import fallback
    monkeypatch.setattr(fallback, "run", lambda spec, args: pytest.fail("the interpreter ran"))
    key = STORE.register(lower(torch.parse_ir(DROPOUT_IR)))
    x = torch.randn(64, 32, requires_grad=True)
    z, r = fuser.run_fusion(key, [x, 0.4, 1 / 0.6])
    assert z.grad_fn is not None and not r.requires_grad
    g = torch.randn_like(z)
    z.backward(g)
    assert_same(x.grad, g * (r > 0.4).float() / 0.6)
    assert_same(z.detach(), x.detach() * (r > 0.4).float() / 0.6)


def test_dropout_double_backward_replays_too():
    key = STORE.register(lower(torch.parse_ir(DROPOUT_IR)))
    x = torch.randn(16, 8, requires_grad=True)
    z, r = fuser.run_fusion(key, [x, 0.4, 1 / 0.6])
    (gx,) = torch.autograd.grad((z * z).sum(), x, create_graph=True)
    mask = (r > 0.4).float() / 0.6
    assert_same(gx.detach(), 2 * x.detach() * mask * mask)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    assert_same(ggx, 2 * mask * mask)


def test_random_group_whose_kernel_cannot_run_uses_eagers_autograd():
    fuser.override_can_fuse_on_cpu(False)
    key = STORE.register(lower(torch.parse_ir(DROPOUT_IR)))
    x = torch.randn(64, 32, requires_grad=True)
    z, r = fuser.run_fusion(key, [x, 0.4, 1 / 0.6])
    g = torch.randn_like(z)
    z.backward(g)
    assert_same(x.grad, g * (r > 0.4).float() / 0.6)


def dropout_residual(x, bias, residual, p: float):
    return bias + (torch.rand_like(x) > p).type_as(x) * x * (1.0 / (1.0 - p)) + residual


def test_scripted_dropout_is_one_group():
    g = fused_graph(dropout_residual)
    assert sum(n.kind() == "prim::FusionGroup" for n in g.nodes()) == 1
    f = fuser.fuse(torch.jit.script(dropout_residual))
    x, b, res = torch.randn(128, 256), torch.randn(128, 256), torch.randn(128, 256)
    torch.manual_seed(5)
    out = f(x, b, res, 0.25)
    kept = (out - b - res).abs() > 1e-6
    frac = float(kept.double().mean())
    assert abs(frac - 0.75) < 6 * math.sqrt(0.25 * 0.75 / x.numel())
    assert_same(torch.where(kept, out, b + res), torch.where(kept, b + x / 0.75 + res, b + res))
