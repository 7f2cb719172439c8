"""A group's backward, built from the derivative table (``fuser/derivatives.py``) as a group of its own.

Its inputs are the forward inputs the gradients read, then the forward outputs it reads (below), then the output
gradients; it recomputes the forward's ops from those inputs (cheaper than saving intermediates: the backward
kernel reads the inputs once, eager's backward reads each saved intermediate), then applies each op's gradient
formula, and casts each input's gradient to its dtype. ``fuser/autodiff.py`` runs it.

The one value it does not recompute is a softmax or log_softmax that is itself a group output: the forward writes
it anyway, so the backward reads it as eager's does (``(g - sum(g * y)) * y``, ``g - exp(y) * sum(g)``), where a
recompute would read the input and form its max and sum again (two more passes over the row, and every prologue
input read once more). ``Backward.saved_outputs`` names those outputs; the forward saves them for backward.
On the CPU, where a transcendental function costs more than the bytes that would save it, the backward also reads
the values ``build_backward``'s ``save`` names (``fuser/saving.py`` picks them among ``Backward.recomputed``): from
the group's outputs, or from extra outputs the forward writes for them (:func:`extra_outputs`).

A group with reductions (a row kernel's, ``fuser/rows/``) gets a backward that is one too. There every reduction
keeps its dims (the forward's are recomputed with keepdim; a dropped-dims output's gradient comes with its dims
restored: ``Backward.grad_unsqueeze``), so every row-level value is [rows..., 1...] and broadcasts along the row.
Where an element-level node reads a row-level value, that value's gradient is summed along the row in the group
(eager's sum_to_size of a broadcast, here a reduction of the same row), before it flows on. A normalization
(softmax, log_softmax, layer_norm, rms_norm) is recomputed as its steps (``fuser/rows/decompose.py``), and its
formula reads the statistics those steps form (layer_norm's mean and rstd) as eager's backward reads the ones its
forward saved.

A column kernel's group (reductions over leading dims, ``fuser/rows/outer.py``) gets the same treatment with its
column-level values in the row-level values' place (``_Rows``): its reductions keep their dims, a gradient arriving
without them broadcasts as it comes, and casts to a column-level value's dtype read an element-level value of that
dtype instead (``_dtype_proxy``), so that the sum's gradient broadcast back down the column stays element-level.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from . import derivatives as D
from . import ir, ops, products
from .kernel_cache import STORE, KernelSpec
from .rows import decompose
from .rows.outer import column_level
from .rows.passes import row_level

@dataclass(frozen=True)
class Backward:
    """The backward of one (group, which inputs need gradients, which output gradients are defined).

    Its group's inputs are the forward inputs listed in ``fwd_inputs`` then the output gradients listed in
    ``grad_outputs`` (``(k, None)``: output k's gradient; ``(k, j)``: the slice of it for piece j of the cat
    that made output k); its outputs are the gradients of the forward inputs in ``grad_inputs``. Inputs in
    ``zero_inputs`` need a gradient that is zero everywhere (``floor``). ``grad_unsqueeze``: per entry of
    ``grad_outputs``, how many trailing dims of size 1 its gradient gets before the call (an output of a
    reduction with keepdim off, whose backward reads it with the dims kept; empty: none anywhere).
    ``row_length``: the group's last input is a float, the number of elements a row reduces (a mean's gradient
    divides by it, as eager's does). ``saved_outputs``: forward outputs (softmax/log_softmax results, see the
    module's doc) whose values the group reads, its inputs after the forward inputs, before the gradients.
    """

    spec: Optional[KernelSpec]
    fwd_inputs: tuple[int, ...]
    grad_outputs: tuple[tuple, ...]
    grad_inputs: tuple[int, ...]
    zero_inputs: tuple[int, ...]
    grad_unsqueeze: tuple[int, ...] = ()
    row_length: bool = False
    # (forward input, index into grad_inputs): an input whose gradient is the same value as that output's (both
    # operands of an add): written once, as eager's backward passes one tensor to both
    aliases: tuple[tuple[int, int], ...] = ()
    saved_outputs: tuple[int, ...] = ()
    # forward values (ids) the group recomputes, whose results it reads (``fuser/saving.py`` picks among them)
    recomputed: tuple[int, ...] = ()
    # per tensor whose gradient is written whole (``chunks`` of build_backward): the forward inputs that are its
    # chunks, in chunk order; under the first, grad_inputs (or aliases) list that gradient, their cat
    cat_of: tuple[tuple[int, ...], ...] = ()


MEAN = "aten::mean.dim"


class _Unsupported(Exception):
    pass


def build_backward(spec: KernelSpec, needs: Sequence[bool], defined: Sequence[bool],
                   floating: frozenset, columns: bool = False, dtypes: Optional[dict] = None,
                   chunks: tuple = (), save: tuple = ()) -> Backward:
    """The backward group of ``spec.group``; raises :class:`_Unsupported` when the table cannot form it.

    needs: per group input, whether its gradient is wanted. defined: per group output, whether a gradient
    arrives for it. floating: ids of the group's values whose dtype is floating for these inputs (gradients
    flow through those only, as in eager, where integer and bool results never require grad). columns: the
    forward ran as a column kernel (its reductions over leading dims, ``fuser/rows/outer.py``; see ``_Rows``).
    dtypes: the forward values' dtypes (id -> dtype; see ``_cast_target``), where known. chunks: per tensor,
    (dim, group input indices) where those inputs are, in order, the equal chunks along dim of that tensor (an LSTM's
    gates): their gradients become one ``cat`` output, that tensor's gradient, which the caller passes on whole
    (eager's chunk backward would cat them in a kernel of its own); two tensors whose chunks share their gradients
    (chunk motion's x @ W and h @ U) share it whole. Where a chunk has no gradient of its own (zero, or shared with
    an input that is no such chunk), that tensor's chunks keep their outputs (it is not in ``Backward.cat_of``).
    save: forward value ids the group reads from the forward instead of recomputing them (a CPU backward,
    ``fuser/saving.py``): a whole output's from that output, another's from the extra output the forward writes for
    it (:func:`extra_outputs`; ``saved_outputs`` then indexes the outputs followed by those).
    """
    if spec.concat_consumed:
        raise _Unsupported("a cat's result used inside the group")
    fwd = spec.group
    b = ir.Builder()
    env: dict[int, ir.Value] = {}
    for v in fwd.inputs:
        env[v.id] = b.input(v.kind)
    reused = _reused_outputs(spec, save)  # forward value id -> output index, read from the saved output
    read_out = {vid: b.input(ir.TENSOR) for vid in reused}
    grad_in = []  # ((k, piece or None), forward value the gradient is for, group input)
    for k, o in enumerate(fwd.outputs):
        if not defined[k]:
            continue
        pieces = spec.pieces[k]
        for j, p in enumerate(pieces) if pieces is not None else [(None, o)]:
            grad_in.append(((k, j), p, b.input(ir.TENSOR)))

    def mapped(a):
        if isinstance(a, ir.Value):
            return env[a.id]
        return tuple(env[x.id] if isinstance(x, ir.Value) else x for x in a) if isinstance(a, tuple) else a

    rows = _Rows(fwd, columns) if spec.has_reduction else None
    columns = columns and rows is not None
    proxy: dict[int, ir.Value] = {}  # column-level value -> an element-level one of its dtype (_dtype_proxy)
    saved: dict[int, list] = {}  # a normalization's statistics, as eager's kernel saves them (its formula reads them)
    for n in fwd.nodes:  # the forward, recomputed from the saved inputs, rounded where the forward rounds
        if n.out.id in read_out:  # the forward's output, saved: not recomputed (the module's doc)
            env[n.out.id], saved[n.out.id] = read_out[n.out.id], []
            continue
        args = list(map(mapped, n.args))
        k = _keepdim_at(n.op)
        if rows is not None and k is not None:
            args[k] = True  # keepdim (see the module's doc)
        steps = _normalization_steps(b, n, args, [read_out[e] for e in _statistics_of(n) if e in read_out],
                                     (dtypes or {}).get(n.out.id))
        if steps is not None:
            env[n.out.id], saved[n.out.id] = steps
            continue
        with b.steps_of(n.origin):
            env[n.out.id] = b.add(n.op, *args)
        if columns:
            _dtype_proxy(b, n, args, proxy)

    carries = _carries(fwd, needs, floating)
    if carries is None:
        raise _Unsupported("an op outside the table")

    grads: dict[int, D.V] = {}
    row_length = None
    zeros: set[int] = set()  # values some op gives a zero gradient (eager then gives zeros, not None)

    def accumulate(u: int, r: D.V) -> None:
        grads[u] = r if u not in grads else grads[u] + r

    for k, o, gv in grad_in:
        if o.id in carries:
            accumulate(o.id, D.V(b, gv))
    # the gradient's nodes are steps of eager's backward kernels (gelu_backward computes in float in one kernel):
    # held unrounded, as the legacy fuser held every intermediate
    b.origin = ir.AUTOGRAD
    folded = products.find(fwd, floating) if rows is None else {}  # chains of mul: see fuser/products.py
    for n in reversed(fwd.nodes):
        if n.out.id not in grads:
            continue
        name = _name(n.op)
        f = D.formula(name)
        if f is None:
            raise _Unsupported(name)
        gy = grads[n.out.id]
        if n.out.id in folded:
            pairs = products.gradients(folded[n.out.id], gy, lambda a: D.V(b, mapped(a)),
                                       lambda a: a.id in carries)
        else:
            xs = [D.V(b, mapped(a)) for a in n.args]
            if n.op == MEAN or name in ("var", "std"):  # the row's length: see derivatives._mean
                if row_length is None:
                    row_length = b.input(ir.FLOAT)
                xs.append(D.V(b, row_length))
            xs += [D.V(b, v) for v in saved.get(n.out.id, ())]
            pairs = zip(n.args, f(gy, xs, D.V(b, env[n.out.id])))
        for inp, r in pairs:
            if not isinstance(inp, ir.Value) or inp.id not in carries:
                continue
            if r is D.UNSUPPORTED:
                raise _Unsupported(f"{name}: gradient of an input")
            is_input = fwd.is_input(inp)
            if r is D.ZERO and (is_input or spec.key in _backward_keys):
                zeros.add(inp.id)
                continue
            if r is D.ZERO:  # eager passes a tensor of zeros on: 0 * inf upstream is NaN there too
                r = D.op("aten::mul", D.op("aten::pow", gy, 0.0), 0.0)
            elif r is None:  # the op does not differentiate this input (type_as's other)
                continue
            if rows is not None and rows.broadcast(n, inp):  # summed along the row to the row-level value's shape
                r = D.reduce_sum(r, rows.dims)
            if not is_input:  # the engine casts a gradient to its value's dtype
                r = D.op("aten::type_as", r, D.V(b, _cast_target(inp, env, proxy, rows, read_out, dtypes)))
            accumulate(inp.id, r)

    grad_inputs, zero_inputs, outputs, aliases, written = [], [], [], [], {}
    for i, v in enumerate(fwd.inputs):
        if not needs[i]:
            continue
        r = grads.get(v.id)
        if r is None:
            if v.id in zeros:
                zero_inputs.append(i)
            continue
        if r.value.id in written:
            aliases.append((i, written[r.value.id]))
            continue
        written[r.value.id] = len(outputs)
        # a copy in the gradient's own dtype: eager sums a broadcast input's gradient before the cast
        outputs.append(D.op("aten::type_as", r, r).value)
        grad_inputs.append(i)
    if not grad_inputs:
        return Backward(None, (), (), (), tuple(zero_inputs))
    cat_of = _cat_chunks(chunks, grad_inputs, outputs, aliases, b)
    g = b.build(outputs).pruned()
    if _n_random(g) not in (0, _n_random(fwd)):
        # the backward redraws the forward's numbers with its state: op r's numbers depend on its ordinal r,
        # which must survive dead-code elimination (a random op nothing differentiable reads would not)
        raise _Unsupported("a random op the gradient does not read")
    # keep only the inputs the gradients read (those are what the forward saves)
    n_fwd = len(fwd.inputs)
    used = {v.id for n in g.nodes for v in n.values} | {v.id for v in g.outputs}
    keep = [j for j, v in enumerate(g.inputs) if v.id in used]
    g = g.with_inputs(keep)
    made = {n.out.id for n in g.nodes}
    recomputed = tuple(n.out.id for n in fwd.nodes if n.out.id not in read_out and env[n.out.id].id in made)
    bspec = STORE.get(STORE.register(g))
    _backward_keys.add(bspec.key)
    n_out = n_fwd + len(read_out)
    n_grad = n_out + len(grad_in)  # (then the row length, where a mean's gradient reads it)
    fwd_inputs = tuple(j for j in keep if j < n_fwd)
    out_index = list(reused.values())
    saved_outputs = tuple(out_index[j - n_fwd] for j in keep if n_fwd <= j < n_out)
    grad_outputs = tuple(grad_in[j - n_out][0] for j in keep if n_out <= j < n_grad)
    unsqueeze = () if rows is None else tuple(rows.dropped(grad_in[j - n_out][1]) for j in keep
                                              if n_out <= j < n_grad)
    return Backward(bspec, fwd_inputs, grad_outputs, tuple(grad_inputs), tuple(zero_inputs),
                    unsqueeze if any(unsqueeze) else (), any(j >= n_grad for j in keep), tuple(aliases),
                    saved_outputs, recomputed, cat_of)


def extra_outputs(spec: KernelSpec, save: tuple) -> tuple[int, ...]:
    """The values of ``save`` (forward value ids) that are no whole output of the group: the forward writes them as
    extra outputs, after its own, in this order."""
    whole = {v.id for v, p in zip(spec.group.outputs, spec.pieces) if p is None}
    return tuple(vid for vid in save if vid not in whole)


def _cat_chunks(chunks: tuple, grad_inputs: list, outputs: list, aliases: list, b: ir.Builder) -> tuple:
    """For ``chunks`` (per tensor: dim, its chunks' inputs): where a tensor's chunks each have an output of their
    own, those outputs replaced (in place, in ``grad_inputs`` and ``outputs``) by one, their cat along dim, under the
    first chunk; where a tensor's chunks are each an alias of those of such a tensor, in order, one alias of that
    cat instead. Returns the chunks' inputs of the tensors so written whole."""
    at = {j: k for k, j in enumerate(grad_inputs)}
    alias_of = dict(aliases)
    own = {}  # chunks' inputs -> their outputs
    for _, pieces in chunks:
        if all(j in at for j in pieces):
            own[pieces] = tuple(at[j] for j in pieces)
    shared = {}  # chunks' inputs -> the chunks' inputs whose outputs they alias
    for _, pieces in chunks:
        if pieces not in own and all(j in alias_of for j in pieces):
            target = tuple(alias_of[j] for j in pieces)
            shared.update({pieces: p for p, outs in own.items() if outs == target})
    covered = {j for pieces in shared for j in pieces}
    for i, k in aliases:  # an output some other input shares: its chunk's output stays
        if i not in covered:
            own = {p: outs for p, outs in own.items() if k not in outs}
    shared = {p: q for p, q in shared.items() if q in own}
    covered = {j for pieces in shared for j in pieces}  # (an alias of a chunk no longer shared points at none kept)
    gone = []
    for dim, pieces in chunks:
        if pieces in own:
            outs = own[pieces]
            outputs[outs[0]] = b.add(ir.CAT, tuple(outputs[k] for k in outs), dim)
            gone += outs[1:]
    for k in sorted(gone, reverse=True):
        del outputs[k], grad_inputs[k]
    kept = [(i, k) for i, k in aliases if i not in covered]
    kept += [(p[0], own[q][0]) for p, q in shared.items()]
    aliases[:] = [(i, k - sum(1 for g in gone if g < k)) for i, k in kept]
    return tuple(pieces for _, pieces in chunks if pieces in own or pieces in shared)


def _reused_outputs(spec: KernelSpec, save: tuple = ()) -> dict[int, int]:
    """The softmax and log_softmax results that are group outputs (whole, not a cat's piece), and the values of
    ``save``: forward value id -> its first output index (``save``'s others: their extra outputs' indices, after the
    group's outputs). The backward reads them from the forward's outputs (the module's doc). A softmax read only
    inside the group is recomputed: saving it would be a write the forward does not do."""
    norm = {n.out.id for n in spec.group.nodes
            if getattr(ops.reduction(n.op), "kind", None) in ("softmax", "log_softmax")}
    found: dict[int, int] = {}
    for k, v in enumerate(spec.group.outputs):
        if (v.id in norm or v.id in save) and spec.pieces[k] is None:
            found.setdefault(v.id, k)
    n = len(spec.group.outputs)
    found.update({vid: n + k for k, vid in enumerate(extra_outputs(spec, save))})
    return found


def _cast_target(v: ir.Value, env: dict, proxy: dict, rows, read_out: dict, dtypes: Optional[dict]) -> ir.Value:
    """What the cast of forward value ``v``'s gradient to ``v``'s dtype reads (``type_as`` reads only its dtype):
    its column-level proxy (``_dtype_proxy``), else an element-level ``v`` of the dtype of a saved output the
    backward reads anyway, that output (so that a softmax's prologue, x * scale + mask, is neither recomputed nor
    its inputs read: the gradient of a mul by a constant or of an add does not read them), else ``v`` itself."""
    if v.id in proxy:
        return proxy[v.id]
    if dtypes and v.id in dtypes and (rows is None or v.id not in rows.row):
        for u, read in read_out.items():
            if dtypes.get(u) == dtypes[v.id]:
                return read
    return env[v.id]


def _dtype_proxy(b: ir.Builder, n: ir.Node, args: list, proxy: dict) -> None:
    """For a column kernel's backward: where forward node ``n`` (``args``: its arguments in the backward) is
    column-level, an element-level value of its dtype in ``proxy`` (by the forward value's id), for the casts of
    gradients to its dtype. A cast that read the column-level value itself would make every gradient after it
    column-level, and the column kernel's element-level nodes (a sum's gradient broadcast back down the column)
    may not read one. A reduction without a dtype argument has its input's dtype; another node, its own op on
    its operands' proxies (type promotion does not depend on the extent of dims). Only casts read a proxy
    (``type_as`` reads no value of its second operand, so the compiler drops the proxy's arithmetic)."""
    red = ops.reduction(n.op)
    if red is not None:
        if red.kind in ("amax", "amin") or (red.kind in ("sum", "mean") and args[3] is None):
            proxy[n.out.id] = args[0]
        return
    if not any(isinstance(a, ir.Value) and a.id in proxy for a in n.args):
        return
    inner = [proxy[a.id] if isinstance(a, ir.Value) and a.id in proxy else m for a, m in zip(n.args, args)]
    with b.steps_of(n.origin):
        proxy[n.out.id] = b.add(n.op, *inner)


def _name(op: str) -> Optional[str]:
    """The derivative table's name of an overload (a pointwise op's table name, a reduction's kind)."""
    red = ops.reduction(op)
    if red is not None:
        return red.kind
    entry = ops.of(op)
    return None if entry is None else entry.name


def _keepdim_at(op: str) -> Optional[int]:
    """The position of a reduction's keepdim argument (None: not a reduction, or a normalization, which has none)."""
    red = ops.reduction(op)
    if red is None or red.kind in ops.NORMALIZATIONS:
        return None
    return 3 if red.kind in ("var", "std") else 2


def _normalization_steps(b: ir.Builder, n: ir.Node, args: list, read: list, dtype) -> Optional[tuple]:
    """A normalization node recomputed as its steps (fuser/rows/decompose.py, the row kernel's own): (its result,
    the statistics its formula reads: layer_norm's mean and rstd, rms_norm's rstd). ``read``: those statistics as
    the backward's inputs, where the forward wrote them (:func:`statistics`; ``dtype``: the op's result's), else
    empty: formed again from the row. None: not one."""
    red = ops.reduction(n.op)
    kind = None if red is None else red.kind
    stats = read or None
    if stats is not None and dtype is None:
        raise _Unsupported("a normalization's saved statistics without its dtype")
    if kind in ("softmax", "log_softmax"):
        return getattr(decompose, kind)(b, args[0], args[1], args[2]), []
    if kind == "layer_norm":
        y, mu, r = decompose.layer_norm_stats(b, *args[:5], stats=stats, dtype=dtype)
        return y, [mu, r]
    if kind == "rms_norm":
        y, r = decompose.rms_norm_stats(b, *args[:4], stats=stats, dtype=dtype)
        return y, [r]
    return None


# ---- a normalization's statistics, written by the forward for its backward (issue 12: "save mean and rstd where
# eager does"). Where the backward formed them again, it read each row twice more (the mean, then the centered
# variance) before the passes its formula makes. An entry of ``save`` names the k-th statistic of the normalization
# node whose result is value v as the negative int -(4 v + k + 1) (value ids are not negative; ``save`` travels as
# ints through the native hot path's records).
STATISTICS = {"layer_norm": 2, "rms_norm": 1}  # mean and rstd; rstd


def statistic(vid: int, k: int) -> int:
    return -(4 * vid + k + 1)


def _statistic_of(entry: int) -> tuple[int, int]:
    """(value id, k) of a ``save`` entry made by :func:`statistic`."""
    return divmod(-entry - 1, 4)


def _statistics_of(n: ir.Node) -> tuple[int, ...]:
    kind = getattr(ops.reduction(n.op), "kind", None)
    return tuple(statistic(n.out.id, k) for k in range(STATISTICS.get(kind, 0)))


def statistics(spec: KernelSpec) -> tuple[int, ...]:
    """The ``save`` entries of every statistic of ``spec``'s normalizations (empty: none)."""
    return tuple(e for n in spec.group.nodes for e in _statistics_of(n))


def forward_group(spec: KernelSpec, extras: tuple, reduced: frozenset = frozenset()) -> ir.Group:
    """``spec``'s group with the values ``extras`` (:func:`extra_outputs`) as more outputs, after its own: the
    forward that writes what its backward reads saved. A statistic is formed beside its normalization as that
    op's steps (the row kernel forms them once: ``decompose.expand`` shares repeated steps), in float32 where its
    normalization's value id is in ``reduced`` (a float16/bfloat16 result: ``decompose.stat_output``)."""
    g = spec.group
    if all(e >= 0 for e in extras):
        by_id = {n.out.id: n.out for n in g.nodes}
        return ir.Group(g.inputs, g.nodes, g.outputs + tuple(by_id[vid] for vid in extras))
    wanted = {_statistic_of(e)[0] for e in extras if e < 0}
    b = ir.Builder()
    env = {v.id: b.input(v.kind, v.dtype, v.rank) for v in g.inputs}

    def arg(a):
        if isinstance(a, ir.Value):
            return env[a.id]
        return tuple(arg(x) for x in a) if isinstance(a, tuple) else a

    stats: dict[int, list] = {}
    for n in g.nodes:
        args = [arg(a) for a in n.args]
        with b.steps_of(n.origin):
            env[n.out.id] = b.add(n.op, *args)
        if n.out.id in wanted:
            kind = ops.reduction(n.op).kind
            got = (decompose.layer_norm_stats(b, *args[:5])[1:] if kind == "layer_norm" else
                   decompose.rms_norm_stats(b, *args[:4])[1:])
            stats[n.out.id] = [decompose.stat_output(b, v, n.out.id in reduced) for v in got]
    outs = [env[v.id] for v in g.outputs]
    for e in extras:
        if e >= 0:
            outs.append(env[e])
        else:
            vid, k = _statistic_of(e)
            outs.append(stats[vid][k])
    return b.build(outs).pruned()


class _Rows:
    """What the backward of a group with reductions needs of the forward: which values are row-level, the
    reduced dims (every reduction's: the row kernel's plan holds them equal), and the row-level values whose
    reduced dims are dropped (keepdim off).

    ``columns``: the forward ran as a column kernel (reductions over leading dims). Its column-level values
    (``fuser.rows.outer.column_level``: the epilogue too, which may read inputs of the columns' shape) take the
    row-level values' place; no element-level value reads one (the column plan's rule), so no gradient is summed
    in the group; and a dropped-dims value's gradient broadcasts as it comes (the reduced dims lead: right-aligned
    broadcasting puts its dims on the kept ones), so nothing is unsqueezed."""

    def __init__(self, fwd: ir.Group, columns: bool = False):
        self.row = column_level(fwd) if columns else row_level(fwd)
        reductions = [n for n in fwd.nodes if ops.reduction(n.op) is not None]
        self.dims = ops.reduced_dims(reductions[0].op, reductions[0].args)
        self._dropped: dict[int, int] = {}
        for n in fwd.nodes:
            if n.out.id not in self.row or columns:
                continue
            k = _keepdim_at(n.op)
            if k is not None:
                d = n.args[1]
                self._dropped[n.out.id] = 0 if n.args[k] else (len(d) if d else 0)
            else:
                self._dropped[n.out.id] = max((self._dropped.get(v.id, 0) for v in n.values), default=0)

    def broadcast(self, n: ir.Node, inp: ir.Value) -> bool:
        """Whether element-level node ``n`` reads row-level ``inp`` (broadcast along the row)."""
        return inp.id in self.row and n.out.id not in self.row

    def dropped(self, v: ir.Value) -> int:
        """The number of reduced dims ``v`` lacks (0 for element-level values and kept dims). With every dim
        reduced (dims empty) there are no rows: a 0-dim value broadcasts as is."""
        return self._dropped.get(v.id, 0)


def _n_random(group: ir.Group) -> int:
    return sum(1 for n in group.nodes if getattr(ops.of(n.op), "random", False))


_backward_keys: set[int] = set()  # specs that are backward groups (their own zeros stay implicit)


_SHIFT_INVARIANT = ("aten::softmax", "aten::log_softmax")


def _stabilizer(fwd: ir.Group, n: ir.Node) -> bool:
    """The max that softmax and log_softmax subtract (``fuser/rows/decompose.py``), read only by that op's other
    steps: their results do not change with it, and eager's backward of the op (y * (g - sum(g * y))) passes it
    no gradient. A max written out by the user gets eager's op-by-op gradient (zero up to rounding, split among
    ties)."""
    if n.op != "aten::amax" or n.origin not in _SHIFT_INVARIANT or any(v.id == n.out.id for v in fwd.outputs):
        return False
    return all(m.origin == n.origin for m in fwd.nodes if any(v.id == n.out.id for v in m.values))


class _REDUCTION:  # what _carries asks of an op-table entry, for a reduction
    concat = False
    name = "reduction"


def _carries(fwd: ir.Group, needs: Sequence[bool], floating: frozenset) -> Optional[set]:
    """ids of the values through which a wanted gradient flows (None: an op outside the table)."""
    carries = {v.id for v, need in zip(fwd.inputs, needs) if need}
    for n in fwd.nodes:
        op = ops.of(n.op)
        if op is None and ops.reduction(n.op) is not None:
            op = _REDUCTION  # differentiable, floating (fuser/rows/ plans floating reductions only)
        if op is not None and op.concat:  # its gradient goes straight to its pieces, as slices of the output's
            if any(p.id in carries for p in n.args[0]):
                carries.add(n.out.id)
            continue
        if not any(v.id in carries for v in n.values):
            continue
        if op is None:
            return None
        if op.name not in D.NOT_DIFFERENTIABLE and n.out.id in floating and not _stabilizer(fwd, n):
            carries.add(n.out.id)
    return carries
