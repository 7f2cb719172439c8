"""Records: one per definition call (``define_tensor``, an op, ``add_output``), compared and hashed by structure.

A definition is the tuple of its records. Two definitions written separately (in two functions, with other
variable names) that make the same calls in the same order have equal records, so the :class:`DefinitionCache`
finds the first one's fusion: same group, same kernel-store key, nothing compiled again. Constants are part of a
record's identity by type and value (``1`` and ``1.0`` differ; ``-0.0`` and ``0.0`` differ; NaN equals NaN).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Optional

from .datatype import DataType


@dataclass(frozen=True)
class Ref:
    """A value of a definition, named as nvFuser prints it: ``T3`` (tensor), ``S1`` (scalar), ``V2`` (vector)."""

    kind: str
    index: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.index}"


def _canon(v):
    """A hashable key for an argument: floats by bits (so -0.0 != 0.0 and NaN == NaN), types kept apart."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v)
    if isinstance(v, float):
        return ("f", "nan" if math.isnan(v) else v.hex())
    if isinstance(v, complex):
        return ("c", _canon(v.real), _canon(v.imag))
    if isinstance(v, (list, tuple)):
        return ("l", tuple(_canon(x) for x in v))
    if isinstance(v, DataType):
        return ("d", v.name)
    if v is None or isinstance(v, (Ref, str)):
        return v
    raise TypeError(f"not a record argument: {v!r}")


@dataclass(frozen=True, eq=False)
class Record:
    """``outputs = name(*args, **kwargs)``. ``plan`` is what lowering needs (derived from the arguments and the
    operands' types, so not part of the identity)."""

    name: str
    args: tuple
    kwargs: tuple  # ((key, value), ...) in the order they print
    outputs: tuple  # Refs
    plan: tuple = field(default=(), repr=False)

    def key(self) -> tuple:
        return (self.name, _canon(self.args), tuple((k, _canon(v)) for k, v in self.kwargs), self.outputs)

    def __eq__(self, other) -> bool:
        return isinstance(other, Record) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


class DefinitionCache:
    """Finished fusions by their records, with hit and miss counters (tests read them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_records: dict[tuple, object] = {}
        self.fusions: list = []  # by fusion id
        self.hits = 0
        self.misses = 0

    def lookup(self, records: tuple) -> Optional[object]:
        with self._lock:
            got = self._by_records.get(records)
            if got is None:
                self.misses += 1
            else:
                self.hits += 1
            return got

    def insert(self, records: tuple, make) -> object:
        """The fusion for ``records``: an existing one, else ``make(fusion_id)`` stored (a failing ``make``
        stores nothing)."""
        with self._lock:
            got = self._by_records.get(records)
            if got is not None:
                return got
            fusion = make(len(self.fusions))
            self.fusions.append(fusion)
            self._by_records[records] = fusion
            return fusion

    def num_fusions(self) -> int:
        return len(self.fusions)

    def reset(self) -> None:
        with self._lock:
            self._by_records.clear()
            self.fusions.clear()
            self.hits = self.misses = 0


CACHE = DefinitionCache()
