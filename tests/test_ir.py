"""The group IR (fuser/ir.py): groups built from the IR alone run through the kernel store, the executor, the
fallback and autodiff, on the CPU and (marked gpu) on CUDA, against eager PyTorch; the canonical text; the
TorchScript door's lowering; and the layering rule that no stage after the pass reads a TorchScript graph."""
import re
from pathlib import Path

import pytest
import torch

import fuser
from fuser import executor, fallback, ir, ts_ir
from fuser.kernel_cache import STORE, KernelStore


def _gelu_cat_group() -> ir.Group:
    """out0 = cat([gelu_tanh(x * w + s), sigmoid(x) - 0.5], 1); out1 = x * w + s (s a float input)."""
    b = ir.Builder()
    x, w, s = b.input(), b.input(), b.input(ir.FLOAT)
    xw = b.call("aten::mul", x, w)
    a = b.call("aten::add", xw, s, 1)
    g = b.add("aten::gelu", a, "tanh")
    h = b.call("aten::sub", b.call("aten::sigmoid", x), 0.5, 1)
    c = b.add("aten::cat", (g, h), 1)
    return b.build([c, a])


def _eager(x, w, s):
    a = x * w + s
    return [torch.cat([torch.nn.functional.gelu(a, approximate="tanh"), torch.sigmoid(x) - 0.5], 1), a]


def _assert_close(outs, refs, dtype):
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape and o.device == r.device
        torch.testing.assert_close(o.double(), r.double(), rtol=tol, atol=tol)


def _run_group_on(device: str, dtype: torch.dtype):
    group = _gelu_cat_group()
    spec = STORE.get(STORE.register(group))
    x = torch.randn(37, 129, dtype=dtype, device=device)
    w = torch.randn(129, dtype=dtype, device=device)  # a row broadcast
    s = float(torch.randn(()).item())
    out = executor.run(spec, [x, w, s])
    assert out is not None, executor.plan(spec, [x, w, s])
    ref = _eager(x, w, s)
    _assert_close(out, ref, dtype)
    # the fused result follows eager computed in float64 as closely as eager itself does
    ref64 = _eager(x.double(), w.double(), s)
    for o, r, r64 in zip(out, ref, ref64):
        err, eager_err = (o.double() - r64).abs().max().item(), (r.double() - r64).abs().max().item()
        assert err <= 4 * eager_err + (1e-6 if dtype == torch.float32 else 1e-14)
    return spec


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_a_group_built_from_the_ir_alone_runs_fused_on_the_cpu(dtype):
    spec = _run_group_on("cpu", dtype)
    assert any(k is not None for k in spec.kernels().values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_a_group_built_from_the_ir_alone_runs_fused_on_cuda(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = _run_group_on("cuda", dtype)
    assert any(k is not None and k.arg_spec.device_type == "cuda" for k in spec.kernels().values())


def test_the_ir_group_under_autograd_matches_eager_gradients():
    spec = STORE.get(STORE.register(_gelu_cat_group()))
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    out = fuser.run_fusion(spec.key, [x, w, 0.25])
    ref = _eager(x, w, 0.25)
    go = [torch.randn_like(r) for r in ref]
    got = torch.autograd.grad(out, (x, w), go)
    want = torch.autograd.grad(ref, (x, w), go)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_the_fallback_evaluates_the_ir_with_eagers_results_and_errors():
    group = _gelu_cat_group()
    x, w = torch.randn(5, 7), torch.randn(7)
    for o, r in zip(fallback.evaluate(group, [x, w, -1.5]), _eager(x, w, -1.5)):
        assert torch.equal(o, r)
    bad = torch.randn(6)  # does not broadcast against (5, 7): eager's error, not a wrong answer
    with pytest.raises(RuntimeError) as fused_err:
        fallback.evaluate(group, [x, bad, 1.0])
    with pytest.raises(RuntimeError) as eager_err:
        _eager(x, bad, 1.0)
    assert str(fused_err.value) == str(eager_err.value)
    # the executor refuses these inputs rather than running a kernel on them
    assert executor.run(STORE.get(STORE.register(group)), [x, bad, 1.0]) is None


def test_canonical_text_names_overloads_and_types_constants():
    text = _gelu_cat_group().text()
    assert text.splitlines() == [
        "in %0: Tensor", "in %1: Tensor", "in %2: float",
        "%3: Tensor = aten::mul.Tensor(%0, %1)",
        "%4: Tensor = aten::add.Scalar(%3, %2, 1)",
        '%5: Tensor = aten::gelu(%4, "tanh")',
        "%6: Tensor = aten::sigmoid(%0)",
        "%7: Tensor = aten::sub.Scalar(%6, 0.5, 1)",
        "%8: Tensor = aten::cat([%5, %7], 1)",
        "return %8, %4"]
    # an int and a float constant differ; -0.0, inf and nan print distinctly
    b = ir.Builder()
    x = b.input()
    outs = [b.call("aten::mul", x, c) for c in (1, 1.0, -0.0, float("inf"), float("nan"))]
    lines = b.build(outs).text().splitlines()[1:6]
    assert [ln.split("(")[1] for ln in lines] == ["%0, 1)", "%0, 1.0)", "%0, -0.0)", "%0, inf)", "%0, nan)"]


def test_lowering_a_torchscript_graph_gives_the_same_group_as_building_it():
    g = torch.parse_ir("""graph(%x : Float(2, 3), %w : Tensor, %s : float):
      %one : int = prim::Constant[value=1]()
      %half : float = prim::Constant[value=0.5]()
      %dim : int = prim::Constant[value=1]()
      %approx : str = prim::Constant[value="tanh"]()
      %xw : Tensor = aten::mul(%x, %w)
      %a : Tensor = aten::add(%xw, %s, %one)
      %g : Tensor = aten::gelu(%a, %approx)
      %sg : Tensor = aten::sigmoid(%x)
      %h : Tensor = aten::sub(%sg, %half, %one)
      %l : Tensor[] = prim::ListConstruct(%g, %h)
      %c : Tensor = aten::cat(%l, %dim)
      return (%c, %a)""")
    lowered = ts_ir.lower(g)
    assert lowered.text() == _gelu_cat_group().text()
    # and raised back, TorchScript's interpreter computes what the group computes
    x, w = torch.randn(2, 3), torch.randn(3)
    raised = ts_ir.raise_group(lowered)
    got = torch._C._jit_interpret_graph(raised, (x, w, 0.75))
    for o, r in zip(got, _eager(x, w, 0.75)):
        assert torch.equal(o, r)
    # one key for both doors
    store = KernelStore()
    assert store.register(lowered) == store.register(_gelu_cat_group())


def test_the_builder_checks_what_it_is_given():
    b = ir.Builder()
    x = b.input()
    with pytest.raises(TypeError):
        b.add("aten::mul.Tensor", x)  # an argument short
    with pytest.raises(TypeError):
        b.add("aten::gelu", x, 3)  # approximate is a str
    with pytest.raises(ValueError):
        b.input("int")
    assert b.call("aten::add", x, 2, 1) and b.nodes[-1].op == "aten::add.Scalar"
    assert b.call("aten::add", x, x) and b.nodes[-1].op == "aten::add.Tensor" and b.nodes[-1].args[2] == 1
    stranger = ir.Value(99)
    with pytest.raises(ValueError):
        ir.Group((x,), (ir.Node("aten::neg", (stranger,), ir.Value(100)),), (ir.Value(100),))
    with pytest.raises(TypeError):
        STORE.register(torch._C.Graph())  # a TorchScript graph is lowered first (fuser.ts_ir.lower)


# the stages after the pass read only the group IR: no TorchScript graph API in their sources
_AFTER_THE_PASS = ["kernel_cache.py", "executor.py", "compiler.py", "fallback.py", "autodiff.py", "backward.py",
                   "derivatives.py",
                   "codegen", "cpu", "cuda/launch.py", "cuda/driver.py", "cuda/templates.py"]
_GRAPH_API = re.compile(r"torch\._C\.(Graph|Node|Value|TensorType|ListType)|parse_ir|_jit_interpret_graph|\.nodes\(\)"
                        r"|\.inputs\(\)|\.outputs\(\)|\.schema\(\)|toIValue")


def test_no_stage_after_the_pass_reads_a_torchscript_graph():
    root = Path(fuser.__file__).parent
    files = [p for name in _AFTER_THE_PASS for p in ((root / name).rglob("*.py") if (root / name).is_dir()
                                                       else [root / name])]
    assert len(files) >= 15
    offenders = {str(p.relative_to(root)): m.group(0) for p in files
                 for m in [_GRAPH_API.search(p.read_text())] if m}
    assert offenders == {}
