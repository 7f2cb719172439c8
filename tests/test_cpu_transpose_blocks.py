"""The CPU vector path's transposed blocks (fuser/cpu/templates.py TRANSPOSE_BLOCKS): an input that steps by 1
along the map's rows and far along its inner dim (a transposed tensor) is read in W x W blocks, each transposed in
registers into a local buffer, beside dense, row, repeated and scalar operands. Against eager on fresh random inputs:
rows and columns past whole blocks, blocks that would cross a run of the second-innermost dim, every dtype of the
vector path, every op of the table with two or more tensors, random ops' streams, and the cases that keep the
gathers."""
import pytest
import torch
from helpers import _SCALARS, build, cases, op_on_layouts_vs_eager, random_tensor

import fuser
from fuser import codegen, compiler, executor, settings
from fuser.cpu import compiler as cpu_compiler
from fuser.descs import DENSE, REPEAT, ROWS, SCALAR, STRIDED, ArgSpec, TensorDesc
from fuser.kernel_cache import KernelStore
from fuser.ts_ir import lower

needs_vectors = pytest.mark.skipif(cpu_compiler.toolchain() is None,
                                   reason="no at::vec toolchain here (not x86-64 with AVX2, or no g++)")

# x dense, b transposed (the blocks' input), c a column (repeated along each row), d rows of a wider tensor, s a
# 0-dim tensor; a float output and a bool one
CHAIN = """graph(%x : Tensor, %b : Tensor, %c : Tensor, %d : Tensor, %s : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::add(%x, %b, %one)
  %t : Tensor = aten::tanh(%a)
  %u : Tensor = aten::mul(%t, %c)
  %v : Tensor = aten::addcmul(%u, %d, %s, %one)
  %m : Tensor = aten::gt(%v, %b)
  return (%v, %m)
"""


def _source(ir: str, descs, out_layouts=(), **options) -> str:
    store = KernelStore()
    spec = store.get(store.register(lower(torch.parse_ir(ir))))
    types = compiler.infer_types(spec, ArgSpec("cpu", None, tuple(descs), True))
    return codegen.generate(spec.group, descs, types, "cpu", "k", codegen.KernelOptions(**options), out_layouts)


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)


def _chain_args(shape, dtype, gen):
    """The chain's inputs over ``shape`` (rank 2 or 3): b transposed in its last two dims."""
    *lead, rows, cols = shape
    x = random_tensor(shape, dtype, gen=gen, specials=False)
    b = random_tensor((*lead, cols, rows), dtype, gen=gen, specials=False).transpose(-1, -2)
    c = random_tensor((*lead, rows, 1), dtype, gen=gen, specials=False)
    d = random_tensor((*lead, rows, cols + 3), dtype, gen=gen, specials=False)[..., :cols]
    s = random_tensor((), dtype, gen=gen, specials=False)
    return [x, b, c, d, s]


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64), ids=str)
@pytest.mark.parametrize("shape", [(37, 45), (16, 16), (7, 300), (40, 9), (3, 40, 50), (2, 21, 33)],
                         ids=lambda s: "x".join(map(str, s)))
def test_transposed_blocks_match_eager(shape, dtype):
    """The chain on shapes with whole blocks, rows and columns past them, rows too few or too short for a block,
    and a rank-3 map whose second-innermost dim (40, 21) ends inside a tile: the blocks stop there and the rows
    after run one by one. Both outputs against eager (the comparison where the values are not a rounding apart)."""
    g = torch.parse_ir(CHAIN)
    gen = torch.Generator().manual_seed(sum(shape) * 7 + dtype.itemsize)
    args = _chain_args(shape, dtype, gen)
    v, m = fuser.debug_launch_graph(g, args)
    x, b, c, d, s = args
    ref = torch.addcmul(torch.tanh(x + b) * c, d, s)
    tol = _tol(dtype)
    torch.testing.assert_close(v, ref, rtol=tol, atol=tol)
    assert v.stride() == ref.stride()
    near = (v.double() - b.double()).abs() <= tol * (1 + b.double().abs())
    assert torch.equal(m[~near], (ref > b)[~near])


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_the_chain_takes_the_blocks(dtype):
    """The source transposes the strided input only where every gathered operand is an input of values; a
    gathered bool or a scattered output, or the option off, keeps the per-vector gathers."""
    descs = [TensorDesc(dtype, DENSE), TensorDesc(dtype, STRIDED), TensorDesc(dtype, REPEAT), TensorDesc(dtype, ROWS),
             TensorDesc(dtype, SCALAR)]
    src = _source(CHAIN, descs)
    assert "fz_transpose(t1 + base" in src and "fz_vload(fz_tb1 + (mb + 3) * W)" in src
    assert "fz_vgather(t1 + off1" in src  # (the rows past the blocks)
    assert "fz_transpose(" not in _source(CHAIN, descs, transpose_blocks=False)
    assert "fz_transpose(" not in _source(CHAIN, descs, (DENSE, STRIDED))
    where = """graph(%c : Tensor, %x : Tensor, %y : Tensor):
  %w : Tensor = aten::where(%c, %x, %y)
  return (%w)
"""
    gathered_mask = [TensorDesc(torch.bool, STRIDED), TensorDesc(dtype, DENSE), TensorDesc(dtype, STRIDED)]
    assert "fz_transpose(" not in _source(where, gathered_mask)
    assert "fz_transpose(t2 + base" in _source(where, [TensorDesc(torch.bool, DENSE)] + gathered_mask[1:])


@needs_vectors
def test_settings_turn_the_blocks_off(monkeypatch):
    """``settings.cpu_transpose_blocks`` off: the kernel built then keeps the gathers, with eager's values."""
    monkeypatch.setattr(settings, "cpu_transpose_blocks", False)
    g = torch.parse_ir(CHAIN)
    args = _chain_args((37, 45), torch.float32, torch.Generator().manual_seed(5))
    store = KernelStore()
    spec = store.get(store.register(lower(g)))
    v, _ = executor.run(spec, args)
    x, b, c, d, s = args
    torch.testing.assert_close(v, torch.addcmul(torch.tanh(x + b) * c, d, s))
    kernel = next(k for k in spec.kernels().values() if k is not None)
    assert "fz_vgather(" in kernel.source and "fz_transpose(" not in kernel.source


RAND_MUL = """graph(%x : Tensor, %b : Tensor):
  %none : NoneType = prim::Constant()
  %r : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
  %y : Tensor = aten::mul(%r, %b)
  return (%y, %r)
"""


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_random_values_in_blocks_follow_the_element_index(dtype):
    """A random op in a kernel with blocks draws each element's value by its index in the map: the same seed gives
    the same values with b transposed (blocks) as with b contiguous (the flat loop), and y = r * b."""
    g = torch.parse_ir(RAND_MUL)
    gen = torch.Generator().manual_seed(11)
    x = random_tensor((37, 45), dtype, gen=gen, specials=False)
    bt = random_tensor((45, 37), dtype, gen=gen, specials=False).t()
    torch.manual_seed(1234)
    y, r = fuser.debug_launch_graph(g, [x, bt])
    torch.manual_seed(1234)
    y2, r2 = fuser.debug_launch_graph(g, [x, bt.contiguous()])
    assert torch.equal(r, r2) and torch.equal(y, y2)
    torch.testing.assert_close(y, r * bt, rtol=_tol(dtype), atol=_tol(dtype))
    assert 0.3 < r.float().mean().item() < 0.7


# every op of the table with two or more tensors: a dense first operand, a transposed second (the blocks), a column
# third; rows and columns past whole blocks
_BLOCK_ROWS, _BLOCK_COLS = 37, 45


def _block_args(b, dtype, gen):
    shapes = [("dense", (_BLOCK_ROWS, _BLOCK_COLS)), ("t", (_BLOCK_COLS, _BLOCK_ROWS)), ("col", (_BLOCK_ROWS, 1))]
    tensors = {}
    for n, (kind, shape) in zip(b.tensor_args, shapes):
        if n == "condition":
            tensors[n] = random_tensor((_BLOCK_ROWS, _BLOCK_COLS), torch.bool, gen=gen)
            continue
        t = random_tensor(shape, dtype, gen=gen)
        tensors[n] = t.t() if kind == "t" else t
    floats = {n: _SCALARS.get(n, 0.75) * 1.0 for n in b.float_args}
    return [tensors[n] for n in b.tensor_args] + [floats[n] for n in b.float_args], tensors, floats


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", [c for c in cases() if not c.none_args and len(build(c).tensor_args) >= 2
                                  and "condition" not in build(c).tensor_args[1:2]], ids=lambda c: c.id)
def test_every_op_with_a_transposed_operand_in_blocks_vs_eager(case, dtype):
    """Each op whose second tensor is transposed (read in blocks), its first dense and a third a column: against
    eager, and the kernel took the blocks."""
    source = op_on_layouts_vs_eager(case, _block_args, dtype)
    if source is not None and cpu_compiler.is_vector_source(source):  # (the output follows the dense first)
        assert "fz_transpose(" in source, f"{case.id}: no blocks"
