"""fuser.explain: the groups the torch.compile door makes and the reason for every compute node it leaves out,
as data and as a table; PYTORCH_FUSION_DEBUG=explain prints it once per compiled graph."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.dynamo import partition as partition_mod


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Mixed(nn.Module):
    """One op outside the table (cumsum), one mutation (of an input), one integer tensor (remainder has no
    integer form in the table), around two fusable chains."""

    def forward(self, x, i, buf):
        y = torch.sigmoid(x) * 2 + 1
        z = torch.cumsum(y, 1)
        buf.mul_(0.5)
        j = i.remainder(3)
        return z.tanh() * j


def _by_op(records):
    return {r.ops[0]: r.reason for r in records.left_out}


def test_explain_names_the_reason_for_an_unsupported_op_a_mutation_and_an_integer_tensor():
    x, i = torch.randn(4, 8), torch.randint(-5, 6, (4, 8))
    buf, buf_ref = torch.rand(8), None
    buf_ref = buf.clone()
    ref = Mixed()(x, i, buf_ref)
    e = fuser.explain(Mixed(), x, i, buf)
    assert torch.equal(buf, buf_ref)  # explain ran the module as eager does, mutation included
    groups = sorted(r.ops for r in e.groups)
    assert groups == [("aten::sigmoid", "aten::mul.Tensor", "aten::add.Tensor"), ("aten::tanh", "aten::mul.Tensor")]
    assert all(r.key is not None and r.graph == e.groups[0].graph for r in e.groups)
    reasons = _by_op(e)
    assert reasons["aten::cumsum"] == "aten::cumsum is not in fuser's op table"
    assert "mutates" in reasons["aten::copy_"]
    assert "no int64 form" in reasons["aten::remainder.Scalar"]
    # the functional half of the mutation (buf * 0.5) is fusable, but alone
    assert reasons["aten::mul.Tensor"].startswith("alone")
    assert e.fallbacks == []
    text = str(e)
    for line in ("aten::cumsum is not in fuser's op table", "group", "3 ops: sigmoid, mul.Tensor, add.Tensor",
                 "2 group(s), 4 op(s) left out, 0 run-time fallback(s)"):
        assert line in text, text
    del ref


def test_explain_covers_the_backward_graph_without_touching_grads():
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    x = torch.randn(3, 6, requires_grad=True)
    e = fuser.explain(lambda m, t: (m(t) * t.sigmoid()).sum(), model, x)
    graphs = {r.graph.split()[-1] for r in e}
    assert graphs == {"forward", "backward"}
    assert any(r.graph.endswith("backward") for r in e.groups)
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    assert "aten::addmm is not in fuser's op table" in _by_op(e).values()


def test_explain_reports_groups_that_fall_back_at_run_time():
    fuser.override_can_fuse_on_cpu(False)
    fn, x = (lambda a: (a.sin() * 2).cos()), torch.randn(5)
    e = fuser.explain(fn, x)
    [g], [fb] = e.groups, e.fallbacks
    assert fb.key == g.key and fb.reason == "cpu fusion is off"
    assert "falls back" in str(e) and "cpu fusion is off" in str(e)
    # asked again, it compiles again (a fresh backend), so the answer is the same
    again = fuser.explain(fn, x)
    assert [(r.kind, r.ops, r.reason) for r in again] == [(r.kind, r.ops, r.reason) for r in e]


def test_explain_names_shape_cycle_side_effect_dtype_and_limit_reasons(monkeypatch):
    fuser.override_can_fuse_on_cpu(False)  # the decisions are made before any kernel: none is built here

    def shapes(x, row):
        a = row.sigmoid()  # [8], needed outside: a group's outputs have its [4, 8] shape
        return a, (x * a) * 2

    e = fuser.explain(shapes, torch.randn(4, 8), torch.randn(8))
    assert "of shape [8] is needed outside" in _by_op(e)["aten::sigmoid"]

    def cycle(x, w):
        a = x.sin() * 2
        return a + a @ w  # a feeds mm, mm feeds the add: a and the add cannot be one group

    e = fuser.explain(cycle, torch.randn(4, 4), torch.randn(4, 4))
    assert "a cycle" in _by_op(e)["aten::add.Tensor"]

    def side_effect(x):
        a = x.sin()
        b = F.dropout(x, 0.5)  # a random op: its order is kept, no group spans it
        return (a * 2).cos() + b

    e = fuser.explain(side_effect, torch.randn(16))
    reasons = _by_op(e)
    assert "a side effect between its ops" in reasons["aten::sin"]
    assert "draws random numbers" not in reasons["aten::native_dropout"]  # simply not in the table
    assert reasons["aten::native_dropout"] == "aten::native_dropout is not in fuser's op table"

    e = fuser.explain(lambda z: (z * 2).exp(), torch.randn(4, dtype=torch.complex64))
    assert "complex64" in _by_op(e)["aten::mul.Tensor"]

    monkeypatch.setattr(partition_mod, "MAX_GROUP_ARGS", 3)
    e = fuser.explain(lambda a, b, c: ((a * b) * c).exp(), *torch.randn(3, 5).unbind())
    assert any("the input/output limit" in r for r in _by_op(e).values())


def test_explain_matches_eager_under_a_side_effect_and_random_ops():
    def f(x):
        a = x.sin()
        b = F.dropout(x, 0.5)
        c = F.dropout(a, 0.5)
        return (a * 2).cos() + b * c

    x = torch.randn(64)
    torch.manual_seed(7)
    ref = f(x)
    torch.manual_seed(7)
    out = torch.compile(f, backend="fuser", dynamic=False)(x)
    # the random ops drew in eager's order (another mask would differ by O(1); the fused cos may differ by an ulp)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_fusion_debug_explain_prints_once_per_compiled_graph(monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_FUSION_DEBUG", "explain")
    fuser.override_can_fuse_on_cpu(False)

    def f(x):
        y = x.tanh() * 2
        torch._dynamo.graph_break()
        return y.sigmoid() + 1

    compiled = torch.compile(f, backend="fuser", dynamic=False)
    x = torch.randn(6)
    compiled(x)
    compiled(x)  # no new graph: nothing printed
    out = capsys.readouterr().out
    assert out.count("group(s),") == 2 and out.count("inference  group") == 2, out
    assert "tanh, mul.Tensor" in out and "sigmoid, add.Tensor" in out


def _mixed(x, i, buf):
    y = torch.sigmoid(x) * 2 + 1
    z = torch.cumsum(y, 1)
    buf.mul_(0.5)
    j = i.remainder(3)
    return z.tanh() * j


def test_explain_follows_the_torchscript_pass_too():
    x, i = torch.randn(4, 8), torch.randint(-5, 6, (4, 8))
    buf, buf_ref = torch.rand(8), None
    buf_ref = buf.clone()
    ref = _mixed(x, i, buf_ref)
    scripted = torch.jit.script(_mixed)
    e = fuser.explain(scripted, x, i, buf.clone())  # runs it more than once (the profiling executor's runs)
    assert torch.equal(scripted(x, i, buf), ref) and torch.equal(buf, buf_ref)
    assert {r.graph for r in e} == {"torchscript"}
    assert sorted(r.ops for r in e.groups) == [("aten::remainder.Scalar", "aten::tanh", "aten::mul.Tensor"),
                                               ("aten::sigmoid", "aten::mul.Scalar", "aten::add.Scalar")]
    reasons = _by_op(e)
    assert reasons["aten::cumsum"] == "aten::cumsum is not in fuser's op table"
    assert "side effect" in reasons["aten::mul_.Scalar"]
    # the pass has no dtypes: the integer remainder joined a group, which falls back when it runs on int64
    [fb] = e.fallbacks
    assert fb.ops[0] == "aten::remainder.Scalar" and "no form for these inputs" in fb.reason
    assert "1 run-time fallback(s)" in str(e)
