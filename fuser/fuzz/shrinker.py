"""Delta debugging: a failing program made smaller (outputs and ops dropped, shapes cut, layouts and dtypes
simplified) while the same kind of mismatch persists."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .judge import Verdict
from .program import Program, TensorInput, _broadcast, _contig


def _replace_value(p: Program, old, new) -> Optional[Program]:
    q = p.copy()
    for n in q.nodes:
        for a in n.args:
            if a.kind == "val" and a.v == old:
                a.v = new
    if new[0] != "n":
        if old in q.outputs:
            return None
    q.outputs = [new if r == old else r for r in q.outputs]
    q.outputs = list(dict.fromkeys(q.outputs))
    # a node referring to itself or a later node is impossible here: ``new`` is an input of ``old``
    return q.compact()


def _map_shape_of(p: Program) -> tuple:
    return tuple(_broadcast(*(t.size for t in p.tensors))) if p.tensors else ()


def _slice_inputs(p: Program, dim_from_right: int, sl: slice) -> Program:
    tensors = []
    for t in p.tensors:
        d = len(t.size) - dim_from_right
        if d < 0 or t.size[d] == 1:
            tensors.append(t)
            continue
        v = t.view()[(slice(None),) * d + (sl,)]
        base = TensorInput(t.storage, v.shape, v.stride(), v.storage_offset(), t.layout).compacted()
        tensors.append(base)
    return Program(tensors, p.floats, p.nodes, p.outputs)


def _squeeze_inputs(p: Program, dim_from_right: int) -> Program:
    tensors = []
    for t in p.tensors:
        d = len(t.size) - dim_from_right
        if d < 0:
            tensors.append(t)
            continue
        tensors.append(TensorInput(t.storage, t.size[:d] + t.size[d + 1:], t.stride[:d] + t.stride[d + 1:],
                                   t.offset, t.layout))
    return Program(tensors, p.floats, p.nodes, p.outputs)


def _with_tensor(p: Program, k: int, t: TensorInput) -> Program:
    tensors = list(p.tensors)
    tensors[k] = t
    return Program(tensors, p.floats, p.nodes, p.outputs)


def _candidates(p: Program):
    # fewer outputs
    if len(p.outputs) > 1:
        for r in p.outputs:
            q = p.copy()
            q.outputs = [r]
            yield "keep one output", q.compact()
        for r in p.outputs:
            q = p.copy()
            q.outputs = [x for x in p.outputs if x != r]
            yield "drop an output", q.compact()
    # bypass a node: its users read one of its tensor arguments instead
    for j in reversed(range(len(p.nodes))):
        for a in p.nodes[j].args:
            if a.kind == "val":
                q = _replace_value(p, ("n", j), a.v)
                if q is not None:
                    yield "bypass a node", q
    # float inputs to constants, tensor constants to float constants
    for k, f in enumerate(p.floats):
        q = p.copy()
        for n in q.nodes:
            for a in n.args:
                if a.kind == "float" and a.v == k:
                    a.kind, a.v = "const", f
        yield "inline a float input", q.compact()
    # smaller shapes
    shape = _map_shape_of(p)
    for dr in range(1, len(shape) + 1):
        n = shape[-dr]
        if n > 1:
            h = n // 2
            for sl in (slice(0, h), slice(h, n), slice(0, 1), slice(n - 1, n)):
                yield "cut a dim", _slice_inputs(p, dr, sl)
    for dr in range(1, len(shape) + 1):
        if shape[-dr] == 1:
            yield "drop a size-1 dim", _squeeze_inputs(p, dr)
    # simpler layouts and dtypes
    for k, t in enumerate(p.tensors):
        if t.layout != "contiguous" or t.stride != _contig(t.size) or t.offset:
            v = t.view()
            flat = torch.empty(v.numel(), dtype=v.dtype).copy_(v.reshape(-1))
            yield "contiguous input", _with_tensor(p, k, TensorInput(flat, v.shape, _contig(v.shape), 0))
    for k, t in enumerate(p.tensors):
        if t.dtype in (torch.float16, torch.bfloat16, torch.float64):
            yield "float32 input", _with_tensor(p, k, TensorInput(t.storage.float(), t.size, t.stride, t.offset,
                                                                  t.layout))
    # simpler values: zero out elements of small tensors one by one (keeps specials that matter)
    for k, t in enumerate(p.tensors):
        if 1 < t.storage.numel() <= 16:
            for i in range(t.storage.numel()):
                x = t.storage[i].item()
                if x != 0 and not (isinstance(x, float) and x == 1.0):
                    s = t.storage.clone()
                    s[i] = 0
                    yield "zero a value", _with_tensor(p, k, TensorInput(s, t.size, t.stride, t.offset, t.layout))


def shrink(p: Program, verdict: Verdict, evaluate: Callable[[Program], Verdict], budget_s: float = 120.0,
           log: Callable[[str], None] = lambda s: None) -> tuple:
    """Delta-debug ``p`` while ``evaluate`` keeps failing with ``verdict.kind``. Returns (program, verdict, steps)."""
    deadline = time.monotonic() + budget_s
    best, best_v, steps = p, verdict, 0
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for what, cand in _candidates(best):
            if time.monotonic() > deadline:
                break
            if not cand.nodes or not cand.outputs:
                continue
            v = evaluate(cand)
            if not v.ok and v.kind == verdict.kind:
                best, best_v, steps, progress = cand, v, steps + 1, True
                log(f"  shrink: {what}: {len(best.nodes)} ops, inputs "
                    f"{[list(t.size) for t in best.tensors]}")
                break
    best = Program([t.compacted() for t in best.tensors], best.floats, best.nodes, best.outputs)
    return best, best_v, steps
