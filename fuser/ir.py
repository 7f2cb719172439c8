"""The group IR: what every front door builds and every later stage reads.

A :class:`Group` is a straight-line program of ATen ops (pointwise ones, and reductions: ``fuser/rows/``). It has
inputs (tensors and float scalars), :class:`Node`s that each name one ATen overload (``"aten::add.Tensor"``,
``"aten::gelu"``) with one positional argument per schema argument, and outputs. An argument is a :class:`Value`
of the group, a constant (None, bool, int, float, str, or a :class:`TensorConst`: the 0-dim tensors tracing makes
of Python numbers), a tuple of values (``cat``'s list), or a tuple of ints (a reduction's dims). Everything is a
frozen dataclass: a group never changes once built (a :class:`Builder` builds it).

``Group.text()`` is the canonical printed form: values renumbered in order, constants typed, so two groups have
the same text exactly when they compute the same thing the same way. It is the kernel store's key and what
debugging shows. The TorchScript pass lowers its ``prim::FusionGroup`` subgraphs to groups
(``fuser/ts_ir.py``); nothing after the pass reads a TorchScript graph.

Values may carry descriptions (a dtype, a rank) that a front door knows; the TorchScript door leaves them
unset, so one group serves every dtype and rank, and the executor specializes per call.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import torch

TENSOR, FLOAT = "Tensor", "float"
# c10::ScalarType codes: how an ATen schema's ``ScalarType? dtype`` argument is given in the group IR
SCALAR_TYPE_CODE = {torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex64: 9, torch.complex128: 10,
                    torch.bool: 11, torch.bfloat16: 15, torch.int32: 3, torch.int64: 4}
CAT = "aten::cat"
AUTOGRAD = "autograd"  # Node.origin of a generated backward's gradient nodes (fuser.backward)


@dataclass(frozen=True)
class Value:
    """A value of a group: a tensor or a float scalar. ``id`` is unique within its group."""

    id: int
    kind: str = TENSOR
    dtype: Optional[torch.dtype] = None  # a description a front door knows (None: any)
    rank: Optional[int] = None

    @property
    def is_tensor(self) -> bool:
        return self.kind == TENSOR


@dataclass(frozen=True)
class TensorConst:
    """A small constant tensor (tracing turns a Python number into a 0-dim one), held by value."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    values: tuple  # flat, row-major Python numbers

    @staticmethod
    def of(t: torch.Tensor) -> "TensorConst":
        t = t.detach().cpu()
        return TensorConst(t.dtype, tuple(t.shape), tuple(t.reshape(-1).tolist()))

    def tensor(self) -> torch.Tensor:
        return _tensor(self)


@functools.lru_cache(maxsize=1024)
def _tensor(c: TensorConst) -> torch.Tensor:
    return torch.tensor(c.values, dtype=c.dtype).reshape(c.shape)


Constant = Union[None, bool, int, float, str, TensorConst]
Arg = Union[Value, Constant, tuple]


@dataclass(frozen=True)
class Node:
    """``out = op(*args)``: one ATen overload, every schema argument given positionally.

    ``origin``: empty for a node that is an eager op of its own, whose result eager stores in its dtype (so a
    float16/bfloat16 result is rounded before the next op reads it); else the eager op (``"aten::batch_norm"``,
    ``"aten::gelu_backward"``) that this node is one step of, computed in one eager kernel without rounding
    between steps: such a result is held in the compute type unrounded."""

    op: str
    args: tuple
    out: Value
    origin: str = ""

    @property
    def values(self) -> list[Value]:
        """The group values this node reads, in argument order (a list argument's items in place)."""
        out = []
        for a in self.args:
            if isinstance(a, Value):
                out.append(a)
            elif isinstance(a, tuple):
                out.extend(x for x in a if isinstance(x, Value))
        return out


@dataclass(frozen=True)
class Group:
    inputs: tuple[Value, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[Value, ...]
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        defined = set()
        for v in self.inputs:
            if v.id in defined:
                raise ValueError(f"input %{v.id} defined twice")
            defined.add(v.id)
        for n in self.nodes:
            for v in n.values:
                if v.id not in defined:
                    raise ValueError(f"{n.op} reads %{v.id} before it is defined")
            if n.out.id in defined:
                raise ValueError(f"%{n.out.id} defined twice")
            defined.add(n.out.id)
        for v in self.outputs:
            if v.id not in defined:
                raise ValueError(f"output %{v.id} is not defined")

    def producer(self, v: Value) -> Optional[Node]:
        """The node that computes ``v`` (None for an input)."""
        by_id = self._cache.get("producers")
        if by_id is None:
            by_id = self._cache["producers"] = {n.out.id: n for n in self.nodes}
        return by_id.get(v.id)

    def is_input(self, v: Value) -> bool:
        ids = self._cache.get("inputs")
        if ids is None:
            ids = self._cache["inputs"] = frozenset(v.id for v in self.inputs)
        return v.id in ids

    def cat_pieces(self, v: Value) -> Optional[tuple[Value, ...]]:
        """The pieces of ``v`` if a ``cat`` made it, else None (a kernel writes such an output piece by piece)."""
        n = self.producer(v)
        return n.args[0] if n is not None and n.op == CAT else None

    def text(self) -> str:
        """The canonical text (see the module's doc)."""
        got = self._cache.get("text")
        if got is None:
            got = self._cache["text"] = _print(self)
        return got

    def __str__(self) -> str:
        return self.text()

    def pruned(self) -> "Group":
        """This group without the nodes no output depends on (inputs stay)."""
        live = {v.id for v in self.outputs}
        keep = []
        for n in reversed(self.nodes):
            if n.out.id in live:
                keep.append(n)
                live.update(v.id for v in n.values)
        return Group(self.inputs, tuple(reversed(keep)), self.outputs)

    def with_inputs(self, keep: Sequence[int]) -> "Group":
        """This group with only the inputs at positions ``keep`` (the others must be unused)."""
        drop = {v.id for j, v in enumerate(self.inputs) if j not in set(keep)}
        if any(v.id in drop for n in self.nodes for v in n.values) or any(v.id in drop for v in self.outputs):
            raise ValueError("with_inputs: a dropped input is used")
        return Group(tuple(self.inputs[j] for j in keep), self.nodes, self.outputs)


def _literal(c) -> str:
    if c is None:
        return "None"
    if isinstance(c, bool):
        return "true" if c else "false"
    if isinstance(c, int):
        return str(c)
    if isinstance(c, float):  # repr round-trips; it always has '.', 'e', 'inf' or 'nan', so never reads as an int
        return repr(c) if math.isfinite(c) or math.isnan(c) else ("inf" if c > 0 else "-inf")
    if isinstance(c, str):
        return json.dumps(c)
    if isinstance(c, TensorConst):
        dt = str(c.dtype).replace("torch.", "")
        return f"tensor({dt}, {list(c.shape)}, [{', '.join(_literal(x) for x in c.values)}])"
    raise TypeError(f"not a constant of the group IR: {c!r}")


def _describe(v: Value) -> str:
    extra = [str(v.dtype).replace("torch.", "")] if v.dtype is not None else []
    if v.rank is not None:
        extra.append(f"rank {v.rank}")
    return v.kind + (f"({', '.join(extra)})" if extra else "")


def _print(g: Group) -> str:
    names: dict[int, str] = {}
    lines = []
    for v in g.inputs:
        names[v.id] = f"%{len(names)}"
        lines.append(f"in {names[v.id]}: {_describe(v)}")

    def arg(a) -> str:
        if isinstance(a, Value):
            return names[a.id]
        if isinstance(a, tuple):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        return _literal(a)

    for n in g.nodes:
        args = ", ".join(arg(a) for a in n.args)
        names[n.out.id] = f"%{len(names)}"
        of = f"  # of {n.origin}" if n.origin else ""
        lines.append(f"{names[n.out.id]}: {_describe(n.out)} = {n.op}({args}){of}")
    lines.append("return " + ", ".join(names[v.id] for v in g.outputs))
    return "\n".join(lines)


# ---- schemas: what an op name means -------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    name: str
    type: str  # TorchScript's type text: "Tensor", "Optional[Tensor]", "number", "List[Tensor]", "str"...
    kwarg_only: bool
    default: object = None
    has_default: bool = False


@functools.lru_cache(maxsize=None)
def schema(op: str):
    """The ``torch._C.FunctionSchema`` of an ATen overload name (``"aten::add.Tensor"``, ``"aten::abs"``)."""
    base, _, overload = op.partition(".")
    for s in torch._C._jit_get_schemas_for_operator(base):
        if s.overload_name == overload:
            return s
    raise ValueError(f"no ATen schema {op!r}")


@functools.lru_cache(maxsize=None)
def params(op: str) -> tuple[Param, ...]:
    return tuple(Param(a.name, str(a.type), a.kwarg_only, a.default_value if a.has_default_value() else None,
                       a.has_default_value()) for a in schema(op).arguments)


def name_of(s) -> str:
    """The overload name of a ``torch._C.FunctionSchema``."""
    return f"{s.name}.{s.overload_name}" if s.overload_name else s.name


def _accepts(ptype: str, a, numbers_as_tensors: bool = False) -> bool:
    """Whether argument ``a`` fits a parameter of type ``ptype``. ``numbers_as_tensors``: a Python number in a
    Tensor parameter too (TorchScript converts it, as eager's Python binding does: ``mul.Tensor(x, 0.5)``)."""
    optional = ptype.startswith("Optional[")
    t = ptype[9:-1] if optional else ptype
    if a is None:
        return optional
    if numbers_as_tensors and t == "Tensor" and isinstance(a, (bool, int, float)):
        return True
    if isinstance(a, Value):
        return t == "Tensor" if a.is_tensor else t in ("number", "float")
    if isinstance(a, TensorConst):
        return t == "Tensor"
    if isinstance(a, tuple):  # cat's list of values, or a constant list of ints (a reduction's dims)
        if t == "List[int]":
            return all(isinstance(x, int) and not isinstance(x, bool) for x in a)
        return t == "List[Tensor]" and all(isinstance(x, Value) and x.is_tensor for x in a)
    if isinstance(a, bool):
        return t in ("bool", "number")
    if isinstance(a, int):
        return t in ("int", "number", "float")
    if isinstance(a, float):
        return t in ("float", "number")
    if isinstance(a, str):
        return t == "str"
    return False


def resolve(name: str, args: Sequence, candidates: Optional[Iterable[str]] = None) -> tuple[str, tuple]:
    """The overload of ``name`` (``"aten::add"``) that takes ``args`` as TorchScript's schema matching would,
    and the arguments completed with the schema's defaults. ``candidates``: the overload names to try, in order
    (default: all of the op's). Raises TypeError when none takes them."""
    names = list(candidates) if candidates is not None else [
        name_of(s) for s in torch._C._jit_get_schemas_for_operator(name)]
    for op in names:
        ps = params(op)
        if len(args) > len(ps) or any(not p.has_default for p in ps[len(args):]):
            continue
        if any(p.name == "out" for p in ps):
            continue
        if all(_accepts(p.type, a) for p, a in zip(ps, args)):
            return op, tuple(args) + tuple(p.default for p in ps[len(args):])
    raise TypeError(f"no overload of {name} takes {list(args)!r}")


class Builder:
    """Builds a :class:`Group`: ``input()``, then ``add(op, *args)`` per node, then ``build(outputs)``."""

    def __init__(self):
        self._next = 0
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.origin = ""  # given to every node added (see Node.origin); set it with ``steps_of``

    @contextlib.contextmanager
    def steps_of(self, origin: str):
        """Within this context every node added is a step of the eager op ``origin`` (see :attr:`Node.origin`)."""
        outer, self.origin = self.origin, origin
        try:
            yield self
        finally:
            self.origin = outer

    def _value(self, kind: str, dtype=None, rank=None) -> Value:
        v = Value(self._next, kind, dtype, rank)
        self._next += 1
        return v

    def input(self, kind: str = TENSOR, dtype: Optional[torch.dtype] = None, rank: Optional[int] = None) -> Value:
        if kind not in (TENSOR, FLOAT):
            raise ValueError(f"a group's inputs are tensors and floats, not {kind}")
        v = self._value(kind, dtype, rank)
        self.inputs.append(v)
        return v

    def add(self, op: str, *args, dtype: Optional[torch.dtype] = None) -> Value:
        """``op(*args)`` appended; ``op`` an overload name, ``args`` every schema argument."""
        ps = params(op)
        if len(args) != len(ps):
            raise TypeError(f"{op} takes {len(ps)} arguments, got {len(args)}")
        for p, a in zip(ps, args):
            if not _accepts(p.type, a, numbers_as_tensors=True):
                raise TypeError(f"{op}: argument {p.name} ({p.type}) cannot be {a!r}")
        out = self._value(TENSOR, dtype)
        self.nodes.append(Node(op, tuple(args), out, self.origin))
        return out

    def call(self, name: str, *args, candidates: Optional[Iterable[str]] = None) -> Value:
        """``name(*args)`` with the overload resolved from the arguments (see :func:`resolve`)."""
        op, full = resolve(name, args, candidates)
        return self.add(op, *full)

    def build(self, outputs: Sequence[Value]) -> Group:
        return Group(tuple(self.inputs), tuple(self.nodes), tuple(outputs))
