"""The derivative table: for each differentiable op of ``fuser/ops.py``, its inputs' gradients as pointwise
formulas, written (like PyTorch's ``derivatives.yaml``) in the ops the fuser itself fuses, so a backward graph
built from them is a fusion group too (the reductions' formulas hold reductions: a row kernel's group).

A formula is ``f(g, x, y) -> list`` with ``g`` the output's gradient, ``x`` the node's inputs and ``y`` its
output, all :class:`V` (graph values with arithmetic that appends nodes). It returns one entry per input:
a :class:`V`, ``None`` (not differentiable: a scalar, a condition, a dtype argument), :data:`ZERO` (a
gradient that is zero everywhere, e.g. ``floor``) or :data:`UNSUPPORTED` (no formula here: a group that needs
that gradient runs through the interpreter, which records eager's autograd). Formulas follow eager's own
(same operation order where it matters, same values at ties: ``max(a, a)`` splits the gradient in halves).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from . import ir
from .ops import OPS_BY_OVERLOAD

ZERO = "zero"
UNSUPPORTED = "unsupported"


class V:
    """A value of the backward group under construction (a :class:`fuser.ir.Value` or a constant); operators
    append nodes through the group's builder."""

    __slots__ = ("builder", "value")

    def __init__(self, builder: ir.Builder, value):
        self.builder, self.value = builder, value

    @property
    def is_tensor(self) -> bool:
        v = self.value
        return isinstance(v, ir.TensorConst) or (isinstance(v, ir.Value) and v.is_tensor)

    def constant(self):
        """The Python value of a constant input (a tensor for a tensor constant), or None when it is not a
        constant (or is None)."""
        v = self.value
        if isinstance(v, ir.Value):
            return None
        return v.tensor() if isinstance(v, ir.TensorConst) else v

    @property
    def is_none(self) -> bool:
        return self.value is None

    def __add__(self, o): return op("aten::add", self, o, 1)
    __radd__ = __add__
    def __sub__(self, o): return op("aten::sub", self, o, 1)
    def __rsub__(self, o): return op("aten::rsub", self, o, 1)
    def __mul__(self, o): return op("aten::mul", self, o)
    __rmul__ = __mul__
    def __truediv__(self, o): return op("aten::div", self, o)
    def __neg__(self): return op("aten::neg", self)
    def __gt__(self, o): return op("aten::gt", self, o)
    def __lt__(self, o): return op("aten::lt", self, o)
    def __ge__(self, o): return op("aten::ge", self, o)
    def __le__(self, o): return op("aten::le", self, o)
    def eq(self, o): return op("aten::eq", self, o)


def op(kind: str, *args) -> V:
    """Append ``kind(args)`` (Python numbers become constants) to the builder of the first :class:`V`, with the
    first of the op table's overloads of ``kind`` that takes these arguments: a formula stays within the
    fusable ops."""
    builder = next(a.builder for a in args if isinstance(a, V))
    vals = [a.value if isinstance(a, V) else a for a in args]
    candidates = [name for name in OPS_BY_OVERLOAD if name.split(".")[0] == kind]
    try:
        return V(builder, builder.call(kind, *vals, candidates=candidates))
    except TypeError as e:
        raise TypeError(f"no fusable overload of {kind} takes {vals!r}") from e


def where(c, a, b) -> V:
    return op("aten::where", c, a, b)


def _f(name: str) -> Callable[[V], V]:
    return lambda a: op(f"aten::{name}", a)


exp, cos, sin, sinh, cosh, tanh, sqrt, rsqrt, log, log1p, trunc = map(
    _f, ("exp", "cos", "sin", "sinh", "cosh", "tanh", "sqrt", "rsqrt", "log", "log1p", "trunc"))
erf = _f("erf")


def _scalar_times(g: V, s: V, negate: bool = False):
    """``g * s`` for a Scalar argument ``s`` (``-g * s`` when negate), skipping a constant 1."""
    if s.constant() == 1:
        return -g if negate else g
    return (-g) * s if negate else g * s


def _unary(f: Callable[[V, V, V], object]):
    return lambda g, x, y: [f(g, x[0], y)]


def _add(g, x, y):
    return [g, _scalar_times(g, x[2], False) if x[1].is_tensor else None, None]


def _sub(g, x, y):
    return [g, _scalar_times(g, x[2], True) if x[1].is_tensor else None, None]


def _rsub(g, x, y):  # other - alpha * self
    return [_scalar_times(g, x[2], True), g if x[1].is_tensor else None, None]


def _mul(g, x, y):
    return [g * x[1], g * x[0] if x[1].is_tensor else None]


def _div(g, x, y):
    return [g / x[1], -g * ((x[0] / x[1]) / x[1]) if x[1].is_tensor else None]


def _abs(g, x, y):
    a = x[0]  # grad * sgn(a), and sgn(NaN) is 0
    return [where(a > 0, g, where(a < 0, -g, g * 0))]


def _max_min(drop_self_where: str):
    def f(g, x, y):
        a, b = x
        half = where(a.eq(b), g / 2, g)
        less, greater = (a < b), (a > b)
        if drop_self_where == "less":  # maximum: self loses where self < other
            return [where(less, 0.0, half), where(greater, 0.0, half)]
        return [where(greater, 0.0, half), where(less, 0.0, half)]
    return f


def _pow_scalar(g, x, y):
    e = x[1].constant()
    if e is None:
        return [UNSUPPORTED, None]
    if e == 0:
        return [ZERO, None]
    return [g * (op("aten::pow", x[0], e - 1) * e), None]


def _pow(g, x, y):
    a, b = x
    if not a.is_tensor:  # pow(Scalar self, Tensor exponent)
        c = a.constant()
        if c is None or not c > 0:
            return [None, UNSUPPORTED]
        return [None, g * (y * math.log(c))]
    ga = where(b.eq(0.0), 0.0, g * (b * op("aten::pow", a, b - 1)))
    ylog = y * log(op("aten::type_as", a, y))  # log of self in the result's dtype, as eager
    gb = g * where(a.eq(0.0), where(b >= 0.0, 0.0, ylog), ylog)
    return [ga, gb]


def _where(g, x, y):
    c, a, b = x
    return [None, where(c, g, 0.0) if a.is_tensor else None, where(c, 0.0, g) if b.is_tensor else None]


def _clamp(g, x, y):
    a, lo, hi = x
    if (lo.is_tensor and not lo.is_none) or (hi.is_tensor and not hi.is_none):
        return [UNSUPPORTED, UNSUPPORTED, UNSUPPORTED]  # clamp.Tensor: bounds' gradients are not here
    r = g
    if not hi.is_none:
        r = where(a <= hi, r, 0.0)
    if not lo.is_none:
        r = where(a >= lo, r, 0.0)
    return [r, None, None]


def _clamp_min(g, x, y):
    a, m = x
    return [where(a >= m, g, 0.0), where(a < m, g, 0.0) if m.is_tensor else None]


def _clamp_max(g, x, y):
    a, m = x
    return [where(a <= m, g, 0.0), where(a > m, g, 0.0) if m.is_tensor else None]


def _lerp(g, x, y):
    a, b, w = x
    if w.is_tensor:
        return [g * (1 - w), g * w, g * (b - a)]
    c = w.constant()
    if c is None:  # eager forms 1 - weight in double on the host; a kernel formula cannot
        return [UNSUPPORTED, UNSUPPORTED, None]
    return [g * (1.0 - c), g * w, None]


def _addcmul(g, x, y):
    a, t1, t2, v = x
    return [g, g * _scalar_times(t2, v), g * _scalar_times(t1, v), None]  # grad * (tensor2 * value)


def _atan2(g, x, y):
    a, b = x
    d = a * a + b * b  # eager zeroes the reciprocal where the denominator is 0 (both 0, or underflow)
    recip = where(d.eq(0.0), 0.0, op("aten::reciprocal", d))
    return [(g * b) * recip, (g * (-a)) * recip]


def _fmod(g, x, y):
    a, b = x
    return [g, (-g) * trunc(a / b) if b.is_tensor else None]


def _remainder(g, x, y):
    a, b = x
    return [g if a.is_tensor else None, UNSUPPORTED if b.is_tensor else None]


_SQRT1_2 = math.sqrt(0.5)
_GELU_PDF = 2 / math.sqrt(math.pi) * _SQRT1_2 * 0.5
_GELU_BETA = math.sqrt(2) * 2 / math.sqrt(math.pi) * 0.5
_GELU_KAPPA = 0.044715


def _gelu(g, x, y):
    a = x[0]
    if x[1].constant() == "tanh":
        x_sq = a * a
        t = tanh((a + (x_sq * a) * _GELU_KAPPA) * _GELU_BETA)
        left_d = (t + 1.0) * 0.5
        right_d = ((a * 0.5) * (1 - t * t)) * _GELU_BETA * ((x_sq * (3 * _GELU_KAPPA)) + 1.0)
        return [g * (left_d + right_d), None]
    cdf = (erf(a * _SQRT1_2) + 1.0) * 0.5
    pdf = exp((a * a) * -0.5) * _GELU_PDF
    return [g * (cdf + a * pdf), None]


def _silu(g, a, y):
    s = op("aten::sigmoid", a)
    return g * s * ((a * (1 - s)) + 1.0)


def _hardtanh_grad(g, a, lo, hi):
    # (NaN gets 0, as eager's vectorized CPU loop gives; its scalar loop and CUDA pass the gradient)
    return where(a > lo, where(a < hi, g, 0.0), 0.0)


def _hardswish(g, a, y):
    # eager's hardswish_backward: 0 up to -3 inclusive, g * (x / 3 + 0.5) below 3, g from 3 on; NaN takes the
    # middle formula (its vectorized CPU loop; CUDA and its scalar loop give g). x clamped to [-3, 3] there keeps
    # the unused side finite (0 * inf would make the double backward NaN) and gives eager's double backward, 0 for
    # x at NaN, since clamp passes no gradient to NaN.
    inner = g * ((op("aten::clamp", a, -3.0, 3.0) / 3.0) + 0.5)
    return where(a <= -3.0, 0.0, where(a >= 3.0, g, inner))


# eager's one_sixth is 1.0f / 6.0f, also in its float64 kernels
_ONE_SIXTH_F = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))


def _hardsigmoid(g, a, y):
    # (eager has no double backward here; this one is exact: 0 for x, hardsigmoid_backward for the gradient)
    return where(a > -3.0, where(a < 3.0, g * _ONE_SIXTH_F, 0.0), 0.0)


def _leaky_relu(g, x, y):
    return [where(x[0] > 0.0, g, _scalar_times(g, x[1])), None]


def _elu(g, x, y):
    a, alpha, scale, input_scale = x
    # eager's elu_backward(is_result=False): g * input_scale * negcoef * exp(x * input_scale) at x <= 0 (and NaN,
    # in its vectorized CPU loop; CUDA: g * scale), negcoef = alpha * scale formed first; g * scale above 0. Its
    # double backward masks x < 0: at x = 0 the gradient has no x in it.
    gi = _scalar_times(g, input_scale)
    ka, ks = alpha.constant(), scale.constant()
    at_zero = gi * (ka * ks) if ka is not None and ks is not None else (gi * alpha) * scale
    # (x > 0 gives exp(0) on the side it does not take: exp(inf) there would make the double backward NaN)
    below = at_zero * exp(_scalar_times(where(a > 0.0, 0.0, a), input_scale))
    return [where(a > 0.0, _scalar_times(g, scale), where(a.eq(0.0), at_zero, below)), None, None, None]


def _softplus(g, x, y):
    a, beta, threshold = x
    # eager's softplus_backward: g above the threshold, g * z / (z + 1) with z = exp(x * beta) at and below it.
    # Its double backward masks x * beta < threshold: at the tie z comes from the threshold, which has no derivative.
    xb = _scalar_times(a, beta)
    z = exp(where(xb >= threshold, threshold, xb))
    return [where(xb > threshold, g, (g * z) / (z + 1.0)), None, None]


def _mish(g, a, y):
    # eager's mish_backward, and under create_graph the same formula in differentiable ops
    s = op("aten::sigmoid", a)
    t = tanh(log1p(exp(a)))
    return g * (t + a * s * (1 - t * t))


# ---- reductions (fuser/rows/): a row's gradient back along the row --------------------------------------------
# In a backward group every reduction keeps its dims (fuser/backward.py recomputes the forward's that way and
# passes a dropped-dims output's gradient with them restored), so ``g`` and ``y`` here are [rows..., 1...] and
# broadcast along the row as the row kernel reads row-level values.

SUM = "aten::sum.dim_IntList"


def reduce_sum(v: V, dims, dtype=None) -> V:
    """``sum(v, dims, keepdim=True, dtype)``: a reduction of the backward group (the row kernel runs it)."""
    return V(v.builder, v.builder.add(SUM, v.value, dims, True, dtype))


def _expand(g: V, u: V) -> V:
    """``g`` broadcast to ``u``'s shape, its values and dtype unchanged (u == u is false at NaN: g either way)."""
    return where(u.eq(u), g, g)


def _sum(g, x, y):  # eager: the gradient expanded back over the reduced dims
    return [_expand(g, x[0]), None, None, None]


def _mean(g, x, y):
    # eager: grad.expand(...) / n with n a Scalar, the row's length: here a float input of the backward group that
    # fuser/backward.py passes as a fifth argument (fuser/autodiff.py gives it the length)
    return [_expand(g / x[4], x[0]), None, None, None]


def _amax_amin(g, x, y):
    # eager's scale_grad_by_count: (grad / mask.sum(dims, keepdim)) * mask, mask = (x == result): ties share the
    # gradient evenly; a row whose result is NaN has no x equal to it, so g / 0 * 0 makes the row NaN, as in eager.
    # The count in x's dtype: eager's grad / count converts the integer count to grad's dtype (x's) the same way.
    mask = op("aten::type_as", where(x[0].eq(y), 1.0, 0.0), x[0])
    return [(g / reduce_sum(mask, x[1].value)) * mask, None, None]


MEAN = "aten::mean.dim"


def reduce_mean(v: V, dims) -> V:
    """``mean(v, dims, keepdim=True)``: a reduction of the backward group (it divides by the row's length)."""
    return V(v.builder, v.builder.add(MEAN, v.value, dims, True, None))


# ---- normalizations (composite reductions, ``ops.Reduction.composite``): fuser/backward.py recomputes the forward
# op as its steps (fuser/rows/decompose.py) and passes what eager's kernels save (layer_norm's mean and rstd,
# rms_norm's rstd) as extra entries of ``x``; each backward is a row group: reductions along the row, then an
# epilogue. The gradients of weight and bias are element-level here ([rows..., cols]): a column group sums them
# over the rows (fuser/grad_sums.py), as for any input broadcast across rows.

def _softmax(g, x, y):
    # eager's softmax_backward: (grad - sum(grad * out)) * out
    return [(g - reduce_sum(g * y, (x[1].constant(),))) * y, None, None]


def _log_softmax(g, x, y):
    # eager's log_softmax_backward: grad - exp(out) * sum(grad)
    return [g - exp(y) * reduce_sum(g, (x[1].constant(),)), None, None]


def _norm_dims(x) -> tuple:
    return tuple(range(-len(x[1].constant()), 0))


def _layer_norm(g, x, y):
    # x: input, normalized_shape, weight, bias, eps, cudnn_enable, then the recomputed mean and rstd (keepdim).
    # dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), gw = grad * weight, xhat = (x - mean) * rstd
    a, w, c, mu, r = x[0], x[2], x[3], x[6], x[7]
    dims = _norm_dims(x)
    xhat = (a - mu) * r
    gw = g if w.is_none else g * w
    ga = r * ((gw - reduce_mean(gw, dims)) - xhat * reduce_mean(gw * xhat, dims))
    return [ga, None, None if w.is_none else g * xhat, None if c.is_none else g, None, None]


def _rms_norm(g, x, y):
    # x: input, normalized_shape, weight, eps, then the recomputed rstd (keepdim).
    # dx = rstd * (gw - x * rstd^2 * mean(gw * x)), gw = grad * weight
    a, w, r = x[0], x[2], x[4]
    gw = g if w.is_none else g * w
    ga = r * (gw - a * ((r * r) * reduce_mean(gw * a, _norm_dims(x))))
    return [ga, None, None if w.is_none else g * (a * r), None]


def _var_grad(g, x):
    """eager's var_backward over listed dims: (2 / (n - correction)) * grad * (x - mean(x)), n the row's length (a
    float input, as for a mean: ``x[4]``), the factor formed in grad's dtype (eager forms it in double on the host,
    then converts it; n - correction is exact either way); every dim (dim None or empty) is eager's other branch:
    not here."""
    a, dims, c = x[0], x[1].constant(), x[2]
    if not dims or isinstance(c.value, ir.Value):
        return UNSUPPORTED
    c = c.constant()
    c = 1.0 if c is None else float(c)  # var.correction's None, var.dim's unbiased (True: 1)
    n = op("aten::type_as", where(g.eq(g), x[4], x[4]), g)  # the row's length as a row-level value of grad's dtype
    scale = op("aten::reciprocal", n - c) * 2.0  # (exact: 2 / d rounds as 1 / d does, times 2)
    return (g * scale) * (a - reduce_mean(a, tuple(dims)))


def _var(g, x, y):
    return [_var_grad(g, x), None, None, None]


def _std(g, x, y):
    # eager's std_backward: var_backward of (grad / (2 * std)), zero where std is zero
    return [_var_grad(where(y.eq(0.0), 0.0, g / (y * 2.0)), x), None, None, None]


_LN2, _LN10, _TWO_OVER_SQRT_PI = math.log(2.0), math.log(10.0), 2.0 / math.sqrt(math.pi)

DERIVATIVES: dict[str, Callable] = {
    "abs": _abs,
    "acos": _unary(lambda g, a, y: -(g * rsqrt((-a) * a + 1.0))),
    "asin": _unary(lambda g, a, y: g * rsqrt((-a) * a + 1.0)),
    "atan": _unary(lambda g, a, y: g / (a * a + 1.0)),
    "ceil": _unary(lambda g, a, y: ZERO),
    "cos": _unary(lambda g, a, y: g * (-sin(a))),
    "cosh": _unary(lambda g, a, y: g * sinh(a)),
    "exp": _unary(lambda g, a, y: g * y),
    "expm1": _unary(lambda g, a, y: g * (y + 1.0)),
    "erf": _unary(lambda g, a, y: exp(-(a * a)) * _TWO_OVER_SQRT_PI * g),
    "erfc": _unary(lambda g, a, y: exp(-(a * a)) * (-_TWO_OVER_SQRT_PI) * g),
    "floor": _unary(lambda g, a, y: ZERO),
    "frac": _unary(lambda g, a, y: g),
    "lgamma": _unary(lambda g, a, y: UNSUPPORTED),  # digamma is not a fused op
    "log": _unary(lambda g, a, y: g / a),
    "log10": _unary(lambda g, a, y: g / (a * _LN10)),
    "log1p": _unary(lambda g, a, y: g / (a + 1.0)),
    "log2": _unary(lambda g, a, y: g / (a * _LN2)),
    "neg": _unary(lambda g, a, y: -g),
    "reciprocal": _unary(lambda g, a, y: (-g) * (y * y)),
    "relu": _unary(lambda g, a, y: where(y <= 0.0, 0.0, g)),
    "round": _unary(lambda g, a, y: ZERO),
    "rsqrt": _unary(lambda g, a, y: (g * -0.5) * (y * y * y)),
    "sigmoid": _unary(lambda g, a, y: g * (1 - y) * y),
    "sin": _unary(lambda g, a, y: g * cos(a)),
    "sinh": _unary(lambda g, a, y: g * cosh(a)),
    "sqrt": _unary(lambda g, a, y: g / (y * 2.0)),
    "tan": _unary(lambda g, a, y: g * (y * y + 1.0)),
    "tanh": _unary(lambda g, a, y: g * (1 - y * y)),
    "trunc": _unary(lambda g, a, y: ZERO),
    "silu": _unary(_silu),
    "gelu": _gelu,
    "hardtanh": lambda g, x, y: [_hardtanh_grad(g, x[0], x[1], x[2]), None, None],
    "hardswish": _unary(_hardswish),
    "hardsigmoid": _unary(_hardsigmoid),
    "relu6": _unary(lambda g, a, y: _hardtanh_grad(g, a, 0.0, 6.0)),  # eager's relu6 is hardtanh(x, 0, 6)
    "leaky_relu": _leaky_relu,
    "elu": _elu,
    "softplus": _softplus,
    "mish": _unary(_mish),
    "add": _add,
    "sub": _sub,
    "rsub": _rsub,
    "mul": _mul,
    "div": _div,
    "atan2": _atan2,
    "fmod": _fmod,
    "remainder": _remainder,
    "maximum": _max_min("less"),
    "minimum": _max_min("greater"),
    "pow": _pow,
    "pow_scalar": _pow_scalar,
    "where": _where,
    "type_as": lambda g, x, y: [op("aten::type_as", g, x[0]), None],  # back in self's dtype
    "cast": lambda g, x, y: [op("aten::type_as", g, x[0])] + [None] * (len(x) - 1),  # back in self's dtype
    "clamp": _clamp,
    "clamp_tensor": _clamp,
    "clamp_min": _clamp_min,
    "clamp_min_tensor": _clamp_min,
    "clamp_max": _clamp_max,
    "clamp_max_tensor": _clamp_max,
    "threshold": lambda g, x, y: [where(x[0] <= x[1], 0.0, g), None, None],
    "lerp": _lerp,
    "addcmul": _addcmul,
    "sum": _sum,
    "mean": _mean,
    "amax": _amax_amin,
    "amin": _amax_amin,
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "var": _var,
    "std": _std,
}

# ops whose results are never differentiable (bool results): gradients stop there
NOT_DIFFERENTIABLE = frozenset({"eq", "ne", "ge", "gt", "le", "lt", "rand_like"})


def formula(op_name: str) -> Optional[Callable]:
    return DERIVATIVES.get(op_name)
