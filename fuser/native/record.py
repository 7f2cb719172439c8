"""A prepared launch for the native hot path, written as the flat integer record ``hotpath.cpp`` reads.

From what a Python call just did (the executor's geometry for the inputs' signature, and the outputs it
returned), the record holds: the signature to match (per tensor: dtype, device, sizes, strides), the outputs to
allocate (dtype, sizes, strides: the Python path's own), the float arguments' limits, and the launch: the CPU
kernel's function, its sizes/strides arrays and whether it draws random numbers, or the CUDA function, grids,
context and the by-value argument struct's bytes with the offsets of what changes per call, then the buffers a
launch allocates (a row kernel's column sums' partial rows, a column kernel's workspace) and the kernels launched
after the first on the same arguments (the column sums' second kernel, a column kernel's stage 1), and whether it
draws random numbers (its launch state is then drawn per call from torch's generator, as ``rng.launch_state``
draws it). A cat's result is allocated whole and written through one pointer per piece (its slices, a fixed number
of bytes apart). A signature this path must not take (a group that falls back) gets a record of kind "python", so
the hot path hands it over without asking again.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from .. import rng

KIND_CPU, KIND_CUDA, KIND_PYTHON = 0, 1, 2
PYTHON = [KIND_PYTHON]

_codes: dict = {}


def scalar_type(dtype: torch.dtype) -> int:
    """c10::ScalarType's number of ``dtype`` (asked of the library once per dtype)."""
    code = _codes.get(dtype)
    if code is None:
        code = _codes[dtype] = int(torch.ops.fuser._native_scalar_type(dtype))
    return code


def _device(d: torch.device) -> tuple[int, int]:
    return (0 if d.type == "cpu" else 1), (-1 if d.index is None else d.index)


def signature(tensors: Sequence[torch.Tensor], n_scalars: int) -> list[int]:
    """[tensors, scalars, then per tensor: dtype, device type, device index, dim, sizes, strides]."""
    out = [len(tensors), n_scalars]
    for t in tensors:
        dev_type, dev_index = _device(t.device)
        out += [scalar_type(t.dtype), dev_type, dev_index, t.dim(), *t.shape, *t.stride()]
    return out


def launch_record(geo, tensors: Sequence[torch.Tensor], scalars: Sequence[float],
                  outputs: Sequence[torch.Tensor]) -> Optional[tuple[list[int], list[float], object]]:
    """(record, floats, what must stay alive while it is used) for an ``executor.Geometry``, or None where the hot
    path must hand such calls over."""
    kernel = getattr(geo, "kernel", None)
    rows = hasattr(geo, "rows")  # a row kernel's geometry (fuser.rows.RowGeometry)
    cols = hasattr(geo, "red")  # a column kernel's (fuser.rows.OuterGeometry; on the CPU, a row kernel's ABI)
    if kernel is None or not getattr(geo, "hot_path", True) or \
            len(outputs) != len(kernel.out_dtypes):  # hot_path False: a column kernel of no work
        return None
    device = geo.device
    if device.type not in ("cpu", "cuda") or any(t.device != device for t in (*tensors, *outputs)):
        return None
    rec = [KIND_CPU if device.type == "cpu" else KIND_CUDA, geo.red if cols else geo.rows if rows else geo.numel,
           len(outputs)]
    concat = None if rows or cols else geo.concat
    kernel_outputs = []  # a cat's result is written as one slice per piece: m pointers, step bytes apart
    for o, info in zip(outputs, concat or [None] * len(outputs)):
        m, step = (1, 0) if info is None else (info[2], info[3] * o.stride(info[1]) * o.element_size())
        rec += [scalar_type(o.dtype), o.dim(), *o.shape, *o.stride(), m, step]
        kernel_outputs += [o] if info is None else [o.narrow(info[1], j * info[3], info[3]) for j in range(m)]
    limits = kernel.scalar_limits or ()
    rec.append(len(limits))
    floats: list[float] = []
    for j, lo, hi, nonfinite in limits:
        rec += [j, int(bool(nonfinite))]
        floats += [float(lo), float(hi)]
    backend = kernel.backend
    if device.type == "cpu":
        fn = ctypes.cast(backend._fn, ctypes.c_void_p).value
        flat = [x for st in geo.strides for x in st]
        # a row kernel: rank is the row dims', sizes are those dims and the row length
        lead = geo.lead if rows else geo.col_sizes if cols else None  # (a column kernel: the column dims)
        sizes = [*lead, geo.cols] if lead is not None else list(geo.sizes)
        # a random kernel (not under autograd: offer() keeps those in Python, whose backward replays the state)
        # gets its launch state drawn per call by hotpath.cpp
        rec += [fn, len(lead) if lead is not None else len(sizes), len(sizes), *sizes, len(flat), *flat,
                _state_slots(getattr(kernel, "random", False))]
        return rec, floats, backend
    from ..cuda import launch as cuda_launch
    if rows or cols:
        return _row_or_column_cuda(geo, rows, tensors, scalars, outputs, rec, floats)
    loc = cuda_launch.LaunchArgs(backend._struct, backend.vec_align)
    loc.fill(geo, tensors, scalars, kernel_outputs)
    struct = type(loc.args)
    raw = ctypes.string_at(ctypes.addressof(loc.args), ctypes.sizeof(loc.args))
    ctx = cuda_launch.primary_context_handle(backend.device_index)
    rec += [backend._function_ptr, cuda_launch.BLOCK_SIZE, 0, backend.grid(geo, True), backend.grid(geo, False),
            int(bool(geo.vec_shape)), ctx, struct.ptrs.offset, struct.vec.offset, struct.scalars.offset,
            len(backend.vec_align), *backend.vec_align, len(raw), *raw]
    # a random kernel (not under autograd, as on the CPU) gets its launch state drawn per call by hotpath.cpp from
    # torch's CUDA generator, which advances as rng.launch_state advances it; while the stream captures a graph,
    # the call goes to Python, which falls back
    rec += _cuda_tail(FORM_PLAIN, [], [], random=bool(getattr(kernel, "random", False)))
    return rec, floats, backend


# a CUDA record's vector field: 0 no vectors, 1 vectors where the pointers are aligned, VECTORS_ONLY the kernel
# takes nothing else (fuser.rows.plan.RowKey.steps, fuser.rows.outer.OuterKey.vectors): hotpath.cpp hands a call
# whose pointers are not aligned to Python, which launches the plan's other kernel (fuser.rows.launch.AnyLaunch)
VECTORS_ONLY = 2
FORM_PLAIN, FORM_ROW_SUMS, FORM_COLUMNS = 0, 1, 2  # a CUDA launch: one kernel, a row kernel with column sums, a
# column kernel (hotpath.cpp counts the last two)


class _Null:
    """A pointer filled per call (a buffer the hot path allocates): 0 in the recorded argument bytes."""

    @staticmethod
    def data_ptr() -> int:
        return 0


def _row_or_column_cuda(geo, rows: bool, tensors, scalars, outputs, rec: list, floats: list) -> tuple:
    """The CUDA launch of a row kernel (with column sums: the row kernel on one wave of blocks writing partial rows
    into buffers allocated per call, then the second kernel adding them) or of a column kernel (stage 0, and where
    the columns are split, stage 1 combining the workspace's partial results)."""
    from ..cuda import launch as cuda_launch
    backend = geo.kernel.backend
    n_ptrs = len(tensors) + len(outputs)
    if rows:
        from ..rows import launch as row_launch
        kernel, struct = backend.kernel, backend.struct
        temps, then, form, slots = [], [], FORM_PLAIN, 0
        grid, smem = backend.grid(geo), backend.smem(geo)  # (a staged row kernel's shared memory)
        if backend.sums:  # (slots and the grid follow from the rows: fixed per signature)
            grid, slots, dtypes = backend.parts(geo)
            temps = [(scalar_type(dt), slots * geo.cols) for dt in dtypes]
            then = [(backend.second._function_ptr, row_launch.parts_grid(geo.cols), row_launch.PARTS_BLOCK, -1, 0)]
            form = FORM_ROW_SUMS
        args = row_launch.fill_args(struct, geo.rows, geo.cols, geo.lead, geo.strides, tensors, scalars, outputs,
                                    parts=(_Null,) * len(temps), slots=slots)
        block, vec_shape, align = backend.block, bool(geo.vec_ok), tuple(geo.vec_align)
        if backend.any_launch is not None:  # a vectors-only kernel: a launch without vectors is Python's
            vec_shape = VECTORS_ONLY
    else:
        from ..rows import outer_launch
        kernel, struct = backend.kernel, backend.struct
        g = backend.grid_for(geo)
        grid, block, vec_shape, form, smem = g.grid0, cuda_launch.BLOCK_SIZE, geo.cvec > 1, FORM_COLUMNS, 0
        if backend.any_launch is not None:  # a whole-vector kernel: a launch without vectors is Python's
            vec_shape = VECTORS_ONLY
        temps = [(scalar_type(torch.float64), g.workspace)]  # (none: a null pointer)
        then = [(kernel._function_ptr, g.grid1, block, struct.stage.offset, 1)] if g.grid1 else []
        args = outer_launch.fill_args(struct, geo, g, 0, tensors, scalars, outputs, 0)
        align = tuple(geo.vec_align) or (0,) * n_ptrs
    if len(align) != n_ptrs:
        return None
    raw = ctypes.string_at(ctypes.addressof(args), ctypes.sizeof(args))
    rec += [kernel._function_ptr, block, smem, grid, grid, int(vec_shape),
            cuda_launch.primary_context_handle(kernel.device_index), struct.ptrs.offset, struct.vec.offset,
            struct.scalars.offset, len(align), *align, len(raw), *raw]
    rec += _cuda_tail(form, temps, then)
    return rec, floats, backend


def _cuda_tail(form: int, temps: Sequence[tuple[int, int]], then: Sequence[tuple], random: bool = False) -> list[int]:
    """The end of a CUDA record: its form, the buffers allocated per call (dtype, elements; their pointers follow
    the outputs'), the kernels launched after the first with the same arguments (function, grid, block, and an
    int32 written first at an offset, -1: none), and the float slots of its launch state (:func:`_state_slots`)."""
    return [form, len(temps), *[x for t in temps for x in t], len(then), *[x for t in then for x in t],
            _state_slots(random)]


def _state_slots(random: bool) -> int:
    """A record's random flag: the float slots of a random kernel's launch state after its float arguments
    (rng.N_STATE; hotpath.cpp checks it against its own count), 0 where the kernel draws no random numbers."""
    return rng.N_STATE if random else 0


def train_record(spec, call, launch: Optional[tuple], outputs: Sequence[torch.Tensor],
                 tensors: Sequence[torch.Tensor]) -> tuple[list[int], str, list[str]]:
    """For a call autograd records (``autodiff.prepare_call``'s ``call``) on ``tensors``: (backward record, backward
    group's digest, the summing steps' digests) for ``hotpath.cpp``'s ``put_train``; the backward group is the one
    of the pattern where every differentiable output gets a gradient. Where an input's gradient is summed over the
    rows (``fuser/grad_sums.py``), the groups ``grad_sums.run`` would launch for these shapes are recorded beside it
    as steps, when kernels serve them all, for backwards that run without grad mode: a row backward's fused form
    (the sums inside its row kernel; on CUDA where ``settings.cuda_column_sums`` is on), or a backward's split (its
    main group, then the column groups); else Python's backward runs such calls."""
    from .. import autodiff, grad_sums
    n = len(spec.group.outputs)  # outputs: the kernel's, the forward's own then extra ones (call.save)
    diff = autodiff.differentiable_outputs(call, outputs[:n])
    saved = call.saved
    chunks = [autodiff.chunk_positions(spec, c) for c in call.chunks]
    if chunks:  # the Function saves the chunked tensors (last) for their chunks; here the chunks themselves are saved
        m = len(chunks)
        saved = list(saved[:-m])
        for pos, keep in zip(chunks, call.saved[-m:]):
            for k in pos:
                saved[k] = keep
    rec = [int(s) for s in saved] + [int(d) for d in diff] + [0] * (len(outputs) - n) + [
        int(k in call.saved_outputs) for k in range(len(outputs))]
    rec.append(n)
    rec.append(len(chunks))
    for c, pos in zip(call.chunks, chunks):
        rec += [c[0], len(pos), *pos]
    bw = autodiff.backward_for(spec, call.needs, diff, call.sig, False, call.chunks, call.save) \
        if launch is not None else None
    t_index = autodiff.tensor_index(spec)
    s_index = {j: k for k, j in enumerate(j for j, is_t in enumerate(spec.input_is_tensor) if not is_t)}
    inputs = []
    if bw is not None and bw.spec is not None and not spec.random:
        for j in bw.fwd_inputs:
            inputs.append((0, t_index[j]) if spec.input_is_tensor[j] else (1, s_index[j]))
        inputs += [(3, k) for k in bw.saved_outputs]  # (the softmax results it reads, as the forward wrote them)
        inputs += [(2, k) for k, piece in bw.grad_outputs if piece is None]
    # (a row group's backward may read its gradients as views with reduced dims restored, and the row length as a
    # float argument: Python's backward assembles those)
    usable = (bw is not None and bw.spec is not None and not spec.random and not any(bw.grad_unsqueeze or ())
              and not bw.row_length
              and all(piece is None for _, piece in bw.grad_outputs)
              and len(bw.cat_of) == len(chunks)  # (else Python's backward joins the chunks' gradients)
              and all(saved[i] for kind, i in inputs if kind == 0) and all(diff[i] for kind, i in inputs if kind == 2)
              and all(i in call.saved_outputs for kind, i in inputs if kind == 3))
    steps = None
    if usable:
        shapes = [t.shape for t in tensors]
        full = autodiff._full_shape(spec, tuple(shapes))
        if grad_sums.summed(spec, bw, shapes, full):
            steps = None if call.columns or bw.cat_of else _summing_steps(spec, bw, _backward_like(
                inputs, tensors, call.scalars, outputs), shapes, full, call.sig)
            usable = steps is not None
    if not usable:
        rec.append(0)
        return rec, "", []
    rec += [1, bw.spec.key, len(inputs), *[x for pair in inputs for x in pair],
            len(bw.grad_inputs), *[t_index[j] for j in bw.grad_inputs],
            len(bw.zero_inputs), *[t_index[j] for j in bw.zero_inputs],
            len(bw.aliases), *[x for j, k in bw.aliases for x in (t_index[j], k)]]
    if steps is None:
        rec.append(0)
        return rec, bw.spec.digest, []
    parts, takes = steps
    rec.append(len(parts))
    for part, kind, part_inputs in parts:
        rec += [part.key, kind, len(part.group.outputs), len(part_inputs), *[x for pair in part_inputs for x in pair]]
    rec += [len(takes), *[x for j, step, out in takes for x in (t_index[j], step, out)]]
    return rec, bw.spec.digest, [part.digest for part, _, _ in parts]


def _summing_steps(spec, bw, args: list, shapes, full, sig) -> Optional[tuple[list, list]]:
    """``grad_sums``' launches for a backward that sums inputs' gradients, as steps (group, kind: 0 a part, 1 a
    fused form, 2 a column group; inputs as (-1, backward argument) or (step, output)) and takes (forward input,
    step, output); None where Python's backward must decide per call."""
    from .. import grad_sums
    fused = grad_sums.fused_plan(spec, bw, args, shapes, full, sig)
    if fused is not None:
        fused_spec, takes = fused
        return [(fused_spec, 1, [(-1, p) for p in range(len(args))])], [(j, 0, out) for j, out in takes]
    return grad_sums.split_plan(spec, bw, args, shapes, full, sig)


def _backward_like(inputs: Sequence[tuple[int, int]], tensors: Sequence[torch.Tensor], scalars: Sequence[float],
                   outputs: Sequence[torch.Tensor]) -> list:
    """Arguments like the recorded backward's (``inputs``: its (kind, index) pairs), the output gradients as fresh
    tensors like the outputs (autograd's usual ones): what planning its kernels needs."""
    like = {}
    args = []
    for kind, i in inputs:
        if kind == 0:
            args.append(tensors[i])
        elif kind == 1:
            args.append(float(scalars[i]))
        elif kind == 3:
            args.append(outputs[i])
        else:
            if i not in like:
                o = outputs[i]
                like[i] = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
            args.append(like[i])
    return args


def backward_meta(call, tensors: Sequence[torch.Tensor]) -> list[int]:
    """What ``fusion_group_backward_py`` rebuilds a call from: per group input whether it needs a gradient, then
    per tensor input its dtype, dim and sizes, then ``call.chunks`` (each: its dim and group inputs), then
    ``call.save`` (the forward values its backward reads saved)."""
    meta = [len(call.needs), *[int(n) for n in call.needs], len(tensors)]
    for t in tensors:
        meta += [scalar_type(t.dtype), t.dim(), *t.shape]
    meta.append(len(call.chunks))
    for dim, pieces in call.chunks:
        meta += [dim, len(pieces), *pieces]
    meta += [len(call.save), *call.save]
    return meta


def parse_backward_meta(meta: Sequence[int]) -> tuple[tuple, list, tuple, tuple]:
    """(needs, per tensor input (dtype, shape), chunks, save) from :func:`backward_meta`'s list."""
    dtypes = {code: dt for dt, code in _codes.items()}
    n = meta[0]
    needs = tuple(bool(x) for x in meta[1:1 + n])
    i = 1 + n
    count = meta[i]
    i += 1
    tensors = []
    for _ in range(count):
        code, dim = meta[i], meta[i + 1]
        tensors.append((dtypes[code], torch.Size(meta[i + 2:i + 2 + dim])))
        i += 2 + dim
    chunks = []
    for _ in range(meta[i]):
        chunks.append((meta[i + 1], tuple(meta[i + 3:i + 3 + meta[i + 2]])))
        i += 2 + meta[i + 2]
    i += 1
    return needs, tensors, tuple(chunks), tuple(meta[i + 1:i + 1 + meta[i]])
