"""Test helpers: one-op graphs generated from the op table, inputs with NaN/inf, eager references."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from fuser import ops
from fuser.ts_ir import lower

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# constant values for Scalar arguments, by argument name (others get 0.75)
_SCALARS = {"alpha": 2, "value": 2, "min_val": -0.5, "max_val": 0.5, "min": -0.5, "max": 0.5,
            "threshold": 0.1, "weight": 0.3, "exponent": 2.0, "self": 1.5, "other": -0.75}


@dataclass(frozen=True)
class Case:
    """One way of calling one op: which args are tensors, float graph inputs, or constants."""

    op: str
    schema: str
    variant: Optional[str] = None
    scalars_as_inputs: bool = False  # Scalar args become `float` graph inputs (kernel arguments)
    none_args: tuple[str, ...] = ()  # optional args passed as None

    @property
    def id(self) -> str:
        s = torch._C.parse_schema(self.schema)
        parts = [self.op, s.overload_name or "default"]
        if self.variant:
            parts.append(self.variant)
        if self.scalars_as_inputs:
            parts.append("floatarg")
        if self.none_args:
            parts.append("none_" + "_".join(self.none_args))
        return "-".join(parts)


# grad_fn.name() of a fused group's backward: the Python autograd Function's, or the native hot path's node
FUSED_BACKWARD = ("_FusedGroupBackward", "FusedGroupBackward")


def cases() -> list[Case]:
    out = []
    for op in ops._OPS:
        if op.concat:  # a list argument: tests/test_concat.py
            continue
        for schema in op.schemas:
            s = torch._C.parse_schema(schema)
            types = [str(a.type) for a in s.arguments]
            for variant in op.exprs:
                out.append(Case(op.name, schema, variant))
                if "Scalar" in types:
                    out.append(Case(op.name, schema, variant, scalars_as_inputs=True))
                optional = [a.name for a in s.arguments if str(a.type) == "Optional[number]"]
                for name in optional:
                    out.append(Case(op.name, schema, variant, none_args=(name,)))
    return out


@dataclass
class Built:
    graph: torch._C.Graph
    tensor_args: list[str]  # names of tensor arguments, in graph-input order
    float_args: list[str]  # names of float arguments, after the tensors
    call_args: dict  # argument name -> ("tensor", name) | ("float", name) | ("const", value)
    schema: torch._C.FunctionSchema


def build(case: Case) -> Built:
    s = torch._C.parse_schema(case.schema)
    inputs, consts, call, tensors, floats = [], [], {}, [], []
    for a in s.arguments:
        t = str(a.type)
        if t in ("Tensor", "Optional[Tensor]"):
            tensors.append(a.name)
            call[a.name] = ("tensor", a.name)
        elif t == "str":
            consts.append(f'  %{a.name} : str = prim::Constant[value="{case.variant}"]()')
            call[a.name] = ("const", case.variant)
        elif a.name in case.none_args or (t.startswith("Optional[") and t != "Optional[number]"):
            # rand_like's tensor options (dtype, layout, device...): not a number's place
            consts.append(f"  %{a.name} : NoneType = prim::Constant()")
            call[a.name] = ("const", None)
        elif t == "bool":  # the cast's non_blocking
            consts.append(f"  %{a.name} : bool = prim::Constant[value=0]()")
            call[a.name] = ("const", False)
        elif case.scalars_as_inputs:
            floats.append(a.name)
            call[a.name] = ("float", a.name)
        else:
            v = _SCALARS.get(a.name, 0.75)
            ty = "int" if isinstance(v, int) else "float"
            consts.append(f"  %{a.name} : {ty} = prim::Constant[value={v}]()")
            call[a.name] = ("const", v)
    inputs = [f"%{n} : Tensor" for n in tensors] + [f"%{n} : float" for n in floats]
    args = ", ".join(f"%{a.name}" for a in s.arguments)
    text = (f"graph({', '.join(inputs)}):\n" + "\n".join(consts) + ("\n" if consts else "")
            + f"  %r : Tensor = {s.name}({args})\n  return (%r)\n")
    return Built(torch.parse_ir(text), tensors, floats, call, s)


def special_values(dtype: torch.dtype) -> list[float]:
    if dtype.is_floating_point:
        return [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.0, -1.0, 0.5]
    return [0, 1, -1]


def random_tensor(shape, dtype, device="cpu", specials=True, gen=None) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen).to(device) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
        if specials and t.numel() >= 16:
            flat = t.view(-1)
            vals = special_values(dtype)
            idx = torch.randperm(flat.numel(), generator=gen)[: len(vals)]
            flat[idx] = torch.tensor(vals, dtype=torch.float64)
        return t.to(dtype).to(device)
    return torch.randint(-5, 6, shape, generator=gen).to(dtype).to(device)


def make_args(b: Built, dtype, shape=(37, 29), device="cpu", gen=None, cond_dtype=torch.bool):
    tensors = {}
    for n in b.tensor_args:
        if n == "condition":
            tensors[n] = random_tensor(shape, cond_dtype, device, gen=gen)
        else:
            tensors[n] = random_tensor(shape, dtype, device, gen=gen)
    floats = {n: _SCALARS.get(n, 0.75) * 1.0 for n in b.float_args}
    graph_args = [tensors[n] for n in b.tensor_args] + [floats[n] for n in b.float_args]
    return graph_args, tensors, floats


def eager(b: Built, tensors: dict, floats: dict):
    """The op called directly through torch.ops (independent of the fuser and the graph)."""
    s = b.schema
    name = s.name.split("::")[1]
    fn = getattr(getattr(torch.ops.aten, name), s.overload_name or "default")
    pos, kw = [], {}
    for a in s.arguments:
        kind, v = b.call_args[a.name]
        val = tensors[v] if kind == "tensor" else floats[v] if kind == "float" else v
        if a.kwarg_only:
            kw[a.name] = val
        else:
            pos.append(val)
    out = fn(*pos, **kw)
    if name == "gelu" and kw.get("approximate", "none") == "none" and out.device.type == "cpu":
        out = _gelu_at_inf_as_scalar(pos[0], out)
    return out


def _gelu_at_inf_as_scalar(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """eager's CPU gelu (erf form) at +inf as its scalar path gives it: inf. torch 2.13's AVX-512 vector kernel gives
    NaN there in float32 and bfloat16 (seen on an AMD EPYC with AVX-512, 2026-11-25; the same call on one element,
    in float64, on AVX2 and on CUDA gives inf), so the reference would depend on the machine's vector width. The
    fused kernels give inf."""
    pinf = x == float("inf")
    if not bool((pinf & out.isnan()).any()):
        return out
    return torch.where(pinf, torch.full_like(out, float("inf")), out)


def trip_sums_fit(n_sums: int, cols: int) -> bool:
    """Whether the current CUDA device's shared memory a block (its opt-in limit, less the kernel's own kilobyte)
    holds ``n_sums`` float32 column sums of rows of ``cols`` elements: where it does, a row of several trips sums its
    columns in its row kernel (fuser.rows.shape.CudaShape.trip_sums; an H100 or H200 does so at 16384 elements)."""
    optin = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    return optin - 1024 >= n_sums * cols * 4


def tolerances(dtype: torch.dtype) -> dict:
    return {
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
        torch.float32: dict(rtol=2e-5, atol=2e-5),
        torch.float64: dict(rtol=1e-10, atol=1e-10),
    }.get(dtype, dict(rtol=0, atol=0))


def assert_same(actual: torch.Tensor, expected: torch.Tensor, dtype=None) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.device == expected.device
    tol = tolerances(dtype or expected.dtype)
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)


def check_scalar_rounding(dtype: torch.dtype, device: str) -> None:
    """Values next to a scalar that is not representable in ``dtype``: discrete results (comparisons,
    threshold) depend on whether eager rounds the scalar first; the fused kernel must decide as eager does."""
    from fuser import executor
    from fuser.kernel_cache import STORE
    base = torch.tensor(0.1, dtype=dtype)
    vals = [base, torch.nextafter(base.float(), torch.tensor(1.0)).to(dtype),
            torch.nextafter(base.float(), torch.tensor(0.0)).to(dtype)]
    x = torch.stack(vals * 11).to(device)
    for op in ("eq", "ne", "lt", "le", "gt", "ge"):
        g = torch.parse_ir(f"""
        graph(%x : Tensor):
          %s : float = prim::Constant[value=0.1]()
          %r : Tensor = aten::{op}(%x, %s)
          return (%r)
        """)
        key = STORE.register(lower(g))
        out = executor.run(STORE.get(key), [x])
        assert out is not None
        expected = getattr(torch, op)(x, 0.1)
        assert torch.equal(out[0], expected), (op, x, out[0], expected)
    g = torch.parse_ir("""
    graph(%x : Tensor):
      %t : float = prim::Constant[value=0.1]()
      %v : float = prim::Constant[value=2.]()
      %r : Tensor = aten::threshold(%x, %t, %v)
      return (%r)
    """)
    key = STORE.register(lower(g))
    out = executor.run(STORE.get(key), [x])
    assert out is not None
    assert torch.equal(out[0], torch.threshold(x, 0.1, 2.0)), (x, out[0])


def assert_same_comparison(actual: torch.Tensor, expected: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor):
    """A fused comparison of values the group computed: equal to eager's except where its operands are within
    their dtype's tolerance of each other (there a 1-ulp difference in a fused intermediate may flip it)."""
    assert actual.dtype == expected.dtype == torch.bool and actual.shape == expected.shape
    tol = tolerances(lhs.dtype)
    near = (lhs.double() - rhs.double()).abs() <= tol["atol"] + tol["rtol"] * rhs.double().abs()
    bad = (actual != expected) & ~near
    assert not bool(bad.any()), f"{int(bad.sum())} comparisons differ from eager away from ties"


# a small group used by the executor tests on both backends: a float argument, a broadcastable pair, a comparison
SIGMOID_GT_IR = """
graph(%x : Tensor, %y : Tensor, %s : float):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::add(%a, %s, %one)
  %c : Tensor = aten::sigmoid(%b)
  %d : Tensor = aten::gt(%c, %x)
  return (%c, %d)
"""


def sigmoid_gt_reference(x, y, s):
    c = torch.sigmoid(x * y + s)
    return c, c > x


# dropout as a group: rand_like beside float arguments (p, then the scale); returns (z, r)
DROPOUT_IR = """graph(%x : Tensor, %p : float, %scale : float):
  %none : NoneType = prim::Constant()
  %r : Tensor = aten::rand_like(%x, %none, %none, %none, %none, %none)
  %m : Tensor = aten::gt(%r, %p)
  %t : Tensor = aten::type_as(%m, %x)
  %y : Tensor = aten::mul(%t, %x)
  %z : Tensor = aten::mul(%y, %scale)
  return (%z, %r)
"""


def expect_fused(case: Case, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """False only where the op table has no integer expression for an integer computation."""
    from fuser import ops
    op = ops.OPS_BY_NAME[case.op]
    if dtype.is_floating_point or expected.dtype.is_floating_point:
        return True
    return op.template(case.variant, "i") is not None


def check_op_against_eager(case: Case, dtype: torch.dtype, device: str = "cpu", shape=(37, 29)) -> None:
    """One op-table entry end to end on ``device`` against eager, on inputs from the per-test seed (conftest):
    where eager raises, the fused path raises the same kind of error; where the op fuses (:func:`expect_fused`)
    the group's kernel runs, not the fallback; either way ``run_fusion`` gives eager's result."""
    import fuser
    from fuser import executor
    from fuser.kernel_cache import STORE
    b = build(case)
    key = STORE.register(lower(b.graph))
    gen = torch.Generator().manual_seed(int(torch.randint(2 ** 31, ())))
    args, tensors, floats = make_args(b, dtype, shape=shape, device=device, gen=gen)
    try:
        expected = eager(b, tensors, floats)
    except Exception as e:  # eager rejects it: the fused path must raise the same kind of error
        with pytest.raises(type(e)):
            fuser.run_fusion(key, args)
        return
    out = executor.run(STORE.get(key), args)
    if expect_fused(case, expected, dtype):
        assert out is not None, f"{case.id} on {dtype} fell back"
        assert_op_result(case, out[0], expected)
    else:
        assert out is None
    assert_op_result(case, fuser.run_fusion(key, args)[0], expected)


def run_in_threads(n: int, fn) -> list:
    """``fn()`` in ``n`` threads released together (a barrier): their results, in thread order; no thread may
    raise."""
    import threading
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def worker(i):
        try:
            barrier.wait()
            results[i] = fn()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def fused_graph(fn) -> torch._C.Graph:
    """The graph of ``fn`` after the pass, before lowering (prim::FusionGroup nodes visible)."""
    from fuser import graph_fuser
    g = torch.jit.script(fn).graph.copy()
    torch._C._jit_pass_inline(g)
    graph_fuser.fuse_graph(g)
    g.lint()
    return g


# ops that eager computes with one rounding (a fused multiply-add) on CPU and CUDA; (IR body, eager function)
FMA_OPS = {
    "add_alpha": ("%r : Tensor = aten::add(%x, %y, %k)", lambda x, y, z: torch.add(x, y, alpha=-2.5)),
    "sub_alpha": ("%r : Tensor = aten::sub(%x, %y, %k)", lambda x, y, z: torch.sub(x, y, alpha=-2.5)),
    "addcmul": ("%r : Tensor = aten::addcmul(%x, %y, %z, %k)", lambda x, y, z: torch.addcmul(x, y, z, value=-2.5)),
    "lerp_tensor": ("%r : Tensor = aten::lerp(%x, %y, %z)", lambda x, y, z: torch.lerp(x, y, z)),
    "lerp_scalar": ("%r : Tensor = aten::lerp(%x, %y, %w)", lambda x, y, z: torch.lerp(x, y, 0.3)),
}


def check_fused_multiply_adds(op: str, dtype: torch.dtype, device: str) -> None:
    """Bit-equal to eager on fresh random values (a separate multiply and add differ in the last bit for
    about a quarter of them), and finite where only the product overflows, as eager is."""
    from fuser import executor
    from fuser.kernel_cache import STORE
    body, ref = FMA_OPS[op]
    g = torch.parse_ir(f"""
    graph(%x : Tensor, %y : Tensor, %z : Tensor):
      %k : float = prim::Constant[value=-2.5]()
      %w : float = prim::Constant[value=0.3]()
      {body}
      return (%r)
    """)
    key = STORE.register(lower(g))
    n = 1 << 14
    x, y = torch.randn(n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device) * 3
    z = torch.rand(n, dtype=dtype, device=device) * 1.4 - 0.2
    big = torch.finfo(dtype).max / 2
    if op.startswith("lerp"):  # end - self overflows only in the product's absence: not for lerp; cancellation
        x[:3], y[:3] = 1.0, 1.0 + 2 ** -10
    else:  # -big + (-2.5 * y) with y = -big/2: the product overflows, the sum does not
        x[:3], y[:3], z[:3] = -big, (big * 0.4 if op == "add_alpha" else -big * 0.4), 1.0
        if op == "addcmul":
            y[:3], z[:3] = 0.4, big
    out = executor.run(STORE.get(key), [x, y, z])
    assert out is not None, f"{op} fell back"
    expected = ref(x, y, z)
    bad = ~((out[0] == expected) | (out[0].isnan() & expected.isnan()))
    assert not bool(bad.any()), (op, int(bad.sum()), out[0][bad][:4], expected[bad][:4])
    if not op.startswith("lerp"):
        assert bool(expected[:3].isfinite().all())


def assert_op_result(case: Case, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """:func:`assert_same`, except for random ops, whose numbers are not eager's: there the same dtype, shape
    and device, and values in [0, 1) (tests/test_random.py checks the distribution)."""
    if ops.OPS_BY_NAME[case.op].random:
        assert (actual.dtype, actual.shape, actual.device) == (expected.dtype, expected.shape, expected.device)
        assert bool(((actual >= 0) & (actual < 1)).all())
        return
    assert_same(actual, expected)


# the CUDA fuzz campaigns' findings: tests/test_cuda_emulated.py runs them emulated, tests/test_gpu.py on a GPU
NARROW_COMPARE_IR = """graph(%t0 : Tensor, %t1 : Tensor):
  %v0 : Tensor = aten::le(%t1, %t0)
  %v1 : Tensor = aten::gt(%t1, %t0)
  return (%v0, %v1)"""
INT_ABS_ERFC_IR = """graph(%t0 : Tensor):
  %v0 : Tensor = aten::abs(%t0)
  %v1 : Tensor = aten::erfc(%v0)
  return (%v0, %v1)"""
NAN_COMPARE_IR = """graph(%t0 : Tensor):
  %v0 : Tensor = aten::sinh(%t0)
  %v1 : Tensor = aten::hardswish(%v0)
  %v2 : Tensor = aten::abs(%v1)
  %c : float = prim::Constant[value=-0.25]()
  %v3 : Tensor = aten::ge(%v2, %c)
  %v4 : Tensor = aten::gt(%v2, %c)
  %v5 : Tensor = aten::neg(%v2)
  %v6 : Tensor = aten::le(%v5, %c)
  %v7 : Tensor = aten::lt(%v5, %c)
  return (%v3, %v4, %v6, %v7, %v1)"""


def interpret(graph, args) -> list:
    """The graph run op by op by TorchScript's own interpreter: a reference independent of fuser's fallback."""
    out = torch._C._jit_interpret_graph(graph, tuple(args))
    return list(out) if isinstance(out, tuple) else [out]

# the sixth CUDA campaign (seed 3082817118): pow(x, -2) is 1 / (x * x) in eager, 0 where x * x overflows (graph 7865);
# a NaN made from constants compared with itself (ptxas took v != v as false; graph 11838)
POW_MINUS_TWO_IR = """graph(%t0 : Tensor):
  %v0 : Tensor = aten::rsqrt(%t0)
  %c1_1 : float = prim::Constant[value=-2.0]()
  %v1 : Tensor = aten::pow(%v0, %c1_1)
  %v2 : Tensor = aten::log10(%v1)
  %v3 : Tensor = aten::atan(%v2)
  return (%v3)"""
# the CUDA fuzzer, 2026-11-27 (seed 1067035713, graph 1106): threshold of -|NaN| gave the value, not NaN (ptxas took
# -fabsf(NaN) <= 1.f as true)
NAN_THRESHOLD_IR = """graph(%t0 : Tensor):
  %v0 : Tensor = aten::acos(%t0)
  %v1 : Tensor = aten::abs(%v0)
  %v2 : Tensor = aten::neg(%v1)
  %c3_1 : int = prim::Constant[value=1]()
  %c3_2 : int = prim::Constant[value=-1]()
  %v3 : Tensor = aten::threshold(%v2, %c3_1, %c3_2)
  return (%v3)"""
NAN_SELF_NE_IR = """graph(%t0 : Tensor):
  %v0 : Tensor = aten::lt(%t0, %t0)
  %c1_1 : int = prim::Constant[value=0]()
  %v1 : Tensor = aten::div(%v0, %c1_1)
  %v2 : Tensor = aten::ne(%v1, %v1)
  %v3 : Tensor = aten::eq(%v1, %v1)
  return (%v2, %v3)"""


# float16/bfloat16 rounding per op (tests/test_rounding.py, tests/test_gpu.py)
# (x * y + z).sigmoid() * w - x / y: every op's result is stored by eager
CHAIN_IR = """graph(%x : Tensor, %y : Tensor, %z : Tensor, %w : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::add(%a, %z, %one)
  %c : Tensor = aten::sigmoid(%b)
  %d : Tensor = aten::mul(%c, %w)
  %e : Tensor = aten::div(%x, %y)
  %f : Tensor = aten::sub(%d, %e, %one)
  return (%f)"""

# the findings the README listed as a known limitation while intermediates were held unrounded (CUDA fuzz
# campaigns): float16 gelu(-6e-8) is -0.0 in eager, so x / 0 is NaN; float16 lgamma(30400) is inf in eager, so
# lgamma * 0 is NaN; float16 sinh(x + 4) at x = 7.785 reads x + 4 rounded to 11.78125; bfloat16 exp(sqrt(7872))
# reads sqrt rounded to 88.5
EDGE_IRS = {
    "gelu_of_a_tiny_negative_over_zero": ("""graph(%x : Tensor):
  %none : str = prim::Constant[value="none"]()
  %zero : float = prim::Constant[value=0.]()
  %g : Tensor = aten::gelu(%x, %none)
  %r : Tensor = aten::div(%g, %zero)
  return (%r)""", torch.float16, [-6e-8, 1.0, -3.0, 0.0]),
    "lgamma_past_float16_max_times_zero": ("""graph(%x : Tensor):
  %zero : float = prim::Constant[value=0.]()
  %g : Tensor = aten::lgamma(%x)
  %r : Tensor = aten::mul(%g, %zero)
  return (%r)""", torch.float16, [30400.0, 3.0, 0.5]),
    "sinh_of_a_rounded_sum": ("""graph(%x : Tensor):
  %four : float = prim::Constant[value=4.]()
  %one : int = prim::Constant[value=1]()
  %s : Tensor = aten::add(%x, %four, %one)
  %r : Tensor = aten::sinh(%s)
  return (%r)""", torch.float16, [7.785, -2.5, 0.125]),
    "exp_of_a_rounded_sqrt": ("""graph(%x : Tensor):
  %s : Tensor = aten::sqrt(%x)
  %r : Tensor = aten::exp(%s)
  return (%r)""", torch.bfloat16, [7872.0, 4.0, 0.5]),
}

# (x * 1000) * 0.001 marked as steps of one eager op: held in float, 100 stays 100 (rounded, 1e5 would be inf)
STEPS_IR = """graph(%x : Tensor):
  %k : float = prim::Constant[value=1000.]()
  %m : float = prim::Constant[value=0.001]()
  %a : Tensor = aten::mul[fuser_origin="aten::some_op"](%x, %k)
  %r : Tensor = aten::mul(%a, %m)
  return (%r)"""


def chain_tolerance(x, y, z, w) -> torch.Tensor:
    """Per element, what CHAIN_IR may differ from eager by when only its sigmoid may be one unit of the dtype off:
    a unit of the sigmoid's product (the subtraction after it may cancel) and a unit of the result (that unit may
    flip the subtraction's rounding), nothing of the exact arithmetic."""
    d = torch.sigmoid(x * y + z) * w
    f = d - x / y
    return 2 * torch.finfo(x.dtype).eps * (d.float().abs() + f.float().abs())


# CHAIN_IR without its sigmoid: IEEE-exact in float before each rounding, so eager's bits on every device
ARITH_IR = """graph(%x : Tensor, %y : Tensor, %z : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::add(%a, %z, %one)
  %c : Tensor = aten::div(%b, %y)
  %d : Tensor = aten::sub(%c, %x, %one)
  return (%d)"""


def fused_run(spec, args) -> list:
    """The outputs of ``executor.run(spec, args)``, which must run the group's kernel, not fall back (else the
    assertion says the plan's reason)."""
    from fuser import executor
    out = executor.run(spec, args)
    assert out is not None, executor.plan(spec, args)
    return out


def check_against_float64(outs, eager, args, tol: dict) -> None:
    """``outs`` against eager's ``eager(*args)`` (dtypes and shapes exactly) and, in value, eager run in float64
    (within ``tol[dtype]``, relative to the outputs' magnitude)."""
    ref = eager(*args)
    ref64 = eager(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    assert len(outs) == len(ref)
    for o, r, r64 in zip(outs, ref, ref64):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        t = tol[r.dtype]
        scale = max(1.0, r64.abs().max().item()) if r64.numel() else 1.0
        torch.testing.assert_close(o.double(), r64, rtol=t, atol=t * scale)


def row_kernels(spec) -> list:
    """The row kernels (fuser/rows/launch.py) ``spec`` has built."""
    from fuser.rows import launch
    return [k for k in spec.kernels().values() if isinstance(k, launch.RowKernel)]


def row_kernels_on_both(group, args) -> list:
    """The outputs of ``group``'s CPU row kernel and of its CUDA one through the host emulation (fuser/rows/); both
    must run fused (the plan says why not)."""
    from fuser import rows
    from fuser.kernel_cache import STORE
    from fuser.rows import emulate as row_emulate
    spec = STORE.get(STORE.register(group))
    cpu = fused_run(spec, args)
    cuda = row_emulate.run(group, args)
    if any(n.op == "aten::rms_norm" for n in group.nodes) and any(  # float64: eager's CUDA kernel differs on inf
            isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
        assert cuda is None and "rms_norm on CUDA in float64" in rows.plan(spec, args, "cuda")
        return [cpu]
    assert cuda is not None, rows.plan(spec, args, "cuda")
    return [cpu, cuda]


# ---- written-out reductions shared by tests/test_reductions.py and tests/test_reduction_grad.py

REDUCE_OPS = {"sum": "aten::sum.dim_IntList", "mean": "aten::mean.dim", "amax": "aten::amax", "amin": "aten::amin"}
REDUCE_EAGER = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}


def reduce_node(b, kind: str, x, dims, keepdim, dtype=None):
    """A reduction node of ``kind`` over ``dims`` (sum and mean take a dtype argument, None by default)."""
    args = (x, tuple(dims), keepdim) + ((dtype,) if kind in ("sum", "mean") else ())
    return b.add(REDUCE_OPS[kind], *args)


def reduction_alone(kind: str, dims, keepdim: bool):
    """(group builder, eager): one reduction of ``kind`` over ``dims`` of the one input."""
    from fuser import ir

    def group():
        b = ir.Builder()
        x = b.input()
        return b.build([reduce_node(b, kind, x, dims, keepdim)])

    def eager(x):
        return [REDUCE_EAGER[kind](x, dim=tuple(dims), keepdim=keepdim)]

    return group, eager


def affine_sums():
    """(group builder, eager): the sum and the mean over the last dim of x * w + b (keepdim off; w and b broadcast
    along the rows)."""
    from fuser import ir

    def group():
        b = ir.Builder()
        x, w, c = b.input(), b.input(), b.input()
        y = b.call("aten::add", b.call("aten::mul", x, w), c, 1)
        return b.build([reduce_node(b, "sum", y, (-1,), False), reduce_node(b, "mean", y, (-1,), False)])

    def eager(x, w, c):
        y = x * w + c
        return [y.sum(-1), y.mean(-1)]

    return group, eager


def decomposed_group(kind: str, normalized: tuple):
    """A group of fuser/rows/decompose.py's steps for ``kind``: softmax or log_softmax over the last dim, or
    layer_norm over ``normalized`` with a weight and a bias (eps 1e-5)."""
    from fuser import ir
    from fuser.rows import decompose
    b = ir.Builder()
    x = b.input()
    if kind == "layer_norm":
        w, c = b.input(), b.input()
        return b.build([decompose.layer_norm(b, x, normalized, w, c, 1e-5)])
    return b.build([getattr(decompose, kind)(b, x, -1)])


def written_softmax():
    """(group builder, eager): softmax over the last dim written out (amax, exp(x - max), its sum, the quotient),
    and the row sums (keepdim) as a second output."""
    from fuser import ir

    def group():
        b = ir.Builder()
        x = b.input()
        m = reduce_node(b, "amax", x, (-1,), True)
        e = b.call("aten::exp", b.call("aten::sub", x, m, 1))
        s = reduce_node(b, "sum", e, (-1,), True)
        return b.build([b.call("aten::div", e, s), s])

    def eager(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        s = e.sum(-1, keepdim=True)
        return [e / s, s]

    return group, eager


def written_layer_norm():
    """(group builder, eager): layer norm over the last dim written out, eps a float input, weight and bias
    broadcast; the mean and rstd (row-level, keepdim) are outputs too."""
    from fuser import ir

    def group():
        b = ir.Builder()
        x, w, c, eps = b.input(), b.input(), b.input(), b.input(ir.FLOAT)
        mu = reduce_node(b, "mean", x, (-1,), True)
        d = b.call("aten::sub", x, mu, 1)
        var = reduce_node(b, "mean", b.call("aten::mul", d, d), (-1,), True)
        r = b.call("aten::rsqrt", b.call("aten::add", var, eps, 1))
        y = b.call("aten::add", b.call("aten::mul", b.call("aten::mul", d, r), w), c, 1)
        return b.build([y, mu, r])

    def eager(x, w, c, eps):
        mu = x.mean(-1, keepdim=True)
        d = x - mu
        r = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
        return [d * r * w + c, mu, r]

    return group, eager


# ---- backward groups under test (tests/test_reduction_grad.py, tests/test_norm_grad.py)

def record_backward_runs(monkeypatch) -> list:
    """The backward groups that run as kernels from now on (their specs), for a fixture: every ``executor.run`` of
    a backward group that returned outputs (None: the fallback ran it). A backward of a sum alone is pointwise
    (the gradient broadcast back); one with a reduction in it (softmax's, a mean's count) is a row kernel."""
    from fuser import executor
    from fuser.backward import _backward_keys
    ran = []
    real = executor.run

    def run(spec, args, rng_state=None):
        out = real(spec, args, rng_state)
        if out is not None and spec.key in _backward_keys:
            ran.append(spec)
        return out

    monkeypatch.setattr(executor, "run", run)
    return ran


def row_backward_keys(backwards) -> set:
    """The keys of the backward groups in ``backwards`` (from :func:`record_backward_runs`) that ran as row
    kernels (a column group that sums a broadcast input's gradient, fuser/grad_sums.py, is not one)."""
    from fuser.grad_sums import column_keys
    return {s.key for s in backwards if s.has_reduction and s.key not in column_keys}


def backward_and_args(spec, inputs: list, eager_fn):
    """The backward of group ``spec`` for ``inputs`` (its float tensors require grad): (bw, its arguments, eager's
    gradients of ``eager_fn`` for the same random output gradients), for running the backward group by itself
    (the CUDA host emulation)."""
    from fuser import autodiff
    args = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in inputs]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    ref = eager_fn(*args)
    grads = [torch.randn_like(r) for r in ref]
    want = torch.autograd.grad(ref, tensors, grads)
    needs = tuple(isinstance(a, torch.Tensor) for a in args)
    sig = tuple((t.dtype, t.dim() == 0) for t in tensors)
    bw = autodiff.backward_for(spec, needs, spec.all_outputs_defined, sig)
    assert bw is not None and bw.spec.has_reduction
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    outputs = {k: r.detach() for k, r in enumerate(ref)}  # (eager's: a backward that reads a forward output)
    return bw, autodiff.backward_args(spec, bw, detached, grads, [t.shape for t in tensors], outputs), want


def train_block_alongside_eager(block, eager_block, device: str = "cpu", rtol: float = 1e-4, atol: float = 1e-6):
    """12 SGD steps of a transformer block (x, wq, wk, wv, wo, g1, b1, w1, c1, w2, c2, g2, b2: dim 32, hidden 64),
    ``block`` (fused) beside ``eager_block`` from the same parameters on the same batches: each step's loss within
    ``rtol`` (and ``atol``) of eager's, the parameters after it within ``rtol`` and ``10 * atol``. Returns the
    fused side's parameters and a batch (for ``fuser.graph_for``)."""
    batch, seq, dim, hidden, steps = 4, 16, 32, 64, 12

    def w(*s):
        return torch.randn(*s) * (1 / s[0] ** 0.5)

    params = [w(dim, dim), w(dim, dim), w(dim, dim), w(dim, dim), 1 + 0.1 * torch.randn(dim), 0.1 * torch.randn(dim),
              w(dim, hidden), 0.1 * torch.randn(hidden), w(hidden, dim), 0.1 * torch.randn(dim),
              1 + 0.1 * torch.randn(dim), 0.1 * torch.randn(dim), w(dim, 1)]
    mine = [p.clone().to(device).requires_grad_() for p in params]
    ref = [p.clone().to(device).requires_grad_() for p in params]
    xs = torch.randn(steps, batch, seq, dim).to(device)
    target = torch.randn(steps, batch, seq, 1).to(device)
    opt_m, opt_r = torch.optim.SGD(mine, lr=0.05), torch.optim.SGD(ref, lr=0.05)
    for step in range(steps):
        losses = []
        for fn, p, opt in ((block, mine, opt_m), (eager_block, ref, opt_r)):
            y = fn(xs[step], *p[:-1])
            loss = ((y @ p[-1] - target[step]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=rtol, abs=atol), (step, losses)
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=10 * atol)
    return mine, xs[0]


class SumsWatch:
    """The column groups (fuser/grad_sums.py) and fused row backwards (sums inside the row kernel) that ran as
    kernels, and the calls of sum_to_size, from now on (a fixture's monkeypatch)."""

    def __init__(self, monkeypatch):
        self.columns, self.fused, self.sum_to_size = [], [], 0
        self._native = self._native_fused()
        from fuser import executor, grad_sums
        real_run, real_sum = executor.run, torch.Tensor.sum_to_size

        def run(spec, args, rng_state=None):
            out = real_run(spec, args, rng_state)
            if out is not None and spec.key in grad_sums.column_keys:
                self.columns.append(spec)
            if out is not None and spec.key in grad_sums.fused_keys:
                self.fused.append(spec)
            return out

        def sum_to_size(t, *shape):
            self.sum_to_size += 1
            return real_sum(t, *shape)

        monkeypatch.setattr(executor, "run", run)
        monkeypatch.setattr(torch.Tensor, "sum_to_size", sum_to_size)

    def clear(self):
        self.columns.clear()
        self.fused.clear()
        self.sum_to_size = 0
        self._native = self._native_fused()

    @staticmethod
    def _native_fused() -> tuple[int, int]:
        """Fused row backwards and column groups the native hot path's backward ran (served natively, they launch
        without executor.run; a column group it hands to Python is counted by executor.run too)."""
        from fuser import native
        stats = native.stats()
        return (stats["fused_backwards"], stats["column_sums"]) if stats else (0, 0)

    def summed(self, fused: bool) -> bool:
        """Whether the sums ran as expected: in the fused form where ``fused`` (inside the kernel that computes the
        gradients: a row backward's row kernel, tests/test_row_partial_sums.py, or on CUDA a pointwise backward's
        column kernel), else by one column group after the main group; sum_to_size never."""
        want = (0, 1) if fused else (1, 0)
        fused, columns, _ = self.took()
        return (columns, fused) == want and self.sum_to_size == 0

    def took(self) -> tuple:
        """(fused row kernels, column kernels, sum_to_size calls); through executor.run or the native hot path's
        backward (a column group it launches natively or hands to Python, counted once)."""
        fused, columns = (now - then for now, then in zip(self._native_fused(), self._native))
        return len(self.fused) + fused, max(len(self.columns), columns), self.sum_to_size


def scripted_training_steps(fn, make_args, watch, steps: int = 5):
    """``fn`` through torch.jit.script and the pass, ``steps`` calls on fresh ``make_args()`` (the later ones served
    by the native hot path, whose backward runs the groups that sum a gradient itself where kernels serve them, and
    hands the other backwards to Python): per call (step, output,
    arguments, output gradient, their gradients), ``watch`` (a :class:`SumsWatch`) cleared just before the
    backward."""
    import fuser
    f = fuser.fuse(torch.jit.script(fn))
    for step in range(steps):
        args = make_args()
        y = f(*args)
        gy = torch.randn_like(y)
        watch.clear()
        yield step, y, args, gy, torch.autograd.grad(y, args, gy)


def assert_close_to_float64(got, want64, want, dtype) -> None:
    """Gradients ``got`` against eager's in float64 (``want64``): float32 within its tolerance at the gradient's scale;
    a reduced dtype within twice eager's own error (``want``: eager's in ``dtype``), plus a unit at that scale."""
    for g, w64, w in zip(got, want64, want):
        assert g.dtype == dtype and g.shape == w64.shape, (g.dtype, g.shape, w64.shape)
        scale = max(1.0, w64.abs().max().item())
        if dtype == torch.float32:
            tol = tolerances(dtype)
            torch.testing.assert_close(g.double(), w64, rtol=tol["rtol"], atol=tol["atol"] * scale)
        else:  # bfloat16: within twice eager's own error of float64, plus a unit of bfloat16 at the gradient's scale
            err = (g.double() - w64).abs().max().item()
            eager_err = (w.double() - w64).abs().max().item()
            assert err <= 2 * eager_err + 8e-3 * scale, (err, eager_err)


def ptx_instructions(source: str) -> list[str]:
    """The PTX instructions (sm_90, NVRTC on this machine: no GPU needed, fuser's flags) of the kernel in ``source``,
    one string each, in order."""
    from cuda.bindings import nvrtc

    from fuser.cuda.driver import NvrtcOptions
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    opts = NvrtcOptions(90, cubin=False, fast_compile="", fmad=False).flags()
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    return [ln.strip() for ln in ptx.rstrip(b"\0").decode().splitlines()
            if re.match(r"\s+[a-z@]", ln) and not ln.strip().startswith("//")]


def ptxas_registers(source: str, fmad: bool = False) -> tuple[int, int]:
    """(registers a thread, bytes of spill stores) of the kernel in ``source``, from ptxas for sm_90 through this
    machine's NVRTC (needs no GPU), with the flags fuser compiles its kernels with (``fmad``: contracted, as
    ``fuser.cuda.launch.contracts`` says for the kernel's outputs)."""
    from cuda.bindings import nvrtc

    from fuser.cuda.driver import NvrtcOptions
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    opts = [*NvrtcOptions(90, cubin=True, fast_compile="", fmad=fmad).flags(), b"--ptxas-options=-v"]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()
    spill, regs = re.findall(r"(\d+) bytes spill stores.*?Used (\d+) registers", log.decode(), re.S)[0]
    return int(regs), int(spill)


def op_on_layouts_vs_eager(case: Case, args_fn, dtype: torch.dtype) -> Optional[str]:
    """One op of the table on the CPU over the arguments ``args_fn(built, dtype, gen)`` gives (args, tensors,
    floats), against eager (or eager's error from the fallback); the kernel's source, or None where eager raised."""
    import fuser
    from fuser import executor
    from fuser.kernel_cache import KernelStore
    b = build(case)
    store = KernelStore()
    spec = store.get(store.register(lower(b.graph)))
    gen = torch.Generator().manual_seed(int(torch.randint(2 ** 31, ())))
    args, tensors, floats = args_fn(b, dtype, gen)
    try:
        expected = eager(b, tensors, floats)
    except Exception as e:
        with pytest.raises(type(e)):
            fuser.fallback.run(spec, args)
        return None
    out = executor.run(spec, args)
    assert out is not None, f"{case.id} fell back"
    assert_op_result(case, out[0], expected)
    return next(k for k in spec.kernels().values() if k is not None).source


def on_cuda_aligned_alike(a):
    """``a`` on the GPU with its sizes, strides and address modulo 16 (a view starting an element in stays so)."""
    if not isinstance(a, torch.Tensor):
        return a
    lead = a.data_ptr() % 16 // a.element_size()
    span = 1 + sum((s - 1) * st for s, st in zip(a.shape, a.stride())) if a.numel() else 0
    flat = torch.empty(lead + span, dtype=a.dtype, device="cuda")
    flat[lead:] = a.as_strided((span,), (1,))
    return flat[lead:].as_strided(a.shape, a.stride())
