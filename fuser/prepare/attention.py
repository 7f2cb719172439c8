"""Attention masks: an all-True bool mask -> None, a strided mask -> contiguous (so the fused kernels run)."""
from __future__ import annotations

import torch

from .common import all_nodes, create

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
    for node in list(all_nodes(graph.block())):
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
    for node in list(all_nodes(graph.block())):
        if node.kind() != _SDPA or node.inputsSize() < 4:
            continue
        mask = node.inputsAt(3)
        if not isinstance(mask.type(), torch._C.TensorType) or mask.node().kind() == "aten::contiguous":
            continue  # None, or an Optional decided at run time; or dense already
        dense = create(graph, "aten::contiguous", [mask, 0], node)  # memory_format=contiguous_format
        dense.output().setType(mask.type())
        node.replaceInput(3, dense.output())
        done += 1
    return done
