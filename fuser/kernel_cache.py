"""The kernel-spec store: integer keys for registered fusion groups, and each spec's compiled kernels.

A spec is keyed by its group's canonical text (``fuser.ir.Group.text``: values renumbered, constants typed), so
alpha-equivalent groups share one key and one spec. Each spec compiles a kernel once per
arg spec: the first thread to ask puts a future in the map and compiles outside the lock, later threads
wait on the future. A failed compile leaves nothing behind, so the next call tries again.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from . import ir, ops, views


@dataclass
class KernelSpec:
    """A registered fusion group: its group IR and the kernels compiled for it. It holds what the later stages
    ask of the group, computed here once: per input whether it is a tensor, each output's shape inputs, the
    random ops, the cats.

    ``input_is_tensor`` gives, per graph input, whether it is a tensor or a float argument.
    ``output_deps`` gives, per output, the indices (among the tensor inputs) of the tensors that decide its
    shape (``ops.OpDef.shape_args``): its shape is their broadcast shape, which the executor checks equals the group's map shape.
    """

    key: int
    group: ir.Group
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _futures: dict = field(default_factory=dict, repr=False)
    _ready: dict = field(default_factory=dict, repr=False)
    # input signature -> fuser.executor.Geometry (or a marker for "falls back"); plain dict, GIL-atomic ops
    geometries: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        g = self.group
        self.text = g.text()
        self.input_is_tensor = tuple(v.is_tensor for v in g.inputs)
        self.all_tensors = all(self.input_is_tensor)
        # identity across processes: a saved TorchScript module carries it, not the per-process key
        self.digest = hashlib.sha256(self.text.encode()).hexdigest()[:32]
        deps = _value_deps(g)
        self.output_deps = tuple(deps.get(v.id, frozenset()) for v in g.outputs)
        # rand_like inside: every launch draws fresh numbers, and a backward cannot recompute the forward
        self.random_deps = tuple(deps.get(n.args[0].id, frozenset()) for n in g.nodes
                                 if getattr(ops.of(n.op), "random", False))
        self.random = bool(self.random_deps)
        self.concats = _concats(g, deps)
        self.all_outputs_defined = (True,) * len(self.concats)
        self.has_concat = any(c is not None for c in self.concats)
        # per output: the pieces of the cat that makes it, or None
        self.pieces = tuple(g.cat_pieces(v) for v in g.outputs)
        # a cat whose result feeds another node of the group (only a hand-written group has one): its value is
        # not a map element, so such a group is neither generated nor differentiated, the fallback runs it
        cats = {n.out.id for n in g.nodes if getattr(ops.of(n.op), "concat", False)}
        self.concat_consumed = any(v.id in cats for n in g.nodes for v in n.values)
        # a reduction inside: the row kernels of fuser/rows/ run it, not the pointwise map
        self.has_reduction = any(ops.reduction(n.op) is not None for n in g.nodes)
        # permutes inside (fuser/views.py): per input, the permutes it is read through (or why the group cannot
        # run as one map); the kernel computes the group without them, ``flat``
        self.views = views.spaces(g) if views.has_permute(g) else None
        self.flat = KernelSpec(self.key, views.flat(g)) if isinstance(self.views, tuple) else None
        self.flat_key: Optional[int] = None  # ``flat`` registered in the store (:meth:`registered_flat`)
        self.view_layouts: dict = {}  # input signature -> whether ``flat`` on the views gives eager's output layouts

    @property
    def n_tensor_inputs(self) -> int:
        return sum(self.input_is_tensor)

    def registered_flat(self) -> "KernelSpec":
        """``flat`` registered in the store (its own key: the caches of backward groups go by key), for autograd,
        which differentiates the permute-free group on the views (``autodiff._differentiable_views``)."""
        if self.flat_key is None:
            self.flat_key = STORE.register(self.flat.group)
        return STORE.get(self.flat_key)

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


def _concats(group: ir.Group, deps: dict) -> tuple:
    """Per output: None, or for a cat's result (dim, per piece the tensor inputs that decide its shape).
    The kernel runs over the pieces' shape, so every piece must have the group's broadcast shape."""
    out = []
    for v in group.outputs:
        pieces = group.cat_pieces(v)
        out.append(None if pieces is None else
                   (group.producer(v).args[1], tuple(deps.get(p.id, frozenset()) for p in pieces)))
    return tuple(out)


def _value_deps(group: ir.Group) -> dict[int, frozenset[int]]:
    """Per value id: the indices (among the tensor inputs) of the inputs that decide its shape."""
    deps: dict[int, frozenset[int]] = {}
    for v in group.inputs:
        if v.is_tensor:
            deps[v.id] = frozenset((len(deps),))
    for n in group.nodes:
        op = ops.of(n.op)
        args = n.args if op is None or op.shape_args is None else [n.args[i] for i in op.shape_args]
        vals = [x for a in args for x in (a if isinstance(a, tuple) else (a,)) if isinstance(x, ir.Value)]
        deps[n.out.id] = frozenset().union(*(deps.get(v.id, frozenset()) for v in vals))
    return deps


class KernelStore:
    """Thread-safe map from canonical group text to :class:`KernelSpec`, with integer keys."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_text: dict[str, int] = {}
        self._specs: dict[int, KernelSpec] = {}
        self._text_by_digest: dict[str, str] = {}

    def register(self, group: ir.Group) -> int:
        if not isinstance(group, ir.Group):
            raise TypeError(f"register expects a fuser.ir.Group, got {type(group).__name__} (a TorchScript graph "
                            "is lowered by fuser.ts_ir.lower)")
        text = group.text()
        with self._lock:
            key = self._by_text.get(text)
            if key is not None:
                return key
            key = len(self._specs)
            self._specs[key] = KernelSpec(key, group)
            self._by_text[text] = key
            self._text_by_digest[self._specs[key].digest] = text
            return key

    def by_digest(self, digest: str) -> Optional[KernelSpec]:
        key = self._by_text.get(self._text_by_digest.get(digest, ""))
        return None if key is None else self._specs[key]

    def get(self, key: int) -> Optional[KernelSpec]:
        return self._specs.get(key)

    @contextlib.contextmanager
    def kernels_set_aside(self) -> Iterator[None]:
        """While it holds, every registered spec looks as if it had built no kernel and planned no launch, so that
        what runs builds its own, as in a new process (the benchmark times each front door's first call so: the
        TorchScript pass and the torch.compile backend often make the same group). Afterwards what was set aside
        comes back; a kernel or geometry made meanwhile for the same arg spec or signature gives way to the earlier
        one (live callers may hold it), the others stay. Not for use while other threads compile."""
        with self._lock:
            specs = list(self._specs.values())
        saved = {}
        for spec in specs:
            with spec._lock:
                saved[spec.key] = spec._ready, spec._futures, spec.geometries
                spec._ready, spec._futures, spec.geometries = {}, {}, {}
        try:
            yield
        finally:
            for spec in specs:
                ready, futures, geometries = saved[spec.key]
                with spec._lock:
                    spec._ready = {**spec._ready, **ready}
                    spec._futures = {**spec._futures, **futures}
                    spec.geometries = {**spec.geometries, **geometries}

    def __len__(self) -> int:
        return len(self._specs)


STORE = KernelStore()
