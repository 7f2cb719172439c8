"""Normalizations of an ATen graph as ops the group IR keeps whole (``ops.Reduction.composite``), before
partitioning: ``_softmax(x, dim, half_to_float)`` becomes ``softmax.int(x, dim, dtype)`` (float32 when
``half_to_float``), ``_log_softmax`` likewise, and a ``native_layer_norm`` whose mean and rstd nothing reads (an
inference graph) becomes ``layer_norm``: single-output ops the partitioner takes and ``fuser.rows`` runs as
their steps. A ``native_layer_norm`` whose mean or rstd is read (a training forward saves them) stays ATen's.
Each new node computes what the old one did (the same ATen kernels: ``layer_norm`` calls ``native_layer_norm``),
and carries its fake value and metadata."""
from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten
_FLOAT32 = 6  # ScalarType code of float32 (the group IR holds dtypes as their codes)


def rewrite(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place; returns the nodes rewritten."""
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.kwargs:
            continue
        if n.target in (aten._softmax.default, aten._log_softmax.default) and len(n.args) == 3:
            x, dim, half_to_float = n.args
            target = aten.softmax.int if n.target is aten._softmax.default else aten.log_softmax.int
            with graph.inserting_after(n):
                new = graph.call_function(target, (x, dim, _FLOAT32 if half_to_float else None))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            done += 1
        elif n.target is aten.native_layer_norm.default and len(n.args) == 5:
            users = list(n.users)
            if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
                continue
            x, shape, w, b, eps = n.args
            with graph.inserting_after(n):
                new = graph.call_function(aten.layer_norm.default, (x, shape, w, b, eps, True))
            new.meta = dict(users[0].meta)
            for u in users:
                u.replace_all_uses_with(new)
                graph.erase_node(u)
            graph.erase_node(n)
            done += 1
    return done
