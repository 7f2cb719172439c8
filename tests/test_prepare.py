"""The rewrites before the pass (fuser/prepare/): mutation removal, dropout, inference batch norm; and conv+BN
folding of frozen modules. Each checked against eager on fresh random inputs, and on the graph it makes."""
import pytest
import torch
import torch.nn as nn
from helpers import assert_same

import fuser
from fuser import graph_fuser, integration, prepare, ts_ir


def _trace(fn, *args):
    fuser.install()
    try:
        return torch.jit.trace(fn, args, check_trace=False)
    finally:
        fuser.uninstall()


def _script(fn):
    fuser.install()
    try:
        return torch.jit.script(fn)
    finally:
        fuser.uninstall()


def _shown(fn) -> torch._C.Graph:
    """``fn``'s graph with each fuser::fusion_group call shown as its prim::FusionGroup."""
    g = fn.graph.copy()
    graph_fuser.raise_fusion_calls(g, lambda key: ts_ir.raise_group(integration.STORE.get(key).group))
    return g


def _group_kinds(g) -> list[list[str]]:
    return [[n.kind() for n in gr.g("Subgraph").nodes() if n.kind() != "prim::Constant"]
            for gr in graph_fuser.fusion_groups(g)]


def _in_a_group(g, kind: str) -> bool:
    return any(kind in kinds for kinds in _group_kinds(g))


@pytest.fixture(autouse=True)
def _fusion_on():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


# ------------------------------------------------------------------------------------------------- mutation

def inplace_chain(x, y):
    a = x * 2
    a.relu_()
    a.add_(y)
    a.mul_(0.5)
    return a.sigmoid()


def test_unobserved_inplace_ops_become_functional_and_fuse():
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    fused = _trace(inplace_chain, x, y)
    g = _shown(fused)
    assert not [n for n in g.nodes() if n.kind().startswith("aten::") and n.kind().endswith("_")]
    assert _group_kinds(g) and all(_in_a_group(g, k) for k in ("aten::relu", "aten::add", "aten::mul"))
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    assert_same(fused(x, y), inplace_chain(x, y))


def observed_alias(x):
    a = x * 2
    v = a[0]  # a view of a: the mutation below is visible through it
    a.relu_()
    return v + 1, a.tanh()


def mutated_input(x, y):
    x.add_(y)  # the caller sees its tensor change
    return (x * 2).sigmoid()


@pytest.mark.parametrize("fn", [observed_alias, mutated_input])
def test_observed_mutation_stays_in_place(fn):
    args = [torch.randn(4, 3) for _ in range(fn.__code__.co_argcount)]
    fused = _trace(fn, *[a.clone() for a in args])
    g = _shown(fused)
    assert [n for n in g.nodes() if n.kind() in ("aten::relu_", "aten::add_")]
    args = [torch.randn(4, 3) for _ in range(len(args))]
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    for a, b in zip(fused(*mine), fn(*theirs)) if fn is observed_alias else [(fused(*mine), fn(*theirs))]:
        assert_same(a, b)
    for a, b in zip(mine, theirs):
        assert_same(a, b)


def mixed_add(x, y):
    a = x * 2
    a.add_(y)  # in place: computed in float32, stored in x's dtype
    return a * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inplace_keeps_selfs_dtype(dtype):
    x, y = torch.randn(8, 4).to(dtype), torch.randn(8, 4)
    fused = _trace(mixed_add, x, y)
    g = _shown(fused)
    assert not g.findAllNodes("aten::add_") and _in_a_group(g, "aten::type_as")
    x, y = torch.randn(8, 4).to(dtype), torch.randn(8, 4)
    out = fused(x, y)
    assert out.dtype == dtype
    assert_same(out, mixed_add(x, y))


def test_binary_inplace_without_types_stays_in_place():
    # a scripted graph has no dtypes: x.add_(y) on an integer x raises in eager where x + y would not
    fused = _script(mixed_add)
    assert _shown(fused).findAllNodes("aten::add_")
    x = torch.arange(6)
    with pytest.raises(RuntimeError, match="can't be cast"):
        mixed_add(x.clone(), torch.rand(6))
    with pytest.raises(RuntimeError, match="can't be cast"):
        fused(x.clone(), torch.rand(6))


@pytest.mark.parametrize("y_type,stays", [("Float(3, 4)", True), ("Float(4)", False), ("Tensor", True),
                                          ("Double(3, 4)", True), ("ComplexFloat(4)", True)])
def test_binary_inplace_needs_recorded_types_that_prove_it(y_type, stays):
    # x.add_(y) with y larger than x raises in eager where x + y would broadcast; without y's type, or with a
    # complex y, nothing proves the functional op equal (a trace cannot record these: eager raised)
    g = torch.parse_ir(f"""
    graph(%x : Float(4), %y : {y_type}):
      %one : int = prim::Constant[value=1]()
      %two : float = prim::Constant[value=2.]()
      %a : Float(4) = aten::mul(%x, %two)
      %b : Float(4) = aten::add_(%a, %y, %one)
      return (%b)
    """)
    prepare.remove_mutation(g)
    g.lint()
    assert bool(g.findAllNodes("aten::add_")) == stays
    if not stays:
        assert g.findAllNodes("aten::type_as")


@pytest.mark.parametrize("name", sorted(prepare.SAME_DTYPE_ACTIVATIONS))
def test_activations_made_functional_keep_every_dtype(name):
    # the list's premise, against eager: the functional op gives the in-place op's dtype, or both raise alike
    args = {"hardtanh": (-1.0, 1.0), "leaky_relu": (0.01,), "threshold": (0.5, 0.0)}.get(name, ())
    functional, inplace = getattr(torch.ops.aten, name), getattr(torch.ops.aten, name + "_")
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.int8, torch.uint8, torch.bool):
        x = torch.tensor([-1, 0, 1, 2]).to(dtype)

        def outcome(fn):
            try:
                return fn(x.clone(), *args).dtype
            except (RuntimeError, NotImplementedError) as e:
                return type(e), str(e).split(" for ")[0][:30]
        assert outcome(functional) == outcome(inplace), (name, dtype)


def test_inplace_activation_after_batch_norm_fuses():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True)).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        fused = _trace(m, x)
        g = _shown(fused)
        assert _group_kinds(g) and all(_in_a_group(g, k) for k in ("aten::rsqrt", "aten::relu"))
        x = torch.randn(2, 3, 8, 8)
        assert_same(fused(x), m(x))


# -------------------------------------------------------------------------------------------------- dropout

class Dropouts(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.d1, self.d2, self.d3 = nn.Dropout(p), nn.Dropout2d(p), nn.AlphaDropout(p)

    def forward(self, x, r):
        return self.d3(self.d2(self.d1(x * 2) + r).sigmoid())


def test_dropout_off_is_removed():
    m = Dropouts(0.3).eval()
    x, r = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    fused = _trace(m, x, r)
    g = _shown(fused)
    assert not [n for n in g.nodes() if "dropout" in n.kind()]
    assert _group_kinds(g) == [["aten::mul", "aten::add", "aten::sigmoid"]]
    x, r = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert_same(fused(x, r), m(x, r))


def test_dropout_with_p_zero_in_training_is_removed():
    m = Dropouts(0.0).train()
    x, r = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    fused = _trace(m, x, r)
    assert not [n for n in _shown(fused).nodes() if "dropout" in n.kind()]
    assert_same(fused(x, r), m(x, r))


def test_dropout_probability_out_of_range_keeps_eagers_error():
    def f(x):
        return torch.dropout(x * 2, 1.5, False) + 1
    fused = _script(f)
    assert _shown(fused).findAllNodes("aten::dropout")
    with pytest.raises(RuntimeError, match="dropout probability"):
        fused(torch.randn(3))


def test_scripted_module_dropout_reads_training_at_run_time():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    fused = _script(m.eval())
    x = torch.randn(3, 4)
    assert_same(fused(x), m(x))
    fused.train()
    torch.manual_seed(0)
    y = fused(x)
    assert bool((y == 0).any()), "dropout is on again"


P = 0.25


def dropout_residual(x, r):
    return torch.dropout(x * 2, P, True) + r


def test_training_dropout_fuses_with_its_neighbours():
    x, r = torch.randn(64, 128), torch.randn(64, 128)
    fused = _trace(dropout_residual, x, r)
    g = _shown(fused)
    assert not g.findAllNodes("aten::dropout")
    assert _group_kinds(g) == [["aten::mul", "aten::rand_like", "aten::gt", "aten::type_as", "aten::mul",
                                "aten::mul", "aten::add"]]
    x, r = torch.randn(64, 128), torch.randn(64, 128)
    with torch.no_grad():
        out = fused(x, r)
    # eager's semantics with another generator's numbers: each element is dropped, or kept scaled by 1/(1-p)
    kept = out != r
    expected = x * 2 * (1 / (1 - P)) + r
    assert_same(out[kept], expected[kept])
    frac = float(kept.float().mean())
    n = kept.numel()
    assert abs(frac - (1 - P)) < 6 * (P * (1 - P) / n) ** 0.5, frac


def test_training_dropout_gradient_is_the_mask_times_the_scale():
    x, r = torch.randn(32, 64), torch.randn(32, 64)
    fused = _trace(dropout_residual, x, r)
    x.requires_grad_()
    g = torch.randn(32, 64)
    out = fused(x, r)
    out.backward(g)
    kept = (out - r) != 0
    scale = 1 / (1 - P)
    assert_same(out.detach(), torch.where(kept, x.detach() * 2 * scale + r, r))
    assert_same(x.grad, torch.where(kept, g * 2 * scale, torch.zeros_like(g)))


def test_training_feature_dropout_stays():
    m = nn.Dropout2d(0.5).train()
    fused = _trace(m, torch.randn(2, 3, 4, 4))
    assert _shown(fused).findAllNodes("aten::feature_dropout")


# ------------------------------------------------------------------------------------------------ batch norm

def _bn(cls, c, affine=True, seed=0):
    torch.manual_seed(seed)
    bn = cls(c, affine=affine).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.25, 4)
        if affine:
            bn.weight.uniform_(-2, 2)
            bn.bias.uniform_(-1, 1)
    return bn


class BNBlock(nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, x, r):
        return torch.relu(self.bn(x) + r)


@pytest.mark.parametrize("cls,shape", [(nn.BatchNorm1d, (6, 5)), (nn.BatchNorm1d, (6, 5, 7)),
                                       (nn.BatchNorm2d, (3, 5, 6, 7)), (nn.BatchNorm3d, (2, 5, 3, 4, 5))],
                         ids=["1d-2dim", "1d-3dim", "2d", "3d"])
@pytest.mark.parametrize("affine", [True, False])
def test_inference_batch_norm_is_one_group_with_add_and_relu(cls, shape, affine):
    m = BNBlock(_bn(cls, shape[1], affine))
    x, r = torch.randn(shape), torch.randn(shape)
    with torch.no_grad():
        fused = _trace(m, x, r)
    g = _shown(fused)
    assert not g.findAllNodes("aten::batch_norm")
    (kinds,) = _group_kinds(g)
    assert {"aten::rsqrt", "aten::relu"} <= set(kinds) and kinds.count("aten::add") == 3
    for _ in range(2):
        x, r = torch.randn(shape) * 3, torch.randn(shape)
        with torch.no_grad():
            assert_same(fused(x, r), m(x, r))
        assert_same(fused(x, r), m(x, r))  # with gradients on: the differentiable group


def test_inference_batch_norm_between_convolutions_stays_eagers_one_kernel():
    """conv -> batch norm -> conv: a group of the batch norm alone would replace eager's one kernel with one of
    ours and save no memory, so it stays; with a ReLU after it, it decomposes and fuses with the ReLU."""
    torch.manual_seed(0)
    conv1, conv2 = nn.Conv2d(3, 5, 3).eval(), nn.Conv2d(5, 4, 1).eval()
    bn = _bn(nn.BatchNorm2d, 5)
    plain, relu = nn.Sequential(conv1, bn, conv2).eval(), nn.Sequential(conv1, bn, nn.ReLU(), conv2).eval()
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        alone, with_relu = _trace(plain, x), _trace(relu, x)
        for f, ref in ((alone, plain), (with_relu, relu)):
            for _ in range(2):
                y = torch.randn(2, 3, 9, 9)
                assert_same(f(y), ref(y))
    g = _shown(alone)
    assert g.findAllNodes("aten::batch_norm") and not graph_fuser.fusion_groups(g)
    g = _shown(with_relu)
    assert not g.findAllNodes("aten::batch_norm")
    (kinds,) = _group_kinds(g)
    assert {"aten::rsqrt", "aten::relu"} <= set(kinds)


def test_inference_batch_norm_layouts_and_dtypes():
    m = BNBlock(_bn(nn.BatchNorm2d, 5))
    x = torch.randn(3, 5, 6, 7)
    with torch.no_grad():
        fused = _trace(m, x, x)
        cl = torch.randn(3, 5, 6, 7).to(memory_format=torch.channels_last)
        assert_same(fused(cl, cl), m(cl, cl))
        for dtype in (torch.float64, torch.bfloat16, torch.float16):
            x, r = torch.randn(3, 5, 6, 7, dtype=dtype), torch.randn(3, 5, 6, 7, dtype=dtype)
            if dtype == torch.float64:  # float32 parameters: eager's CPU kernel refuses
                with pytest.raises(RuntimeError, match="mixed dtype"):
                    m(x, r)
                with pytest.raises(RuntimeError, match="mixed dtype"):
                    fused(x, r)
            else:  # float32 parameters, reduced-precision input: computed in float32, stored in the input dtype
                assert_same(fused(x, r), m(x, r))
            same = BNBlock(_bn(nn.BatchNorm2d, 5)).to(dtype)
            fused_same = _trace(same, x, r)
            assert_same(fused_same(x, r), same(x, r))


def test_inference_batch_norm_gradients():
    m = BNBlock(_bn(nn.BatchNorm2d, 5))
    ref = BNBlock(_bn(nn.BatchNorm2d, 5))
    x, r = torch.randn(3, 5, 4, 4), torch.randn(3, 5, 4, 4)
    fused = _trace(m, x, r)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    g = torch.randn(3, 5, 4, 4)
    fused(xs[0], r).backward(g)
    ref(xs[1], r).backward(g)
    assert_same(xs[0].grad, xs[1].grad)
    for a, b in zip(m.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)


def test_inference_batch_norm_bad_input_raises_eagers_error():
    m = BNBlock(_bn(nn.BatchNorm2d, 5))
    with torch.no_grad():
        fused = _trace(m, torch.randn(2, 5, 3, 3), torch.randn(2, 5, 3, 3))
        for bad in (torch.randn(2, 4, 3, 3), torch.randn(2, 1, 3, 3)):  # wrong channel count (1 would broadcast)
            with pytest.raises(RuntimeError) as eager:
                m(bad, bad)
            with pytest.raises(RuntimeError) as ours:  # raised in the interpreter: it adds a TorchScript traceback
                fused(bad, bad)
            assert str(eager.value) in str(ours.value)
            assert "functional.py" in str(ours.value)  # the traceback points at F.batch_norm, as a stock trace's
        empty = torch.randn(0, 5, 3, 3)
        assert_same(fused(empty, empty), m(empty, empty))


def test_training_batch_norm_and_missing_statistics_stay():
    bn_train = BNBlock(nn.BatchNorm2d(5).train())
    no_stats = BNBlock(nn.BatchNorm2d(5, track_running_stats=False).eval())
    x = torch.randn(2, 5, 3, 3)
    for m in (bn_train, no_stats):
        fused = _trace(m, x, x)
        assert _shown(fused).findAllNodes("aten::batch_norm")


def test_frozen_module_folds_conv_and_batch_norm():
    # torch.jit.freeze (run_frozen_optimizations) folds each conv's BN into its weights when it sees
    # aten::batch_norm: freeze a stock trace, then fuse what remains (the residual add and the ReLU)
    class ConvBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), _bn(nn.BatchNorm2d, 4)

        def forward(self, x, r):
            return torch.relu(self.bn(self.conv(x)) + r)

    m = ConvBN().eval()
    x, r = torch.randn(2, 3, 6, 6), torch.randn(2, 4, 6, 6)
    frozen = fuser.fuse(torch.jit.freeze(torch.jit.trace(m, (x, r))))
    g = _shown(frozen)
    assert not g.findAllNodes("aten::batch_norm") and not g.findAllNodes("fuser::batch_norm_params")
    assert g.findAllNodes("aten::conv2d") or g.findAllNodes("aten::_convolution")
    assert _group_kinds(g) == [["aten::add", "aten::relu"]]
    x, r = torch.randn(2, 3, 6, 6), torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(frozen(x, r), m(x, r))  # folding rounds differently: float32's defaults


class _MaskedAttention(nn.Module):
    """Attention whose mask is a broadcast view, as a traced Hugging Face model builds it."""

    def forward(self, q, keep):
        mask = keep[:, None, :, None].expand(q.shape[0], 1, q.shape[2], q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, mask, 0.0, False, scale=0.25)


def test_an_expanded_attention_mask_is_made_contiguous_and_the_result_is_eagers():
    """A mask made by expand (stride 0 in its last dim) makes CUDA's fused attention kernels refuse it (tests/
    test_gpu.py); the pass copies it to a contiguous mask of the same values first."""
    torch.manual_seed(3)
    m = _MaskedAttention()
    q, keep = torch.randn(2, 3, 5, 8), torch.rand(2, 5) > 0.3
    keep[:, 0] = True  # a row of all False is NaN in eager on some paths: keep every query attending somewhere
    with torch.no_grad():
        traced = _trace(m, q, keep)
        for _ in range(2):
            q2 = torch.randn(2, 3, 5, 8)
            assert_same(traced(q2, keep), m(q2, keep))
    g = traced.graph
    (sdpa,) = g.findAllNodes("aten::scaled_dot_product_attention")
    assert sdpa.inputsAt(3).node().kind() == "aten::contiguous"
    assert sdpa.inputsAt(3).node().inputsAt(0).node().kind() == "aten::expand"


class _IndexMaskAttention(nn.Module):
    """Attention whose mask is built from positions, as a traced Hugging Face model (transformers 5.17) builds an
    all-True one: ``(arange(n) + offset)[None, None, :, None] >= bound``, expanded."""

    def __init__(self, offset: int, bound: int):
        super().__init__()
        self.offset, self.bound = offset, bound

    def forward(self, q):
        n = q.shape[2]
        idx = torch.arange(n, device=q.device) + self.offset
        mask = (idx[None, None, :, None] >= self.bound).expand(q.shape[0], 1, n, n)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, mask, 0.0, False, scale=0.25)


@pytest.mark.parametrize("offset,bound,dropped", [(0, 0, True), (3, 2, True), (0, 1, False), (-1, 0, False)])
def test_an_all_true_attention_mask_becomes_none_and_the_result_is_eagers(offset, bound, dropped):
    """A mask the pass proves all True (every position + offset >= bound) is dropped: eager's result with None,
    which lets CUDA run its flash kernel. A mask with a False somewhere (the first query row) stays."""
    torch.manual_seed(5)
    m = _IndexMaskAttention(offset, bound)
    q = torch.randn(2, 3, 5, 8)
    with torch.no_grad():
        traced = _trace(m, q)
        for _ in range(2):
            q2 = torch.randn(2, 3, 5, 8)
            assert_same(traced(q2), m(q2))
    (sdpa,) = traced.graph.findAllNodes("aten::scaled_dot_product_attention")
    assert (sdpa.inputsAt(3).node().kind() == "prim::Constant" and sdpa.inputsAt(3).toIValue() is None) == dropped

