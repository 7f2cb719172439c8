"""What ``fuser.explain`` returns: one record per group made and per compute node left out, with its reason.

An :class:`Explanation` is a list of :class:`Record` (data for programs) whose ``str()`` is a table (for people).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .partition import Partition
from .support import overload_name

GROUP, LEFT_OUT, FALLS_BACK, VIEW = "group", "left out", "falls back", "view"


@dataclass(frozen=True)
class Record:
    """``kind``: "group" (fused), "left out" (a node no group took), "view" (a view or alias left out: it
    launches no kernel) or "falls back" (a group that ran through the interpreter at run time). ``ops``: the
    overload names involved; ``nodes``: the FX node names; ``reason``: why ("" for a group); ``graph``: which
    compiled graph ("graph 1 forward", "torchscript"); ``key``: the group's kernel store key (None for a node)."""

    graph: str
    kind: str
    ops: tuple[str, ...]
    reason: str = ""
    nodes: tuple[str, ...] = ()
    key: Optional[int] = None
    source: str = ""  # the user's line that made the node, where the graph recorded it


def _source(node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _op(node) -> str:
    return overload_name(node) or getattr(node.target, "__name__", str(node.target))


def graph_records(graph: str, part: Partition, specs: list = ()) -> list[Record]:
    """The records of one compiled graph: its groups (``specs`` in region order, when registered), then the
    nodes left out, in graph order."""
    out = []
    for k, r in enumerate(part.regions):
        key = specs[k].key if k < len(specs) else None
        out.append(Record(graph, GROUP, tuple(_op(n) for n in r.nodes), "", tuple(n.name for n in r.nodes), key))
    for n, why in part.left_out.items():
        kind = VIEW if _is_view(n) else LEFT_OUT
        out.append(Record(graph, kind, (_op(n),), why, (n.name,), None, _source(n)))
    return out


def _is_view(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _short(op: str) -> str:
    return op[6:] if op.startswith("aten::") else op


class Explanation(list):
    """A list of :class:`Record`; ``str()`` prints it as a table."""

    @property
    def groups(self) -> list[Record]:
        return [r for r in self if r.kind == GROUP]

    @property
    def left_out(self) -> list[Record]:
        return [r for r in self if r.kind == LEFT_OUT]

    @property
    def fallbacks(self) -> list[Record]:
        return [r for r in self if r.kind == FALLS_BACK]

    def reasons(self) -> dict[str, str]:
        """Node name -> reason, for every node left out (names are unique within one graph)."""
        return {f"{r.graph}: {r.nodes[0]}": r.reason for r in self.left_out}

    @property
    def views(self) -> list[Record]:
        return [r for r in self if r.kind == VIEW]

    def __str__(self) -> str:
        rows = [("graph", "", "ops", "reason")]
        views: dict[str, dict[str, int]] = {}
        for r in self:
            if r.kind == VIEW:
                count = views.setdefault(r.graph, {})
                count[_short(r.ops[0])] = count.get(_short(r.ops[0]), 0) + 1
                continue
            ops = ", ".join(_short(o) for o in r.ops)
            if r.kind == GROUP:
                what, ops = f"group {r.key}" if r.key is not None else "group", f"{len(r.ops)} ops: {ops}"
            elif r.kind == FALLS_BACK:
                what = f"group {r.key} falls back" if r.key is not None else "falls back"
            else:
                what = "left out"
            rows.append((r.graph, what, ops, r.reason))
        for graph, count in views.items():
            ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in count.items())
            rows.append((graph, "views", ops, "views and aliases launch no kernel: left to ATen"))
        n_groups, n_left = len(self.groups), len(self.left_out)
        widths = [max(len(row[c]) for row in rows) for c in range(3)]
        widths[2] = min(widths[2], 60)
        lines = []
        for j, row in enumerate(rows):
            ops = row[2] if len(row[2]) <= widths[2] else row[2][:widths[2] - 3] + "..."
            lines.append("  ".join(c.ljust(w) for c, w in zip((row[0], row[1], ops), widths)) + "  " + row[3])
            if j == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
        lines = [ln.rstrip() for ln in lines]
        lines.append(f"{n_groups} group(s), {n_left} op(s) left out, {len(self.fallbacks)} run-time fallback(s)")
        return "\n".join(lines)
