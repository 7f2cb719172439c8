"""Chunk motion: the pointwise ops before a chunk join the group of the ops after it."""
import itertools

import pytest
import torch
from helpers import assert_same, fused_graph

import fuser
from fuser import graph_fuser


def _outside(g):
    return [n.kind() for n in g.nodes() if n.kind() not in ("prim::Constant", "prim::FusionGroup")]


def lstm_cell(x, hx, cx, w_ih, w_hh, b_ih, b_hh):
    gates = torch.mm(x, w_ih.t()) + torch.mm(hx, w_hh.t()) + b_ih + b_hh
    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)
    cy = torch.sigmoid(forgetgate) * cx + torch.sigmoid(ingate) * torch.tanh(cellgate)
    hy = torch.sigmoid(outgate) * torch.tanh(cy)
    return hy, cy


def milstm_cell(x, hx, cx, w_ih, w_hh, alpha, beta_i, beta_h, bias):
    Wx = x.mm(w_ih.t())
    Uz = hx.mm(w_hh.t())
    gates = alpha * Wx * Uz + beta_i * Wx + beta_h * Uz + bias
    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)
    ingate = ingate.sigmoid()
    forgetgate = forgetgate.sigmoid()
    cellgate = cellgate.tanh()
    outgate = outgate.sigmoid()
    cy = (forgetgate * cx) + (ingate * cellgate)
    hy = outgate * cy.tanh()
    return hy, cy


def _lstm_args(B=5, I=6, H=8, dtype=torch.float32):
    return [torch.randn(B, I, dtype=dtype), torch.randn(B, H, dtype=dtype), torch.randn(B, H, dtype=dtype),
            torch.randn(4 * H, I, dtype=dtype), torch.randn(4 * H, H, dtype=dtype),
            torch.randn(4 * H, dtype=dtype), torch.randn(4 * H, dtype=dtype)]


def test_lstm_cell_leaves_only_matmuls_outside_one_group():
    g = fused_graph(lstm_cell)
    assert len(graph_fuser.fusion_groups(g)) == 1
    outside = _outside(g)
    assert outside.count("aten::mm") == 2
    assert set(outside) <= {"aten::mm", "aten::t", "prim::ListConstruct", "fuser::broadcasting_chunk",
                            "prim::ListUnpack", "prim::TupleConstruct"}
    f = fuser.fuse(torch.jit.script(lstm_cell))
    for dtype in (torch.float32, torch.float64):
        args = _lstm_args(dtype=dtype)
        for a, b in zip(f(*args), lstm_cell(*args)):
            assert_same(a, b)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4)))[::5])
def test_every_gate_order_is_one_group(order, tmp_path):
    names = ["i", "f", "g", "o"]
    unpacked = ", ".join(names[k] for k in order)
    src = (
        "import torch\n"
        "def cell(x, hx, cx, w_ih, w_hh, b_ih, b_hh):\n"
        "    gates = torch.mm(x, w_ih.t()) + torch.mm(hx, w_hh.t()) + b_ih + b_hh\n"
        f"    {unpacked} = gates.chunk(4, 1)\n"
        "    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)\n"
        "    return torch.sigmoid(o) * torch.tanh(cy), cy\n")
    path = tmp_path / f"cell_{''.join(map(str, order))}.py"
    path.write_text(src)
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = fused_graph(mod.cell)
    assert len(graph_fuser.fusion_groups(g)) == 1
    f = fuser.fuse(torch.jit.script(mod.cell))
    args = _lstm_args()
    for a, b in zip(f(*args), mod.cell(*args)):
        assert_same(a, b)


def test_milstm_cell_is_one_group():
    g = fused_graph(milstm_cell)
    assert len(graph_fuser.fusion_groups(g)) == 1
    assert _outside(g).count("aten::mm") == 2
    f = fuser.fuse(torch.jit.script(milstm_cell))
    B, I, H = 3, 5, 7
    args = [torch.randn(B, I), torch.randn(B, H), torch.randn(B, H), torch.randn(4 * H, I), torch.randn(4 * H, H),
            torch.randn(4 * H), torch.randn(4 * H), torch.randn(4 * H), torch.randn(4 * H)]
    for a, b in zip(f(*args), milstm_cell(*args)):
        assert_same(a, b)


def chunk_dim0(x, y):
    a, b = (x * y).chunk(2, 0)
    return a.sigmoid() + b


def chunk_dim1(x, y):
    a, b, c = (x + y).chunk(3, 1)
    return a * b - c.tanh()


def chunk_dim2(x, y):
    a, b = (x - y).chunk(2, -1)
    return a.relu() * b


@pytest.mark.parametrize("fn,shapes", [
    (chunk_dim0, [(6, 4), (6, 4)]), (chunk_dim0, [(6, 4), (4,)]), (chunk_dim0, [(6, 1), (1, 4)]),
    (chunk_dim1, [(2, 9), (9,)]), (chunk_dim1, [(2, 9, 3), (1, 9, 1)]), (chunk_dim1, [(4, 6), ()]),
    (chunk_dim2, [(2, 3, 8), (8,)]), (chunk_dim2, [(2, 3, 8), (2, 3, 1)]), (chunk_dim2, [(5, 1), (3, 1, 4)]),
])
def test_chunk_motion_with_broadcasting(fn, shapes):
    g = fused_graph(fn)
    assert len(graph_fuser.fusion_groups(g)) == 1
    assert "aten::chunk" not in _outside(g)
    f = fuser.fuse(torch.jit.script(fn))
    x, y = torch.randn(shapes[0]), torch.randn(shapes[1])
    assert_same(f(x, y), fn(x, y))
    xt = torch.randn(tuple(reversed(shapes[0]))).t() if len(shapes[0]) == 2 else x
    assert_same(f(xt, y), fn(xt, y))


def test_chunk_motion_keeps_zero_dim_promotion():
    f = fuser.fuse(torch.jit.script(chunk_dim1))
    x = torch.randn(4, 6, dtype=torch.float16)
    s = torch.tensor(0.5, dtype=torch.float64)  # 0-dim: x + s stays float16 in eager
    out = f(x, s)
    assert out.dtype == torch.float16
    assert_same(out, chunk_dim1(x, s))


def chunk_uneven(x, y):
    a, b, c = (x + y).chunk(3, 1)
    return a.sigmoid(), b * 2, c.tanh()


def test_chunk_sizes_that_do_not_divide():
    f = fuser.fuse(torch.jit.script(chunk_uneven))
    x, y = torch.randn(2, 10), torch.randn(10)  # chunks of 4, 4 and 2 columns: outputs of two shapes
    for a, b in zip(f(x, y), chunk_uneven(x, y)):
        assert_same(a, b)
    f = fuser.fuse(torch.jit.script(chunk_dim1))
    x, y = torch.randn(2, 4), torch.randn(4)  # chunk(3) of 4 gives 2 chunks: unpacking 3 fails in eager too
    with pytest.raises(ValueError):
        chunk_dim1(x, y)
    with pytest.raises(RuntimeError, match="Expected 3 elements in a list but found 2"):
        f(x, y)


def test_chunk_not_moved_past_mutation_or_other_uses():
    def mutated(x, y):
        z = x * 2
        y.add_(1)
        a, b = (z + y).chunk(2, 0)
        return a * b

    def used_twice(x, y):
        z = x * y
        a, b = z.chunk(2, 0)
        return a.sigmoid() + b, z

    for fn in (mutated, used_twice):
        f = fuser.fuse(torch.jit.script(fn))
        x, y = torch.randn(4, 3), torch.randn(4, 3)
        y2 = y.clone()
        out, ref = f(x, y), fn(x, y2)
        out = out if isinstance(out, tuple) else (out,)
        ref = ref if isinstance(ref, tuple) else (ref,)
        for a, b in zip(out, ref):
            assert_same(a, b)
    g = fused_graph(used_twice)
    assert "aten::chunk" in _outside(g)
