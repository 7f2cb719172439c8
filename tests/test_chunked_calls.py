"""A group that takes every chunk of a tensor is lowered to a chunked call (fuser::fusion_group<m>_c<n>): the whole
tensor its argument and the chunks made by the call, so that TorchScript runs no chunk and builds no list. Every
call equals eager's (the unfused scripted function's errors included), and the native hot path serves the plain
ones."""
import io
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_same

import fuser
from fuser import graph_fuser, native

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _lstm_tail(gates, cx):
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


def _last_dim(gates, cx):
    i, f, g, o = gates.chunk(4, -1)
    return torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g) - o


def _rows(gates, cx):  # chunks along dim 0, two of them read twice
    a, b = gates.chunk(2, 0)
    y = a * cx + b
    return torch.tanh(y), y - b * b


def _two_tensors_chunked(x, y, z):  # chunks of two tensors and a tensor of its own
    x1, x2 = x.chunk(2, 1)
    y1, y2, y3 = y.chunk(3, 1)
    return x1 * y1 + x2 * y2 - y3 * z


def _chunk_also_used_outside(gates, cx):
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), torch.mm(i, cx.t())


CASES = {  # fn, argument shapes (b: batch, h: hidden), the call expected
    "lstm_tail": (_lstm_tail, lambda b, h: [(b, 4 * h), (b, h)], "fuser::fusion_group2_c2"),
    "last_dim": (_last_dim, lambda b, h: [(b, 4 * h), (b, h)], "fuser::fusion_group1_c2"),
    "rows": (_rows, lambda b, h: [(2 * b, h), (b, h)], "fuser::fusion_group2_c2"),
    "two_tensors": (_two_tensors_chunked, lambda b, h: [(b, 2 * h), (b, 3 * h), (b, h)], "fuser::fusion_group1_c3"),
}


def _calls(graph):
    return [n for n in graph.nodes() if graph_fuser.is_group_call(n)]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _layouts(shape, dtype, device):
    """The tensor of ``shape`` contiguous, transposed, and a view at an offset into a wider tensor."""
    yield torch.randn(shape, dtype=dtype, device=device)
    yield torch.randn(shape[::-1], dtype=dtype, device=device).t()
    yield torch.randn(shape[0], shape[1] + 6, dtype=dtype, device=device)[:, 3:3 + shape[1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_chunked_calls_take_the_whole_tensor_and_equal_eager(name, device):
    fn, shapes, call = CASES[name]
    ff = fuser.fuse(torch.jit.script(fn))
    calls = _calls(ff.graph)
    assert [c.kind() for c in calls] == [call]
    kinds = {n.kind() for n in ff.graph.nodes()}
    assert "aten::chunk" not in kinds and "prim::ConstantChunk" not in kinds
    # each argument is a parameter of the function: the whole tensors
    assert {v.node().kind() for v in graph_fuser.group_call_args(calls[0])[0]} == {"prim::Param"}
    assert any(n > 1 for _, _, n, _ in graph_fuser.group_call_chunks(calls[0]))
    hits = native.stats()["hits"] if native.loaded() else 0
    for dtype in (torch.float32, torch.float64):
        b, h = 5, 8
        for k in range(3):
            args = [next(x for j, x in enumerate(_layouts(s, dtype, device)) if j == k) for s in shapes(b, h)]
            with torch.no_grad():
                for _ in range(4):  # past the profiled runs: the native hot path serves the last ones
                    got = _as_tuple(ff(*args))
            want = _as_tuple(fn(*args))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_same(g, w)
    if native.loaded():
        assert native.stats()["hits"] > hits
    shown = fuser.graph_for(ff, *args)
    assert not _calls(shown) and len(graph_fuser.fusion_groups(shown)) == 1
    assert "prim::ConstantChunk" in {n.kind() for n in shown.nodes()}


def test_chunks_of_unequal_sizes_equal_eager():
    """10 columns in 4 chunks: 3, 3, 3 and 1 (broadcast in the group): eager's chunks, served through at::chunk."""
    ff = fuser.fuse(torch.jit.script(_lstm_tail))
    for _ in range(4):
        gates, cx = torch.randn(5, 10), torch.randn(5, 1)
        with torch.no_grad():
            got = ff(gates, cx)
        for g, w in zip(got, _lstm_tail(gates, cx)):
            assert_same(g, w)


def _error(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (the error itself is compared)
        return type(e), str(e).strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("shapes", [[(5, 3), (5, 1)], [(5, 0), (5, 0)], [(5,), (5,)], [(), (5, 1)]],
                         ids=["fewer_chunks", "empty", "one_dim", "zero_dim"])
def test_chunk_errors_and_empty_tensors_follow_the_unfused_function(shapes):
    """3 columns make 3 chunks of the 4 taken: the interpreter's error; 0 columns: 4 empty chunks; a 1-D gates
    tensor has no dim 1, a 0-dim one no dims: at::chunk's errors. Each as the unfused scripted function gives it."""
    plain = torch.jit.script(_lstm_tail)
    ff = fuser.fuse(torch.jit.script(_lstm_tail))
    for _ in range(4):
        args = [torch.randn(s) for s in shapes]
        want_error = _error(plain, *args)
        with torch.no_grad():
            assert _error(ff, *args) == want_error
        if want_error is None:
            for g, w in zip(ff(*args), plain(*args)):
                assert_same(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_call_gradients_equal_eager(device):
    ff = fuser.fuse(torch.jit.script(_lstm_tail))
    for _ in range(4):
        gates = torch.randn(6, 20, dtype=torch.float64, device=device, requires_grad=True)
        cx = torch.randn(6, 5, dtype=torch.float64, device=device, requires_grad=True)
        weights = [torch.randn(6, 5, dtype=torch.float64, device=device) for _ in range(2)]
        got = ff(gates, cx)
        g_got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), [gates, cx])
        want = _lstm_tail(gates, cx)
        g_want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)), [gates, cx])
        for a, b in zip((*got, *g_got), (*want, *g_want)):
            assert_same(a.detach(), b.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_call_under_inference_mode(device):
    ff = fuser.fuse(torch.jit.script(_lstm_tail))
    with torch.inference_mode():
        for _ in range(4):
            gates, cx = torch.randn(4, 12, device=device), torch.randn(4, 3, device=device)
            for g, w in zip(ff(gates, cx), _lstm_tail(gates, cx)):
                assert_same(g, w)


def test_chunks_also_used_outside_keep_their_chunk():
    ff = fuser.fuse(torch.jit.script(_chunk_also_used_outside))
    assert all(not any(n > 1 for _, _, n, _ in graph_fuser.group_call_chunks(c)) for c in _calls(ff.graph))
    gates, cx = torch.randn(6, 20), torch.randn(6, 5)
    for _ in range(4):
        for g, w in zip(ff(gates, cx), _chunk_also_used_outside(gates, cx)):
            assert_same(g, w)


def test_saved_chunked_call_loads_and_runs_in_another_process(tmp_path):
    ff = fuser.fuse(torch.jit.script(_lstm_tail))
    gates, cx = torch.randn(3, 8), torch.randn(3, 2)
    ff(gates, cx)
    path = tmp_path / "lstm.pt"
    torch.jit.save(ff, str(path))
    buf = io.BytesIO()
    torch.save([gates, cx, *_lstm_tail(gates, cx)], buf)
    (tmp_path / "data.pt").write_bytes(buf.getvalue())
    script = tmp_path / "load.py"
    script.write_text(
        "import sys, torch, fuser\n"
        "f = torch.jit.load(sys.argv[1])\n"
        "gates, cx, hy, cy = torch.load(sys.argv[2])\n"
        "for _ in range(4):\n"
        "    got = f(gates, cx)\n"
        "torch.testing.assert_close(got[0], hy)\n"
        "torch.testing.assert_close(got[1], cy)\n"
        "print(any(n.kind().startswith('fuser::fusion_group2_c') for n in f.graph.nodes()))\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fuser.__file__)))
    r = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "data.pt")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"]


def test_python_kernel_of_a_chunked_call_equals_eager():
    """The operator's Python kernel (before the native hot path is loaded, or under vmap) makes the same chunks."""
    ff = fuser.fuse(torch.jit.script(_lstm_tail))
    gates, cx = torch.randn(7, 3, 16), torch.randn(7, 3, 4)
    ff(gates[0], cx[0])
    got = torch.vmap(ff)(gates, cx)
    want = torch.vmap(_lstm_tail)(gates, cx)
    for g, w in zip(got, want):
        assert_same(g, w)


def _written_between(x, y):
    a, b = x.chunk(2, 1)
    x.set_(torch.zeros(4, 8))  # the chunks are of the tensor as it was
    return torch.sigmoid(a) * y + torch.tanh(b)


def _transposed_between(x, y):
    a, b = x.chunk(2, 1)
    x.t_()
    return torch.sigmoid(a) * y + torch.tanh(b)


def _in_a_branch(x, y, flag: bool):
    a, b = x.chunk(2, 1)  # raises for a 1-D x whatever the flag
    if flag:
        return torch.sigmoid(a) * y + torch.tanh(b)
    return y


def _in_a_loop(x, y, n: int):
    a, b = x.chunk(2, 1)
    for _ in range(n):
        y = torch.sigmoid(a) * y + torch.tanh(b)
    return y


def _unused_chunks(x, y):
    a, b, c, d = x.chunk(4, 1)  # the unpack needs 4 chunks though the group reads 2
    return torch.sigmoid(a) * y + torch.tanh(b) * y


def _chunk_of_one(x, y):
    (a,) = x.chunk(1, 5)  # dim 5 out of range: an error even for one chunk
    b, c = y.chunk(2, 1)
    return a * b + c


KEPT = {  # fn, argument sets (each: the arguments, made fresh), whether the call may still chunk
    "written_between": (_written_between, [lambda: (torch.randn(4, 8), torch.randn(4, 4))]),
    "transposed_between": (_transposed_between, [lambda: (torch.randn(4, 8), torch.randn(4, 4))]),
    "in_a_branch": (_in_a_branch, [lambda: (torch.randn(8), torch.randn(4), False),
                                   lambda: (torch.randn(4, 8), torch.randn(4, 4), True)]),
    "in_a_loop": (_in_a_loop, [lambda: (torch.randn(8), torch.randn(4), 0),
                               lambda: (torch.randn(4, 8), torch.randn(4, 4), 3)]),
    "unused_chunks": (_unused_chunks, [lambda: (torch.randn(5, 3), torch.randn(5, 1)),
                                       lambda: (torch.randn(5, 8), torch.randn(5, 2))]),
    "chunk_of_one": (_chunk_of_one, [lambda: (torch.randn(3, 4), torch.randn(3, 8)),
                                     lambda: (torch.randn(3, 4, 1, 1, 1, 1), torch.randn(3, 8))]),
}


@pytest.mark.parametrize("name", list(KEPT))
def test_chunks_the_call_must_not_make_stay_where_they_were(name):
    """The call makes no chunk that a write could change before the group (set_, t_), that an outer block makes
    (its error would depend on the branch or the loop's trips), whose list unpack needs chunks the group does not
    read, or that is one chunk (its dim is still checked): the chunk stays, and every call gives the unfused
    function's results or its error."""
    fn, argsets = KEPT[name]
    plain = torch.jit.script(fn)
    ff = fuser.fuse(torch.jit.script(fn))
    def all_nodes(block):
        for n in block.nodes():
            yield n
            for b in n.blocks():
                yield from all_nodes(b)
    kinds = [n.kind() for n in all_nodes(ff.graph.block())]
    assert "aten::chunk" in kinds or "prim::ConstantChunk" in kinds
    if name != "chunk_of_one":  # (there the call makes y's two chunks)
        for call in [n for n in all_nodes(ff.graph.block()) if graph_fuser.is_group_call(n)]:
            assert not any(n > 1 for _, _, n, _ in graph_fuser.group_call_chunks(call)), call
    for make in argsets:
        for _ in range(4):
            args_plain = make()
            args_fused = [a.clone() if isinstance(a, torch.Tensor) else a for a in args_plain]
            want_error = _error(plain, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args_plain])
            with torch.no_grad():
                assert _error(ff, *args_fused) == want_error
            if want_error is None:
                got = _as_tuple(ff(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args_plain]))
                want = _as_tuple(plain(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args_plain]))
                for g, w in zip(got, want):
                    assert_same(g, w)
