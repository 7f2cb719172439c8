"""The fuzzer's program model: the op catalog (every schema of the op table), programs (the structure the
generator builds and the shrinker edits) and their concrete tensor inputs."""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import ops


# ----------------------------------------------------------------------------------------------------------
# the op catalog: every schema of the op table


@dataclass(eq=False)
class OpSchema:
    op: ops.OpDef
    schema: str
    kind: str  # "aten::add"
    overload: str  # "Tensor", "" for the default overload
    args: list  # [(name, type str, kwarg_only)]

    @property
    def fn(self):
        return getattr(getattr(torch.ops.aten, self.kind.split("::")[1]), self.overload or "default")

    @property
    def id(self) -> str:
        return f"{self.kind.split('::')[1]}.{self.overload}" if self.overload else self.kind.split("::")[1]


def _entry(op: ops.OpDef, schema: str) -> OpSchema:
    s = torch._C.parse_schema(schema)
    return OpSchema(op, schema, s.name, s.overload_name, [(a.name, str(a.type), a.kwarg_only) for a in s.arguments])


def _catalog() -> list[OpSchema]:
    out = []
    for op in ops._OPS:
        if op.random or op.concat or op.cast:  # rand_like's numbers are not eager's (tests/test_random.py checks them);
            continue  # cat takes a list, which the generator does not build (tests/test_concat.py)
        out += [_entry(op, schema) for schema in op.schemas]
    return out


CATALOG = _catalog()


def _reduction_catalog() -> list[OpSchema]:
    """The reductions and normalizations the TorchScript pass fuses (``ops.REDUCTION_DEFS``): the generator adds
    one now and then over the last dim (``generator._add_reduction``), apart from the pointwise catalog so that
    the pointwise programs of a seed stay what they were."""
    return [_entry(op, schema) for schema, op in ops.REDUCTION_DEFS.items()]


REDUCTION_CATALOG = _reduction_catalog()
# the view the generator adds now and then (``generator._add_permute``), apart as the reductions are
VIEW_CATALOG = [_entry(ops.PERMUTE, ops.PERMUTE.schemas[0])]
BY_OP: dict[str, list[OpSchema]] = collections.defaultdict(list)
for _e in CATALOG:
    BY_OP[_e.op.name].append(_e)
OP_NAMES = sorted(BY_OP)

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool",
               torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16"}
_TCONST_TYPES = {torch.float64: "Double", torch.float32: "Float", torch.int64: "Long"}

# ----------------------------------------------------------------------------------------------------------
# programs: the structure the generator builds and the shrinker edits


@dataclass
class Arg:
    """One node argument. kind: "val" (v = ("t", k) a tensor input or ("n", j) a node), "float" (v = index of
    a float graph input), "const" (v = a Python int/float), "none", "str" (v = the string), "tconst" (a 0-dim
    tensor constant: v = its value, dtype), "bool" (v = True/False), "ints" (v = a tuple of ints: dims, a
    normalized shape)."""

    kind: str
    v: Any = None
    dtype: Optional[torch.dtype] = None


@dataclass
class PNode:
    schema: OpSchema
    args: list

    def __getstate__(self):
        return {"schema": self.schema.schema, "args": self.args}

    def __setstate__(self, st):
        self.schema = next(e for e in CATALOG + REDUCTION_CATALOG + VIEW_CATALOG if e.schema == st["schema"])
        self.args = st["args"]


class TensorInput:
    """A concrete input: a 1-d storage and the view over it (size, stride, offset). Pickled as bytes."""

    def __init__(self, storage: torch.Tensor, size, stride, offset: int, layout: str = "contiguous"):
        self.storage = storage
        self.recipe = None  # how the generator made it (not pickled)
        self.size, self.stride, self.offset = tuple(size), tuple(stride), int(offset)
        self.layout = layout

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def view(self, device="cpu") -> torch.Tensor:
        return self.storage.to(device).as_strided(self.size, self.stride, self.offset)

    def compacted(self) -> "TensorInput":
        if any(s == 0 for s in self.size):
            return TensorInput(self.storage[:0].clone(), self.size, self.stride, 0, self.layout)
        end = self.offset + sum((s - 1) * st for s, st in zip(self.size, self.stride)) + 1
        if self.offset == 0 and end == self.storage.numel():
            return self
        return TensorInput(self.storage[self.offset:end].clone(), self.size, self.stride, 0, self.layout)

    def __reduce__(self):
        s = torch.empty(self.storage.numel(), dtype=self.storage.dtype).copy_(self.storage.reshape(-1))
        raw = s.view(torch.uint8).numpy().tobytes() if s.numel() else b""
        return (_tensor_input_from_bytes, (raw, DTYPE_NAMES[s.dtype], self.size, self.stride, self.offset,
                                           self.layout))

    def describe(self) -> str:
        return (f"{DTYPE_NAMES[self.dtype]}{list(self.size)} stride={list(self.stride)} offset={self.offset} "
                f"({self.layout})")


def _tensor_input_from_bytes(raw, dtype_name, size, stride, offset, layout):
    dtype = getattr(torch, dtype_name)
    if raw:
        storage = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).clone()
    else:
        storage = torch.empty(0, dtype=dtype)
    return TensorInput(storage, size, stride, offset, layout)


def _broadcast(*shapes) -> tuple:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, x in enumerate(s):
            d = ndim - len(s) + i
            if x != 1:
                if out[d] not in (1, x):
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                out[d] = x
    return tuple(out)


def _contig(size) -> tuple:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@dataclass
class Program:
    tensors: list  # [TensorInput]
    floats: list  # [float]
    nodes: list  # [PNode]
    outputs: list  # [("n", j)]

    def copy(self) -> "Program":
        return Program(list(self.tensors), list(self.floats),
                       [PNode(n.schema, [dataclasses.replace(a) for a in n.args]) for n in self.nodes],
                       list(self.outputs))

    def args(self, device="cpu") -> list:
        return [t.view(device) for t in self.tensors] + [float(f) for f in self.floats]

    def compact(self) -> "Program":
        """Drop nodes no output needs and inputs nothing uses; renumber."""
        live = set()
        stack = [r for r in self.outputs if r[0] == "n"]
        while stack:
            r = stack.pop()
            if r in live:
                continue
            live.add(r)
            for a in self.nodes[r[1]].args:
                if a.kind == "val" and a.v[0] == "n":
                    stack.append(a.v)
        used_t, used_f = set(), set()
        for j, n in enumerate(self.nodes):
            if ("n", j) in live:
                for a in n.args:
                    if a.kind == "val" and a.v[0] == "t":
                        used_t.add(a.v[1])
                    elif a.kind == "float":
                        used_f.add(a.v)
        tmap = {k: i for i, k in enumerate(sorted(used_t))}
        fmap = {k: i for i, k in enumerate(sorted(used_f))}
        nmap, nodes = {}, []
        for j, n in enumerate(self.nodes):
            if ("n", j) not in live:
                continue
            args = []
            for a in n.args:
                if a.kind == "val":
                    a = Arg("val", ("t", tmap[a.v[1]]) if a.v[0] == "t" else ("n", nmap[a.v[1]]))
                elif a.kind == "float":
                    a = Arg("float", fmap[a.v])
                else:
                    a = dataclasses.replace(a)
                args.append(a)
            nmap[j] = len(nodes)
            nodes.append(PNode(n.schema, args))
        outs = []
        for r in self.outputs:
            if r[0] == "n" and ("n", nmap[r[1]]) not in outs:
                outs.append(("n", nmap[r[1]]))
        return Program([self.tensors[k] for k in sorted(used_t)], [self.floats[k] for k in sorted(used_f)],
                       nodes, outs)
