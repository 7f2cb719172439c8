"""Explicit broadcasts of an ATen graph moved out of the way of groups, before partitioning.

A decomposed backward writes ``expand(r, [rows, cols])`` of a row's value ``r`` ([rows, 1]) before the ops that
combine it with full-size values (rms_norm's: ``div(expand(r), n) * x + g``). ``expand`` is a view: a group
never holds one, so it would split that chain from the row kernel that made ``r``. Pointwise ops broadcast their
operands anyway, so:

- where a pointwise user of the expand gets its result's shape from its other operands alone, it reads ``r``
  itself (``mul(expand(r), x)`` is ``mul(r, x)``);
- where the expand is a pointwise op's only tensor operand (``div(expand(r), n)``), the op runs on ``r`` and the
  expand moves after it (``expand(div(r, n))``), and the same question is asked of its users.

Elementwise results are the same values either way. Both keep each user's dtype: the expand's input must have at
least one dim (a 0-dim tensor takes part in type promotion as a lower category than a dimensioned one). Each new
node carries its fake value, computed by the node's own op under the graph's fake mode.
"""
from __future__ import annotations

import torch
import torch.fx

from .. import ops
from .support import overload_name

aten = torch.ops.aten
_EXPAND = aten.expand.default


def _val(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _pointwise(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = overload_name(node)
    op = ops.of(name) if name else None
    return op is not None and not op.random and not op.concat and _val(node) is not None


def _tensor_args(node: torch.fx.Node) -> list:
    return [a for a in node.all_input_nodes if _val(a) is not None]


def _call(graph: torch.fx.Graph, like: torch.fx.Node, target, args: tuple, kwargs: dict, mode) -> torch.fx.Node:
    with mode:
        fake_args = [_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
        fake_kwargs = {k: _val(a) if isinstance(a, torch.fx.Node) else a for k, a in kwargs.items()}
        val = target(*fake_args, **fake_kwargs)
    node = graph.call_function(target, args, kwargs)
    node.meta = {**{k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")}, "val": val}
    return node


def sink(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place; returns the number of uses of an expand removed."""
    done = 0
    work = [n for n in graph.nodes if n.op == "call_function" and n.target is _EXPAND]
    while work:
        e = work.pop()
        x = e.args[0]
        xv, ev = _val(x), _val(e)
        if xv is None or ev is None or xv.dim() == 0 or len(e.args) != 2 or e.kwargs or \
                getattr(xv, "fake_mode", None) is None:
            continue
        mode = xv.fake_mode
        for u in list(e.users):
            uv = _val(u)
            if not _pointwise(u) or uv is None:
                continue
            others = [a for a in _tensor_args(u) if a is not e]
            shapes = [tuple(xv.shape)] + [tuple(_val(a).shape) for a in others]
            if others and tuple(torch.broadcast_shapes(*shapes)) == tuple(uv.shape):
                u.replace_input_with(e, x)
                done += 1
            elif not others:
                args = tuple(x if a is e else a for a in u.args)
                kwargs = {k: (x if a is e else a) for k, a in u.kwargs.items()}
                with graph.inserting_before(u):
                    moved = _call(graph, u, u.target, args, kwargs, mode)
                    if _val(moved).dtype != uv.dtype:  # never expected: keep the graph as it was
                        graph.erase_node(moved)
                        continue
                    again = _call(graph, e, _EXPAND, (moved, e.args[1]), {}, mode)
                u.replace_all_uses_with(again)
                graph.erase_node(u)
                work.append(again)
                done += 1
        if not e.users:
            graph.erase_node(e)
    return done
