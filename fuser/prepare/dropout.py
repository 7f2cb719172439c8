"""Dropout that is off -> the identity; functional dropout that is on -> its pointwise form."""
from __future__ import annotations

import torch

from .common import all_nodes, constant, create

_DROPOUTS = frozenset(f"aten::{name}{suffix}" for name in ("dropout", "feature_dropout", "alpha_dropout",
                                                           "feature_alpha_dropout") for suffix in ("", "_"))


def remove_dropout(graph: torch._C.Graph) -> int:
    """Dropout off -> identity; functional dropout on -> its pointwise form. Returns the nodes rewritten.

    Only constant arguments are decided here: a scripted module's ``self.training`` is read at run time, so its
    dropout stays. ``p`` must be a constant in [0, 1] (eager checks the range even when dropout is off).
    """
    done = 0
    for node in list(all_nodes(graph.block())):
        if node.kind() not in _DROPOUTS or node.inputsSize() != 3:
            continue
        (p_const, p), (t_const, train) = constant(node.inputsAt(1)), constant(node.inputsAt(2))
        if not (p_const and t_const and isinstance(p, (int, float)) and 0 <= p <= 1):
            continue
        x = node.inputsAt(0)
        if not train or p == 0:  # eager returns the input itself (also for the in-place forms)
            node.output().replaceAllUsesWith(x)
            node.destroy()
            done += 1
        elif node.kind() == "aten::dropout" and p < 1:
            _decompose_dropout(graph, node, float(p))
            done += 1
    return done


def _decompose_dropout(graph: torch._C.Graph, node: torch._C.Node, p: float) -> None:
    # eager keeps an element with probability 1 - p and scales it by 1 / (1 - p); rand_like(x) > p keeps it
    # with the same probability (rand_like's grid is eager's)
    x = node.inputsAt(0)
    u = create(graph, "aten::rand_like", [x, None, None, None, None, None], node).output()
    # eager computes x * mask * scale in one kernel, in float for float16/bfloat16, rounding once
    keep = create(graph, "aten::gt", [u, p], node, origin="aten::dropout").output()
    mask = create(graph, "aten::type_as", [keep, x], node, origin="aten::dropout").output()
    kept = create(graph, "aten::mul", [mask, x], node, origin="aten::dropout").output()
    out = create(graph, "aten::mul", [kept, 1.0 / (1.0 - p)], node).output()  # dropout's result: stored
    out.setType(node.output().type())
    node.output().replaceAllUsesWith(out)
    node.destroy()
