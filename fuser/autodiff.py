"""Fusion groups under autograd: a differentiable group op whose backward is a generated fusion group too.

When grad mode is on and an input requires grad, :func:`run` wraps the group in an autograd Function. Its
forward runs the forward kernel (grad mode is off inside it) and saves the inputs the backward reads, and the
outputs it reads (a softmax or log_softmax result, ``Backward.saved_outputs``: saved as eager saves its output, so
an in-place change of it before backward raises eager's error). On the CPU the forward may also write the
transcendental values its backward reads, as extra outputs it saves and does not return (``fuser/saving.py``,
``_read_saved``). Its backward is a group that ``fuser/backward.py`` builds from the derivative table. That group is registered in the kernel store like any group, so it gets a fused kernel (or the
fallback, when it cannot be fused), and, when the backward itself runs under grad mode
(``create_graph=True``), it is differentiated the same way: double backward either runs fused or through
the interpreter. Gradients of inputs broadcast over the leading dims (a bias, a norm's weight of shape [cols]) are
summed by generated column groups (``fuser/grad_sums.py``: the backward group split in two, the sums fused with the
gradient's own element-level ops); other broadcast inputs' gradients, and every one where that split does not
apply (double backward, a random or cat group), are summed to the input's shape after the kernel by
``sum_to_size``.

A group with reductions (``fuser/rows/``) is wrapped only where its forward runs as a row or column kernel (the
kernel runs first, as for a random group; where it cannot, the interpreter runs the group and eager's autograd
records it; which of the two ran picks the backward: ``backward._Rows``).
Its backward group holds reductions too and runs as a row kernel like any group. A gradient summed along the
row (a row-level value read by element-level ops) is summed inside that kernel; an input broadcast across rows
(a bias or weight of shape [cols]) gets its gradient from a column group that reads the row statistics the main
backward group writes (layer_norm's mean and rstd; ``fuser/grad_sums.py``), or, where that does not apply
(float16/bfloat16 statistics), eager's ``sum_to_size`` after it.

A group whose gradient cannot be formed here (an op without a formula, a formula that needs an argument
that is not a constant) is not wrapped: the interpreter runs it op by op and eager's autograd records it.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Optional, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad

from . import compiler, executor, fallback, grad_sums, ir, layout, ops, rng, saving, settings, views
from .backward import Backward, _carries, _Unsupported, build_backward, extra_outputs, forward_group, statistics
from .descs import DENSE, ArgSpec, TensorDesc
from .kernel_cache import STORE, KernelSpec

_functorch_stack = torch._C._functorch.peek_interpreter_stack


def run(spec: KernelSpec, args: list, rng_state: Optional[list] = None) -> list[torch.Tensor]:
    """The group's outputs: the fused kernel, the differentiable fused group, or the interpreter.

    ``rng_state``: a random group's backward replays its forward's numbers with the forward's state (kernels
    only: the interpreter's rand_like would draw others, so there a replay raises).
    """
    # an input that requires grad under grad mode: the kernel alone would not do (the executor says None)
    grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    out = None if grad else executor.run(spec, args, rng_state)
    if out is None and grad and isinstance(spec.views, tuple):
        out = _differentiable_views(spec, args)
    elif out is None:
        out = differentiable(spec, args, rng_state)
    if out is None and rng_state is not None:
        raise RuntimeError("fuser: the backward of a fusion group with rand_like (dropout) could not run as a "
                           "kernel, and the interpreter cannot redraw the forward's numbers. Please report this; "
                           "fuser.override_can_fuse_on_cpu/gpu(False) before the forward avoids it.")
    return out if out is not None else fallback.run(spec, args)


# (spec key, needs, defined, dtype signature) -> Backward, or None where the table cannot form it
_backwards: dict[tuple, Optional[Backward]] = {}
_floating: dict[tuple, frozenset] = {}
_dtypes: dict[tuple, dict] = {}
_lock = threading.Lock()


MAX_CACHED = 4096  # per cache below: past it, the cache starts over (bounded, not a leak)


def _bounded(cache: dict) -> dict:
    if len(cache) >= MAX_CACHED:
        cache.clear()
    return cache


def _floating_values(spec: KernelSpec, sig: tuple) -> frozenset:
    """ids of the group values whose dtype is floating, for tensor inputs of dtypes ``sig``."""
    key = (spec.key, sig)
    got = _floating.get(key)
    if got is None:
        got = frozenset(v for v, dt in _value_dtypes(spec, sig).items() if dt.is_floating_point)
        _bounded(_floating)[key] = got
    return got


def _value_dtypes(spec: KernelSpec, sig: tuple) -> dict:
    """id -> dtype of the group's tensor inputs and nodes, for tensor inputs of dtypes ``sig`` (the dtypes come
    from the same eager probe the compiler uses; it raises what eager raises for these dtypes)."""
    key = (spec.key, sig)
    got = _dtypes.get(key)
    if got is not None:
        return got
    if spec.has_reduction:
        results = _reduction_dtypes(spec, sig)
    else:
        arg_spec = ArgSpec("cpu", None, tuple(TensorDesc(dt, DENSE, zero_dim) for dt, zero_dim in sig))
        results = [t.result for t in compiler.infer_types(spec, arg_spec)]
    got = {n.out.id: dt for n, dt in zip(spec.group.nodes, results)}
    dtypes = iter(sig)
    got.update({v.id: next(dtypes)[0] for v in spec.group.inputs if v.is_tensor})
    _bounded(_dtypes)[key] = got
    return got


def _reduction_dtypes(spec: KernelSpec, sig: tuple) -> list:
    """Each node's result dtype for a group with reductions: the group run on meta tensors of ones along every
    dim its reductions name (the pointwise probe's empty tensors would make amax raise), ending in a
    normalization's normalized_shape (its weight and bias: of that shape)."""
    rank, trailing, weights = 1, (), set()
    for n in spec.group.nodes:
        dims = ops.reduced_dims(n.op, n.args)
        if dims:
            rank = max([rank] + [d + 1 if d >= 0 else -d for d in dims])
        if n.op in ops.COMPOSITE_TENSOR_ARGS:
            trailing = max(trailing, tuple(n.args[1]), key=len)
            weights |= {n.args[k].id for k in ops.COMPOSITE_TENSOR_ARGS[n.op] if isinstance(n.args[k], ir.Value)}
    dtypes = iter(sig)
    samples = []
    for v, is_t in zip(spec.group.inputs, spec.input_is_tensor):
        if is_t:
            dt, zero_dim = next(dtypes)
            shape = () if zero_dim else trailing if v.id in weights else (1,) * (rank - len(trailing)) + trailing
            samples.append(torch.empty(shape, dtype=dt, device="meta"))
        else:
            samples.append(1.0)
    values = fallback.evaluate(spec.group, samples, every_value=True)[len(spec.group.outputs):]
    return [v.dtype for v in values]


def backward_for(spec: KernelSpec, needs: tuple, defined: tuple, sig: tuple,
                 columns: bool = False, chunks: tuple = (), save: tuple = ()) -> Optional[Backward]:
    """``columns``: the forward ran as a column kernel (``fuser/rows/outer.py``), whose backward differs.
    ``chunks``: per tensor, (dim, group inputs) that are its chunks (``_chunked_inputs``). ``save``: forward values
    read from the forward's outputs and extra outputs (``fuser/saving.py``)."""
    key = (spec.key, needs, defined, sig, columns, chunks, save)
    if key in _backwards:
        return _backwards[key]
    try:
        bw = build_backward(spec, needs, defined, _floating_values(spec, sig), columns, _value_dtypes(spec, sig),
                            chunks, save)
    except _Unsupported:
        bw = None
    except RuntimeError:  # eager rejects these dtypes (the type probe raised): the interpreter will say so
        bw = None
    with _lock:
        return _bounded(_backwards).setdefault(key, bw)


def _carried_outputs(spec: KernelSpec, needs: tuple, sig: tuple) -> tuple[bool, ...]:
    key = (spec.key, needs, sig)
    got = _carried.get(key)
    if got is None:
        carries = _carries(spec.group, needs, _floating_values(spec, sig)) or set()
        got = _bounded(_carried)[key] = tuple(o.id in carries for o in spec.group.outputs)
    return got


_carried: dict[tuple, tuple] = {}
_saves: dict[tuple, tuple] = {}  # (spec key, needs, sig, chunks) -> saving.chosen's values
_extended: dict[tuple, KernelSpec] = {}  # (spec key, extra output ids) -> the forward group with those outputs


def _cpu_save(spec: KernelSpec, needs: tuple, sig: tuple, chunks: tuple) -> tuple:
    """The values a CPU backward of every output's gradient reads saved (``fuser/saving.py``); () where none."""
    key = (spec.key, needs, sig, chunks)
    got = _saves.get(key)
    if got is None:
        bw = backward_for(spec, needs, spec.all_outputs_defined, sig, False, chunks)
        got = () if bw is None or bw.spec is None else saving.chosen(spec, bw.recomputed, _value_dtypes(spec, sig))
        _bounded(_saves)[key] = got
    return got


def extended_spec(spec: KernelSpec, extras: tuple, reduced: frozenset = frozenset()) -> KernelSpec:
    """``spec``'s group with the values ``extras`` as more outputs, after its own: the forward that writes what its
    backward reads saved (``backward.forward_group``)."""
    key = (spec.key, extras, reduced)
    got = _extended.get(key)
    if got is None:
        got = _bounded(_extended)[key] = STORE.get(STORE.register(forward_group(spec, extras, reduced)))
    return got


class _Call:
    """What the autograd Function needs besides the tensors: the group and where its arguments go."""

    __slots__ = ("spec", "scalars", "needs", "sig", "saved", "carried", "rng_state", "outputs", "columns",
                 "saved_outputs", "chunks", "sources", "save", "forward")

    def __init__(self, spec, scalars, needs, sig, saved, carried, rng_state=None, outputs=None, columns=False,
                 saved_outputs=(), chunks=()):
        self.spec, self.scalars, self.needs, self.sig, self.saved = spec, scalars, needs, sig, saved
        self.carried = carried  # per output: whether a wanted gradient reaches it
        self.rng_state = rng_state  # a random group's launch state: the backward redraws the same numbers
        self.outputs = outputs  # a random group's forward outputs, computed before (its kernel had to run)
        self.columns = columns  # the forward ran as a column kernel (its backward is formed for that)
        self.saved_outputs = saved_outputs  # forward outputs the backward reads (Backward.saved_outputs)
        # per tensor whose gradient the backward writes whole: (dim, group inputs that are its chunks); _chunked_inputs
        self.chunks = chunks
        self.sources = None  # those tensors, until the Function is applied; then their chunks, until its forward runs
        # forward values the backward reads saved (fuser/saving.py; saved_outputs indexes the outputs, then the extra
        # outputs of those that are none), and the group the forward runs: spec, or spec with those extra outputs
        self.save, self.forward = (), spec

    def args(self, tensors: Sequence) -> list:
        if self.spec.all_tensors:
            return list(tensors)
        ts, fs = iter(tensors), iter(self.scalars)
        return [next(ts) if is_t else next(fs) for is_t in self.spec.input_is_tensor]


class _FusedGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        if call.chunks:  # the kernel reads the chunks as they came (the executor's signature counts requires_grad)
            ins = list(tensors[:-len(call.chunks)])
            for c, pieces in zip(call.chunks, call.sources):
                for k, t in zip(chunk_positions(call.spec, c), pieces):
                    ins[k] = t
            call.sources = None
            args = call.args(ins)
        else:
            args = call.args(tensors)
        out = call.outputs
        if out is None:
            out = executor.run(call.forward, args)  # grad mode is off in here: the forward kernel
        if out is None:
            out = fallback.run(call.forward, args)
        call.outputs = None  # the Function holds them now
        ctx.call = call
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        ctx.n_tensors = len(tensors)
        ctx.save_for_backward(*[t if keep else None for t, keep in zip(tensors, call.saved)],
                              *[out[k] for k in call.saved_outputs])
        out = out[:len(call.spec.group.outputs)]  # (the extra outputs are the backward's alone)
        # outputs no wanted gradient reaches do not require grad, as in eager
        ctx.mark_non_differentiable(*[o for o, d in zip(out, differentiable_outputs(call, out)) if not d])
        ctx.set_materialize_grads(False)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        n, call = ctx.n_tensors, ctx.call
        outputs = dict(zip(call.saved_outputs, saved[n:]))
        if not call.chunks:
            return (None, *input_grads(call, saved[:n], ctx.meta, grads, outputs))
        # the chunks went in detached: read again from the saved tensors they are chunks of (double backward
        # then differentiates through them to those); their gradients go to those whole, the last inputs
        m = len(call.chunks)
        ins = list(saved[:n - m])
        for c, source in zip(call.chunks, saved[n - m:n]):
            if source is not None:
                for k, t in zip(chunk_positions(call.spec, c), source.chunk(len(c[1]), c[0])):
                    ins[k] = t
        return (None, *input_grads(call, ins, ctx.meta[:n - m], grads, outputs))


def tensor_index(spec: KernelSpec) -> dict:
    """Group input index -> index among the tensor inputs."""
    t_index, k = {}, 0
    for j, is_t in enumerate(spec.input_is_tensor):
        if is_t:
            t_index[j] = k
            k += 1
    return t_index


def input_grads(call: _Call, saved: Sequence, meta: Sequence, grads: Sequence, outputs: Optional[dict] = None) -> list:
    """The gradients of the tensor inputs (None where none is wanted) from the outputs' gradients (None where
    none arrived): the backward group of this pattern run as a group. ``saved``: per tensor input, the saved
    tensor or None; ``meta``: per tensor input, (shape, dtype, device); ``outputs``: output index -> the saved
    forward output (those in ``call.saved_outputs``)."""
    spec = call.spec
    defined = tuple(gr is not None for gr in grads)
    result: list = [None] * len(saved)
    if not any(defined):
        return result + [None] * len(call.chunks)
    # double backward (create_graph) recomputes: the extra outputs have no autograd history to differentiate through
    save = call.save if not torch.is_grad_enabled() else ()
    bw = backward_for(spec, call.needs, defined, call.sig, call.columns, call.chunks, save)
    t_index = tensor_index(spec)
    fwd_args = call.args(saved)
    wholes: dict = {}  # first chunk's input -> its tensor's gradient, whole
    firsts = {pieces[0] for pieces in bw.cat_of}
    if bw.spec is not None:
        shapes = [m[0] for m in meta]
        args = backward_args(spec, bw, fwd_args, grads, shapes, outputs or {})
        got = None
        if not torch.is_grad_enabled() and not bw.cat_of:  # inputs broadcast over leading dims: summed by column
            got = grad_sums.run(spec, bw, args, shapes, _full_shape(spec, tuple(shapes)), call.sig)  # groups
        if got is None:
            outs = run(bw.spec, args, call.rng_state)
            got = [*zip(bw.grad_inputs, outs), *((j, outs[k]) for j, k in bw.aliases)]
        for j, r in got:
            shape, dtype, _ = meta[t_index[j]]
            if j in firsts:  # a chunked tensor's gradient, whole
                wholes[j] = r if r.dtype == dtype else r.to(dtype)
                continue
            if r.shape != shape:  # a column group's sum (keepdim) is a view of the shape; the old path sums here
                r = r.reshape(shape) if r.numel() == math.prod(shape) and _same_dims(r.shape, shape) else \
                    r.sum_to_size(shape)
            result[t_index[j]] = r if r.dtype == dtype else r.to(dtype)
    for j in bw.zero_inputs:
        shape, dtype, device = meta[t_index[j]]
        result[t_index[j]] = torch.zeros(shape, dtype=dtype, device=device)
    if not call.chunks:
        return result
    # the chunks' gradients apart (a pattern without the cat): joined as eager's chunk backward joins them
    whole = [wholes[c[1][0]] if c[1][0] in wholes else _joined(spec, c, result, meta) for c in call.chunks]
    for c in call.chunks:
        for k in chunk_positions(spec, c):
            result[k] = None
    return result + whole


def _joined(spec: KernelSpec, chunk: tuple, result: list, meta: Sequence) -> Optional[torch.Tensor]:
    """A chunked tensor's gradient from its chunks' (zeros for a chunk without one; None where none has one), as
    eager's backward of split forms it."""
    pos = chunk_positions(spec, chunk)
    if all(result[k] is None for k in pos):
        return None
    parts = [result[k] if result[k] is not None else torch.zeros(meta[k][0], dtype=meta[k][1], device=meta[k][2])
             for k in pos]
    return torch.cat(parts, chunk[0])


def chunk_positions(spec: KernelSpec, chunk: tuple) -> tuple[int, ...]:
    """The tensor-input indices of ``chunk``'s group inputs (one entry of ``_Call.chunks``), in chunk order."""
    t_index = tensor_index(spec)
    return tuple(t_index[j] for j in chunk[1])


_SPLITS = ("SplitBackward0", "SplitWithSizesBackward0")


def _chunked_inputs(spec: KernelSpec, args: Sequence, full: torch.Size) -> list:
    """Per tensor whose every chunk, of equal size and the group's full shape, is a tensor input of the group (an
    LSTM's ``gates.chunk(4, 1)``): (dim, group input indices in chunk order, the tensor). Eager's ``chunk``
    (or ``fuser::broadcasting_chunk``) made them views whose backward concatenates their gradients, which the
    group's backward can instead write as one tensor. The chunked tensor is the views' base and autograd's edge
    of their split is that tensor's own (so a view of a view, whose gradient eager forms through more nodes, does
    not match). Only pointwise groups (a reduction's or random group's backward keeps its pieces apart)."""
    found: list = []
    if spec.has_reduction or spec.random:
        return found
    by_node: dict = {}
    for j, a in enumerate(args):
        fn = a.grad_fn if isinstance(a, torch.Tensor) else None
        if fn is not None and type(fn).__name__ in _SPLITS:
            by_node.setdefault(fn, []).append(j)
    for fn, js in by_node.items():
        if len(js) < 2:
            continue
        src = args[js[0]]._base
        if src is None or not all(args[j]._base is src for j in js):
            continue
        edge = fn.next_functions[0]
        if src.grad_fn is not None:
            if edge[0] is not src.grad_fn or edge[1] != src.output_nr:
                continue
        elif not (src.requires_grad and getattr(edge[0], "variable", None) is src):
            continue
        dim = fn._saved_dim % max(src.dim(), 1)
        order = sorted(js, key=lambda j: args[j].output_nr)
        if [args[j].output_nr for j in order] != list(range(len(js))) or tuple(fn._saved_self_sym_sizes) != \
                tuple(src.shape) or any(args[j].shape != full for j in js) or full[dim] * len(js) != src.shape[dim]:
            continue
        found.append((dim, tuple(order), src))
    return found


def backward_args(spec: KernelSpec, bw: Backward, fwd_args: Sequence, grads: Sequence,
                  shapes: Sequence[torch.Size], outputs: Optional[dict] = None) -> list:
    """The arguments of ``bw``'s group: the forward arguments it reads, the forward outputs it reads (``outputs``:
    output index -> saved tensor), then the output gradients it reads (and the row length, for a group with
    reductions whose backward reads it). ``shapes``: the forward's tensor inputs' shapes."""
    args = [fwd_args[j] for j in bw.fwd_inputs]
    for k in bw.saved_outputs:
        if outputs is None or outputs.get(k) is None:  # the forward saves what the every-gradient pattern reads
            raise RuntimeError(f"fuser: the backward reads forward output {k}, which the forward did not save. "
                               "Please report this.")
        args.append(outputs[k])
    if not bw.grad_unsqueeze:
        args += [_grad_arg(spec, grads, k, j) for k, j in bw.grad_outputs]
    else:
        for (k, j), u in zip(bw.grad_outputs, bw.grad_unsqueeze):
            g = _grad_arg(spec, grads, k, j)
            args.append(g[(...,) + (None,) * u] if u and g.dim() else g)  # reduced dims restored, as a view
    if bw.row_length:
        args.append(float(_row_length(spec, tuple(shapes))))
    return args


def _full_shape(spec: KernelSpec, shapes: tuple) -> torch.Size:
    """The broadcast shape of the forward's tensor inputs and tensor constants: the shape its gradients have."""
    consts = [tuple(a.shape) for n in spec.group.nodes for a in n.args if isinstance(a, ir.TensorConst)]
    return broadcast_shapes(*shapes, *consts)


def _same_dims(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether ``a`` and ``b`` are one shape but for dims of size 1."""
    return [s for s in a if s != 1] == [s for s in b if s != 1]


def _row_length(spec: KernelSpec, shapes: tuple) -> int:
    """The number of elements each row of a row kernel reduces: the reduced dims of the full shape, which is the
    inputs' broadcast shape where the forward ran as a row kernel (every input broadcasts to it, and the reduced
    value's shape is the broadcast of what it reads)."""
    full = _full_shape(spec, shapes)
    dims = next(ops.reduced_dims(n.op, n.args) for n in spec.group.nodes if ops.reduction(n.op) is not None)
    if not dims:
        return math.prod(full)
    return math.prod(full[d] for d in {d % len(full) for d in dims}) if full else 1


def _grad_arg(spec: KernelSpec, grads: tuple, k: int, piece: Optional[int]) -> torch.Tensor:
    """Output k's gradient, or the slice of it that piece ``piece`` of the cat making output k filled."""
    g = grads[k]
    if piece is None:
        return g
    dim, piece_deps = spec.concats[k]
    d = dim % g.dim()
    size = g.shape[d] // len(piece_deps)
    return g.narrow(d, piece * size, size)


# torch.broadcast_shapes runs tens of us of Python checks, on every call of a group under grad (and of an LSTM's
# chunk, integration.py): the shapes repeat
broadcast_shapes = functools.lru_cache(maxsize=MAX_CACHED)(torch.broadcast_shapes)


def differentiable(spec: KernelSpec, args: list, rng_state: Optional[list] = None) -> Optional[list[torch.Tensor]]:
    """The group as one autograd Function, or None (the caller runs the interpreter) when grad mode is off,
    no input requires grad, a transform or forward AD is active, or the gradient cannot be formed.

    A random group (dropout) runs its forward kernel first, with ``rng_state`` or a fresh launch state that
    its backward kernel then reuses: Philox numbers depend only on (seed, offset, op, element), so the
    backward recomputes exactly the forward's mask. If the forward kernel cannot run, the interpreter does
    (eager's autograd then records eager's own draw). A group with reductions runs its forward kernel first too:
    its backward is formed for the shapes the row kernel takes (see ``fuser/backward.py``)."""
    call = prepare_call(spec, args, rng_state)
    if call is None:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if call.chunks:  # the chunks go in detached (no edge to their split), their tensors last (gradients, whole)
        tensors += call.sources
        call.sources = [[tensors[k] for k in chunk_positions(spec, c)] for c in call.chunks]  # the forward reads
        for c in call.chunks:
            for k in chunk_positions(spec, c):
                tensors[k] = tensors[k].detach()
    return list(_FusedGroup.apply(call, *tensors))


def _differentiable_views(spec: KernelSpec, args: list) -> Optional[list[torch.Tensor]]:
    """A group with permutes under autograd (``fuser/views.py``): its permute-free group, differentiated as any
    group, on its inputs' views, which autograd carries the gradients back through. Only where that group gives
    eager's output layouts for these views (it does but where eager's layout rule breaks a tie by dim order, which
    the permutes change); else None (the interpreter runs the ops)."""
    if len(args) != len(spec.input_is_tensor) or any(
            is_t != isinstance(a, torch.Tensor) for a, is_t in zip(args, spec.input_is_tensor)):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        sig = executor.signature(tensors)
    except (AttributeError, RuntimeError, TypeError):
        return None
    flat = spec.registered_flat()
    viewed = views.apply(spec.group, spec.views, tensors)
    if isinstance(viewed, str):
        return None
    it = iter(viewed)
    flat_args = [next(it) if is_t else a for a, is_t in zip(args, spec.input_is_tensor)]
    same = spec.view_layouts.get(sig)
    if same is None:
        want = layout.group_layouts(spec.group, args)
        same = not isinstance(want, str) and want == layout.group_layouts(flat.group, flat_args)
        _bounded(spec.view_layouts)[sig] = same
    return differentiable(flat, flat_args) if same else None


def prepare_call(spec: KernelSpec, args: list, rng_state: Optional[list] = None) -> Optional[_Call]:
    """What :func:`differentiable` runs as an autograd Function (a random group's or a row group's forward outputs
    computed), or None where it cannot."""
    if not torch.is_grad_enabled() or spec.views is not None:  # (a group with permutes: _differentiable_views)
        return None
    if _forward_ad._current_level >= 0 or _functorch_stack() is not None:
        return None
    tensors, scalars = [], []
    for a, is_t in zip(args, spec.input_is_tensor):
        (tensors if is_t else scalars).append(a)
    if len(args) != len(spec.input_is_tensor) or not tensors:
        return None
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not any(t.requires_grad for t in tensors):
        return None
    if not all(isinstance(s, (float, int)) and not isinstance(s, bool) for s in scalars):
        return None
    if any(t.is_complex() for t in tensors):
        return None  # the kernels have no complex types; eager's autograd keeps the gradients
    shapes = [t.shape for t in tensors]
    try:
        full = broadcast_shapes(*shapes)
    except RuntimeError:
        return None
    if any(broadcast_shapes(*(shapes[k] for k in deps)) != full for deps in spec.output_deps):
        return None  # gradient contributions of different shapes cannot be added in one pointwise kernel
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return None  # gradients would need moving between devices: eager's autograd does that
    needs = tuple(bool(a.requires_grad) if is_t else False for a, is_t in zip(args, spec.input_is_tensor))
    sig = tuple((t.dtype, t.dim() == 0) for t in tensors)
    bw = backward_for(spec, needs, spec.all_outputs_defined, sig)
    if bw is None:
        return None
    used = set(bw.fwd_inputs)
    saved = []
    for j, is_t in enumerate(spec.input_is_tensor):
        if is_t:
            saved.append(j in used)
    call = _Call(spec, tuple(float(s) for s in scalars), needs, sig, tuple(saved), _carried_outputs(spec, needs, sig),
                 saved_outputs=bw.saved_outputs)
    chunked = _chunked_inputs(spec, args, full)
    if chunked:
        chunks = tuple(c[:2] for c in chunked)
        whole = backward_for(spec, needs, spec.all_outputs_defined, sig, False, chunks)
        if whole is not None and len(whole.cat_of) < len(chunks):  # those it writes whole
            chunked = [c for c in chunked if c[1] in whole.cat_of]
            chunks = tuple(c[:2] for c in chunked)
            whole = backward_for(spec, needs, spec.all_outputs_defined, sig, False, chunks) if chunks else None
        if whole is not None and len(whole.cat_of) == len(chunks):
            pos = [set(chunk_positions(spec, c)) for c in chunks]
            # the chunks are not saved: their tensors are, where the backward reads one (the Function's last inputs)
            call.saved = (*(False if any(k in p for p in pos) else keep for k, keep in enumerate(saved)),
                          *(any(saved[k] for k in p) for p in pos))
            call.chunks, call.sources = chunks, [c[2] for c in chunked]
    if device.type == "cpu" and settings.cpu_save:
        _read_saved(call, shapes, full)
    if spec.random or spec.has_reduction:  # (a row kernel's backward is planned for the shapes its forward takes)
        if spec.random:
            if rng_state is None and not rng.can_draw(device):
                return None
            call.rng_state = rng.launch_state(device) if rng_state is None else rng_state
        plain = call.saved_outputs
        if spec.has_reduction and settings.save_statistics:
            _save_statistics(call)
        with torch.no_grad():
            call.outputs = executor.run(call.forward, args, call.rng_state)
            if call.outputs is None and call.forward is not spec:  # (its kernel did not run: the plain forward's?)
                call.save, call.forward, call.saved_outputs = (), spec, plain
                call.outputs = executor.run(spec, args, call.rng_state)
        if call.outputs is None:
            return None
        columns = _ran_as_columns(call.forward, tensors) if spec.has_reduction else False
        if columns is None:
            return None
        if columns:
            bw = backward_for(spec, needs, spec.all_outputs_defined, sig, True)
            if bw is None:
                return None
            call.columns, call.save = True, ()  # (call.outputs keeps the extra outputs of call.forward: unread)
            call.saved = tuple(j in bw.fwd_inputs for j, is_t in enumerate(spec.input_is_tensor) if is_t)
            call.saved_outputs = bw.saved_outputs
    return call


def _save_statistics(call: _Call) -> None:
    """For a group with normalizations: the call made to run the forward writing their statistics as extra outputs
    (layer_norm's mean and rstd, rms_norm's rstd: ``backward.statistics``), and its backward to read them, as
    eager's do, where that backward can be formed."""
    spec = call.spec
    save = statistics(spec)
    if not save:
        return
    bw = backward_for(spec, call.needs, spec.all_outputs_defined, call.sig, False, call.chunks, save)
    if bw is None or bw.spec is None or len(bw.cat_of) != len(call.chunks):
        return
    dtypes = _value_dtypes(spec, call.sig)
    reduced = frozenset(n.out.id for n in spec.group.nodes
                        if ops.reduction(n.op) is not None and dtypes.get(n.out.id) in (torch.float16, torch.bfloat16))
    call.save, call.forward = save, extended_spec(spec, save, reduced)
    call.saved_outputs = tuple(sorted({*call.saved_outputs, *bw.saved_outputs}))


def _read_saved(call: _Call, shapes: list, full: torch.Size) -> None:
    """On the CPU, where the cost model picks values for the backward to read saved (``fuser/saving.py``): the call
    made to run the forward with them as extra outputs and to save them. A value whose inputs broadcast to less
    than ``full`` stays recomputed (the kernel writes outputs of the full shape). The inputs the recomputing
    backward reads stay saved too (a superset of what this one reads): double backward recomputes."""
    spec = call.spec
    save = _cpu_save(spec, call.needs, call.sig, call.chunks)
    if not save:
        return
    n = len(spec.group.outputs)
    extras = extra_outputs(spec, save)
    forward = extended_spec(spec, extras) if extras else spec
    narrow = {vid for vid, deps in zip(extras, forward.output_deps[n:])
              if broadcast_shapes(*(shapes[k] for k in deps)) != full}
    if narrow:
        save = tuple(vid for vid in save if vid not in narrow)
        extras = extra_outputs(spec, save)
        forward = extended_spec(spec, extras) if extras else spec
        if not save:
            return
    bw = backward_for(spec, call.needs, spec.all_outputs_defined, call.sig, False, call.chunks, save)
    if bw is None or bw.spec is None or len(bw.cat_of) != len(call.chunks):
        return
    call.save, call.forward = save, forward
    call.saved_outputs = tuple(sorted({*call.saved_outputs, *bw.saved_outputs}))


def _ran_as_columns(spec: KernelSpec, tensors: list) -> Optional[bool]:
    """Whether the kernel that just ran on ``tensors`` was a column kernel (its geometry, cached by signature; None
    where it is gone: the cache started over)."""
    from .rows.outer_launch import OuterGeometry
    geo = spec.geometries.get(executor.signature(tensors))
    return None if geo is None else isinstance(geo, OuterGeometry)


def differentiable_outputs(call: _Call, outputs: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """Per output, whether a gradient reaches it (the others are marked non-differentiable, as in eager)."""
    return tuple(bool(c and o.is_floating_point()) for o, c in zip(outputs, call.carried))
