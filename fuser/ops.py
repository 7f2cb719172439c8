"""The one table of fusable ops.

Each entry maps TorchScript schemas to C expression templates, one per compute family:

* ``f``: single-precision math (float32 values, and float16/bfloat16 values, which are computed in float),
* ``d``: double-precision math (float64),
* ``i``: integer and bool math; ``None`` where an integer compute type is not supported (the group then
  falls back, e.g. integer ``fmod`` by zero raises in eager).

The CPU backend also runs ``f`` and ``d`` math on vectors (ATen's ``at::vec::Vectorized``, see
``fuser/cpu/templates.py``): an op's scalar expression serves there unchanged when it calls only functions the
vector header overloads; ``v`` gives a vector form where it does not (a conditional becomes ``fz_vsel``).

Templates are :class:`string.Template` texts. ``$a $b $c $d`` are the node's inputs in schema order, already
converted to the node's compute type (``$na``... the same negated as eager negates a Scalar: an int 0
stays +0); ``$T`` is that C type. Helpers named ``fz_*`` are defined once per
target in the target's prelude (see ``fuser/cpu/templates.py`` and ``fuser/cuda/templates.py``).

The pass (which ops may join a group), codegen (what C to emit) and the tests (which ops to check against
eager) all read this table, so adding an op is one entry here.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

ARG_NAMES = ("a", "b", "c", "d")


@dataclass(frozen=True)
class Exprs:
    """Expression templates of one op (or one variant of it) per compute family."""

    f: str
    d: str
    i: Optional[str] = None
    v: Optional[str] = None  # the CPU vector form of f and d (values are vectors; constants exact in float)

    def for_family(self, family: str) -> Optional[str]:
        return {"f": self.f, "d": self.d, "i": self.i}[family]


@dataclass(frozen=True)
class OpDef:
    """One fusable op.

    compute: ``"result"`` computes in the result's dtype (most ops); ``"common"`` computes in the promoted
    dtype of the operands and produces bool (comparisons).
    none_as: for optional bounds, what a ``None`` constant stands for: ``"lowest"`` or ``"highest"`` of the
    compute type (clamp's missing bound leaves values unchanged, NaN included).
    variant_arg: index of a constant string argument that selects the expressions (gelu's ``approximate``).
    aliases_input: the op may return its input itself (``type_as`` with equal dtypes); such a value must not
    leave a group, because the group's outputs are always fresh tensors.
    keep_args: inputs used in their own type rather than converted to the compute type (where's condition).
    round_operands: targets on which eager rounds scalars and operands of other dtypes to a float16/bfloat16
    compute dtype before the op. It changes discrete results (``bf16(x) == 0.1`` is true in eager on the
    CPU), so it is matched per target; arithmetic ops keep full-precision scalars, within tolerance of either.
    shape_args: the inputs that decide the result's shape (default: all tensor inputs); ``type_as`` takes
    only a dtype from ``other``.
    discrete: the result jumps where the operand crosses a value (floor, comparisons, fmod...): computed
    float16/bfloat16 operands are rounded to their dtype first, as eager stores them, so the jump happens
    where eager's does.
    fast: per variant, a CUDA float expression used when the result is float16/bfloat16. Such a result keeps
    at most 11 significant bits, so an approximation with relative error near 2^-20 (``__expf``) cannot
    change it beyond a rare last-bit tie, and it costs a fraction of the instructions: those kernels are
    otherwise bound by arithmetic, not memory. (``__expf`` flushes results below 2^-126 to zero. The sigmoid
    forms divide by 1 + e^x through ``fz_div_ge1``, which keeps quotients below 2^-126, because a bfloat16 result
    of 6e-39 and one of 0 differ without bound downstream: lgamma of them is 88 or inf. See
    ``fuser/cuda/templates.py`` for the one-instruction ``.ftz`` exponential and reciprocal they use.)
    fast_offset: a cheaper form of ``fast`` whose error is small in absolute terms (near 1e-7) but not relative
    to a tiny result; used only where the result is read by nothing but additions of a constant of magnitude at
    least 1/2 (GELU's ``1 + tanh(u)``: see ``codegen.body.offset_uses_only``), whose sums then keep a relative
    error near 2e-7, far below a float16/bfloat16 result's rounding.
    scalars_as_given: eager's kernels read a 0-dim operand of a float16/bfloat16 op in its own dtype
    (TensorIterator's ``original_scalar_value``: bfloat16 * a 0-dim float32 0.37 multiplies by 0.37), where other ops
    cast a tensor operand of another dtype to the op's (``codegen.body.node_statement``).
    cast: the op converts its first argument to the result dtype (``aten::_to_copy`` with only ``dtype`` given).
    random: the op draws random numbers (``rand_like``, see ``fuser/rng.py``): ``$r`` is its ordinal among
    the group's random ops, ``$bits`` the random bits its result dtype holds, ``@IDX@`` the element's index in
    the map; its arguments after ``self`` are constant tensor options, of which only ``dtype`` may be given.
    concat: ``torch.cat`` of values of the group (its ``prim::ListConstruct`` used by nothing else): no
    expression; the kernel runs over the pieces' shape and writes each piece into its slice of the output.
    targets: per target (``"cpu"``, ``"cuda"``), expressions that replace ``exprs`` there, where eager's kernels
    of that device compute differently (addcmul's order of roundings). The kernel follows the eager of its device.
    (hardswish's CUDA kernel multiplies by ``1.0f / 6.0f``, a float constant 3e-8 away from 1/6 even in
    float64, where the CPU kernel divides by 6.)
    """

    name: str
    schemas: tuple[str, ...]
    exprs: Mapping[Optional[str], Exprs]
    compute: str = "result"
    none_as: Mapping[int, str] = field(default_factory=dict)
    variant_arg: Optional[int] = None
    aliases_input: bool = False
    keep_args: tuple[int, ...] = ()
    round_operands: tuple[str, ...] = ()
    discrete: bool = False
    shape_args: Optional[tuple[int, ...]] = None
    fast: Mapping[Optional[str], str] = field(default_factory=dict)
    fast_offset: Optional[str] = None
    scalars_as_given: bool = False
    random: bool = False
    concat: bool = False
    cast: bool = False  # converts ``self`` to the dtype argument; the arguments after it are tensor options
    targets: Mapping[str, Mapping[Optional[str], Exprs]] = field(default_factory=dict)
    reduction: Optional["Reduction"] = None  # a reduction (see Reduction): no expression, a row kernel runs it

    def template(self, variant: Optional[str], family: str, target: Optional[str] = None) -> Optional[string.Template]:
        exprs = self.targets.get(target, {}).get(variant) or self.exprs.get(variant)
        if exprs is None:
            return None
        text = exprs.for_family(family)
        return None if text is None else string.Template(text)

    def vector_text(self, variant: Optional[str]) -> Optional[str]:
        """The explicit CPU vector form (``Exprs.v``), or None (codegen may use the scalar one)."""
        exprs = self.targets.get("cpu", {}).get(variant) or self.exprs.get(variant)
        return None if exprs is None else exprs.v

    def fast_template(self, variant: Optional[str]) -> Optional[string.Template]:
        text = self.fast.get(variant)
        return None if text is None else string.Template(text)


def _unary(name: str, f: str, d: str, i: Optional[str] = None, fast: Optional[str] = None,
           discrete: bool = False, fast_offset: Optional[str] = None) -> OpDef:
    return OpDef(name, (f"aten::{name}(Tensor self) -> Tensor",), {None: Exprs(f, d, i)},
                 fast={None: fast} if fast else {}, discrete=discrete, fast_offset=fast_offset)


def _cuda_clamp(x: str, lo: str, hi: str, nan_fills: bool = False, integers: bool = True) -> Exprs:
    """CUDA eager's clamp with Scalar bounds (``fz_clamp_scalar`` in the CUDA prelude); ``"false"`` for a bound
    that is not given. ``nan_fills``: a NaN bound makes the whole result NaN (the clamp_min and clamp_max ops
    fill it; clamp with one bound given passes that bound to the kernel, which ignores a NaN)."""
    has = lambda b: "false" if b == "false" else "true"  # noqa: E731
    lo_v, hi_v = ("($T)0" if b == "false" else b for b in (lo, hi))
    e = f"fz_clamp_scalar({x}, {lo_v}, {hi_v}, {has(lo)}, {has(hi)})"
    if nan_fills:
        bound = lo_v if has(lo) == "true" else hi_v
        e = f"({bound} != {bound} ? {bound} : {e})"
    return Exprs(e, e, e if integers else None)


# clamp: a bound given as None is not given ($has_b / $has_c, from codegen)
_CUDA_CLAMP = Exprs(*["fz_clamp_scalar($a, $b, $c, $has_b, $has_c)"] * 3)

def _sixth(name: str, times: str) -> OpDef:
    """hardswish / hardsigmoid: ``times`` relu6(x + 3) over 6. Eager's CPU kernel divides by 6; its CUDA kernel
    multiplies by 1.0f / 6.0f, a float also in float64 (3e-8 away from 1/6)."""
    f, d = times + "fz_min(fz_max($a + 3.f, 0.f), 6.f)", times + "fz_min(fz_max($a + 3.0, 0.0), 6.0)"
    return OpDef(name, (f"aten::{name}(Tensor self) -> Tensor",), {None: Exprs(f"({f} / 6.f)", f"({d} / 6.0)")},
                 targets={"cuda": {None: Exprs(f"({f} * (1.f / 6.f))", f"({d} * (double)(1.f / 6.f))")}})


_OPS: list[OpDef] = [
    OpDef("abs", ("aten::abs(Tensor self) -> Tensor",), {None: Exprs("fabsf($a)", "fabs($a)", "($a < 0 ? fz_neg($a) : $a)")},
          targets={"cuda": {None: Exprs("fabsf($a)", "fabs($a)", "fz_iabs($a)")}}),  # see fz_iabs
    _unary("acos", "acosf($a)", "acos($a)"),
    _unary("asin", "asinf($a)", "asin($a)"),
    _unary("atan", "atanf($a)", "atan($a)"),
    _unary("ceil", "ceilf($a)", "ceil($a)", "$a", discrete=True),
    _unary("cos", "cosf($a)", "cos($a)"),
    _unary("cosh", "coshf($a)", "cosh($a)"),
    _unary("exp", "expf($a)", "exp($a)", fast="__expf($a)"),
    _unary("expm1", "expm1f($a)", "expm1($a)"),
    _unary("erf", "erff($a)", "erf($a)"),
    _unary("erfc", "erfcf($a)", "erfc($a)"),
    _unary("floor", "floorf($a)", "floor($a)", "$a", discrete=True),
    _unary("frac", "($a - truncf($a))", "($a - trunc($a))", discrete=True),
    _unary("lgamma", "lgammaf($a)", "lgamma($a)"),
    _unary("log", "logf($a)", "log($a)"),
    _unary("log10", "log10f($a)", "log10($a)"),
    _unary("log1p", "log1pf($a)", "log1p($a)"),
    _unary("log2", "log2f($a)", "log2($a)"),
    _unary("neg", "(-$a)", "(-$a)", "fz_neg($a)"),
    _unary("reciprocal", "(1.f / $a)", "(1.0 / $a)"),
    # max(x, 0) with the device's rule for a tie of signed zeros (CPU eager keeps -0, CUDA's gives +0)
    _unary("relu", "fz_max($a, 0.f)", "fz_max($a, 0.0)", "($a > 0 ? $a : ($T)0)"),
    _unary("round", "nearbyintf($a)", "nearbyint($a)", "$a", discrete=True),
    _unary("rsqrt", "(1.f / sqrtf($a))", "(1.0 / sqrt($a))"),
    _unary("sigmoid", "(1.f / (1.f + expf(-$a)))", "(1.0 / (1.0 + exp(-$a)))",
           fast="fz_div_ge1(1.f, 1.f + fz_exp_1p(-$a))"),
    _unary("sin", "sinf($a)", "sin($a)"),
    _unary("sinh", "sinhf($a)", "sinh($a)"),
    _unary("sqrt", "sqrtf($a)", "sqrt($a)"),
    _unary("tan", "tanf($a)", "tan($a)"),
    _unary("tanh", "tanhf($a)", "tanh($a)", fast="fz_tanh_fast($a)", fast_offset="fz_tanh_offset($a)"),
    _unary("trunc", "truncf($a)", "trunc($a)", "$a", discrete=True),
    _unary("silu", "($a / (1.f + expf(-$a)))", "($a / (1.0 + exp(-$a)))",
           fast="fz_div_ge1($a, 1.f + fz_exp_1p(-$a))"),
    OpDef(
        "gelu",
        ('aten::gelu(Tensor self, *, str approximate="none") -> Tensor',),
        {
            "none": Exprs("(0.5f * $a * (1.f + erff($a * 0.70710678118654752f)))",
                          "(0.5 * $a * (1.0 + erf($a * 0.70710678118654752440)))"),
            "tanh": Exprs(
                "(0.5f * $a * (1.f + tanhf(0.79788456080286535f * ($a + 0.044715f * $a * $a * $a))))",
                "(0.5 * $a * (1.0 + tanh(0.79788456080286535588 * ($a + 0.044715 * $a * $a * $a))))"),
        },
        variant_arg=1,
        # eager's CPU kernels (scalar and vector) are compiled with contraction: x + 0.044715 * x^3 is one fma there
        targets={"cpu": {"tanh": Exprs(
            "(0.5f * $a * (1.f + tanhf(0.79788456080286535f * fmaf(0.044715f, $a * $a * $a, $a))))",
            "(0.5 * $a * (1.0 + tanh(0.79788456080286535588 * fma(0.044715, $a * $a * $a, $a))))")}},
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation in the negative tail, and about half the work. Below
        # u = -9 eager's own form, as its CUDA kernel writes it: its tanhf(u) reaches -1 near u = -9.01 and the
        # result is then a zero (which a later inf * 0 turns into NaN, the fuzzer found), where sigmoid(2u) would
        # still leave a bfloat16-sized 1e-8 * x
        fast={"tanh": "(0.79788456080286535f * ($a + 0.044715f * ($a * $a * $a)) < -9.f ? "
                      "0.5f * $a * (1.f + tanhf(0.79788456080286535f * ($a + 0.044715f * ($a * $a * $a)))) : "
                      "fz_div_ge1($a, 1.f + fz_exp_1p(-1.5957691216057308f * ($a + 0.044715f * $a * $a * $a))))"},
    ),
    OpDef("hardtanh", ("aten::hardtanh(Tensor self, Scalar min_val=-1, Scalar max_val=1) -> Tensor",),
          {None: Exprs("fz_min(fz_max($a, $b), $c)", "fz_min(fz_max($a, $b), $c)")},
          targets={"cuda": {None: _cuda_clamp("$a", "$b", "$c", integers=False)}}),  # eager's hardtanh is clamp(self, min, max)
    # The activations below follow ATen's kernels (cpu/Activation.cpp, cpu/Elu.h, cuda/Activation*Kernel.cu) in
    # their order of operations; both compute float16/bfloat16 in float, as these expressions do.
    _sixth("hardswish", "$a * "),
    _sixth("hardsigmoid", ""),
    # hardtanh(x, 0, 6), i.e. clamp, which takes integers too; CUDA's clamp passes NaN, then fmaxf/fminf, which
    # turn -0.0 into +0 (the CPU keeps -0.0)
    OpDef("relu6", ("aten::relu6(Tensor self) -> Tensor",),
          {None: Exprs("fz_min(fz_max($a, 0.f), 6.f)", "fz_min(fz_max($a, 0.0), 6.0)",
                       "fz_min(fz_max($a, ($T)0), ($T)6)")},
          targets={"cuda": {None: Exprs("($a != $a ? $a : fminf(fmaxf($a, 0.f), 6.f))",
                                        "($a != $a ? $a : fmin(fmax($a, 0.0), 6.0))",
                                        "fz_min(fz_max($a, ($T)0), ($T)6)")}}),
    OpDef("leaky_relu", ("aten::leaky_relu(Tensor self, Scalar negative_slope=0.01) -> Tensor",),
          {None: Exprs("($a > 0.f ? $a : $a * $b)", "($a > 0.0 ? $a : $a * $b)",
                       v="fz_vsel($a > 0.f, $a, $a * $b)")}),
    # (alpha * scale) is eager's negcoef, formed in the compute type; the CPU takes the exponential side below 0,
    # CUDA at or below 0: the sign of a zero result differs when alpha * scale < 0
    OpDef("elu", ("aten::elu(Tensor self, Scalar alpha=1, Scalar scale=1, Scalar input_scale=1) -> Tensor",),
          {None: Exprs("($a < 0.f ? expm1f($a * $d) * ($b * $c) : $a * $c)",
                       "($a < 0.0 ? expm1($a * $d) * ($b * $c) : $a * $c)",
                       v="fz_vsel($a < 0.f, expm1f($a * $d) * ($b * $c), $a * $c)")},
          targets={"cuda": {None: Exprs("($a > 0.f ? $a * $c : expm1f($a * $d) * ($b * $c))",
                                        "($a > 0.0 ? $a * $c : expm1($a * $d) * ($b * $c))")}}),
    # x itself above the threshold: a jump there (log(2) at x = 0 for threshold 0)
    OpDef("softplus", ("aten::softplus(Tensor self, Scalar beta=1, Scalar threshold=20) -> Tensor",),
          {None: Exprs("($a * $b > $c ? $a : log1pf(expf($a * $b)) / $b)",
                       "($a * $b > $c ? $a : log1p(exp($a * $b)) / $b)",
                       v="fz_vsel($a * $b > $c, $a, log1pf(expf($a * $b)) / $b)")}, discrete=True),
    OpDef("mish", ("aten::mish(Tensor self) -> Tensor",),
          {None: Exprs("($a * tanhf(log1pf(expf($a))))", "($a * tanh(log1p(exp($a))))")}),
    OpDef("add", ("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
                  "aten::add.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor"),
          # eager (CPU vector and scalar loops, CUDA) computes fma(alpha, other, self): without the fused
          # multiply-add a huge other*alpha overflows where eager's result is finite
          {None: Exprs("fmaf($c, $b, $a)", "fma($c, $b, $a)", "($T)(FZ_U($a) + FZ_U($c) * FZ_U($b))")},
          scalars_as_given=True),
    OpDef("sub", ("aten::sub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
                  "aten::sub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor"),
          # (-alpha as eager negates the Scalar: $nc, so an int 0 gives +0 and the sign of a zero result is eager's)
          {None: Exprs("fmaf($nc, $b, $a)", "fma($nc, $b, $a)", "($T)(FZ_U($a) - FZ_U($c) * FZ_U($b))")},
          scalars_as_given=True),
    OpDef("rsub", ("aten::rsub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
                   "aten::rsub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor"),
          # ``1 - x``: eager computes sub(other, self, alpha), i.e. fma(-alpha, self, other)
          {None: Exprs("fmaf($nc, $a, $b)", "fma($nc, $a, $b)", "($T)(FZ_U($b) - FZ_U($c) * FZ_U($a))")},
          scalars_as_given=True),
    OpDef("mul", ("aten::mul.Tensor(Tensor self, Tensor other) -> Tensor",
                  "aten::mul.Scalar(Tensor self, Scalar other) -> Tensor"),
          {None: Exprs("($a * $b)", "($a * $b)", "($T)(FZ_U($a) * FZ_U($b))")}, scalars_as_given=True),
    OpDef("div", ("aten::div.Tensor(Tensor self, Tensor other) -> Tensor",
                  "aten::div.Scalar(Tensor self, Scalar other) -> Tensor"),
          {None: Exprs("($a / $b)", "($a / $b)")},
          # CUDA eager divides by a CPU scalar (a Python number, a 0-dim CPU tensor) as a product with its
          # reciprocal in the compute type: x / 1e-40 is x * inf there (0 gives NaN)
          targets={"cuda": {None: Exprs("($scalar_b ? $a * (1.f / $b) : $a / $b)",
                                        "($scalar_b ? $a * (1.0 / $b) : $a / $b)")}}, scalars_as_given=True),
    OpDef("atan2", ("aten::atan2(Tensor self, Tensor other) -> Tensor",),
          {None: Exprs("atan2f($a, $b)", "atan2($a, $b)")}),
    OpDef("fmod", ("aten::fmod.Tensor(Tensor self, Tensor other) -> Tensor",
                   "aten::fmod.Scalar(Tensor self, Scalar other) -> Tensor"),
          {None: Exprs("fmodf($a, $b)", "fmod($a, $b)")}, discrete=True),
    OpDef("remainder", ("aten::remainder.Tensor(Tensor self, Tensor other) -> Tensor",
                        "aten::remainder.Scalar(Tensor self, Scalar other) -> Tensor",
                        "aten::remainder.Scalar_Tensor(Scalar self, Tensor other) -> Tensor"),
          {None: Exprs("fz_remainder($a, $b)", "fz_remainder($a, $b)")}, discrete=True),
    OpDef("maximum", ("aten::max.other(Tensor self, Tensor other) -> Tensor",
                      "aten::maximum(Tensor self, Tensor other) -> Tensor"),
          {None: Exprs("fz_max($a, $b)", "fz_max($a, $b)", "fz_max($a, $b)")}),
    OpDef("minimum", ("aten::min.other(Tensor self, Tensor other) -> Tensor",
                      "aten::minimum(Tensor self, Tensor other) -> Tensor"),
          {None: Exprs("fz_min($a, $b)", "fz_min($a, $b)", "fz_min($a, $b)")}),
    OpDef("pow", ("aten::pow.Tensor_Tensor(Tensor self, Tensor exponent) -> Tensor",
                  "aten::pow.Scalar(Scalar self, Tensor exponent) -> Tensor"),
          {None: Exprs("powf($a, $b)", "pow($a, $b)")},
          # CUDA eager takes a CPU scalar exponent (a traced Python number) as pow.Tensor_Scalar does: sqrt for
          # 0.5, so pow(-inf, 0.5) is NaN there and inf on the CPU (the CUDA fuzzer)
          targets={"cuda": {None: Exprs("($scalar_b ? fz_pow_scalar($a, $b) : powf($a, $b))",
                                        "($scalar_b ? fz_pow_scalar($a, $b) : pow($a, $b))")}},
          # and a scalar base in a float16/bfloat16 compute dtype, as eager converts it: pow(1e-40, x) over float16 is
          # pow(0, x), inf for x < 0 (the CUDA fuzzer, seed 2852755661)
          round_operands=("cpu", "cuda")),
    # eager converts the exponent to a float16/bfloat16 self's dtype: pow(inf, 1e-40) is 1 in float16 (the fuzzer)
    OpDef("pow_scalar", ("aten::pow.Tensor_Scalar(Tensor self, Scalar exponent) -> Tensor",),
          {None: Exprs("fz_pow_scalar($a, $b)", "fz_pow_scalar($a, $b)")}, round_operands=("cpu", "cuda")),
    OpDef("where", ("aten::where.self(Tensor condition, Tensor self, Tensor other) -> Tensor",
                    "aten::where.ScalarOther(Tensor condition, Tensor self, Scalar other) -> Tensor",
                    "aten::where.ScalarSelf(Tensor condition, Scalar self, Tensor other) -> Tensor",
                    "aten::where.Scalar(Tensor condition, Scalar self, Scalar other) -> Tensor"),
          {None: Exprs("($a ? $b : $c)", "($a ? $b : $c)", "($a ? $b : $c)", v="fz_vsel($a, $b, $c)")},
          keep_args=(0,)),
    OpDef("type_as", ("aten::type_as(Tensor self, Tensor other) -> Tensor",),
          {None: Exprs("$a", "$a", "$a")}, aliases_input=True, shape_args=(0,)),
    # Scalar and Tensor bounds are two entries: on CUDA a NaN Scalar bound is ignored where it is the only one
    # (fmaxf/fminf) and fills the result with NaN where both are given, while a NaN Tensor bound propagates
    OpDef("clamp", ("aten::clamp(Tensor self, Scalar? min=None, Scalar? max=None) -> Tensor",),
          {None: Exprs("fz_min(fz_max($a, $b), $c)", "fz_min(fz_max($a, $b), $c)",
                       "fz_min(fz_max($a, $b), $c)")},
          none_as={1: "lowest", 2: "highest"}, targets={"cuda": {None: _CUDA_CLAMP}}),
    OpDef("clamp_tensor", ("aten::clamp.Tensor(Tensor self, Tensor? min=None, Tensor? max=None) -> Tensor",),
          {None: Exprs("fz_min(fz_max($a, $b), $c)", "fz_min(fz_max($a, $b), $c)",
                       "fz_min(fz_max($a, $b), $c)")},
          none_as={1: "lowest", 2: "highest"}),
    OpDef("clamp_min", ("aten::clamp_min(Tensor self, Scalar min) -> Tensor",),
          {None: Exprs("fz_max($a, $b)", "fz_max($a, $b)", "fz_max($a, $b)")},
          targets={"cuda": {None: _cuda_clamp("$a", "$b", "false", nan_fills=True)}}),
    OpDef("clamp_min_tensor", ("aten::clamp_min.Tensor(Tensor self, Tensor min) -> Tensor",),
          {None: Exprs("fz_max($a, $b)", "fz_max($a, $b)", "fz_max($a, $b)")}),
    OpDef("clamp_max", ("aten::clamp_max(Tensor self, Scalar max) -> Tensor",),
          {None: Exprs("fz_min($a, $b)", "fz_min($a, $b)", "fz_min($a, $b)")},
          targets={"cuda": {None: _cuda_clamp("$a", "false", "$b", nan_fills=True)}}),
    OpDef("clamp_max_tensor", ("aten::clamp_max.Tensor(Tensor self, Tensor max) -> Tensor",),
          {None: Exprs("fz_min($a, $b)", "fz_min($a, $b)", "fz_min($a, $b)")}),
    OpDef("threshold", ("aten::threshold(Tensor self, Scalar threshold, Scalar value) -> Tensor",),
          {None: Exprs("($a <= $b ? $c : $a)", "($a <= $b ? $c : $a)", "($a <= $b ? $c : $a)",
                       v="fz_vsel($a <= $b, $c, $a)")},
          # CUDA: a NaN stays NaN through fz_isnan (ptxas took -fabsf(NaN) <= 1.f as true: threshold(-|acos(3.07)|,
          # 1, -1) gave -1 where eager gives NaN; the CUDA fuzzer, 2026-11-27)
          targets={"cuda": {None: Exprs("(!fz_isnan($a) && $a <= $b ? $c : $a)",
                                        "(!fz_isnan($a) && $a <= $b ? $c : $a)", "($a <= $b ? $c : $a)")}},
          round_operands=("cuda",), discrete=True),
    OpDef("lerp", ("aten::lerp.Scalar(Tensor self, Tensor end, Scalar weight) -> Tensor",
                   "aten::lerp.Tensor(Tensor self, Tensor end, Tensor weight) -> Tensor"),
          # eager's two-sided formula (exact at weight 0 and 1), with eager's fused multiply-adds
          # (-(end - self), not self - end: x - x is +0, and the sign of a zero result must be eager's; fuzzer)
          {None: Exprs("(fabsf($c) < 0.5f ? fmaf($c, $b - $a, $a) : fmaf(-($b - $a), 1.f - $c, $b))",
                       "(fabs($c) < 0.5 ? fma($c, $b - $a, $a) : fma(-($b - $a), 1.0 - $c, $b))",
                       v="fz_vsel(fabsf($c) < 0.5f, fmaf($c, $b - $a, $a), fmaf(-($b - $a), 1.f - $c, $b))")}),
    OpDef("rand_like", ("aten::rand_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, "
                        "Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor",),
          {None: Exprs("fz_uniform_f(fz_rs, $r, @IDX@, $bits)", "fz_uniform_d(fz_rs, $r, @IDX@)",
                       v="fz_vuniform($T(), fz_rs, $r, @IDX@, $bits)")}, random=True),
    OpDef("cat", ("aten::cat(Tensor[] tensors, int dim=0) -> Tensor",), {}, concat=True),
    # a dtype conversion (the FusionDefinition frontend's cast): eager's C conversion of the value
    OpDef("cast", ("aten::_to_copy(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, "
                   "bool? pin_memory=None, bool non_blocking=False, MemoryFormat? memory_format=None) -> Tensor",),
          {None: Exprs("$a", "$a", "$a")}, cast=True),
    OpDef("addcmul", ("aten::addcmul(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor",),
          # CPU eager: fma(value * tensor1, tensor2, self); CUDA eager: fma(tensor1, tensor2, self) for value 1, else
          # fma(value, tensor1 * tensor2, self) (the product first: inf * 0 is NaN there; with value 1 there is no
          # rounded product: -1.5 * -3e38 - 3e38 is 1.5e38, not inf; the CUDA fuzzer)
          {None: Exprs("fmaf($d * $b, $c, $a)", "fma($d * $b, $c, $a)", "($T)(FZ_U($a) + FZ_U($d) * FZ_U($b) * FZ_U($c))")},
          targets={"cuda": {None: Exprs("($d == 1 ? fmaf($b, $c, $a) : fmaf($d, $b * $c, $a))",
                                        "($d == 1 ? fma($b, $c, $a) : fma($d, $b * $c, $a))",
                                        "($T)(FZ_U($a) + FZ_U($d) * (FZ_U($b) * FZ_U($c)))")}}),
]

for _cmp, _sym in (("eq", "=="), ("ne", "!="), ("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
    _e = f"($a {_sym} $b)"
    # CUDA: a comparison of floats also asks fz_isnan of its operands (see there): ptxas took fabsf(NaN) >= -0.25f
    # as true, and the NaN of 0 * (1 / 0) != itself as false (the CUDA fuzzer)
    _ordered = (f"(fz_isnan($a) || fz_isnan($b) || {_e})" if _cmp == "ne"
                else f"(!fz_isnan($a) && !fz_isnan($b) && {_e})")
    _OPS.append(OpDef(_cmp, (f"aten::{_cmp}.Tensor(Tensor self, Tensor other) -> Tensor",
                             f"aten::{_cmp}.Scalar(Tensor self, Scalar other) -> Tensor"),
                      {None: Exprs(_e, _e, _e)}, compute="common", round_operands=("cpu", "cuda"), discrete=True,
                      targets={"cuda": {None: Exprs(_ordered, _ordered, _e)}}))

OPS_BY_NAME: dict[str, OpDef] = {op.name: op for op in _OPS}
OPS_BY_SCHEMA: dict[str, OpDef] = {s: op for op in _OPS for s in op.schemas}


# by overload name ("aten::add.Tensor", "aten::abs"): what the group IR's nodes name (``fuser/ir.py``)
OPS_BY_OVERLOAD: dict[str, OpDef] = {s.split("(", 1)[0]: op for op in _OPS for s in op.schemas}


def lookup(schema: str) -> Optional[OpDef]:
    """The table entry for a node's schema string, or None when the op is not fusable."""
    return OPS_BY_SCHEMA.get(schema)


def of(op: str) -> Optional[OpDef]:
    """The table entry for an ATen overload name (a group IR node's ``op``), or None when it is not fusable."""
    return OPS_BY_OVERLOAD.get(op)


# A view the TorchScript pass may put in a group (``fuser/views.py``). It is in none of the tables above, so the
# other front doors do not take it, and codegen never sees it: the kernel computes the group without its permutes,
# each input read through its view.
PERMUTE = OpDef("permute", ("aten::permute(Tensor(a) self, int[] dims) -> Tensor(a)",),
                {None: Exprs("$a", "$a", "$a")}, aliases_input=True, shape_args=(0,))


# ---- reductions ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reduction:
    """A reduction over a constant list of dims (``fuser/rows/``: a group's row kernel).

    identity: the accumulator's start, a C expression of the accumulator type ``$A``; combine: a struct of the
    kernels' row prelude whose ``f(a, b)`` folds two partial results (the block reduction calls it too, so it is
    associative and commutative up to rounding); wide: the accumulator is float for float16/bfloat16/float32 and
    double for float64 (eager's sum and mean; the CPU kernels accumulate in double), else the compute type
    (max and min are exact); mean: the result is the sum over the row's length. Arguments: ``self``, ``dim``
    (a constant tuple of ints; empty or None: every dim), ``keepdim``, and for sum and mean the ``dtype`` the
    input is converted to before the sum (eager's rule).

    variance: two passes along the row, the mean and then the sum of squared deviations from it, over
    ``max(0, n - correction)`` (eager's divisor: a row of n <= correction gives inf or NaN, as eager's does);
    the correction is :func:`correction` of the node's constant arguments. composite: an eager op that is no
    reduction itself but reduces (softmax, layer_norm, rms_norm, std): the row kernel runs its steps
    (``fuser.rows.decompose.expand``); the group IR, the fallback and autograd keep the eager op whole.
    """

    kind: str
    identity: str
    combine: str
    wide: bool
    mean: bool = False
    has_dtype: bool = False
    variance: bool = False
    composite: bool = False


def _composite(kind: str) -> Reduction:
    return Reduction(kind, "", "", True, composite=True)


REDUCTIONS: dict[str, Reduction] = {
    "aten::sum.dim_IntList": Reduction("sum", "(($A)0)", "fz_rsum", True, has_dtype=True),
    "aten::mean.dim": Reduction("mean", "(($A)0)", "fz_rsum", True, mean=True, has_dtype=True),
    # eager's amax/amin propagate NaN (fz_max/fz_min do); an empty row raises in eager (the executor falls back)
    "aten::amax": Reduction("amax", "FZ_LOWEST($A)", "fz_rmax", False),
    "aten::amin": Reduction("amin", "FZ_HIGHEST($A)", "fz_rmin", False),
    "aten::var.correction": Reduction("var", "(($A)0)", "fz_rsum", True, variance=True),
    "aten::var.dim": Reduction("var", "(($A)0)", "fz_rsum", True, variance=True),
    "aten::std.correction": _composite("std"),
    "aten::std.dim": _composite("std"),
    "aten::softmax.int": _composite("softmax"),
    "aten::log_softmax.int": _composite("log_softmax"),
    "aten::layer_norm": _composite("layer_norm"),
    "aten::rms_norm": _composite("rms_norm"),
}

# composites whose result has the input's shape (a normalization: every element of the row, not one per row)
NORMALIZATIONS = frozenset({"softmax", "log_softmax", "layer_norm", "rms_norm"})

# per composite: the positions of its optional tensor arguments (weight, bias), which need not be constants
COMPOSITE_TENSOR_ARGS: dict[str, tuple[int, ...]] = {"aten::layer_norm": (2, 3), "aten::rms_norm": (2,)}

_REDUCTION_SCHEMAS = (
    "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
    "aten::mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
    "aten::amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor",
    "aten::amin(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor",
    "aten::var.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor",
    "aten::var.dim(Tensor self, int[1]? dim, bool unbiased=True, bool keepdim=False) -> Tensor",
    "aten::std.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor",
    "aten::std.dim(Tensor self, int[1]? dim, bool unbiased=True, bool keepdim=False) -> Tensor",
    "aten::softmax.int(Tensor self, int dim, ScalarType? dtype=None) -> Tensor",
    "aten::log_softmax.int(Tensor self, int dim, ScalarType? dtype=None) -> Tensor",
    "aten::layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
    "float eps=1.0000000000000001e-05, bool cudnn_enable=True) -> Tensor",
    "aten::rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor")


# what the pass looks up by a node's schema (ops.lookup serves pointwise ops only); ops this torch lacks
# (rms_norm before 2.4) are left out
def _reduction_defs() -> dict[str, OpDef]:
    import torch
    defs = {}
    for s in _REDUCTION_SCHEMAS:
        name = s.split("(", 1)[0]
        base = name.split(".")[0]
        if s in {str(x) for x in torch._C._jit_get_schemas_for_operator(base)}:
            defs[s] = OpDef(name, (s,), {}, reduction=REDUCTIONS[name])
    return defs


REDUCTION_DEFS: dict[str, OpDef] = _reduction_defs()


def reduction(op: str) -> Optional[Reduction]:
    """The reduction an ATen overload name stands for, or None (pointwise ops are in the table above)."""
    return REDUCTIONS.get(op)


def reduced_dims(op: str, args: Sequence) -> Optional[tuple]:
    """The dims a reduction or composite node ``op(*args)`` reduces, as its constant arguments give them (None
    for every dim, or where they are not constants of the form): ``dim`` (a list, or softmax's one int), or a
    normalization's last ``len(normalized_shape)`` dims."""
    red = REDUCTIONS.get(op)
    if red is None:
        return None
    a = args[1]
    if red.kind in ("softmax", "log_softmax"):
        return (a,) if isinstance(a, int) and not isinstance(a, bool) else None
    if not isinstance(a, (list, tuple)) or not a or not all(isinstance(d, int) for d in a):
        return None
    if red.kind in ("layer_norm", "rms_norm"):
        return tuple(range(-len(a), 0))
    return tuple(a)


def correction(op: str, args: Sequence) -> float:
    """A variance's correction (``var.correction``: the argument, 1 when None; ``var.dim``: 1 if unbiased)."""
    c = args[2]
    if op.endswith(".dim"):
        return 1.0 if c else 0.0
    return 1.0 if c is None else float(c)


def lookup_reduction(schema: str) -> Optional[OpDef]:
    """The reduction entry for a node's schema string, or None."""
    return REDUCTION_DEFS.get(schema)
