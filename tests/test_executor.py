"""run_fusion on the CPU backend: shapes, layouts, dtypes and bad input, each against eager."""
import pytest
import torch
from helpers import (SIGMOID_GT_IR as IR, assert_same, assert_same_comparison, check_scalar_rounding,
                     random_tensor, sigmoid_gt_reference as reference)

import fuser
from fuser import executor
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower


def _key():
    return STORE.register(lower(torch.parse_ir(IR)))


def _check(x, y, s=0.25, fused=True):
    key = _key()
    c, d = reference(x, y, s)
    out = executor.run(STORE.get(key), [x, y, s])
    assert (out is not None) == fused
    c2, d2 = fuser.run_fusion(key, [x, y, s])
    assert_same(c2, c)
    assert_same_comparison(d2, d, c, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_same_shape(dtype):
    _check(random_tensor((33, 17), dtype), random_tensor((33, 17), dtype))


@pytest.mark.parametrize("shapes", [((4, 5), (5,)), ((4, 1), (1, 5)), ((3, 1, 6), (2, 1)), ((), (7, 3)),
                                    ((2, 3, 4), (2, 1, 4)), ((1,), (6, 6))])
def test_broadcast(shapes):
    _check(random_tensor(shapes[0], torch.float32), random_tensor(shapes[1], torch.float32))


def test_transposed_sliced_expanded_and_offset_views():
    base = random_tensor((40, 30), torch.float32)
    _check(base.t(), random_tensor((30, 40), torch.float32))
    _check(base[::2, 1::3], random_tensor((20, 10), torch.float32).t().contiguous().t())
    _check(random_tensor((5,), torch.float32).expand(7, 5), random_tensor((7, 5), torch.float32))
    flat = random_tensor((101,), torch.float32)
    _check(flat[1:], flat[:-1])


def test_large_tensor_runs_in_parallel_chunks():
    _check(random_tensor((512, 300), torch.float32), random_tensor((300,), torch.float32))


def test_zero_dim_and_zero_element():
    _check(torch.tensor(0.5), torch.tensor(-2.0))
    key = _key()
    before = fuser.n_compiled_kernels()
    x, y = torch.empty(0, 4), torch.empty(0, 4)
    out = fuser.run_fusion(key, [x, y, 1.0])
    assert [o.shape for o in out] == [torch.Size([0, 4])] * 2
    assert [o.dtype for o in out] == [torch.float32, torch.bool]
    assert fuser.n_compiled_kernels() - before <= 1


@pytest.mark.parametrize("dx,dy", [(torch.int32, torch.float32), (torch.float16, torch.float64),
                                   (torch.int64, torch.int32), (torch.bool, torch.float16),
                                   (torch.bfloat16, torch.float16), (torch.uint8, torch.int8)])
def test_type_promotion_as_eager(dx, dy):
    _check(random_tensor((9, 8), dx), random_tensor((9, 8), dy))


def test_zero_dim_tensor_does_not_promote_like_a_dimensioned_one():
    _check(random_tensor((6, 4), torch.float16), torch.tensor(3.0, dtype=torch.float64))


def test_output_shapes_that_differ_fall_back():
    ir = """
    graph(%x : Tensor, %y : Tensor):
      %a : Tensor = aten::sin(%x)
      %b : Tensor = aten::mul(%a, %y)
      return (%a, %b)
    """
    key = STORE.register(lower(torch.parse_ir(ir)))
    x, y = torch.randn(5), torch.randn(3, 5)
    assert executor.run(STORE.get(key), [x, y]) is None  # `a` has x's shape, not the map's
    a, b = fuser.run_fusion(key, [x, y])
    assert_same(a, x.sin())
    assert_same(b, x.sin() * y)


def test_non_broadcastable_shapes_raise_eagers_error():
    key = _key()
    x, y = torch.randn(3, 4), torch.randn(5)
    with pytest.raises(RuntimeError) as fused_err:
        fuser.run_fusion(key, [x, y, 1.0])
    with pytest.raises(RuntimeError) as eager_err:
        reference(x, y, 1.0)
    # the interpreter prefixes its traceback; eager's own message is what it reports
    assert str(eager_err.value).splitlines()[0] in str(fused_err.value)


def test_mismatched_devices_fall_back_to_eager_error():
    key = _key()
    x, y = torch.randn(3), torch.randn(3, device="meta")
    with pytest.raises(Exception) as fused_err:
        fuser.run_fusion(key, [x, y, 1.0])
    with pytest.raises(Exception) as eager_err:
        reference(x, y, 1.0)
    assert type(fused_err.value) is type(eager_err.value)


def test_complex_falls_back():
    key = _key()
    x = torch.randn(4, dtype=torch.complex64)
    y = torch.randn(4, dtype=torch.complex64)
    assert executor.run(STORE.get(key), [x, y, 0.5]) is None
    with pytest.raises(RuntimeError):  # eager: gt is not supported for complex
        reference(x, y, 0.5)
    with pytest.raises(RuntimeError):
        fuser.run_fusion(key, [x, y, 0.5])


def test_sparse_falls_back():
    ir = """
    graph(%x : Tensor, %y : Tensor):
      %a : Tensor = aten::mul(%x, %y)
      %b : Tensor = aten::mul(%a, %y)
      return (%b)
    """
    key = STORE.register(lower(torch.parse_ir(ir)))
    x = torch.randn(4, 4).to_sparse()
    y = torch.randn(4, 4).to_sparse()
    assert executor.run(STORE.get(key), [x, y]) is None
    out = fuser.run_fusion(key, [x, y])[0]
    assert_same(out.to_dense(), (x * y * y).to_dense())


def test_requires_grad_gives_eagers_gradients():
    key = _key()
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5)
    c, d = fuser.run_fusion(key, [x, y, 0.5])
    assert c.requires_grad
    c.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    reference(x2, y, 0.5)[0].sum().backward()
    assert_same(x.grad, x2.grad)
    with torch.no_grad():
        assert executor.run(STORE.get(key), [x, y, 0.5]) is not None


def test_cpu_fusion_off_uses_the_fallback():
    fuser.override_can_fuse_on_cpu(False)
    assert not fuser.can_fuse_on_cpu()
    key = STORE.register(lower(torch.parse_ir(IR.replace("aten::sigmoid", "aten::tanh"))))
    before = fuser.n_compiled_kernels()
    x, y = torch.randn(8), torch.randn(8)
    c, d = fuser.run_fusion(key, [x, y, 0.1])
    assert fuser.n_compiled_kernels() == before
    assert_same(c, torch.tanh(x * y + 0.1))


def test_float_argument_changes_without_recompiling():
    key = _key()
    x, y = torch.randn(50), torch.randn(50)
    fuser.run_fusion(key, [x, y, 0.0])
    before = fuser.n_compiled_kernels()
    for s in (0.5, -3.0, float("inf"), float("nan")):
        for a, b in zip(fuser.run_fusion(key, [x, y, s]), reference(x, y, s)):
            assert_same(a, b)
    assert fuser.n_compiled_kernels() == before


def test_one_kernel_serves_all_shapes():
    key = _key()
    fuser.run_fusion(key, [torch.randn(10), torch.randn(10), 1.0])
    before = fuser.n_compiled_kernels()
    for n in (1, 7, 1000, 4097):
        _check(torch.randn(n), torch.randn(n))
    _check(torch.randn(3, 5), torch.randn(3, 5))
    assert fuser.n_compiled_kernels() == before


def test_integer_overflow_wraps_like_eager():
    ir = """
    graph(%x : Tensor, %y : Tensor):
      %one : int = prim::Constant[value=1]()
      %a : Tensor = aten::mul(%x, %y)
      %b : Tensor = aten::add(%a, %x, %one)
      return (%b)
    """
    key = STORE.register(lower(torch.parse_ir(ir)))
    x = torch.randint(-128, 127, (100,), dtype=torch.int8)
    y = torch.randint(-128, 127, (100,), dtype=torch.int8)
    out = executor.run(STORE.get(key), [x, y])
    assert out is not None
    assert torch.equal(out[0], x * y + x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scalar_rounding_at_reduced_precision_matches_eager(dtype):
    check_scalar_rounding(dtype, "cpu")


def test_cuda_index_divider_matches_integer_division():
    """The CUDA kernels divide 32-bit indices by host-computed magic numbers; check the arithmetic here."""
    import random
    from fuser.cuda.launch import divider
    rng = random.Random(0)
    for d in [1, 2, 3, 7, 4096, 16383, 65535, 2 ** 31 - 1] + [rng.randrange(1, 2 ** 31) for _ in range(300)]:
        magic, shift = divider(d)
        for n in [0, 1, d - 1, d, d + 1, 2 ** 31 - 1] + [rng.randrange(0, 2 ** 31) for _ in range(50)]:
            if n < 2 ** 31:
                q = (((n * magic) >> 32) + n) >> shift  # no 32-bit overflow: the sum stays below 2n
                assert q == n // d, (n, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op,ref", [
    ("aten::floor(%s)", lambda s: torch.floor(s)), ("aten::ceil(%s)", lambda s: torch.ceil(s)),
    ("aten::trunc(%s)", lambda s: torch.trunc(s)), ("aten::round(%s)", lambda s: torch.round(s)),
    ("aten::frac(%s)", lambda s: torch.frac(s)), ("aten::threshold(%s, %t, %v)", lambda s: torch.threshold(s, 3.0, -1.0)),
    ("aten::remainder(%s, %t)", lambda s: torch.remainder(s, 3.0)), ("aten::fmod(%s, %t)", lambda s: torch.fmod(s, 3.0)),
])
def test_discontinuous_ops_see_intermediates_rounded_as_eager(op, ref, dtype):
    """a + b is 2.99951171875 in float but rounds to 3.0 in float16/bfloat16, as eager stores it: floor,
    threshold, remainder... must jump where eager's do."""
    g = torch.parse_ir(f"""graph(%a : Tensor, %b : Tensor):
      %one : int = prim::Constant[value=1]()
      %t : float = prim::Constant[value=3.]()
      %v : float = prim::Constant[value=-1.]()
      %s : Tensor = aten::add(%a, %b, %one)
      %r : Tensor = {op}
      return (%r)""")
    a = torch.full((40,), 2.0, dtype=dtype)
    b = torch.full((40,), 0.99951171875, dtype=dtype)
    key = STORE.register(lower(g))
    out = executor.run(STORE.get(key), [a, b])
    assert out is not None
    assert torch.equal(out[0], ref(a + b))


def test_type_as_other_does_not_decide_the_shape():
    """Found by the fuzzer: type_as takes only a dtype from `other`, so a smaller `self` keeps its shape."""
    g = torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
      %a : Tensor = aten::type_as(%x, %y)
      %b : Tensor = aten::sin(%a)
      return (%b)""")
    key = STORE.register(lower(g))
    for x, y in ((torch.tensor(0.5), torch.randn(1, 1, dtype=torch.float64)),
                 (torch.randn(3), torch.randn(4, 3, dtype=torch.float16))):
        out = fuser.run_fusion(key, [x, y])[0]
        assert_same(out, torch.sin(x.type_as(y)))


def test_float_arguments_between_tensor_inputs():
    """Graph inputs may interleave tensors and floats (a hand-written graph, a backward graph): each float
    must reach its own use, not the next tensor's."""
    g = torch.parse_ir("""graph(%x : Tensor, %s : float, %y : Tensor, %t : float):
      %one : int = prim::Constant[value=1]()
      %a : Tensor = aten::add(%x, %s, %one)
      %b : Tensor = aten::mul(%a, %y)
      %c : Tensor = aten::sub(%b, %t, %one)
      return (%c)
    """)
    x, y = torch.randn(6, 5), torch.randn(5)
    key = STORE.register(lower(g))
    out = executor.run(STORE.get(key), [x, 0.75, y, -3.5])
    assert out is not None
    assert_same(out[0], (x + 0.75) * y - (-3.5))


@pytest.mark.parametrize("weight", [0.3, 0.7, 2.0, -1.0])
def test_lerp_signed_zeros_as_eager(weight):
    """lerp(x, x, 2.0) at x = -0.0 is +0.0 in eager (end - (end - self) * (1 - w)); atan2 of it tells the sign
    apart (found by the fuzzer: -pi against 0)."""
    g = torch.parse_ir(f"""graph(%x : Tensor, %y : Tensor):
      %w : float = prim::Constant[value={weight}]()
      %a : Tensor = aten::lerp(%x, %y, %w)
      %r : Tensor = aten::atan2(%a, %a)
      return (%r, %a)
    """)
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0])
    x, y = vals.repeat_interleave(4), vals.repeat(4)
    out = executor.run(STORE.get(STORE.register(lower(g))), [x, y])
    assert out is not None
    a = torch.lerp(x, y, weight)
    assert torch.equal(out[1], a) and torch.equal(out[1].signbit(), a.signbit())
    assert_same(out[0], torch.atan2(a, a))


@pytest.mark.parametrize("alpha", ["0", "0.0", "-0.0", "1", "%s"])
@pytest.mark.parametrize("op", ["sub", "rsub"])
def test_sub_alpha_zero_signs_as_eager(op, alpha):
    """eager negates alpha as a Scalar: an int 0 stays +0, a float 0.0 becomes -0.0; the sign of a zero result
    follows (rsub(x, x, 0) at x = -0.0 fed rsqrt, found by the fuzzer: inf against 0)."""
    arg = "%s" if alpha == "%s" else "%k"
    const = "" if alpha == "%s" else (f"  %k : {'int' if '.' not in alpha else 'float'} = "
                                      f"prim::Constant[value={alpha}]()\n")
    g = torch.parse_ir(f"graph(%x : Tensor, %y : Tensor, %s : float):\n{const}"
                       f"  %r : Tensor = aten::{op}(%x, %y, {arg})\n  return (%r)\n")
    vals = torch.tensor([0.0, -0.0, 1.0, -2.0])
    x, y = vals.repeat_interleave(4), vals.repeat(4)
    a = 0.0 if alpha == "%s" else (int(alpha) if "." not in alpha else float(alpha))
    out = executor.run(STORE.get(STORE.register(lower(g))), [x, y, -0.0 if alpha == "%s" else 0.0])
    assert out is not None
    ref = getattr(torch, op)(x, y, alpha=-0.0 if alpha == "%s" else a)
    assert torch.equal(out[0], ref) and torch.equal(out[0].signbit(), ref.signbit()), (out[0], ref)


def _sigmoid_then(op: str):
    """The spec of sigmoid(x) followed by ``op`` with a 0-dim CPU tensor constant %c."""
    g = torch.parse_ir(f"""graph(%x : Tensor):
  %c : Float(requires_grad=0, device=cpu) = prim::Constant[value={{0.25}}]()
  %s : Tensor = aten::sigmoid(%x)
  %t : Tensor = aten::{op}(%s, %c)
  return (%t)""", parse_tensor_constants=True)
    return STORE.get(STORE.register(lower(g)))


def test_type_probe_runs_on_the_arg_specs_device(monkeypatch):
    """The compiler's eager type probe runs on the device the kernel is for (eager's CUDA kernels refuse CPU
    constants its CPU kernels take; tests/test_gpu.py checks those cases on CUDA). The meta device stands in
    for a second device here."""
    from fuser import compiler
    from fuser.descs import ArgSpec, TensorDesc
    spec = _sigmoid_then("mul")
    seen = []
    real = compiler.evaluate
    monkeypatch.setattr(compiler, "evaluate", lambda group, args, **kw: seen.extend(args) or real(group, args, **kw))
    types = compiler.infer_types(spec, ArgSpec("meta", None, (TensorDesc(torch.float16, "dense"),)))
    assert [t.result for t in types] == [torch.float16, torch.float16]
    assert [a.device.type for a in seen] == ["meta"]
    # a value that leaves the probe's device (type_as of a CPU constant) is no kernel's output
    with pytest.raises(RuntimeError):
        compiler.infer_types(_sigmoid_then("type_as"), ArgSpec("meta", None, (TensorDesc(torch.float32, "dense"),)))
