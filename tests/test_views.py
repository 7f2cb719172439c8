"""Permutes inside fusion groups (fuser/views.py): each input read through its view, checked against eager.

ConvNeXt's `residual + (gamma * x).permute(0, 3, 1, 2)` is one group. What is checked, each against eager run
directly on the same inputs: values, dtypes and strides (users see them), through the TorchScript door on the
CPU backend, through the CUDA kernels in the host emulation, and on a GPU. Three cases come from a review of an
earlier design (a graph rewrite that moved permutes onto operands) that got them wrong: a 0-dim float32 operand
beside bfloat16 ones (type promotion), a function traced with a 0-dim operand and called with a full one (ranks
come from the call), and an outer product whose operands are all broadcast (eager's layout tie-break); two more
from a review of this one: a dims list changed before the permute, and a permuted input leaving the group.
"""
import pytest
import torch
from helpers import FUSED_BACKWARD, random_tensor

import fuser
from fuser import executor, graph_fuser, ir, ts_ir, views
from fuser.cuda import emulate
from fuser.kernel_cache import STORE

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rand(*shape, dtype=torch.float32, device="cpu"):
    return random_tensor(tuple(shape), dtype, device=device, specials=False)


def _layer_scale(res, gamma, x):
    return res + (gamma * x).permute(0, 3, 1, 2)


_graphs = []  # the graphs whose group nodes a test reads (a node is valid while its graph lives)


def _groups(fn, *args):
    graph = fuser.graph_for(fn, *args)
    _graphs[:] = [graph]
    return graph_fuser.fusion_groups(graph)


def _module_groups(module):
    """The groups of a fused module's forward (its graph, with each group call raised back to a group)."""
    graph = module.graph.copy()
    graph_fuser.raise_fusion_calls(graph, lambda key: ts_ir.raise_group(STORE.get(key).group))
    _graphs[:] = [graph]
    return graph_fuser.fusion_groups(graph)


def _kernel_ran(group_node, args) -> bool:
    """Whether the registered group of ``group_node`` has a kernel (not the fallback) for ``args``."""
    spec = STORE.get(fuser.register_fusion(group_node))
    geo = spec.geometries.get(executor.signature([a for a in args if isinstance(a, torch.Tensor)]))
    return isinstance(geo, executor.Geometry)


def _check(fn, args, dtype=torch.float32, permutes=1):
    """Scripted ``fn`` fused: one group holding ``permutes`` permutes, run as a kernel, equal to eager in
    values, dtype and strides."""
    scripted = fuser.fuse(torch.jit.script(fn))
    for _ in range(2):
        out = scripted(*args)
    ref = fn(*args)
    ref64 = fn(*[a.double() for a in args])
    groups = _groups(scripted, *args)
    assert len(groups) == 1
    sub = groups[0].g("Subgraph")
    assert len(sub.findAllNodes("aten::permute")) == permutes
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    refs64 = ref64 if isinstance(ref64, tuple) else (ref64,)
    for o, r, r64 in zip(outs, refs, refs64):
        assert o.dtype == r.dtype and o.shape == r.shape and o.stride() == r.stride()
        _assert_near(o, r, r64)
    group_args = _group_args(groups[0], fn, args)
    assert _kernel_ran(groups[0], group_args)
    return scripted


def _assert_near(out, eager, ref64):
    """``out`` as close to the float64 result as eager's is, or within one unit of the dtype (eager rounds each op's
    float16/bfloat16 result, the kernel only the last: where a sum cancels, eager's error is the larger)."""
    eps = torch.finfo(out.dtype).eps
    err, eager_err = (out.double() - ref64).abs(), (eager.double() - ref64).abs()
    bound = torch.maximum(2 * eager_err, eps * ref64.abs()) + 1e-6
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def _group_args(group_node, fn, args):
    """The group's inputs for this call: the function's parameters, by name, in the group's input order."""
    names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    by_name = dict(zip(names, args))
    return [by_name[v.debugName().split(".")[0]] for v in group_node.inputs()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("res_layout", ["contiguous", "channels_last"])
def test_layer_scale_permute_residual(device, dtype, res_layout):
    res = _rand(4, 48, 7, 9, dtype=dtype, device=device)
    if res_layout == "channels_last":
        res = res.contiguous(memory_format=torch.channels_last)
    gamma, x = _rand(48, dtype=dtype, device=device), _rand(4, 7, 9, 48, dtype=dtype, device=device)
    _check(_layer_scale, (res, gamma, x), dtype)


def test_layer_scale_is_one_group_in_the_cuda_kernels():
    """The CUDA kernel of the group, run in the host emulation: x is read through the permute (a transposed
    input: the tiled path), gamma as a vector repeated along the map."""
    group = _groups(fuser.fuse(torch.jit.script(_layer_scale)), *_inputs_layer_scale())[0]
    sub = group.g("Subgraph")
    for dtype in (torch.float32, torch.float16):
        args = _inputs_layer_scale(dtype)
        ref, ref64 = _layer_scale(*args), _layer_scale(*(a.double() for a in args))
        for res_layout in (torch.contiguous_format, torch.channels_last):
            res, gamma, x = args
            res = res.contiguous(memory_format=res_layout)
            out, = emulate.run_graph(sub, _group_args(group, _layer_scale, (res, gamma, x)))
            assert out.stride() == _layer_scale(res, gamma, x).stride()
            assert out.is_contiguous(memory_format=res_layout)
            _assert_near(out, ref, ref64)


def _inputs_layer_scale(dtype=torch.float32):
    return _rand(2, 40, 6, 5, dtype=dtype), _rand(40, dtype=dtype), _rand(2, 6, 5, 40, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_input_read_through_a_permute_and_without_it(device):
    def fn(x, y):
        return torch.relu(x.permute(1, 0) * 2 + x) + (y * 3).permute(1, 0)

    x, y = _rand(33, 33, device=device), _rand(33, 33, device=device)
    scripted = _check(fn, (x, y), permutes=2)
    group = _groups(scripted, x, y)[0]
    assert [v.debugName() for v in group.inputs()].count(group.inputsAt(0).debugName()) == 2  # x, twice


@pytest.mark.parametrize("device", DEVICES)
def test_nested_permutes(device):
    def fn(x, y, z, w):
        return ((x * y).permute(0, 2, 1) * z).permute(2, 0, 1) + w

    x, y = _rand(3, 5, 7, device=device), _rand(7, device=device)
    z, w = _rand(3, 1, 5, device=device), _rand(5, 3, 7, device=device)
    _check(fn, (x, y, z, w), permutes=2)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_dim_float32_operand_keeps_bfloat16(device):
    """bfloat16 * a 0-dim float32 tensor is bfloat16 in eager (a 0-dim tensor does not promote dimensioned ones):
    under a permute the 0-dim operand stays 0-dim."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor(0.37))

        def forward(self, res, x):
            return res + (self.scale * x).permute(0, 2, 1)

    m = Block().to(device)
    res, x = _rand(2, 16, 8, dtype=torch.bfloat16, device=device), _rand(2, 8, 16, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        traced = fuser.fuse(torch.jit.trace(m, (res, x), check_trace=False))
        for _ in range(2):
            out = traced(res, x)
        ref = m(res, x)
    group, = _module_groups(traced)
    assert group.g("Subgraph").findAllNodes("aten::permute")
    assert _kernel_ran(group, [m.scale, x, res])
    ref64 = res.double() + (m.scale.double() * x.double()).permute(0, 2, 1)
    assert out.dtype == ref.dtype == torch.bfloat16 and out.stride() == ref.stride()
    _assert_near(out, ref, ref64)


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_come_from_the_call_not_the_trace(device):
    """Traced with a 0-dim ``a``, called with a full one: the permute's operand rank is the call's."""
    def fn(a, b, c):
        return (a * b).permute(1, 0) + c

    a0, b, c = _rand(device=device), _rand(6, 4, device=device), _rand(4, 6, device=device)
    traced = fuser.fuse(torch.jit.trace(fn, (a0, b, c)))
    for a in (a0, _rand(6, 4, device=device), _rand(4, device=device), _rand(6, 1, device=device)):
        for _ in range(2):
            out = traced(a, b, c)
        ref = fn(a, b, c)
        assert out.stride() == ref.stride()
        torch.testing.assert_close(out, ref)
    assert _groups(traced, a0, b, c)[0].g("Subgraph").findAllNodes("aten::permute")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", [((5, 1), (1, 7), (1,)), ((5, 1), (1, 7), ()), ((1, 1), (5, 7), (7, 5)),
                                    ((5, 1), (1, 7), (7, 1))])
def test_outer_product_strides_follow_eager(device, shapes):
    """Every operand broadcast along a dim (an outer product): eager's layout tie-break goes by dim order, before
    and after the permute; the output's strides must be eager's."""
    def fn(a, b, c):
        return (a * b + 1).permute(1, 0) * c

    args = tuple(_rand(*s, device=device) for s in shapes)
    _check(fn, args)


@pytest.mark.parametrize("device", DEVICES)
def test_permute_result_is_an_output(device):
    """A permute's result leaving the group: a fresh tensor with the strides eager's view has."""
    def fn(x, y):
        z = (x * y).permute(1, 0)
        return z, torch.sigmoid(z) * 2

    x, y = _rand(9, 13, device=device), _rand(13, device=device)
    _check(fn, (x, y))


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_dims_give_eagers_error(device):
    def fn(x, y):
        return (x * y).permute(1, 0) + 1

    scripted = fuser.fuse(torch.jit.script(fn))
    x = _rand(3, 4, device=device)
    scripted(x, x)
    scripted(x, x)
    bad = _rand(2, 3, 4, device=device)
    with pytest.raises(RuntimeError) as got:
        scripted(bad, bad)
    with pytest.raises(RuntimeError) as want:
        fn(bad, bad)
    assert str(want.value).splitlines()[0] in str(got.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("res_layout", [torch.contiguous_format, torch.channels_last])
def test_gradients_equal_eagers(device, res_layout):
    """Under autograd the permute-free group is differentiated on the inputs' views (one fused Function), and
    autograd carries the gradients back through the views: gamma's is summed over the broadcast dims."""
    res, gamma, x = _inputs_layer_scale()
    res = res.contiguous(memory_format=res_layout)
    res, gamma, x = (t.to(device).requires_grad_() for t in (res, gamma, x))
    scripted = fuser.fuse(torch.jit.script(_layer_scale))
    for _ in range(2):
        out = scripted(res, gamma, x)
    assert out.grad_fn.name() in FUSED_BACKWARD
    ref = _layer_scale(res, gamma, x)
    assert out.stride() == ref.stride()
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (res, gamma, x), grad)
    want = torch.autograd.grad(ref, (res, gamma, x), grad)
    for g, w in zip(got, want):
        assert g.stride() == w.stride() or not g.is_contiguous()
        torch.testing.assert_close(g, w)


def test_gradients_where_the_permute_free_group_would_change_the_layout():
    """An outer product under a permute: eager's layout rule breaks the tie by dim order, which the permute
    changes, so the permute-free group would give other strides: the interpreter runs the ops under autograd."""
    def fn(a, b, c):
        return (a * b + 1).permute(1, 0) * c

    a, b, c = (t.requires_grad_() for t in (_rand(5, 1), _rand(1, 7), _rand(1)))
    scripted = fuser.fuse(torch.jit.script(fn))
    for _ in range(2):
        out = scripted(a, b, c)
    ref = fn(a, b, c)
    assert out.stride() == ref.stride()
    got = torch.autograd.grad(out.sum(), (a, b, c))
    want = torch.autograd.grad(ref.sum(), (a, b, c))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_value_needed_in_two_spaces_is_not_grouped_with_both():
    """``m.permute(1, 0) + m``: m would be needed both in the permute's order and its own; the pass leaves the
    permute out (or m), and the result is eager's."""
    def fn(x, y):
        m = x * y
        return torch.relu(m.permute(1, 0) + m)

    x, y = _rand(11, 11), _rand(11, 11)
    scripted = fuser.fuse(torch.jit.script(fn))
    for _ in range(2):
        out = scripted(x, y)
    torch.testing.assert_close(out, fn(x, y))
    for g in _groups(scripted, x, y):
        kinds = {n.kind() for n in g.g("Subgraph").nodes()}
        assert not {"aten::mul", "aten::permute"} <= kinds


def test_spaces_and_flat_group():
    b = ir.Builder()
    x, y, z = b.input(), b.input(), b.input()
    m = b.add("aten::mul.Tensor", x, y)
    p = b.add("aten::permute", m, (1, 0))
    o = b.add("aten::add.Tensor", p, z, 1)
    g = b.build([o])
    assert views.spaces(g) == ((1,), (1,), ())
    flat = views.flat(g)
    assert [n.op for n in flat.nodes] == ["aten::mul.Tensor", "aten::add.Tensor"]
    assert flat.nodes[1].args[0] == m
    # m read both through the permute and as an output: not one map
    assert isinstance(views.spaces(b.build([o, m])), str)
    x2, y2, z2 = _rand(3, 4), _rand(4), _rand(4, 3)
    vx, vy, vz = views.apply(g, views.spaces(g), [x2, y2, z2])
    assert vx.shape == (4, 3) and vy.shape == (4, 1) and vz is z2
    assert vx.data_ptr() == x2.data_ptr() and vy.stride() == (1, 4)
    assert isinstance(views.apply(g, views.spaces(g), [_rand(2, 3, 4), y2, z2]), str)


def test_random_and_reductions_stay_out_of_a_group_with_a_permute():
    def fn(x, y):
        a = (torch.rand_like(x) * y).permute(1, 0)
        return a + 1, (x * y).permute(1, 0).sum(-1) * 2

    x, y = _rand(6, 5), _rand(6, 5)
    scripted = fuser.fuse(torch.jit.script(fn))
    scripted(x, y)
    for g in _groups(scripted, x, y):
        kinds = {n.kind() for n in g.g("Subgraph").nodes()}
        if "aten::permute" in kinds:
            assert not kinds & {"aten::rand_like", "aten::sum"}


def test_traced_dims_become_one_constant():
    """Tracing records ``x.permute(0, 3, 1, 2)``'s dims as a list of int constants; the group holds one list."""
    res, gamma, x = _inputs_layer_scale()
    with torch.no_grad():
        traced = fuser.fuse(torch.jit.trace(_layer_scale, (res, gamma, x)))
        out = traced(res, gamma, x)
    torch.testing.assert_close(out, _layer_scale(res, gamma, x))
    group = _groups(traced, res, gamma, x)[0]
    lowered = ts_ir.lower(group.g("Subgraph"))
    permute = next(n for n in lowered.nodes if n.op == views.PERMUTE)
    assert permute.args[1] == (0, 3, 1, 2)


def test_a_dims_list_changed_before_the_permute_is_not_folded():
    """Folding a permute's list of int constants into one constant holds only where nothing else uses the list:
    ``dims[0] = 1`` or ``dims.reverse()`` change it before the permute reads it."""
    def setitem(x, y):
        dims = [0, 1]
        dims[0] = 1
        dims[1] = 0
        return (x * y).permute(dims) + 1

    def reverse(x, y):
        dims = [1, 0]
        dims.reverse()
        return (x * y).permute(dims) + 1

    x, y = _rand(3, 4), _rand(4)
    for fn in (setitem, reverse):
        fused = fuser.fuse(torch.jit.script(fn))
        for _ in range(2):
            out = fused(x, y)
        ref = fn(x, y)
        assert out.shape == ref.shape and out.stride() == ref.stride()
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("order", ["permute_then_type_as", "type_as_then_permute"])
def test_a_view_of_an_input_is_not_a_fresh_output(order):
    """``x.permute(1, 0).type_as(y)`` with y of x's dtype is a view of x in eager, which users write through: such
    an output does not leave a group as a fresh tensor."""
    def permute_then_type_as(x, y):
        a = x.permute(1, 0).type_as(y)
        return a, torch.relu(a) * 2

    def type_as_then_permute(x, y):
        a = x.type_as(y).permute(1, 0)
        return a, torch.relu(a) * 2

    fn = {"permute_then_type_as": permute_then_type_as, "type_as_then_permute": type_as_then_permute}[order]
    x, y = _rand(3, 4), _rand(1)
    fused = fuser.fuse(torch.jit.script(fn))
    for _ in range(2):
        a, b = fused(x, y)
    ra, rb = fn(x, y)
    assert a.data_ptr() == ra.data_ptr() == x.data_ptr() and a.stride() == ra.stride()
    torch.testing.assert_close(b, rb)
