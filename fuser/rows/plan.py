"""The row plan: a group with reductions viewed as [rows, cols], or the reason it must fall back.

Every value of the group is element-level (one per (row, col): the tensor inputs, and nodes that read one) or
row-level (one per row: a reduction's result, and nodes that read only row-level values): ``passes.py``, which also
gives the passes a row kernel makes along the row. The group's shapes come
from eager itself: the group runs once on meta tensors of the inputs' shapes and strides, which also raises
where eager raises (an amax of an empty row), and gives each value's dtype. The form this supports: every
reduction reads an element-level value of one full shape F and reduces the same trailing dims of it; rows is the
product of F's other dims, cols of the reduced ones. Element-level values broadcast to F, row-level values have F's
leading dims (with the reduced dims kept as 1, or dropped); a row-level value read by an element-level node keeps
its dims (otherwise broadcasting would align it with F's trailing dims, not its rows). An output that sums an
element-level value of shape F over F's leading dims (a weight's gradient in a norm's backward) is a column sum
(:func:`column_sum_form`): the kernel adds it up across the rows as it goes (on CUDA where the row takes one trip
of a thread's elements, or several whose sums fit a block's shared memory: ``CudaShape.trip_sums``). Where the
kernel cannot (a CUDA row of several trips whose sums do not fit), the plan keeps such sums apart
(``RowKey.apart``): the kernel writes the summed values whole and eager's ``sum`` adds them up after it, unless the
group's spec is in :data:`SUMS_IN_KERNEL_ONLY` (``fuser/grad_sums.py``'s fused backwards, which have a split of their
own: a column kernel that recomputes the summed values from the inputs). On CUDA the row's :class:`CudaShape` (how
its kernel lays a row over threads) comes from ``shape.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import codegen, executor, ir, ops, settings
from ..codegen import REDUCED
from ..descs import DTYPES
from ..fallback import evaluate
from ..kernel_cache import KernelSpec
from . import decompose
from . import shape as row_shape  # (its functions and limits read through the module, where a test patches them)
from .passes import column_sum_candidates, column_sum_form, pass_width, row_inputs, row_level, with_row_inputs
from .shape import CudaShape

MAX_LEAD_DIMS = 8  # compressed row dims (the CUDA argument struct's arrays)
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Column sums in a CPU row kernel add each row's values into a partial row in memory, a vector store per vector of
# each sum on top of the row's own stores, where a column kernel keeps its sums in registers and reads x and dy
# again from the cache. Measured first (2-core EPYC, one thread, layer_norm(x) * w + b backward, medians): [8 x 4096]
# 36 us against 47, [64 x 1024] 38-58 against 47-68, [256 x 1024] even, [1024 x 1024] 850-950 against 740-800,
# [2048 x 1024] 2.8-3.0 ms against 2.1-2.5, so float32 and float64 took the split (a row kernel, then a column
# kernel) past 2^18 elements. Since the row kernels' at::vec loops, the split lost at every size of the benchmark's:
# python -m fuser.bench --device cpu, 2 threads, training steps of 4M float32 elements, split / sums in the row
# kernel, two rounds alternating (2026-11-27): layer_norm(x) * w + b over rows of 4096 9.9, 7.7 / 7.2, 5.8 ms, of 512
# 9.6, 11.5 / 6.0, 4.9 ms, of 16384 6.2, 6.6 / 7.7, 6.3 ms; rms_norm(x) * w over rows of 4096 6.7, 5.2 / 5.9, 4.1 ms,
# of 512 6.0, 5.2 / 2.7, 4.4 ms (the column kernel splits its work by columns: rows of 512 gave it one thread). So no
# bound (None); an int brings the split back past that many elements (float16/bfloat16 keep the column sums at any
# size: the split would pass their statistics through memory rounded, eager's sum_to_size instead)
CPU_MAX_SUMMED: Optional[int] = None
# spec keys of groups whose column sums run in the row kernel or not at all (no RowKey.apart): the caller has a better
# way (fuser/grad_sums.py registers its fused backwards here)
SUMS_IN_KERNEL_ONLY: set = set()
MAX_CUDA_COLS = 2 ** 31 - 2 ** 16  # a CUDA row kernel's column index is an int, with room for a trip past the end
INDEX32_LIMIT = 2 ** 31  # CUDA: a walk over dims divides in 32 bits below this (RowKey.index64, OuterKey.index64)


def index64(target: str, bound: int) -> bool:
    """Whether a kernel whose walks over dims divide values below ``bound`` divides in 64 bits: CPU kernels always
    (their templates), CUDA ones from :data:`INDEX32_LIMIT` on (``templates.quotient``)."""
    return target != "cuda" or bound >= INDEX32_LIMIT


@dataclass(frozen=True)
class RowKey:
    """What a row kernel's source depends on: the target, the device, per tensor input its dtype and whether it
    is 0-dim (type promotion treats those apart), and on CUDA the row's :class:`CudaShape` (chosen from the row
    length) and, for a kernel that takes whole vectors only, each input's step along the row (``steps``); whether
    the rows' offsets take a walk over several row dims (``walk``) and divide in 64 bits (``index64``). The other
    strides and sizes are launch arguments."""

    target: str
    device_index: Optional[int]
    inputs: tuple[tuple[torch.dtype, bool], ...]
    shape: Optional[CudaShape] = None
    sums: tuple[int, ...] = ()  # the outputs that are column sums (:func:`column_sum_form`)
    # CUDA: per tensor input its step along the row (1, or 0: one value a row) where the kernel takes whole vectors
    # only (``settings.cuda_vector_rows``: the signature allows them, ``RowPlan.vec_ok``); None: the kernel checks
    # the launch's ``args.vec`` and any strides
    steps: Optional[tuple[int, ...]] = None
    # the outputs that are column sums the kernel writes whole, summed after it by eager's sum (RowPlan.apart)
    apart: tuple[int, ...] = ()
    # the tensor inputs (group input positions) that hold one value a row, loaded once a row (with_row_inputs)
    row_inputs: tuple[int, ...] = ()
    # the walk over the row dims divides in 64 bits (on CUDA only where there are 2^31 rows or more: templates.quotient)
    index64: bool = True
    # the rows span several dims after compression, so a row's offsets come from a divmod walk over them; on CUDA
    # False where they span one or none (row * stride; the walk's loop took NVRTC a fifth of a row kernel's time)
    walk: bool = True


@dataclass
class RowPlan:
    key: RowKey
    tensors: list
    scalars: list
    rows: int
    cols: int
    lead: list  # the compressed sizes of the row dims (row-major)
    strides: list  # per tensor input: its strides over ``lead``, then its one stride along the row
    out_shapes: list  # per group output
    out_dtypes: list
    types: list  # codegen.NodeTypes per node
    vec_ok: bool = False  # CUDA: sizes and strides allow whole vectors (the pointers are checked per launch)
    vec_align: tuple = ()  # CUDA, per pointer (inputs, outputs): bytes it must be aligned to for vectors (0: any)
    apart: tuple = ()  # (output, dims, keepdim) per column sum kept apart (RowKey.apart): summed after the kernel


def _column_dims(d: Sequence[int], s: tuple, full: tuple, lead: int) -> bool:
    """Whether a sum over dims ``d`` of a value of shape ``s`` is a column sum of a row kernel over ``full`` with
    ``lead`` row dims: the value is element-level at the full shape, and the sum takes every row dim of size > 1
    and no dim along the row."""
    return s == full and all(x < lead for x in d) and all(x in d for x in range(lead) if full[x] != 1)


def _dims(node: ir.Node, rank: int) -> list[int]:
    dims = node.args[1]
    if not dims:  # None or empty: every dim, as eager reads it
        return list(range(rank))
    return sorted({d % rank for d in dims}) if rank else []


def _eager_rms_vectorized(normalized_shape) -> bool:
    """Whether eager's CUDA rms_norm takes its vectorized kernel by the row length (a multiple of 4, at most
    2**24 elements) for inputs and weights aligned to 4 elements."""
    n = math.prod(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else None
    return n is not None and n % 4 == 0 and n <= 1 << 24


def _steps_differ(group: ir.Group, steps: ir.Group, meta_args: list, values: list, target: str) -> str:
    """Why the steps of ``group``'s composite ops (``decompose.expand``) would not give eager's outputs for these
    inputs on ``target`` (their dtypes or shapes differ: a float32 weight of a bfloat16 layer_norm, whose eager
    kernel keeps the input's dtype; rms_norm's default eps in float64; CUDA's float64 rms_norm), or ""."""
    value_of = {n.out.id: v for n, v in zip(group.nodes, values[len(group.outputs):])}
    value_of.update({v.id: a for v, a in zip(group.inputs, meta_args)})
    for n in group.nodes:
        if n.op == "aten::rms_norm" and target == "cuda" and value_of[n.args[0].id].dtype == torch.float64:
            # eager's CUDA rms_norm in float64 gives a whole row NaN where an element is inf; its composite, which
            # the steps follow, gives 0 for the finite elements (the CUDA fuzzer found it). In float32, bfloat16 and
            # float16 eager's CUDA results are the composite's, overflowing rows included (H100, torch 2.11)
            return "rms_norm on CUDA in float64: eager's kernel and its composite differ on rows holding inf"
        if n.op == "aten::rms_norm" and target == "cuda" and not _eager_rms_vectorized(n.args[1]):
            # the same on every dtype where eager's CUDA kernel takes its non-vectorized path: a row length that is
            # not a multiple of 4 (or past 2**24). Rows of 3, 49 and 838 elements gave whole NaN rows, of 512, 4096
            # and 16384 the composite's (H100, torch 2.11). Eager also takes that path for an input or weight not
            # aligned to 4 elements, which the plan does not see (the signature has no data pointers): there a
            # row holding inf still gives the composite's 0 for its finite elements where eager gives NaN
            return "rms_norm on CUDA over rows eager does not vectorize: its kernel and its composite differ on inf"
        if n.op == "aten::rms_norm" and n.args[3] is None and value_of[n.args[0].id].dtype == torch.float64:
            return "rms_norm's default eps in float64 (the steps take float32's)"
    try:
        outs = evaluate(steps, meta_args)
    except Exception as e:
        return f"the steps of a composite op reject these inputs: {e}"
    for o, want in zip(outs, values):
        if o.dtype != want.dtype or o.shape != want.shape:
            return f"the steps of a composite op give {o.dtype} {list(o.shape)}, eager {want.dtype} {list(want.shape)}"
    return ""


def _column_sums(group: ir.Group, shape: dict) -> frozenset:
    """ids of the sum nodes of ``group`` that a row kernel takes as column sums (:func:`column_sum_form`), by the
    values' shapes: the other reductions reduce the trailing dims of one shape, and each such sum takes its row
    dims (:func:`_column_dims`). Empty where there are none, or no other reduction (a column kernel's form)."""
    cands = column_sum_candidates(group)
    if not cands:
        return frozenset()
    others = [n for n in group.nodes if ops.reduction(n.op) is not None and n.out.id not in cands]
    if not others:
        return frozenset()
    full = shape[others[0].args[0].id]
    d = _dims(others[0], len(full))
    lead = len(full) - len(d)
    if d != list(range(lead, len(full))):
        return frozenset()
    return frozenset(n.out.id for n in group.nodes if n.out.id in cands
                     and _column_dims(_dims(n, len(shape[n.args[0].id])), shape[n.args[0].id], full, lead))


def broadcasts_to(s: tuple, full: tuple) -> bool:
    """Whether shape ``s`` broadcasts to ``full`` (and is no larger)."""
    try:
        return torch.broadcast_shapes(s, full) == torch.Size(full)
    except RuntimeError:
        return False


def _types(group: ir.Group, args: Sequence, metas_list: list, values: list) -> list:
    """Each node's ``codegen.NodeTypes``, as the compiler's probe gives them (comparisons compute in their operands'
    common dtype); a reduction computes in its result's dtype: eager converts the input to it first (sum's dtype
    argument)."""
    meta_of = {v.id: m for v, m in zip([v for v in group.inputs if v.is_tensor], metas_list)}
    meta_of.update({v.id: float(a) for v, a in zip(group.inputs, args) if not v.is_tensor})
    meta_of.update({n.out.id: val for n, val in zip(group.nodes, values)})
    types = []
    for n, val in zip(group.nodes, values):
        op = ops.of(n.op)
        compute = val.dtype
        if op is not None and op.compute == "common":
            a, b = (meta_of[x.id] if isinstance(x, ir.Value) else
                    x.tensor() if isinstance(x, ir.TensorConst) else x for x in n.args)
            compute = torch.result_type(a, b)
        types.append(codegen.NodeTypes(val.dtype, compute))
    return types


def plan(spec: KernelSpec, args: Sequence, target: Optional[str] = None, apart: bool = False) -> Union[RowPlan, str]:
    """A :class:`RowPlan` for ``args``, or the reason to fall back. ``target``: as for ``executor.plan`` (the
    CUDA emulator plans "cuda" kernels for CPU tensors). ``apart``: column sums kept apart (``RowKey.apart``); the
    plan asks for it itself where the kernel cannot sum them."""
    checked = executor.check_inputs(spec, args, target)
    if isinstance(checked, str):
        return checked
    tensors, scalars, device, target = checked
    group = spec.group
    if any(group.is_input(v) for v in group.outputs):
        return "an output is an input (a kernel's outputs are fresh tensors)"
    if target == "cuda":
        if any(isinstance(a, ir.TensorConst) and a.shape for n in group.nodes for a in n.args):
            # the meta run below does not check devices: eager's CUDA kernels reject a CPU tensor constant that is
            # not 0-dim (a 0-dim one is a CPU scalar, which they take: the door's where(c, x, scalar_tensor(0.)))
            return "a tensor constant of more than 0 dims in a CUDA row group (its device is not checked)"
    metas_list = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors]
    metas = iter(metas_list)
    meta_args = [next(metas) if is_t else a for a, is_t in zip(args, spec.input_is_tensor)]
    try:
        values = evaluate(group, meta_args, every_value=True)
        # meta kernels check neither devices nor a Scalar's range for the dtype (CUDA's threshold(half, 70000.0)
        # raises in eager): the group once more on the real device, on at most one slice of each input's first dim
        # (the rows reduce trailing dims, so their length and the errors that depend on it stay). Not on fake tensors
        # (a front door's example inputs, fuser/dynamo/prebuild.py: their mode refuses a real tensor constant beside
        # them); the first call's plan runs it on the real ones.
        if not all(t.device.type == "meta" or is_fake(t) for t in tensors):
            heads = iter([t[:1] if t.dim() >= 2 else t for t in tensors])
            evaluate(group, [next(heads) if is_t else a for a, is_t in zip(args, spec.input_is_tensor)])
    except Exception as e:  # eager raises for these inputs: the fallback shows its error
        return f"eager rejects these inputs: {e}"
    steps = decompose.expand(group)
    if steps is not group:  # composite ops (softmax, layer_norm, ...): the kernel runs their steps
        why = _steps_differ(group, steps, meta_args, values, target)
        if why:
            return why
        group, values = steps, evaluate(steps, meta_args, every_value=True)
    values = values[len(group.outputs):]
    shape = {v.id: tuple(t.shape) for v, t in zip([v for v in group.inputs if v.is_tensor], tensors)}
    dtype = {v.id: t.dtype for v, t in zip([v for v in group.inputs if v.is_tensor], tensors)}
    for n, val in zip(group.nodes, values):
        if not isinstance(val, torch.Tensor):
            return f"{n.op} does not give a tensor"
        shape[n.out.id], dtype[n.out.id] = tuple(val.shape), val.dtype
    if any(dt not in DTYPES for dt in dtype.values()):
        return "a value of an unsupported dtype"
    sums: tuple[int, ...] = ()
    sum_shapes: dict = {}
    kept_apart: tuple = ()
    chosen = _column_sums(group, shape)
    if chosen:  # column sums: the row kernel runs the group without them, and sums their values per column
        sums = tuple(m for m, v in enumerate(group.outputs) if v.id in chosen)
        producer = {n.out.id: n for n in group.nodes}
        if any(dtype[i] not in FLOATING or dtype[producer[i].args[0].id] != dtype[i] for i in chosen):
            return "a column sum that converts its values' dtype (floating sums of their own dtype only)"
        sum_shapes = {m: (shape[group.outputs[m].id], dtype[group.outputs[m].id]) for m in sums}
        summed = [producer[group.outputs[m].id] for m in sums]
        group = column_sum_form(group, sums)
        values = evaluate(group, meta_args, every_value=True)[len(group.outputs):]
        if apart:  # the kernel writes the summed values whole (element-level outputs of the full shape)
            kept_apart = tuple((m, tuple(_dims(n, len(shape[n.args[0].id]))), bool(n.args[2]))
                               for m, n in zip(sums, summed))
            sums, sum_shapes = (), {}
    rows_v = row_level(group)

    full, dims = None, None
    for n in group.nodes:
        if ops.reduction(n.op) is None:
            continue
        u = n.args[0]
        if u.id in rows_v:
            return f"{n.op} of a row-level value (a reduction of a reduction)"
        if dtype[u.id] not in FLOATING or dtype[n.out.id] not in FLOATING:
            return f"{n.op} of {dtype[u.id]} to {dtype[n.out.id]} (floating reductions only)"
        d = _dims(n, len(shape[u.id]))
        if full is None:
            full, dims = shape[u.id], d
        elif shape[u.id] != full or d != dims:
            return "reductions of different shapes or dims in one group"
    nd, k = len(full), len(dims)
    for v in group.inputs:
        if v.is_tensor and not broadcasts_to(shape[v.id], full):
            return f"an input of shape {list(shape[v.id])} is larger than the reduced shape {list(full)}"
    if dims != list(range(nd - k, nd)):  # a column kernel's form (fuser/rows/outer.py), or why not
        from . import outer
        return outer.plan(group, (target, device.index, tuple((t.dtype, t.dim() == 0) for t in tensors)), tensors,
                          scalars, metas_list, shape, dtype, full, dims,
                          _types(group, args, metas_list, values))
    lead_shape = full[:nd - k]
    keep, drop = lead_shape + (1,) * k, lead_shape
    seeded = row_inputs(group, shape, full, k)
    if seeded:
        group = with_row_inputs(group, seeded)
        rows_v = row_level(group)

    def broadcasts(s) -> bool:
        return broadcasts_to(s, full)

    for n in group.nodes:
        s = shape[n.out.id]
        row_args = [shape[v.id] for v in n.values if v.id in rows_v]
        if n.out.id in rows_v:
            if s not in (keep, drop) or any(a != s for a in row_args):
                return f"a row-level value of shape {list(s)} (rows {list(lead_shape)})"
        elif not broadcasts(s) or any(a != keep and not (a == () and not lead_shape) for a in row_args):
            return f"{n.op} broadcasts a row-level value across the row's dims"
    for v in group.outputs:
        if shape[v.id] != (full if v.id not in rows_v else shape[v.id]):
            return f"an output of shape {list(shape[v.id])} (the rows' elements are {list(full)})"

    # each input's strides over the row dims and along the row: views of it broadcast to the full shape,
    # compressed as the pointwise map compresses its dims
    wide = [m.expand(full).stride() for m in metas_list]
    base = torch.empty(0, device="meta")
    lead, lead_st = executor._compress(lead_shape, [base.as_strided(lead_shape, w[:nd - k]) for w in wide])
    inner, inner_st = executor._compress(full[nd - k:], [base.as_strided(full[nd - k:], w[nd - k:]) for w in wide])
    if len(inner) > 1:
        return "an input does not walk the reduced dims with one stride"
    col_strides = [st[0] if st else 0 for st in inner_st]
    if len(lead) > MAX_LEAD_DIMS:
        return f"{len(lead)} row dims after compression (row kernels take {MAX_LEAD_DIMS})"

    types = _types(group, args, metas_list, values)
    rows, cols = math.prod(lead_shape), math.prod(full[nd - k:])
    out_dtypes = [dtype[v.id] for v in group.outputs]
    strides = [ls + [cs] for ls, cs in zip(lead_st, col_strides)]
    cuda_sh, vec_ok, vec_align = None, False, ()
    if target == "cuda":
        if cols > MAX_CUDA_COLS:
            return f"a row of {cols} elements (CUDA row kernels index a row with 32 bits)"
        dts = [t.dtype for t in tensors] + out_dtypes
        sizes = [torch.empty((), dtype=dt).element_size() for dt in dts]
        # a row-level output (a norm's mean and rstd, saved in float32 by a bfloat16 forward) is stored once a row:
        # the shape's vectors are those of the rest. H200, [16384 x 4096] bfloat16, torch.profiler: layer_norm's
        # training forward 98 -> 71 us, rms_norm's 74 -> 67 us. Row-level inputs still count for a held row: the
        # backwards reading those statistics (and summing the weight's gradient) took 161 -> 173 us and 106 -> 115
        # us with 16-byte vectors of their bfloat16 rows (2026-11-29); a row of several trips leaves them out
        # (TRIP_SUMS_ELEMENT_VECTORS)
        n_in = len(tensors)
        widths = [sz for j, sz in enumerate(sizes) if j < n_in or group.outputs[j - n_in].id not in rows_v]
        if sums:
            def stage(sh: CudaShape, left: int) -> Optional[CudaShape]:  # the trip sums' staged inputs
                return (row_shape.staged_shape(group, sh, cols, sizes[:len(tensors)], strides, left)
                        if settings.cuda_staged_rows and settings.cuda_vector_rows and _vectors(cols, strides, sh.vec)
                        else None)
            per_element = [sz for j, sz in enumerate(widths) if j >= n_in or col_strides[j] != 0]
            if not _vectors(cols, strides, 16 // max(per_element, default=4)):  # (their wider vectors would not fit
                per_element = None  # the row: it would be read an element at a time, unstaged)
            cuda_sh = row_shape._cuda_sums_shape(group, cols, widths, len(sums), row_shape.shared_limit(device),
                                                 stage, row_shape.sum_sizes(out_dtypes, sums), per_element)
            if cols > cuda_sh.tpr * cuda_sh.items and not cuda_sh.trip_sums:
                return _sums_apart(spec, args, target,
                                   "column sums of a CUDA row kernel of several trips along the row, past a "
                                   "block's shared memory")
        else:
            cuda_sh = row_shape._cuda_row_shape(group, cols, widths, 0)
            if (not cuda_sh.held and min(widths) >= row_shape.CLUSTER_MIN_BYTES
                    and row_shape._clusters(device)):  # a cluster's
                cuda_sh = row_shape.cluster_shape(cols, widths, *pass_width(group, True)) or cuda_sh
            if not cuda_sh.held:  # each pass loads what it reads
                cuda_sh = row_shape._cuda_row_shape(group, cols, widths, 0, held=False)
                # or keeps in shared memory what several passes read (a vectors-only kernel's: RowKey.steps below)
                if settings.cuda_vector_rows and _vectors(cols, strides, cuda_sh.vec):
                    cuda_sh = row_shape.staged_shape(group, cuda_sh, cols, sizes[:len(tensors)], strides,
                                                     row_shape.stage_limit(device)) or cuda_sh
        vec = cuda_sh.vec
        vec_ok = _vectors(cols, strides, vec)
        size = lambda dt: min(16, torch.empty((), dtype=dt).element_size() * vec)  # noqa: E731
        vec_align = tuple(size(t.dtype) if st[-1] == 1 else 0 for t, st in zip(tensors, strides)) + tuple(
            size(dt) if v.id not in rows_v and m not in sums else 0
            for m, (v, dt) in enumerate(zip(group.outputs, out_dtypes)))
    out_shapes = [shape[v.id] for v in group.outputs]
    if sums and rows == 0:
        return _sums_apart(spec, args, target, "column sums over no rows (zeros: eager's sum gives them)")
    if (sums and target == "cpu" and CPU_MAX_SUMMED is not None and rows * cols > CPU_MAX_SUMMED
            and not any(t.dtype in REDUCED for t in tensors)):
        return _sums_apart(spec, args, target, f"column sums over {rows * cols} elements on the CPU (a row kernel, "
                           f"then a column kernel, is faster from {CPU_MAX_SUMMED})")
    for m, (s, dt) in sum_shapes.items():
        out_shapes[m], out_dtypes[m] = s, dt
    steps = tuple(st[-1] for st in strides) if vec_ok and settings.cuda_vector_rows else None
    key = RowKey(target, device.index, tuple((t.dtype, t.dim() == 0) for t in tensors), cuda_sh, sums, steps,
                 tuple(m for m, _, _ in kept_apart), seeded, index64(target, rows), target != "cuda" or len(lead) > 1)
    return RowPlan(key, tensors, scalars, rows, cols, lead, strides, out_shapes, out_dtypes, types, vec_ok,
                   vec_align, kept_apart)


def _vectors(cols: int, strides: Sequence, vec: int) -> bool:
    """Whether rows of ``cols`` elements of inputs of ``strides`` (over the row dims, then along the row) may be
    read in whole vectors of ``vec`` elements (``RowPlan.vec_ok``)."""
    return cols > 0 and cols % vec == 0 and all(
        st[-1] in (0, 1) and (st[-1] == 0 or all(x % vec == 0 for x in st[:-1])) for st in strides)


def sum_apart(apart: tuple, outputs: list) -> list:
    """``outputs`` with the column sums a kernel wrote whole (``RowPlan.apart``: (output, dims, keepdim) each) summed
    by eager's sum."""
    for m, dims, keepdim in apart:
        outputs[m] = outputs[m].sum(dims, keepdim=keepdim)
    return outputs


def _sums_apart(spec: KernelSpec, args: Sequence, target: str, why: str) -> Union[RowPlan, str]:
    """The plan with the column sums kept apart (``RowKey.apart``), where the kernel cannot sum them for ``why``;
    ``why`` where the group's caller sums them its own way (:data:`SUMS_IN_KERNEL_ONLY`)."""
    if spec.key in SUMS_IN_KERNEL_ONLY:
        return why + " (a column kernel sums them)"
    return plan(spec, args, target, apart=True)
