"""Before the fusion pass: rewrite what real networks contain into the pointwise ops the pass fuses.

Five rewrites, each exact to eager's semantics where it applies and a no-op elsewhere:

* :func:`remove_dropout`: dropout that is off (``train`` a constant False, or ``p`` a constant 0) is the
  identity, as eager returns its input; dropout that is on (a constant ``0 < p < 1``) becomes
  ``(rand_like(x) > p).type_as(x) * x * (1 / (1 - p))``, which fuses through the in-kernel Philox generator.
  Its numbers are not eager's (eager draws a Bernoulli mask from another generator), its distribution and
  its gradient (the same mask times the same scale) are.
* :func:`remove_mutation`: in-place ops become functional where nothing observes the alias (TorchScript's own
  ``RemoveMutation`` decides that), and only where the functional op gives the in-place op's dtype and shape.
* :func:`decompose_batch_norm`: inference ``batch_norm`` (``training`` a constant False, running statistics
  present) becomes pointwise ops over the running statistics, in eager's CPU formula.
* :func:`densify_attention_masks`: an attention mask (say one made by ``expand``, a broadcast view: stride 0 in its
  last dim) is made contiguous before ``scaled_dot_product_attention``. Eager's fused attention kernels refuse such a
  mask and run the math path (two bmm and a softmax); a traced Hugging Face model builds exactly that mask (an
  all-True ``expand`` where eager passes None). Same values, so the same result; the copy costs a small kernel.
  Before it, :func:`drop_all_true_attention_masks` passes None for a bool mask that is provably all True (that
  traced mask: ``expand(ge(arange(n) + 0, 0))``), as eager does, so the flash kernel can run.

Precondition: calls are inlined. The graph may have nested blocks; every rewrite walks them.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from . import graph_fuser
from .ts_ir import ORIGIN

_TENSOR = torch._C.TensorType.get()

# in-place activations whose functional form gives the in-place result's dtype for every input dtype (or both
# raise), so they need no dtype proof; tests/test_prepare.py checks each against eager in every dtype.
# (sigmoid, tanh and clamp with float bounds are not here: on integers the functional op returns float where
# the in-place op raises.) TODO(ops table): a flag of ops.OpDef once these ops are all in the table.
SAME_DTYPE_ACTIVATIONS = frozenset((
    "relu", "relu6", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "silu",
    "mish", "gelu", "threshold"))

_FLOATING = frozenset(("Float", "Double", "Half", "BFloat16"))

_DROPOUTS = frozenset(f"aten::{name}{suffix}" for name in ("dropout", "feature_dropout", "alpha_dropout",
                                                           "feature_alpha_dropout") for suffix in ("", "_"))

BATCH_NORM_SCHEMA = ("aten::batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
                     "Tensor? running_var, bool training, float momentum, float eps, bool cudnn_enabled) -> Tensor")


def prepare_graph(graph: torch._C.Graph) -> dict[str, int]:
    """Apply the rewrites in place, in the order they need; returns how many nodes each rewrote.

    Mutation goes before batch_norm: the decomposition ends in ``type_as``, whose result may alias its input,
    and RemoveMutation leaves an in-place op on such a value alone (``bn(x).relu_()`` would stay in place).
    """
    return {"dropout": remove_dropout(graph), "mutation": remove_mutation(graph),
            "batch_norm": decompose_batch_norm(graph), "all_true_mask": drop_all_true_attention_masks(graph),
            "attention_mask": densify_attention_masks(graph)}


def _all_nodes(block: torch._C.Block) -> Iterable[torch._C.Node]:
    for n in list(block.nodes()):
        yield n
        for b in n.blocks():
            yield from _all_nodes(b)


def _constant(v: torch._C.Value):
    """(True, value) for a constant, (False, None) otherwise."""
    if v.node().kind() != "prim::Constant":
        return False, None
    return True, v.toIValue()


def _create(graph: torch._C.Graph, kind: str, inputs: list, before: torch._C.Node,
            n_out: int = 1, origin: str = "") -> torch._C.Node:
    """``kind(inputs)`` inserted before ``before``, which it replaces (in part); Python numbers and None become
    constants. ``origin``: the eager op this node is one step of (``ts_ir.ORIGIN``; the group IR's
    ``Node.origin``)."""
    vals = []
    for a in inputs:
        if isinstance(a, torch._C.Value):
            vals.append(a)
        else:
            c = graph.insertConstant(a)
            c.node().moveBefore(before)
            vals.append(c)
    node = graph.create(kind, vals, n_out)
    node.insertBefore(before)
    node.copyMetadata(before)  # the replaced node's source range and scope: errors point at the model's line
    if origin:
        node.s_(ORIGIN, origin)
    for o in node.outputs():
        o.setType(_TENSOR)
    return node


# ---------------------------------------------------------------------------------------------------- dropout

def remove_dropout(graph: torch._C.Graph) -> int:
    """Dropout off -> identity; functional dropout on -> its pointwise form. Returns the nodes rewritten.

    Only constant arguments are decided here: a scripted module's ``self.training`` is read at run time, so its
    dropout stays. ``p`` must be a constant in [0, 1] (eager checks the range even when dropout is off).
    """
    done = 0
    for node in list(_all_nodes(graph.block())):
        if node.kind() not in _DROPOUTS or node.inputsSize() != 3:
            continue
        (p_const, p), (t_const, train) = _constant(node.inputsAt(1)), _constant(node.inputsAt(2))
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
    u = _create(graph, "aten::rand_like", [x, None, None, None, None, None], node).output()
    # eager computes x * mask * scale in one kernel, in float for float16/bfloat16, rounding once
    keep = _create(graph, "aten::gt", [u, p], node, origin="aten::dropout").output()
    mask = _create(graph, "aten::type_as", [keep, x], node, origin="aten::dropout").output()
    kept = _create(graph, "aten::mul", [mask, x], node, origin="aten::dropout").output()
    out = _create(graph, "aten::mul", [kept, 1.0 / (1.0 - p)], node).output()  # dropout's result: stored
    out.setType(node.output().type())
    node.output().replaceAllUsesWith(out)
    node.destroy()


# --------------------------------------------------------------------------------------------------- mutation

def _inplace_name(kind: str) -> Optional[str]:
    """``add`` for ``aten::add_``; None for other kinds (``aten::__and__`` is not in place)."""
    if not kind.startswith("aten::"):
        return None
    name = kind[6:]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else None


def remove_mutation(graph: torch._C.Graph) -> int:
    """In-place ops -> functional ops where that cannot change a result. Returns the ops made functional.

    TorchScript's ``RemoveMutation`` (``torch._C._jit_pass_remove_mutation``) makes an op functional when its
    mutated value is fresh and unaliased, so no one can see the mutation. It does not check types: ``x.add_(y)``
    keeps ``x``'s dtype and shape and raises if the result cannot be cast or broadcast to them, ``x + y`` does
    neither. So each op it converted is kept only when

    * it is an activation that keeps every dtype (:data:`SAME_DTYPE_ACTIVATIONS`), or
    * the graph's types (a traced graph records them) show a floating ``self``, no complex operand, and operand
      shapes that broadcast to ``self``'s; then the functional result is cast back with ``type_as(r, self)``,
      which is the in-place op's rounding (compute in the promoted dtype, store in ``self``'s);

    the others are turned back into the in-place op. (``_jit_pass_remove_inplace_ops`` is not used: it rewrites
    without alias analysis, so a later use of the mutated tensor would read the unmutated value.)
    """
    inplace = {n.kind() for n in _all_nodes(graph.block()) if _inplace_name(n.kind())}
    if not inplace:
        return 0
    first_new = 1 + max([v.unique() for n in _all_nodes(graph.block()) for v in n.outputs()]
                        + [v.unique() for v in graph.inputs()])
    torch._C._jit_pass_remove_mutation(graph)
    kept = 0
    for node in list(_all_nodes(graph.block())):
        if (node.outputsSize() != 1 or node.output().unique() < first_new or node.kind() + "_" not in inplace):
            continue  # not a functional op made from an in-place one (TorchScript's fill_/zero_ forms stay)
        name = node.kind()[6:]
        tensors = [v for v in node.inputs() if isinstance(v.type(), torch._C.TensorType)]
        if name in SAME_DTYPE_ACTIVATIONS and len(tensors) == 1:
            kept += 1
        elif _inplace_result_provably_equal(node, tensors):
            if len(tensors) > 1:
                _cast_like_self(graph, node)
            kept += 1
        else:
            _restore_inplace(graph, node)
    return kept


def _inplace_result_provably_equal(node: torch._C.Node, tensors: list) -> bool:
    self_t = node.inputsAt(0).type()
    if not isinstance(self_t, torch._C.TensorType) or self_t.scalarType() not in _FLOATING:
        return False
    shapes = []
    for v in tensors:
        t = v.type()
        sizes = t.sizes() if t.scalarType() is not None else None
        if sizes is None or "Complex" in t.scalarType():
            return False
        shapes.append(sizes)
    for v in node.inputs():
        if v.type().kind() == "ComplexType" or isinstance(_constant(v)[1], complex):
            return False
    try:
        return list(torch.broadcast_shapes(*shapes)) == list(shapes[0])
    except RuntimeError:
        return False


def _cast_like_self(graph: torch._C.Graph, node: torch._C.Node) -> None:
    out = node.output()
    cast = graph.create("aten::type_as", [out, node.inputsAt(0)], 1)
    cast.insertAfter(node)
    cast.copyMetadata(node)
    cast.output().setType(out.type())
    out.replaceAllUsesWith(cast.output())
    cast.replaceInput(0, out)


def _restore_inplace(graph: torch._C.Graph, node: torch._C.Node) -> None:
    # RemoveMutation pointed the later uses of the mutated value at this node's output; the in-place op's
    # output is that value itself, so pointing them at it restores the original program
    back = graph.create(node.kind() + "_", list(node.inputs()), 1)
    back.insertBefore(node)
    back.copyMetadata(node)
    back.output().setType(node.output().type())
    node.output().replaceAllUsesWith(back.output())
    node.destroy()


# ------------------------------------------------------------------------------------------------- batch norm

def decompose_batch_norm(graph: torch._C.Graph) -> int:
    """Inference ``batch_norm`` -> pointwise ops. Returns the nodes decomposed.

    Eager's CPU kernel computes, per channel, ``alpha = invstd * weight`` with ``invstd = 1 / sqrt(var + eps)``
    and ``beta = bias - mean * alpha``, then ``x * alpha + beta`` in the parameters' compute dtype (float32 for
    float16/bfloat16), stored in ``x``'s dtype. The decomposition is that formula, op for op, over the
    statistics shaped to broadcast along dim 1 by ``fuser::batch_norm_params`` (which also checks the arguments
    as eager does), ending in ``type_as(y, x)``; in a group the per-channel terms are recomputed per element,
    which costs arithmetic but no memory traffic. It applies only when ``training`` is a constant False and
    the running statistics are tensors (not None): training-mode batch norm reduces over the batch. A batch
    norm with no fusable op beside it (conv -> batch norm -> conv) stays eager's one kernel.
    """
    done = 0
    for node in list(_all_nodes(graph.block())):
        if node.kind() != "aten::batch_norm" or node.schema() != BATCH_NORM_SCHEMA:
            continue
        x, weight, bias, mean, var, training, _momentum, eps, _cudnn = list(node.inputs())
        if _constant(training) != (True, False):
            continue
        if not all(isinstance(v.type(), torch._C.TensorType) for v in (mean, var)):
            continue
        if not all(isinstance(v.type(), torch._C.TensorType) or _constant(v) == (True, None)
                   for v in (weight, bias)):
            continue  # an Optional[Tensor] decided at run time
        if not (_constant(eps)[0] or eps.type().kind() == "FloatType"):
            continue
        if not _fusable_neighbour(node):
            continue  # a group of it alone would replace eager's one kernel with one of ours: no memory saved
        _decompose_batch_norm(graph, node)
        done += 1
    return done


def _fusable_neighbour(node: torch._C.Node) -> bool:
    """Whether the op producing ``node``'s input, or one using its output, is one the pass may group with it."""
    return graph_fuser.fusable_op(node.inputsAt(0).node()) is not None or any(
        graph_fuser.fusable_op(u.user) is not None for u in node.output().uses())


def _decompose_batch_norm(graph: torch._C.Graph, node: torch._C.Node) -> None:
    x, weight, bias, mean, var, _training, _momentum, eps, _cudnn = list(node.inputs())
    has_w = isinstance(weight.type(), torch._C.TensorType)
    has_b = isinstance(bias.type(), torch._C.TensorType)
    n_params = 2 + has_w + has_b
    params = _create(graph, "fuser::batch_norm_params", [x, weight, bias, mean, var], node)
    params.output().setType(torch._C.ListType.ofTensors())
    unpack = _create(graph, "prim::ListUnpack", [params.output()], node, n_params)
    vecs = list(unpack.outputs())
    w = vecs.pop(0) if has_w else None
    b = vecs.pop(0) if has_b else None
    m, v = vecs

    def op(kind, *args):  # eager's batch norm kernel computes all of it in float, rounding once at the end
        return _create(graph, kind, list(args), node, origin="aten::batch_norm").output()

    invstd = op("aten::rsqrt", op("aten::add", v, eps, 1))
    alpha = op("aten::mul", invstd, w) if has_w else invstd
    mean_alpha = op("aten::mul", m, alpha)
    # eager's bias is 0 when absent: 0 - m * alpha (rsub), not -(m * alpha), for the sign of a zero result
    beta = op("aten::sub", b, mean_alpha, 1) if has_b else op("aten::rsub", mean_alpha, 0, 1)
    y = op("aten::add", op("aten::mul", x, alpha), beta, 1)
    out = _create(graph, "aten::type_as", [y, x], node).output()  # batch norm's result: stored
    out.setType(node.output().type())
    node.output().replaceAllUsesWith(out)
    node.destroy()


# ------------------------------------------------------------------------------------------ attention masks

_SDPA = "aten::scaled_dot_product_attention"


# ops that pass their input's values through (a view, a copy, a part of them): a range or an all-True holds after
_SAME_VALUES = frozenset(("aten::unsqueeze", "aten::slice", "aten::expand", "aten::view", "aten::reshape",
                          "aten::contiguous", "aten::squeeze", "aten::select", "aten::expand_as", "aten::clone",
                          "aten::detach"))
_COMPARE = {"aten::ge": lambda lo, hi, c: lo is not None and lo >= c, "aten::gt": lambda lo, hi, c: lo is not None
            and lo > c, "aten::le": lambda lo, hi, c: hi is not None and hi <= c,
            "aten::lt": lambda lo, hi, c: hi is not None and hi < c}
_RANGE_DEPTH = 32


def _number(v: torch._C.Value):
    """A constant int/float (or a one-element constant tensor's), else None."""
    n = v.node()
    if n.kind() != "prim::Constant" or not n.hasAttribute("value"):
        return None
    x = v.toIValue()
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 and x.dtype != torch.bool else None
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _value_range(v: torch._C.Value, depth: int = 0) -> tuple:
    """(lowest, highest) a value's elements can be, each None where unknown: from constants, ``arange`` (its
    start and a positive step), the adds of two ranges and value-preserving views."""
    if depth > _RANGE_DEPTH:
        return None, None
    c = _number(v)
    if c is not None:
        return c, c
    n, k = v.node(), v.node().kind()
    if k in _SAME_VALUES:
        return _value_range(n.inputsAt(0), depth + 1)
    if k == "aten::arange":  # arange(end, ...), arange(start, end, ...), arange(start, end, step, ...)
        count = n.inputsSize()
        if count == 5:
            return 0, None
        step = _number(n.inputsAt(2)) if count == 7 else 1
        start = _number(n.inputsAt(0))
        return (start, None) if start is not None and step is not None and step > 0 else (None, None)
    if k in ("aten::add", "aten::sub") and n.inputsSize() == 3:
        alpha = _number(n.inputsAt(2))
        (alo, ahi), (blo, bhi) = _value_range(n.inputsAt(0), depth + 1), _value_range(n.inputsAt(1), depth + 1)
        if alpha is None or alpha < 0:
            return None, None
        if k == "aten::sub":
            blo, bhi = (None if bhi is None else -bhi), (None if blo is None else -blo)
        lo = None if alo is None or blo is None else alo + alpha * blo
        hi = None if ahi is None or bhi is None else ahi + alpha * bhi
        return lo, hi
    return None, None


def _all_true(v: torch._C.Value, depth: int = 0) -> bool:
    """Whether every element of the bool tensor ``v`` is provably True: a comparison that its operand's range
    decides, a constant all-True tensor, the and of two such, or a view or copy of one."""
    if depth > _RANGE_DEPTH:
        return False
    n, k = v.node(), v.node().kind()
    if k == "prim::Constant" and n.hasAttribute("value"):
        x = v.toIValue()
        return isinstance(x, torch.Tensor) and x.dtype == torch.bool and bool(x.all())
    if k in _SAME_VALUES:
        return _all_true(n.inputsAt(0), depth + 1)
    if k in _COMPARE and n.inputsSize() == 2:
        c = _number(n.inputsAt(1))
        return c is not None and _COMPARE[k](*_value_range(n.inputsAt(0), depth + 1), c)
    if k in ("aten::__and__", "aten::logical_and", "aten::bitwise_and") and n.inputsSize() == 2:
        return all(_all_true(n.inputsAt(i), depth + 1) for i in range(2))
    return False


def drop_all_true_attention_masks(graph: torch._C.Graph) -> int:
    """``scaled_dot_product_attention``'s bool ``attn_mask`` that is provably all True -> None, where ``is_causal``
    is a constant False (eager raises for a mask with is_causal). An all-True mask attends everywhere, as None does;
    with None the flash kernel runs where a mask allows only the memory-efficient one or the math path. (A traced
    Hugging Face ViT, transformers 5.17, builds ``expand(ge(arange(n) + 0, 0))`` where eager passes None.)
    Returns the masks dropped."""
    done = 0
    for node in list(_all_nodes(graph.block())):
        if node.kind() != _SDPA or node.inputsSize() < 6:
            continue
        mask, causal = node.inputsAt(3), node.inputsAt(5)
        mtype = mask.type()
        if not isinstance(mtype, torch._C.TensorType) or mtype.scalarType() != "Bool":
            continue
        if causal.node().kind() != "prim::Constant" or causal.toIValue() is not False or not _all_true(mask):
            continue
        none = graph.insertConstant(None)
        none.node().moveBefore(node)
        node.replaceInput(3, none)
        done += 1
    return done


def densify_attention_masks(graph: torch._C.Graph) -> int:
    """``scaled_dot_product_attention``'s tensor ``attn_mask`` -> ``contiguous(attn_mask)`` (which returns a dense
    mask itself, and copies a view: ``expand``'s broadcast, a slice, a transpose). Returns the masks rewritten. (Measured on an H100, torch 2.11, transformers 5.17: a traced ViT-B/16 passes
    an expanded all-True bool mask of strides (0, 197, 1, 0); with it the fused kernels refuse and the math
    path runs; a contiguous mask of the same values runs the memory-efficient kernel.)"""
    done = 0
    for node in list(_all_nodes(graph.block())):
        if node.kind() != _SDPA or node.inputsSize() < 4:
            continue
        mask = node.inputsAt(3)
        if not isinstance(mask.type(), torch._C.TensorType) or mask.node().kind() == "aten::contiguous":
            continue  # None, or an Optional decided at run time; or dense already
        dense = _create(graph, "aten::contiguous", [mask, 0], node)  # memory_format=contiguous_format
        dense.output().setType(mask.type())
        node.replaceInput(3, dense.output())
        done += 1
    return done
