"""Fusion groups under autograd: a differentiable group op whose backward is a generated fusion group too.

When grad mode is on and an input requires grad, :func:`run` wraps the group in an autograd Function. Its
forward runs the forward kernel (grad mode is off inside it) and saves the inputs the backward reads. Its
backward is a graph built from the derivative table (``fuser/derivatives.py``): the forward ops recomputed
from the saved inputs (cheaper than saving intermediates: the backward kernel reads the inputs once, eager's
backward reads each saved intermediate) followed by the gradient formulas, each input's gradient cast to
its dtype. That graph is registered in the kernel store like any group, so it gets a fused kernel (or the
interpreter, when it cannot be fused), and, when the backward itself runs under grad mode
(``create_graph=True``), it is differentiated the same way: double backward either runs fused or through
the interpreter. Gradients of broadcast inputs are summed to the input's shape after the kernel.

A group whose gradient cannot be formed here (an op without a formula, a formula that needs an argument
that is not a constant) is not wrapped: the interpreter runs it op by op and eager's autograd records it.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad

from . import derivatives as D
from . import codegen, compiler, executor, fallback, ops, rng
from .descs import DENSE, ArgSpec, TensorDesc
from .kernel_cache import STORE, KernelSpec, concat_pieces

_TENSOR = torch._C.TensorType.get()
_STRUCTURAL = ("prim::Constant", "prim::ListConstruct", "aten::cat")
_functorch_stack = torch._C._functorch.peek_interpreter_stack


def run(spec: KernelSpec, args: list, rng_state: Optional[list] = None) -> list[torch.Tensor]:
    """The group's outputs: the fused kernel, the differentiable fused group, or the interpreter.

    ``rng_state``: a random group's backward replays its forward's numbers with the forward's state (kernels
    only: the interpreter's rand_like would draw others, so there a replay raises).
    """
    # an input that requires grad under grad mode: the kernel alone would not do (the executor says None)
    grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    out = None if grad else executor.run(spec, args, rng_state)
    if out is None:
        out = differentiable(spec, args, rng_state)
    if out is None and rng_state is not None:
        raise RuntimeError("fuser: the backward of a fusion group with rand_like (dropout) could not run as a "
                           "kernel, and the interpreter cannot redraw the forward's numbers. Please report this; "
                           "fuser.override_can_fuse_on_cpu/gpu(False) before the forward avoids it.")
    return out if out is not None else fallback.run(spec, args)


@dataclass(frozen=True)
class Backward:
    """The backward of one (group, which inputs need gradients, which output gradients are defined).

    Its graph's inputs are the forward inputs listed in ``fwd_inputs`` then the output gradients listed in
    ``grad_outputs`` (``(k, None)``: output k's gradient; ``(k, j)``: the slice of it for piece j of the cat
    that made output k); its outputs are the gradients of the forward inputs in ``grad_inputs``. Inputs in
    ``zero_inputs`` need a gradient that is zero everywhere (``floor``).
    """

    spec: Optional[KernelSpec]
    fwd_inputs: tuple[int, ...]
    grad_outputs: tuple[tuple, ...]
    grad_inputs: tuple[int, ...]
    zero_inputs: tuple[int, ...]


class _Unsupported(Exception):
    pass


def build_backward(spec: KernelSpec, needs: Sequence[bool], defined: Sequence[bool],
                   floating: frozenset) -> Backward:
    """The backward graph of ``spec.graph``; raises :class:`_Unsupported` when the table cannot form it.

    needs: per graph input, whether its gradient is wanted. defined: per graph output, whether a gradient
    arrives for it. floating: ``unique()`` ids of the graph values whose dtype is floating for these inputs
    (gradients flow through those only, as in eager, where integer and bool results never require grad).
    """
    if spec.concat_consumed:
        raise _Unsupported("a cat's result used inside the group")
    fwd = spec.graph
    g = torch._C.Graph()
    env: dict[int, torch._C.Value] = {}
    for v in fwd.inputs():
        nv = g.addInput()
        nv.setType(v.type())
        env[v.unique()] = nv
    grad_in = []  # ((k, piece or None), forward value the gradient is for, graph input)
    for k, o in enumerate(fwd.outputs()):
        if not defined[k]:
            continue
        pieces = concat_pieces(fwd, o)
        for j, p in enumerate(pieces) if pieces is not None else [(None, o)]:
            gv = g.addInput()
            gv.setType(_TENSOR)
            grad_in.append(((k, j), p, gv))
    nodes = list(fwd.nodes())
    for n in nodes:
        c = g.createClone(n, lambda v: env[v.unique()])
        g.insertNode(c)
        for o, co in zip(n.outputs(), c.outputs()):
            env[o.unique()] = co

    carries = _carries(fwd, needs, floating)
    if carries is None:
        raise _Unsupported("an op outside the table")
    fwd_inputs_ids = {v.unique() for v in fwd.inputs()}

    grads: dict[int, D.V] = {}
    zeros: set[int] = set()  # values some op gives a zero gradient (eager then gives zeros, not None)

    def accumulate(u: int, r: D.V) -> None:
        grads[u] = r if u not in grads else grads[u] + r

    for k, o, gv in grad_in:
        if o.unique() in carries:
            accumulate(o.unique(), D.V(g, gv))
    for n in reversed(nodes):
        if n.kind() == "prim::Constant" or n.output().unique() not in grads:
            continue
        op = ops.lookup(n.schema())
        f = D.formula(op.name)
        if f is None:
            raise _Unsupported(op.name)
        gy = grads[n.output().unique()]
        res = f(gy, [D.V(g, env[i.unique()]) for i in n.inputs()], D.V(g, env[n.output().unique()]))
        for inp, r in zip(n.inputs(), res):
            if inp.unique() not in carries:
                continue
            if r is D.UNSUPPORTED:
                raise _Unsupported(f"{op.name}: gradient of input {inp.debugName()}")
            is_input = inp.unique() in fwd_inputs_ids
            if r is D.ZERO and (is_input or spec.key in _backward_keys):
                zeros.add(inp.unique())
            elif r is D.ZERO:  # eager passes a tensor of zeros on: 0 * inf upstream is NaN there too
                accumulate(inp.unique(), D.op("aten::mul", D.op("aten::pow", gy, 0.0), 0.0))
            elif r is not None and not is_input:  # the engine casts a gradient to its value's dtype
                accumulate(inp.unique(), D.op("aten::type_as", r, D.V(g, env[inp.unique()])))
            elif r is not None:  # None: the op does not differentiate this input (type_as's other)
                accumulate(inp.unique(), r)

    grad_inputs, zero_inputs = [], []
    for i, v in enumerate(fwd.inputs()):
        if not needs[i]:
            continue
        r = grads.get(v.unique())
        if r is None:
            if v.unique() in zeros:
                zero_inputs.append(i)
            continue
        # a copy in the gradient's own dtype: eager sums a broadcast input's gradient before the cast
        out = D.op("aten::type_as", r, r)
        g.registerOutput(out.value)
        grad_inputs.append(i)
    if not grad_inputs:
        return Backward(None, (), (), (), tuple(zero_inputs))
    torch._C._jit_pass_dce(g)
    if _n_random(g) not in (0, _n_random(fwd)):
        # the backward redraws the forward's numbers with its state: op r's numbers depend on its ordinal r,
        # which must survive dead-code elimination (a random op nothing differentiable reads would not)
        raise _Unsupported("a random op the gradient does not read")
    # keep only the inputs the gradients read (those are what the forward saves)
    n_fwd = len(list(fwd.inputs()))
    inputs = list(g.inputs())
    keep = [j for j, v in enumerate(inputs) if v.uses()]
    for j in reversed(range(len(inputs))):
        if j not in keep:
            g.eraseInput(j)
    g.lint()
    bspec = STORE.get(STORE.register(g))
    _backward_keys.add(bspec.key)
    fwd_inputs = tuple(j for j in keep if j < n_fwd)
    grad_outputs = tuple(grad_in[j - n_fwd][0] for j in keep if j >= n_fwd)
    return Backward(bspec, fwd_inputs, grad_outputs, tuple(grad_inputs), tuple(zero_inputs))


def _n_random(graph: torch._C.Graph) -> int:
    return sum(1 for n in graph.nodes() if n.kind() == "aten::rand_like")


# (spec key, needs, defined, dtype signature) -> Backward, or None where the table cannot form it
_backwards: dict[tuple, Optional[Backward]] = {}
_floating: dict[tuple, frozenset] = {}
_lock = threading.Lock()
_backward_keys: set[int] = set()  # specs that are backward graphs (their own zeros stay implicit)


def _carries(fwd: torch._C.Graph, needs: Sequence[bool], floating: frozenset) -> Optional[set]:
    """ids of the values through which a wanted gradient flows (None: an op outside the table)."""
    carries = {v.unique() for v, need in zip(fwd.inputs(), needs) if need}
    for n in fwd.nodes():
        if n.kind() in ("prim::Constant", "prim::ListConstruct"):
            continue
        if n.kind() == "aten::cat":  # its gradient goes straight to its pieces, as slices of the output's
            if any(p.unique() in carries for p in n.inputsAt(0).node().inputs()):
                carries.add(n.output().unique())
            continue
        if not any(i.unique() in carries for i in n.inputs()):
            continue
        op = ops.lookup(n.schema())
        if op is None:
            return None
        if op.name not in D.NOT_DIFFERENTIABLE:
            carries.update(o.unique() for o in n.outputs() if o.unique() in floating)
    return carries


MAX_CACHED = 4096  # per cache below: past it, the cache starts over (bounded, not a leak)


def _bounded(cache: dict) -> dict:
    if len(cache) >= MAX_CACHED:
        cache.clear()
    return cache


def _floating_values(spec: KernelSpec, sig: tuple) -> frozenset:
    """ids of the graph values whose dtype is floating, for tensor inputs of dtypes ``sig`` (the dtypes come
    from the same eager probe the compiler uses; it raises what eager raises for these dtypes)."""
    key = (spec.key, sig)
    got = _floating.get(key)
    if got is not None:
        return got
    arg_spec = ArgSpec("cpu", None, tuple(TensorDesc(dt, DENSE, zero_dim) for dt, zero_dim in sig))
    types = compiler.infer_types(spec, arg_spec)
    got = frozenset(n.output().unique() for n, t in zip(codegen.typed_nodes(spec.graph), types)
                    if t.result.is_floating_point)
    dtypes = iter(sig)
    got |= frozenset(v.unique() for v, is_t in zip(spec.graph.inputs(), spec.input_is_tensor)
                     if is_t and next(dtypes)[0].is_floating_point)
    _bounded(_floating)[key] = got
    return got


def backward_for(spec: KernelSpec, needs: tuple, defined: tuple, sig: tuple) -> Optional[Backward]:
    key = (spec.key, needs, defined, sig)
    if key in _backwards:
        return _backwards[key]
    try:
        bw = build_backward(spec, needs, defined, _floating_values(spec, sig))
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
        carries = _carries(spec.graph, needs, _floating_values(spec, sig)) or set()
        got = _bounded(_carried)[key] = tuple(o.unique() in carries for o in spec.graph.outputs())
    return got


_carried: dict[tuple, tuple] = {}


class _Call:
    """What the autograd Function needs besides the tensors: the group and where its arguments go."""

    __slots__ = ("spec", "scalars", "needs", "sig", "saved", "carried", "rng_state", "outputs")

    def __init__(self, spec, scalars, needs, sig, saved, carried, rng_state=None, outputs=None):
        self.spec, self.scalars, self.needs, self.sig, self.saved = spec, scalars, needs, sig, saved
        self.carried = carried  # per output: whether a wanted gradient reaches it
        self.rng_state = rng_state  # a random group's launch state: the backward redraws the same numbers
        self.outputs = outputs  # a random group's forward outputs, computed before (its kernel had to run)

    def args(self, tensors: Sequence) -> list:
        if self.spec.all_tensors:
            return list(tensors)
        ts, fs = iter(tensors), iter(self.scalars)
        return [next(ts) if is_t else next(fs) for is_t in self.spec.input_is_tensor]


class _FusedGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        args = call.args(tensors)
        out = call.outputs
        if out is None:
            out = executor.run(call.spec, args)  # grad mode is off in here: the forward kernel
        if out is None:
            out = fallback.run(call.spec, args)
        call.outputs = None  # the Function holds them now
        ctx.call = call
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        ctx.save_for_backward(*[t if keep else None for t, keep in zip(tensors, call.saved)])
        # outputs no wanted gradient reaches do not require grad, as in eager
        ctx.mark_non_differentiable(*[o for o, c in zip(out, call.carried) if not (c and o.is_floating_point())])
        ctx.set_materialize_grads(False)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        spec = call.spec
        saved = ctx.saved_tensors
        n_t = len(saved)
        defined = tuple(gr is not None for gr in grads)
        result: list = [None] * n_t
        if not any(defined):
            return (None, *result)
        bw = backward_for(spec, call.needs, defined, call.sig)
        # graph input index -> tensor index
        t_index, k = {}, 0
        for j, is_t in enumerate(spec.input_is_tensor):
            if is_t:
                t_index[j] = k
                k += 1
        fwd_args = call.args(saved)
        if bw.spec is not None:
            args = [fwd_args[j] for j in bw.fwd_inputs] + [_grad_arg(spec, grads, k, j) for k, j in bw.grad_outputs]
            outs = run(bw.spec, args, call.rng_state)
            for j, r in zip(bw.grad_inputs, outs):
                shape, dtype, _ = ctx.meta[t_index[j]]
                r = r if r.shape == shape else r.sum_to_size(shape)
                result[t_index[j]] = r if r.dtype == dtype else r.to(dtype)
        for j in bw.zero_inputs:
            shape, dtype, device = ctx.meta[t_index[j]]
            result[t_index[j]] = torch.zeros(shape, dtype=dtype, device=device)
        return (None, *result)


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
    (eager's autograd then records eager's own draw)."""
    if not torch.is_grad_enabled():
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
    call = _Call(spec, tuple(float(s) for s in scalars), needs, sig, tuple(saved), _carried_outputs(spec, needs, sig))
    if spec.random:
        call.rng_state = rng.launch_state(device) if rng_state is None else rng_state
        with torch.no_grad():
            call.outputs = executor.run(spec, args, call.rng_state)
        if call.outputs is None:
            return None
    return list(_FusedGroup.apply(call, *tensors))
