"""What the torch.compile door may put in a group: one FX node of an ATen graph at a time.

A node is taken when it calls an ATen overload of fuser's op table (``fuser/ops.py``; the table is keyed by the
same overload names the group IR uses, ``"aten::add.Tensor"``), computes a tensor of a dtype the kernels hold on
a CPU or CUDA device, reads only tensors of such dtypes on that device, and takes every other argument as a
constant the group IR holds. As in the TorchScript pass: nothing that mutates or aliases. ``rand_like`` is in the
op table, and joins a group as it does there: the kernel draws its numbers with its own Philox generator seeded from
torch's (``fuser/rng.py``; not the numbers eager draws, as with Inductor's default); ``native_dropout`` is not in the
table and stays ATen, so ``nn.Dropout`` keeps eager's random stream. :func:`reason` says why a node is not taken;
``fuser.explain`` shows it.

Only dtypes and devices are read from the fake values (``node.meta["val"]``), never sizes: reading a symbolic
size would install a guard and make Dynamo recompile per size.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from .. import ir, ops
from ..descs import DTYPES, family
from ..frontend.datatype import SCALAR_TYPE_CODE

_CONSTANT_TYPES = (type(None), bool, int, float, str)
DEVICE_TYPES = ("cpu", "cuda")


def overload_name(node: torch.fx.Node) -> Optional[str]:
    """``"aten::add.Tensor"`` for a call of ``torch.ops.aten.add.Tensor``; None for other nodes."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        return t.name()
    return None


def is_compute(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an op that ``fuser.explain`` reports (not a placeholder, output, getitem or attr)."""
    return node.op in ("call_function", "call_module", "call_method") and node.target is not operator.getitem


def is_barrier(node: torch.fx.Node) -> bool:
    """Whether ``node`` has an effect besides its result (a mutation such as the ``copy_`` that writes an input
    back, a print) or draws random numbers: its order against every other node is kept, and no group spans it
    (as no group crosses a side effect in the TorchScript pass). A random op may be a group's first or last node (the
    group then spans no other effect), whose kernel then draws the numbers."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and (
            t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags):
        return True
    return node.is_impure()


def fake(x) -> Optional[torch.Tensor]:
    """The fake tensor of a node (its ``meta["val"]``), or None where the node is not a tensor."""
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None
    return None


def full_args(node: torch.fx.Node, op: str) -> tuple:
    """Every schema argument of ``node`` positionally: its args, then its kwargs by name, then defaults."""
    ps = ir.params(op)
    args = list(node.args)
    if len(args) > len(ps):
        raise TypeError(f"{op} takes {len(ps)} arguments, the graph gives {len(args)}")
    for p in ps[len(args):]:
        if p.name in node.kwargs:
            args.append(node.kwargs[p.name])
        elif p.has_default:
            args.append(p.default)
        else:
            raise TypeError(f"{op}: argument {p.name} missing")
    extra = set(node.kwargs) - {p.name for p in ps}
    if extra:
        raise TypeError(f"{op}: unknown keyword arguments {sorted(extra)}")
    if op in ("aten::_to_copy", "aten::rand_like") and args:
        # a cast, or rand_like, that names the input's own layout and device and no pinned memory: dtype alone
        v = fake(args[0]) if isinstance(args[0], torch.fx.Node) else None
        names = [p.name for p in ps]
        # contiguous_format of a contiguous input is its own strides: what preserve_format (None) gives
        for name, same in (("layout", lambda a: a == torch.strided), ("pin_memory", lambda a: a is False),
                           ("device", lambda a: v is not None and torch.device(a) == v.device),
                           ("memory_format", lambda a: a == torch.preserve_format or (
                               a == torch.contiguous_format and v is not None and v.is_contiguous()))):
            i = names.index(name)
            if args[i] is not None and same(args[i]):
                args[i] = None
    return tuple(args)


def tensor_constant(node) -> Optional[ir.TensorConst]:
    """The constant a node stands for, where a group may hold it by value: ``aten::scalar_tensor`` of a number
    (decompositions make ``where(c, x, scalar_tensor(0.0))``). Held as a 0-dim tensor, so type promotion stays
    a 0-dim tensor's."""
    if not isinstance(node, torch.fx.Node) or node.target is not _SCALAR_TENSOR or len(node.args) != 1:
        return None
    value, v = node.args[0], fake(node)
    if not isinstance(value, (bool, int, float)) or v is None or v.dtype not in DTYPES:
        return None
    if set(node.kwargs) - {"dtype", "device", "layout", "pin_memory"} or node.kwargs.get("layout") not in (
            None, torch.strided) or node.kwargs.get("pin_memory"):
        return None
    # a constant is a CPU tensor: on another device only ops whose eager kernels take a CPU scalar may read it
    # (the interpreter calls the eager op with it when a group falls back)
    if v.device.type != "cpu" and not all(overload_name(u) in _TAKE_CPU_SCALARS for u in node.users):
        return None
    # the value as the tensor holds it (0 in a float32 tensor is 0.0): one canonical text per constant
    return ir.TensorConst(v.dtype, (), (torch.tensor(value, dtype=v.dtype).item(),))


_SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default
_TAKE_CPU_SCALARS = frozenset(["aten::where.self", "aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor",
                               "aten::div.Tensor", "aten::maximum", "aten::minimum"] + [
    f"aten::{c}.Tensor" for c in ("eq", "ne", "lt", "le", "gt", "ge")])


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def reason(node: torch.fx.Node) -> Optional[str]:
    """None when ``node`` may join a group; else why not, in words."""
    name = overload_name(node)
    if name is None:
        t = node.target
        what = getattr(t, "__name__", None) or str(t)
        return f"not an ATen op ({what}): left to its own implementation"
    schema = node.target._schema
    if schema.is_mutable:
        return f"{name} mutates an argument (a side effect: groups never cross one)"
    if any(r.alias_info is not None for r in schema.returns):
        return f"{name} returns a view of its input (aliasing: a group's outputs are fresh tensors)"
    op = ops.of(name)
    if op is None and ops.reduction(name) is not None:
        return _reduction_reason(node, name)
    if op is None:
        return f"{name} is not in fuser's op table"
    if op.concat:
        return f"{name}: cat is left to ATen by the torch.compile door"
    out = fake(node)
    if out is None:
        return f"{name} does not compute one tensor here"
    try:
        args = full_args(node, name)
    except TypeError as e:
        return str(e)
    device = out.device
    for p, a in zip(ir.params(name), args):
        if isinstance(a, torch.fx.Node):
            if tensor_constant(a) is not None:
                continue
            v = fake(a)
            if v is None:
                val = a.meta.get("val")
                what = (f"the symbolic value {val}" if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))
                        else "a value the graph does not describe as a tensor")
                return f"{name}: argument {p.name} is {what}, not a tensor a group takes"
            if v.dtype not in DTYPES:
                return f"{name}: argument {p.name} has dtype {_dtype(v.dtype)}, which fuser's kernels do not hold"
            if v.device != device:
                return f"{name}: argument {p.name} is on {v.device}, the result on {device}"
        elif not isinstance(constant(a), _CONSTANT_TYPES) or not ir._accepts(p.type, constant(a),
                                                                               numbers_as_tensors=True):
            return f"{name}: argument {p.name} is {type(a).__name__} {a!r}, not a constant a group holds"
        elif op.variant_arg is not None and p is ir.params(name)[op.variant_arg] and a not in op.exprs:
            return f"{name}: {p.name}={a!r} has no expression in the op table"
    if out.dtype not in DTYPES:
        return f"{name} computes dtype {_dtype(out.dtype)}, which fuser's kernels do not hold"
    if device.type not in DEVICE_TYPES:
        return f"{name} runs on device {device.type} (fuser compiles for cpu and cuda)"
    if op.compute == "result":
        variant = args[op.variant_arg] if op.variant_arg is not None else None
        if op.template(variant, family(out.dtype), device.type) is None:
            return f"{name} has no {_dtype(out.dtype)} form in the op table (it computes in the result's dtype)"
    return None


_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def reduced_dims(node: torch.fx.Node) -> Optional[tuple]:
    """The dims a reduction or normalization node (``ops.Reduction``) reduces, when they are constants: the
    trailing dims of its input's rank, negative (-k..-1: a row kernel's); or for a sum, mean, amax or amin the
    leading dims, from 0 (0..k-1: a column kernel's, ``fuser/rows/outer.py``) (a rank is no symbolic size: no
    guard); else None."""
    name = overload_name(node)
    v = fake(node.args[0]) if node.args else None
    if name is None or ops.reduction(name) is None or v is None:
        return None
    try:
        args = full_args(node, name)
    except TypeError:
        return None
    dims = ops.reduced_dims(name, args)
    rank = v.dim()
    if not dims or not rank or any(not -rank <= d < rank for d in dims):
        return None
    dims = tuple(sorted({d % rank - rank for d in dims}))
    if dims == tuple(range(-len(dims), 0)):
        return dims
    lead = tuple(d + rank for d in dims)
    red = ops.reduction(name)
    return lead if lead == tuple(range(len(lead))) and not (red.variance or red.composite) else None


def constant(a):
    """A constant argument as the group IR holds it: a list of ints (dims, a normalized shape) as a tuple, a dtype
    (``_to_copy(x, dtype=torch.float32)``, which decompositions put around reduced-precision steps) as its c10
    ScalarType code, as TorchScript gives it."""
    if isinstance(a, torch.dtype):
        return SCALAR_TYPE_CODE.get(a, a)
    return tuple(a) if isinstance(a, list) else a


def _reduction_reason(node: torch.fx.Node, name: str) -> Optional[str]:
    """As :func:`reason`, for a reduction or a normalization kept whole (``ops.Reduction``): a row kernel runs it
    (``fuser/rows/``) over trailing dims, with constant arguments besides a normalization's weight and bias."""
    out = fake(node)
    if out is None:
        return f"{name} does not compute one tensor here"
    if reduced_dims(node) is None:
        return (f"{name} reduces dims that are not constants, nor its input's trailing dims (a row kernel), nor "
                f"for a sum, mean, amax or amin its leading dims (a column kernel)")
    args = full_args(node, name)
    tensors = (0,) + ops.COMPOSITE_TENSOR_ARGS.get(name, ())
    for i, (p, a) in enumerate(zip(ir.params(name), args)):
        if isinstance(a, torch.fx.Node):
            v = fake(a)
            if i not in tensors or v is None:
                return f"{name}: argument {p.name} is not a constant a group holds"
            if v.dtype not in _FLOATING or v.device != out.device:
                return f"{name}: argument {p.name} is {_dtype(v.dtype)} on {v.device} (floating, on the result's device)"
        elif not isinstance(a, _CONSTANT_TYPES + (list, tuple)) or not ir._accepts(
                p.type, constant(a), numbers_as_tensors=True):
            return f"{name}: argument {p.name} is {type(a).__name__} {a!r}, not a constant a group holds"
    if out.dtype not in _FLOATING or out.device.type not in DEVICE_TYPES:
        return f"{name} computes {_dtype(out.dtype)} on {out.device.type} (floating reductions on cpu and cuda only)"
    return None


class Support:
    """``reason`` per node, asked once and remembered (the partitioner and ``fuser.explain`` both read it)."""

    def __init__(self):
        self.reasons: dict[torch.fx.Node, Optional[str]] = {}

    def reason(self, node: torch.fx.Node) -> Optional[str]:
        if node not in self.reasons:
            self.reasons[node] = reason(node) if is_compute(node) else "not a compute node"
        return self.reasons[node]

    def takes(self, node: torch.fx.Node) -> bool:
        return self.reason(node) is None
