"""``fd.ops``: the operations of a definition. Each checks its operands (rank, dtype, broadcast) at once, with an
error naming the operand, works out nvFuser's result dtype and shape, and records itself; lowering
(``lower.py``) turns the records into the group IR at the end of the definition.

The pointwise ops with one tensor argument and optional Scalar arguments (``exp``, ``gelu``, ``leaky_relu``...)
are generated from the op table (``fuser/ops.py``); the others are written here with nvFuser's semantics.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .. import ir
from .. import ops as op_table
from .datatype import DataType, as_datatype, category, compute_dtype, of_python, promote
from .handles import Scalar, Sym, Tensor, Vector, describe, show_extent

# table ops whose nvFuser spelling differs, and table entries that are not fd.ops (other doors' spellings)
_SKIP = {"type_as", "cat", "rsub", "pow_scalar", "clamp_tensor", "clamp_min_tensor", "clamp_max_tensor",
         "rand_like", "cast", "clamp_min", "clamp_max"}
# binary ops: fd.ops name -> (ATen op, float op, commutes as (swapped name))
_BINARY = {
    "add": ("aten::add", False, "aten::add"), "sub": ("aten::sub", False, "aten::rsub"),
    "mul": ("aten::mul", False, "aten::mul"), "truediv": ("aten::div", True, None),
    "atan2": ("aten::atan2", True, None), "fmod": ("aten::fmod", False, None),
    "remainder": ("aten::remainder", False, None), "pow": ("aten::pow", False, None),
    "maximum": ("aten::maximum", False, "aten::maximum"), "minimum": ("aten::minimum", False, "aten::minimum"),
}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}  # name -> swapped name
# nvFuser ops this frontend does not have yet: a clear error instead of an AttributeError
NOT_YET = ("cat", "reshape", "permute", "squeeze", "slice", "pad", "gather", "index_select", "take_along_axis",
           "welford", "batch_norm", "cumsum", "argsort", "topk", "matmul", "linear", "iota", "full", "normal",
           "randn_like", "prod", "triu", "real", "imag", "stride_order", "segment_set", "signbit", "exp2", "erfinv",
           "erfcinv", "acosh", "asinh", "atanh", "gcd", "nextafter", "bitwise_left_shift", "bitwise_right_shift",
           "logical_right_shift", "isneginf", "isposinf", "isreal", "set")


def _fail(fd, exc: Exception):
    fd._failed = exc
    return exc


def _is_num(x) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, complex)


def _scalar_dtype(x) -> DataType:
    return x.dtype if isinstance(x, Scalar) else of_python(x)


def _operand(fd, x, op: str, name: str):
    """A Tensor or Scalar of this definition, or a Python number; an error naming the argument otherwise."""
    if isinstance(x, (Tensor, Scalar)):
        if x.fd is not fd:
            raise _fail(fd, ValueError(f"fd.ops.{op}: {name} is {x!r} of another FusionDefinition"))
        return x
    if _is_num(x):
        return x
    raise _fail(fd, TypeError(f"fd.ops.{op}: {name} must be a Tensor, a Scalar or a Python number, got "
                              f"{type(x).__name__} {x!r}"))


def broadcast_extents(fd, op: str, tensors: Sequence[Tensor]) -> tuple:
    """Trailing-aligned broadcast of the tensors' extents (dims declared 1 broadcast; a -1 dim does not, as in
    nvFuser: two run-time sizes must be equal, checked at execute)."""
    rank = max((t.ndim for t in tensors), default=0)
    out = []
    for d in range(rank):
        cur, who = 1, None
        for t in tensors:
            k = d - (rank - t.ndim)
            if k < 0:
                continue
            e = t.extents[k]
            if e == 1:
                continue
            if cur == 1:
                cur, who = e, (t, k)
            elif cur != e:
                if isinstance(cur, int) and isinstance(e, int):
                    raise _fail(fd, ValueError(
                        f"fd.ops.{op}: cannot broadcast {describe(who[0])} dim {who[1]} (size {cur}) with "
                        f"{describe(t)} dim {k} (size {e}): only dims of size 1 broadcast"))
                fd._constraints.append((cur, e, f"fd.ops.{op}: T{who[0].index} dim {who[1]} and T{t.index} dim {k}"))
                if isinstance(e, int):
                    cur, who = e, (t, k)
        out.append(cur)
    return tuple(out)


def _norm_dims(fd, op: str, t: Tensor, dims, name: str = "dims") -> tuple:
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise _fail(fd, TypeError(f"fd.ops.{op}: {name} must be an int or a list of ints, got {dims!r}"))
    out = []
    for d in dims:
        if not -t.ndim <= d < t.ndim:
            raise _fail(fd, IndexError(f"fd.ops.{op}: {name} entry {d} is out of range for {describe(t)} "
                                       f"(expected {-t.ndim}..{t.ndim - 1})"))
        d %= t.ndim
        if d in out:
            raise _fail(fd, ValueError(f"fd.ops.{op}: dim {d} appears twice in {name}={list(dims)}"))
        out.append(d)
    if not out:
        raise _fail(fd, ValueError(f"fd.ops.{op}: {name} is empty (give every dim to reduce all of them)"))
    return tuple(sorted(out))


class Operators:
    """The operations of a FusionDefinition (``fd.ops``). Every op takes Tensors, Scalars and Python numbers
    (constants) where nvFuser takes a Tensor or a Scalar, and returns a new Tensor (a tuple for ``var_mean``).

    Types follow nvFuser: float16/bfloat16 operands are computed in float32 and the result is float32 (except
    ``where``, ``cast`` and reductions); a ``Double`` scalar of a higher category than the tensors (``int_tensor *
    2.5``) makes the result ``Double``; comparisons give ``Bool``; ``div`` truncates integers; ``truediv`` always
    divides exactly. Shapes follow nvFuser: lower-rank operands are aligned to the trailing dims, dims declared 1
    broadcast, other sizes must be equal.
    """

    def __init__(self, fd):
        self._fd = fd

    def __getattr__(self, name: str):
        if name in NOT_YET:
            raise NotImplementedError(f"fd.ops.{name} is an nvFuser op that fuser's FusionDefinition does not support "
                                      f"yet; see help(FusionDefinition.Operators) for the supported ops")
        raise AttributeError(f"fd.ops has no op {name!r}; see help(FusionDefinition.Operators) for the supported ops")

    # ---- the building blocks -----------------------------------------------------------------------------
    def _pointwise(self, op: str, aten: str, args: Sequence, *, float_op=False, compare=False, half_to_float=True,
                   swapped: Optional[str] = None, extra: tuple = (), shown: bool = True):
        """``extra``: arguments after the tensors' (Scalars, numbers, strings) passed to the ATen op as they are;
        ``shown``: whether the printed record shows them (div's rounding mode is implied by its operands)."""
        fd = self._fd
        fd._check_open()
        names = ("self", "other", "third", "fourth")
        vals = [_operand(fd, a, op, names[i]) for i, a in enumerate(args)]
        tensors = [v for v in vals if isinstance(v, Tensor)]
        scalars = [_scalar_dtype(v) for v in vals if not isinstance(v, Tensor)]
        if not tensors:
            return self._scalar_op(op, aten, vals, float_op, compare, extra)
        common = promote([t.dtype for t in tensors], scalars)
        comp = compute_dtype(common, float_op, half_to_float)
        out_dtype = DataType.Bool if compare else comp
        extents = broadcast_extents(fd, op, tensors)
        for e in extra:
            if isinstance(e, (Tensor, Scalar)) and e.fd is not fd:
                raise _fail(fd, ValueError(f"fd.ops.{op}: {e!r} is of another FusionDefinition"))
        raw = tuple(_spec(e) if isinstance(e, Scalar) else ("raw", e) for e in extra)
        plan = ("node", aten, tuple(_spec(v) for v in vals), comp, out_dtype, swapped, raw)
        return fd._record(op, tuple(vals) + (tuple(extra) if shown else ()), (), [("T", out_dtype, extents)], plan)[0]

    def _scalar_op(self, op, aten, vals, float_op, compare, extra):
        fd = self._fd
        if any(isinstance(v, Scalar) and v.symbolic for v in vals):
            raise _fail(fd, NotImplementedError(f"fd.ops.{op} of symbolic scalars only: not supported yet (give it "
                                                "a tensor operand, or constants)"))
        dts = [_scalar_dtype(v) for v in vals]
        common = promote([], dts)
        comp = compute_dtype(common, float_op, False)
        if any(isinstance(e, Scalar) for e in extra):
            raise _fail(fd, NotImplementedError(f"fd.ops.{op} of constants with Scalar arguments: not supported yet"))
        # folded now, by eager's own op on 0-dim tensors of the compute dtype
        consts = [ir.TensorConst.of(torch.tensor(v.value if isinstance(v, Scalar) else v, dtype=comp.torch_dtype))
                  for v in vals]
        name, full = ir.resolve(aten, consts + list(extra))
        from ..fallback import _overload
        fn, kw, n_pos = _overload(name)
        args = [a.tensor() if isinstance(a, ir.TensorConst) else a for a in full]
        value = fn(*args[:n_pos], **dict(zip(kw, args[n_pos:]))).item()
        dt = DataType.Bool if compare else comp
        return fd.define_scalar(value, dtype=dt)

    # ---- binary and ternary pointwise ops ----------------------------------------------------------------
    def div(self, a, b):
        """a / b. Integers: truncated division (C's, ``torch.div(rounding_mode="trunc")``); floats: division."""
        ints = all(category(x.dtype if isinstance(x, (Tensor, Scalar)) else of_python(x)) < 2
                   for x in (a, b) if isinstance(x, (Tensor, Scalar)) or _is_num(x))
        if ints:
            return self._pointwise("div", "aten::div", (a, b), extra=("trunc",), shown=False)
        return self._pointwise("div", "aten::div", (a, b))

    def where(self, cond, a, b):
        """where(cond, a, b): a where cond (a Bool tensor) is true, else b. Keeps float16/bfloat16."""
        fd = self._fd
        c = _operand(fd, cond, "where", "condition")
        if not isinstance(c, Tensor) or c.dtype is not DataType.Bool:
            raise _fail(fd, TypeError(f"fd.ops.where: the condition must be a Bool tensor, got "
                                      f"{describe(c) if isinstance(c, Tensor) else repr(c)}"))
        return self._pointwise("where", "aten::where", (c, a, b), half_to_float=False)

    def lerp(self, start, end, weight):
        """start + weight * (end - start)."""
        return self._pointwise("lerp", "aten::lerp", (start, end, weight))

    def addcmul(self, a, b, c, value=1.0):
        """a + value * b * c."""
        return self._pointwise("addcmul", "aten::addcmul", (a, b, c), extra=(value,))

    def clamp(self, x, min=None, max=None):  # noqa: A002
        """min(max(x, min), max) with Scalar bounds (either may be None)."""
        return self._table_op("clamp", "aten::clamp", x, (min, max))

    def threshold(self, x, threshold, value):
        """x <= threshold ? value : x."""
        return self._table_op("threshold", "aten::threshold", x, (threshold, value))

    def mod(self, a, b):
        """C's % (the sign of the dividend): ``fmod``."""
        return self.fmod(a, b)

    def cast(self, x, dtype):
        """x converted to ``dtype`` (a DataType)."""
        fd = self._fd
        fd._check_open()
        x = _operand(fd, x, "cast", "self")
        dt = as_datatype(dtype, "fd.ops.cast: dtype")
        if isinstance(x, Scalar) or _is_num(x):
            if isinstance(x, Scalar) and x.symbolic:
                raise _fail(fd, NotImplementedError("fd.ops.cast of a symbolic scalar: not supported yet"))
            v = x.value if isinstance(x, Scalar) else x
            return fd.define_scalar(torch.tensor(v).to(dt.torch_dtype).item(), dtype=dt)
        return fd._record("cast", (x,), (("dtype", dt),), [("T", dt, x.extents)], ("cast", x.index, dt))[0]

    # ---- shape ops ---------------------------------------------------------------------------------------
    def shape(self, x) -> Vector:
        """The sizes of tensor x, as a Vector for ``broadcast_in_dim``/``expand``."""
        fd = self._fd
        fd._check_open()
        if not isinstance(x, Tensor):
            raise _fail(fd, TypeError(f"fd.ops.shape: expected a Tensor, got {x!r}"))
        return fd._record("shape", (x,), (), [("V", None, x.extents)], ("shape",))[0]

    def _shape_arg(self, op: str, shape) -> tuple:
        fd = self._fd
        if isinstance(shape, Vector):
            return shape.extents
        if isinstance(shape, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            if any(s < -1 for s in shape):
                raise _fail(fd, ValueError(f"fd.ops.{op}: shape {list(shape)} has a size below -1"))
            return tuple(shape)
        raise _fail(fd, TypeError(f"fd.ops.{op}: shape must be a list of ints or a Vector, got {shape!r}"))

    def broadcast_in_dim(self, x, shape, broadcast_dims):
        """x broadcast to ``shape``: input dim i becomes output dim ``broadcast_dims[i]`` (strictly increasing);
        the other output dims are new. A size-1 input dim may be expanded; -1 in ``shape`` keeps the input's
        size (for a new dim: a broadcast dim of size 1)."""
        fd = self._fd
        fd._check_open()
        x = _operand(fd, x, "broadcast_in_dim", "self")
        if not isinstance(x, Tensor):
            raise _fail(fd, TypeError(f"fd.ops.broadcast_in_dim: expected a Tensor, got {x!r}"))
        out = self._shape_arg("broadcast_in_dim", shape)
        bdims = list(broadcast_dims)
        if len(bdims) != x.ndim:
            raise _fail(fd, ValueError(f"fd.ops.broadcast_in_dim: broadcast_dims has {len(bdims)} entries, but "
                                       f"{describe(x)} has {x.ndim} dims (one entry per input dim)"))
        if len(out) < x.ndim:
            raise _fail(fd, ValueError(f"fd.ops.broadcast_in_dim: output shape {list(map(show_extent, out))} has "
                                       f"fewer dims than {describe(x)}"))
        if any(not isinstance(d, int) or not 0 <= d < len(out) for d in bdims) or any(
                a >= b for a, b in zip(bdims, bdims[1:])):
            raise _fail(fd, ValueError(f"fd.ops.broadcast_in_dim: broadcast_dims {bdims} must be strictly "
                                       f"increasing dims of the output (0..{len(out) - 1})"))
        return self._broadcast("broadcast_in_dim", x, out, bdims,
                               (x, list(map(show_extent, out)) if not isinstance(shape, Vector) else shape, bdims),
                               ("shape", "broadcast_dims"))

    def _broadcast(self, op, x: Tensor, out: tuple, bdims: list, args: tuple, names: tuple):
        fd = self._fd
        ext = [(1 if e == -1 else e) for e in out]
        for i, d in enumerate(bdims):
            xe, oe = x.extents[i], out[d]
            if oe == -1 or oe == xe:
                ext[d] = xe
            elif xe == 1:
                ext[d] = oe
            elif isinstance(xe, int) and isinstance(oe, int):
                raise _fail(fd, ValueError(f"fd.ops.{op}: {describe(x)} dim {i} has size {xe} and cannot broadcast "
                                           f"to size {oe} (output dim {d}); only size-1 dims broadcast"))
            else:
                fd._constraints.append((xe, oe, f"fd.ops.{op}: T{x.index} dim {i} and output dim {d}"))
                ext[d] = oe if isinstance(oe, int) else xe
        kwargs = tuple(zip(names, args[1:]))
        return fd._record(op, args[:1], kwargs, [("T", x.dtype, tuple(ext))],
                          ("bcast", x.index, tuple(ext), tuple(bdims)))[0]

    def broadcast(self, x, is_broadcast_dim):
        """x with new size-1 dims where ``is_broadcast_dim`` is True (its False entries are x's dims, in order)."""
        fd = self._fd
        fd._check_open()
        flags = list(is_broadcast_dim)
        if not isinstance(x, Tensor) or sum(not f for f in flags) != x.ndim:
            raise _fail(fd, ValueError(f"fd.ops.broadcast: is_broadcast_dim {flags} must have one False entry per "
                                       f"dim of {describe(x) if isinstance(x, Tensor) else repr(x)}"))
        bdims = [i for i, f in enumerate(flags) if not f]
        return self._broadcast("broadcast", x, tuple(-1 for _ in flags), bdims, (x, flags), ("is_broadcast_dim",))

    def expand(self, x, shape):
        """x with its size-1 dims expanded to ``shape`` (same rank; -1 keeps a size)."""
        fd = self._fd
        fd._check_open()
        out = self._shape_arg("expand", shape)
        if not isinstance(x, Tensor) or len(out) != x.ndim:
            raise _fail(fd, ValueError(f"fd.ops.expand: shape {list(map(show_extent, out))} must have the rank of "
                                       f"{describe(x) if isinstance(x, Tensor) else repr(x)}"))
        return self._broadcast("expand", x, out, list(range(x.ndim)),
                               (x, shape if isinstance(shape, Vector) else list(out)), ("shape",))

    # ---- reductions --------------------------------------------------------------------------------------
    def _reduce(self, op: str, aten: str, x, dims, keepdim: bool, dtype, extra: tuple = (), extra_kw: tuple = (),
                float_only: bool = False, outputs: int = 1):
        fd = self._fd
        fd._check_open()
        if not isinstance(x, Tensor) or x.fd is not fd:
            raise _fail(fd, TypeError(f"fd.ops.{op}: expected a Tensor of this definition, got {x!r}"))
        rd = _norm_dims(fd, op, x, list(range(x.ndim)) if dims is None else dims)
        if not isinstance(keepdim, bool):
            raise _fail(fd, TypeError(f"fd.ops.{op}: keepdim must be a bool, got {keepdim!r}"))
        dt = DataType.Null if dtype is None else as_datatype(dtype, f"fd.ops.{op}: dtype")
        if float_only and category(x.dtype) not in (2, 3) and dt is DataType.Null:
            raise _fail(fd, TypeError(f"fd.ops.{op}: {describe(x)} must be a floating-point tensor "
                                      f"(cast it first)"))
        if dt is not DataType.Null:
            out_dt = dt
        elif aten == "aten::sum.dim_IntList" and category(x.dtype) < 2:
            out_dt = DataType.Int  # nvFuser and eager sum bools and ints as int64
        else:
            out_dt = x.dtype
        ext = tuple((1 if d in rd else e) for d, e in enumerate(x.extents) if keepdim or d not in rd)
        kwargs = (("dims", list(rd)),) + tuple(extra_kw) + (("keepdim", keepdim),)
        if aten in ("aten::sum.dim_IntList", "aten::mean.dim"):
            kwargs += (("dtype", dt),)
        plan = ("reduce", aten, x.index, rd, keepdim, dt, extra)
        return fd._record(op, (x,), kwargs, [("T", out_dt, ext)] * outputs, plan)

    def sum(self, x, dims=None, keepdim: bool = False, dtype=None):
        """Sum over ``dims`` (an int or a list; None: all), in ``dtype`` when given (DataType.Null: x's)."""
        return self._reduce("sum", "aten::sum.dim_IntList", x, dims, keepdim, _null(dtype))[0]

    def mean(self, x, dims=None, keepdim: bool = False, dtype=None):
        """Mean over ``dims``."""
        return self._reduce("mean", "aten::mean.dim", x, dims, keepdim, _null(dtype), float_only=True)[0]

    def amax(self, x, dims=None, keepdim: bool = False):
        """Maximum over ``dims``."""
        return self._reduce("amax", "aten::amax", x, dims, keepdim, None)[0]

    def amin(self, x, dims=None, keepdim: bool = False):
        """Minimum over ``dims``."""
        return self._reduce("amin", "aten::amin", x, dims, keepdim, None)[0]

    def max(self, x, dims=None, keepdim: bool = False, dtype=None):  # noqa: A003 - nvFuser's name
        """nvFuser's max reduction: ``amax`` over ``dims``."""
        return self._minmax("max", "aten::amax", x, dims, keepdim, dtype)

    def min(self, x, dims=None, keepdim: bool = False, dtype=None):  # noqa: A003 - nvFuser's name
        """nvFuser's min reduction: ``amin`` over ``dims``."""
        return self._minmax("min", "aten::amin", x, dims, keepdim, dtype)

    def _minmax(self, op, aten, x, dims, keepdim, dtype):
        dt = _null(dtype)
        if dt is not None and isinstance(x, Tensor) and as_datatype(dt, f"fd.ops.{op}: dtype") is not x.dtype:
            raise _fail(self._fd, NotImplementedError(f"fd.ops.{op} with a dtype other than the input's: not "
                                                      "supported yet (cast the result)"))
        return self._reduce(op, aten, x, dims, keepdim, None)[0]

    def var(self, x, dims=None, correction=1, keepdim: bool = False):
        """Variance over ``dims`` with ``correction`` (1: Bessel's)."""
        return self._reduce("var", "aten::var.correction", x, dims, keepdim, None, (correction,),
                            (("correction", correction),), float_only=True)[0]

    def var_mean(self, x, dims=None, correction=1, keepdim: bool = False):
        """(variance, mean) over ``dims``."""
        return tuple(self._reduce("var_mean", "var_mean", x, dims, keepdim, None, (correction,),
                                  (("correction", correction),), float_only=True, outputs=2))

    # ---- random numbers ----------------------------------------------------------------------------------
    def rand_like(self, x, rng_seed=None, rng_offset=None):
        """Uniform random numbers in [0, 1) with x's shape and dtype (fresh numbers every execute)."""
        fd = self._fd
        fd._check_open()
        if rng_seed is not None or rng_offset is not None:
            raise _fail(fd, NotImplementedError("fd.ops.rand_like with rng_seed/rng_offset: not supported yet"))
        if not isinstance(x, Tensor) or category(x.dtype) != 2:
            raise _fail(fd, TypeError(f"fd.ops.rand_like: expected a floating-point Tensor, got "
                                      f"{describe(x) if isinstance(x, Tensor) else repr(x)}"))
        return fd._record("rand_like", (x,), (), [("T", x.dtype, x.extents)], ("rand_like", x.index))[0]

    def uniform(self, minval, maxval, shape, *, rng_seed=None, rng_offset=None, dtype=DataType.Float):
        """Uniform random numbers in [minval, maxval) of ``shape`` (ints or a Vector) and ``dtype``."""
        fd = self._fd
        fd._check_open()
        if rng_seed is not None or rng_offset is not None:
            raise _fail(fd, NotImplementedError("fd.ops.uniform with rng_seed/rng_offset: not supported yet"))
        dt = as_datatype(dtype, "fd.ops.uniform: dtype")
        if category(dt) != 2:
            raise _fail(fd, TypeError(f"fd.ops.uniform: dtype must be a floating-point DataType, got {dt}"))
        ext = self._shape_arg("uniform", shape)
        if any(e == -1 for e in ext):
            raise _fail(fd, ValueError(f"fd.ops.uniform: shape {list(map(show_extent, ext))} has a -1; give sizes "
                                       "or a Vector (t.shape())"))
        lo, hi = (_operand(fd, v, "uniform", n) for v, n in ((minval, "minval"), (maxval, "maxval")))
        for v, n in ((lo, "minval"), (hi, "maxval")):
            if isinstance(v, Tensor):
                raise _fail(fd, TypeError(f"fd.ops.uniform: {n} must be a Scalar or a number, got {describe(v)}"))
        args = (lo, hi, shape if isinstance(shape, Vector) else list(ext))
        return fd._record("uniform", args, (("dtype", dt),), [("T", dt, ext)],
                          ("uniform", _spec(lo), _spec(hi), ext, dt))[0]

    def _table_op(self, name: str, aten: str, x, extra: tuple, float_op: Optional[bool] = None):
        fd = self._fd
        fd._check_open()
        x = _operand(fd, x, name, "self")
        for v in extra:
            if isinstance(v, Tensor):
                raise _fail(fd, TypeError(f"fd.ops.{name}: its arguments after the first must be Scalars or numbers, "
                                          f"got {describe(v)}"))
        if float_op is None:
            float_op = _is_float_op(name)
        return self._pointwise(name, aten, (x,), float_op=float_op, extra=tuple(extra))


def _null(dtype):
    return None if dtype is None or dtype is DataType.Null else dtype


def _spec(v):
    """How lowering sees an operand."""
    if isinstance(v, Tensor):
        return ("T", v.index)
    if isinstance(v, Scalar):
        return ("S", v.index) if v.symbolic else ("c", v.value, v.dtype)
    if isinstance(v, tuple) and v and v[0] in ("raw", "S", "c"):
        return v
    return ("c", v, of_python(v))


@functools.lru_cache(maxsize=None)
def _is_float_op(name: str) -> bool:
    """Ints compute in float (nvFuser's float ops): the table has no integer expression for the op."""
    op = op_table.OPS_BY_NAME[name]
    return all(e.i is None for e in op.exprs.values())


def _make_binary(name: str, aten: str, float_op: bool, swapped: Optional[str]):
    def f(self, a, b):
        return self._pointwise(name, aten, (a, b), float_op=float_op, swapped=swapped)
    f.__name__ = name
    f.__doc__ = (f"{name}(a, b): {aten} of a and b (Tensors, Scalars or numbers), broadcast"
                 + ("; integers computed in float" if float_op else "") + ".")
    return f


def _make_compare(name: str, swapped: str):
    def f(self, a, b):
        return self._pointwise(name, f"aten::{name}", (a, b), compare=True, swapped=f"aten::{swapped}")
    f.__name__ = name
    f.__doc__ = f"{name}(a, b): the comparison aten::{name}, a Bool tensor."
    return f


def _make_table_op(op: op_table.OpDef):
    schema = torch._C.parse_schema(op.schemas[0])
    rest = [a for a in schema.arguments[1:]]
    aten = op.schemas[0].split("(", 1)[0]

    def f(self, x, *args, **kwargs):
        if len(args) > len(rest):
            raise TypeError(f"fd.ops.{op.name} takes at most {len(rest) + 1} arguments")
        vals = list(args) + [None] * (len(rest) - len(args))
        for k, v in kwargs.items():
            names = [a.name for a in rest]
            if k not in names:
                raise TypeError(f"fd.ops.{op.name} has no argument {k!r} (it takes {', '.join(names) or 'none'})")
            vals[names.index(k)] = v
        for i, a in enumerate(rest):
            if vals[i] is None and a.has_default_value():
                vals[i] = a.default_value
        return self._table_op(op.name, aten, x, tuple(vals))
    f.__name__ = op.name
    sig = ", ".join(["x"] + [f"{a.name}={a.default_value!r}" if a.has_default_value() else a.name for a in rest])
    f.__doc__ = (f"{op.name}({sig}): elementwise {aten} (from fuser's op table: fuses)"
                 + ("; integers computed in float" if _is_float_op(op.name) else "") + ".")
    return f


# nvFuser ops outside the op table: ATen nodes of the group IR, which the fallback runs (eager's results) until the
# table takes them; fd.ops name -> (ATen op, arity, Bool result, commutes)
_OUTSIDE = {
    "logical_and": ("aten::logical_and", 2, True, True), "logical_or": ("aten::logical_or", 2, True, True),
    "logical_not": ("aten::logical_not", 1, True, False), "isnan": ("aten::isnan", 1, True, False),
    "isinf": ("aten::isinf", 1, True, False), "isfinite": ("aten::isfinite", 1, True, False),
    "sign": ("aten::sign", 1, False, False), "bitwise_and": ("aten::bitwise_and", 2, False, True),
    "bitwise_or": ("aten::bitwise_or", 2, False, True), "bitwise_xor": ("aten::bitwise_xor", 2, False, True),
    "bitwise_not": ("aten::bitwise_not", 1, False, False),
}


def _make_outside(name: str, aten: str, arity: int, boolean: bool, commutes: bool):
    def f(self, *args):
        if len(args) != arity:
            raise TypeError(f"fd.ops.{name} takes {arity} argument{'s' if arity > 1 else ''}, got {len(args)}")
        return self._pointwise(name, aten, args, compare=boolean, half_to_float=not name.startswith("bitwise"),
                               swapped=aten if commutes else None)
    f.__name__ = name
    f.__doc__ = (f"{name}({', '.join('abc'[:arity])}): elementwise {aten}" + (", a Bool tensor" if boolean else "")
                 + " (outside fuser's op table: runs through the fallback).")
    return f


def _alpha(name: str, aten: str):
    def f(self, a, b, alpha):
        return self._pointwise(name, aten, (a, b), extra=(alpha,))
    f.__name__ = name
    f.__doc__ = f"{name}(a, b, alpha): {aten} with b scaled by alpha (a Scalar or a number)."
    return f


for _name, _e in _OUTSIDE.items():
    setattr(Operators, _name, _make_outside(_name, *_e))
Operators.add_alpha = _alpha("add_alpha", "aten::add")
Operators.sub_alpha = _alpha("sub_alpha", "aten::sub")
for _name, (_aten, _float, _swap) in _BINARY.items():
    setattr(Operators, _name, _make_binary(_name, _aten, _float, _swap))
for _name, _sw in _COMPARE.items():
    setattr(Operators, _name, _make_compare(_name, _sw))
for _op in op_table._OPS:
    if _op.name in _SKIP or hasattr(Operators, _op.name) or _op.concat or _op.random:
        continue
    _s = torch._C.parse_schema(_op.schemas[0])
    if str(_s.arguments[0].type) == "Tensor" and all(str(a.type) in ("Scalar", "number", "str", "Optional[number]")
                                                      or "Scalar" in str(a.type) for a in _s.arguments[1:]):
        setattr(Operators, _op.name, _make_table_op(_op))
