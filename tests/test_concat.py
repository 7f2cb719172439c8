"""torch.cat inside fusion groups: the kernel writes each piece into its slice of the output. The pass's
decisions, every dim and layout against torch.cat, dtype promotion, the fallbacks, autograd, and the CUDA
source through NVRTC."""
import pytest
import torch
from helpers import FUSED_BACKWARD, assert_same, fused_graph

import fuser
from fuser import codegen, compiler, executor
from fuser.descs import DENSE, ROWS, STRIDED, ArgSpec, TensorDesc
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower


@pytest.fixture(autouse=True)
def _needs_cpu_fusion():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


def _ir(dim: int, n: int = 2) -> str:
    """cat of n exact pieces (x + y, x * y, x - y: correctly rounded, so equal to eager's bit for bit)."""
    ops = ["aten::add(%x, %y, %one)", "aten::mul(%x, %y)", "aten::sub(%x, %y, %one)"][:n]
    lines = [f"  %p{k} : Tensor = {op}" for k, op in enumerate(ops)]
    items = ", ".join(f"%p{k}" for k in range(n))
    return (f"graph(%x : Tensor, %y : Tensor):\n  %one : int = prim::Constant[value=1]()\n"
            f"  %d : int = prim::Constant[value={dim}]()\n" + "\n".join(lines) +
            f"\n  %l : Tensor[] = prim::ListConstruct({items})\n  %c : Tensor = aten::cat(%l, %d)\n"
            f"  return (%c, %p0)\n")


def _eager(x, y, dim, n=2):
    pieces = [x + y, x * y, x - y][:n]
    return torch.cat(pieces, dim), pieces[0]


def _layouts():
    x = torch.randn(6, 5, 7)
    return {
        "contiguous": (x, torch.randn(6, 5, 7)),
        "transposed": (x.transpose(0, 2).contiguous().transpose(0, 2), torch.randn(6, 5, 7)),
        "broadcast": (x, torch.randn(5, 7)),
        "sliced": (torch.randn(6, 10, 7)[:, ::2], torch.randn(1, 5, 1)),
    }


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast", "sliced"])
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("n", [2, 3])
def test_every_dim_and_layout_exact(dim, layout, n):
    x, y = _layouts()[layout]
    key = STORE.register(lower(torch.parse_ir(_ir(dim, n))))
    out = executor.run(STORE.get(key), [x, y])
    assert out is not None, "fell back"
    c, p0 = _eager(x, y, dim, n)
    assert out[0].shape == c.shape and out[0].is_contiguous()
    assert torch.equal(out[0], c) and torch.equal(out[1], p0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_dtypes(dtype):
    x, y = (torch.randn(33, 17) * 4).to(dtype), (torch.randn(33, 17) * 4).to(dtype)
    key = STORE.register(lower(torch.parse_ir(_ir(1, 3))))
    out = executor.run(STORE.get(key), [x, y])
    assert out is not None
    c, _ = _eager(x, y, 1, 3)
    assert out[0].dtype == c.dtype
    assert_same(out[0], c)


def test_pieces_of_different_dtypes_promote_like_eager():
    """cat(half piece, float piece) is float; the half piece is rounded to half first, as eager stores it."""
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %d : int = prim::Constant[value=0]()
      %a : Tensor = aten::sigmoid(%x)
      %b : Tensor = aten::sigmoid(%y)
      %l : Tensor[] = prim::ListConstruct(%a, %b)
      %c : Tensor = aten::cat(%l, %d)
      return (%c)
    """)))
    x, y = torch.randn(40, 3).half(), torch.randn(40, 3)
    out = executor.run(STORE.get(key), [x, y])
    assert out is not None
    expected = torch.cat([torch.sigmoid(x), torch.sigmoid(y)], 0)
    assert out[0].dtype == torch.float32
    assert_same(out[0][:40], expected[:40], torch.float16)
    assert torch.equal(out[0][:40], out[0][:40].half().float())  # values a half can hold
    assert_same(out[0][40:], expected[40:])


def test_an_input_as_a_piece():
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %d : int = prim::Constant[value=1]()
      %a : Tensor = aten::tanh(%y)
      %l : Tensor[] = prim::ListConstruct(%x, %a, %x)
      %c : Tensor = aten::cat(%l, %d)
      return (%c)
    """)))
    x, y = torch.randn(9, 4), torch.randn(9, 4)
    out = executor.run(STORE.get(key), [x, y])
    assert out is not None
    assert_same(out[0], torch.cat([x, torch.tanh(y), x], 1))


def test_pieces_of_different_shapes_fall_back_to_eagers_cat():
    """x (2, 4) and y (1, 4): the pieces x and tanh(y) have different shapes; cat gives (3, 4), never a
    broadcast (4, 4)."""
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %d : int = prim::Constant[value=0]()
      %a : Tensor = aten::sigmoid(%x)
      %b : Tensor = aten::tanh(%y)
      %l : Tensor[] = prim::ListConstruct(%a, %b)
      %c : Tensor = aten::cat(%l, %d)
      return (%c)
    """)))
    x, y = torch.randn(2, 4), torch.randn(1, 4)
    assert executor.run(STORE.get(key), [x, y]) is None
    out = fuser.run_fusion(key, [x, y])[0]
    assert out.shape == (3, 4)
    assert_same(out, torch.cat([torch.sigmoid(x), torch.tanh(y)], 0))


def test_bad_dim_raises_eagers_error():
    """(through the interpreter, as a scripted function without fusion raises it)"""
    key = STORE.register(lower(torch.parse_ir(_ir(3))))
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    with pytest.raises((IndexError, RuntimeError), match="Dimension out of range"):
        fuser.run_fusion(key, [x, y])
    with pytest.raises(IndexError, match="Dimension out of range"):
        torch.cat([x + y, x * y], 3)


def test_zero_element_and_zero_dim():
    key = STORE.register(lower(torch.parse_ir(_ir(1))))
    x, y = torch.randn(3, 0), torch.randn(3, 0)
    assert fuser.run_fusion(key, [x, y])[0].shape == (3, 0)
    key0 = STORE.register(lower(torch.parse_ir(_ir(0))))
    with pytest.raises(RuntimeError):  # cat of 0-dim tensors
        fuser.run_fusion(key0, [torch.tensor(1.0), torch.tensor(2.0)])


def gates(a, b, c):
    return torch.cat([torch.sigmoid(a + b), torch.tanh(a * c)], 1) * 2.0


def cat_only(a, b):
    return torch.cat([a, b], 0)


def test_pass_puts_cat_in_the_group_but_not_its_consumer():
    g = fused_graph(gates)
    groups = [n for n in g.nodes() if n.kind() == "prim::FusionGroup"]
    assert len(groups) == 1
    sub = groups[0].g("Subgraph")
    assert any(n.kind() == "aten::cat" for n in sub.nodes())
    # the cat's result is not consumed inside its own group: the final mul stays outside (a later group)
    assert not any(n.kind() == "aten::mul" and n.inputsAt(0).node().kind() == "aten::cat" for n in sub.nodes())
    f = fuser.fuse(torch.jit.script(gates))
    a, b, c = torch.randn(16, 8), torch.randn(16, 8), torch.randn(16, 8)
    assert_same(f(a, b, c), gates(a, b, c))


def test_a_bare_cat_is_not_a_group():
    g = fused_graph(cat_only)
    assert not any(n.kind() == "prim::FusionGroup" for n in g.nodes())


def test_gradients_through_a_cat_group():
    key = STORE.register(lower(torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %d : int = prim::Constant[value=1]()
      %a : Tensor = aten::sigmoid(%x)
      %b : Tensor = aten::mul(%x, %y)
      %l : Tensor[] = prim::ListConstruct(%a, %b)
      %c : Tensor = aten::cat(%l, %d)
      return (%c, %a)
    """)))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, dtype=torch.float64, requires_grad=True)
    c, a = fuser.run_fusion(key, [x, y])
    assert c.grad_fn.name() in FUSED_BACKWARD
    assert torch.autograd.gradcheck(lambda x, y: fuser.run_fusion(key, [x, y]), (x, y))
    # only the cat's gradient, as a non-contiguous view
    g = torch.randn(6, 5, dtype=torch.float64).t()
    mine = torch.autograd.grad(fuser.run_fusion(key, [x, y])[0], (x, y), g)
    x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    theirs = torch.autograd.grad(torch.cat([torch.sigmoid(x2), x2 * y2], 1), (x2, y2), g)
    for m, t in zip(mine, theirs):
        assert_same(m, t)


@pytest.mark.parametrize("arch", (80, 90))
def test_cuda_source_compiles(arch):
    from fuser.cuda import driver
    spec = STORE.get(STORE.register(lower(torch.parse_ir(_ir(1, 3)))))
    for out_layout in (DENSE, ROWS, STRIDED):
        for in_layout in (DENSE, STRIDED):
            arg_spec = ArgSpec("cuda", 0, (TensorDesc(torch.float16, in_layout),) * 2, True,
                               (out_layout,) * 3 + (DENSE,))
            types = compiler.infer_types(spec, arg_spec, "cpu")  # dtypes only: probed on the CPU
            src = codegen.generate(spec.group, arg_spec.inputs, types, "cuda", "k",
                                   out_layouts=arg_spec.outputs)
            driver.compile_source(src, "k", driver.NvrtcOptions(arch))


def test_a_hand_written_graph_consuming_a_cat_runs_through_the_interpreter():
    """The pass never makes one; debug_launch_graph may get one: eager's values and gradients, no crash."""
    g = torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %d : int = prim::Constant[value=0]()
      %a : Tensor = aten::sigmoid(%x)
      %l : Tensor[] = prim::ListConstruct(%a, %y)
      %c : Tensor = aten::cat(%l, %d)
      %r : Tensor = aten::mul(%c, %c)
      return (%r)
    """)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = fuser.debug_launch_graph(g, [x, y])[0]
    ref = torch.cat([torch.sigmoid(x), y]) ** 2
    assert_same(out, ref)
    assert torch.autograd.gradcheck(lambda x, y: fuser.debug_launch_graph(g, [x, y])[0], (x, y))
