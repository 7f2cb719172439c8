"""A group whose inputs are every chunk of one tensor (an LSTM cell's ``gates.chunk(4, 1)``): its backward writes
that tensor's gradient whole, as one cat output of the backward group, and autograd's edge goes straight to the
tensor (no split backward, no separate cat). Against eager's autograd on fresh random inputs, on the Python path
and the native hot path, the CUDA kernel through the host emulation, and the patterns that keep eager's split."""
import pytest
import torch
from helpers import FUSED_BACKWARD, assert_same

import fuser
from fuser import autodiff, compiler, executor, native
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower


def lstm_cell(gates, cx):
    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)
    cy = torch.sigmoid(forgetgate) * cx + torch.sigmoid(ingate) * torch.tanh(cellgate)
    hy = torch.sigmoid(outgate) * torch.tanh(cy)
    return hy, cy


def lstm_cell_mm(x, w, cx):
    gates = torch.mm(x, w)  # not a graph input: chunk motion's broadcasting_chunk chunks it
    return lstm_cell(gates * 1.0, cx)


GROUP_IR = """graph(%i : Tensor, %f : Tensor, %g : Tensor, %o : Tensor, %cx : Tensor):
  %one : int = prim::Constant[value=1]()
  %si : Tensor = aten::sigmoid(%i)
  %sf : Tensor = aten::sigmoid(%f)
  %tg : Tensor = aten::tanh(%g)
  %so : Tensor = aten::sigmoid(%o)
  %a : Tensor = aten::mul(%sf, %cx)
  %b : Tensor = aten::mul(%si, %tg)
  %cy : Tensor = aten::add(%a, %b, %one)
  %tc : Tensor = aten::tanh(%cy)
  %hy : Tensor = aten::mul(%so, %tc)
  return (%hy, %cy)"""


def _group_spec():
    """The LSTM cell's fusion group (the four chunks, then cx), registered."""
    return STORE.get(STORE.register(lower(torch.parse_ir(GROUP_IR))))


def _nodes(fn) -> set:
    """The names of every node of the autograd graph below ``fn``."""
    seen, todo, names = set(), [fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(f.name())
        todo.extend(g for g, _ in f.next_functions)
    return names


def _losses(outs, pattern, weights):
    return sum((o * w).sum() for o, w, use in zip(outs, weights, pattern) if use)


def _grads(fn, args, pattern, weights):
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    outs = fn(*leaves)
    grads = torch.autograd.grad(_losses(outs, pattern, weights), [a for a in leaves if a.requires_grad],
                                allow_unused=True)
    return outs, grads


PATTERNS = [(True, True), (True, False), (False, True)]  # hy and cy, only hy, only cy
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", PATTERNS, ids=["both", "hy", "cy"])
def test_lstm_cell_gradient_of_the_gates_is_written_whole(dtype, pattern, device):
    ff = fuser.fuse(torch.jit.script(lstm_cell))
    for batch, hidden in [(5, 7), (16, 32), (1, 1)]:
        weights = [torch.randn(batch, hidden, dtype=dtype, device=device) for _ in range(2)]
        for call in range(4):  # the first calls prepare (Python's Function), the later ones the native hot path's
            args = [torch.randn(batch, 4 * hidden, dtype=dtype, device=device),
                    torch.randn(batch, hidden, dtype=dtype, device=device)]
            outs, grads = _grads(ff, args, pattern, weights)
            ref_outs, ref = _grads(lstm_cell, args, pattern, weights)
            for o, r in zip(outs, ref_outs):
                assert_same(o, r)
            for g, r in zip(grads, ref):
                assert g.shape == r.shape and g.is_contiguous()
                assert_same(g, r)
            names = _nodes(outs[0].grad_fn if pattern[0] else outs[1].grad_fn)
            assert names & set(FUSED_BACKWARD)
            assert not any(n.startswith(("Split", "Cat")) for n in names), names  # the gates' edge is their own
        if native.loaded():
            assert outs[1].grad_fn.name() == "FusedGroupBackward"


def test_the_backward_group_writes_one_cat_output():
    """The backward group's outputs: the gates' gradient whole (a cat of the four chunks' gradients) and cx's."""
    spec = _group_spec()
    sig = ((torch.float32, False),) * 5
    bw = autodiff.backward_for(spec, (True,) * 5, (True, True), sig, False, ((1, (0, 1, 2, 3)),))
    assert bw.cat_of == ((0, 1, 2, 3),) and bw.grad_inputs == (0, 4)
    assert bw.spec.pieces[0] is not None and len(bw.spec.pieces[0]) == 4 and bw.spec.pieces[1] is None
    # without the chunk: four outputs, one per chunk, as before
    plain = autodiff.backward_for(spec, (True,) * 5, (True, True), sig)
    assert not plain.cat_of and plain.grad_inputs == (0, 1, 2, 3, 4)
    # a pattern where a chunk gets no gradient (only cy: the out gate's): the chunks stay apart (autodiff joins
    # them with zeros, as eager's split backward)
    cy_only = autodiff.backward_for(spec, (True,) * 5, (False, True), sig, False, ((1, (0, 1, 2, 3)),))
    assert not cy_only.cat_of and cy_only.grad_inputs == (0, 1, 2, 4)




@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_cuda_kernel_of_the_cat_backward_emulated(dtype):
    """The backward group's CUDA kernel (the cat output written piece by piece into its column slices), run on
    the host emulation: eager's float64 gradient of the gates. Pieces of 64 columns hold whole vectors: the
    vector path writes its slices (rows outputs) a vector at a time, and the scalar path as well."""
    spec = _group_spec()
    sig = ((dtype, False),) * 5
    bw = autodiff.backward_for(spec, (True,) * 5, (True, True), sig, False, ((1, (0, 1, 2, 3)),))
    assert bw.cat_of
    for batch, hidden in [(7, 13), (3, 64)]:
        gates = torch.randn(batch, 4 * hidden, dtype=dtype)
        cx = torch.randn(batch, hidden, dtype=dtype)
        grads = [torch.randn(batch, hidden, dtype=dtype) for _ in range(2)]
        g64, c64 = gates.double().requires_grad_(), cx.double().requires_grad_()
        want = torch.autograd.grad(lstm_cell(g64, c64), (g64, c64), [g.double() for g in grads])
        fwd = [*gates.chunk(4, 1), cx]
        bargs = autodiff.backward_args(spec, bw, fwd, grads, [t.shape for t in fwd])
        for vectorize in ((None,) if hidden % 8 else (True, False)):
            out = emulate.run_graph(bw.spec.group, bargs, vectorize=vectorize)
            assert out is not None, "fell back"
            whole, gcx = out
            assert whole.shape == gates.shape and whole.is_contiguous()
            assert_same(whole, want[0].to(dtype), dtype)
            assert_same(gcx, want[1].to(dtype), dtype)


def _cuda_source(spec, args) -> str:
    p = executor.plan(spec, args, target="cuda")
    return compiler.build(spec, p.arg_spec, load=lambda *_: (None, False), probe_device="cpu").source


def test_cuda_backward_takes_the_vector_loop_with_registers_for_its_vectors():
    """The backward's CUDA kernel writes the four column slices a vector at a time (rows outputs take the vector
    loop: before, such a kernel ran the per-element loop, a division walk per element), and in bfloat16, where 12
    tensors move in 16-byte vectors, asks __launch_bounds__ for 64 registers a thread, not the 32 of kernels with
    few vectors (the forward's: 7 tensors), under which it spilled (fuser/codegen/common.py)."""
    spec = _group_spec()
    for dtype, fwd_bound, bwd_bound in ((torch.bfloat16, "(256, 8)", "(256, 4)"), (torch.float32, "(256)", "(256)")):
        sig = ((dtype, False),) * 5
        bw = autodiff.backward_for(spec, (True,) * 5, (True, True), sig, False, ((1, (0, 1, 2, 3)),))
        gates, cx = torch.randn(6, 4 * 64, dtype=dtype), torch.randn(6, 64, dtype=dtype)
        fwd = [*gates.chunk(4, 1), cx]
        bargs = autodiff.backward_args(spec, bw, fwd, [torch.randn(6, 64, dtype=dtype)] * 2, [t.shape for t in fwd])
        back, front = _cuda_source(bw.spec, bargs), _cuda_source(spec, fwd)
        assert "if (args.vec)" in back and "(o0 + ooff0) = ov0;" in back and "(o4 + base) = ov4;" in back
        assert f"__launch_bounds__{bwd_bound}" in back and f"__launch_bounds__{fwd_bound}" in front


def _chunk_used_outside(gates, cx):
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy, torch.mm(i, cx.t())  # chunk i also feeds a matmul


def _three_of_four(gates, cx):
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.tanh(cy), cy


def _unequal(gates, cx):  # 7 columns: chunks of 2, 2, 2 and 1 (the last broadcast in the group)
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


def _view_of_view(gates, cx):
    return lstm_cell(gates.t(), cx)


FALLBACKS = {
    "chunk_used_outside": (_chunk_used_outside, lambda b, h: [(b, 4 * h), (b, h)], False),
    "three_of_four": (_three_of_four, lambda b, h: [(b, 4 * h), (b, h)], False),
    "broadcast_chunks": (lstm_cell, lambda b, h: [(1, 4 * h), (b, h)], False),
    "unequal_chunks": (_unequal, lambda b, h: [(b, 7), (b, 2)], False),
    "transposed_gates": (_view_of_view, lambda b, h: [(4 * h, b), (b, h)], False),
    "chunk_motion": (lstm_cell_mm, None, True),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_patterns_that_keep_eager_split_still_equal_eager(name, dtype):
    """Chunks also used outside the group, a chunk the group does not read, chunks broadcast in the group,
    chunks of unequal size, chunks of a view (their base is not the tensor chunked): eager's split and cat stay
    (where autograd's graph has them) and every gradient equals eager's. Chunk motion's chunks of a matmul
    result (fuser::broadcasting_chunk) take the whole-gradient path."""
    fn, shapes, whole = FALLBACKS[name]
    ff = fuser.fuse(torch.jit.script(fn))
    b, h = 6, 5
    for _ in range(3):
        if shapes is None:
            args = [torch.randn(b, 7, dtype=dtype), torch.randn(7, 4 * h, dtype=dtype), torch.randn(b, h, dtype=dtype)]
        else:
            args = [torch.randn(s, dtype=dtype) for s in shapes(b, h)]
        ref_outs = fn(*args)
        weights = [torch.randn_like(o) for o in ref_outs]
        outs, grads = _grads(ff, args, (True,) * len(ref_outs), weights)
        _, ref = _grads(fn, args, (True,) * len(ref_outs), weights)
        for o, r in zip(outs, ref_outs):
            assert_same(o, r)
        for g, r in zip(grads, ref):
            assert g.shape == r.shape
            assert_same(g, r)
    names = _nodes(outs[0].grad_fn)
    assert names & set(FUSED_BACKWARD)
    if whole:
        assert not any(n.startswith(("Split", "Cat")) for n in names), names


def lstm_cell_two_mm(x, hx, cx, w_ih, w_hh, b_ih, b_hh):
    gates = torch.mm(x, w_ih.t()) + torch.mm(hx, w_hh.t()) + b_ih + b_hh
    return lstm_cell(gates, cx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_chunk_motion_two_matmuls_share_one_whole_gradient(dtype, monkeypatch, device):
    """The LSTM cell as nn.LSTMCell computes it: chunk motion chunks both matmul results (and the biases, broadcast
    in the group: their splits stay); the two matmuls' chunks share their gradients, so the backward writes one
    whole gradient that both matmuls' backward nodes take, with no split between. In bfloat16 the weights'
    gradients of the fused backward (which rounds once) and eager's (which rounds every op) differ past bfloat16's
    tolerance on some seeds with or without this path: there it is held to the split path's gradients."""
    ff = fuser.fuse(torch.jit.script(lstm_cell_two_mm))
    b, i, h = 5, 6, 8
    for _ in range(4):
        shapes = [(b, i), (b, h), (b, h), (4 * h, i), (4 * h, h), (4 * h,), (4 * h,)]
        args = [torch.randn(s, dtype=dtype, device=device) for s in shapes]
        weights = [torch.randn(b, h, dtype=dtype, device=device) for _ in range(2)]
        outs, grads = _grads(ff, args, (True, True), weights)
        ref_outs, ref = _grads(lstm_cell_two_mm, args, (True, True), weights)
        if dtype == torch.bfloat16:
            with monkeypatch.context() as m:
                m.setattr(autodiff, "_chunked_inputs", lambda *a: [])
                native.clear()
                _, ref = _grads(ff, args, (True, True), weights)
            native.clear()
        for o, r in zip(outs, ref_outs):
            assert_same(o, r)
        for g, r in zip(grads, ref):
            assert g.shape == r.shape
            assert_same(g, r)
    fused = next(f for f in _all_nodes(outs[0].grad_fn) if f.name() in FUSED_BACKWARD)
    nexts = [f for f, _ in fused.next_functions if f is not None]
    # the matmuls' nodes (eager's, or TorchScript's differentiable graphs) take the fused node's gradient directly
    assert sum(1 for f in nexts if "AccumulateGrad" not in f.name() and not f.name().startswith("Split")) == 2
    splits = [f for f in nexts if f.name().startswith("Split")]
    assert len(splits) == 8 and all("AccumulateGrad" in g.name() for f in splits for g, _ in f.next_functions)


def _all_nodes(fn) -> list:
    seen, todo, out = set(), [fn], []
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        out.append(f)
        todo.extend(g for g, _ in f.next_functions)
    return out


def test_double_backward_through_the_whole_gradient():
    ff = fuser.fuse(torch.jit.script(lstm_cell))
    for _ in range(3):
        gates = torch.randn(4, 12, dtype=torch.float64)
        cx = torch.randn(4, 3, dtype=torch.float64)
        got = []
        for fn in (ff, lstm_cell):
            g, c = gates.clone().requires_grad_(), cx.clone().requires_grad_()
            hy, cy = fn(g, c)
            gg, gc = torch.autograd.grad((hy * 1.5 + cy).sum(), (g, c), create_graph=True)
            got.append(torch.autograd.grad((gg * gg).sum() + (gc * g[:, :3]).sum(), (g, c)))
        for a, r in zip(*got):
            assert_same(a, r)


def test_leaf_gradient_accumulates_as_eager():
    """.backward() twice into a leaf's .grad (AccumulateGrad takes the whole gradient), and retain_graph."""
    ff = fuser.fuse(torch.jit.script(lstm_cell))
    gates = torch.randn(5, 24)
    cx = torch.randn(5, 6)
    got = []
    for fn in (ff, ff, lstm_cell):
        g, c = gates.clone().requires_grad_(), cx.clone().requires_grad_()
        hy, cy = fn(g, c)
        loss = (hy * 2 + cy).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        got.append((g.grad, c.grad))
    for a, r in zip(got[1], got[2]):
        assert a.is_contiguous()
        assert_same(a, r)
