"""The native hot path (fuser/native): repeated calls of a fused TorchScript function served in C++, every call
equal to eager's, and every call it must not take handed to Python (autograd, forward AD, vmap, lazy tensor bits,
the device switches, float arguments eager would reject)."""
import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers import assert_same, run_in_threads, trip_sums_fit

import fuser
from fuser import native

pytestmark = pytest.mark.skipif(not native.loaded(), reason=f"native hot path: {native.status()}")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gelu_bias(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def _scaled(x, y, s: float):
    return torch.sigmoid(x * s + y) - 0.25, x * y


def _mixed(x, i):
    return (x * i + 1).relu(), i * 3


def _two(x, y):
    return (x * y).sin() + y


def _stats():
    return native.stats()


def _served(fn, *args, calls=4):
    """Call ``fn`` ``calls`` times under no_grad; the hits the hot path counted, and the last result."""
    before = _stats()["hits"]
    with torch.no_grad():
        for _ in range(calls):
            out = fn(*args)
    return _stats()["hits"] - before, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_repeated_calls_are_served_natively_and_equal_eager(device, dtype):
    ff = fuser.fuse(torch.jit.script(_gelu_bias))
    for shape in [(64, 96), (3, 5, 7), (1, 1), (257,)]:
        x = torch.randn(shape, dtype=dtype, device=device)
        b = torch.randn(shape[-1:], dtype=dtype, device=device)
        hits, out = _served(ff, x, b)
        assert hits >= 2  # the first call (or two: the profiling executor) prepares, the rest are served
        assert_same(out, _gelu_bias(x, b))
        # fresh values through the same prepared signature
        x2, b2 = torch.randn_like(x), torch.randn_like(b)
        with torch.no_grad():
            assert_same(ff(x2, b2), _gelu_bias(x2, b2))


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_scalars_mixed_dtypes_and_empty(device):
    ff = fuser.fuse(torch.jit.script(_scaled))
    base = torch.randn(40, 30, device=device)
    cases = [
        (base.t(), torch.randn(30, 40, device=device)),  # a transposed input
        (base[::2, 1::3], torch.randn(10, device=device)),  # sliced, broadcast row
        (torch.randn(7, 1, device=device), torch.randn(1, 5, device=device)),  # outer product
        (torch.tensor(0.5, device=device), torch.randn(6, device=device)),  # 0-dim
        (torch.empty(0, 4, device=device), torch.empty(0, 4, device=device)),  # no elements
    ]
    for x, y in cases:
        for s in (0.25, -3.0):
            hits, out = _served(ff, x, y, s)
            ref = _scaled(x, y, s)
            for o, r in zip(out, ref):
                assert o.shape == r.shape and o.dtype == r.dtype
                assert_same(o, r)
    fm = fuser.fuse(torch.jit.script(_mixed))
    x = torch.randn(33, 17, device=device)
    i = torch.randint(-5, 5, (33, 17), device=device, dtype=torch.int32)
    hits, out = _served(fm, x, i)
    assert hits >= 2
    for o, r in zip(out, _mixed(x, i)):
        assert o.dtype == r.dtype
        assert_same(o, r)


def _cat0(x, y):
    return torch.cat([torch.sigmoid(x), x * y, x + y], 0), x - y


def _cat1(x, y):
    return x - y, torch.cat([torch.sigmoid(x), x * y], 1)


def _cat_last(x, y):
    return torch.cat([torch.tanh(x), x * y, x + y, x / (1 + y * y)], -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [_cat0, _cat1, _cat_last], ids=lambda f: f.__name__)
def test_cat_outputs_are_served_natively(device, fn):
    """A group with a cat output: allocated whole here and written through one pointer per piece (its slices)."""
    ff = fuser.fuse(torch.jit.script(fn))
    for shape in [(6, 5, 3), (33, 17), (1, 1, 1), (0, 4)]:
        x = torch.randn(shape, device=device)
        y = torch.randn(shape, device=device)
        hits, out = _served(ff, x, y)
        assert hits >= 2
        ref = fn(x, y)
        for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
            assert o.shape == r.shape and o.dtype == r.dtype and o.stride() == r.stride()
            assert_same(o, r)
        x2, y2 = torch.randn_like(x), torch.randn_like(y)  # fresh values through the prepared signature
        with torch.no_grad():
            out = ff(x2, y2)
        for o, r in zip(out if isinstance(out, tuple) else (out,), [fn(x2, y2)] if not isinstance(ref, tuple)
                        else fn(x2, y2)):
            assert_same(o, r)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode_is_served(device):
    ff = fuser.fuse(torch.jit.script(_two))
    x, y = torch.randn(100, device=device), torch.randn(100, device=device)
    before = _stats()["hits"]
    with torch.inference_mode():
        for _ in range(4):
            out = ff(x, y)
    assert _stats()["hits"] - before >= 2
    assert_same(out, _two(x, y))


def _grads(fn, inputs, weights, create_graph=False):
    """Gradients of sum(w_k * out_k) over the outputs given a weight (None: that output unused)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * w).sum() for o, w in zip(outs, weights) if w is not None)
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, torch.autograd.grad(loss, wanted, create_graph=create_graph)


def _fresh(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in inputs]


@pytest.mark.parametrize("device", DEVICES)
def test_training_calls_are_recorded_natively_with_eager_gradients(device):
    """After a first call prepares it, a call autograd records runs its forward here and records a node whose
    backward runs the backward group (or Python's backward for another output-gradient pattern)."""
    ff = fuser.fuse(torch.jit.script(_scaled))
    x = torch.randn(6, 5, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)  # broadcast: summed to its shape
    for weights in [(1.0, 2.0), (None, 1.5), (0.5, None), (1.0, 2.0)]:
        for _ in range(3):
            wt = [None if w is None else torch.full((6, 5), w, dtype=torch.float64, device=device) for w in weights]
            before = _stats()["hits"]
            outs, grads = _grads(ff, [x, y, 0.75], wt)
            served = _stats()["hits"] > before
            ref_outs, ref = _grads(_scaled, _fresh([x, y, 0.75]), wt)
            for o, r in zip(outs, ref_outs):
                assert_same(o, r)
            for g, r in zip(grads, ref):
                assert_same(g, r)
        assert served  # the third call of each pattern at least
        assert outs[0].grad_fn.name() == "FusedGroupBackward"
    # only one input requires grad; a float16 input whose gradient is cast back to its dtype
    xh = torch.randn(6, 5, device=device).half().requires_grad_()
    yf = torch.randn(5, device=device)
    for _ in range(3):
        wt = [torch.ones(6, 5, device=device), torch.ones(6, 5, device=device)]
        outs, (g,) = _grads(ff, [xh, yf, 2.0], wt)
        ref_outs, (r,) = _grads(_scaled, _fresh([xh, yf, 2.0]), wt)
        assert g.dtype == torch.float16 and g.shape == xh.shape
        assert_same(g, r)


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_through_a_native_node(device):
    ff = fuser.fuse(torch.jit.script(_two))
    x = torch.randn(20, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randn(20, dtype=torch.float64, device=device, requires_grad=True)
    for _ in range(3):
        _, (gx, gy) = _grads(ff, [x, y], [torch.ones(20, dtype=torch.float64, device=device)], create_graph=True)
        (ggx,) = torch.autograd.grad((gx * gy).sum(), x)
        xr, yr = _fresh([x, y])
        _, (rx, ry) = _grads(_two, [xr, yr], [torch.ones(20, dtype=torch.float64, device=device)], create_graph=True)
        (rgx,) = torch.autograd.grad((rx * ry).sum(), xr)
        assert_same(ggx, rgx)


def test_saved_inputs_modified_in_place_raise_as_in_eager():
    ff = fuser.fuse(torch.jit.script(_two))
    x, y = torch.randn(8, requires_grad=True), torch.randn(8)
    for _ in range(3):
        ff(x, y).sum().backward()
    yy = y.clone()
    out = ff(x, yy)
    assert out.grad_fn.name() == "FusedGroupBackward"
    yy.mul_(2)  # saved for the backward (the sine's argument needs it)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_forward_ad_vmap_and_lazy_bits_go_to_python():
    import torch.autograd.forward_ad as fwAD
    ff = fuser.fuse(torch.jit.script(_two))
    x, y, t = torch.randn(6), torch.randn(6), torch.randn(6)
    _served(ff, x, y)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(ff(fwAD.make_dual(x, t), y))
        ref = fwAD.unpack_dual(_two(fwAD.make_dual(x, t), y))
    assert out.tangent is not None
    assert_same(out.tangent, ref.tangent)
    xb, yb = torch.randn(3, 6), torch.randn(3, 6)
    assert_same(torch.vmap(ff)(xb, yb), _two(xb, yb))
    xi = torch.randn(6, dtype=torch.complex64).conj().imag  # the neg bit: memory is not the values
    assert xi.is_neg()
    for _ in range(3):
        assert_same(ff(xi, y), _two(xi, y))
    z = torch._efficientzerotensor((6,))
    for _ in range(3):
        assert_same(ff(z, y), _two(z, y))


def test_device_switch_and_signature_changes():
    ff = fuser.fuse(torch.jit.script(_two))
    x, y = torch.randn(64), torch.randn(64)
    hits, _ = _served(ff, x, y)
    assert hits >= 2
    fuser.override_can_fuse_on_cpu(False)  # forgets every prepared launch; Python decides again
    assert _stats()["signatures"] == 0
    before = fuser.n_compiled_kernels()
    hits, out = _served(ff, x, y)
    assert hits == 0
    assert_same(out, _two(x, y))
    fuser.override_can_fuse_on_cpu(None)
    hits, out = _served(ff, x, y)
    assert hits >= 2
    assert fuser.n_compiled_kernels() == before  # the kernel was kept: nothing recompiled
    # another shape, then the first again: both prepared, both served
    x2, y2 = torch.randn(8, 8), torch.randn(8)
    for a, b in [(x2, y2), (x, y), (x2, y2)]:
        with torch.no_grad():
            assert_same(ff(a, b), _two(a, b))


def _int_add(x, s: float):
    return (x + s) * 2


def test_float_arguments_eager_rejects_are_handed_over():
    """A float argument outside what the kernel's dtype holds: eager's result or error, as from Python."""
    ff = fuser.fuse(torch.jit.script(_int_add))
    x = torch.randint(-100, 100, (16,), dtype=torch.int8)
    for s in (1.0, 2.0, 1.0):
        with torch.no_grad():
            out = ff(x, s)
        assert_same(out, _int_add(x, s))
    for s in (1e300, float("nan"), float("inf")):
        try:
            ref = _int_add(x, s)
        except RuntimeError as e:
            with pytest.raises(RuntimeError):
                ff(x, s)
            continue
        with torch.no_grad():
            assert_same(ff(x, s), ref)


def test_threads_share_prepared_launches():
    ff = fuser.fuse(torch.jit.script(_gelu_bias))
    shapes = [(16, 32), (5, 7), (64, 8), (3, 32)]
    errors = []

    def work(k):
        try:
            g = torch.Generator().manual_seed(k)
            for j in range(40):
                shape = shapes[(k + j) % len(shapes)]
                x = torch.randn(shape, generator=g)
                b = torch.randn(shape[-1:], generator=g)
                with torch.no_grad():
                    out = ff(x, b)
                torch.testing.assert_close(out, _gelu_bias(x, b))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_off_switch_runs_python_with_equal_results(tmp_path):
    script = tmp_path / "off.py"
    script.write_text(
        "import torch, fuser\n"
        "from fuser import native\n"
        "def f(x, y):\n    return (x * y).sin() + y\n"
        "ff = fuser.fuse(torch.jit.script(f))\n"
        "x, y = torch.linspace(-2, 2, 9), torch.linspace(0, 1, 9)\n"
        "with torch.no_grad():\n"
        "    outs = [ff(x, y) for _ in range(4)]\n"
        "assert all(torch.equal(o, f(x, y)) for o in outs)\n"
        "print(native.loaded(), native.stats())\n")
    env = dict(os.environ, FUSER_NATIVE="0", PYTHONPATH=os.path.dirname(os.path.dirname(fuser.__file__)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "None"]


def _lstm_cell(gates, cx):
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


def test_chunk_motion_forward_and_gradients_through_the_native_chunk():
    ff = fuser.fuse(torch.jit.script(_lstm_cell))
    for batch, hidden in [(3, 2), (5, 7), (1, 1)]:
        gates = torch.randn(batch, 4 * hidden, dtype=torch.float64)
        cx = torch.randn(batch, hidden, dtype=torch.float64)
        hits, out = _served(ff, gates, cx)
        for o, r in zip(out, _lstm_cell(gates, cx)):
            assert_same(o, r)
        g1, c1 = gates.clone().requires_grad_(), cx.clone().requires_grad_()
        g2, c2 = gates.clone().requires_grad_(), cx.clone().requires_grad_()
        for _ in range(2):
            hy, cy = ff(g1, c1)
            grads = torch.autograd.grad((hy * 2 + cy).sum(), (g1, c1))
        hy2, cy2 = _lstm_cell(g2, c2)
        ref = torch.autograd.grad((hy2 * 2 + cy2).sum(), (g2, c2))
        for a, b in zip(grads, ref):
            assert_same(a, b)
    # a gates tensor that does not split into 4: eager's error
    with pytest.raises(RuntimeError):
        ff(torch.randn(3, 2), torch.randn(3, 2))


def _same_views(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
        assert torch.equal(x, y)


@pytest.mark.parametrize("case", range(6))
def test_native_broadcasting_chunk_equals_the_python_operator(case):
    chunks, dim, shapes = [(4, 1, [(3, 8), (3, 1)]), (2, 0, [(6, 5), (5,)]), (3, -1, [(2, 7), (1, 7), ()]),
                           (4, 1, [(3, 2)]), (2, 2, [(4, 4)]), (2, 0, [(0, 3)])][case]
    inputs = [torch.randn(s) for s in shapes]
    full = torch.broadcast_shapes(*shapes)
    try:
        n = len(torch.empty(full).chunk(chunks, dim))
    except (RuntimeError, IndexError):
        n = 2
    args = (inputs, chunks, dim, n)
    try:
        ref = torch.ops.fuser.broadcasting_chunk_py(*args)
    except Exception as e:
        with pytest.raises(type(e)):
            torch.ops.fuser.broadcasting_chunk(*args)
        return
    _same_views(torch.ops.fuser.broadcasting_chunk(*args), ref)
    # each chunk of the broadcast result is what the pieces compute
    pieces = torch.broadcast_tensors(*inputs)[0].chunk(chunks, dim)
    got = torch.ops.fuser.broadcasting_chunk(*args)
    for k, p in enumerate(pieces):
        assert torch.broadcast_shapes(*(got[j * n + k].shape for j in range(len(inputs)))) == p.shape
    # a wrong count: eager's error
    with pytest.raises(RuntimeError):
        torch.ops.fuser.broadcasting_chunk(inputs, chunks, dim, n + 1)


@pytest.mark.parametrize("dtype,vec_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16), (torch.float64, torch.float64)])
@pytest.mark.parametrize("affine", [True, False])
def test_native_batch_norm_params_equal_the_python_operator(dtype, vec_dtype, affine):
    x = torch.randn(2, 5, 3, 4).to(dtype)
    w, b = (torch.randn(5).to(vec_dtype), torch.randn(5).to(vec_dtype)) if affine else (None, None)
    mean, var = torch.randn(5).to(vec_dtype), torch.rand(5).to(vec_dtype) + 0.5
    for args in [(x, w, b, mean, var), (x[:, :, 0], w, b, mean, var), (x, w, b, mean[::1], var)]:
        try:
            ref = torch.ops.fuser.batch_norm_params_py(*args)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                torch.ops.fuser.batch_norm_params(*args)
            continue
        _same_views(torch.ops.fuser.batch_norm_params(*args), ref)
    # a vector of the wrong length: eager's error
    with pytest.raises(RuntimeError):
        torch.ops.fuser.batch_norm_params(x, w, b, torch.randn(4).to(vec_dtype), var)


def test_native_batch_norm_params_kept_views_follow_their_vectors():
    """A repeated call returns the kept views: they alias the vectors (an in-place update of the running statistics
    shows), a vector replaced by another tensor, of another dtype, or a storage swapped in under the same tensor
    (``.data =``) gets new views, an input of another rank gets views of its rank, and views autograd records are
    not kept."""
    x = torch.randn(2, 5, 3, 4)
    w, b, mean, var = torch.randn(5), torch.randn(5), torch.randn(5), torch.rand(5) + 0.5
    first = torch.ops.fuser.batch_norm_params(x, w, b, mean, var)
    again = torch.ops.fuser.batch_norm_params(x, w, b, mean, var)
    assert all(a is f for a, f in zip(again, first))  # the kept views themselves
    _same_views(again, torch.ops.fuser.batch_norm_params_py(x, w, b, mean, var))
    mean.add_(1.5)  # eval mode keeps the statistics, but a user may set them in place
    var.mul_(2)
    _same_views(torch.ops.fuser.batch_norm_params(x, w, b, mean, var),
                torch.ops.fuser.batch_norm_params_py(x, w, b, mean, var))
    assert torch.equal(first[2].flatten(), mean) and torch.equal(first[3].flatten(), var)
    mean2 = mean.clone() + 3  # another tensor in the same slot
    _same_views(torch.ops.fuser.batch_norm_params(x, w, b, mean2, var),
                torch.ops.fuser.batch_norm_params_py(x, w, b, mean2, var))
    w.data = torch.randn(5)  # a new storage under the same tensor
    _same_views(torch.ops.fuser.batch_norm_params(x, w, b, mean, var),
                torch.ops.fuser.batch_norm_params_py(x, w, b, mean, var))
    x3 = torch.randn(2, 5, 7)  # another rank
    got = torch.ops.fuser.batch_norm_params(x3, w, b, mean, var)
    assert all(t.shape == (5, 1) for t in got)
    _same_views(got, torch.ops.fuser.batch_norm_params_py(x3, w, b, mean, var))
    wd, bd, md, vd = (t.double() for t in (w, b, mean, var))  # another dtype
    xd = x.double()
    _same_views(torch.ops.fuser.batch_norm_params(xd, wd, bd, md, vd),
                torch.ops.fuser.batch_norm_params_py(xd, wd, bd, md, vd))
    wg = w.detach().clone().requires_grad_()
    with torch.enable_grad():
        got = torch.ops.fuser.batch_norm_params(x, wg, b, mean, var)
        got2 = torch.ops.fuser.batch_norm_params(x, wg, b, mean, var)
        assert got[0].grad_fn is not None and got[0] is not got2[0]
        got[0].sum().backward()
    assert torch.equal(wg.grad, torch.ones(5))


def _softmax_written_out(x, bias):
    y = x + bias
    e = torch.exp(y - torch.amax(y, -1, True))
    return e / torch.sum(e, -1, True)


def _row_sum(x):
    return (x * 2 + 1).sum(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_row_kernels_are_served_natively(device):
    fs = fuser.fuse(torch.jit.script(_softmax_written_out))
    fr = fuser.fuse(torch.jit.script(_row_sum))
    for shape in [(8, 33), (2, 3, 1024), (5, 1)]:
        x = torch.randn(shape, device=device)
        bias = torch.randn(shape[-1:], device=device)
        hits, out = _served(fs, x, bias)
        assert hits >= 2
        assert_same(out, _softmax_written_out(x, bias))
        hits, out = _served(fr, x)
        assert hits >= 2
        assert_same(out, _row_sum(x))
        x2 = torch.randn_like(x)
        with torch.no_grad():
            assert_same(fs(x2, bias), _softmax_written_out(x2, bias))


def _dropout_residual(x, r):
    return torch.nn.functional.dropout(x, 0.25, True) + r


@pytest.mark.parametrize("device", DEVICES)
def test_random_kernels_are_served_natively_with_the_python_paths_numbers(device):
    """A group drawing rand_like's numbers (dropout): served natively, its launch state drawn from the device's
    default generator as the Python path draws it (the CPU's: a seed and offset drawn from it; CUDA's: its seed
    and Philox offset, advanced by 4), so a seed gives the same numbers either way; two calls differ; kept elements
    are x / (1 - p)."""
    fd = fuser.fuse(torch.jit.script(_dropout_residual))
    x, r = torch.randn(64, 96, device=device), torch.randn(64, 96, device=device)
    hits, _ = _served(fd, x, r)
    assert hits >= 2
    torch.manual_seed(123)
    before = _stats()["hits"]
    with torch.no_grad():
        a, a2 = fd(x, r), fd(x, r)
    assert _stats()["hits"] - before == 2
    torch.manual_seed(123)
    before = _stats()["hits"]
    b = fd(x.clone().requires_grad_(), r)  # a call autograd records: a random group's goes to Python
    assert _stats()["hits"] == before
    assert torch.equal(a, b.detach())
    assert not torch.equal(a, a2)
    kept = (a - r) != 0
    torch.testing.assert_close(a[kept], x[kept] / 0.75 + r[kept])
    assert abs(kept.float().mean().item() - 0.75) < 0.05
    if device == "cuda":  # the generator moves on as after Python's launch (and eager's Philox ops)
        gen = torch.cuda.default_generators[x.device.index or 0]
        offset = gen.get_offset()
        _served(fd, x, r, calls=1)
        assert gen.get_offset() == offset + 4


# ---- norms' weight and bias gradients: the native backward runs the fused group (sums inside the row kernel)

def _ln_affine(x, w, b):
    return torch.layer_norm(x, [48], None, None, 1e-5) * w + b


def _rms_weight(x, w):
    return torch.rms_norm(x, [48], None, 1e-6) * w


def _python_backwards(monkeypatch) -> list:
    """Every backward the native node hands to Python from now on."""
    calls = []
    real = native.python_backward

    def python_backward(*args):
        calls.append(args[0].key)
        return real(*args)

    monkeypatch.setattr(native, "python_backward", python_backward)
    return calls


def _norm_args(fn, shape, dtype, wants=(True, True, True)):
    n_params = 2 if fn is _ln_affine else 1
    args = [torch.randn(shape, dtype=dtype)] + [torch.randn(shape[-1:], dtype=dtype) for _ in range(n_params)]
    return [a.requires_grad_(want) for a, want in zip(args, wants)]


def _check_step(ff, fn, args, gy=None, tol=None):
    """One training step of ``ff`` on ``args``: its output and gradients against eager's float64 ones."""
    y = ff(*args)
    gy = torch.randn_like(y) if gy is None else gy
    wanted = [a for a in args if a.requires_grad]
    got = torch.autograd.grad(y, wanted, gy)
    args64 = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    y64 = fn(*args64)
    want = torch.autograd.grad(y64, [a for a in args64 if a.requires_grad], gy.double())
    tol = tol or (dict(rtol=1e-10, atol=1e-10) if args[0].dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5))
    torch.testing.assert_close(y.double(), y64.detach(), **tol)
    # float16/bfloat16: a summed gradient (a bias's) adds terms rounded to the dtype, eager's too, so where its
    # terms cancel its error exceeds a tolerance relative to the result. Allowed on top: eager's own error (twice),
    # or four standard deviations of the error that rounding each term to the dtype gives the sum (an error of up
    # to u|t| each, about uniform: u / sqrt(3) * sqrt(sum t^2)), whichever is larger. (Eager's error alone is one
    # draw of that noise: on the CPU, 5 of 60 seeds of a bfloat16 bias over 512 elements failed with it.)
    reduced = args[0].dtype in (torch.float16, torch.bfloat16)
    if reduced:
        args_e = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        eager = torch.autograd.grad(fn(*args_e), [a for a in args_e if a.requires_grad], gy)
        unit = 2.0 ** (-8 if args[0].dtype == torch.bfloat16 else -11)
    at = [i for i, a in enumerate(args) if a.requires_grad]
    for k, (g, w, a) in enumerate(zip(got, want, wanted)):
        assert g.dtype == a.dtype and g.shape == a.shape and g.device == a.device
        atol = tol["atol"] * max(1.0, w.abs().max().item())
        if reduced:
            noise = 4 * unit / 3 ** 0.5 * _summed_terms(fn, args64, at[k], gy).pow(2).sum_to_size(a.shape).sqrt()
            atol += max(2 * (eager[k].double() - w).abs().max().item(), noise.max().item())
        torch.testing.assert_close(g.double(), w, rtol=tol["rtol"], atol=atol)
    return y


def _summed_terms(fn, args64, k, gy):
    """The float64 terms that the gradient of input ``k`` sums where it is broadcast: the gradient of that input
    expanded to the output's shape (its own gradient where it is not broadcast)."""
    full = args64[k].detach().expand(gy.shape).clone().requires_grad_()
    return torch.autograd.grad(fn(*[full if i == k else b for i, b in enumerate(args64)]), [full], gy.double())[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("fn", [_ln_affine, _rms_weight], ids=lambda f: f.__name__)
def test_norm_weight_gradients_are_summed_by_the_native_backward(fn, dtype, monkeypatch):
    """A layer_norm's / rms_norm's weight and bias gradients (summed over the rows): after the first calls, the
    native node's backward runs the fused group (the sums in the row kernel), not Python's backward; eager's
    gradients on fresh inputs every call."""
    ff = fuser.fuse(torch.jit.script(fn))
    handed = _python_backwards(monkeypatch)
    for step in range(5):
        before, handed_before = _stats()["fused_backwards"], len(handed)
        y = _check_step(ff, fn, _norm_args(fn, (9, 48), dtype))
        if step >= 2:  # (the profiling executor's first calls run unfused)
            assert y.grad_fn.name() == "FusedGroupBackward"
            assert _stats()["fused_backwards"] == before + 1 and len(handed) == handed_before


def test_native_fused_backward_follows_shapes_dtypes_and_requires_grad(monkeypatch):
    """The prepared backward is per signature: another shape, dtype, or set of inputs requiring grad (the bias's
    gradient alone summed, or x's alone: nothing summed) gets its own, each with eager's gradients, and the first
    again keeps its own."""
    ff = fuser.fuse(torch.jit.script(_ln_affine))
    variants = [((9, 48), torch.float32, (True, True, True)), ((2, 3, 48), torch.float32, (True, True, True)),
                ((9, 48), torch.float32, (True, False, True)), ((9, 48), torch.float32, (True, False, False)),
                ((9, 48), torch.float64, (True, True, True)), ((9, 48), torch.float32, (False, True, False)),
                ((9, 48), torch.float32, (True, True, True))]
    for shape, dtype, wants in variants:
        for _ in range(3):
            _check_step(ff, _ln_affine, _norm_args(_ln_affine, shape, dtype, wants))
    before = _stats()["fused_backwards"]
    _check_step(ff, _ln_affine, _norm_args(_ln_affine, (9, 48), torch.float32))
    assert _stats()["fused_backwards"] == before + 1


def test_native_fused_backward_where_its_kernel_does_not_serve(monkeypatch):
    """float32 rows past fuser.rows.plan.CPU_MAX_SUMMED elements, set here (the fused row kernel falls back there):
    the native backward runs the split Python's backward would (the row group, then the column group), with eager's
    gradients; an output gradient of another layout (stride 0) than the one prepared runs the fused group from
    Python once, then natively, eager's gradients."""
    import sys
    CPU_MAX_SUMMED = 1 << 18
    monkeypatch.setattr(sys.modules["fuser.rows.plan"], "CPU_MAX_SUMMED", CPU_MAX_SUMMED)
    ff = fuser.fuse(torch.jit.script(_ln_affine))
    handed = _python_backwards(monkeypatch)
    rows = CPU_MAX_SUMMED // 48 + 1
    for step in range(4):
        before, handed_before = _stats(), len(handed)
        _check_step(ff, _ln_affine, _norm_args(_ln_affine, (rows, 48), torch.float32))
        after = _stats()
        assert after["fused_backwards"] == before["fused_backwards"]
        if step >= 2:  # (the profiling executor's first calls run unfused)
            assert len(handed) == handed_before and after["split_backwards"] == before["split_backwards"] + 1
            assert after["column_sums"] == before["column_sums"] + 1
    for _ in range(3):
        args = _norm_args(_ln_affine, (9, 48), torch.float32)
        _check_step(ff, _ln_affine, args, gy=torch.randn(48).expand(9, 48))


def test_native_fused_backward_under_create_graph():
    """A backward that autograd records (create_graph: grad mode on in it) runs the plain backward group and sums
    after it, as Python's backward does: eager's second derivatives."""
    ff = fuser.fuse(torch.jit.script(_ln_affine))
    for _ in range(4):
        x, w, b = _norm_args(_ln_affine, (7, 48), torch.float64)
        gy = torch.randn(7, 48, dtype=torch.float64)
        gx, gw, gb = torch.autograd.grad(ff(x, w, b), (x, w, b), gy, create_graph=True)
        (ggx,) = torch.autograd.grad((gx * gw).sum() + gb.sum() * 0.5 + (gw * gw).sum(), x)
        xr, wr, br = _fresh([x, w, b])
        rx, rw, rb = torch.autograd.grad(_ln_affine(xr, wr, br), (xr, wr, br), gy, create_graph=True)
        (rgx,) = torch.autograd.grad((rx * rw).sum() + rb.sum() * 0.5 + (rw * rw).sum(), xr)
        for g, r in [(gx, rx), (gw, rw), (gb, rb), (ggx, rgx)]:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_native_fused_backward_from_several_threads():
    """Threads released together on one prepared function: each its own shapes' calls, eager's gradients."""
    ff = fuser.fuse(torch.jit.script(_ln_affine))
    for _ in range(3):
        _check_step(ff, _ln_affine, _norm_args(_ln_affine, (9, 48), torch.float32))
    count = iter(range(4))

    def work():
        k = next(count)
        for j in range(20):
            _check_step(ff, _ln_affine, _norm_args(_ln_affine, ((9, 48), (4, 48))[(k + j) % 2], torch.float32))

    run_in_threads(4, work)


# ---- broadcast inputs' gradients summed by column groups: the native backward runs the main and column groups

def _gelu_two(x, b, c):
    return _gelu_bias(x, b) * c


def _args(shapes, dtype, device="cpu", wants=None):
    wants = wants or (True,) * len(shapes)
    return [torch.randn(s, dtype=dtype, device=device).requires_grad_(w) for s, w in zip(shapes, wants)]


# (function, input shapes, column groups per backward: 0 where nothing is summed by one, sum_to_size as before)
_BROADCASTS = [(_gelu_bias, [(8, 128), (128,)], 1), (_gelu_bias, [(8, 128), (1, 128)], 1),
               (_gelu_bias, [(4, 8, 16), (1, 1, 1)], 1), (_gelu_bias, [(4, 8, 16), ()], 1),
               (_gelu_bias, [(8, 128), (8, 1)], 0),  # a column vector: summed over the last dim, not leading
               (_gelu_two, [(6, 5, 16), (16,), (5, 16)], 2),  # summed over (0, 1) and over (0,): two column groups
               (_gelu_two, [(6, 5, 16), (16,), (1, 16)], 1)]  # both over (0, 1): one column group, two sums


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(_BROADCASTS)))
def test_broadcast_gradients_are_summed_by_the_native_backward(case, dtype, device, column_sums_setting,
                                                                 monkeypatch):
    """An input broadcast over leading dims (a bias, a scalar-shaped one, two of them): after the first calls the
    native node's backward runs the backward's main group and the column groups itself, not Python's backward;
    eager's gradients on fresh inputs every call. On CUDA this is the split with the fused form turned off
    (``settings.cuda_column_sums``); the fused form has its own test below."""
    fn, shapes, n_columns = _BROADCASTS[case]
    if device == "cuda":
        column_sums_setting(False)
    ff = fuser.fuse(torch.jit.script(fn))
    handed = _python_backwards(monkeypatch)
    for step in range(5):
        before, handed_before = _stats(), len(handed)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else None  # (rounded once, from float)
        y = _check_step(ff, fn, _args(shapes, dtype, device), tol=tol)
        if step >= 2:  # (the profiling executor's first calls run unfused)
            after = _stats()
            assert y.grad_fn.name() == "FusedGroupBackward" and len(handed) == handed_before
            assert after["column_sums"] - before["column_sums"] == n_columns
            assert after["split_backwards"] - before["split_backwards"] == int(n_columns > 0)


def test_native_summed_backward_follows_requires_grad_and_shapes(monkeypatch):
    """The prepared backward is per signature: the bias alone, x alone (nothing summed), c alone, another shape, then
    the first again, each with eager's gradients, natively; the first keeps its own. The bias alone with c of
    [5, 16] reads c in its column group, which no column kernel serves (c does not walk the summed dims with one
    stride): Python's backward runs those, as before."""
    ff = fuser.fuse(torch.jit.script(_gelu_two))
    handed = _python_backwards(monkeypatch)
    shapes = [(6, 5, 16), (16,), (5, 16)]
    variants = [(shapes, (True, True, True), True), (shapes, (False, True, False), False),
                ([(6, 5, 16), (16,), (1, 16)], (False, True, False), True), (shapes, (True, False, False), True),
                (shapes, (False, False, True), True), ([(3, 16), (16,), (16,)], (True, True, True), True),
                (shapes, (True,) * 3, True)]
    for s, wants, natively in variants:
        for step in range(3):
            handed_before = len(handed)
            _check_step(ff, _gelu_two, _args(s, torch.float64, wants=wants))
            if step:
                assert (len(handed) == handed_before) == natively, (s, wants)
    before = _stats()
    _check_step(ff, _gelu_two, _args(shapes, torch.float64))
    after = _stats()
    assert after["column_sums"] == before["column_sums"] + 2 and after["split_backwards"] == before["split_backwards"] + 1


def test_native_summed_backward_with_an_output_gradient_of_another_layout():
    """An output gradient that is a stride-0 expansion (not the layout prepared): eager's gradients."""
    ff = fuser.fuse(torch.jit.script(_gelu_bias))
    for _ in range(4):
        _check_step(ff, _gelu_bias, _args([(8, 128), (128,)], torch.float64),
                    gy=torch.randn(128, dtype=torch.float64).expand(8, 128))


def test_native_summed_backward_under_create_graph(monkeypatch):
    """A backward autograd records (create_graph: grad mode on in it) runs the plain backward group and sums after
    it, as Python's backward does, not the column groups: eager's second derivatives."""
    ff = fuser.fuse(torch.jit.script(_gelu_bias))
    for _ in range(4):
        x, b = _args([(7, 48), (48,)], torch.float64)
        gy = torch.randn(7, 48, dtype=torch.float64)
        before = _stats()["split_backwards"]
        gx, gb = torch.autograd.grad(ff(x, b), (x, b), gy, create_graph=True)
        assert _stats()["split_backwards"] == before
        (ggx,) = torch.autograd.grad((gx * gx).sum() + (gb * gb).sum(), x)
        xr, br = _fresh([x, b])
        rx, rb = torch.autograd.grad(_gelu_bias(xr, br), (xr, br), gy, create_graph=True)
        (rgx,) = torch.autograd.grad((rx * rx).sum() + (rb * rb).sum(), xr)
        for g, r in [(gx, rx), (gb, rb), (ggx, rgx)]:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_native_summed_backward_from_several_threads():
    """Threads released together on one prepared function: each its own shapes' calls, eager's gradients."""
    ff = fuser.fuse(torch.jit.script(_gelu_two))
    shapes = ([(6, 5, 16), (16,), (5, 16)], [(4, 16), (16,), (1, 16)])
    for s in shapes:
        for _ in range(3):
            _check_step(ff, _gelu_two, _args(s, torch.float32))
    before = _stats()["split_backwards"]
    count = iter(range(4))

    def work():
        k = next(count)
        for j in range(20):
            _check_step(ff, _gelu_two, _args(shapes[(k + j) % 2], torch.float32))

    run_in_threads(4, work)
    assert _stats()["split_backwards"] == before + 80


# ---- CUDA: the native backward launches the column kernels and the row kernels with column sums itself

def _ln_long(x, w, b):
    return torch.layer_norm(x, [16384], None, None, 1e-5) * w + b


def _rms_long(x, w):
    return torch.rms_norm(x, [16384], None, 1e-6) * w


def _ln_longer(x, w, b):
    return torch.layer_norm(x, [65536], None, None, 1e-5) * w + b


@pytest.fixture
def column_sums_setting(monkeypatch):
    """Sets ``settings.cuda_column_sums`` for a test; the prepared signatures are forgotten before and after (they
    hold the backward chosen under the setting they were prepared with)."""
    from fuser import settings

    def choose(value: bool):
        monkeypatch.setattr(settings, "cuda_column_sums", value)
        native.clear()

    yield choose
    native.clear()


def _steady(before: dict, after: dict, handed: list, handed_before: int) -> None:
    """A step the native path served whole: no call handed over (neither to prepare nor for Python), no backward
    run by Python."""
    assert after["handed"] == before["handed"] and after["misses"] == before["misses"], (before, after)
    assert len(handed) == handed_before


def _cuda_tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else None  # (rounded once, from float)


# (function, [rows, cols], whether the fused row kernel can take the sums: the row in one trip (True), or in several
# whose sums (this many) fit the block's shared memory (16384 float32 or bfloat16 elements on an H100/H200:
# CudaShape.trip_sums); 65536 never)
_CUDA_NORMS = [(_ln_affine, (9, 48), True), (_rms_weight, (9, 48), True), (_ln_affine, (300, 48), True),
               (_ln_long, (8, 16384), 2), (_rms_long, (8, 16384), 1), (_ln_longer, (4, 65536), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("in_row", (True, False), ids=("in_row_on", "in_row_off"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(_CUDA_NORMS)),
                         ids=[f"{f.__name__}-{r}x{n}" for f, (r, n), _ in _CUDA_NORMS])
def test_cuda_norm_training_steps_run_natively(case, dtype, in_row, column_sums_setting, monkeypatch):
    """layer_norm(x) * w + b and rms_norm(x) * w training steps on CUDA: after the first calls the native backward
    launches the fused row kernel with its partial rows and second kernel (in-row sums on, a row of one trip or of
    several trips whose sums fit in shared memory), or the split (the row kernel, then the column kernel of the weight's and bias's sums), without handing anything to
    Python: bfloat16 too, as the forward saves the statistics in float32 (the split reads them unrounded; it formed
    them in bfloat16 before, and bfloat16 rows kept Python's backward). Eager's float64 gradients on fresh inputs
    every call."""
    fn, shape, one_trip = _CUDA_NORMS[case]
    column_sums_setting(in_row)
    ff = fuser.fuse(torch.jit.script(fn))
    handed = _python_backwards(monkeypatch)
    fused = in_row and (one_trip is True or (one_trip and trip_sums_fit(one_trip, shape[-1])))
    n_params = 1 if fn in (_rms_weight, _rms_long) else 2
    for step in range(6):
        args = _args([shape] + [shape[-1:]] * n_params, dtype, "cuda")
        before, handed_before = _stats(), len(handed)
        y = _check_step(ff, fn, args, tol=_cuda_tol(dtype))
        torch.cuda.synchronize()
        after = _stats()
        if step < 3:  # (the profiling executor's first calls run unfused; then the steps' groups are prepared)
            continue
        assert y.grad_fn.name() == "FusedGroupBackward"
        grew = {k: after[k] - before[k] for k in ("fused_backwards", "cuda_row_sums", "split_backwards",
                                                   "column_sums", "cuda_column_kernels")}
        if fused:
            _steady(before, after, handed, handed_before)
            assert grew == dict(fused_backwards=1, cuda_row_sums=1, split_backwards=0, column_sums=0,
                                cuda_column_kernels=0), grew
        else:
            _steady(before, after, handed, handed_before)
            assert grew == dict(fused_backwards=0, cuda_row_sums=0, split_backwards=1, column_sums=1,
                                cuda_column_kernels=1), grew


def _cuda_broadcast_ids():
    return [f"{f.__name__}-{'-'.join('x'.join(map(str, s)) or 'scalar' for s in shapes)}" for f, shapes, _ in
            _BROADCASTS]


# per case of _BROADCASTS, the column kernels that run (a sum over every dim, of a bias shaped [1, 1, 1] or [], is a
# row kernel over one row), and (fused forms, column groups) per backward: on CUDA a pointwise backward takes the
# fused form (grad_sums._fused_first) where one kernel takes its sums, the split where they are over two sets of dims
_COLUMN_KERNELS = (1, 1, 0, 0, 0, 2, 1)
_CUDA_SUMS = ((1, 0), (1, 0), (1, 0), (1, 0), (0, 0), (0, 2), (1, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(_BROADCASTS)), ids=_cuda_broadcast_ids())
def test_cuda_broadcast_gradients_summed_by_native_column_kernels(case, dtype, monkeypatch):
    """gelu(x + bias) (and times a third input) training steps on CUDA: the native backward runs the fused form (one
    kernel writes x's gradient and sums the bias's) or the main group and the column groups itself, launching the
    column kernels (cuda_column_kernels grows by those), nothing handed to Python in the steady state; eager's float64
    gradients on fresh inputs every call."""
    fn, shapes, _ = _BROADCASTS[case]
    n_fused, n_columns = _CUDA_SUMS[case]
    ff = fuser.fuse(torch.jit.script(fn))
    handed = _python_backwards(monkeypatch)
    for step in range(6):
        before, handed_before = _stats(), len(handed)
        y = _check_step(ff, fn, _args(shapes, dtype, "cuda"), tol=_cuda_tol(dtype))
        torch.cuda.synchronize()
        after = _stats()
        if step >= 3:
            assert y.grad_fn.name() == "FusedGroupBackward"
            _steady(before, after, handed, handed_before)
            assert after["cuda_column_kernels"] - before["cuda_column_kernels"] == _COLUMN_KERNELS[case]
            assert after["fused_backwards"] - before["fused_backwards"] == n_fused
            assert after["column_sums"] - before["column_sums"] == n_columns


@pytest.mark.gpu
@pytest.mark.parametrize("in_row", (True, False), ids=("in_row_on", "in_row_off"))
def test_cuda_native_summed_backward_on_a_side_stream(in_row, column_sums_setting, monkeypatch):
    """Training steps on a side stream whose inputs are written after a long sleep queued on it: the native launches
    (the row kernel with partial rows and its second kernel, or the column kernels, and the buffers they allocate)
    go on torch's current stream, so they read the inputs once written and the results equal eager's; launched on
    another stream they would race the sleep."""
    column_sums_setting(in_row)
    fl = fuser.fuse(torch.jit.script(_ln_affine))
    fg = fuser.fuse(torch.jit.script(_gelu_bias))
    handed = _python_backwards(monkeypatch)
    for _ in range(4):  # prepared on the default stream
        _check_step(fl, _ln_affine, _args([(300, 48), (48,), (48,)], torch.float32, "cuda"))
        _check_step(fg, _gelu_bias, _args([(300, 48), (48,)], torch.float32, "cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    before = _stats()
    handed_before = len(handed)
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.cuda._sleep(20_000_000)  # (tens of milliseconds of the side stream before the inputs exist)
            ln_args = _args([(300, 48), (48,), (48,)], torch.float32, "cuda")
            gelu_args = _args([(300, 48), (48,)], torch.float32, "cuda")
            _check_step(fl, _ln_affine, ln_args)
            _check_step(fg, _gelu_bias, gelu_args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    after = _stats()
    _steady(before, after, handed, handed_before)
    grew = {k: after[k] - before[k] for k in ("cuda_row_sums", "cuda_column_kernels")}
    assert grew == (dict(cuda_row_sums=3, cuda_column_kernels=3) if in_row
                    else dict(cuda_row_sums=0, cuda_column_kernels=6)), grew


def _cuda_record_tail(rec: list) -> tuple:
    """A CUDA launch record read as hotpath.cpp's parse reads it (from the function on): (head, align, raw bytes,
    form, buffers, later kernels), after checking its last value, the random flag, is 0 (these kernels draw no
    random numbers)."""
    head, rest = rec[:10], rec[10:]
    align, rest = rest[1:1 + rest[0]], rest[1 + rest[0]:]
    raw, rest = bytes(rest[1:1 + rest[0]]), rest[1 + rest[0]:]
    form, rest = rest[0], rest[1:]
    temps, rest = [tuple(rest[1 + 2 * j:3 + 2 * j]) for j in range(rest[0])], rest[1 + 2 * rest[0]:]
    then = [tuple(rest[1 + 5 * j:6 + 5 * j]) for j in range(rest[0])]
    assert len(rest) == 1 + 5 * rest[0] + 1 and rest[-1] == 0
    return head, align, raw, form, temps, then


def test_cuda_records_of_row_sums_and_column_kernels(monkeypatch):
    """The records of the CUDA launches the native backward makes, built on the CPU from CUDA plans with stand-in
    loaded kernels: a row kernel with column sums (its grid and slots from the rows, the slots in the argument bytes,
    a float32 partial-row buffer [slots, cols] per sum whose pointer follows the outputs', then the second kernel);
    a column kernel split along its rows (the float64 workspace, stage 0 in the bytes, then stage 1 written at the
    struct's stage field)."""
    from types import SimpleNamespace

    from fuser import autodiff, grad_sums, ir
    from fuser.cuda import launch as cuda_launch
    from fuser.kernel_cache import STORE
    from fuser.native import record
    from fuser.rows import RowGeometry, launch, outer_launch
    from fuser.rows.plan import plan as row_plan
    monkeypatch.setattr(cuda_launch, "primary_context_handle", lambda index: 0x77)
    fn, second = SimpleNamespace(_function_ptr=0x1000, device_index=0), SimpleNamespace(_function_ptr=0x2000)

    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    spec = STORE.get(STORE.register(b.build([b.add("aten::layer_norm", x, (40,), w, c, 1e-5, True)])))
    args = [torch.randn(300, 40), torch.randn(40), torch.randn(40)]
    sig = tuple((a.dtype, False) for a in args)
    bw = autodiff.backward_for(spec, (True,) * 3, (True,), sig)
    shapes = [a.shape for a in args]
    bargs = autodiff.backward_args(spec, bw, args, [torch.randn(300, 40)], shapes)
    fused = grad_sums.fused_for(bw, grad_sums.plan(spec, bw, shapes, args[0].shape, sig, bargs))
    p = row_plan(fused.spec, bargs, target="cuda")
    assert p.key.sums == (1, 2), p
    backend = object.__new__(launch.RowCudaKernel)
    n_in, n_out = len(p.tensors), len(p.out_dtypes)
    backend.kernel, backend.second, backend.shape, backend.sums = fn, second, p.key.shape, p.key.sums
    backend.struct = launch.args_struct(n_in, n_in + n_out + 2, len(p.scalars))
    backend.block, backend.rows_per_block = p.key.shape.block, p.key.shape.block // p.key.shape.tpr
    backend.parts_blocks, backend.max_blocks = 3, 3 * launch.ROW_WAVES  # (few blocks: several rows a slot)
    geo = RowGeometry(p, launch.RowKernel("k", "", "cuda", tuple(p.out_dtypes), backend))
    outputs = geo.new_outputs()
    rec, _, owner = record._row_or_column_cuda(geo, True, p.tensors, p.scalars, outputs, [], [])
    head, align, raw, form, temps, then = _cuda_record_tail(rec)
    grid, slots = launch.part_layout(300, p.key.shape, 3)
    # the block's rows' slots in shared memory, added by the block before it writes one partial row
    assert p.key.shape.sums_shared and backend.rows_per_block > 1
    assert owner is backend and grid == 3 and slots == 3
    assert head[:7] == [0x1000, backend.block, 0, grid, grid, int(p.vec_ok), 0x77] and len(align) == n_in + n_out
    assert form == record.FORM_ROW_SUMS and then == [(0x2000, launch.parts_grid(40), launch.PARTS_BLOCK, -1, 0)]
    assert temps == [(record.scalar_type(torch.float32), slots * 40)] * 2
    a = backend.struct.from_buffer_copy(raw)
    assert (a.rows, a.cols, a.slots) == (300, 40, slots) and list(a.ptrs[n_in + n_out:]) == [None, None]
    assert head[7] == backend.struct.ptrs.offset and head[7] + 8 * (len(align) + len(temps)) <= len(raw)
    # a vectors-only kernel (fuser.rows.plan.RowKey.steps, with its kernel for launches without vectors): the vector
    # field says so, and hotpath.cpp hands a call whose pointers are not aligned to Python
    backend.any_launch = launch.AnyLaunch(fused.spec, launch.any_plan(p), launch.build)
    rec, _, _ = record._row_or_column_cuda(geo, True, p.tensors, p.scalars, outputs, [], [])
    assert _cuda_record_tail(rec)[0][5] == record.VECTORS_ONLY == 2
    # a staged row kernel (fuser.rows.shape.CudaShape.staged): its launch's shared memory, a block's rows of them
    b = ir.Builder()
    x = b.input()
    sspec = STORE.get(STORE.register(b.build([b.add("aten::softmax.int", b.call("aten::mul", x, 0.5), -1, None)])))
    sargs = [torch.randn(20, 65536, dtype=torch.bfloat16)]
    p = row_plan(sspec, sargs, target="cuda")
    assert p.key.shape.staged == (0,) and launch.plan_stage_bytes(p) == 65536 * 2
    backend = object.__new__(launch.RowCudaKernel)
    backend.kernel, backend.second, backend.shape, backend.sums = fn, None, p.key.shape, ()
    backend.struct = launch.args_struct(1, 2, len(p.scalars))
    backend.block, backend.rows_per_block = p.key.shape.block, 1
    backend.stage_sizes, backend._stage_blocks, backend.sms = (2,), {65536 * 2: 1}, 132  # (a wave: one block)
    geo = RowGeometry(p, launch.RowKernel("k", "", "cuda", tuple(p.out_dtypes), backend))
    rec, _, _ = record._row_or_column_cuda(geo, True, p.tensors, p.scalars, geo.new_outputs(), [], [])
    grid = min(20, launch.ROW_WAVES)  # (ROW_WAVES waves of it, at most a block a row)
    assert _cuda_record_tail(rec)[0][:5] == [0x1000, 1024, 65536 * 2, grid, grid]
    # a row of several trips with column sums (CudaShape.trip_sums): its launch's shared memory holds the staged rows,
    # then a slot a column for each sum; its grid is one wave with that shared memory
    b = ir.Builder()
    x, w, c = b.input(), b.input(), b.input()
    spec = STORE.get(STORE.register(b.build([b.add("aten::layer_norm", x, (20000,), w, c, 1e-5, True)])))
    args = [torch.randn(30, 20000), torch.randn(20000), torch.randn(20000)]
    bw = autodiff.backward_for(spec, (True,) * 3, (True,), sig)
    bargs = autodiff.backward_args(spec, bw, args, [torch.randn(30, 20000)], [a.shape for a in args])
    fused = grad_sums.fused_for(bw, grad_sums.plan(spec, bw, [a.shape for a in args], args[0].shape, sig, bargs))
    p = row_plan(fused.spec, bargs, target="cuda")
    sh = p.key.shape
    assert sh.trip_sums and p.key.sums == (1, 2) and 20000 > sh.tpr * sh.items and sh.block == sh.tpr, p
    trip = sh.tpr * sh.items
    smem = launch.plan_stage_bytes(p)
    staged = sum(-(-20000 * 4 // 16) * 16 for _ in sh.staged)
    assert smem == staged + 2 * -(-20000 // trip) * trip * 4
    backend = object.__new__(launch.RowCudaKernel)
    backend.kernel, backend.second, backend.shape, backend.sums = fn, second, sh, p.key.sums
    backend.struct = launch.args_struct(len(p.tensors), len(p.tensors) + len(p.out_dtypes) + 2, len(p.scalars))
    backend.block, backend.rows_per_block = sh.block, 1
    backend.stage_sizes, backend._stage_blocks, backend.sms = (4,) * len(sh.staged), {smem: 4}, 132
    backend.parts_blocks, backend.max_blocks = 99, 99 * launch.ROW_WAVES  # (not a trip sums kernel's: its smem's)
    geo = RowGeometry(p, launch.RowKernel("k", "", "cuda", tuple(p.out_dtypes), backend))
    rec, _, _ = record._row_or_column_cuda(geo, True, p.tensors, p.scalars, geo.new_outputs(), [], [])
    head, _, raw, form, temps, then = _cuda_record_tail(rec)
    assert head[:5] == [0x1000, sh.block, smem, 4, 4] and form == record.FORM_ROW_SUMS
    assert temps == [(record.scalar_type(torch.float32), 4 * 20000)] * 2

    b = ir.Builder()
    x, y = b.input(), b.input()
    cspec = STORE.get(STORE.register(b.build([b.add(grad_sums.SUM, b.call("aten::mul", x, y), (0,), True, None)])))
    cargs = [torch.randn(4096, 64), torch.randn(4096, 64)]
    p = row_plan(cspec, cargs, target="cuda")
    assert isinstance(p, outer_launch.OuterPlan), p
    backend = object.__new__(outer_launch.OuterCudaKernel)
    backend.kernel, backend.n_red, backend.max_blocks, backend.n_sm, backend._grids = fn, 1, 65535, 132, {}
    backend.per_sm = outer_launch.BLOCKS_PER_SM
    backend.struct = outer_launch.args_struct(2, 2 + 1 + 1, len(p.scalars))
    geo = outer_launch.OuterGeometry(p, outer_launch.OuterKernel("k", "", "cuda", tuple(p.out_dtypes), backend))
    rec, _, _ = record._row_or_column_cuda(geo, False, p.tensors, p.scalars, [torch.empty(1, 64)], [], [])
    head, align, raw, form, temps, then = _cuda_record_tail(rec)
    g = outer_launch.cuda_grid(4096, 64, 1, 132, 65535, p.key.cvec)
    assert g.grid1 > 0 and g.workspace > 0 and geo.hot_path
    assert head[:6] == [0x1000, cuda_launch.BLOCK_SIZE, 0, g.grid0, g.grid0, int(p.key.cvec > 1)] and len(align) == 3
    assert form == record.FORM_COLUMNS and temps == [(record.scalar_type(torch.float64), g.workspace)]
    assert then == [(0x1000, g.grid1, cuda_launch.BLOCK_SIZE, backend.struct.stage.offset, 1)]
    a = backend.struct.from_buffer_copy(raw)
    assert (a.red, a.cols, a.splits, a.stage, a.ptrs[3]) == (4096, 64, g.splits, 0, None)
    # a whole-vector column kernel (fuser.rows.outer.OuterKey.vectors, with its element by element kernel for
    # launches without vectors): the vector field says so, and hotpath.cpp hands a misaligned call to Python
    assert p.key.vectors
    backend.any_launch = launch.AnyLaunch(cspec, outer_launch.any_plan(p), outer_launch.build)
    rec, _, _ = record._row_or_column_cuda(geo, False, p.tensors, p.scalars, [torch.empty(1, 64)], [], [])
    assert _cuda_record_tail(rec)[0][5] == record.VECTORS_ONLY


def _sum0(x, y):
    return (x * y).sum(0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_column_kernels_are_served_natively_without_autograd(dtype):
    """A fused sum over dim 0 on CUDA: repeated calls launched natively (cuda_column_kernels grows per call), for
    columns in vectors, a strided input, odd columns, and rows split over blocks (a workspace and stage 1); every
    call the same bits, float64 eager's sums within the rounding of the dtype; a sum over no rows goes to Python
    (its zeros)."""
    f = fuser.fuse(torch.jit.script(_sum0))
    for x, y in ((torch.randn(8, 4096), torch.randn(8, 4096)), (torch.randn(64, 2 * 77)[:, ::2], torch.randn(77)),
                 (torch.randn(1000, 33), torch.randn(1000, 33)), (torch.randn(4096, 64), torch.randn(4096, 64))):
        x, y = x.to("cuda", dtype), y.to("cuda", dtype)
        with torch.no_grad():
            for _ in range(3):  # (the profiling executor's first calls run unfused)
                f(x, y)
            before = _stats()
            outs = [f(x, y) for _ in range(3)]
            torch.cuda.synchronize()
            after = _stats()
        assert after["hits"] - before["hits"] == 3 and after["cuda_column_kernels"] - before["cuda_column_kernels"] == 3
        want = (x.double() * y.double()).sum(0)
        rows = x.shape[0]
        tol = dict(rtol=2e-2, atol=2e-2 * rows ** 0.5) if dtype == torch.bfloat16 else dict(rtol=1e-5,
                                                                                               atol=1e-5 * rows ** 0.5)
        for out in outs:
            assert out.dtype == dtype and out.shape == want.shape
            torch.testing.assert_close(out.double(), want, **tol)
            assert torch.equal(out, outs[0])
    with torch.no_grad():
        empty = [torch.randn(0, 6, dtype=dtype, device="cuda"), torch.randn(0, 6, dtype=dtype, device="cuda")]
        for _ in range(4):
            torch.testing.assert_close(f(*empty), _sum0(*empty))


@pytest.mark.parametrize("device", DEVICES)
def test_phase_clock_counts_served_calls_only_while_on(device):
    """native.phases: off by default (served calls add nothing); on, every served call adds one call and a
    positive time to its phases (a training call's to record), a call handed to Python (a new signature) adds
    nothing; reading resets the counts."""
    ff = fuser.fuse(torch.jit.script(_gelu_bias))
    x, b = torch.randn(64, 96, device=device), torch.randn(96, device=device)
    _served(ff, x, b)
    native.phases(False)
    _served(ff, x, b, calls=3)
    off = native.phases(True)
    assert off["calls"] == 0 and not any(off[p] for p in native.PHASES)
    try:
        hits, _ = _served(ff, x, b, calls=5)
        got = native.phases(True)
        assert got["calls"] == hits == 5
        assert all(got[p] > 0 for p in native.PHASES if p != "record") and got["record"] == 0
        xt, bt = x.clone().requires_grad_(), b.clone().requires_grad_()
        for _ in range(3):
            ff(xt, bt).sum().backward()
        native.phases(True)
        before = _stats()["hits"]
        ff(xt, bt).sum().backward()
        got = native.phases(True)
        assert 1 <= got["calls"] <= _stats()["hits"] - before and got["record"] > 0  # (its backward's hits too)
        ff(x[:, :48], b[:48])  # a new signature: handed over, not served
        assert native.phases(True)["calls"] == 0
    finally:
        native.phases(False)


def _two_outputs(x, y):
    z = x * y + 1
    return torch.sigmoid(z), z * 2


@pytest.mark.gpu
def test_cuda_outputs_come_from_the_caching_allocator():
    """A served CUDA call's outputs come from torch's caching allocator on the current device and stream (called
    without the dispatcher): counted by memory_allocated and given back when dropped, the freed block taken again by
    the next call, two outputs in blocks of their own, resize_ as on an eager tensor, and a side stream's call
    correct."""
    ff = fuser.fuse(torch.jit.script(_two_outputs))
    x, y = torch.randn(1024, 1000, device="cuda"), torch.randn(1024, 1000, device="cuda")
    with torch.no_grad():
        _served(ff, x, y)
        wanted = _two_outputs(x, y)
        torch.cuda.synchronize()
        before, hits = torch.cuda.memory_allocated(), _stats()["hits"]
        a, b = ff(x, y)
        assert _stats()["hits"] == hits + 1
        assert torch.cuda.memory_allocated() - before >= 2 * x.numel() * 4
        for got, want in zip((a, b), wanted):
            assert got.device == x.device and got.untyped_storage().device == x.device
            # (not assert_close here: under compute-sanitizer its frames outlived it, holding both tensors)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        del a, b, got
        assert torch.cuda.memory_allocated() == before
        reserved = torch.cuda.memory_reserved()
        a, b = ff(x, y)
        assert torch.cuda.memory_reserved() == reserved  # the freed blocks, cached, taken again
        a.resize_(2048, 1000)  # grows through the same allocator, as an eager tensor's storage would
        assert a.untyped_storage().nbytes() >= 2048 * 1000 * 4
        del a, b
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            a, b = ff(x, y)
            for got, want in zip((a, b), _two_outputs(x, y)):
                assert_same(got, want)
        torch.cuda.synchronize()


def _mul_add(a, b, c):
    return a * b + c


def test_small_cpu_outputs_reuse_freed_blocks_and_resize_as_eager():
    """A small CPU output's block, once its tensor is dropped, is the next output's of its size class (the thread's
    block cache); an output still alive is never handed out again; an output resizes (up past its class, down) as
    an eager tensor does, keeping its values; and a large output comes from c10's allocator."""
    ff = fuser.fuse(torch.jit.script(_mul_add))
    a, b, c = (torch.randn(300) for _ in range(3))
    hits, out = _served(ff, a, b, c)
    assert hits >= 2
    with torch.no_grad():
        first = ff(a, b, c)
        addr = first.data_ptr()
        kept = ff(a, b, c)  # the first still alive: another block
        assert kept.data_ptr() != addr
        del first
        again = ff(a, b, c)
        assert again.data_ptr() == addr and again.data_ptr() % 64 == 0
        assert_same(again, _mul_add(a, b, c))
        want = again.clone()
        again.resize_(5000)  # past its 2 KB class: a new block, its first values kept
        assert_same(again[:300], want)
        again[300:] = 1.5
        assert torch.all(again[300:] == 1.5)
        again.resize_(10)
        assert_same(again, want[:10])
        big = [torch.randn(70000) for _ in range(3)]  # 280 KB: over the cache's largest class
        for _ in range(3):
            out = ff(*big)
        assert_same(out, _mul_add(*big))


def test_small_cpu_outputs_freed_on_other_and_exiting_threads():
    """Outputs made on one thread and dropped on another, by threads that exit with blocks in their caches: every
    live output has a block of its own and keeps eager's values, and the calls after go on giving eager's."""
    ff = fuser.fuse(torch.jit.script(_mul_add))
    a, b, c = (torch.randn(8, 16) for _ in range(3))
    _served(ff, a, b, c)
    want = _mul_add(a, b, c)
    handed = []

    def make():
        with torch.no_grad():
            outs = [ff(a, b, c) for _ in range(20)]
        handed.extend(outs[::2])  # freed on the main thread later

    for _ in range(3):
        run_in_threads(4, make)  # each thread exits with the blocks of the outputs it dropped in its cache
    assert len({o.data_ptr() for o in handed}) == len(handed) == 3 * 4 * 10
    for o in handed:
        assert_same(o, want)
    handed.clear()
    with torch.no_grad():
        for _ in range(50):
            assert_same(ff(a, b, c), want)


def test_block_cache_off_switch(tmp_path):
    """FUSER_CPU_BLOCK_CACHE=0: outputs from c10's allocator (the cache takes no block); on: a few blocks serve
    every call."""
    script = tmp_path / "blocks.py"
    script.write_text(
        "import torch, fuser\n"
        "from fuser import native\n"
        "assert native.ensure(block=True)\n"
        "def f(a, b, c):\n    return a * b + c\n"
        "ff = fuser.fuse(torch.jit.script(f))\n"
        "a, b, c = (torch.randn(100) for _ in range(3))\n"
        "with torch.no_grad():\n"
        "    outs = [ff(a, b, c) for _ in range(4)]\n"
        "    addr = outs[-1].data_ptr()\n"
        "    del outs\n"
        "    out = ff(a, b, c)\n"
        "assert torch.equal(out, f(a, b, c))\n"
        "print(native.stats()['hits'], native.stats()['new_blocks'])\n")
    for setting, blocks in (("0", lambda n: n == 0), ("1", lambda n: 1 <= n <= 4)):
        env = dict(os.environ, FUSER_CPU_BLOCK_CACHE=setting,
                   PYTHONPATH=os.path.dirname(os.path.dirname(fuser.__file__)))
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        hits, new_blocks = map(int, r.stdout.split())
        assert hits >= 2 and blocks(new_blocks), (setting, hits, new_blocks)
