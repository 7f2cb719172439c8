"""Output layouts as eager gives them (issue 10): the strides of every fused output equal eager's, and its values.

Eager's rule (TensorIterator's, and empty_like's for the ops that allocate that way) is modeled in
``fuser/layout.py``; here it is checked against eager itself, op by op over many input layouts, then whole
groups through the executor on the CPU, through the CUDA kernels in the host emulation, and through the
TorchScript door. References are eager's ops run directly (values and strides).
"""
import math
from dataclasses import replace

import pytest
import torch
from helpers import assert_same, build, cases, eager, interpret, on_cuda_aligned_alike, random_tensor

import fuser
from fuser import compiler, executor, ir, layout, settings
from fuser.codegen import common
from fuser.cuda import emulate
from fuser.descs import DENSE
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower


def _t(shape, dtype=torch.float32):
    return random_tensor(tuple(shape), dtype)


def _permuted(shape, order, dtype=torch.float32):
    """A tensor of ``shape`` whose memory runs in dim order ``order`` (outermost first)."""
    base = _t([shape[d] for d in order], dtype)
    return base.permute([order.index(d) for d in range(len(shape))])


def _layouts_of(shape):
    """Inputs of ``shape`` in many layouts (name -> maker of a tensor of a dtype)."""
    nd = len(shape)
    out = {
        "contiguous": lambda dt: _t(shape, dt),
        "reversed": lambda dt: _permuted(shape, list(range(nd))[::-1], dt),
        "zero_dim": lambda dt: _t((), dt),
    }
    if nd:
        out["step"] = lambda dt: _t((shape[0] * 2,) + tuple(shape[1:]), dt)[::2]
        out["expanded"] = lambda dt: _t((1,) + tuple(shape[1:]), dt).expand(shape)
        out["row"] = lambda dt: _t(shape[-1:], dt)
        out["column"] = lambda dt: _t(tuple(shape[:-1]) + (1,), dt)
        # a contiguous tensor whose size-1 dims have odd strides (eager copies or canonicalizes them per op)
        out["odd_size1"] = lambda dt: _t(shape, dt).as_strided(shape, [1] * nd)
    if nd == 4:
        out["channels_last"] = lambda dt: _t(shape, dt).contiguous(memory_format=torch.channels_last)
        out["nhwc_other"] = lambda dt: _permuted(shape, [0, 3, 2, 1], dt)
    return out


SHAPES = [(5, 7), (2, 3, 4, 5), (1, 6), (6, 1), (2, 3, 1, 1), (1, 3, 4, 4), (3, 1, 4), (), (0, 3)]


def _eager_layout(t: torch.Tensor):
    return tuple(t.shape), tuple(t.stride())


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_the_layout_model_is_eagers_for_every_op(case):
    b = build(case)
    group = lower(b.graph)
    n_checked = 0
    for shape in SHAPES:
        makers = _layouts_of(shape)
        for first in makers:
            for other in makers if len(b.tensor_args) > 1 else ["contiguous"]:
                tensors = {}
                for j, name in enumerate(b.tensor_args):
                    dt = torch.bool if name == "condition" else torch.float32
                    tensors[name] = makers[first if j == 0 else other](dt)
                floats = {n: 0.75 for n in b.float_args}
                args = [tensors[n] for n in b.tensor_args] + [floats[n] for n in b.float_args]
                try:
                    ref = eager(b, tensors, floats)
                except RuntimeError:
                    continue  # shapes that do not broadcast
                got = layout.group_layouts(group, args)
                assert got == [_eager_layout(ref)], (shape, first, other, [t.stride() for t in tensors.values()])
                n_checked += 1
    assert n_checked >= 60


@pytest.mark.parametrize("dim", [0, 1, 3, -1])
def test_the_layout_model_is_eagers_for_cat(dim):
    b = ir.Builder()
    x, y = b.input(), b.input()
    group = b.build([b.add("aten::cat", (b.call("aten::sigmoid", x), b.call("aten::neg", y)), dim)])
    for shape in [(2, 3, 4, 5), (2, 3, 1, 1), (1, 3, 4, 4), (2, 3, 4, 5, 6)]:
        makers = _layouts_of(shape)
        makers["channels_last_3d"] = lambda dt: _t(shape, dt).contiguous(memory_format=torch.channels_last_3d)
        for first in makers:
            for other in makers:
                try:
                    xs, ys = makers[first](torch.float32), makers[other](torch.float32)
                    ref = torch.cat([torch.sigmoid(xs), torch.neg(ys)], dim)
                except (RuntimeError, IndexError):
                    continue  # eager rejects these pieces (different shapes, 0-dim)
                assert layout.group_layouts(group, [xs, ys]) == [_eager_layout(ref)], (shape, first, other)


# --------------------------------------------------------------------------------------------------------
# groups: values and strides through the executor (CPU), the CUDA kernels (host emulation), TorchScript

AFFINE_RELU = """graph(%x : Tensor, %s : Tensor, %t : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %s)
  %b : Tensor = aten::add(%a, %t, %one)
  %r : Tensor = aten::relu(%b)
  return (%r)"""

GELU_ROW = """graph(%x : Tensor, %w : Tensor):
  %one : int = prim::Constant[value=1]()
  %tanh : str = prim::Constant[value="tanh"]()
  %a : Tensor = aten::add(%x, %w, %one)
  %r : Tensor = aten::gelu(%a, %tanh)
  return (%r)"""

# two outputs whose layouts differ when x's and y's do: sigmoid(x) follows x, y * 2 + x follows y's and x's
TWO_OUTPUTS = """graph(%x : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %two : float = prim::Constant[value=2.]()
  %a : Tensor = aten::sigmoid(%x)
  %b : Tensor = aten::mul(%y, %two)
  %c : Tensor = aten::add(%b, %x, %one)
  return (%a, %c)"""

SCALAR_CHAIN = """graph(%x : Tensor):
  %one : int = prim::Constant[value=1]()
  %h : float = prim::Constant[value=0.5]()
  %a : Tensor = aten::mul(%x, %h)
  %b : Tensor = aten::add(%a, %h, %one)
  %r : Tensor = aten::tanh(%b)
  return (%r)"""

CAT_SIGMOID = """graph(%x : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::sigmoid(%x)
  %b : Tensor = aten::mul(%x, %y)
  %l : Tensor[] = prim::ListConstruct(%a, %b)
  %r : Tensor = aten::cat(%l, %one)
  return (%r)"""

# type_as of x returns x itself when the dtypes agree, else a copy with empty_like's strides: which one decides
# the product's layout when x is not dense
TYPE_AS_MUL = """graph(%x : Tensor, %y : Tensor):
  %a : Tensor = aten::sigmoid(%y)
  %b : Tensor = aten::type_as(%x, %a)
  %r : Tensor = aten::mul(%b, %y)
  return (%r)"""

CL = torch.channels_last


def _cl(*shape, dtype=torch.float32):
    return _t(shape, dtype).contiguous(memory_format=CL)


# name -> (graph, inputs maker, whether the executor fuses it)
GROUP_CASES = {
    "channels_last_affine": (AFFINE_RELU, lambda: [_cl(4, 16, 5, 6), _t((16, 1, 1)), _t((16, 1, 1))], True),
    "channels_last_affine_fp16_in_fp32_params": (
        AFFINE_RELU, lambda: [_cl(2, 16, 5, 6, dtype=torch.float16), _t((16, 1, 1)), _t((16, 1, 1))], True),
    "channels_last_3d": (AFFINE_RELU, lambda: [_t((2, 8, 3, 4, 5)).contiguous(memory_format=torch.channels_last_3d),
                                                _t((8, 1, 1, 1)), _t(())], True),
    "per_channel_first": (AFFINE_RELU, lambda: [_t((16, 1, 1)), _cl(4, 16, 5, 6), _t((4, 16, 5, 6))], True),
    "transposed_plus_row": (GELU_ROW, lambda: [_t((96, 67)).t(), _t((96,))], True),
    "transposed_fp16_plus_fp32_row": (GELU_ROW, lambda: [_t((96, 67), torch.float16).t(), _t((96,))], True),
    "row_plus_transposed": (GELU_ROW, lambda: [_t((96,)), _t((96, 67)).t()], True),
    "column_times_row": (AFFINE_RELU, lambda: [_t((67, 1)), _t((1, 96)), _t((96,))], True),
    "column_times_transposed": (AFFINE_RELU, lambda: [_t((96, 1)), _t((96, 67)).t().t(), _t((67, 96)).t()], True),
    "two_permutations": (AFFINE_RELU, lambda: [_permuted((3, 4, 5, 6), [2, 0, 3, 1]),
                                               _permuted((3, 4, 5, 6), [1, 3, 0, 2]), _t(())], True),
    "different_layouts_per_output": (TWO_OUTPUTS, lambda: [_t((40, 24)).t(), _t((24, 40))], True),
    "same_permutation_outputs": (TWO_OUTPUTS, lambda: [_permuted((6, 5, 8), [2, 0, 1]),
                                                       _permuted((6, 5, 8), [2, 0, 1])], True),
    "step_slices": (TWO_OUTPUTS, lambda: [_t((20, 30))[::2, ::3], _t((10, 10)).t()], True),
    "expanded": (TWO_OUTPUTS, lambda: [_t((37, 1)).expand(37, 45), _t((45, 37)).t()], True),
    "zero_dim": (TWO_OUTPUTS, lambda: [_t(()), _t(())], True),
    # sigmoid(x) is 0-dim, the other output is not: outputs of different shapes fall back (as before)
    "zero_dim_and_tensor": (TWO_OUTPUTS, lambda: [_t(()), _t((7, 9)).t()], False),
    "odd_size1_strides": (SCALAR_CHAIN, lambda: [_t((1, 37)).as_strided((1, 37), (1, 1))], True),
    "permuted_size1": (SCALAR_CHAIN, lambda: [_t((37, 1, 40)).permute(1, 0, 2)], True),
    "channels_last_hw1": (SCALAR_CHAIN, lambda: [_cl(6, 37, 1, 1)], True),
    "empty": (TWO_OUTPUTS, lambda: [_t((0, 5)).t(), _t((5, 0))], True),
    "type_as_itself": (TYPE_AS_MUL, lambda: [_t((37, 1)).expand(37, 45), _t((45, 37)).t()], True),
    "type_as_a_copy": (TYPE_AS_MUL, lambda: [_t((37, 1)).expand(37, 45), _t((45, 37), torch.float64).t()], True),
    "type_as_stepped": (TYPE_AS_MUL, lambda: [_t((37, 90))[:, ::2], _t((45, 37), torch.float64).t()], True),
    "cat_contiguous": (CAT_SIGMOID, lambda: [_t((9, 31)), _t((9, 31))], True),
    "cat_transposed_pieces": (CAT_SIGMOID, lambda: [_t((31, 9)).t(), _t((9, 31))], True),
    "cat_channels_last_pieces": (CAT_SIGMOID, lambda: [_cl(2, 6, 3, 5), _cl(2, 6, 3, 5)], True),
    "cat_channels_last_and_contiguous": (CAT_SIGMOID, lambda: [_cl(2, 6, 3, 5), _t((2, 6, 3, 5))], True),
}


def _reference(graph_text, args):
    return interpret(torch.parse_ir(graph_text), args)


def _assert_like_eager(outs, refs):
    assert outs is not None
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.stride() == r.stride(), (o.shape, o.stride(), r.stride())
        assert_same(o, r)


@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_executor_outputs_have_eagers_strides_and_values(name):
    text, make, fused = GROUP_CASES[name]
    args = make()
    spec = STORE.get(STORE.register(lower(torch.parse_ir(text))))
    out = executor.run(spec, args)
    if not fused:
        assert out is None and isinstance(executor.plan(spec, args), str)
        return
    _assert_like_eager(out, _reference(text, args))


def test_a_channels_last_group_is_one_dense_run():
    """Compressing dims in the output's memory order: every channels_last tensor of the group is dense over a
    1-D map, and the per-channel vectors are repeated along the inner dim, the vector path's REPEAT class."""
    x, s, t = GROUP_CASES["channels_last_affine"][1]()
    y = _cl(4, 16, 5, 6)
    spec = STORE.get(STORE.register(lower(torch.parse_ir(AFFINE_RELU))))
    p = executor.plan(spec, [x, y, y])
    assert p.sizes == [x.numel()] and [d.layout for d in p.arg_spec.inputs] == [DENSE] * 3
    assert p.arg_spec.outputs == ()
    p = executor.plan(spec, [x, s, t])
    assert p.sizes == [4 * 5 * 6, 16] and p.arg_spec.inputs[0].layout == DENSE and p.arg_spec.outputs == ()


def test_random_groups_keep_the_logical_order_and_write_eagers_strides():
    """rand_like's numbers go by logical element (the backward replays them): the map is not reordered,
    the output is written strided with eager's strides."""
    text = """graph(%x : Tensor):
      %none : NoneType = prim::Constant()
      %r : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
      %m : Tensor = aten::mul(%r, %x)
      return (%m)"""
    x = random_tensor((2, 8, 3, 5), torch.float32, specials=False).contiguous(memory_format=CL)
    spec = STORE.get(STORE.register(lower(torch.parse_ir(text))))
    p = executor.plan(spec, [x])
    assert p.arg_spec.outputs != ()  # strided
    out = executor.run(spec, [x])[0]
    ref = _reference(text, [x])[0]
    assert out.stride() == ref.stride()
    u = out / x  # the uniform numbers, in [0, 1)
    assert bool(((u >= 0) & (u < 1)).all())


# --------------------------------------------------------------------------------------------------------
# the CUDA kernels in the host emulation: the same cases, every kernel registered before the first run

@pytest.fixture(scope="module")
def emulated():
    em = emulate.Emulator()
    inputs = {}
    for name, (text, make, fused) in GROUP_CASES.items():
        inputs[name] = make()
        emulate.kernel_for(torch.parse_ir(text), inputs[name], emulator=em)
    yield em, inputs
    em.close()


@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_emulated_cuda_outputs_have_eagers_strides_and_values(emulated, name):
    em, inputs = emulated
    text, _, fused = GROUP_CASES[name]
    args = inputs[name]
    out = emulate.run_graph(torch.parse_ir(text), args, emulator=em)
    if not fused:
        assert out is None
        return
    _assert_like_eager(out, _reference(text, args))


def test_emulated_channels_last_takes_the_vector_path(emulated):
    em, inputs = emulated
    args = inputs["channels_last_affine"]
    kernel = emulate.kernel_for(torch.parse_ir(AFFINE_RELU), args, emulator=em)
    assert kernel.vec > 1 and "fz_vec<float" in kernel.source
    out = emulate.run_graph(torch.parse_ir(AFFINE_RELU), args, emulator=em)
    assert kernel.backend.last_vec
    _assert_like_eager(out, _reference(AFFINE_RELU, args))


def test_emulated_outer_product_broadcast_takes_the_vector_path(emulated):
    """A column vector (read once per vector) and a row vector (16-byte loads) beside a full tensor."""
    em, _ = emulated
    x = _t((67, 96))
    for args in ([x, _t((67, 1)), _t((96,))], [_t((67, 1)), _t((1, 96)), _t((96,))]):
        kernel = emulate.kernel_for(torch.parse_ir(AFFINE_RELU), args, emulator=em)
        out = emulate.run_graph(torch.parse_ir(AFFINE_RELU), args, emulator=em)
        assert kernel.vec > 1 and kernel.backend.last_vec
        _assert_like_eager(out, _reference(AFFINE_RELU, args))


def test_emulated_mixed_dtypes_take_vectors_of_16_bytes_of_the_widest(emulated):
    """A float16 tensor plus a float32 row bias giving float32: 4 elements per thread, so the float32 bias and
    output move one 16-byte vector a lane and the float16 input 8 bytes (each warp access contiguous); the float16
    pointer needs 8-byte alignment only, so an input starting 8 bytes into its storage keeps the vector path."""
    em, _ = emulated
    x = _t((67 * 96 + 4,), torch.float16)[4:].view(67, 96)  # 8 bytes past an aligned start
    assert x.data_ptr() % 16 == 8
    bias = _t((96 + 4,))[4:]  # 16 bytes past a 512-byte aligned start
    assert bias.data_ptr() % 32 == 16
    graph = torch.parse_ir(GELU_ROW)
    kernel = emulate.kernel_for(graph, [x, bias], emulator=em)
    assert kernel.vec == 4
    assert "fz_vec<fz_half, 4>" in kernel.source and "fz_vec<float, 4>" in kernel.source
    out = emulate.run_graph(graph, [x, bias], emulator=em)
    assert kernel.backend.last_vec
    _assert_like_eager(out, _reference(GELU_ROW, [x, bias]))


# --------------------------------------------------------------------------------------------------------
# the TorchScript door


def _affine_relu(x, s, t):
    return torch.relu(x * s + t)


def _gelu_row(x, w):
    return torch.nn.functional.gelu(x + w, approximate="tanh")


@pytest.mark.parametrize("name", ["channels_last_affine", "two_permutations", "column_times_row",
                                  "per_channel_first"])
def test_scripted_affine_relu_has_eagers_strides(name):
    fuser.install()
    fn = torch.jit.script(_affine_relu)
    args = GROUP_CASES[name][1]()
    g = fuser.graph_for(fn, *args)
    assert sum(1 for n in g.nodes() if n.kind() == "prim::FusionGroup") == 1
    spec = STORE.get(STORE.register(lower(torch.parse_ir(AFFINE_RELU))))
    assert not isinstance(executor.plan(spec, args), str)  # the group runs as a kernel for these inputs
    _assert_like_eager([fn(*args)], [_affine_relu(*args)])


@pytest.mark.parametrize("name", ["transposed_plus_row", "row_plus_transposed"])
def test_scripted_gelu_on_a_transposed_input_has_eagers_strides(name):
    fuser.install()
    fn = torch.jit.script(_gelu_row)
    args = GROUP_CASES[name][1]()
    fn(*args)
    _assert_like_eager([fn(*args)], [_gelu_row(*args)])


# --------------------------------------------------------------------------------------------------------
# the CUDA tiled path: tensors that disagree on their fastest dim meet in shared-memory tiles

ADD_SIGMOID = """graph(%x : Tensor, %y : Tensor, %z : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::add(%x, %y, %one)
  %b : Tensor = aten::mul(%a, %z)
  %r : Tensor = aten::sigmoid(%b)
  return (%r, %a)"""

# name -> (inputs maker, the tiled dim expected, or -1 where no tiles are chosen)
TILED_CASES = {
    # x contiguous (the output follows it), y a transposed view: y is read through the tiles
    "2d_transposed": (lambda dt: [_t((45, 70), dt), _t((70, 45), dt).t(), _t((70,), dt)], 0),
    # rows wider than a tile (64 elements along the innermost dim): a whole tile and a partial one per row of tiles
    "2d_wide": (lambda dt: [_t((40, 100), dt), _t((100, 40), dt).t(), _t((100,), dt)], 0),
    # more rows than a tile takes along the transposed input's fastest dim (32, or 64 for 2-byte elements)
    "2d_tall": (lambda dt: [_t((100, 40), dt), _t((40, 100), dt).t(), _t((40,), dt)], 0),
    # many tiles both ways, partial ones at both ends (7 x 6 tiles: the kernel divides tile numbers by these counts)
    "2d_many_tiles": (lambda dt: [_t((163, 391), dt), _t((391, 163), dt).t(), _t((391,), dt)], 0),
    # both the second and third inputs transposed, sizes multiples of the tile
    "2d_two_transposed": (lambda dt: [_t((64, 96), dt), _t((96, 64), dt).t(), _t((96, 64), dt).t()], 0),
    # a batch of transposes, a row vector beside them
    "3d_batched": (lambda dt: [_t((3, 40, 33), dt), _t((3, 33, 40), dt).transpose(1, 2), _t((33,), dt)], 1),
    # the strided input's fastest dim is the outermost of three
    "3d_outer": (lambda dt: [_t((20, 5, 36), dt), _permuted((20, 5, 36), [2, 1, 0], dt), _t(())], 0),
    # a step slice of a transposed tensor: its smallest stride is 2
    "stepped_transpose": (lambda dt: [_t((33, 50), dt), _t((100, 33), dt)[::2].t(), _t((1, 50), dt)], 0),
    # a column vector (read once per element where it is) beside the tiles
    "2d_with_column": (lambda dt: [_t((45, 70), dt), _t((70, 45), dt).t(), _t((45, 1), dt)], 0),
    # a dim below TILE_MIN: the plain strided loop
    "narrow_inner": (lambda dt: [_t((200, 7), dt), _t((7, 200), dt).t(), _t((7,), dt)], -1),
}
TILED_PARAMS = [(n, dt, i32) for n in TILED_CASES for dt in (torch.float32, torch.float16, torch.float64, torch.int32)
                for i32 in (True, False)]


def _emulated_inputs(params, case):
    """An emulator with the kernels of every (name, dtype, index32) of ``params`` registered (they compile in one
    batch), and the inputs per (name, dtype); ``case(name)``: (graph text, inputs maker)."""
    em = emulate.Emulator()
    inputs = {}
    for name, dt, i32 in params:
        text, make = case(name)
        if (name, dt) not in inputs:
            inputs[name, dt] = make(dt)
        emulate.kernel_for(torch.parse_ir(text), inputs[name, dt], i32, em)
    return em, inputs


def _ids(params):
    return [f"{n}-{str(dt)[6:]}-{'i32' if i else 'i64'}" for n, dt, i in params]


@pytest.fixture(scope="module")
def tiled_inputs():
    em, inputs = _emulated_inputs(TILED_PARAMS, lambda name: (ADD_SIGMOID, TILED_CASES[name][0]))
    yield em, inputs
    em.close()


@pytest.mark.parametrize("name,dtype,index32", TILED_PARAMS, ids=_ids(TILED_PARAMS))
def test_emulated_tiled_path(tiled_inputs, name, dtype, index32):
    em, inputs = tiled_inputs
    args = inputs[name, dtype]
    graph = torch.parse_ir(ADD_SIGMOID)
    spec = STORE.get(STORE.register(lower(graph)))
    p = executor.plan(spec, args, target="cuda")
    kernel = emulate.kernel_for(graph, args, index32, em)
    assert executor.Geometry(p, kernel).tile_dim == TILED_CASES[name][1]
    assert "__shared__" in kernel.source and "__syncthreads();" in kernel.source
    _assert_like_eager(emulate.run_graph(graph, args, index32, emulator=em), _reference(ADD_SIGMOID, args))


# --------------------------------------------------------------------------------------------------------
# the tiled path's vector form (2-byte staged inputs: cuda/templates.py's TILED_TRIP_VEC): 8-element vectors where
# every operand's sizes, strides and address allow them (partial tiles at both ends), the scalar form where not

# y contiguous, x transposed, w contiguous float32: outputs of the contiguous layout in three dtypes
MIXED_OUTPUTS = """graph(%y : Tensor, %x : Tensor, %w : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%y, %x)
  %r : Tensor = aten::sigmoid(%a)
  %s : Tensor = aten::add(%w, %x, %one)
  %c : Tensor = aten::gt(%y, %x)
  return (%r, %s, %c)"""


def _offset(shape, dtype, order=None):
    """A tensor of ``shape`` starting one element into its memory (an address no vector is aligned to); its memory
    runs in dim order ``order`` (outermost first; default: contiguous)."""
    order = list(range(len(shape))) if order is None else order
    n = math.prod(shape)
    base = _t((n + 1,), dtype)[1:].view([shape[d] for d in order])
    return base.permute([order.index(d) for d in range(len(shape))])


def _tr(rows, cols, dtype):
    """A (rows, cols) transposed view: its fastest dim is the outer one."""
    return _t((cols, rows), dtype).t()


# name -> (graph, inputs maker); every case takes the tiled path, in its vector form unless a comment says it falls
# to the scalar form. Sizes: 64 x 64 tiles of 8-element vectors for 2-byte staged inputs (or 64 x 32:
# FUSER_CUDA_TILE_VEC_B), 64 x 32 tiles of 4-element vectors for 4-byte ones (the odd sizes are odd for both)
VEC_CASES = {
    # whole tiles
    "aligned": (ADD_SIGMOID, lambda dt: [_t((128, 192), dt), _tr(128, 192, dt), _t((192,), dt)]),
    # multiples of the vector, not of the tile: partial tiles at both ends
    "partial_tiles": (ADD_SIGMOID, lambda dt: [_t((136, 200), dt), _tr(136, 200, dt), _t((200,), dt)]),
    # odd sizes both ways: the scalar form
    "odd_sizes": (ADD_SIGMOID, lambda dt: [_t((131, 197), dt), _tr(131, 197, dt), _t((131, 1), dt)]),
    # an odd innermost size (the dense side's vectors), an odd outer one (the staged input's): the scalar form
    "odd_inner": (ADD_SIGMOID, lambda dt: [_t((136, 197), dt), _tr(136, 197, dt), _t((197,), dt)]),
    "odd_outer": (ADD_SIGMOID, lambda dt: [_t((131, 200), dt), _tr(131, 200, dt), _t((200,), dt)]),
    # the transposed view starts an element in, or the contiguous one: the scalar form
    "staged_offset": (ADD_SIGMOID, lambda dt: [_t((136, 200), dt), _offset((136, 200), dt, [1, 0]),
                                               _t((200,), dt)]),
    "dense_offset": (ADD_SIGMOID, lambda dt: [_offset((136, 200), dt), _tr(136, 200, dt), _t((136, 1), dt)]),
    # a row slice of a wider tensor (rows layout) whose row stride is a multiple of the vector, a column
    "rows_slice": (ADD_SIGMOID, lambda dt: [_t((72, 256), dt)[:, :200], _tr(72, 200, dt), _t((72, 1), dt)]),
    # ... and one whose row stride is not: the scalar form
    "rows_slice_odd": (ADD_SIGMOID, lambda dt: [_t((72, 256), dt)[:, :200], _tr(72, 200, dt),
                                                _t((72, 203), dt)[:, :200]]),
    # two transposed inputs
    "two_staged": (ADD_SIGMOID, lambda dt: [_t((72, 136), dt), _tr(72, 136, dt), _tr(72, 136, dt)]),
    # ... the second starting an element in: the scalar form
    "two_staged_offset": (ADD_SIGMOID, lambda dt: [_t((72, 136), dt), _tr(72, 136, dt),
                                                   _offset((72, 136), dt, [1, 0])]),
    # a batch of transposes
    "3d_batched": (ADD_SIGMOID, lambda dt: [_t((3, 48, 72), dt), _t((3, 72, 48), dt).transpose(1, 2),
                                            _t((72,), dt)]),
    # the transposed input's fastest dim is the outermost of three, a dim between
    "3d_outer": (ADD_SIGMOID, lambda dt: [_t((40, 5, 48), dt), _permuted((40, 5, 48), [2, 1, 0], dt), _t(())]),
    # 4-d: the fastest dim of the permuted input is the third
    "4d_permute": (ADD_SIGMOID, lambda dt: [_t((2, 3, 40, 48), dt), _permuted((2, 3, 40, 48), [0, 3, 1, 2], dt),
                                            _t((48,), dt)]),
    # 4-d channels_last beside a contiguous tensor
    "4d_channels_last": (ADD_SIGMOID, lambda dt: [_t((2, 16, 3, 40), dt),
                                                  _t((2, 16, 3, 40), dt).contiguous(memory_format=torch.channels_last),
                                                  _t((40,), dt)]),
    # ... sizes that are not multiples of the vector: the scalar form
    "4d_channels_last_odd": (ADD_SIGMOID, lambda dt: [_t((2, 20, 3, 37), dt),
                                                      _t((2, 20, 3, 37), dt).contiguous(
                                                          memory_format=torch.channels_last), _t((37,), dt)]),
    # outputs of three dtypes (float16/bfloat16, float32, bool): vectors of 16, 32 and 8 bytes
    "mixed_outputs": (MIXED_OUTPUTS, lambda dt: [_t((136, 200), dt), _tr(136, 200, dt),
                                                 _t((136, 200), torch.float32)]),
    # ... odd sizes: the scalar form
    "mixed_outputs_odd": (MIXED_OUTPUTS, lambda dt: [_t((131, 197), dt), _tr(131, 197, dt),
                                                     _t((131, 197), torch.float32)]),
}
VEC_PARAMS = [(n, dt, True) for n in VEC_CASES for dt in (torch.float16, torch.bfloat16, torch.float32)] + [
    (n, torch.float16, False) for n in VEC_CASES] + [(n, dt, True) for n in ("partial_tiles", "odd_sizes")
                                                     for dt in (torch.int16, torch.int32)]


def _vec_tile(dtype) -> tuple[int, int]:
    """The vector form's tile for staged inputs of ``dtype``."""
    return (common.TILE_VEC_A, common.TILE_VEC_B) if dtype.itemsize == 2 else (64, 32)


@pytest.fixture(scope="module")
def vec_inputs():
    em, inputs = _emulated_inputs(VEC_PARAMS, VEC_CASES.get)
    yield em, inputs
    em.close()


@pytest.mark.parametrize("name,dtype,index32", VEC_PARAMS, ids=_ids(VEC_PARAMS))
def test_emulated_tiled_vector_form(vec_inputs, name, dtype, index32):
    em, inputs = vec_inputs
    text, _ = VEC_CASES[name]
    args = inputs[name, dtype]
    graph = torch.parse_ir(text)
    spec = STORE.get(STORE.register(lower(graph)))
    p = executor.plan(spec, args, target="cuda")
    kernel = emulate.kernel_for(graph, args, index32, em)
    assert executor.Geometry(p, kernel).tile_dim >= 0
    assert "fz_vec_strides(args.strides" in kernel.source and kernel.tile == _vec_tile(dtype)
    assert f"constexpr int vw = {16 // dtype.itemsize}," in kernel.source
    _assert_like_eager(emulate.run_graph(graph, args, index32, emulator=em), _reference(text, args))


@pytest.mark.parametrize("name", ["partial_tiles", "staged_offset", "mixed_outputs_odd"])
def test_emulated_tiled_scalar_form_of_2_byte_inputs(monkeypatch, name):
    """settings.cuda_tile_vec off: 2-byte staged inputs take the scalar form, a kernel of another name and source."""
    text, make = VEC_CASES[name]
    args, graph = make(torch.float16), torch.parse_ir(text)
    em_vector, em = emulate.Emulator(), emulate.Emulator()  # an emulator keeps the kernels it built (as a spec does)
    try:
        vector = emulate.kernel_for(graph, args, None, em_vector)
        monkeypatch.setattr(settings, "cuda_tile_vec", False)
        scalar = emulate.kernel_for(graph, args, None, em)
        assert "fz_vec_strides(args.strides" not in scalar.source and scalar.tile == common.TILE_SCALAR
        assert scalar.name != vector.name and scalar.source != vector.source
        _assert_like_eager(emulate.run_graph(graph, args, emulator=em), _reference(text, args))
    finally:
        em.close()
        em_vector.close()


@pytest.mark.parametrize("arch", (80, 90))
def test_tiled_vector_form_compiles_with_nvrtc(arch):
    """NVRTC takes the vector form's kernels (CI has no GPU: the emulation runs them, this compiles them)."""
    from fuser.cuda import driver
    for name in ("partial_tiles", "rows_slice", "two_staged", "mixed_outputs"):
        text, make = VEC_CASES[name]
        graph = torch.parse_ir(text)
        spec = STORE.get(STORE.register(lower(graph)))
        for dtype, index32 in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)):
            p = executor.plan(spec, make(dtype), target="cuda")
            kernel = compiler.build(spec, replace(p.arg_spec, index32=index32), load=lambda *_: (None, False),
                                    probe_device="cpu")
            assert "fz_vec_strides(args.strides" in kernel.source
            driver.compile_source(kernel.source, kernel.name, driver.NvrtcOptions(arch))


# --------------------------------------------------------------------------------------------------------
# on a GPU: the same cases through the executor's CUDA kernels (run by scripts/gpu_check.sh's test run)

def _on_cuda(a):
    """``a`` on the GPU with the very same sizes and strides (a view of a copy of the memory it spans)."""
    if not isinstance(a, torch.Tensor):
        return a
    span = 1 + sum((s - 1) * st for s, st in zip(a.shape, a.stride())) if a.numel() else 0
    return a.as_strided((span,), (1,)).cuda().as_strided(a.shape, a.stride())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_gpu_outputs_have_eagers_strides_and_values(name):
    text, make, fused = GROUP_CASES[name]
    args = [_on_cuda(a) for a in make()]
    spec = STORE.get(STORE.register(lower(torch.parse_ir(text))))
    out = executor.run(spec, args)
    if not fused:
        assert out is None
        return
    _assert_like_eager(out, _reference(text, args))


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [(n, dt) for n in VEC_CASES
                                        for dt in (torch.float16, torch.bfloat16, torch.float32)])
def test_gpu_tiled_vector_form(name, dtype):
    text, make = VEC_CASES[name]
    host = make(dtype)
    args = [on_cuda_aligned_alike(a) for a in host]
    assert [a.data_ptr() % 16 for a in args if isinstance(a, torch.Tensor)] == [
        a.data_ptr() % 16 for a in host if isinstance(a, torch.Tensor)]
    spec = STORE.get(STORE.register(lower(torch.parse_ir(text))))
    p = executor.plan(spec, args)
    kernel = executor.kernel_for(spec, p)
    assert executor.Geometry(p, kernel).tile_dim >= 0 and kernel.tile == _vec_tile(dtype)
    _assert_like_eager(executor.run(spec, args), _reference(text, args))


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [(n, dt) for n in TILED_CASES for dt in (torch.float32, torch.float16)])
def test_gpu_tiled_path(name, dtype):
    args = [_on_cuda(a) for a in TILED_CASES[name][0](dtype)]
    spec = STORE.get(STORE.register(lower(torch.parse_ir(ADD_SIGMOID))))
    p = executor.plan(spec, args)
    assert executor.Geometry(p, executor.kernel_for(spec, p)).tile_dim == TILED_CASES[name][1]
    _assert_like_eager(executor.run(spec, args), _reference(ADD_SIGMOID, args))


def test_tiled_vector_tiles_fit_static_shared_memory():
    """Both forms' shared tiles of a kernel stay within 48 KB: 64 x 64 for up to two staged 2-byte inputs, 64 x 32 for
    three, the scalar form alone from four; 64 x 32 for up to two staged 4-byte inputs; staged inputs of both
    widths: the scalar form."""
    from fuser.descs import STRIDED, TensorDesc
    options = common.KernelOptions()
    want = {1: (64, 64), 2: (64, 64), 3: (64, 32), 4: common.TILE_SCALAR, 5: common.TILE_SCALAR}
    for n, shape in want.items():
        inputs = [TensorDesc(torch.float16, STRIDED)] * n + [TensorDesc(torch.float16, DENSE)]
        assert common.tiled_vector(inputs, options) == (n <= 3)
        if common.TILE_VEC_B == 64:
            assert common.tile_shape(inputs, options) == shape, n
        vec = common.tile_shape(inputs, options) if common.tiled_vector(inputs, options) else (0, 0)
        assert n * (64 * 33 * 4 + vec[0] * vec[1] * 2) <= common.SHARED_BYTES
        wide = [TensorDesc(torch.float32, STRIDED)] * n + [TensorDesc(torch.float32, DENSE)]
        assert common.tiled_vector(wide, options) == (n <= 2)
        assert common.tile_shape(wide, options) == ((64, 32) if n <= 2 else common.TILE_SCALAR)
    mixed = [TensorDesc(torch.float16, STRIDED), TensorDesc(torch.float32, STRIDED)]
    assert not common.tiled_vector(mixed, options) and common.tile_shape(mixed, options) == common.TILE_SCALAR


def test_tiled_scalar_tiles_fit_static_shared_memory():
    """The tiled path's scalar form declares a [64][33] tile of values per staged input: a kernel gets the path only
    where they fit 48 KB (two 8-byte inputs, five 4-byte ones; 2-byte ones are held in 4 bytes)."""
    from fuser.descs import STRIDED, TensorDesc
    for dtype, most in ((torch.float64, 2), (torch.int64, 2), (torch.float32, 5), (torch.bfloat16, 5),
                        (torch.int32, 5)):
        for n in (1, most, most + 1):
            inputs = [TensorDesc(dtype, STRIDED)] * n + [TensorDesc(dtype, DENSE)]
            assert common.has_tiled_path(inputs, "cuda") == (n <= most), (dtype, n)
    assert not common.has_tiled_path([TensorDesc(torch.float64, STRIDED)], "cpu")


def _strided_inputs_graph(k: int) -> str:
    """t0 plus each of k more inputs (one output each; a float scalar as the adds' alpha)."""
    ins = ", ".join(f"%t{j} : Tensor" for j in range(k + 1))
    body = "".join(f"  %v{j} : Tensor = aten::add(%t0, %t{j}, %f0)\n" for j in range(1, k + 1))
    outs = ", ".join(f"%v{j}" for j in range(1, k + 1))
    return f"graph({ins}, %f0 : float):\n{body}  return ({outs})\n"


@pytest.mark.parametrize("dtype,k", ((torch.float64, 3), (torch.float32, 3), (torch.float32, 6)), ids=str)
def test_strided_inputs_past_the_tiles_shared_memory_compile_and_match_eager(dtype, k):
    """(CUDA fuzz, seed 608887534, graph 529: three strided float64 inputs beside a dense one, dense outputs) the
    scalar form's tiles (50688 bytes, as for six float32 inputs) made ptxas refuse the kernel, so the call raised.
    Now such a kernel has no tiled path (three float32 inputs keep it; the launcher's tile_dim agrees with the
    source); NVRTC compiles it and the emulated kernel gives eager's values and strides."""
    from fuser.cuda import driver
    text = _strided_inputs_graph(k)
    graph = torch.parse_ir(text)
    spec = STORE.get(STORE.register(lower(graph)))
    args = [random_tensor((3, 48, 40), dtype)] + [random_tensor((3, 40, 48), dtype).transpose(1, 2)
                                                  for _ in range(k)] + [-0.5]
    p = executor.plan(spec, args, target="cuda")
    kernel = compiler.build(spec, p.arg_spec, load=lambda *_: (None, False), probe_device="cpu")
    tiled = dtype == torch.float32 and k == 3
    assert ("fz_tile1" in kernel.source) == tiled
    assert (executor.Geometry(p, kernel).tile_dim >= 0) == tiled
    driver.compile_source(kernel.source, kernel.name, driver.NvrtcOptions(90))
    _assert_like_eager(emulate.run_graph(graph, args), _reference(text, args))
