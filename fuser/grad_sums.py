"""Broadcast inputs' gradients summed by generated column groups (issue 12), not by eager's ``sum_to_size``.

A backward group (``fuser/backward.py``) gives each input's gradient element by element, at the full shape F of the
forward. An input broadcast over F's leading dims (a bias or a norm's weight of shape [cols], or [1, ..., cols])
needs that gradient summed over them. Here the backward is split, once per pattern (the backward, and per output
which leading dims are summed), into:

- the main group: the backward group without those outputs, plus the row-level values the sums read (a row
  backward's statistics, layer_norm's mean and rstd, as [rows..., 1]);
- per set of summed dims, a column group (``fuser/rows/outer.py``): the nodes that form the gradients element by
  element (its prologue, reading the backward's inputs and those row-level values, broadcast along the row) and a
  ``sum(grad, dims, keepdim=True)`` of each, one column kernel for the weight's and the bias's gradients together.

Both are registered in the kernel store and run through the executor like any group.

A backward is first tried in a fused form (:class:`Fused`): the backward group with each summed output replaced
by its sum over the leading dims (kept beside it where an input takes it whole). A row backward's (one with
reductions along the row: layer_norm's, rms_norm's, softmax's) the row plan takes as column sums
(``fuser.rows.passes.column_sum_form``): the row kernel that computes x's gradient adds the weight's and the bias's
per-element gradients into partial rows and a second stage adds those, so x and dy are read once (eager's and
Inductor's layer_norm backward sum per block, then reduce the blocks, the same way). A pointwise backward's is a
column group (``fuser/rows/outer.py``) that writes x's gradient and sums the bias's as it goes, so the split's main
group does not write a gradient that its column group then reads again (gelu(x + b)'s training step on an H200,
float32 [16384 x 4096]: see the README's benchmark notes); on CUDA only (:func:`_fused_first`). Where that kernel
does not run for a signature (its plan fell back: a CUDA row of several trips whose sums pass a block's shared
memory, float32 on the CPU past ``fuser.rows.plan.CPU_MAX_SUMMED`` elements where that is set, sums over some of the
row dims only, sums over two sets of dims), that call and the later ones of that signature take the split. Where a pattern does not split (dims that
are not leading, a random or cat group, float16/bfloat16 statistics that would be rounded in memory, an empty shape,
autograd recording the backward), or where a column kernel did not run for a signature (its plan fell back: that call and the later ones of
that signature, so that a backward run twice gives the same values), the caller keeps the old path: the whole
backward group, then ``sum_to_size``.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import executor, fallback, ir, settings
from .kernel_cache import STORE, KernelSpec
from .rows.passes import row_level
from .rows.plan import SUMS_IN_KERNEL_ONLY

SUM = "aten::sum.dim_IntList"
REDUCED = (torch.float16, torch.bfloat16)
MAX_CACHED = 4096


@dataclass(frozen=True)
class Column:
    """A column group: ``inputs`` per group input, ``(0, i)`` the backward's argument i or ``(1, i)`` the main
    group's row-level output i; its outputs are the sums of the backward's outputs ``sums`` over ``dims``."""

    spec: KernelSpec
    inputs: tuple[tuple[int, int], ...]
    sums: tuple[int, ...]
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """The main group (None: no output left) reads the backward's arguments ``main_inputs``; its outputs are the
    backward's outputs ``kept``, then ``n_rows`` row-level values the column groups read. ``apart``: a group of its
    own for the outputs ``apart_outputs`` (reading the arguments ``apart_inputs``), whose shape is not the others'
    (a column forward's epilogue input: a pointwise kernel writes outputs of one shape)."""

    main: Optional[KernelSpec]
    main_inputs: tuple[int, ...]
    kept: tuple[int, ...]
    n_rows: int
    columns: tuple[Column, ...]
    apart: Optional[KernelSpec] = None
    apart_inputs: tuple[int, ...] = ()
    apart_outputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fused:
    """The backward group with its summed outputs as sums over the rows (``fuser.rows.passes.column_sum_form``: one
    row kernel adds them up while it computes x's gradient, reading the inputs once); per backward output, its
    position among ``spec``'s outputs taken whole (``whole``) and summed (``summed``), or None."""

    spec: KernelSpec
    whole: tuple[Optional[int], ...]
    summed: tuple[Optional[int], ...]


_fused: dict[tuple, Optional[Fused]] = {}
_no_fused: set = set()  # (backward key, shapes, dtypes, device) whose fused kernel did not run: the split from then on
fused_keys: set[int] = set()  # the fused groups' spec keys (tests ask whether one ran)
_splits: dict[tuple, Optional[Split]] = {}
_plans: dict[tuple, Optional[tuple]] = {}
_no_kernel: set = set()  # (backward key, shapes, dtypes, device) whose column kernel fell back: the old path from then on
_lock = threading.Lock()
column_keys: set[int] = set()  # the column groups' spec keys (tests ask whether one ran)


def _bounded(cache):
    if len(cache) >= MAX_CACHED:
        cache.clear()
    return cache


def summed_dims(full: Sequence[int], shape: Sequence[int]) -> Optional[tuple[int, ...]]:
    """The dims of ``full`` an input of ``shape`` is broadcast over, where they are leading (every one before every
    kept dim of size > 1: a column kernel's form); None otherwise (no such dim, or not leading)."""
    n = len(full)
    if len(shape) > n:
        return None
    padded = (1,) * (n - len(shape)) + tuple(shape)
    dims = tuple(d for d in range(n) if padded[d] == 1 and full[d] != 1)
    kept = [d for d in range(n) if d not in dims and full[d] != 1]
    if not dims or (kept and max(dims) > min(kept)):
        return None
    return dims


def plan(spec: KernelSpec, bw, shapes: Sequence[torch.Size], full: torch.Size, sig: tuple,
         args: Sequence) -> Optional[tuple]:
    """Per backward output (``bw.grad_inputs`` order): (whether an input takes it whole, the dims it is summed over
    for the others or None, whether a group of its own computes it); None where this call takes the old path. ``shapes``: the forward's tensor inputs';
    ``full``: their broadcast shape; ``sig``: per tensor input (dtype, 0-dim); ``args``: the backward's arguments
    (their shapes only: the backward's outputs' shapes, from a run on meta tensors, once per key)."""
    key = (bw.spec.key, bw.grad_inputs, bw.aliases, tuple(shapes), sig,  # (one group serves several needs)
           tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args))
    if key in _plans:
        return _plans[key]
    got = _plan(spec, bw, shapes, full, sig, args)
    _bounded(_plans)[key] = got
    return got


def summed(spec: KernelSpec, bw, shapes: Sequence[torch.Size], full: torch.Size) -> bool:
    """Whether an input's gradient may be summed by a column group for these shapes (the native hot path hands such
    backwards to Python unless :func:`fused_plan` serves them; :func:`plan` decides)."""
    if spec.random or spec.has_concat or math.prod(full) == 0:
        return False
    return any(tuple(shapes[t]) != tuple(full) and summed_dims(full, shapes[t]) is not None
               for js in _users(spec, bw).values() for _, t in js)


_user_maps: dict[tuple, dict] = {}


def _users(spec: KernelSpec, bw) -> dict:
    """Backward output -> the tensor input indices (among the forward's tensor inputs) whose gradient it is (built
    once per pattern: every backward call reads it)."""
    key = (spec.key, bw.spec.key, tuple(bw.grad_inputs), tuple(bw.aliases))
    users = _user_maps.get(key)
    if users is None:
        t_index = {j: k for k, j in enumerate(j for j, is_t in enumerate(spec.input_is_tensor) if is_t)}
        users = {}
        for j, out in [*zip(bw.grad_inputs, range(len(bw.grad_inputs))), *bw.aliases]:
            users.setdefault(out, []).append((j, t_index[j]))
        _bounded(_user_maps)[key] = users
    return users


def _out_shapes(g: ir.Group, args: Sequence) -> Optional[list]:
    """The shapes of ``g``'s outputs for ``args``, from a run on meta tensors (None where that raises)."""
    metas = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor)
             else a for a in args]
    try:
        return [tuple(o.shape) for o in fallback.evaluate(g, metas)]
    except Exception:
        return None


def _plan(spec, bw, shapes, full, sig, args) -> Optional[tuple]:
    if spec.random or spec.has_concat or math.prod(full) == 0:
        return None
    out_shapes = _out_shapes(bw.spec.group, args)
    if out_shapes is None:
        return None
    users = _users(spec, bw)
    per_out = []
    for out in range(len(bw.grad_inputs)):
        if out_shapes[out] != tuple(full):  # (a column forward's epilogue input: its gradient has the columns' shape)
            per_out.append((True, None, not bw.spec.has_reduction))
            continue
        dims = [summed_dims(full, shapes[t]) if tuple(shapes[t]) != tuple(full) else None for _, t in users[out]]
        sums = {d for d in dims if d is not None}
        if len(sums) != 1:  # none, or inputs summed over different dims: whole (the old path for them)
            per_out.append((True, None, False))
        else:
            per_out.append((None in dims, sums.pop(), False))
    if all(d is None and not apart for _, d, apart in per_out):
        return None
    return tuple(per_out)


def _rounded_statistics(spec: KernelSpec, bw, dims: tuple, sig: tuple) -> bool:
    """Whether the split of a row backward would pass its statistics through memory in a float16/bfloat16 input's
    dtype (the kernel holds them in float): then the split does not apply (the fused form reads none)."""
    if not (spec.has_reduction and any(dt in REDUCED for dt, _ in sig)):
        return False
    split = split_for(bw, dims)
    return split is None or bool(split.n_rows)


def fused_for(bw, dims: tuple) -> Optional[Fused]:
    """The fused form of ``bw`` for :func:`plan`'s ``dims`` (None where an output is computed apart), built once."""
    key = (bw.spec.key, dims)
    if key in _fused:
        return _fused[key]
    got = None if any(apart for _, _, apart in dims) else _build_fused(bw.spec.group, dims)
    with _lock:
        return _bounded(_fused).setdefault(key, got)


def _build_fused(g: ir.Group, dims: tuple) -> Fused:
    from .backward import _backward_keys
    next_id = 1 + max([v.id for v in g.inputs] + [n.out.id for n in g.nodes])
    outputs, sums, whole, summed = [], [], [], []
    for k, (keep, d, _) in enumerate(dims):
        whole.append(len(outputs) if keep else None)
        if keep:
            outputs.append(g.outputs[k])
        summed.append(len(outputs) if d is not None else None)
        if d is not None:
            sums.append(ir.Node(SUM, (g.outputs[k], d, True, None), ir.Value(next_id)))
            outputs.append(sums[-1].out)
            next_id += 1
    spec = STORE.get(STORE.register(ir.Group(g.inputs, g.nodes + tuple(sums), tuple(outputs)).pruned()))
    fused_keys.add(spec.key)
    SUMS_IN_KERNEL_ONLY.add(spec.key)  # where the row kernel cannot sum, the split below does (not the plan's apart)
    _backward_keys.add(spec.key)
    return Fused(spec, tuple(whole), tuple(summed))


def split_for(bw, dims: tuple) -> Optional[Split]:
    """The split of ``bw`` for :func:`plan`'s ``dims``, built once."""
    key = (bw.spec.key, dims)
    if key in _splits:
        return _splits[key]
    got = _build(bw.spec.group, dims)
    with _lock:
        return _bounded(_splits).setdefault(key, got)


def _build(g: ir.Group, dims: tuple) -> Optional[Split]:
    from .backward import _backward_keys  # (they are backward groups too: tests and tools ask that set)
    rows = row_level(g)
    producer = {n.out.id: n for n in g.nodes}
    position = {v.id: p for p, v in enumerate(g.inputs)}
    kept = tuple(k for k, (whole, _, apart) in enumerate(dims) if whole and not apart)
    apart = tuple(k for k, (_, _, a) in enumerate(dims) if a)
    # the main group's outputs: the kept gradients, then the row-level values the column groups read; a column
    # group reads a kept gradient from there too (the bias of gelu(x + b): x's gradient is written anyway)
    main_out: list[ir.Value] = [g.outputs[k] for k in kept]
    stops = {v.id for v in main_out} | rows
    next_id = 1 + max([v.id for v in g.inputs] + [n.out.id for n in g.nodes])
    groups: dict[tuple, list[int]] = {}
    for out, (_, d, _) in enumerate(dims):
        if d is not None:
            groups.setdefault(d, []).append(out)
    columns = []
    for d, outs in groups.items():
        need, stack, reads = set(), [g.outputs[k] for k in outs], set()
        while stack:
            v = stack.pop()
            if v.id in need:
                continue
            need.add(v.id)
            if v.id in stops or v.id in position:
                reads.add(v.id)
            else:
                stack.extend(producer[v.id].values)
        nodes = tuple(n for n in g.nodes if n.out.id in need and n.out.id not in reads)
        computed = [v for v in [n.out for n in g.nodes] if v.id in reads]  # read from the main group
        for v in computed:
            if all(c.id != v.id for c in main_out):
                main_out.append(v)
        inputs = [v for v in g.inputs if v.id in reads]
        sums = []
        for k in outs:
            sums.append(ir.Node(SUM, (g.outputs[k], d, True, None), ir.Value(next_id)))
            next_id += 1
        col = ir.Group(tuple(inputs) + tuple(computed), nodes + tuple(sums), tuple(n.out for n in sums))
        cspec = STORE.get(STORE.register(col))
        column_keys.add(cspec.key)
        _backward_keys.add(cspec.key)
        where = tuple((0, position[v.id]) for v in inputs) + tuple(
            (1, next(i for i, c in enumerate(main_out) if c.id == v.id)) for v in computed)
        columns.append(Column(cspec, where, tuple(outs), d))
    mspec, keep = _part(g, main_out)
    aspec, akeep = _part(g, [g.outputs[k] for k in apart])
    return Split(mspec, keep, kept, len(main_out) - len(kept), tuple(columns), aspec, akeep, apart)


def _part(g: ir.Group, outputs: Sequence[ir.Value]) -> tuple[Optional[KernelSpec], tuple[int, ...]]:
    """The group of ``g``'s nodes that ``outputs`` need, registered (a backward group too), and the positions of the
    inputs it reads; (None, ()) for no outputs."""
    from .backward import _backward_keys
    if not outputs:
        return None, ()
    part = ir.Group(g.inputs, g.nodes, tuple(outputs)).pruned()
    used = {v.id for n in part.nodes for v in n.values} | {v.id for v in part.outputs}
    keep = tuple(p for p, v in enumerate(g.inputs) if v.id in used)
    spec = STORE.get(STORE.register(part.with_inputs(keep)))
    _backward_keys.add(spec.key)
    return spec, keep


def run(spec: KernelSpec, bw, args: list, shapes: Sequence[torch.Size], full: torch.Size, sig: tuple,
        launch: Optional[Callable] = None) -> Optional[list]:
    """[(forward input index, its gradient)] for the backward's arguments ``args``: a summed one of its shape up to
    dims of size 1 (keepdim), a kept one element-level (the caller sums it where its shape differs, as before);
    or None where this call takes the old path (the caller runs ``bw`` and ``sum_to_size``). Runs without
    autograd recording (the caller checks grad mode is off). ``launch(spec, args)``: a group's outputs from its
    kernel, or None (then the interpreter runs it; tests pass the CUDA host emulation's); the executor's by default."""
    launch = launch or executor.run
    dims = plan(spec, bw, shapes, full, sig, args)
    if dims is None:
        return None
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    signature = (bw.spec.key, tuple(shapes), sig, device)  # (a kernel may run on one device and not another)
    whole: list = [None] * len(dims)
    summed: list = [None] * len(dims)
    if signature not in _no_fused and _fused_first(bw, device):
        fused = fused_for(bw, dims)
        outs = None if fused is None else launch(fused.spec, args)
        if outs is not None:
            for k, (w, s) in enumerate(zip(fused.whole, fused.summed)):
                whole[k] = None if w is None else outs[w]
                summed[k] = None if s is None else outs[s]
            return _gathered(spec, bw, dims, shapes, full, whole, summed)
        with _lock:  # the split from now on for this signature (the same values every call)
            _bounded(_no_fused).add(signature)
    if signature in _no_kernel or _rounded_statistics(spec, bw, dims, sig):
        return None
    split = split_for(bw, dims)
    if split is None:
        return None
    main: list = []
    if split.main is not None:
        margs = [args[p] for p in split.main_inputs]
        main = launch(split.main, margs)
        if main is None:
            main = fallback.run(split.main, margs)
        for k, r in zip(split.kept, main):
            whole[k] = r
    if split.apart is not None:
        aargs = [args[p] for p in split.apart_inputs]
        outs = launch(split.apart, aargs)
        for k, r in zip(split.apart_outputs, outs if outs is not None else fallback.run(split.apart, aargs)):
            whole[k] = r
    for col in split.columns:
        cargs = [args[i] if kind == 0 else main[i] for kind, i in col.inputs]
        outs = launch(col.spec, cargs)
        if outs is None:  # the old path, for this call and the later ones of this signature (the same values)
            with _lock:
                _bounded(_no_kernel).add(signature)
            return None
        for k, r in zip(col.sums, outs):
            summed[k] = r
    return _gathered(spec, bw, dims, shapes, full, whole, summed)


def _gathered(spec: KernelSpec, bw, dims: tuple, shapes, full, whole: list, summed: list) -> list:
    """:func:`run`'s result from the backward outputs taken whole and summed."""
    return [(j, (summed if take else whole)[out]) for j, out, take in _takes(spec, bw, dims, shapes, full)]


def _takes(spec: KernelSpec, bw, dims: tuple, shapes, full) -> list[tuple[int, int, bool]]:
    """Per forward input with a gradient: (its index, the backward output giving it, whether summed)."""
    got = []
    for out, js in _users(spec, bw).items():
        d = dims[out][1]
        for j, t in js:
            take = d is not None and tuple(shapes[t]) != tuple(full) and summed_dims(full, shapes[t]) == d
            got.append((j, out, take))
    return got


def fused_plan(spec: KernelSpec, bw, args: list, shapes: Sequence[torch.Size], full: torch.Size,
               sig: tuple) -> Optional[tuple[KernelSpec, list[tuple[int, int]]]]:
    """For the native hot path, which prepares a backward before it runs: where :func:`run` would take a
    backward's fused form for arguments like ``args`` and its kernel serves them (planned and compiled now), the
    fused group and, per forward input with a gradient, (its index, the fused group's output that is its gradient,
    summed or taken whole); else None (Python's backward decides per call, as before)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return None
    dims = plan(spec, bw, shapes, full, sig, args)
    if dims is None or _fused_declines(bw, dims, tensors, args, (bw.spec.key, tuple(shapes), sig, tensors[0].device)):
        return None
    fused = fused_for(bw, dims)
    if len(fused.spec.group.inputs) != len(args):
        return None
    takes = [(j, (fused.summed if take else fused.whole)[out])
             for j, out, take in _takes(spec, bw, dims, shapes, full)]
    if any(position is None for _, position in takes):
        return None
    return fused.spec, takes


def _fused_first(bw, device: torch.device) -> bool:
    """Whether a backward on ``device`` tries its fused form before the split: a row backward's, and on CUDA (with
    ``settings.cuda_column_sums``) a pointwise backward's too. On the CPU a pointwise backward keeps the split: its
    vectorized pointwise kernel and a column kernel over the gradient beat one column kernel there (gelu(x + b)'s
    training step over [1024 x 4096], the CPU benchmark's row, a 2-core Xeon, two rounds: float32 10.2-10.5 ms
    split, 11.1-11.4 ms fused; bfloat16 6.0 against 6.7-6.8 ms)."""
    if device.type == "cuda":
        return settings.cuda_column_sums
    return bw.spec.has_reduction


def _fused_declines(bw, dims: tuple, tensors: Sequence[torch.Tensor], args: list, signature: tuple) -> bool:
    """Whether :func:`run` takes a backward's split for such arguments (``signature``: :func:`run`'s): its fused
    form is off (CUDA without ``settings.cuda_column_sums``), there is none, or its kernel does not serve them (a
    fallback: :func:`run` takes the split from then on)."""
    if signature in _no_fused or not _fused_first(bw, tensors[0].device):
        return True
    fused = fused_for(bw, dims)
    return fused is None or (len(fused.spec.group.inputs) == len(args)
                             and executor.kernel_geometry(fused.spec, tensors, args) is None)


def split_plan(spec: KernelSpec, bw, args: list, shapes: Sequence[torch.Size], full: torch.Size,
               sig: tuple) -> Optional[tuple[list, list]]:
    """For the native hot path, which prepares a backward before it runs: where :func:`run` would take the split of a
    backward (its main group, a group apart, the column groups) where :func:`_fused_declines`, for
    arguments like ``args`` and a kernel serves every part (planned and compiled now; no float argument limits, which
    would send a call to the old path), (steps, takes); else None (Python's backward decides per call, as before).
    Steps, in :func:`run`'s order: (group, 0 or 2 for a column group, its inputs as (-1, the backward's argument) or
    (an earlier step, its output)); takes: per forward input with a gradient, (its index, the step, the step's
    output)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return None
    dims = plan(spec, bw, shapes, full, sig, args)
    signature = (bw.spec.key, tuple(shapes), sig, tensors[0].device)
    if dims is None or signature in _no_kernel or _rounded_statistics(spec, bw, dims, sig) or (
            not _fused_declines(bw, dims, tensors, args, signature)):
        return None
    split = split_for(bw, dims)
    if split is None:
        return None
    steps, made, where = [], {}, {}  # made: step -> its outputs like the real ones; where: ("whole"/"summed", out)

    def add(part: KernelSpec, kind: int, inputs: list) -> bool:
        part_args = [args[i] if src < 0 else made[src][i] for src, i in inputs]
        part_tensors = [a for a in part_args if isinstance(a, torch.Tensor)]
        geo = executor.kernel_geometry(part, part_tensors, part_args)
        if geo is None or geo.kernel.scalar_limits:
            return False
        made[len(steps)] = None if kind else executor.outputs_like(geo, part_tensors)
        steps.append((part, kind, inputs))
        return True

    if split.main is not None:
        if not add(split.main, 0, [(-1, p) for p in split.main_inputs]):
            return None
        where.update({("whole", k): (0, r) for r, k in enumerate(split.kept)})
    if split.apart is not None:
        if not add(split.apart, 0, [(-1, p) for p in split.apart_inputs]):
            return None
        where.update({("whole", k): (len(steps) - 1, r) for r, k in enumerate(split.apart_outputs)})
    for col in split.columns:
        if not add(col.spec, 2, [(-1, i) if kind == 0 else (0, i) for kind, i in col.inputs]):
            return None
        where.update({("summed", k): (len(steps) - 1, r) for r, k in enumerate(col.sums)})
    takes = []
    for j, out, take in _takes(spec, bw, dims, shapes, full):
        got = where.get(("summed" if take else "whole", out))
        if got is None:
            return None
        takes.append((j, *got))
    return steps, takes


__all__ = ["Column", "Fused", "Split", "column_keys", "fused_for", "fused_keys", "fused_plan", "plan", "run",
           "split_for", "split_plan", "summed", "summed_dims"]
