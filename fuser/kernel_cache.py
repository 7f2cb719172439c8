"""The kernel-spec store: integer keys for registered fusion groups, and each spec's compiled kernels.

Registration normalizes the group's subgraph into a canonical text (value names, shapes and source ranges
left out), so alpha-equivalent groups share one key and one spec. Each spec compiles a kernel once per
arg spec: the first thread to ask puts a future in the map and compiles outside the lock, later threads
wait on the future. A failed compile leaves nothing behind, so the next call tries again.
"""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import ops


def _is_tensor(v: torch._C.Value) -> bool:
    return isinstance(v.type(), torch._C.TensorType)


def canonical_text(graph: torch._C.Graph) -> str:
    """A text that is equal for two graphs exactly when they compute the same thing the same way."""
    ids: dict[int, str] = {}
    lines = []
    for i, v in enumerate(graph.inputs()):
        ids[v.unique()] = f"%i{i}"
        lines.append(f"in {ids[v.unique()]}: {'Tensor' if _is_tensor(v) else v.type().kind()}")
    for j, n in enumerate(graph.nodes()):
        outs = []
        for k, o in enumerate(n.outputs()):
            ids[o.unique()] = f"%n{j}.{k}"
            outs.append(ids[o.unique()])
        if n.kind() == "prim::Constant":
            val = n.output().toIValue() if n.outputsSize() == 1 else None
            if isinstance(val, torch.Tensor):  # repr would round the value
                val = (val.dtype, tuple(val.shape), str(val.device), val.tolist())
            lines.append(f"{outs[0]} = const {n.output().type().kind()} {type(val).__name__} {val!r}")
            continue
        if list(n.blocks()):
            raise ValueError(f"a fusion group cannot hold a node with blocks: {n.kind()}")
        args = ", ".join(ids[v.unique()] for v in n.inputs())
        schema = n.schema()
        lines.append(f"{', '.join(outs)} = {n.kind() if schema == '(no schema)' else schema} ({args})")
    lines.append("return " + ", ".join(ids[v.unique()] for v in graph.outputs()))
    return "\n".join(lines)


def _normalized_copy(graph: torch._C.Graph) -> torch._C.Graph:
    g = graph.copy()
    generic = torch._C.TensorType.get()
    for v in g.inputs():
        if _is_tensor(v):
            v.setType(generic)
    for n in g.nodes():
        for o in n.outputs():
            if _is_tensor(o):
                o.setType(generic)
    return g


@dataclass
class KernelSpec:
    """A registered fusion group: its normalized graph and the kernels compiled for it.

    ``input_is_tensor`` gives, per graph input, whether it is a tensor or a float argument.
    ``output_deps`` gives, per output, the indices (among the tensor inputs) of the tensors that decide its
    shape (``ops.OpDef.shape_args``): its shape is their broadcast shape, which the executor checks equals the group's map shape.
    """

    key: int
    graph: torch._C.Graph
    text: str
    input_is_tensor: tuple[bool, ...]
    output_deps: tuple[frozenset[int], ...]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _futures: dict = field(default_factory=dict, repr=False)
    _ready: dict = field(default_factory=dict, repr=False)
    # input signature -> fuser.executor.Geometry (or a marker for "falls back"); plain dict, GIL-atomic ops
    geometries: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.all_tensors = all(self.input_is_tensor)
        # identity across processes: a saved TorchScript module carries these, not the per-process key
        self.digest = hashlib.sha256(self.text.encode()).hexdigest()[:32]
        self.ir = self.graph.str(False)
        # rand_like inside: every launch draws fresh numbers, and a backward cannot recompute the forward
        self.random_deps = _random_deps(self.graph)
        self.random = bool(self.random_deps)
        self.concats = _concats(self.graph)
        self.all_outputs_defined = (True,) * len(self.concats)  # (graph.outputs() costs microseconds)
        self.has_concat = any(c is not None for c in self.concats)
        # a cat whose result feeds another node of the graph (only a hand-written graph has one): its value is
        # not a map element, so such a graph is neither generated nor differentiated, the interpreter runs it
        self.concat_consumed = any(u.user.kind() != "prim::Return" for n in self.graph.nodes()
                                   if n.kind() == "aten::cat" for u in n.output().uses())

    @property
    def n_tensor_inputs(self) -> int:
        return sum(self.input_is_tensor)

    def kernel_for(self, arg_spec, build: Callable[[], object]):
        """The kernel for ``arg_spec``, built by ``build()`` exactly once however many threads ask.

        ``build`` may return None (not fusable for these inputs); that answer is cached too. If it raises,
        the entry is removed and every waiting caller sees the exception.
        """
        hit = self._ready.get(arg_spec, _MISSING)  # lock-free fast path: plain dict read
        if hit is not _MISSING:
            return hit
        with self._lock:
            fut = self._futures.get(arg_spec)
            owner = fut is None
            if owner:
                fut = self._futures[arg_spec] = Future()
        if owner:
            try:
                kernel = build()
            except BaseException as e:
                with self._lock:
                    del self._futures[arg_spec]
                fut.set_exception(e)
                raise
            with self._lock:
                self._ready[arg_spec] = kernel
            fut.set_result(kernel)
            return kernel
        return fut.result()

    def kernels(self) -> dict:
        """The kernels built so far, by arg spec (None where the spec was not fusable)."""
        with self._lock:
            return dict(self._ready)


_MISSING = object()


def _output_deps(graph: torch._C.Graph) -> tuple[frozenset[int], ...]:
    deps = _value_deps(graph)
    return tuple(deps.get(v.unique(), frozenset()) for v in graph.outputs())


def _random_deps(graph: torch._C.Graph) -> tuple[frozenset[int], ...]:
    """Per random op (rand_like): the tensor inputs that decide its input's shape. Its numbers are drawn
    per element of the map, so that shape must be the map's (else eager broadcasts one draw: fall back)."""
    deps = _value_deps(graph)
    return tuple(deps.get(n.inputsAt(0).unique(), frozenset()) for n in graph.nodes()
                 if n.kind().startswith("aten::") and getattr(ops.lookup(n.schema()), "random", False))


def _concats(graph: torch._C.Graph) -> tuple:
    """Per output: None, or for a cat's result (dim, per piece the tensor inputs that decide its shape).
    The kernel runs over the pieces' shape, so every piece must have the group's broadcast shape."""
    deps = _value_deps(graph)
    out = []
    for v in graph.outputs():
        n = v.node()
        if n.kind() == "aten::cat":
            pieces = n.inputsAt(0).node().inputs()
            out.append((n.inputsAt(1).toIValue(), tuple(deps.get(p.unique(), frozenset()) for p in pieces)))
        else:
            out.append(None)
    return tuple(out)


def concat_pieces(graph: torch._C.Graph, output: torch._C.Value) -> Optional[list[torch._C.Value]]:
    """The pieces of ``output`` if a cat made it, else None."""
    n = output.node()
    return list(n.inputsAt(0).node().inputs()) if n.kind() == "aten::cat" else None


def _value_deps(graph: torch._C.Graph) -> dict[int, frozenset[int]]:
    tensor_index = {}
    for v in graph.inputs():
        if _is_tensor(v):
            tensor_index[v.unique()] = len(tensor_index)
    deps: dict[int, frozenset[int]] = {u: frozenset((k,)) for u, k in tensor_index.items()}
    for n in graph.nodes():
        inputs = list(n.inputs())
        op = ops.lookup(n.schema()) if n.kind().startswith("aten::") else None
        if op is not None and op.shape_args is not None:
            inputs = [inputs[i] for i in op.shape_args]
        d = frozenset().union(*(deps.get(v.unique(), frozenset()) for v in inputs))
        for o in n.outputs():
            deps[o.unique()] = d
    return deps


class KernelStore:
    """Thread-safe map from canonical group text to :class:`KernelSpec`, with integer keys."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_text: dict[str, int] = {}
        self._specs: dict[int, KernelSpec] = {}
        self._text_by_digest: dict[str, str] = {}

    def register(self, graph: torch._C.Graph) -> int:
        for v in graph.inputs():
            if not _is_tensor(v) and v.type().kind() != "FloatType":
                raise ValueError(f"a fusion group's inputs are tensors and floats; input %{v.debugName()} is "
                                 f"{v.type()} (make it a constant of the graph instead)")
        text = canonical_text(graph)
        with self._lock:
            key = self._by_text.get(text)
            if key is not None:
                return key
            key = len(self._specs)
            g = _normalized_copy(graph)
            self._specs[key] = KernelSpec(
                key, g, text, tuple(_is_tensor(v) for v in g.inputs()), _output_deps(g))
            self._by_text[text] = key
            self._text_by_digest[self._specs[key].digest] = text
            return key

    def by_digest(self, digest: str) -> Optional[KernelSpec]:
        key = self._by_text.get(self._text_by_digest.get(digest, ""))
        return None if key is None else self._specs[key]

    def get(self, key: int) -> Optional[KernelSpec]:
        return self._specs.get(key)

    def __len__(self) -> int:
        return len(self._specs)


STORE = KernelStore()
