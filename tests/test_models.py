"""The model zoo: real networks through the whole pipeline, against eager.

Hugging Face transformers models built from tiny configs in place (no download): GPT-2, BERT, ViT, ConvNeXt,
ResNet, MobileNetV2; and two blocks written as torchvision writes them (in-place ReLU and ``+=``, Hardswish and a
squeeze-excitation), which also script. Each is traced (and scripted where it scripts) with ``fuser.install()``,
in eval and in train mode, and

* its outputs equal eager's (float32, 1e-5 relative), under ``torch.no_grad()`` (forward kernels) and with
  gradients on; its gradients (parameters, and the image for vision models) equal eager's after one backward;
  in train mode batch norm's running statistics after the call equal eager's too;
* the fused regions that matter are asserted per model (BN+residual add+ReLU groups in ResNet, the tanh-GELU
  chain in GPT-2, dropout+residual add in BERT and ViT, ...).

Dropout: the equality checks run with every dropout probability 0 (dropout is then the identity, in eager and
in the pass). With dropout on (p = 0.1) fused numbers are not eager's (another generator), so those runs (in
float64) check that dropout fused with its neighbours, that the same seed repeats a run and another seed does
not, that no group falls back to the interpreter, and that the gradient equals the central difference of the
loss along a random direction of all parameters (the seed fixes the masks); tests/test_prepare.py checks
dropout's values and gradient against its mask.

Fixed seeds only. Train mode ``torch.jit.trace`` calls the model once, so the eager reference is copied after
tracing (batch norm's running statistics moved once in both).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import transformers

import fuser
from fuser import graph_fuser, integration, ts_ir

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
RTOL = ATOL = 1e-5


# --------------------------------------------------------------------------- torchvision-style blocks (scriptable)

class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock at a tiny size: in-place ReLU, ``out += identity``."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: Optional[nn.Module] = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation as MobileNetV3 uses it (Hardsigmoid scale)."""

    def __init__(self, c: int, squeeze: int):
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = nn.functional.adaptive_avg_pool2d(x, 1)
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(scale))))
        return scale * x


class InvertedResidual(nn.Module):
    """torchvision.models.mobilenetv3.InvertedResidual: Conv-BN-Hardswish(inplace) expand and depthwise, SE,
    Conv-BN project, ``result += input``."""

    def __init__(self, c: int, expanded: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, expanded, 1, bias=False), nn.BatchNorm2d(expanded),
                                    nn.Hardswish(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(expanded, expanded, 3, 1, 1, groups=expanded, bias=False),
                                       nn.BatchNorm2d(expanded), nn.Hardswish(inplace=True))
        self.se = SqueezeExcitation(expanded, 8)
        self.project = nn.Sequential(nn.Conv2d(expanded, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.project(self.se(self.depthwise(self.expand(x))))
        result += x
        return result


class TinyMobileNetV3(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.Hardswish(inplace=True))
        self.block = InvertedResidual(16, 32)
        self.classifier = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=dropout, inplace=True), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.stem(x))
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


# ------------------------------------------------------------------------------------------------ the zoo

class HFWrapper(nn.Module):
    """A Hugging Face model called with ``return_dict=False`` (a tuple of tensors, which trace accepts)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        return self.model(x, return_dict=False)


def _hf(cls, config_cls, **kwargs) -> Callable[[float], nn.Module]:
    def build(p: float) -> nn.Module:
        dropouts = {k: p for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
                                   "attention_probs_dropout_prob", "classifier_dropout_prob", "drop_path_rate")
                    if k in kwargs}
        return HFWrapper(cls(config_cls(**{**kwargs, **dropouts})))
    return build


def _text(vocab: int):
    return lambda g: (torch.randint(0, vocab, (2, 8), generator=g),)


def _image(size: int):
    return lambda g: (torch.randn(2, 3, size, size, generator=g),)


def _groups_with(graph, *kinds) -> int:
    """Fusion groups whose subgraph holds every op in ``kinds``."""
    return sum(all(any(n.kind() == f"aten::{k}" for n in s.nodes()) for k in kinds)
               for s in (gr.g("Subgraph") for gr in graph_fuser.fusion_groups(graph)))


@dataclass
class Model:
    name: str
    build: Callable[[float], nn.Module]  # dropout probability -> model
    inputs: Callable[[torch.Generator], tuple]
    image: bool
    scripts: bool = False
    # mode -> (graph -> None), assertions on the traced graph (prim::FusionGroup nodes raised back)
    expect: dict = field(default_factory=dict)
    dropout: bool = True  # has dropout layers (the p > 0 runs check they fused)


def _expect_gpt2_eval(g):
    # GPT-2's gelu_new, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), written in ops: one group per layer; each
    # residual add with the layer_norm that reads it (a row kernel, fuser/rows/): two per layer, and ln_f
    assert _groups_with(g, "tanh", "pow", "mul", "add") == 2
    assert _groups_with(g, "add", "layer_norm") == 5 and len(graph_fuser.fusion_groups(g)) == 7
    assert not g.findAllNodes("aten::layer_norm")


def _expect_bert_eval(g):
    # the three embeddings summed (word + token type + position) with their layer_norm, and each residual add with
    # its layer_norm (row kernels, fuser/rows/); gelu follows a linear, so it has no pointwise neighbour at eval
    assert _groups_with(g, "add", "add", "layer_norm") == 5 and len(graph_fuser.fusion_groups(g)) == 5
    assert not g.findAllNodes("aten::layer_norm")


def _expect_vit(g):
    # each residual add with the layer_norm after it (the next layernorm_before, the last one the final norm): row
    # kernels (fuser/rows/); gelu follows a linear, so it has no pointwise neighbour
    assert _groups_with(g, "add", "layer_norm") == 5 and len(graph_fuser.fusion_groups(g)) == 5
    assert not g.findAllNodes("aten::layer_norm")


def _expect_resnet_eval(g):
    # every BN decomposed and in a group: conv-BN-ReLU, and per residual block BN (+ shortcut BN) + add + ReLU
    assert not g.findAllNodes("aten::batch_norm")
    assert _groups_with(g, "rsqrt", "relu") == len(graph_fuser.fusion_groups(g))
    assert sum(1 for gr in graph_fuser.fusion_groups(g)
               if [n.kind() for n in gr.g("Subgraph").nodes()].count("aten::rsqrt") >= 1
               and _has_residual_add(gr)) == 2


def _has_residual_add(group) -> bool:
    # an add of two tensors (not the eps add of a decomposed BN, whose second operand is a constant)
    return any(n.kind() == "aten::add" and all(v.node().kind() != "prim::Constant" for v in list(n.inputs())[:2])
               and "aten::type_as" in (n.inputsAt(0).node().kind(), n.inputsAt(1).node().kind())
               for n in group.g("Subgraph").nodes())


def _expect_mobilenetv2_eval(g):
    # 52 conv-BN pairs: BN + ReLU6 (hardtanh) where an activation follows, BN + residual add at the block ends; the
    # project BNs between two convolutions stay eager's one kernel (a group of one BN would save no memory)
    n_alone = len(g.findAllNodes("aten::batch_norm"))
    assert n_alone == 2  # this config's two project BNs that no residual add follows
    assert len(graph_fuser.fusion_groups(g)) == 52 - n_alone
    assert _groups_with(g, "rsqrt", "hardtanh") == 35
    assert sum(_has_residual_add(gr) for gr in graph_fuser.fusion_groups(g)) == 10


def _expect_tv_resnet_eval(g):
    # traced: in-place ReLU and `out += identity` became functional, so BN + add + ReLU is one group
    assert not g.findAllNodes("aten::relu_") and not g.findAllNodes("aten::add_")
    assert not g.findAllNodes("aten::batch_norm")
    assert sum(_has_residual_add(gr) for gr in graph_fuser.fusion_groups(g)) == 2


def _expect_tv_mobilenet_eval(g):
    # in-place Hardswish became functional; the residual `+=` joined the project BN's group
    assert not g.findAllNodes("aten::hardswish_") and not g.findAllNodes("aten::add_")
    assert not g.findAllNodes("aten::batch_norm")
    assert sum(_has_residual_add(gr) for gr in graph_fuser.fusion_groups(g)) == 1
    # each BN with its Hardswish (3), the project BN with the residual add, and the SE's hardsigmoid * x
    assert _groups_with(g, "rsqrt") == 4
    assert _groups_with(g, "rsqrt", "hardswish") == 3
    assert _groups_with(g, "hardsigmoid") == 1


def _expect_tv_scripted(g):
    # scripted modules read self.training at run time: batch norm and dropout stay (a frozen module folds BN
    # into the conv instead, tests/test_prepare.py), so nothing fuses. In-place activations still become
    # functional, except on the result of `+=`, which stays in place: a scripted graph has no dtypes to prove
    # `x + y` has x's dtype, and an in-place op's result aliases its input
    assert g.findAllNodes("aten::batch_norm")
    assert g.findAllNodes("aten::relu") or g.findAllNodes("aten::hardswish")
    for n in g.findAllNodes("aten::relu_") + g.findAllNodes("aten::hardswish_"):
        assert n.inputsAt(0).node().kind() == "aten::add_", n


def _expect_convnext(g):
    # each block ends in `residual + (layer_scale * x).permute(0, 3, 1, 2)`: the permute joins the group, which reads
    # x and the scale through it (fuser/views.py). The last block's residual add goes with the pooler's mean over H and
    # W that reads it instead (a row kernel, fuser/rows/; a permute stays out of a group with a reduction). gelu
    # follows a linear and a linear follows it, and the channels-last layer_norms follow a permute or a convolution
    # and a linear follows them: no neighbour
    kinds = [[n.kind() for n in grp.g("Subgraph").nodes()] for grp in graph_fuser.fusion_groups(g)]
    assert len(kinds) == 2
    assert sum({"aten::mul", "aten::permute", "aten::add"} <= set(k) for k in kinds) == 1
    assert sum({"aten::mean", "aten::add"} <= set(k) for k in kinds) == 1
    assert not g.findAllNodes("aten::dropout")


def _expect_dropout_add(count):
    def check(g):
        # dropout decomposed into rand_like > p (Philox in the kernel), its mask fused with what follows: the
        # residual add, and the layer_norm after it (a row kernel, fuser/rows/). A group with a reduction runs
        # eager's ops under autograd for now (no reduction derivatives yet), so rand_like stays out of such a group
        # (its numbers would differ between a no-grad call and one under autograd) and runs as eager's op
        assert _groups_with(g, "gt", "type_as", "mul") == count
        assert not g.findAllNodes("aten::dropout")
    return check


def _expect_bn_training(groups_with_add_relu: int):
    def check(g):
        # training-mode batch norm normalizes with the batch's statistics: it stays, and splits the chains
        assert g.findAllNodes("aten::batch_norm")
        assert _groups_with(g, "add", "relu") == groups_with_add_relu
    return check


MODELS = [
    Model("gpt2", _hf(transformers.GPT2Model, transformers.GPT2Config, n_embd=32, n_layer=2, n_head=2,
                      vocab_size=100, n_positions=16, use_cache=False, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
          _text(100), image=False,
          # with dropout on: each dropout mask with the residual add and layer_norm after it, and the embeddings' one
          expect={"eval": _expect_gpt2_eval, "train": _expect_gpt2_eval, "train_dropout": _expect_dropout_add(5)}),
    Model("bert", _hf(transformers.BertModel, transformers.BertConfig, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=37, vocab_size=100, max_position_embeddings=16,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
          _text(100), image=False,
          # with dropout on: dropout + residual add + layer_norm twice per layer, and the embeddings' dropout
          expect={"eval": _expect_bert_eval, "train": _expect_bert_eval, "train_dropout": _expect_dropout_add(5)}),
    Model("vit", _hf(transformers.ViTModel, transformers.ViTConfig, image_size=16, patch_size=8, hidden_size=32,
                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
          _image(16), image=True,
          # with dropout on: each dropout mask with the residual add and layer_norm after it, and the embeddings' one
          expect={"eval": _expect_vit, "train": _expect_vit, "train_dropout": _expect_dropout_add(5)}),
    Model("convnext", _hf(transformers.ConvNextModel, transformers.ConvNextConfig, hidden_sizes=[8, 16],
                          depths=[1, 1], num_stages=2, image_size=16, drop_path_rate=0.0),
          _image(16), image=True, dropout=False,
          expect={m: _expect_convnext for m in ("eval", "train")}),
    Model("resnet", _hf(transformers.ResNetModel, transformers.ResNetConfig, embedding_size=8, hidden_sizes=[8, 16],
                        depths=[1, 1], layer_type="basic"),
          _image(16), image=True, dropout=False,
          # train: TorchScript's RemoveMutation makes one of the two `+=` functional; the other's BN would have to
          # move past the shortcut BN's num_batches_tracked.add_, which alias analysis forbids
          expect={"eval": _expect_resnet_eval, "train": _expect_bn_training(1)}),
    Model("mobilenetv2", _hf(transformers.MobileNetV2Model, transformers.MobileNetV2Config, image_size=16,
                             depth_multiplier=0.25, classifier_dropout_prob=0.0),
          _image(16), image=True, dropout=False,
          expect={"eval": _expect_mobilenetv2_eval, "train": _expect_bn_training(0)}),
    Model("tv_resnet", lambda p: TinyResNet(), _image(16), image=True, scripts=True, dropout=False,
          expect={"eval": _expect_tv_resnet_eval, "train": _expect_bn_training(1), "script": _expect_tv_scripted}),
    Model("tv_mobilenetv3", lambda p: TinyMobileNetV3(p), _image(16), image=True, scripts=True, dropout=False,
          expect={"eval": _expect_tv_mobilenet_eval, "train": _expect_bn_training(0),
                  "script": _expect_tv_scripted}),
]
BY_NAME = {m.name: m for m in MODELS}


# ----------------------------------------------------------------------------------------------- helpers

def _build(spec: Model, p: float, train: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = spec.build(p).train(train)
    with torch.no_grad():  # running statistics away from their 0/1 start, so inference BN is not the identity
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def _inputs(spec: Model, seed: int = 1, grad: bool = False, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(seed)
    xs = tuple(x.to(device) for x in spec.inputs(g))
    return tuple(x.clone().requires_grad_() for x in xs) if grad and spec.image else xs


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


def _assert_close(actual, expected, what: str) -> None:
    a, e = _tensors(actual), _tensors(expected)
    assert len(a) == len(e) and len(a) > 0, what
    for x, y in zip(a, e):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _loss(out) -> torch.Tensor:
    # a fixed random weighting, so that no gradient is a sum that cancels
    total = 0
    for i, t in enumerate(_tensors(out)):
        if t.is_floating_point():
            w = torch.randn(t.shape, generator=torch.Generator().manual_seed(100 + i)).to(t.device, t.dtype)
            total = total + (t * w).sum()
    return total


def _fused(graph) -> torch._C.Graph:
    g = graph.copy()
    graph_fuser.raise_fusion_calls(g, lambda key: ts_ir.raise_group(integration.STORE.get(key).group))
    return g


def _trace(spec: Model, model: nn.Module, xs: tuple):
    fuser.install()
    try:
        return torch.jit.trace(model, xs, check_trace=False)
    finally:
        fuser.uninstall()


def _assert_grad_close(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """A gradient ``got`` against eager's float32 one elementwise, within RTOL/ATOL widened by twice eager's own
    largest error against the float64 gradient ``exact``: a parameter's gradient sums a term per row and position,
    and where large terms cancel, float32 rounding in another summation order moves a small element by more than
    1e-5 of itself (the tiny GPT-2's attention bias: terms up to 300, an element of 0.15 off by 2.3e-5 where eager's
    own error was 2.1e-5)."""
    slack = 2 * (eager.double() - exact).abs().max().item() if eager.numel() else 0.0
    torch.testing.assert_close(got, eager, rtol=RTOL, atol=ATOL + slack, msg=lambda m: f"{what}: {m}")


def _check_against_eager(spec: Model, fused, owner: nn.Module, ref: nn.Module, train: bool,
                         device: str = "cpu") -> None:
    """``fused`` (whose parameters and buffers are ``owner``'s) against ``ref`` (eager, in the same state); the
    gradients also against ``ref`` in float64 (:func:`_assert_grad_close`)."""
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        xs = _inputs(spec, device=device)
        _assert_close(fused(*xs), ref(*xs), f"{spec.name} forward (no_grad)")
    xs_f, xs_e = _inputs(spec, grad=True, device=device), _inputs(spec, grad=True, device=device)
    xs_64 = tuple(x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x
                  for x in _inputs(spec, grad=True, device=device))
    out_f, out_e = fused(*xs_f), ref(*xs_e)
    _assert_close(out_f, out_e, f"{spec.name} forward")
    _loss(out_f).backward()
    _loss(out_e).backward()
    _loss(ref64(*xs_64)).backward()
    for (name, p), (_, q), (_, r) in zip(owner.named_parameters(), ref.named_parameters(), ref64.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            _assert_grad_close(p.grad, q.grad, r.grad, f"grad {name}")
    for a, b, c in zip(xs_f, xs_e, xs_64):
        if a.requires_grad:
            _assert_grad_close(a.grad, b.grad, c.grad, "input grad")
    if train:
        for (name, a), (_, b) in zip(owner.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"buffer {name}: {m}")


# ------------------------------------------------------------------------------------------------- tests

@pytest.fixture(autouse=True)
def _fusion_on():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_traced_model_matches_eager(name, mode):
    spec = BY_NAME[name]
    model = _build(spec, 0.0, mode == "train")
    fused = _trace(spec, model, _inputs(spec))
    spec.expect[mode](_fused(fused.graph))
    # after tracing, which ran the model once (train mode moved batch norm's running statistics)
    _check_against_eager(spec, fused, model, copy.deepcopy(model), mode == "train")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_traced_model_matches_eager_on_cuda(name, mode):
    # eager's CUDA batch norm computes ((x - mean) * invstd) * w + b: the CPU formula here is within float32's
    # tolerance of it, not bitwise
    assert fuser.can_fuse_on_gpu()
    spec = BY_NAME[name]
    model = _build(spec, 0.0, mode == "train").cuda()
    fused = _trace(spec, model, _inputs(spec, device="cuda"))
    spec.expect[mode](_fused(fused.graph))
    _check_against_eager(spec, fused, model, copy.deepcopy(model), mode == "train", device="cuda")


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", [m.name for m in MODELS if m.scripts])
def test_scripted_model_matches_eager(name, mode):
    spec = BY_NAME[name]
    model = _build(spec, 0.0, mode == "train")
    fuser.install()
    try:
        fused = torch.jit.script(copy.deepcopy(model))
    finally:
        fuser.uninstall()
    spec.expect["script"](_fused(fused.graph))
    _check_against_eager(spec, fused, fused, model, mode == "train")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", [m.name for m in MODELS if m.dropout])
def test_train_mode_with_dropout_on(name, device, monkeypatch):
    spec = BY_NAME[name]
    model = _build(spec, 0.1, True).double().to(device)
    xs = tuple(x.double() if x.is_floating_point() else x for x in _inputs(spec, device=device))
    fused = _trace(spec, model, xs)
    spec.expect["train_dropout"](_fused(fused.graph))

    def loss(seed):
        torch.manual_seed(seed)  # the dropout masks' Philox state comes from torch's generator
        return _loss(fused(*xs))

    with torch.no_grad():  # forward kernels, Philox in the kernel
        a, b, c = loss(5), loss(5), loss(6)
    assert a == b, "the same seed must repeat a run"
    assert a != c, "dropout must draw other masks for another seed"
    # the gradient: the backward kernels redraw the forward's masks (never the interpreter), and it equals the
    # derivative of the (masked, so deterministic per seed) loss along a random direction of every parameter
    from fuser import fallback
    interpret = fallback.run

    def run(spec, args):  # groups with a reduction run eager's ops under autograd for now; random ones never
        if spec.random:
            pytest.fail(f"{name}: a group with rand_like ran in the interpreter")
        return interpret(spec, args)

    monkeypatch.setattr(fallback, "run", run)
    params = [p for p in model.parameters() if p.requires_grad]
    loss(7).backward()
    g = torch.Generator().manual_seed(3)
    dirs = [torch.randn(p.shape, generator=g, dtype=p.dtype).to(device) for p in params]
    analytic = sum(float((p.grad * d).sum()) for p, d in zip(params, dirs) if p.grad is not None)
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, dirs):
            p.add_(d, alpha=eps)
        up = float(loss(7))
        for p, d in zip(params, dirs):
            p.add_(d, alpha=-2 * eps)
        down = float(loss(7))
    numeric = (up - down) / (2 * eps)
    assert abs(analytic - numeric) <= 1e-6 * max(1.0, abs(numeric)), (analytic, numeric)
