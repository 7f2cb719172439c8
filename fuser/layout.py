"""Eager's output layouts: the sizes and strides eager gives each output of a group, from its inputs' layouts.

Users see strides (``is_contiguous()``, ``.view``, the layout of what they compute next), so a fused group's
outputs have exactly the strides eager's ops would have given them. The executor asks once per input
signature; the kernel then writes those layouts (``executor.plan`` orders the map in the first output's
memory order, so a channels_last group stays one dense run).

Eager's rule is TensorIterator's (aten/src/ATen/TensorIterator.cpp), applied op by op through the group:

* fast setup, when every operand has one shape (a 0-dim operand or a Scalar wrapped as one breaks it): all
  contiguous gives contiguous, all channels_last gives channels_last, all non-overlapping and dense with one
  set of strides gives those strides;
* otherwise each operand's strides over the broadcast shape (0 where it is broadcast; a size-1 dim of the
  result keeps the operand's stride), the dims sorted fastest first by an insertion sort whose comparison
  asks the operands in order and skips a pair that one of them broadcasts (equal strides: the smaller dim
  goes first); the result is dense in that order (contiguous when the order is the identity).

A ``permute`` inside a group (``fuser/views.py``) is a view: its operand's sizes and strides, reordered.

Ops that allocate otherwise have their own rule: ``empty_like`` semantics (rand_like, casts, hardtanh, which
allocates with empty_like and writes into it: the input's strides when it is non-overlapping and dense, else
dense strides in its stride order), type_as (its input itself when the dtypes agree, else empty_like's;
the dtypes of computed values come from the group run on meta tensors, only when they decide), contiguous
(``pow.Scalar``), and cat's (channels_last when every piece's strides suggest it, else contiguous).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from . import ir, views

Layout = tuple  # (sizes, strides), both tuples of ints

# allocate their result with empty_like(self) (preserve format), not through TensorIterator's layout rule
_LIKE = frozenset({"aten::rand_like", "aten::_to_copy", "aten::hardtanh", "aten::relu6"})
# allocate a contiguous result of the tensor operand's shape
_CONTIGUOUS = frozenset({"aten::pow.Scalar"})
# Scalar parameters that eager wraps into 0-dim operands of the TensorIterator (the rest are kernel parameters)
_WRAPPED_SCALARS = ("self", "other")


def contiguous_strides(sizes: Sequence[int]) -> tuple:
    """c10's contiguous strides (a size-0 dim counts as 1)."""
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(out[::-1])


# dims of a channels_last (4-d) and channels_last_3d (5-d) tensor, fastest first
_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}


def _channels_last_strides(sizes: Sequence[int]) -> tuple:
    out, acc = [0] * len(sizes), 1
    for d in _CHANNELS_LAST_ORDER[len(sizes)]:
        out[d] = acc
        acc *= max(sizes[d], 1)
    return tuple(out)


def _strides_like_channels_last(sizes, strides) -> bool:
    """c10's is_channels_last_strides_2d/3d: the heuristic behind suggest_memory_format."""
    order = _CHANNELS_LAST_ORDER.get(len(sizes))
    if order is None or strides[1] == 0:
        return False
    low = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < low:
            return False
        if d == 0 and low == strides[1]:  # N111-like: ambiguous, contiguous by default
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _is_contiguous(sizes, strides) -> bool:
    if math.prod(sizes) == 0:
        return True
    expected = 1
    for s, x in zip(reversed(sizes), reversed(strides)):
        if s != 1:
            if x != expected:
                return False
            expected *= s
    return True


def _is_channels_last(sizes, strides) -> bool:
    """c10's is_contiguous(memory_format=channels_last) for a 4-dim tensor."""
    if len(sizes) != 4:
        return False
    if math.prod(sizes) == 0:
        return True
    expected = 1
    for d in _CHANNELS_LAST_ORDER[4]:
        if sizes[d] != 1:
            if strides[d] != expected:
                return False
            expected *= sizes[d]
    return True


def non_overlapping_and_dense(sizes, strides) -> bool:
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    order = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d]))
    expected = 1
    for d in order:
        if sizes[d] < 2:
            return True
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def _sort_dims(shape: Sequence[int], operand_strides: Sequence[Sequence[int]]) -> list:
    """TensorIterator's reorder_dimensions: the dims fastest first."""
    nd = len(shape)
    perm = list(range(nd - 1, -1, -1))
    if nd <= 1:
        return perm

    def should_swap(d0, d1):
        for st in operand_strides:
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, nd):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    return perm


def _dense_in_order(shape: Sequence[int], perm: Sequence[int], skip_ones: bool) -> tuple:
    """Strides dense in dim order ``perm`` (fastest first). TensorIterator multiplies by every size (a size-0
    dim zeroes the strides after it); infer_dense_strides (empty_like) skips sizes below 2."""
    out = [0] * len(shape)
    acc = 1
    for d in perm:
        out[d] = acc
        if not skip_ones or shape[d] > 1:
            acc *= shape[d]
    return tuple(out)


def tensor_iterator(operands: Sequence[Layout]) -> Layout:
    """The layout of a TensorIterator op's result from its input operands' (a wrapped Scalar: ``((), ())``)."""
    shapes = [tuple(s) for s, _ in operands]
    shape = tuple(torch.broadcast_shapes(*shapes)) if len(set(shapes)) > 1 else shapes[0]
    nd = len(shape)
    has_scalar = any(len(s) == 0 for s in shapes)
    same = len(set(shapes)) == 1 and not (has_scalar and any(len(s) for s in shapes))
    if same:
        if all(_is_contiguous(s, st) for s, st in operands):
            return shape, contiguous_strides(shape)
        if all(_is_channels_last(s, st) for s, st in operands):
            return shape, _channels_last_strides(shape)
        if all(non_overlapping_and_dense(s, st) for s, st in operands) and len({tuple(st) for _, st in operands}) == 1:
            return shape, tuple(operands[0][1])
    per = []
    for s, st in operands:
        off = nd - len(s)
        full = [0] * nd
        for d, (size, x) in enumerate(zip(s, st)):
            full[off + d] = 0 if size == 1 and shape[off + d] != 1 else x
        per.append(full)
    perm = _sort_dims(shape, per)
    if perm == list(range(nd - 1, -1, -1)):
        return shape, contiguous_strides(shape)
    return shape, _dense_in_order(shape, perm, skip_ones=False)


def empty_like(sizes: Sequence[int], strides: Sequence[int]) -> Layout:
    """``torch.empty_like(t)``'s layout (preserve format) for a strided ``t``."""
    sizes, strides = tuple(sizes), tuple(strides)
    if non_overlapping_and_dense(sizes, strides):
        return sizes, strides
    return sizes, _dense_in_order(sizes, _sort_dims(sizes, [strides]), skip_ones=True)


def group_layouts(group: ir.Group, args: Sequence) -> Union[list, str]:
    """Per output of ``group``: eager's (sizes, strides) for ``args`` (its inputs: tensors, or float
    arguments), or the reason it is not known here (the caller falls back to eager)."""
    env: dict = {}
    dtypes: dict = {}  # of the inputs (type_as returns its input itself when the dtypes agree)
    for v, a in zip(group.inputs, args):
        if isinstance(a, torch.Tensor):
            env[v.id] = (tuple(a.shape), tuple(a.stride()))
            dtypes[v.id] = a.dtype
    for n in group.nodes:
        got = _node_layout(n, env, dtypes)
        if got is None:  # a computed value's dtype decides: every value's dtype, from the group run on meta tensors
            dtypes = _value_dtypes(group, args)
            got = "a dtype eager's meta tensors do not give" if dtypes is None else _node_layout(n, env, dtypes)
        if isinstance(got, str) or got is None:
            return got or "a dtype the layout depends on is unknown"
        env[n.out.id] = got
    return [env[v.id] for v in group.outputs]


def _value_dtypes(group: ir.Group, args: Sequence) -> Optional[dict]:
    from .fallback import evaluate
    metas = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor)
             else a for a in args]
    try:
        values = evaluate(group, metas, every_value=True)[len(group.outputs):]
    except Exception:  # an op without a meta kernel
        return None
    out = {v.id: a.dtype for v, a in zip(group.inputs, args) if isinstance(a, torch.Tensor)}
    out.update({n.out.id: val.dtype for n, val in zip(group.nodes, values)})
    return out


def _operand(a, env) -> Optional[Layout]:
    if isinstance(a, ir.Value):
        return env.get(a.id)
    if isinstance(a, ir.TensorConst):
        return a.shape, contiguous_strides(a.shape)
    return None


def _dtype(a, dtypes: dict) -> Optional[torch.dtype]:
    return a.dtype if isinstance(a, ir.TensorConst) else dtypes.get(a.id) if isinstance(a, ir.Value) else None


def _node_layout(n: ir.Node, env: dict, dtypes: dict) -> Union[Layout, str, None]:
    if n.op == views.PERMUTE:  # a view: its operand's sizes and strides, reordered
        sizes, strides = env[n.args[0].id]
        dims = views.permute_dims(n.args[1], len(sizes))
        if dims is None:
            return f"permute dims {list(n.args[1])} for a tensor of {len(sizes)} dims (eager raises)"
        return tuple(sizes[d] for d in dims), tuple(strides[d] for d in dims)
    if n.op == "aten::cat":  # channels_last when every piece suggests it, else contiguous
        pieces = [env[x.id] for x in n.args[0]]
        dim = n.args[1] % len(pieces[0][0])
        sizes = list(pieces[0][0])
        sizes[dim] = sum(s[dim] for s, _ in pieces)
        if all(_strides_like_channels_last(*p) for p in pieces):
            return tuple(sizes), _channels_last_strides(sizes)
        return tuple(sizes), contiguous_strides(sizes)
    params = ir.params(n.op)
    operands = []
    for p, a in zip(params, n.args):
        lay = _operand(a, env)
        if lay is not None:
            operands.append(lay)
        elif p.name in _WRAPPED_SCALARS and isinstance(a, (ir.Value, int, float, bool)):
            operands.append(((), ()))  # a Scalar eager wraps into a 0-dim tensor operand
    if n.op == "aten::rsub.Tensor":  # other - self: TensorIterator's operands in that order
        operands.reverse()
    if n.op == "aten::type_as":
        self_layout = _operand(n.args[0], env)
        if non_overlapping_and_dense(*self_layout):
            return self_layout  # itself, or a copy with its strides
        a, b = _dtype(n.args[0], dtypes), _dtype(n.args[1], dtypes)
        if a is None or b is None:
            return None  # it aliases its input when the dtypes agree: the caller finds them
        return self_layout if a == b else empty_like(*self_layout)
    if n.op.split(".")[0] in _LIKE:
        return empty_like(*_operand(n.args[0], env))
    if n.op in _CONTIGUOUS:
        sizes = next(lay for lay in map(lambda a: _operand(a, env), n.args) if lay is not None)[0]
        return sizes, contiguous_strides(sizes)
    return tensor_iterator(operands)
