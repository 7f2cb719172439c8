"""CUDA pointwise kernels' shape, without a GPU: the register bound of kernels over 2-byte tensors (ptxas for sm_90
through NVRTC), the vector path's offsets over a map of two dims and over more (the host emulation, against eager),
the fast tanh's instructions against float64 (emulated)."""
from __future__ import annotations

import pytest
import torch

from fuser.cuda import emulate
from helpers import ptx_instructions, ptxas_registers

GELU_BIAS = """
def gelu_bias(x: Tensor, b: Tensor) -> Tensor:
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))
"""


def _graph(source: str, name: str) -> torch.Graph:
    g = getattr(torch.jit.CompilationUnit(source), name).graph.copy()
    torch._C._jit_pass_inline(g)
    return g


def _gelu_bias(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
def test_kernels_of_2_byte_tensors_are_bound_to_a_full_sm(dtype):
    """codegen.common.POINTWISE_THREADS: a kernel whose vector path holds 8 elements a thread asks ptxas for 8
    blocks of 256 threads an SM (32 registers; unbounded, NVRTC 13.0 gave the float16 GELU 39 and 6 blocks), with
    no spills; float32 kernels (4 elements) keep no bound."""
    g = _graph(GELU_BIAS, "gelu_bias")
    k = emulate.kernel_for(g, [torch.randn(64, 256, dtype=dtype), torch.randn(256, dtype=dtype)])
    bounded = "__launch_bounds__(256, 8)" in k.source
    assert bounded == (dtype != torch.float32)
    regs, spill = ptxas_registers(k.source)
    assert spill == 0 and (regs <= 32 or not bounded), (regs, spill)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_the_vector_path_rounds_2_byte_outputs_in_pairs_and_reads_bfloat16_words(dtype):
    """The vector path of GELU over 2-byte tensors in PTX (sm_90, NVRTC): its 8 results rounded two at a time into
    32-bit words (``cvt.rn.{f16,bf16}x2.f32``, cuda.templates' fz_pack2: 4 of them, and one single rounding for the
    element loop), and bfloat16 inputs widened from their 32-bit words (a shift or a mask each: no 16-bit moves out
    of a word in the vector path); through the host emulation, eager's GELU in float64 at the dtype's tolerance."""
    g = _graph(GELU_BIAS, "gelu_bias")
    gen = torch.Generator().manual_seed(11)
    x, b = torch.randn(48, 256, generator=gen).to(dtype), torch.randn(256, generator=gen).to(dtype)
    k = emulate.kernel_for(g, [x, b])
    ptx = ptx_instructions(k.source)
    suffix = "bf16" if dtype == torch.bfloat16 else "f16"
    assert sum(ln.startswith(f"cvt.rn.{suffix}x2.f32") for ln in ptx) == 4, ptx
    assert sum(ln.startswith(f"cvt.rn.{suffix}.f32") for ln in ptx) == 1, ptx
    if dtype == torch.bfloat16:
        assert not [ln for ln in ptx if ln.startswith("mov.b32") and "{" in ln], ptx
    out, = emulate.run_graph(g, [x, b], vectorize=True)
    torch.testing.assert_close(out.double(), _gelu_bias(x.double(), b.double()), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("shapes", [((48, 256), (256,)), ((6, 4, 64), (6, 1, 64)), ((3, 5, 7, 16), (5, 1, 16))],
                         ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("dtype", (torch.float16, torch.float32), ids=str)
def test_vector_offsets_over_two_dims_and_more(shapes, dtype):
    """The vector path reads a broadcast operand at an offset computed by ``cuda.templates.OFFSETS_2D`` where the
    compressed map has two dims, and by the walk over every dim otherwise: both give eager's GELU (a bias along
    the rows; one broadcast along a middle dim, which no compression removes)."""
    g = _graph(GELU_BIAS, "gelu_bias")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shapes[0], generator=gen).to(dtype)
    b = torch.randn(shapes[1], generator=gen).to(dtype)
    k = emulate.kernel_for(g, [x, b])
    assert "if (args.rank == 2)" in k.source
    assert ("__launch_bounds__(256, 8)" in k.source) == (dtype == torch.float16)
    expected = _gelu_bias(x, b)
    truth = _gelu_bias(x.double(), b.double())
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-6, rtol=1e-5)
    for index32 in (True, False):  # fz_div by magic numbers, and 64-bit division
        out, = emulate.run_graph(g, [x, b], index32=index32, vectorize=True)
        torch.testing.assert_close(out, expected, **tol)
        err, eager_err = (out.double() - truth).abs().max(), (expected.double() - truth).abs().max()
        assert err <= 2 * eager_err + 1e-6, (err, eager_err)


def test_kernels_without_a_vector_path_keep_no_bound():
    """A bool output (16 elements a vector) beside a transposed float32 input: no vector path (a generically
    strided input), and the tiled path's vector form over 4-byte elements, so no register bound (with one ptxas
    spilled such a kernel's body at 32 and at 40 registers)."""
    g = torch._C.parse_ir("""
graph(%m : Tensor, %x : Tensor):
  %one : int = prim::Constant[value=1]()
  %c : float = prim::Constant[value=0.5]()
  %e : Tensor = aten::erf(%x)
  %t : Tensor = aten::tanh(%x)
  %y : Tensor = aten::mul(%e, %t)
  %w : Tensor = aten::where(%m, %y, %c)
  %r : Tensor = aten::gt(%w, %c)
  return (%r)""")
    m, x = torch.randn(64, 256) > 0, torch.randn(256, 64).t()
    k = emulate.kernel_for(g, [m, x])
    assert "__launch_bounds__(256)" in k.source
    out, = emulate.run_graph(g, [m, x])
    assert torch.equal(out, torch.where(m, torch.erf(x) * torch.tanh(x), 0.5) > 0.5)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_fast_tanh_against_float64(dtype):
    """``fz_tanh_fast`` (float16/bfloat16 results): every value of the dtype between -12 and 12, tiny ones
    included, within an ulp of the dtype of the float64 truth and no further from it than eager's tanh plus an
    ulp; and 1 + tanh(x), where it cancels, likewise against eager's."""
    g = torch._C.parse_ir("""
graph(%x : Tensor):
  %one : int = prim::Constant[value=1]()
  %t : Tensor = aten::tanh(%x)
  %u : Tensor = aten::add(%t, %one, %one)
  return (%t, %u)""")
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits) & (bits.abs() <= 12)]
    t, one_plus = emulate.run_graph(g, [x])
    ref_t, ref_one_plus = torch.tanh(x), 1 + torch.tanh(x)
    truth = torch.tanh(x.double())
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    scale = truth.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((t.double() - truth).abs() / scale).max() <= ulp
    assert ((t.double() - truth).abs() <= (ref_t.double() - truth).abs() + ulp * scale).all()
    truth1 = 1 + truth
    err1 = (one_plus.double() - truth1).abs()
    assert (err1 <= (ref_one_plus.double() - truth1).abs() + ulp * truth1.abs()).all()


_OFFSET_IR = """
graph(%x : Tensor):
  %one : int = prim::Constant[value=1]()
  %c : float = prim::Constant[value={c}]()
  %t : Tensor = aten::tanh(%x)
  %u : Tensor = aten::{op}(%t, %c, %one)
  return (%u)"""


@pytest.mark.parametrize("op, c", [("add", 1.0), ("sub", -0.5), ("rsub", 1.0), ("add", -2.0)])
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_tanh_read_only_by_an_offset_takes_the_absolute_form(op, c, dtype):
    """A tanh whose result only meets the addition of a constant of magnitude 1/2 or more (GELU's 1 + tanh(u))
    takes ``fz_tanh_offset`` (``ops.OpDef.fast_offset``, no small-|x| form): over every value of the dtype between
    -12 and 12, the sum is within an ulp of the float64 truth beyond eager's own error."""
    g = torch._C.parse_ir(_OFFSET_IR.replace("{c}", repr(c)).replace("{op}", op))
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits) & (bits.abs() <= 12)]
    k = emulate.kernel_for(g, [x])
    assert "fz_tanh_offset(" in k.source.split("extern \"C\"")[1]
    out, = emulate.run_graph(g, [x])
    eager = {"add": lambda t: t + c, "sub": lambda t: t - c, "rsub": lambda t: c - t}[op]
    ref, truth = eager(torch.tanh(x)), eager(torch.tanh(x.double()))
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    err = (out.double() - truth).abs()
    assert (err <= (ref.double() - truth).abs() + ulp * truth.abs()).all()


_SQUARE_IR = """
graph(%x : Tensor):
  %one : int = prim::Constant[value=1]()
  %t : Tensor = aten::tanh(%x)
  %s : Tensor = aten::mul(%t, %t)
  %u : Tensor = aten::rsub(%s, %one, %one)
  %w : Tensor = aten::type_as(%u, %t)
  return (%w)"""


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_tanh_read_by_its_derivative_takes_the_absolute_form(dtype):
    """tanh's derivative as the backward writes it, 1 - t * t, with a type_as that takes only its dtype from t:
    t * t meets only the offset, so t takes ``fz_tanh_offset``
    (codegen.body.offset_uses_only); over every value of the dtype between -12 and 12 the result is within an ulp
    of the float64 truth beyond eager's own error."""
    g = torch._C.parse_ir(_SQUARE_IR)
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits) & (bits.abs() <= 12)]
    k = emulate.kernel_for(g, [x])
    body = k.source.split("extern \"C\"")[1]
    assert "fz_tanh_offset(" in body and "fz_tanh_fast(" not in body
    out, = emulate.run_graph(g, [x])
    t = torch.tanh(x)
    ref, truth = 1 - t * t, 1 - torch.tanh(x.double()) ** 2
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    err = (out.double() - truth).abs()
    assert (err <= (ref.double() - truth).abs() + ulp * truth.abs()).all()


@pytest.mark.parametrize("ir", [
    _SQUARE_IR.replace("%u : Tensor = aten::rsub(%s, %one, %one)", "%u : Tensor = aten::mul(%s, %x)"),  # a product
    _SQUARE_IR.replace("return (%w)", "return (%w, %s)"),  # the square is an output
    """
graph(%x : Tensor, %m : Tensor):
  %one : int = prim::Constant[value=1]()
  %t : Tensor = aten::tanh(%x)
  %b : Tensor = aten::type_as(%t, %m)
  %u : Tensor = aten::add(%b, %one, %one)
  return (%u)""",  # passed on by type_as, whose dtype (bool here: t != 0) is not known to the rule
    _OFFSET_IR.replace("{c}", "0.25").replace("{op}", "add"),  # a sum that tanh's absolute error would dominate
    _OFFSET_IR.replace("{c}", "1.0").replace("{op}", "add").replace("return (%u)", "return (%u, %t)"),  # an output
    """
graph(%x : Tensor):
  %one : int = prim::Constant[value=1]()
  %t : Tensor = aten::tanh(%x)
  %u : Tensor = aten::add(%t, %one, %one)
  %v : Tensor = aten::mul(%t, %u)
  return (%v)""",  # also read by a product
])
def test_tanh_read_otherwise_keeps_its_relative_form(ir):
    """Any other reader (a small constant, the group's output, a product, a type_as passing it on) keeps
    ``fz_tanh_fast``, whose error is relative near 0."""
    g = torch._C.parse_ir(ir)
    x = torch.randn(64, dtype=torch.float16)
    k = emulate.kernel_for(g, [x, torch.zeros(64, dtype=torch.bool)] if "%m" in ir else [x])
    body = k.source.split("extern \"C\"")[1]
    assert "fz_tanh_fast(" in body and "fz_tanh_offset(" not in body


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_tanh_of_tiny_values_converted_to_bool_is_true_as_in_eager(dtype):
    """1 + tanh(x).type_as(mask) for a bool mask: tanh of a tiny nonzero x is nonzero, so true, so 2, as eager
    gives; the absolute form would give 0 there (a review found 1 for bfloat16 1e-30 when type_as was followed)."""
    g = torch._C.parse_ir("""
graph(%x : Tensor, %m : Tensor):
  %one : int = prim::Constant[value=1]()
  %t : Tensor = aten::tanh(%x)
  %b : Tensor = aten::type_as(%t, %m)
  %u : Tensor = aten::add(%b, %one, %one)
  return (%u)""")
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([1e-30, 1e-20, 1e-9, 6e-8, tiny, -tiny, 0.0, -0.0, 0.5, -3.0] * 8).to(dtype)
    m = torch.zeros(x.shape, dtype=torch.bool)
    out, = emulate.run_graph(g, [x, m])
    torch.testing.assert_close(out, torch.tanh(x).type_as(m) + 1, rtol=0, atol=0)
