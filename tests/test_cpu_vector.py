"""The CPU backend's vector path (at::vec loops, fuser/cpu/templates.py): which groups take it, the vector
body, the single-vector loop and the scalar tail against eager for every op of the table and every layout
class, eager's own bits where its vector loops compute the same way, and the compile cache (precompiled header,
kernels on disk)."""
import os
import subprocess
import sys

import pytest
import torch
from helpers import DROPOUT_IR, build, cases, eager, op_on_layouts_vs_eager, random_tensor

import fuser
from fuser import codegen, compiler, executor, ops
from fuser.cpu import compiler as cpu_compiler
from fuser.cpu import templates as cpu_t
from fuser.cpu import vml
from fuser.descs import DENSE, REPEAT, ROWS, SCALAR, STRIDED, ArgSpec, TensorDesc
from fuser.kernel_cache import KernelStore
from fuser.ts_ir import lower

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_vectors = pytest.mark.skipif(cpu_compiler.toolchain() is None,
                                   reason="no at::vec toolchain here (not x86-64 with AVX2, or no g++)")

# elements per row of the layout tests: two trips of 4 float vectors (AVX2) and one single vector and 5 tail
# elements; for doubles 4 trips, 3 single vectors and one tail element (with AVX-512: one trip, tails)
INNER = 77


def _source(ir: str, descs, n_scalars=0, vectorize=True) -> str:
    store = KernelStore()
    spec = store.get(store.register(lower(torch.parse_ir(ir))))
    types = compiler.infer_types(spec, ArgSpec("cpu", None, tuple(descs), True))
    return codegen.generate(spec.group, descs, types, "cpu", "k",
                            codegen.KernelOptions(vectorize=vectorize))


MUL_TANH = """graph(%x : Tensor, %y : Tensor):
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::tanh(%a)
  return (%b)
"""


def test_every_op_has_a_vector_form():
    """Every op of the table runs on vectors in float and double (its scalar expression compiles on vectors
    through the header's overloads, or the table gives ``Exprs.v``): a new op must say how."""
    missing = []
    for op in ops.OPS_BY_NAME.values():
        if op.concat:
            continue
        for variant in op.exprs:
            if codegen.vector_template(op, variant, "f") is None or codegen.vector_template(op, variant, "d") is None:
                missing.append((op.name, variant))
    assert missing == []


def test_vector_ready_reads_the_calls():
    assert codegen.vector_ready("(1.f / (1.f + expf(-$a)))")
    assert not codegen.vector_ready("($a > 0.f ? $a : $a * $b)")  # a conditional: needs Exprs.v
    assert not codegen.vector_ready("fz_uniform_f(fz_rs, $r, @IDX@, $bits)")  # not overloaded for vectors


MUL_ADD = """graph(%x : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::add(%a, %y, %one)
  return (%b)
"""


def test_float_group_source_has_wide_single_and_tail_loops():
    f32 = TensorDesc(torch.float32, DENSE)
    src = _source(MUL_TANH, [f32, f32])
    assert src.count(cpu_t.VECTOR_INCLUDE) == 1
    assert f"{codegen.CPU_VECTORS_PER_TRIP} * W" in src  # trips of several vectors
    assert "for (; i0 + W <= numel; i0 += W)" in src  # single vectors
    # a transcendental body's tail is one partial vector (at::vec's tanh, not libm's per element)
    assert "tanhf(v0_3)" in src and "tanhf(v0_0)" in src and "tanhf(v0)" not in src
    assert "fz_vgather_n(t0 + i, 1, n)" in src and "fz_vscatter_n(o0 + i, 1, v1_0, n);" in src
    cheap = _source(MUL_ADD, [f32, f32])  # a cheap body keeps the scalar tail
    assert "for (int64_t i = i0; i < numel; ++i)" in cheap and "_n(" not in cheap
    rows = _source(MUL_TANH, [TensorDesc(torch.bfloat16, STRIDED), TensorDesc(torch.bfloat16, ROWS)])
    assert "fz_vgather(t0 + off0" in rows and "fz_vload(t1 + off1" in rows
    assert "fz_vgather_n(t0 + off0, st0[rank - 1], n)" in rows and "fz_vgather_n(t1 + off1, 1, n)" in rows


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64), ids=str)
@pytest.mark.parametrize("cols", (1, 3, 5, 8, 13))
def test_rows_shorter_than_a_vector_run_as_partial_vectors(dtype, cols):
    """Rows of fewer elements than a vector (a transposed [cols x 40] tensor, a broadcast along the short dim, a
    bool condition gathered across it, a float and a bool output) run their transcendental bodies as one partial
    vector a row: eager's elements within tolerance, masks loaded and stored lane by lane."""
    g = torch.parse_ir("""graph(%x : Tensor, %b : Tensor, %c : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::add(%x, %b, %one)
  %e : Tensor = aten::tanh(%a)
  %w : Tensor = aten::where(%c, %e, %y)
  %m : Tensor = aten::gt(%e, %y)
  return (%w, %m)
""")
    gen = torch.Generator().manual_seed(cols)
    x = random_tensor((40, cols), dtype, gen=gen).t()  # (cols, 40), strides (1, cols): rows of `cols` elements
    b = random_tensor((1, 40), dtype, gen=gen)  # broadcast along the short dim
    c = random_tensor((cols, 40), torch.bool, gen=gen)  # row-major where x is transposed: gathered
    y = random_tensor((40, cols), dtype, gen=gen).t()
    w, m = fuser.debug_launch_graph(g, [x, b, c, y])
    e = torch.tanh(x + b)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 1e-2)
    ref = torch.where(c, e, y)
    torch.testing.assert_close(w, ref, rtol=tol, atol=tol, equal_nan=True)
    assert w.stride() == ref.stride()
    near = (e - y).abs() <= tol * (1 + y.abs())  # comparisons of values a rounding apart may differ
    assert torch.equal(m[~near], (e > y)[~near])
    src = _source(g.str(), [TensorDesc(dtype, STRIDED), TensorDesc(dtype, ROWS), TensorDesc(torch.bool, STRIDED),
                            TensorDesc(dtype, STRIDED)])
    assert "fz_vload_mask_n<fz_v>(t2 + off" in src and "fz_vstore_mask_n(" in src and "fz_vscatter_n(" in src


@pytest.mark.parametrize("descs", [
    [TensorDesc(torch.int32, DENSE), TensorDesc(torch.int32, DENSE)],  # integers: scalar loops
    [TensorDesc(torch.float32, DENSE), TensorDesc(torch.float64, DENSE)],  # two compute types
])
def test_groups_without_a_vector_form_keep_the_scalar_loop(descs):
    assert cpu_t.VECTOR_INCLUDE not in _source(MUL_TANH, descs)


def test_vectorize_option_off_gives_the_scalar_kernel():
    f32 = TensorDesc(torch.float32, DENSE)
    src = _source(MUL_TANH, [f32, f32], vectorize=False)
    assert cpu_t.VECTOR_INCLUDE not in src and "#include <math.h>" in src


def _layout_args(b, dtype: torch.dtype, gen: torch.Generator) -> tuple[list, dict, dict]:
    """Tensor arguments of one op in different layout classes, over a (3, INNER) map: the first transposed
    (strided), the second a row broadcast over the rows, the third a column broadcast along them; a condition is
    dense bool. Floats as helpers.make_args."""
    from helpers import _SCALARS
    shapes = [("t", (INNER, 3)), ("row", (INNER,)), ("col", (3, 1))]
    tensors = {}
    for n, (kind, shape) in zip(b.tensor_args, shapes):
        if n == "condition":
            tensors[n] = random_tensor((3, INNER), torch.bool, gen=gen)
            continue
        t = random_tensor(shape, dtype, gen=gen)
        tensors[n] = t.t() if kind == "t" else t
    floats = {n: _SCALARS.get(n, 0.75) * 1.0 for n in b.float_args}
    return [tensors[n] for n in b.tensor_args] + [floats[n] for n in b.float_args], tensors, floats


# float64 (4 lanes with AVX2; its expressions are the d family's) on a few ops of each kind, to keep CI short
_DOUBLE_OPS = {"tanh", "sigmoid", "gelu", "add", "div", "where", "lerp", "pow_scalar", "clamp", "gt", "hardswish"}


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64), ids=str)
@pytest.mark.parametrize("case", [c for c in cases() if not c.none_args], ids=lambda c: c.id)
def test_every_op_on_vectors_and_tails_vs_eager(case, dtype):
    """Each op with strided, row-broadcast and column-broadcast operands (gathers, vector loads, broadcasts), rows
    of INNER elements: vector trips, single vectors and the scalar tail each compute part of every row."""
    if dtype == torch.float64 and case.op not in _DOUBLE_OPS:
        pytest.skip("float64: a few ops of each kind")
    source = op_on_layouts_vs_eager(case, _layout_args, dtype)
    assert source is None or cpu_compiler.is_vector_source(source), \
        f"{case.id} on {dtype} did not take the vector path"


# ops whose float32 results on the vector path are eager's bit for bit on this build of torch: eager's vector
# loops compute them with the same at::vec / SLEEF calls in the same order (the others: eager calls MKL's VML
# for contiguous float32/float64 tensors, 1 ulp away at times; its gelu(approximate='none') uses at::vec's
# approximate erf where fuser's erf is SLEEF's 1-ulp one)
BITWISE = {"abs", "ceil", "cosh", "expm1", "floor", "frac", "lgamma", "log1p", "neg", "reciprocal", "relu", "round",
           "rsqrt", "sigmoid", "sinh", "trunc", "silu", "hardtanh", "hardswish", "hardsigmoid", "relu6", "leaky_relu",
           "elu", "softplus", "mish", "add", "sub", "rsub", "mul", "div", "atan2", "fmod", "remainder", "maximum",
           "minimum", "pow", "pow_scalar", "type_as", "clamp", "clamp_tensor", "clamp_min", "clamp_min_tensor",
           "clamp_max", "clamp_max_tensor", "threshold", "lerp", "addcmul", "where", "eq", "ne", "ge", "gt", "le", "lt"}


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", [c for c in cases() if c.op in BITWISE or c.op in cpu_t.VML_FUNCTIONS
                                  or c.id == "gelu-default-tanh"], ids=lambda c: c.id)
def test_bitwise_eager_where_eager_computes_alike(case, dtype, monkeypatch):
    """4096 contiguous elements: eager's own vector loop covers them all (it leaves a scalar tail of < 2
    vectors per chunk, and chunks only above 32768 elements). The ops eager computes with MKL's VML in float32
    (cpu_t.VML_FUNCTIONS) call the same functions where this torch exports them (fuser.cpu.vml; on any processor
    here, as FUSER_CPU_VML=1 has it)."""
    if dtype == torch.float32 and case.op in cpu_t.VML_FUNCTIONS and case.op not in vml._probe():
        pytest.skip(f"this torch's libtorch_cpu has no {cpu_t.VML_FUNCTIONS[case.op]} giving eager's bits")
    monkeypatch.setattr(vml, "_found", [vml._probe()])
    b = build(case)
    store = KernelStore()
    spec = store.get(store.register(lower(b.graph)))
    gen = torch.Generator().manual_seed(int(torch.randint(2 ** 31, ())))
    tensors = {n: random_tensor((4096,), torch.bool if n == "condition" else dtype, gen=gen) for n in b.tensor_args}
    floats = {n: 0.75 for n in b.float_args}
    args = [tensors[n] for n in b.tensor_args] + [floats[n] for n in b.float_args]
    try:
        expected = eager(b, tensors, floats)
    except Exception:
        pytest.skip("eager rejects these inputs")
    out = executor.run(spec, args)
    assert out is not None
    got = out[0]
    same = (got == expected) | (got.isnan() & expected.isnan()) if got.is_floating_point() else got == expected
    if got.is_floating_point():
        same &= (torch.signbit(got) == torch.signbit(expected)) | got.isnan()
    assert bool(same.all()), (case.id, int((~same).sum()), got[~same][:4], expected[~same][:4])


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_random_numbers_are_the_scalar_paths(dtype, monkeypatch):
    """rand_like's Philox on vectors draws exactly the scalar loop's numbers (word i % 4 of block i // 4)."""
    x = random_tensor((1000 + 7,), dtype)
    outs = []
    for vectorize in ("1", "0"):
        monkeypatch.setattr(compiler, "_cpu_vectorize", lambda: vectorize == "1")
        store = KernelStore()
        spec = store.get(store.register(lower(torch.parse_ir(DROPOUT_IR))))
        torch.manual_seed(7)
        outs.append(executor.run(spec, [x, 0.3, 1 / 0.7]))
        kernel = next(k for k in spec.kernels().values() if k is not None)
        assert cpu_compiler.is_vector_source(kernel.source) == (vectorize == "1")
    for v, s in zip(*outs):
        torch.testing.assert_close(v, s, rtol=0, atol=0, equal_nan=True)


def test_scalar_and_zero_dim_operands_broadcast_on_vectors():
    g = torch.parse_ir("""graph(%x : Tensor, %y : Tensor, %c : Tensor):
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::where(%c, %a, %x)
  %d : Tensor = aten::gt(%b, %y)
  return (%b, %d)
""")
    x, y = random_tensor((5, INNER), torch.bfloat16), torch.tensor(1.5, dtype=torch.bfloat16)
    c = random_tensor((1, 1), torch.bool)
    out = fuser.debug_launch_graph(g, [x, y, c])
    b = torch.where(c, x * y, x)
    torch.testing.assert_close(out[0], b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out[1], b > y)


@needs_vectors
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_transposed_operands_take_the_tiled_loop_across_tile_and_chunk_edges(dtype):
    """A transposed operand (gathered along the inner dim) beside a dense one: tasks of CPU_TILE_ROWS rows by
    CPU_TILE_CHUNK elements (fuser/cpu/templates.py VECTOR_LOOP_TILES). Rows and columns past whole tiles and
    chunks, the output in either operand's layout, against eager."""
    from fuser.codegen.common import CPU_TILE_CHUNK, CPU_TILE_ROWS
    g = torch.parse_ir(MUL_TANH)
    rows, cols = 2 * CPU_TILE_ROWS + 5, CPU_TILE_CHUNK + 44
    gen = torch.Generator().manual_seed(3)
    xt = random_tensor((cols, rows), dtype, gen=gen).t()  # (rows, cols), strides (1, rows)
    y = random_tensor((rows, cols), dtype, gen=gen)
    for args in ((xt, y), (y, xt)):
        out = fuser.debug_launch_graph(g, list(args))[0]
        ref = torch.tanh(args[0] * args[1])
        assert out.stride() == ref.stride()
        tol = 1e-5 if dtype != torch.bfloat16 else 1e-2
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol, equal_nan=True)
    descs = [TensorDesc(dtype, STRIDED), TensorDesc(dtype, DENSE)]
    src = _source(MUL_TANH, descs)
    assert "tiles * chunks" in src and cpu_compiler.is_vector_source(src)


_CHILD = """
import sys, torch, fuser
from fuser import disk_cache
from fuser.cpu import compiler
g = torch.parse_ir('''graph(%x : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::add(%x, %b, %one)
  %t : Tensor = aten::tanh(%y)
  %r : Tensor = aten::mul(%t, %y)
  return (%r)''')
x, b = torch.linspace(-3, 3, 4000).view(40, 100), torch.linspace(-1, 1, 100)
out = fuser.debug_launch_graph(g, [x, b])[0]
ok = torch.allclose(out, torch.tanh(x + b) * (x + b))
print(int(ok), fuser.n_compiled_kernels(), disk_cache.hits, int(compiler.toolchain().build_s > 1.0))
"""


@needs_vectors
def test_kernels_and_the_precompiled_header_come_back_from_disk(tmp_path):
    """A second process compiles nothing (the kernel is a checked disk entry); a corrupt kernel entry and a
    corrupt precompiled header are rebuilt, never used."""
    env = dict(os.environ, FUSER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    env.pop("FUSER_DISABLE_CACHE", None)

    def child():
        r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        return [int(v) for v in r.stdout.split()]

    ok, compiled, hits, _ = child()
    assert (ok, compiled, hits) == (1, 1, 0)
    assert child()[:3] == [1, 0, 1]  # from disk: nothing compiled
    entries = list((tmp_path / "cache").glob("*.so"))
    assert len(entries) == 1
    data = bytearray(entries[0].read_bytes())
    data[-100] ^= 0xFF
    entries[0].write_bytes(bytes(data))
    assert child()[:3] == [1, 1, 0]  # corrupt: rebuilt
    (gch,) = (tmp_path / "cache").glob(f"cpu-toolchain-*/{cpu_t.VECTOR_HEADER_NAME}.gch")
    gch.write_bytes(gch.read_bytes()[:1000])
    for entry in (tmp_path / "cache").glob("*.so"):
        entry.unlink()
    ok, compiled, hits, rebuilt = child()
    assert (ok, compiled, rebuilt) == (1, 1, 1)  # the header precompiled again


def test_the_vector_header_compiles_for_avx512(tmp_path):
    """Only AVX2 runs here; the AVX-512 branches of the header at least compile (g++ needs no such CPU)."""
    if cpu_compiler.vector_capability() is None:
        pytest.skip("no at::vec headers or not x86-64")
    header = tmp_path / "h.h"
    header.write_text(cpu_t.VECTOR_HEADER)
    cxx = cpu_compiler.compiler()
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-x", "c++", *cpu_compiler.ISA_FLAGS["AVX512"],
                        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-I", str(cpu_compiler._torch_include()),
                        str(header)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("isa", ("AVX2", "AVX512"))
def test_the_row_kernels_lane_combines_compile_for_both_isas(isa, tmp_path):
    """The CPU row kernels' lane trees and double widening (fuser/rows/templates.py CPU_LANE_REDUCE) have one branch
    per instruction set; whichever this machine runs, both compile (g++ needs no such CPU)."""
    from fuser.rows import templates as row_t
    if cpu_compiler.vector_capability() is None:
        pytest.skip("no at::vec headers or not x86-64")
    src = tmp_path / "lanes.cpp"
    src.write_text(cpu_t.VECTOR_HEADER + row_t.row_prelude("cpu", row_t.CPU_LANE_REDUCE) +
                   "double f(const fz_vf& a, const fz_vd& b) {\n  const fz_vd c = fz_vd(1.5);\n"
                   "  return fz_lane_tree<fz_rsum, double>(fz_wsum(a) + fz_wdiff(a, c) + fz_wsum(b) + fz_wdiff(b, c))\n"
                   "         + fz_lane_tree<fz_rmax, float>(a);\n}\n")
    r = subprocess.run([cpu_compiler.compiler(), "-std=c++17", "-fsyntax-only", "-x", "c++",
                        *cpu_compiler.ISA_FLAGS[isa], f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}",
                        "-I", str(cpu_compiler._torch_include()), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_vectors
@pytest.mark.parametrize("op", sorted(cpu_t.VML_FUNCTIONS))
@pytest.mark.parametrize("shape", [(5, 77), (3, 16), (2, 5)], ids=str)
def test_vml_ops_give_eagers_bits_in_trips_single_vectors_and_tails(op, shape, monkeypatch):
    """``op(x + b)`` over float32 rows of 77 (a trip of four vectors, a partial vector), 16 (single vectors) and 5
    elements (partial vectors alone), b a row: every loop of the kernel calls the op's VML function (as on an Intel
    processor, or with FUSER_CPU_VML=1), so the results are eager's add and op, bit for bit."""
    if op not in vml._probe():
        pytest.skip(f"this torch's libtorch_cpu has no {cpu_t.VML_FUNCTIONS[op]} giving eager's bits")
    monkeypatch.setattr(vml, "_found", [vml._probe()])
    ir = f"""graph(%x : Tensor, %b : Tensor):
      %one : int = prim::Constant[value=1]()
      %a : Tensor = aten::add(%x, %b, %one)
      %r : Tensor = aten::{op}(%a)
      return (%r)
    """
    x, b = torch.randn(shape) * 3, torch.randn(shape[1:])
    if op in ("log", "log10", "log2"):
        x, b = x.abs() * 10, b.abs()
    elif op in ("asin", "acos"):
        x, b = torch.rand(shape) - 0.5, torch.rand(shape[1:]) - 0.5
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    store = KernelStore()
    spec = store.get(store.register(lower(torch.parse_ir(ir))))
    got = executor.run(spec, [x, b])[0]
    (kernel,) = [k for k in spec.kernels().values() if k is not None]
    assert f"fz_vml_{op}f(" in kernel.source
    expected = getattr(torch, op)(x + b)
    same = (got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())
    assert bool(same.all()), (int((~same).sum()), got[~same][:4], expected[~same][:4])


@pytest.mark.parametrize("intel,setting,used", [(True, "", True), (False, "", False), (False, "1", True),
                                                 (True, "0", False)])
def test_vml_is_used_on_intel_processors_or_when_asked(intel, setting, used, monkeypatch):
    """Kernels call VML on Intel processors (MKL's tuned paths), elsewhere only with FUSER_CPU_VML=1, nowhere with
    FUSER_CPU_VML=0; and then for the ops the bitwise probe finds."""
    monkeypatch.setattr(vml, "_found", [])
    monkeypatch.setattr(vml, "intel", lambda: intel)
    monkeypatch.setenv("FUSER_CPU_VML", setting)
    assert vml.eager_ops() == (vml._probe() if used else ())


def test_the_vml_probe_runs_outside_a_callers_fake_tensor_mode(monkeypatch):
    """The first CPU kernel build may come under a tracer's fake-tensor mode: the probe still runs on real tensors
    and gives what it gives outside (kernels of the process then agree whoever built first)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    outside = vml._probe()
    monkeypatch.setattr(vml, "_found", [])
    monkeypatch.setenv("FUSER_CPU_VML", "1")
    with FakeTensorMode():
        assert vml.eager_ops() == outside


_CHILD_GONE = r"""
import os, shutil, sys, torch, fuser
g = torch.parse_ir('''graph(%x : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::add(%x, %b, %one)
  %t : Tensor = aten::OP(%y)
  %r : Tensor = aten::mul(%t, %y)
  return (%r)''')
x, b = torch.linspace(-3, 3, 4000).view(40, 100), torch.linspace(-1, 1, 100)
ok = []
for op, where in (("tanh", sys.argv[1]), ("sigmoid", sys.argv[2])):
    os.environ["FUSER_CACHE_DIR"] = where
    out = fuser.debug_launch_graph(torch.parse_ir(str(g).replace("aten::OP", "aten::" + op)), [x, b])[0]
    ok.append(torch.allclose(out, getattr(torch, op)(x + b) * (x + b)))
    shutil.rmtree(where)
print(int(all(ok)), fuser.n_compiled_kernels())
"""


@needs_vectors
def test_a_removed_cache_directory_gets_a_new_toolchain(tmp_path):
    """The vector header lives in the disk cache's directory; when that directory goes while the process runs (the
    benchmark's cold caches are removed after each run) the next vector kernel makes the toolchain again in the
    directory now named, rather than failing to find the header."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("FUSER_DISABLE_CACHE", None)
    r = subprocess.run([sys.executable, "-c", _CHILD_GONE, str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "2"]
