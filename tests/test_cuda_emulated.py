"""The CUDA backend's generated kernels, run on the CPU through the host emulation (fuser/cuda/emulate.py)
under AddressSanitizer and UBSan, against eager on fresh random inputs: every op of the table in every dtype
it supports, every layout class in both index widths on the vector and the scalar path, cat outputs along
every dim, rand_like against an independent Philox4x32-10, the benchmark's fused groups, and the harness
itself (fibers, shared memory, the sanitizers' reports). Runs in CI without a GPU.

Every selected test's kernels are registered before the first one runs (:func:`_compile_together`), so
they compile as a few units in parallel rather than one executable each."""
import ctypes
import dataclasses
import math
from fractions import Fraction
from string import Template

import numpy as np
import pytest
import torch
from helpers import (interpret, NAN_SELF_NE_IR, NAN_THRESHOLD_IR, POW_MINUS_TWO_IR, DROPOUT_IR, FLOAT_DTYPES, INT_ABS_ERFC_IR, NAN_COMPARE_IR, NARROW_COMPARE_IR,
                     SIGMOID_GT_IR, assert_op_result, assert_same, assert_same_comparison, build, cases, eager,
                     expect_fused, make_args, random_tensor, sigmoid_gt_reference)

from fuser import bench, codegen, compiler, executor, fallback, graph_fuser, ops, rng
from fuser.cuda import emulate, templates
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
SHAPE = (67, 97)  # odd: the vector loop leaves a tail; 6499 elements: 3 blocks of 256 threads wrap


def _number_args(case) -> bool:
    return any(str(a.type) in ("number", "Optional[number]") for a in torch._C.parse_schema(case.schema).arguments)


# every case of the table, and each one with a Scalar as a float argument (a kernel argument in FzArgs)
OP_CASES = cases() + [dataclasses.replace(c, scalars_as_inputs=True) for c in cases() if _number_args(c)]
OP_PARAMS = [(c, dt) for c in OP_CASES for dt in FLOAT_DTYPES + INT_DTYPES]


def _emulator() -> emulate.Emulator:
    return emulate.default()


# --------------------------------------------------------------------------------------------------------
# every op in every dtype: dense inputs, the vector path and then the scalar path of the same kernel


def _op_inputs(case, dtype):
    b = build(case)
    args, tensors, floats = make_args(b, dtype, shape=SHAPE)
    return b, args, tensors, floats


def _register_op(em, case, dtype):
    b, args, _, _ = _op_inputs(case, dtype)
    emulate.kernel_for(b.graph, args, emulator=em)


def _cuda_eager(b, case, tensors: dict, floats: dict, dtype):
    """eager as it runs on CUDA: where CUDA's eager rounds Scalars to a float16/bfloat16 compute dtype and
    the CPU's does not (``ops.OpDef.round_operands``), round them before calling the CPU's."""
    op = ops.OPS_BY_NAME[case.op]
    if dtype not in (torch.float16, torch.bfloat16) or "cuda" not in op.round_operands or "cpu" in op.round_operands:
        return eager(b, tensors, floats)
    rnd = lambda v: torch.tensor(v, dtype=torch.float64).to(dtype).item()  # noqa: E731
    call = {k: (kind, rnd(v) if kind == "const" and isinstance(v, float) else v)
            for k, (kind, v) in b.call_args.items()}
    return eager(dataclasses.replace(b, call_args=call), tensors, {k: rnd(v) for k, v in floats.items()})


def _assert_result(case, actual, expected):
    if expected.dtype == torch.bool:  # bytes: an element no thread wrote holds 0xbe, which a bool hides
        assert actual.dtype == torch.bool and actual.shape == expected.shape
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
        return
    if "cuda" in ops.OPS_BY_NAME[case.op].targets and expected.dtype == torch.float64:
        # CUDA's own expression (ops.OpDef.targets) against the CPU's eager: hardswish's CUDA kernel multiplies by
        # the float 1.0f / 6.0f, 3e-8 from 1/6, in float64 too (tests/test_gpu.py checks it against CUDA eager)
        torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-7, equal_nan=True)
        return
    assert_op_result(case, actual, expected)


@pytest.mark.parametrize("case,dtype", OP_PARAMS, ids=[f"{c.id}-{str(dt)[6:]}" for c, dt in OP_PARAMS])
def test_op(case, dtype):
    b, args, tensors, floats = _op_inputs(case, dtype)
    try:
        expected = _cuda_eager(b, case, tensors, floats, dtype)
    except Exception:  # eager rejects these inputs: the group falls back, no kernel
        assert emulate.run_graph(b.graph, args) is None
        return
    out = emulate.run_graph(b.graph, args)
    if not expect_fused(case, expected, dtype):
        assert out is None
        return
    assert out is not None, f"{case.id} on {dtype} fell back"
    kernel = emulate.kernel_for(b.graph, args)
    assert kernel.backend.last_vec == (kernel.vec > 1)  # dense and aligned: the vector path when there is one
    _assert_result(case, out[0], expected)
    out = emulate.run_graph(b.graph, args, vectorize=False)
    _assert_result(case, out[0], expected)


# --------------------------------------------------------------------------------------------------------
# layouts: x and y of SIGMOID_GT_IR (x * y + s, sigmoid, > x) in each layout class, both index widths

LAYOUT_DTYPES = FLOAT_DTYPES + (torch.uint8, torch.int64)


def _t(dtype, *shape):
    return random_tensor(shape, dtype)


# name -> (x, y) maker, and whether the launcher takes the vector path (inner sizes of 96 and offsets of 16
# or 96 elements keep whole, aligned vectors for every dtype here)
LAYOUTS = {
    "dense": (lambda d: (_t(d, *SHAPE), _t(d, *SHAPE)), True),
    "rows": (lambda d: (_t(d, 67, 128)[:, :96], _t(d, 67, 96)), True),
    "chunk": (lambda d: (_t(d, 67, 3 * 96).chunk(3, 1)[1], _t(d, 67, 96)), True),
    "chunk_odd": (lambda d: (_t(d, 67, 3 * 97).chunk(3, 1)[1], _t(d, *SHAPE)), False),
    "strided": (lambda d: (_t(d, 67, 194)[:, ::2], _t(d, *SHAPE)), False),
    "transposed": (lambda d: (_t(d, 97, 67).t(), _t(d, *SHAPE)), False),
    "scalar_0d": (lambda d: (_t(d, *SHAPE), _t(d)), True),
    "scalar_1x1": (lambda d: (_t(d, *SHAPE), _t(d, 1, 1)), True),
    "row": (lambda d: (_t(d, 67, 96), _t(d, 96)), True),
    # a column read once per vector, wherever its rows start (an outer-product broadcast keeps 16-byte access)
    "column": (lambda d: (_t(d, 67, 96), _t(d, 67, 1)), True),
    "column_stride16": (lambda d: (_t(d, 67, 96), _t(d, 67, 16)[:, :1]), True),
    "offset": (lambda d: (_t(d, 67 * 97 + 1)[1:].view(SHAPE), _t(d, *SHAPE)), False),
    "offset_aligned": (lambda d: (_t(d, 67 * 97 + 16)[16:].view(SHAPE), _t(d, *SHAPE)), True),
    "3d_broadcast": (lambda d: (_t(d, 5, 13, 96), _t(d, 5, 1, 96)), True),
    "rank8": (lambda d: (_t(d, 5, 2, 3, 2, 3, 2, 3, 2).permute(7, 6, 5, 4, 3, 2, 1, 0), _t(d, 2, 3, 2, 3, 2, 3, 2, 5)),
              False),
}
LAYOUT_PARAMS = [(lay, dt, i32) for lay in LAYOUTS for dt in LAYOUT_DTYPES for i32 in (True, False)]


def _register_layout(em, layout, dtype, index32):
    x, y = LAYOUTS[layout][0](dtype)
    emulate.kernel_for(torch.parse_ir(SIGMOID_GT_IR), [x, y, 0.25], index32, em)


@pytest.mark.parametrize("layout,dtype,index32", LAYOUT_PARAMS,
                         ids=[f"{lay}-{str(dt)[6:]}-{'i32' if i else 'i64'}" for lay, dt, i in LAYOUT_PARAMS])
def test_layout(layout, dtype, index32):
    make, vector = LAYOUTS[layout]
    x, y = make(dtype)
    g = torch.parse_ir(SIGMOID_GT_IR)
    c, d = sigmoid_gt_reference(x, y, 0.25)
    kernel = emulate.kernel_for(g, [x, y, 0.25], index32)
    assert kernel is not None and kernel.arg_spec.index32 == index32
    for vectorize in (None, False):
        out = emulate.run_graph(g, [x, y, 0.25], index32, vectorize)
        assert kernel.backend.last_vec == (vector and vectorize is None)
        assert_same(out[0], c, dtype if dtype.is_floating_point else None)
        assert_same_comparison(out[1], d, c, x)
        assert int(out[1].view(torch.uint8).max()) <= 1  # a bool no thread wrote holds 0xbe


def test_more_dims_than_the_cuda_kernels_take_fall_back():
    x = _t(torch.float32, *(2,) * 9).permute(*reversed(range(9)))
    y = _t(torch.float32, *(2,) * 9)
    spec = STORE.get(STORE.register(lower(torch.parse_ir(SIGMOID_GT_IR))))
    reason = executor.plan(spec, [x, y, 0.5], target="cuda")
    assert isinstance(reason, str) and "9 dims" in reason
    assert emulate.run_graph(torch.parse_ir(SIGMOID_GT_IR), [x, y, 0.5]) is None
    assert not isinstance(executor.plan(spec, [x, y, 0.5], target="cpu"), str)  # the CPU kernels take any rank


# --------------------------------------------------------------------------------------------------------
# cat: each piece written into its slice of the result (strided outputs unless along the first dim)

CAT_IR = """graph(%x : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %d : int = prim::Constant[value={dim}]()
  %s : Tensor = aten::add(%x, %y, %one)
  %a : Tensor = aten::sigmoid(%s)
  %b : Tensor = aten::mul(%x, %y)
{third}  %l : Tensor[] = prim::ListConstruct(%a, %b{third_item})
  %c : Tensor = aten::cat(%l, %d)
  return (%c, %b)
"""
CAT_LAYOUTS = {
    "contiguous": lambda d: (_t(d, 5, 13, 96), _t(d, 5, 13, 96)),
    "transposed": lambda d: (_t(d, 96, 13, 5).permute(2, 1, 0), _t(d, 5, 13, 96)),
    "broadcast": lambda d: (_t(d, 5, 13, 96), _t(d, 13, 96)),
    "sliced": lambda d: (_t(d, 5, 26, 96)[:, ::2], _t(d, 1, 13, 1)),
}
CAT_PARAMS = [(dim, lay, dt, i32, n) for dim in (0, 1, 2, -1) for lay in CAT_LAYOUTS
              for dt in (torch.float32, torch.float16) for i32 in (True, False) for n in (2, 3)
              if n == 2 or (dt == torch.float32 and i32)]


def _cat_graph(dim: int, n: int) -> torch.Graph:
    third = "  %e : Tensor = aten::sub(%x, %y, %one)\n" if n == 3 else ""
    return torch.parse_ir(CAT_IR.format(dim=dim, third=third, third_item=", %e" if n == 3 else ""))


def _cat_reference(x, y, dim, n):
    pieces = [torch.sigmoid(x + y), x * y, x - y][:n]
    return torch.cat(pieces, dim), pieces[1]


def _register_cat(em, dim, layout, dtype, index32, n):
    emulate.kernel_for(_cat_graph(dim, n), list(CAT_LAYOUTS[layout](dtype)), index32, em)


@pytest.mark.parametrize("dim,layout,dtype,index32,n", CAT_PARAMS,
                         ids=[f"dim{d}-{lay}-{str(dt)[6:]}-{'i32' if i else 'i64'}-{n}pieces"
                              for d, lay, dt, i, n in CAT_PARAMS])
def test_cat(dim, layout, dtype, index32, n):
    x, y = CAT_LAYOUTS[layout](dtype)
    out = emulate.run_graph(_cat_graph(dim, n), [x, y], index32)
    assert out is not None, "fell back"
    c, b = _cat_reference(x, y, dim, n)
    assert out[0].shape == c.shape and out[0].is_contiguous()
    assert_same(out[0], c)
    _assert_equal(out[1], b)


def _assert_equal(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def test_cat_of_sigmoid_and_product_along_dim_1():
    """torch.cat([(x + y).sigmoid(), x * y], 1): two strided outputs and no strided input (issue 9: its
    FzArgs had stride rows for the strided inputs only, and the kernel read a second one)."""
    x, y = torch.randn(300, 40), torch.randn(300, 40)
    c, b = _cat_reference(x, y, 1, 2)
    # its pieces' rows hold whole vectors: the vector path writes each piece's rows (rows outputs), and the scalar path
    for vectorize in (None, True, False):
        out = emulate.run_graph(_cat_graph(1, 2), [x, y], vectorize=vectorize)
        assert out is not None
        assert_same(out[0], c)
        _assert_equal(out[1], b)


# --------------------------------------------------------------------------------------------------------
# rand_like: exactly the numbers of Philox4x32-10 for counter (i, r << 24, offset) and key seed

RAND_IR = """graph(%x : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
  %b : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
  %s : Tensor = aten::add(%a, %x, %one)
  return (%a, %b, %s)
"""
_M0, _M1, _W0, _W1, _MASK = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC'11; the Random123 reference's round and key schedule) of four uint32
    counter arrays and a (uint32, uint32) key, in numpy: independent of fuser/rng.py."""
    c0, c1, c2, c3 = (np.asarray(w, dtype=np.uint64) for w in counter)
    k0, k1 = key
    for _ in range(10):
        p0, p1 = np.uint64(_M0) * c0, np.uint64(_M1) * c2  # exact: both factors are below 2^32
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & np.uint64(_MASK), \
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & np.uint64(_MASK)
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def test_philox_reference_matches_random123_known_answers():
    """The reference against the known-answer vectors of Random123 (kat_vectors, philox4x32 10 rounds)."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((_MASK,) * 4, (_MASK, _MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in kat:
        assert tuple(int(w[0]) for w in philox4x32_10([[w] for w in counter], key)) == expected


def _uniform_reference(shape, dtype, seed: int, offset: int, r: int) -> torch.Tensor:
    """Element i: word i % 4 of the Philox block of counter (i // 4, r, offset), its top bits as the dtype's grid;
    float16/bfloat16: 16 bits each, the high half of word (i // 2) % 4 of block i // 8 for even i, the low half for
    odd; float64: words 2 (i % 2) and the next of block i // 2, as 53 bits."""
    n = math.prod(shape)
    halves = dtype in (torch.float16, torch.bfloat16)
    per = 2 if dtype == torch.float64 else 8 if halves else 4  # elements a block
    i = np.arange(n, dtype=np.uint64)
    blk = i // np.uint64(per)
    counter = (blk & np.uint64(_MASK), (blk >> np.uint64(32)) | np.uint64(r << 24),
               np.full(n, offset & _MASK, np.uint64), np.full(n, offset >> 32, np.uint64))
    words = np.stack(philox4x32_10(counter, (seed & _MASK, seed >> 32)))  # [4, n]
    slot = i % np.uint64(per)
    pick = slot // np.uint64(2) if halves else slot * np.uint64(4 // per)
    first = words[pick.astype(np.int64), np.arange(n)]
    if dtype == torch.float64:
        second = words[pick.astype(np.int64) + 1, np.arange(n)]
        bits = ((first << np.uint64(21)) ^ (second >> np.uint64(11))).astype(np.float64)
        return torch.from_numpy(bits * 2.0 ** -53).reshape(shape)
    if halves:  # the 16 bits of the element's half, as the top of a 32-bit word
        first = np.where(slot % np.uint64(2) == 0, first >> np.uint64(16), first & np.uint64(0xFFFF)) << np.uint64(16)
    k = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    return torch.from_numpy((first >> np.uint64(32 - k)).astype(np.float64) * 2.0 ** -k).reshape(shape).to(dtype)


RAND_LAYOUTS = {"dense": lambda d: _t(d, *SHAPE), "transposed": lambda d: _t(d, 97, 67).t()}
RAND_PARAMS = [(lay, dt, i32) for lay in RAND_LAYOUTS for dt in FLOAT_DTYPES for i32 in (True, False)]


def _register_rand(em, layout, dtype, index32):
    emulate.kernel_for(torch.parse_ir(RAND_IR), [RAND_LAYOUTS[layout](dtype)], index32, em)


def _random_u64() -> int:
    return int.from_bytes(torch.randint(0, 256, (8,), dtype=torch.uint8).numpy().tobytes(), "little")


@pytest.mark.parametrize("layout,dtype,index32", RAND_PARAMS,
                         ids=[f"{lay}-{str(dt)[6:]}-{'i32' if i else 'i64'}" for lay, dt, i in RAND_PARAMS])
def test_rand_like_is_philox(layout, dtype, index32):
    x = RAND_LAYOUTS[layout](dtype)
    seed, offset = _random_u64(), _random_u64()
    for vectorize in (None, False):  # the element's index, not the thread, picks its numbers
        a, b, s = emulate.run_graph(torch.parse_ir(RAND_IR), [x], index32, vectorize, (seed, offset))
        assert torch.equal(a, _uniform_reference(x.shape, dtype, seed, offset, 0))
        assert torch.equal(b, _uniform_reference(x.shape, dtype, seed, offset, 1))
        assert_same(s, a + x)


RAND_WIDE_IR = """graph(%x : Tensor, %y : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
  %s : Tensor = aten::add(%a, %y, %one)
  return (%a, %s)
"""
# a 2-byte draw beside a wider tensor: vectors of 4 (float32) or 2 (float64) elements, part of a block each
RAND_WIDE_PARAMS = [(dt, wide) for dt in (torch.float16, torch.bfloat16) for wide in (torch.float32, torch.float64)]


def _rand_wide_inputs(dtype, wide):
    return [_t(dtype, *SHAPE), _t(wide, *SHAPE)]


def _register_rand_wide(em, dtype, wide):
    emulate.kernel_for(torch.parse_ir(RAND_WIDE_IR), _rand_wide_inputs(dtype, wide), emulator=em)


@pytest.mark.parametrize("dtype,wide", RAND_WIDE_PARAMS, ids=[f"{str(a)[6:]}-{str(b)[6:]}" for a, b in RAND_WIDE_PARAMS])
def test_rand_like_in_vectors_shorter_than_a_block(dtype, wide):
    x, y = _rand_wide_inputs(dtype, wide)
    seed, offset = _random_u64(), _random_u64()
    kernel = emulate.kernel_for(torch.parse_ir(RAND_WIDE_IR), [x, y])
    assert "fz_j0" in kernel.source  # the vector path picks its words from a part of the block
    for vectorize in (None, False):
        a, s = emulate.run_graph(torch.parse_ir(RAND_WIDE_IR), [x, y], None, vectorize, (seed, offset))
        assert torch.equal(a, _uniform_reference(x.shape, dtype, seed, offset, 0))
        assert_same(s, a + y)


def test_vector_loops_draw_each_philox_block_once():
    """A vector of 8 float16 elements computes its one Philox block once, before its elements (rng.vector_words),
    not a block per element; a vector shorter than a block computes its block and picks words by selects; a
    float64 draw takes two words an element (the values, the same either way, are test_rand_like_is_philox's)."""
    body = ["const float v0 = (float)(fz_uniform_f(fz_rs, 0, @IDX@, 11));",
            "const double v1 = (double)(fz_uniform_d(fz_rs, 1, @IDX@));",
            "const float v2 = (float)(fz_uniform_f(fz_rs, 2, @IDX@, 24));"]
    lines, out = rng.vector_words(body, 8, "v", "k")
    assert [sum(f"fz_philox_at(fz_w{r}" in ln for ln in lines) for r in range(3)] == [1, 4, 2]
    assert out == ["const float v0 = (float)(fz_bits_f(fz_w0[k >> 1] << ((k & 1) * 16), 11));",
                   "const double v1 = (double)(fz_bits_d(fz_w1[2 * k], fz_w1[2 * k + 1]));",
                   "const float v2 = (float)(fz_bits_f(fz_w2[k], 24));"]
    lines, out = rng.vector_words(body[:1], 4, "v", "k")  # half a block: vector v's elements from 4 (v % 2)
    assert lines == ["unsigned int fz_w0[4];", "fz_philox_at(fz_w0, fz_rs, 0u, (unsigned long long)(v) * 4u / 8u);",
                     "const unsigned int fz_j0 = (unsigned int)((unsigned long long)(v) * 4u % 8u);"]
    assert out == ["const float v0 = (float)(fz_bits_f(fz_word(fz_w0, (fz_j0 + k) >> 1) << ((k & 1) * 16), 11));"]
    assert rng.vector_words(body[1:2], 2, "v", "k")[0] == [
        "unsigned int fz_w1[4];", "fz_philox_at(fz_w1 + 0, fz_rs, 1u, (unsigned long long)(v) * 1u + 0u);"]
    assert rng.vector_words(body[:1], 3, "v", "k") == ([], body[:1])  # neither divides the other
    x = _t(torch.float16, *SHAPE)
    spec = STORE.get(STORE.register(lower(torch.parse_ir(DROPOUT_IR))))
    p = executor.plan(spec, [x, 0.3, 1 / 0.7], target="cuda")
    source = compiler.build(spec, p.arg_spec, load=lambda *_: (None, False), probe_device="cpu").source
    assert source.count("fz_philox_at(fz_w0") == 1 and "fz_bits_f(fz_w0[k >> 1] << ((k & 1) * 16), 11)" in source


def _register_dropout(em, dtype):
    emulate.kernel_for(torch.parse_ir(DROPOUT_IR), [_t(dtype, *SHAPE), 0.3, 1 / 0.7], emulator=em)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dropout_float_arguments_come_before_the_philox_state(dtype):
    x = _t(dtype, *SHAPE)
    seed, offset = _random_u64(), _random_u64()
    z, r = emulate.run_graph(torch.parse_ir(DROPOUT_IR), [x, 0.3, 1 / 0.7], rng_state=(seed, offset))
    assert torch.equal(r, _uniform_reference(x.shape, dtype, seed, offset, 0))
    assert_same(z, (r > 0.3).type_as(x) * x * (1 / 0.7))


# --------------------------------------------------------------------------------------------------------
# the benchmark's workloads: the groups the pass makes of them, on their small shapes, against the same
# subgraph run op by op in float64

# (the row kernels' workloads are emulated by tests/test_normalizations.py)
BENCH = {wl.name: wl for wl in bench.WORKLOADS if not wl.train and not wl.random and wl.name not in
         bench.workloads.ROW_WORKLOADS}
BENCH_PARAMS = [(name, dt, i32) for name, wl in BENCH.items() for dt in wl.dtypes for i32 in (True, False)]


def _bench_group(name: str, dtype):
    """The one fusion group the pass makes of workload ``name``, and its inputs (chunks as the views the
    group reads) for the workload's small shape."""
    wl = BENCH[name]
    g = bench._script_function(wl).graph.copy()
    torch._C._jit_pass_inline(g)
    graph_fuser.fuse_graph(g)
    group, = [n for n in g.nodes() if n.kind() == "prim::FusionGroup"]
    args = {v.unique(): a for v, a in zip(g.inputs(), wl.make_inputs(wl.shapes["small"], dtype, torch.device("cpu")))}
    inputs = []
    for v in group.inputs():
        n = v.node()
        if n.kind() == "prim::ListUnpack":  # a chunk of a function input: the pass leaves aten::chunk outside
            chunk = n.inputsAt(0).node()
            pieces = args[chunk.inputsAt(0).unique()].chunk(chunk.inputsAt(1).toIValue(), chunk.inputsAt(2).toIValue())
            inputs.append(pieces[[o.unique() for o in n.outputs()].index(v.unique())])
        else:
            inputs.append(args[v.unique()])
    return group.g("Subgraph"), inputs


def _register_bench(em, name, dtype, index32):
    graph, inputs = _bench_group(name, dtype)
    emulate.kernel_for(graph, inputs, index32, em)


@pytest.mark.parametrize("name,dtype,index32", BENCH_PARAMS,
                         ids=[f"{n}-{str(dt)[6:]}-{'i32' if i else 'i64'}" for n, dt, i in BENCH_PARAMS])
def test_bench_workload(name, dtype, index32):
    graph, inputs = _bench_group(name, dtype)
    out = emulate.run_graph(graph, inputs, index32)
    assert out is not None, "fell back"
    wide = [a.double() if isinstance(a, torch.Tensor) else a for a in inputs]
    for actual, expected, plain in zip(out, interpret(graph, wide), interpret(graph, inputs)):
        assert actual.stride() == plain.stride()  # eager's layout (a transposed or channels_last input's)
        assert_same(actual, expected.to(plain.dtype), dtype)  # a float32 result of float16 inputs: their tolerance


# --------------------------------------------------------------------------------------------------------
# conversions: the host prelude's float16 conversions (PTX cvt on a GPU) and the bfloat16 store, bit for bit

def _type_as_graph() -> torch.Graph:
    return torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %r : Tensor = aten::type_as(%x, %y)
      return (%r)
    """)


def _rounding_cases(dtype) -> torch.Tensor:
    """Every value of ``dtype`` as float32, the midpoints between neighbours (ties), and the floats next to
    them, with zeros, infinities, NaN and the overflow threshold."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).float()
    vals = bits[torch.isfinite(bits)].unique()
    mid = (vals[1:] + vals[:-1]) / 2  # exact in float32: one bit more than the dtype holds
    up, down = torch.nextafter(mid, torch.tensor(math.inf)), torch.nextafter(mid, torch.tensor(-math.inf))
    top = torch.finfo(dtype).max
    extra = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, -1e-30, top * (1 + 2 ** -12), 3e38,
                          65520.0, torch.finfo(torch.float32).max])
    return torch.cat([vals, mid, up, down, extra, torch.tensor([top]).float()])


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_stores_round_to_nearest_even(dtype):
    x = _rounding_cases(dtype)
    out = emulate.run_graph(_type_as_graph(), [x, torch.zeros(1, dtype=dtype)])[0]
    expected = x.to(dtype)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_loads_are_exact(dtype):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    out = emulate.run_graph(_type_as_graph(), [x, torch.zeros(1)])[0]
    expected = x.float()
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32))


# --------------------------------------------------------------------------------------------------------
# the harness itself: hand-written kernels (valid CUDA: NVRTC compiles them too) for fibers and shared
# memory, the intrinsics' documented edges, and faults each of which must be reported

RAW_ARGS = """
struct FzArgs {
  int n;
  void* ptrs[2];
};
"""
# each block mirrors its slice in shared memory; with ${sums}, then sums it by a tree of barriers into
# out[n + block]
_MIRROR = Template(r"""
extern "C" __global__ void __launch_bounds__(256) ${name}(const FzArgs args) {
  __shared__ double tile[256];
  const double* in = (const double*)args.ptrs[0];
  double* out = (double*)args.ptrs[1];
  const unsigned t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  tile[t] = i < args.n ? in[i] : 0.0;
${barrier}  const double mirrored = tile[blockDim.x - 1 - t];
${barrier}  if (i < args.n) out[i] = mirrored;
${sums}}
""")
_BARRIER = "  __syncthreads();\n"
_SUMS = """  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) tile[t] += tile[t + s];
    __syncthreads();
  }
  if (t == 0) out[args.n + blockIdx.x] = tile[0];
"""
RAW = {
    "fz_test_shared": _MIRROR.substitute(name="fz_test_shared", barrier=_BARRIER, sums=_SUMS),
    # the mirror without its barriers: a race the emulation must not hide
    "fz_test_no_barrier": _MIRROR.substitute(name="fz_test_no_barrier", barrier="", sums=""),
    "fz_test_divergent_barrier": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_divergent_barrier(const FzArgs args) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  ((double*)args.ptrs[1])[blockIdx.x * blockDim.x + threadIdx.x] = 1.0;
}
""",
    "fz_test_read_past_end": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_read_past_end(const FzArgs args) {
  const double* in = (const double*)args.ptrs[0];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < args.n; i += blockDim.x * gridDim.x)
    ((double*)args.ptrs[1])[i] = in[i + 1];
}
""",
    "fz_test_signed_overflow": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_signed_overflow(const FzArgs args) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < args.n) ((double*)args.ptrs[1])[i] = (double)(args.n + (2147483647 - i));
}
""",
    "fz_test_writes_input": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_writes_input(const FzArgs args) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < args.n) ((double*)args.ptrs[0])[i] = ((double*)args.ptrs[1])[i] = 0.0;
}
""",
    "fz_test_skips_odd": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_skips_odd(const FzArgs args) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < args.n && i % 2 == 0) ((double*)args.ptrs[1])[i] = ((const double*)args.ptrs[0])[i];
}
""",
    # __fdividef(x, y) and __expf(x) of float pairs, as CUDA documents them at their edges
    "fz_test_intrinsics": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_intrinsics(const FzArgs args) {
  const float* in = (const float*)args.ptrs[0];
  float* out = (float*)args.ptrs[1];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < args.n) {
    out[2 * i] = __fdividef(in[2 * i], in[2 * i + 1]);
    out[2 * i + 1] = __expf(in[2 * i]);
  }
}
""",
    # the .ftz exponential and reciprocal of the fast expressions, and the helpers built on them
    "fz_test_ftz": r"""
extern "C" __global__ void __launch_bounds__(256) fz_test_ftz(const FzArgs args) {
  const float* in = (const float*)args.ptrs[0];
  float* out = (float*)args.ptrs[1];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < args.n) {
    out[4 * i] = fz_ex2_ftz(in[2 * i]);
    out[4 * i + 1] = fz_rcp_ftz(in[2 * i + 1]);
    out[4 * i + 2] = fz_div_ge1(in[2 * i], in[2 * i + 1]);
    out[4 * i + 3] = fz_exp_1p(in[2 * i]);
  }
}
""",
}


class _RawArgs(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int32), ("ptrs", ctypes.c_void_p * 2)]


def _raw_source(name: str) -> str:
    return templates.PRELUDE + RAW_ARGS + RAW[name]


def _register_raw(em, name):
    em.add(name, _raw_source(name))


def _run_raw(name: str, x: torch.Tensor, n_out: int, grid: int = 3, extra_args: bytes = b"") -> torch.Tensor:
    """Launch hand-written kernel ``name`` on input ``x`` (its n: x's elements, or pairs for the intrinsics)
    with an output of ``n_out`` elements of x's dtype; fake addresses stand for the tensors."""
    em = _emulator()
    _register_raw(em, name)
    n = x.numel() // 2 if name in ("fz_test_intrinsics", "fz_test_ftz") else x.numel()
    args = _RawArgs(n, (ctypes.c_void_p * 2)(0x10000, 0x90000))
    size = x.element_size()
    data = x.contiguous().view(torch.uint8).numpy().tobytes()
    spans = [(0x10000, len(data), data), (0x90000, n_out * size, None)]
    out, = em.run(name, grid, 256, bytes(args) + extra_args, spans)
    return torch.frombuffer(bytearray(out), dtype=x.dtype)


def test_shared_memory_and_barriers():
    n = 700  # the last of 3 blocks of 256 is partly past the end
    x = torch.randint(-1000, 1000, (n,)).double()
    out = _run_raw("fz_test_shared", x, n + 3)
    padded = torch.cat([x, torch.zeros(3 * 256 - n, dtype=torch.float64)]).view(3, 256)
    assert torch.equal(out[:n], padded.flip(1).flatten()[:n])
    assert torch.equal(out[n:], padded.sum(1))


def test_a_missing_barrier_shows_as_a_race():
    x = torch.randint(-1000, 1000, (768,)).double() + 2000  # no value is 0, what an unwritten tile holds
    out = _run_raw("fz_test_no_barrier", x, 768)
    assert not torch.equal(out, x.view(3, 256).flip(1).flatten())


FAULTS = {  # kernel -> what its report says
    "fz_test_divergent_barrier": "waits for threads that have returned",
    "fz_test_read_past_end": "AddressSanitizer: heap-buffer-overflow",
    "fz_test_signed_overflow": "runtime error: signed integer overflow",
    "fz_test_writes_input": "wrote into input 0",
}


@pytest.mark.parametrize("kernel", FAULTS)
def test_faults_are_reported(kernel):
    x = torch.randn(500, dtype=torch.float64)
    with pytest.raises(emulate.EmulationError, match=FAULTS[kernel]):
        _run_raw(kernel, x, 768)
    # the server starts again for the next launch
    assert torch.equal(_run_raw("fz_test_skips_odd", x, 500)[::2], x[::2])


def test_elements_no_thread_writes_show():
    out = _run_raw("fz_test_skips_odd", torch.randn(101, dtype=torch.float64), 101)
    assert bytes(out[1::2].numpy().tobytes()) == b"\xbe" * 8 * 50


def test_an_argument_struct_of_another_size_is_an_error():
    with pytest.raises(emulate.EmulationError, match="ctypes mirror disagrees"):
        _run_raw("fz_test_skips_odd", torch.randn(10, dtype=torch.float64), 10, extra_args=b"\0" * 8)


def test_fast_intrinsics_at_their_documented_edges():
    """__fdividef(x, y) is 0 for 2^126 < |y| (NaN for an infinite x), x / y below; __expf flushes results
    under 2^-126 to 0 (CUDA Math API, intrinsics)."""
    inf = math.inf
    pairs = [(1.0, 2.0 ** 126), (1.0, 2.0 ** 127), (1.0, -(2.0 ** 127)), (-3.0, 3e38), (inf, 2.0 ** 127),
             (1.0, inf), (6.0, 3.0), (-100.0, 1.0), (-80.0, 1.0), (0.5, 1.0), (100.0, 1.0), (math.nan, 1.0)]
    x = torch.tensor(pairs, dtype=torch.float32).flatten()
    out = _run_raw("fz_test_intrinsics", x, len(pairs) * 2).view(-1, 2)
    quotient, exp = out[:, 0], out[:, 1]
    want = [2.0 ** -126, 0.0, -0.0, -0.0, math.nan, 0.0, 2.0, -100.0, -80.0, 0.5, 100.0, math.nan]
    torch.testing.assert_close(quotient, torch.tensor(want), equal_nan=True, rtol=0, atol=0)
    assert [math.copysign(1, v) for v in quotient[1:4].tolist()] == [1, -1, -1]
    assert exp[7] == 0.0  # exp(-100) = 3.7e-44: subnormal, flushed
    torch.testing.assert_close(exp[[6, 8, 9]], torch.exp(x.view(-1, 2)[[6, 8, 9], 0]), rtol=1e-5, atol=0)
    assert exp[10] == math.inf and math.isnan(exp[11])


def test_ftz_exponential_and_reciprocal_at_their_edges():
    """ex2.approx.ftz and rcp.approx.ftz give zeros where a result or an operand is subnormal; fz_div_ge1 keeps a
    quotient below 2^-126 (the reciprocal of any finite divisor >= 1 stays normal after its scaling)."""
    inf = math.inf
    pairs = [(-126.0, 2.0 ** 126), (-127.0, 2.0 ** 127), (1.0, 2.0 ** 127), (-150.0, 3e38), (3.0, 2.0 ** -127),
             (130.0, inf), (0.5, 4.0), (math.nan, math.nan)]
    x = torch.tensor(pairs, dtype=torch.float32).flatten()
    out = _run_raw("fz_test_ftz", x, len(pairs) * 4).view(-1, 4)
    ex2, rcp, quotient, exp = out[:, 0], out[:, 1], out[:, 2], out[:, 3]
    assert ex2[:6].tolist() == [2.0 ** -126, 0.0, 2.0, 0.0, 8.0, inf]
    torch.testing.assert_close(ex2[6], torch.tensor(2.0 ** 0.5), rtol=1e-6, atol=0)
    assert rcp[:7].tolist() == [2.0 ** -126, 0.0, 0.0, 0.0, inf, 0.0, 0.25]
    # a / d for d >= 1: 1 / 2^127 = 2^-127 is subnormal and kept
    assert quotient[0].item() == -126.0 * 2.0 ** -126 and quotient[1].item() == -127.0 * 2.0 ** -127
    assert quotient[2].item() == 2.0 ** -127
    torch.testing.assert_close(quotient[3], torch.tensor(-150.0 / 3e38), rtol=1e-6, atol=0)
    assert quotient[5].item() == 0.0 and quotient[6].item() == 0.125
    # e^x: e^-126 and e^-150 are below 2^-126 and flushed (only 1 + e^x reads them); e^0.5 is e^0.5
    assert exp[0].item() == 0.0 and exp[3].item() == 0.0 and exp[1].item() == 0.0
    torch.testing.assert_close(exp[6], torch.exp(torch.tensor(0.5)), rtol=1e-6, atol=0)
    assert all(math.isnan(v) for v in out[7].tolist())


@pytest.mark.parametrize("arch", (80, 90))
def test_hand_written_kernels_are_cuda(arch):
    from fuser.cuda import driver
    for name in RAW:
        driver.compile_source(_raw_source(name), name, driver.NvrtcOptions(arch))


def test_production_source_keeps_its_prelude_and_the_host_source_only_swaps_it():
    x, y = torch.randn(4, 8), torch.randn(8)
    kernel = emulate.kernel_for(torch.parse_ir(SIGMOID_GT_IR), [x, y, 1.0])
    src = kernel.source
    assert templates.PRELUDE in src and templates.HALF_LOAD in src and templates.HALF_STORE in src
    host = emulate.host_source(src)
    assert templates.HALF_LOAD not in host and templates.HALF_STORE not in host
    assert host.split(emulate.host_prelude.PRELUDE) == src.split(templates.PRELUDE)


# --------------------------------------------------------------------------------------------------------
# compile every selected test's kernels together, before the first runs

_REGISTER = {"test_op": _register_op, "test_layout": _register_layout, "test_cat": _register_cat,
             "test_rand_like_is_philox": _register_rand,
             "test_rand_like_in_vectors_shorter_than_a_block": _register_rand_wide,
             "test_dropout_float_arguments_come_before_the_philox_state": _register_dropout,
             "test_bench_workload": _register_bench}


@pytest.fixture(scope="module", autouse=True)
def _compile_together(request):
    em = _emulator()
    with torch.random.fork_rng():  # the inputs made here only give layouts; tests draw their own
        for item in request.session.items:
            register = _REGISTER.get(getattr(item, "originalname", ""))
            if item.module is request.module and register is not None:
                register(em, **item.callspec.params)
    for name in RAW:
        _register_raw(em, name)
    em.compile_pending()
    yield


# --------------------------------------------------------------------------------------------------------
# the fourth CUDA fuzz campaign's findings (seed 3345125243, H100), regression tests that run here

WRAP_IR = """graph(%t0 : Tensor):
  %five : int = prim::Constant[value=5]()
  %one : int = prim::Constant[value=1]()
  %m1 : int = prim::Constant[value=-1]()
  %three : int = prim::Constant[value=3]()
  %v0 : Tensor = aten::add(%t0, %five, %one)
  %v1 : Tensor = aten::clamp_min(%t0, %v0)
  %v2 : Tensor = aten::rsub(%t0, %t0, %m1)
  %v3 : Tensor = aten::le(%v2, %three)
  %v4 : Tensor = aten::mul(%t0, %t0)
  %v5 : Tensor = aten::addcmul(%t0, %t0, %t0, %three)
  return (%v1, %v3, %v4, %v5)"""


@pytest.mark.parametrize("dtype", (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8), ids=str)
def test_integer_arithmetic_wraps_as_eager(dtype):
    """Signed overflow is undefined in C, and NVRTC took max(x, x + 5) to be x + 5 at INT64_MAX, and 2x <= 3 to be
    false at INT32_MAX: the kernels compute integer sums and products in unsigned 64 bits (FZ_U), which wrap as
    eager does. UBSan in the emulation reports any signed overflow left."""
    info = torch.iinfo(dtype)
    x = torch.tensor([info.max, info.max - 3, info.min, info.min + 2, 0, -1 if info.min < 0 else 1, 7] * 40,
                     dtype=dtype)
    g = torch.parse_ir(WRAP_IR)
    out = emulate.run_graph(g, [x])
    assert out is not None
    for o, r in zip(out, interpret(g, [x])):
        assert o.dtype == r.dtype and torch.equal(o, r), (o, r)


def test_fast_sigmoid_keeps_results_below_2_to_the_minus_126():
    """bfloat16 holds sigmoid(-88) = 6e-39; __fdividef gave 0 for its divisor above 2^126, and lgamma made that inf
    where eager's is 88 (fz_fdividef)."""
    g = torch.parse_ir("""graph(%t0 : Tensor):
  %v0 : Tensor = aten::sigmoid(%t0)
  %v1 : Tensor = aten::lgamma(%v0)
  %v2 : Tensor = aten::silu(%t0)
  return (%v1, %v0, %v2)""")
    x = torch.tensor([-88.0, -87.5, -88.5, -89.0, -90.0, 0.5, -200.0] * 30, dtype=torch.bfloat16)
    out = emulate.run_graph(g, [x])
    assert out is not None
    ref = interpret(g, [x])
    assert bool((out[1] > 0).eq(ref[1] > 0).all()) and bool((out[2] < 0).eq(ref[2] < 0).all())
    for o, r in zip(out, ref):
        assert_same(o, r)


# --------------------------------------------------------------------------------------------------------
# the fifth CUDA fuzz campaign's findings (seed 2651105296, H100) and the fourth's left open


def test_an_int32_operand_converts_to_a_narrow_compute_dtype_before_comparing():
    """le(int32 0-dim -3, uint8 [3]) compares in uint8, where -3 is 253: False. Narrow integers are held in int on
    CUDA, and the int32 operand went into that int unconverted (-3 <= 3: True)."""
    g = torch.parse_ir(NARROW_COMPARE_IR)
    for narrow in (torch.uint8, torch.int8, torch.int16):
        x = torch.randint(-128 if narrow != torch.uint8 else 0, 128, (300,), dtype=narrow)
        for s in (-3, 300, -200, 70000):
            args = [x, torch.tensor(s, dtype=torch.int32)]
            out = emulate.run_graph(g, args)
            assert out is not None
            for o, r in zip(out, interpret(g, args)):
                assert torch.equal(o, r), (narrow, s)


def test_pow_of_a_cpu_scalar_exponent_follows_cuda_eager():
    """CUDA eager takes a CPU scalar exponent as pow.Tensor_Scalar: sqrt for 0.5, 1/sqrt for -0.5, so
    pow(-inf, 0.5) is NaN and pow(-0.0, -0.5) is -inf there (CPU eager: inf, inf). The kernel follows CUDA's."""
    x = torch.tensor([-math.inf, -0.0, 0.0, 2.0, math.inf, -4.0, math.nan] * 20)
    for e in (0.5, -0.5, 2.0, 3.0):
        g = torch.parse_ir("""graph(%t0 : Tensor):
  %e : Float(requires_grad=0, device=cpu) = prim::Constant[value={1.}]()
  %v0 : Tensor = aten::pow(%t0, %e)
  return (%v0)""", parse_tensor_constants=True)
        g.findNode("prim::Constant").t_("value", torch.tensor(e))  # (parse_ir reads {-0.5} as 0.5)
        out = emulate.run_graph(g, [x])
        assert out is not None
        ref = torch.pow(x, e)  # pow.Tensor_Scalar: what CUDA eager runs for a CPU scalar exponent
        torch.testing.assert_close(out[0], ref, equal_nan=True, rtol=1e-6, atol=0)
        assert torch.equal(torch.signbit(out[0])[~ref.isnan()], torch.signbit(ref)[~ref.isnan()])


def test_integer_abs_wraps_and_is_hidden_from_ptxas():
    """erfc(abs(INT32_MIN)) is erfc(-2^31) = 2 in eager (abs wraps). ptxas took the abs.s32 that NVVM made of
    `x < 0 ? -x : x` as never negative and gave 0; fz_iabs computes it through a sign mask behind an empty asm
    (tests/test_gpu.py checks the GPU; here the wrapping, under UBSan)."""
    g = torch.parse_ir(INT_ABS_ERFC_IR)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8):
        info = torch.iinfo(dtype)
        x = torch.tensor([info.min, info.min + 1, -3, 0, 5, info.max] * 30, dtype=dtype)
        k = emulate.kernel_for(g, [x])
        assert "fz_iabs(x0)" in k.source
        out = emulate.run_graph(g, [x])
        ref = interpret(g, [x])
        assert torch.equal(out[0], ref[0]), dtype
        torch.testing.assert_close(out[1], ref[1], rtol=1e-6, atol=0)


def test_ordered_comparisons_of_nan_are_false():
    """ptxas took fabsf(x) >= -0.25f as true for a NaN x (abs(hardswish(sinh(-3e38))) >= -0.25 was True on an
    H100): ordered comparisons of floats also test their operands' NaN bits (fz_isnan)."""
    g = torch.parse_ir(NAN_COMPARE_IR)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.tensor([-3e38, math.nan, 1.0, -math.inf, 0.5] * 30).to(dtype)
        k = emulate.kernel_for(g, [x])
        assert "!fz_isnan(" in k.source
        out = emulate.run_graph(g, [x])
        ref = interpret(g, [x])
        for o, r in zip(out[:4], ref):
            assert torch.equal(o, r), dtype
        # hardswish's CUDA kernel multiplies by the float 1.0f / 6.0f (ops._sixth): not bitwise in float64
        torch.testing.assert_close(out[4], ref[4], equal_nan=True)


def test_threshold_keeps_nan():
    """threshold(-|acos(3.07)|, 1, -1) is NaN in eager; ptxas took -fabsf(NaN) <= 1.f as true and the CUDA kernel gave
    -1 (the CUDA fuzzer): the kernel tests the NaN bits first. Every float dtype, against the interpreter."""
    g = torch.parse_ir(NAN_THRESHOLD_IR)
    for dtype in FLOAT_DTYPES:
        x = torch.tensor([3.0687239, 0.5, -0.9, math.nan, 1.0] * 30).to(dtype)
        assert "!fz_isnan(" in emulate.kernel_for(g, [x]).source
        out, ref = emulate.run_graph(g, [x])[0], interpret(g, [x])[0]
        assert out.isnan().equal(ref.isnan()) and ref.isnan().any(), dtype
        torch.testing.assert_close(out, ref, equal_nan=True)


def test_pow_by_2_3_and_minus_2_are_eagers_products():
    """Eager's pow with a Scalar exponent of 2, 3 or -2 is a * a, a * a * a, 1 / (a * a) on both devices, which differ
    from pow where a * a overflows or underflows: atan(log10(pow(rsqrt(1e-310), -2))) is -pi/2 in eager (the sixth
    CUDA campaign); a NaN of the group compared with itself is unequal."""
    g = torch.parse_ir(POW_MINUS_TWO_IR)
    x = torch.tensor([1e-310, 1e-300, 4.0, 0.25] * 30, dtype=torch.float64)
    assert torch.equal(emulate.run_graph(g, [x])[0], interpret(g, [x])[0])
    for e in (2.0, 3.0, -2.0):
        ge = torch.parse_ir(f"""graph(%t0 : Tensor):
  %e : float = prim::Constant[value={e}]()
  %v : Tensor = aten::pow(%t0, %e)
  return (%v)""")
        for dtype in (torch.float32, torch.float64):
            big = 1e155 if dtype == torch.float64 else 2e19
            x = torch.tensor([big, 1 / big, -big, 3.0, -0.0, math.inf, math.nan] * 20, dtype=dtype)
            assert torch.equal(emulate.run_graph(ge, [x])[0].nan_to_num(7.0), interpret(ge, [x])[0].nan_to_num(7.0))
    g = torch.parse_ir(NAN_SELF_NE_IR)
    x = torch.tensor([-0.2, 0.0, math.nan] * 40)
    k = emulate.kernel_for(g, [x])
    assert "fz_isnan(" in k.source
    for o, r in zip(emulate.run_graph(g, [x]), interpret(g, [x])):
        assert torch.equal(o, r)


def test_addcmul_with_value_1_is_one_fused_multiply_add_on_cuda():
    """CUDA eager's addcmul is fma(tensor1, tensor2, self) for value 1: -1.5 * -3e38 - 3e38 is 1.5e38 (the product
    is never rounded to inf); for other values fma(value, tensor1 * tensor2, self)."""
    g = torch.parse_ir("""graph(%t0 : Tensor, %t1 : Tensor):
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %v0 : Tensor = aten::addcmul(%t0, %t1, %t0, %one)
  %v1 : Tensor = aten::addcmul(%t0, %t1, %t0, %two)
  return (%v0, %v1)""")
    for dtype in (torch.float32, torch.float64):
        big = -3e38 if dtype == torch.float32 else -1e308
        a = torch.tensor([big, 1.0, 3.0] * 30, dtype=dtype)
        b = torch.tensor([-1.5, 2.0, -0.5] * 30, dtype=dtype)
        out = emulate.run_graph(g, [a, b])
        exact = torch.tensor([float(Fraction(y) * Fraction(x) + Fraction(x)) for x, y in zip(a.tolist(), b.tolist())],
                             dtype=torch.float64).to(dtype)
        assert math.isfinite(out[0][0].item())  # no rounded product
        torch.testing.assert_close(out[0], exact, rtol=1e-7, atol=0)
        assert math.isinf(out[1][0].item())  # 2 * (t1 * t2) overflows first, as in CUDA eager


def test_float_scalars_of_a_float16_op_are_not_rounded_to_float16():
    """A float16 op computes in float with its Python float operands unrounded, as eager does: -inf * 1e-40 is -inf
    (1e-40 rounded to float16 is 0, and -inf * 0 NaN), softplus(x, beta=1e-40) is x. Only the op's result rounds."""
    g = torch.parse_ir("""graph(%t0 : Tensor, %f0 : float):
  %zero : float = prim::Constant[value=0.]()
  %v0 : Tensor = aten::mul(%t0, %f0)
  %v1 : Tensor = aten::softplus(%t0, %f0, %zero)
  return (%v0, %v1)""")
    x = torch.tensor([-math.inf, math.inf, 0.7993, -2.0, 1e4] * 30, dtype=torch.float16)
    ref = interpret(g, [x, 1e-40])
    for out in (emulate.run_graph(g, [x, 1e-40]), executor.run(STORE.get(STORE.register(lower(g))), [x, 1e-40])):
        assert out is not None
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r, equal_nan=True, rtol=1e-3, atol=0)


def test_pow_rounds_its_scalar_exponent_to_a_reduced_dtype():
    """Eager's pow.Tensor_Scalar converts the exponent to a float16/bfloat16 self's dtype: pow(x * y, 1e-40) is 1
    for x * y = inf in float16 (1e-40 is 0 there) and inf in bfloat16 (which holds 1e-40)."""
    g = torch.parse_ir("""graph(%t0 : Tensor, %t1 : Tensor):
  %v0 : Tensor = aten::mul(%t1, %t0)
  %e : float = prim::Constant[value=1e-40]()
  %v1 : Tensor = aten::pow(%v0, %e)
  return (%v1)""")
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.tensor([-79.3125, 2.0, 1e30, 0.0] * 30).to(dtype)
        y = torch.tensor([-2696.0, 3.0, 1e30, 5.0] * 30).to(dtype)
        ref = interpret(g, [x, y])
        for out in (emulate.run_graph(g, [x, y]), executor.run(STORE.get(STORE.register(lower(g))), [x, y])):
            assert out is not None
            torch.testing.assert_close(out[0], ref[0], equal_nan=True, rtol=1e-3, atol=0)


def test_pow_rounds_its_scalar_base_to_a_reduced_dtype():
    """Eager's pow.Scalar converts a scalar base to a float16/bfloat16 exponent's dtype: pow(1e-40, x) is pow(0, x)
    in float16, inf for x < 0 and 0 for x > 0 (frac of inf is NaN), and bfloat16 holds 1e-40 (the CUDA fuzzer,
    seed 2852755661: the fused kernel gave 0.0 where eager gave NaN)."""
    g = torch.parse_ir("""graph(%t0 : Tensor):
  %c : float = prim::Constant[value=1e-40]()
  %v0 : Tensor = aten::pow(%c, %t0)
  %v1 : Tensor = aten::frac(%v0)
  return (%v0, %v1)""")
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(120) * 0.3).to(dtype)
        ref = interpret(g, [x])
        for out in (emulate.run_graph(g, [x]), executor.run(STORE.get(STORE.register(lower(g))), [x])):
            assert out is not None
            for o, r in zip(out, ref):
                torch.testing.assert_close(o, r, equal_nan=True, rtol=1e-3, atol=0)


# --------------------------------------------------------------------------------------------------------
# the launch's waves (codegen.grid_waves)

MIXED_WIDTH_IR = """graph(%x : Tensor, %col : Tensor, %row : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %col)
  %b : Tensor = aten::add(%a, %row, %one)
  %c : Tensor = aten::gt(%b, %x)
  return (%b, %c)
"""


GELU_BIAS_IR = """graph(%x : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %none : str = prim::Constant[value="none"]()
  %a : Tensor = aten::add(%x, %b, %one)
  %g : Tensor = aten::gelu(%a, %none)
  return (%g)
"""


def _waves(ir_text: str, inputs) -> object:
    spec = STORE.get(STORE.register(lower(torch.parse_ir(ir_text))))
    p = executor.plan(spec, inputs, target="cuda")
    chosen = []
    compiler.build(spec, p.arg_spec, load=lambda *a: (chosen.append(a[7]), (None, False))[1], probe_device="cpu")
    return chosen[0]


def test_cheap_walking_kernels_launch_one_trip_a_thread():
    """codegen.grid_waves: a broadcast affine over float32 or a float16 tensor plus a float32 bias (4-element vectors,
    cheap ops) launch a block per 256 vectors; a float16 GELU (8-element vectors) and a transposed (tiled) input
    keep the launcher's default waves."""
    col, row = random_tensor((61, 1), torch.float32), random_tensor((128,), torch.float32)
    affine = MIXED_WIDTH_IR.replace("  %c : Tensor = aten::gt(%b, %x)\n", "").replace("return (%b, %c)", "return (%b)")
    assert _waves(affine, [random_tensor((61, 128), torch.float32), col, row]) == codegen.CHEAP_WAVES
    assert _waves(MIXED_WIDTH_IR, [random_tensor((61, 128), torch.float16), col, row]) == codegen.CHEAP_WAVES
    assert _waves(affine, [random_tensor((61, 128), torch.float16), col.half(), row.half()]) is None  # 8 elements
    assert _waves(GELU_BIAS_IR, [random_tensor((61, 128), torch.float16), row.half()]) is None  # 8 elements
    residual = random_tensor((61, 128), torch.float32)
    assert _waves(affine, [random_tensor((128, 61), torch.float32).t(), col, residual]) is None  # the tiled path
    assert codegen.grid_waves(["mul", "add"], [], 4, "cpu") is None


def test_heavy_4_element_kernels_launch_more_waves():
    """codegen.grid_waves: a float32 GELU over rows plus a bias (4-element vectors, an erf) and over two full-size
    tensors launch HEAVY_WAVES waves (not 8 waves or one trip a thread, the launcher's defaults for walking and
    dense kernels); float64 (2-element vectors) keeps the launcher's default."""
    x, row = random_tensor((61, 128), torch.float32), random_tensor((128,), torch.float32)
    assert codegen.HEAVY_WAVES not in (0, 8)
    assert _waves(GELU_BIAS_IR, [x, row]) == codegen.HEAVY_WAVES
    assert _waves(GELU_BIAS_IR, [x, random_tensor((61, 128), torch.float32)]) == codegen.HEAVY_WAVES
    assert _waves(GELU_BIAS_IR, [x.double(), row.double()]) is None
    assert codegen.grid_waves(["gelu"], [], 4, "cpu") is None
