"""Groups that draw random numbers (``rand_like``) through both doors, and fused functions in CUDA graphs.

A random group's kernel draws its own Philox numbers (``fuser/rng.py``), not eager's, so outputs are checked by
what must hold whatever the numbers: a dropped element is exactly ``bias + residual``, a kept one is eager's
formula on the same inputs, about the expected fraction is kept, ``torch.manual_seed`` repeats a run and the next
call draws others; under autograd, the gradient is the forward's own mask. While a CUDA graph is captured, a random
group falls back (torch's generator cannot be read then) so eager's ops draw, which a replay advances; other
groups launch their kernels into the graph, and replays on new input values give eager's results.
"""
import pytest
import torch

import fuser
import fuser.dynamo  # noqa: F401  (registers backend="fuser")
from fuser import fallback
from fuser.kernel_cache import STORE


def dropout_residual(x, bias, residual):
    return bias + (torch.rand_like(x) > 0.1).type_as(x) * x * (1.0 / 0.9) + residual


def gelu_bias(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    fuser.uninstall()


def _door(name, fn):
    if name == "compile":
        return torch.compile(fn, backend="fuser", dynamic=False)
    fuser.install()
    return torch.jit.script(fn)


class _Fallbacks:
    """Counts the groups the interpreter runs (fuser.fallback.run)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = fallback.run

        def counted(spec, args):
            self.n += 1
            return real(spec, args)
        monkeypatch.setattr(fallback, "run", counted)


def _check_dropout(y, x, b, r, tol):
    """The dropped/kept split of ``y``; each element is one of the two values, computed in float32 from the inputs
    (a reduced-precision group computes in float32 and rounds its result once)."""
    y, x, b, r = y.float(), x.float(), b.float(), r.float()
    dropped = b + r
    kept = b + x * (1.0 / 0.9) + r
    is_kept = (y - kept).abs() <= (y - dropped).abs()
    torch.testing.assert_close(y[is_kept], kept[is_kept], **tol)
    torch.testing.assert_close(y[~is_kept], dropped.expand_as(y)[~is_kept], **tol)
    # only where the two candidates differ does the split say anything
    distinct = (kept - dropped).abs() > 0.1
    return is_kept, is_kept[distinct].float().mean().item()




# bfloat16: the result rounded once (half an ulp, 2^-9 relative) from inputs that float32 holds exactly
_TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=4e-3, atol=1e-5)}


def _dropout_through(door, device, dtype, monkeypatch):
    torch.manual_seed(7)
    x = torch.randn(96, 160, device=device, dtype=dtype)
    b, r = torch.randn(160, device=device, dtype=dtype), torch.randn(96, 160, device=device, dtype=dtype)
    f = _door(door, dropout_residual)
    with torch.no_grad():
        for _ in range(3):  # past TorchScript's profiling runs
            f(x, b, r)
        fallbacks = _Fallbacks(monkeypatch)
        torch.manual_seed(11)
        y1 = f(x, b, r)
        y2 = f(x, b, r)
        torch.manual_seed(11)
        y3 = f(x, b, r)
    assert any(s.random for s in STORE._specs.values()), "no group took rand_like"
    assert fallbacks.n == 0, "a random group fell back"
    for y in (y1, y2):
        assert y.dtype == dtype and y.shape == x.shape
        _, frac = _check_dropout(y, x, b, r, _TOL[dtype])
        assert 0.85 < frac < 0.95, frac
    assert torch.equal(y1, y3)  # torch.manual_seed repeats the numbers
    assert not torch.equal(y1, y2)  # the next call draws others


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("door", ("compile", "script"))
def test_rand_like_is_drawn_inside_a_group_through_both_doors(door, dtype, monkeypatch):
    _dropout_through(door, "cpu", dtype, monkeypatch)


def test_the_compile_door_puts_rand_like_in_the_group_and_explains_it():
    x, b, r = torch.randn(8, 16), torch.randn(16), torch.randn(8, 16)
    with torch.no_grad():
        records = fuser.explain(torch.compile(dropout_residual, backend="fuser"), x, b, r)
    groups = [rec for rec in records if rec.kind == "group"]
    assert len(groups) == 1 and "aten::rand_like" in groups[0].ops
    assert not [rec for rec in records if rec.kind == "left out"]


def test_a_random_op_between_two_groups_keeps_them_apart_and_in_order():
    # rand_like of a computed value: the op before it stays out of the random group (a group spans no effect)
    def f(x):
        y = x * 2.0 + 1.0
        return (torch.rand_like(y) < 0.5).type_as(y) * y
    x = torch.randn(32, 8)
    with torch.no_grad():
        out = torch.compile(f, backend="fuser")(x)
    y = x * 2.0 + 1.0
    assert torch.all((out == 0) | (out == y))


def _dropout_training(door, device):
    torch.manual_seed(3)
    x = torch.randn(64, 96, device=device, requires_grad=True)
    b, r = torch.randn(96, device=device), torch.randn(64, 96, device=device)
    f = _door(door, dropout_residual)
    for _ in range(3):
        f(x, b, r).sum().backward()
    x.grad = None
    y = f(x, b, r)
    go = torch.randn_like(y)
    y.backward(go)
    is_kept, frac = _check_dropout(y.detach(), x.detach(), b, r, _TOL[torch.float32])
    assert 0.8 < frac < 1.0, frac
    # the gradient is the forward's own mask: go / 0.9 where kept, 0 where dropped
    distinct = ((b + x.detach() / 0.9 + r) - (b + r)).abs() > 0.1
    expected = torch.where(is_kept, go / 0.9, torch.zeros_like(go))
    torch.testing.assert_close(x.grad[distinct], expected[distinct])


@pytest.mark.parametrize("door", ("compile", "script"))
def test_dropout_trains_with_the_forwards_mask_through_both_doors(door):
    _dropout_training(door, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# CUDA: the same, and CUDA graphs

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("door", ("compile", "script"))
def test_rand_like_is_drawn_inside_a_group_through_both_doors_cuda(door, dtype, monkeypatch):
    _cuda()
    _dropout_through(door, "cuda", dtype, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("door", ("compile", "script"))
def test_dropout_trains_with_the_forwards_mask_through_both_doors_cuda(door):
    _cuda()
    _dropout_training(door, "cuda")


def _captured(fn, args):
    """``fn(*args)`` warmed up on a side stream, then captured in a CUDA graph: (graph, static output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(4):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("door", ("compile", "script"))
def test_a_fused_kernel_is_captured_in_a_cuda_graph_and_replays_on_new_values(door, monkeypatch):
    _cuda()
    x, b = torch.randn(256, 512, device="cuda"), torch.randn(512, device="cuda")
    f = _door(door, gelu_bias)
    with torch.no_grad():
        for _ in range(3):
            f(x, b)
        fallbacks = _Fallbacks(monkeypatch)
        graph, out = _captured(f, (x, b))
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            b.copy_(torch.randn_like(b))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, gelu_bias(x, b))
    assert fallbacks.n == 0  # the kernel itself was captured


@pytest.mark.gpu
@pytest.mark.parametrize("door", ("compile", "script"))
def test_a_random_group_falls_back_under_cuda_graph_capture_and_replays_draw_anew(door, monkeypatch):
    _cuda()
    torch.manual_seed(5)
    x = torch.randn(128, 256, device="cuda")
    b, r = torch.randn(256, device="cuda"), torch.randn(128, 256, device="cuda")
    f = _door(door, dropout_residual)
    with torch.no_grad():
        for _ in range(3):
            f(x, b, r)
        fallbacks = _Fallbacks(monkeypatch)
        graph, out = _captured(f, (x, b, r))
        assert fallbacks.n >= 1  # captured as eager's ops: the generator cannot be read while capturing
        seen = []
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            _, frac = _check_dropout(out, x, b, r, _TOL[torch.float32])
            assert 0.85 < frac < 0.95, frac
            seen.append(out.clone())
        assert not torch.equal(seen[0], seen[1])  # each replay draws new numbers, as eager's captured ops do
        # outside a capture the kernel runs again
        n = fallbacks.n
        _check_dropout(f(x, b, r), x, b, r, _TOL[torch.float32])
        assert fallbacks.n == n
