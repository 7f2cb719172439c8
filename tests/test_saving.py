"""On the CPU a group's backward reads the transcendental values the cost model picks (fuser/saving.py) from its
forward, the forward writing those that are no output of its own as extra outputs: the call's structure (what is
saved, what the backward group still computes) and gradients equal to eager's on fresh random inputs (float64 for
bfloat16's reference), through Python's autograd Function and the native hot path."""
from __future__ import annotations

import pytest
import torch
from helpers import FUSED_BACKWARD, assert_close_to_float64, tolerances

import fuser
from fuser import autodiff, ir, native, settings
from fuser.kernel_cache import STORE

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")

DTYPES = (torch.float32, torch.bfloat16)
TRANSCENDENTAL = ("aten::sigmoid", "aten::tanh", "aten::exp")
_SPECS: dict = {}


def _lstm_spec():
    """The LSTM cell's tail: sigmoid/tanh of four gate chunks, cy, hy = o * tanh(cy); outputs hy, cy."""
    if "lstm" not in _SPECS:
        b = ir.Builder()
        i, f, g, o, cx = (b.input() for _ in range(5))
        i, f, g, o = b.call("aten::sigmoid", i), b.call("aten::sigmoid", f), b.call("aten::tanh", g), \
            b.call("aten::sigmoid", o)
        cy = b.call("aten::add", b.call("aten::mul", f, cx), b.call("aten::mul", i, g), 1)
        hy = b.call("aten::mul", o, b.call("aten::tanh", cy))
        _SPECS["lstm"] = STORE.get(STORE.register(b.build([hy, cy])))
    return _SPECS["lstm"]


def _lstm_eager(i, f, g, o, cx):
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return [torch.sigmoid(o) * torch.tanh(cy), cy]


def _lstm_cell(gates, cx):
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


def _bias_spec():
    """tanh(b) * x + exp(x), b a bias broadcast along the rows: tanh(b) stays recomputed (a saved one would be
    of b's shape, not the kernel's), exp(x) is read saved."""
    if "bias" not in _SPECS:
        b = ir.Builder()
        x, bias = b.input(), b.input()
        y = b.call("aten::add", b.call("aten::mul", b.call("aten::tanh", bias), x), b.call("aten::exp", x), 1)
        _SPECS["bias"] = STORE.get(STORE.register(b.build([y])))
    return _SPECS["bias"]


def _bias_eager(x, bias):
    return [torch.tanh(bias) * x + torch.exp(x)]


def _output_spec():
    """y = tanh(x) is an output, and y * z: the backward reads y from the output, no extra output."""
    if "output" not in _SPECS:
        b = ir.Builder()
        x, z = b.input(), b.input()
        y = b.call("aten::tanh", x)
        _SPECS["output"] = STORE.get(STORE.register(b.build([y, b.call("aten::mul", y, z)])))
    return _SPECS["output"]


def _output_eager(x, z):
    y = torch.tanh(x)
    return [y, y * z]


def _gates(dtype, batch=5, hidden=7):
    """Leaf gates and cx, and the gates' four chunks (views, as an LSTM's gates.chunk(4, 1) makes them)."""
    gates = torch.randn(batch, 4 * hidden, dtype=dtype, requires_grad=True)
    cx = torch.randn(batch, hidden, dtype=dtype, requires_grad=True)
    return gates, cx


def _ops(g: ir.Group) -> set:
    return {n.op for n in g.nodes}


def _call_and_backward(spec, args):
    call = autodiff.prepare_call(spec, list(args))
    assert call is not None
    bw = autodiff.backward_for(spec, call.needs, spec.all_outputs_defined, call.sig, False, call.chunks, call.save)
    return call, bw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lstm_backward_reads_the_saved_activations(dtype):
    """Every sigmoid and tanh is read saved: the four gate activations and tanh(cy) as extra outputs of the forward;
    the backward group computes none of them and still writes the gates' gradient whole (a cat of the chunks')."""
    spec = _lstm_spec()
    gates, cx = _gates(dtype)
    call, bw = _call_and_backward(spec, [*gates.chunk(4, 1), cx])
    transcendental = [n.out.id for n in spec.group.nodes if n.op in TRANSCENDENTAL]
    assert sorted(call.save) == sorted(transcendental) and len(transcendental) == 5
    assert call.forward is not spec and call.forward.group.outputs[:2] == spec.group.outputs
    assert [call.forward.group.producer(v).op for v in call.forward.group.outputs[2:]] == \
        ["aten::sigmoid", "aten::sigmoid", "aten::tanh", "aten::sigmoid", "aten::tanh"]
    assert not _ops(bw.spec.group) & set(TRANSCENDENTAL)
    assert set(bw.saved_outputs) == set(range(2, 7)) and set(call.saved_outputs) >= set(bw.saved_outputs)
    assert call.chunks and bw.cat_of  # the chunks' gradients: one cat output, the gates' gradient
    recompute = autodiff.backward_for(spec, call.needs, spec.all_outputs_defined, call.sig, False, call.chunks)
    assert set(TRANSCENDENTAL[:2]) <= _ops(recompute.spec.group)  # (what it reads instead of)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lstm_gradients_equal_eager(dtype):
    """Through chunks of one gates tensor (the whole gradient written by the backward) and through separate gate
    tensors (four gradients), every output gradient and only hy's, on fresh random inputs."""
    spec = _lstm_spec()
    for batch, hidden in [(5, 7), (1, 1), (33, 64)]:
        for chunked in (True, False):
            for only_hy in (False, True):
                gates, cx = _gates(dtype, batch, hidden)
                leaves = [gates, cx] if chunked else [*(c.detach().requires_grad_() for c in gates.chunk(4, 1)), cx]
                args = [*gates.chunk(4, 1), cx] if chunked else leaves
                outs = fuser.run_fusion(spec.key, args)
                assert all(o.grad_fn.name() in FUSED_BACKWARD for o in outs)
                gys = [torch.randn_like(o) for o in outs]
                pick = [0] if only_hy else [0, 1]
                got = torch.autograd.grad([outs[k] for k in pick], leaves, [gys[k] for k in pick])
                l64 = [t.detach().double().requires_grad_() for t in leaves]
                a64 = [*l64[0].chunk(4, 1), l64[1]] if chunked else l64
                ref = _lstm_eager(*a64)
                want64 = torch.autograd.grad([ref[k] for k in pick], l64, [gys[k].double() for k in pick])
                le = [t.detach().requires_grad_() for t in leaves]
                ae = [*le[0].chunk(4, 1), le[1]] if chunked else le
                ref = _lstm_eager(*ae)
                want = torch.autograd.grad([ref[k] for k in pick], le, [gys[k] for k in pick])
                assert_close_to_float64(got, want64, want, dtype)
                for o, r in zip(outs, _lstm_eager(*[a.detach() for a in ae])):
                    torch.testing.assert_close(o, r, **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_broadcast_value_stays_recomputed(dtype):
    """tanh(bias) would be a [cols] tensor, no output of the kernel's shape: recomputed; exp(x) is read saved. The
    bias's gradient is summed over the rows as before."""
    spec = _bias_spec()
    for rows, cols in [(6, 40), (1, 3), (64, 257)]:
        x = torch.randn(rows, cols, dtype=dtype, requires_grad=True)
        bias = torch.randn(cols, dtype=dtype, requires_grad=True)
        call, bw = _call_and_backward(spec, [x, bias])
        exp = next(n.out.id for n in spec.group.nodes if n.op == "aten::exp")
        assert call.save == (exp,)
        assert "aten::tanh" in _ops(bw.spec.group) and "aten::exp" not in _ops(bw.spec.group)
        (out,) = fuser.run_fusion(spec.key, [x, bias])
        gy = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, bias], gy)
        a64 = [t.detach().double().requires_grad_() for t in (x, bias)]
        want64 = torch.autograd.grad(_bias_eager(*a64), a64, gy.double())
        ae = [t.detach().requires_grad_() for t in (x, bias)]
        want = torch.autograd.grad(_bias_eager(*ae), ae, gy)
        assert_close_to_float64(got, want64, want, dtype)
    # a "bias" of x's own shape: tanh(bias) has the kernel's shape, and is read saved too
    x = torch.randn(8, dtype=dtype, requires_grad=True)
    call, _ = _call_and_backward(spec, [x, torch.randn(8, dtype=dtype, requires_grad=True)])
    assert len(call.save) == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_transcendental_output_is_read_from_the_output(dtype):
    spec = _output_spec()
    x = torch.randn(9, 16, dtype=dtype, requires_grad=True)
    z = torch.randn(9, 16, dtype=dtype, requires_grad=True)
    call, bw = _call_and_backward(spec, [x, z])
    assert len(call.save) == 1 and call.forward is spec and bw.saved_outputs == (0,)
    assert "aten::tanh" not in _ops(bw.spec.group)
    outs = fuser.run_fusion(spec.key, [x, z])
    gys = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, [x, z], gys)
    a64 = [t.detach().double().requires_grad_() for t in (x, z)]
    want64 = torch.autograd.grad(_output_eager(*a64), a64, [g.double() for g in gys])
    ae = [t.detach().requires_grad_() for t in (x, z)]
    want = torch.autograd.grad(_output_eager(*ae), ae, gys)
    assert_close_to_float64(got, want64, want, dtype)


def test_the_switch_and_ops_outside_the_model():
    spec = _lstm_spec()
    gates, cx = _gates(torch.float32)
    old = settings.cpu_save
    try:
        settings.cpu_save = False
        call = autodiff.prepare_call(spec, [*gates.chunk(4, 1), cx])
        assert call.save == () and call.forward is spec
    finally:
        settings.cpu_save = old
    b = ir.Builder()
    x, y = b.input(), b.input()
    relu = STORE.get(STORE.register(b.build([b.call("aten::mul", b.call("aten::relu", x), y)])))
    call = autodiff.prepare_call(relu, [torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)])
    assert call.save == ()
    # a group with reductions (a row kernel's backward) recomputes as before: softmax(x) * exp(x)
    b = ir.Builder()
    x = b.input()
    rows = STORE.get(STORE.register(b.build([b.call("aten::mul", b.add("aten::softmax.int", x, -1, None),
                                                    b.call("aten::exp", x))])))
    call = autodiff.prepare_call(rows, [torch.randn(4, 32, requires_grad=True)])
    assert call is not None and call.save == () and call.forward is rows


def test_double_backward_recomputes():
    """create_graph: the extra outputs have no history, so the backward recomputes them from the saved inputs
    (gradgradcheck against finite differences, float64)."""
    # (in float64 exp's saved value would cost more than its recompute; tanh's, of a full-shaped "bias", less)
    for spec, shapes in ((_lstm_spec(), [(3, 4)] * 5), (_bias_spec(), [(2, 5)] * 2), (_output_spec(), [(3, 4)] * 2)):
        ts = tuple(torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes)
        call = autodiff.prepare_call(spec, list(ts))
        assert call.save

        def fn(*args):
            return tuple(fuser.run_fusion(spec.key, list(args)))

        assert torch.autograd.gradcheck(fn, ts)
        assert torch.autograd.gradgradcheck(fn, ts)


# ------------------------------------------------------------------------------------------- native hot path

def _grads(fn, args, weights):
    outs = fn(*args)
    loss = sum((o * w).sum() for o, w in zip(outs, weights) if w is not None)
    return outs, torch.autograd.grad(loss, [a for a in args if a.requires_grad], create_graph=False)


@pytest.mark.skipif(not native.loaded(), reason=f"native hot path: {native.status()}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_training_calls_save_the_activations(dtype):
    """Repeated training steps of the scripted LSTM cell, served by the hot path (its kernel's extra outputs saved
    on the node, the backward group run there); another output-gradient pattern (Python's backward, which gets the
    extra outputs from the node) and double backward (recomputed) equal eager's too."""
    ff = fuser.fuse(torch.jit.script(_lstm_cell))
    for weights in [(1.0, 2.0), (None, 1.5), (0.5, None), (1.0, 2.0)]:
        for _ in range(3):
            gates, cx = _gates(dtype, 6, 16)
            before = native.stats()["hits"]
            outs, got = _grads(ff, [gates, cx], weights)
            served = native.stats()["hits"] > before
            assert len(outs) == 2
            l64 = [t.detach().double().requires_grad_() for t in (gates, cx)]
            _, want64 = _grads(_lstm_cell, l64, weights)
            le = [t.detach().requires_grad_() for t in (gates, cx)]
            _, want = _grads(_lstm_cell, le, weights)
            assert_close_to_float64(got, want64, want, dtype)
        assert served and outs[0].grad_fn.name() == "FusedGroupBackward"
    gates, cx = _gates(torch.float64, 3, 4)
    for _ in range(3):
        hy, cy = ff(gates, cx)
    assert hy.grad_fn.name() == "FusedGroupBackward"
    gg = torch.autograd.grad((hy * cy).sum(), (gates, cx), create_graph=True)
    got = torch.autograd.grad(sum((g * g).sum() for g in gg), (gates, cx))
    ref = _lstm_cell(gates, cx)
    gg = torch.autograd.grad((ref[0] * ref[1]).sum(), (gates, cx), create_graph=True)
    want = torch.autograd.grad(sum((g * g).sum() for g in gg), (gates, cx))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tolerances(torch.float64))
