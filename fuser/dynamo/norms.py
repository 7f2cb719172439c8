"""Normalizations of an ATen graph as ops the group IR keeps whole (``ops.Reduction.composite``), before
partitioning: ``_softmax(x, dim, half_to_float)`` becomes ``softmax.int(x, dim, dtype)`` (float32 when
``half_to_float``), ``_log_softmax`` likewise, and a ``native_layer_norm`` whose mean and rstd nothing reads (an
inference graph) becomes ``layer_norm``: single-output ops the partitioner takes and ``fuser.rows`` runs as
their steps. A ``native_layer_norm`` whose mean or rstd is read (a training forward saves them for the backward)
becomes its steps as ATen nodes (``mean.dim``, ``sub``, ``mul``, ``rsqrt``, ...; the input converted to the op's
computation type first, float32 for float16/bfloat16, and the results to the dtypes eager returns), so the forward
is one row kernel whose outputs are y and the row statistics. The steps carry ``original_aten`` (lowered as one
eager op's steps, not rounded between them); the final conversions do not (eager rounds y to its dtype).
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
            if any(u.target is not operator.getitem for u in users):
                continue
            if any(u.args[1] != 0 for u in users):
                done += _layer_norm_steps(graph, n, users)
                continue
            if not users:
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


def split_training_layer_norms(graph: torch.fx.Graph) -> int:
    """Each ``native_layer_norm`` whose mean or rstd is read, as its steps (in place; the nodes rewritten). Run on
    AOTAutograd's joint graph before it is cut into forward and backward: the min-cut partitioner then saves the
    input and the row statistics and recomputes the normalized rows in the backward (pointwise from those), where
    the op whole made it save the normalized rows, a tensor the size of the input, written by the forward and read
    back by the backward."""
    done = 0
    for n in list(graph.nodes):
        if n.op == "call_function" and not n.kwargs and n.target is aten.native_layer_norm.default and \
                len(n.args) == 5:
            users = list(n.users)
            if users and all(u.target is operator.getitem for u in users) and any(u.args[1] != 0 for u in users):
                done += _layer_norm_steps(graph, n, users)
    return done


def _fake_mode(node: torch.fx.Node):
    v = node.meta.get("val")
    return getattr(v, "fake_mode", None)


def _layer_norm_steps(graph: torch.fx.Graph, n: torch.fx.Node, users: list) -> int:
    """``native_layer_norm`` (y, mean, rstd) as ATen steps in place of ``n``; 0 where it stays (no fake values
    to describe the new nodes, a non-floating input, or results of dtypes the steps do not give)."""
    x, shape, w, b, eps = n.args
    xv, vals = x.meta.get("val") if isinstance(x, torch.fx.Node) else None, n.meta.get("val")
    mode = _fake_mode(x) if isinstance(x, torch.fx.Node) else None
    if xv is None or mode is None or not isinstance(vals, (tuple, list)) or len(vals) != 3 or \
            xv.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or \
            not isinstance(shape, (list, tuple)) or not 0 < len(shape) <= xv.dim() or not isinstance(eps, float):
        return 0
    stats = tuple(xv.shape[:xv.dim() - len(shape)]) + (1,) * len(shape)
    if tuple(vals[0].shape) != tuple(xv.shape) or any(tuple(v.shape) != stats for v in vals[1:]):
        return 0
    compute = torch.float32 if xv.dtype in (torch.float16, torch.bfloat16) else xv.dtype
    if any(v.dtype not in (xv.dtype, compute) for v in vals) or vals[0].dtype != xv.dtype:
        return 0
    dims = list(range(-len(shape), 0))
    step_meta = {"original_aten": n.target}

    def add(target, args, meta=step_meta, kwargs=None):
        with mode:
            fargs = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
            val = target(*fargs, **(kwargs or {}))
        node = graph.call_function(target, tuple(args), kwargs or {})
        node.meta = {**{k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}, **meta, "val": val}
        return node

    def cast(v, dtype, meta=step_meta):
        return v if v.meta["val"].dtype == dtype else add(aten._to_copy.default, [v], meta, {"dtype": dtype})

    with graph.inserting_before(n):
        xc = cast(x, compute)
        mean = add(aten.mean.dim, [xc, dims, True])
        d = add(aten.sub.Tensor, [xc, mean])
        var = add(aten.mean.dim, [add(aten.mul.Tensor, [d, d]), dims, True])
        rstd = add(aten.rsqrt.default, [add(aten.add.Tensor, [var, eps])])
        y = add(aten.mul.Tensor, [d, rstd])
        if w is not None:
            y = add(aten.mul.Tensor, [y, w])
        if b is not None:
            y = add(aten.add.Tensor, [y, b])
        plain = {"original_aten": None}  # eager rounds its results to their dtypes
        outs = [cast(y, vals[0].dtype, plain), cast(mean, vals[1].dtype, plain), cast(rstd, vals[2].dtype, plain)]
    for u in users:
        u.replace_all_uses_with(outs[u.args[1]])
        graph.erase_node(u)
    graph.erase_node(n)
    return 1
