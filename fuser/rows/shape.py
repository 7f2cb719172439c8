"""How a CUDA row kernel lays a row over threads: its :class:`CudaShape` (the threads a row, the elements a thread
and their vectors; the row held in registers, by the CTAs of a cluster, or read again by each pass, its inputs
staged in shared memory or not; column sums in registers or in shared memory), chosen from the row length, the
tensors' element sizes and the group's passes (``passes.py``), and the shared memory a launch of it takes. The plan
(``plan.py``) asks it for a row's shape, ``launch.py`` for a launch's shared memory, and the torch.compile door's
partition whether a row kernel sums its columns itself (:func:`cuda_sums_in_kernel`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from .. import ir, settings
from .passes import column_sum_form, needed, pass_width, row_passes


REGISTER_ITEMS = 32  # 32-bit registers a CUDA thread gives to the row elements it holds
MAX_TPR = 1024  # CUDA threads a row at most (a block's)
MIN_TPR = 4
# A CUDA row kernel with column sums (a norm's backward summing its weight's and bias's gradients) runs on one wave
# of blocks that grid-stride over the rows, so its rows overlap only across the blocks an SM holds: it takes fewer
# threads a row (at most SUMS_MAX_TPR) and more registers a thread (SUMS_REGISTER_ITEMS row values), so that the row
# is held (x and dy read once) and several blocks share an SM. H100, 16384 x 4096 float32, layer_norm(x) * w + b
# backward kernel, 639 us with the defaults (1024 threads a row, the row read again by each pass), 498 us with 64
# values a thread (512 threads, held), 368 us with these (256 threads, 16 values); bfloat16 315 -> 260 us; rms_norm
# and rows of 512 the same or faster (torch.profiler kernel times, one process per setting, same run)
# Fewer elements a thread (more threads a row) were slower where these hold a row of 512 or 4096 in 32 elements a
# thread: H200, 2026-12-02, training steps, two rounds alternating, fuser alone, 32 / 16 / 8 elements a thread:
# layer_norm(x) * w + b over rows of 512 bfloat16 188-189 / 192-193 / 210-215 us, float32 350-356 / 359-361 /
# 368-374; rows of 4096 bfloat16 201-202 / 210-216 / 224-231; rms_norm(x) * w, rows of 512 bfloat16 180-183 /
# 185-186 / 185-187, rows of 4096 184-185 / 184-195 / 199-207. With 16-byte vectors of the rows as well (the saved
# float32 statistics not narrowing them): slower still at 8 elements; at 16, from as fast as 32 (rms_norm, rows of
# 512: 181-182 us) to 40 us slower (layer_norm, rows of 4096: 241-243 us)
SUMS_REGISTER_ITEMS = 128
SUMS_MAX_TPR = 256
# a held row's column sums go to shared memory (a thread's own slots, no barrier) where a block's take at most this
# many bytes (static shared memory: 48 KB a block with the reductions' few words): the registers they took hold more
# of the row, so more rows are in flight an SM
SUMS_SHARED_BYTES = 40 * 1024
# A row of several trips sums its columns in dynamic shared memory: a slot per column of the block's row (one row a
# block), beside the inputs it stages, where both fit the device's limit a block. The row's passes read x and dy
# once for the row's reductions and the sums where a column kernel of their own read them again: rows of 16384
# bfloat16 elements, layer_norm(x) * w + b's backward moved 1.40x the step's floor with that column kernel (bytes
# counted from its plans). Off: such sums kept apart (a column kernel sums them)
TRIP_SUMS = True
# Such a row's vectors are those of its tensors read an element at a time: an input read once a row (a norm's saved
# float32 mean and rstd beside bfloat16 rows) does not narrow them. ncu, H200, layer_norm(x) * w + b's backward over
# rows of 16384 bfloat16 (its sums' 8 floats a vector in 16-byte chunks, rows.codegen.sum_slots.trip_slot_chunk): 8
# elements a trip in 16-byte vectors 102.9M instructions, 198 us, against 4 in 8-byte vectors (the float32 inputs' 16
# bytes) 109.9M, 210 us. Held rows keep the narrower vectors: planned so, the bfloat16 training steps of rows of 4096
# went from 0.79 to 0.67-0.68 of the copy floor (layer_norm) and 0.87 to 0.81-0.83 (rms_norm) (H200, 2026-12-01, two
# rounds alternating; rows of 512 within 0.02)
TRIP_SUMS_ELEMENT_VECTORS = True


@dataclass(frozen=True)
class CudaShape:
    """How a CUDA row kernel lays a row over threads: ``tpr`` consecutive threads share a row (a power of two), a
    block of ``block`` threads holds ``block // tpr`` rows, a thread takes ``items`` elements a trip along the row
    in vectors of ``vec`` elements (16 bytes of the widest tensor; of a trip-sums row, of the widest it reads or
    writes an element at a time: :data:`TRIP_SUMS_ELEMENT_VECTORS`). ``held``: the row takes one trip, so the
    inputs that several passes read are loaded once and kept in registers; otherwise each pass reads them again.
    ``full``: the row length is a whole number of trips (``tpr * items`` elements), so no element of a trip is past
    the row's end and the kernel checks none (the row length is part of the kernel's key through its shape).
    ``cluster``: the CTAs of a thread block cluster (sm_90) that share a row too long for one block's registers;
    each holds a segment of ``tpr * items`` consecutive columns (the last may be short, never empty), and the row's
    reductions combine the CTAs' results through distributed shared memory (:func:`cluster_shape`).
    ``uncapped``: the launch takes a block per ``block // tpr`` rows however many that is, rather than at most
    ``launch.ROW_WAVES`` waves of resident blocks grid-striding over the rows (:data:`HELD_BYTES`).
    ``compensated``: a thread adds more than :data:`COMPENSATED_PER_THREAD` of a row's elements, so its float sums
    carry their rounding error along (Kahan) rather than lose it. ``staged``: a row read again by each pass keeps
    these tensor inputs (positions among the tensor inputs) in shared memory: copied there at each row's start
    (asynchronous copies, all in flight at once), and read back by every pass (:func:`staged_inputs`)."""

    tpr: int
    items: int
    vec: int
    held: bool
    full: bool = False
    cluster: int = 1
    uncapped: bool = False
    compensated: bool = False
    staged: tuple[int, ...] = ()
    sums_shared: bool = False  # column sums: a thread's partial sums in shared memory rather than registers

    @property
    def trip_sums(self) -> bool:
        """Column sums of a row of several trips (one row a block): a slot per column in dynamic shared memory
        (:func:`trip_sums_bytes`), a thread adding its own columns of each trip."""
        return self.sums_shared and not self.held

    @property
    def block(self) -> int:
        return max(self.tpr, 128)

    @property
    def min_blocks(self) -> int:
        """The blocks an SM that the kernel's launch bounds ask for: 2 for a row held by 512 threads (64 registers
        a thread; it may spill a little). H200, [16384 x 16384] layer_norm(x) * w + b in bfloat16, two runs: 76
        registers, one block an SM, 0.52 / 0.51 of the copy floor; asking for two, 0.70 / 0.70. Softmax, rms_norm
        and float32 rows of 16384, and rows of 4096, within the runs' noise (0.02-0.04). Asking every held row for
        1024 threads an SM made bias + residual + layer_norm fall from 0.98 to 0.58. A cluster's segments that are
        not all whole (a row of 65537 elements) ask for one: their checks spilled 250-1250 bytes a thread at 64
        registers (ptxas, sm_90)."""
        return 2 if self.held and self.block == 512 and (self.cluster == 1 or self.full) else 1


_CLUSTER_DEVICES: dict = {}


def _clusters(device: torch.device) -> bool:
    """Whether row kernels for ``device`` may be cluster kernels (``CudaShape.cluster``): a CUDA device of compute
    capability 9.0 or later that has not refused one (``settings.cuda_no_clusters``), or the host emulation's CPU
    (``settings.cuda_clusters`` off: none)."""
    if not settings.cuda_clusters:
        return False
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in settings.cuda_no_clusters:
        return False
    got = _CLUSTER_DEVICES.get(index)
    if got is None:
        got = _CLUSTER_DEVICES[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return got


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def register_items(block: int, wide: bool, cap: int = REGISTER_ITEMS) -> int:
    """Row elements a CUDA thread may keep in registers at once in a block of ``block`` threads: what the register
    file leaves each thread (64K registers a block's share, 255 at most) less about 40 for the rest of the
    kernel, at most 32; halved for 8-byte values. (H100, one run each: 32 elements a thread in 128-thread blocks
    took 128-168 registers without spilling; launch bounds asking for 768 or 1024 resident threads an SM made
    softmax faster and layer_norm slower, through spills: the kernel leaves the registers to the compiler.)"""
    regs = min(255, 65536 // block) - 40
    return max(4, min(cap, 1 << (regs.bit_length() - 1))) // (2 if wide else 1)


# a held row (no column sums) whose tensors have 4 bytes an element or more: more threads a row while a thread would
# hold more than HELD_BYTES bytes of the widest tensor and the row's threads stay at most HELD_MAX_TPR, and a block
# per row (CudaShape.uncapped). H200, torch.profiler kernel time per call, [16384 x 4096] float32, this / 128 threads
# of 32 elements in 8 waves / that shape uncapped (Inductor): layer_norm(x) * w + b 130.3 / 135.2 / 132.8 us (127.2),
# softmax 130.7 / 132.9 / 132.3 (134.3), bias + residual + layer_norm 188.0 / 192.1 / 190.3 (199.9), rms_norm 131.7 /
# 132.4 / 131.2 (126.1); the training steps of layer_norm and softmax 391.8 -> 387.7 and 322.6 -> 318.2 us; rows of
# 512 within 1.2%. 256 threads in 8 waves: no faster than before. In bfloat16 (64 bytes a thread already) a block a
# row was slower: softmax 71.9 -> 76.2 us, rows of 512 68.4 -> 71.7
HELD_BYTES = 64
HELD_MAX_TPR = 256

# the most values (elements x pass width) a thread's trip along a row read again may hold when its elements are
# doubled (cuda_shape's trip_factor): ptxas for sm_90 at 64 registers, rows of 16384 and 65536 bfloat16 elements,
# 16 elements a thread: layer_norm(x) (width 3, 48 values) spilled 8 bytes a thread, layer_norm(x + residual)
# (width 4, 64 values) 176 bytes, and 8 elements a thread none
TRIP_VALUES = 48

# a row read again whose threads each add more than this many of its elements sums them compensated
# (CudaShape.compensated): a float sum's rounding error grows with the additions a thread makes in a row (the tree
# across the block's threads adds ten levels at most), and a thread of a 1024-thread row adds cols / 1024. The CUDA
# fuzzer (H200, 2026-11-28) found a float32 sum over one row of 3,006,704 equal values 3e-5 from eager and the
# float64 truth (2,936 additions a thread); eager spreads such a row over many blocks. Rows of up to 262,144 elements
# (256 a thread: at most 256 * 2**-24 = 1.5e-5 relative even for equal values, below the fuzzer's 2e-5 for float32)
# keep the plain sum, and the benchmark's rows (65,536 at most) with it
COMPENSATED_PER_THREAD = 256


def cuda_shape(cols: int, sizes: Sequence[int], width: int, first_loads: int = 0, cap: int = REGISTER_ITEMS,
               max_tpr: int = MAX_TPR, trip_factor: int = 2) -> CudaShape:
    """The :class:`CudaShape` for rows of ``cols`` elements; ``sizes``: the element sizes of the tensor inputs and
    outputs; ``width``: the most row values a pass holds per element (``pass_width``), ``first_loads``: the inputs
    the first pass loads, all before it computes (counted where a block's registers are few: 512 threads or
    more): a thread's ``items`` elements of each must fit :func:`register_items`.

    Held where some shape fits: the fewest threads a row whose elements fit, with 16-byte vectors, else 8-byte
    ones (a wide group of 2-byte values: half the elements a thread at least); for tensors of 4 bytes or more,
    without column sums, then more threads while a thread holds more than :data:`HELD_BYTES` bytes (at most
    :data:`HELD_MAX_TPR` threads), launched a block per row (``CudaShape.uncapped``). Otherwise the row is read again by
    each pass, in trips of ``trip_factor`` times the elements the register estimate gives a thread (1 for column
    sums, which hold a register per element of a trip for each sum), while such a trip's values (elements x
    ``width``) stay within :data:`TRIP_VALUES`. Never more threads a row than its vectors (a
    row of 512 bfloat16 elements gets no 1024 threads, half of them idle: H100, a layer_norm backward took 30 ms
    that way)."""
    widest = max(sizes, default=4)
    width = max(1, width)
    wide = widest == 8
    vec16 = max(1, 16 // widest)
    for vec in (vec16, vec16 // 2) if vec16 >= 4 else (vec16,):
        top = min(max_tpr, max(MIN_TPR, _pow2_at_least(-(-cols // vec))))
        tpr = MIN_TPR
        while tpr <= top:
            items = max(vec, _pow2_at_least(-(-cols // tpr)))
            need = items * max(width, first_loads if max(tpr, 128) >= 512 else 0)
            if tpr * items >= cols and need <= register_items(max(tpr, 128), wide, cap):
                uncapped = False
                if HELD_BYTES and cap == REGISTER_ITEMS and widest >= 4:  # (no column sums: HELD_BYTES)
                    while (items * widest > HELD_BYTES and items // 2 >= vec and tpr * 2 <= min(top, HELD_MAX_TPR)):
                        tpr, items = tpr * 2, items // 2
                    uncapped = True
                return CudaShape(tpr, items, vec, True, cols == tpr * items, uncapped=uncapped)
            tpr *= 2
    # trip_factor 2, twice the register estimate: a trip's loads are all that a pass of a row read again keeps, and
    # more of them in flight is what a long row's kernel lacks (H200, one run, fraction of the copy floor, rows of
    # 65536: layer_norm(x) * w + b float32 0.47 -> 0.57, bfloat16 0.42 -> 0.49; softmax 0.60 -> 0.63 and 0.49 ->
    # 0.46; 50 registers a thread at most before, 64 after, one with 8 bytes spilled)
    per = register_items(MAX_TPR, wide) // width
    base = max(vec16, 1 << (max(1, per).bit_length() - 1))
    if trip_factor * base * width > TRIP_VALUES:
        trip_factor = 1
    items = trip_factor * base
    tpr = min(MAX_TPR, max(MIN_TPR, _pow2_at_least(-(-cols // items))))
    return CudaShape(tpr, items, vec16, False, cols > 0 and cols % (tpr * items) == 0,
                     compensated=cols > COMPENSATED_PER_THREAD * tpr)


MAX_CLUSTER = 8  # CTAs a cluster (the portable limit)
# a cluster row's CTAs hold at least this many threads each: a block is one row (CUDA_KERNEL's cluster loop)
CLUSTER_MIN_TPR = 128
# clusters only for rows whose tensors all have at least this many bytes an element: in bfloat16 a cluster was slower
# than reading the row again (H200, r64k rows: see README, "Where fuser is behind"), with the vectors-only kernels too
# (2 / 4, fraction of the copy floor, two rounds: softmax 0.39 / 0.50, layer_norm 0.40 / 0.56, rms_norm 0.46 / 0.72,
# softmax's training step 0.44 / 0.62-0.64; docs/bench_h200_bf16_clusters_ab_s18.json)
CLUSTER_MIN_BYTES = 4


def cluster_shape(cols: int, sizes: Sequence[int], width: int, first_loads: int = 0) -> Optional[CudaShape]:
    """A row too long for one block's registers, held by the CTAs of a cluster (sm_90): the fewest CTAs (at most
    :data:`MAX_CLUSTER`) whose segments of the row (``cuda_shape`` of ``cols / n`` columns, held, at least
    :data:`CLUSTER_MIN_TPR` threads) cover it, or None. So a row is read once where it was read again by each
    pass (softmax and layer_norm: two reads and a write where one read and a write is the floor).

    The plan takes it for groups whose tensors are all of 4 bytes or more. H200, rows of 65536, fraction of the
    copy floor with clusters / without (one run, fuser alone, the two alternating): float32 softmax 0.73 / 0.62,
    layer_norm(x) * w + b 0.68 / 0.57, rms_norm 0.80 / 0.71, softmax's training step 0.83 / 0.61; bfloat16 0.38 /
    0.47, 0.36 / 0.50, 0.45 / 0.67, 0.41 / 0.56: a held bfloat16 element takes a 32-bit register as a float32 one
    does, so an SM holds half the bytes in flight, and the row's latency chain (loads, the reductions' barriers,
    the stores) is no shorter."""
    for n in range(2, MAX_CLUSTER + 1):
        seg = -(-cols // n)
        sh = cuda_shape(seg, sizes, width, first_loads)
        if not sh.held or sh.tpr < CLUSTER_MIN_TPR:
            continue
        span = sh.tpr * sh.items
        n = -(-cols // span)
        return CudaShape(sh.tpr, sh.items, sh.vec, True, cols == n * span, n)
    return None


# a row read again (CudaShape.held False, no cluster) keeps the inputs that several of its passes read, and that
# differ from row to row, in shared memory while they fit (STAGE_RESERVE bytes left for the kernel's own arrays)
STAGE_RESERVE = 1024
STAGE_EMULATED_BYTES = 232448  # the host emulation plans for an H100/H200's shared memory a block (opt-in)
_STAGE_DEVICES: dict = {}


def stage_limit(device: torch.device) -> int:
    """Bytes of shared memory a block of a staged row kernel may take (``CudaShape.staged``): :func:`shared_limit`;
    0 where staging is off (``settings.cuda_staged_rows``)."""
    return shared_limit(device) if settings.cuda_staged_rows else 0


def shared_limit(device: torch.device) -> int:
    """Bytes of dynamic shared memory a block of a row kernel may take (staged rows, trip sums): the device's opt-in
    limit a block less :data:`STAGE_RESERVE` (the host emulation's: an H100/H200's)."""
    if device.type != "cuda":
        return STAGE_EMULATED_BYTES - STAGE_RESERVE
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _STAGE_DEVICES.get(index)
    if got is None:
        props = torch.cuda.get_device_properties(index)
        got = _STAGE_DEVICES[index] = max(0, getattr(props, "shared_memory_per_block_optin", 0) - STAGE_RESERVE)
    return got


def stage_row_bytes(cols: int, sizes: Sequence[int]) -> int:
    """Shared memory of one row of a staged row kernel: a row of each staged input (element sizes ``sizes``), each
    rounded up to 16 bytes (the kernel lays them out so: ``templates.CUDA_STAGE``)."""
    return sum(-(-cols * s // 16) * 16 for s in sizes)


def stage_bytes(shape: CudaShape, cols: int, sizes: Sequence[int], sum_sizes: Sequence[int] = ()) -> int:
    """The dynamic shared memory of a launch of a row kernel: a staged row per row of its block (``sizes``: the
    staged inputs' element sizes), then a row of trip sums' slots (:func:`trip_sums_bytes`; ``sum_sizes``: their
    accumulators' sizes)."""
    staged = (shape.block // shape.tpr) * stage_row_bytes(cols, sizes) if shape.staged else 0
    return staged + trip_sums_bytes(shape, cols, sum_sizes)


def sum_sizes(out_dtypes: Sequence[torch.dtype], sums: Sequence[int]) -> tuple:
    """The element sizes of the column sums' accumulators (their partial rows' dtype) of outputs ``sums``: double
    for float64 sums, else float."""
    return tuple(8 if out_dtypes[m] == torch.float64 else 4 for m in sums)


def trip_sums_bytes(shape: CudaShape, cols: int, sum_sizes: Sequence[int]) -> int:
    """The shared memory of a row of several trips' column sums (``CudaShape.trip_sums``): a slot per column of the
    row's whole trips for each sum (``sum_sizes``: their accumulators' sizes, 4 or 8), one after the other."""
    if not shape.trip_sums:
        return 0
    trip = shape.tpr * shape.items
    return sum(-(-cols // trip) * trip * s for s in sum_sizes)


# Staged rows are one CTA's: the CTAs of a cluster sharing a staged row (a segment of at most 64 KB each, 512 threads
# a CTA, so that an SM holds three) were slower on an H200 (2026-11-29, fuser alone, staging on / off alternating,
# two rounds, fraction of the copy floor): softmax(x * 0.125) over rows of 65536 bfloat16 0.42-0.43 against 0.48-0.49
# read again, layer_norm(x) * w + b 0.40 against 0.55-0.56 (0.64-0.65 staged by one CTA), float32 rows of 65536
# 0.61-0.73 against 0.71-0.84 held in registers by a cluster. Nor does a held row fetch its next row ahead: each
# thread copying its vectors of the next row into shared memory (fz_row_fetch) once it had read this row's from
# there, one wave of blocks looping over the rows, was slower on an H200 (2026-12-02, fuser alone, two rounds,
# without / with): float32 rows of 65536 held by clusters, softmax(x * 0.125) 166-168 / 198-202 us, layer_norm(x) *
# w + b 171-174 / 185-186, rms_norm(x) * w 154-156 / 177-178, softmax's training step 382-385 / 465-477; bfloat16
# rows of 16384 held by a block of 512 threads 69-77 / 76-79; bfloat16 rows of 65536 held by clusters that way
# (read again now: 79-92 us) 96-117
def staged_shape(group: ir.Group, shape: CudaShape, cols: int, sizes: Sequence[int], strides: Sequence,
                 limit: int) -> Optional[CudaShape]:
    """``shape`` (a row read again) keeping in shared memory the inputs :func:`staged_inputs` picks, or None where
    it picks none. ``sizes``: the tensor inputs' element sizes; ``strides``: theirs (over the row dims, then along the
    row)."""
    staged = staged_inputs(group, shape, cols, sizes, strides, limit)
    return replace(shape, staged=staged) if staged else None


def staged_inputs(group: ir.Group, shape: CudaShape, cols: int, sizes: Sequence[int], strides: Sequence,
                  limit: int) -> tuple[int, ...]:
    """The tensor inputs (positions) a row read again keeps in shared memory (``CudaShape.staged``): those that two
    passes or more read (:func:`row_passes`), that step by 1 along the row (a vectors-only kernel's) and differ
    from row to row (a weight broadcast over the rows stays in the caches), the most-read first while a block's
    rows of them fit ``limit`` bytes. ``sizes``: the tensor inputs' element sizes; ``strides``: theirs over the
    row dims, then along the row."""
    if shape.held or shape.cluster > 1 or limit <= 0:
        return ()
    passes = row_passes(group, merge=True)
    tensor_inputs = [v for v in group.inputs if v.is_tensor]
    reads = []
    for k, v in enumerate(tensor_inputs):
        st = strides[k]
        if st[-1] != 1 or not any(st[:-1]):
            continue
        n = sum(v.id in needed(group, w) for w in passes)
        if n >= 2:
            reads.append((-n, k))
    chosen: list[int] = []
    rpb = shape.block // shape.tpr
    for _, k in sorted(reads):
        if rpb * stage_row_bytes(cols, [sizes[j] for j in (*chosen, k)]) <= limit:
            chosen.append(k)
    return tuple(sorted(chosen))


def _cuda_row_shape(group: ir.Group, cols: int, sizes: Sequence[int], n_sums: int, held: bool = True,
                    sums_shared: bool = False) -> CudaShape:
    """The CUDA row kernel's shape for ``group`` (a column sum form's, with ``n_sums`` column sums) over rows of
    ``cols`` elements, ``sizes`` the inputs' and outputs' element sizes: the row held, or (``held`` False) each pass
    loading what it reads. ``sums_shared``: the held row's column sums take no registers (shared memory)."""
    if not held:
        return cuda_shape(cols, sizes, pass_width(group, False)[0] + n_sums, trip_factor=1 if n_sums else 2)
    width, first = pass_width(group, True)
    return cuda_shape(cols, sizes, width + (0 if sums_shared else n_sums), first,  # (a sum's registers: a value's)
                      *((SUMS_REGISTER_ITEMS, SUMS_MAX_TPR) if n_sums else ()))


def cuda_sums_in_kernel(group: ir.Group, sums: tuple[int, ...], cols: int, sizes: Sequence[int],
                        device: torch.device) -> bool:
    """Whether a CUDA row kernel of ``group`` (its composite ops' steps) sums its outputs ``sums`` (column sums) in
    the kernel over rows of ``cols`` elements on ``device`` (a row of one trip, or of several whose sums fit its
    shared memory), rather than writing them whole for eager's sum (``RowKey.apart``). ``sizes``: the element
    sizes of the tensor inputs and outputs. For a caller choosing between the column sums and a column kernel of
    their own before any call (the torch.compile door's partition)."""
    sh = _cuda_sums_shape(column_sum_form(group, sums), cols, sizes, len(sums), shared_limit(device))
    return cols <= sh.tpr * sh.items or sh.trip_sums


def _cuda_sums_shape(form: ir.Group, cols: int, sizes: Sequence[int], n_sums: int, limit: int = 0,
                     stage: Optional[Callable] = None, sum_sizes: Sequence[int] = (),
                     element_sizes: Optional[Sequence[int]] = None) -> CudaShape:
    """The CUDA shape of a row kernel with ``n_sums`` column sums (``form``: the column sum form): the row held, its
    sums in shared memory where a block's fit :data:`SUMS_SHARED_BYTES` (double sums where a tensor has 8-byte
    elements), else in registers; else each pass loading what it reads, and where the row takes several trips
    (``cols > tpr * items``), one row a block, its sums in dynamic shared memory where they fit ``limit`` bytes
    (``CudaShape.trip_sums``; ``sum_sizes``: the sums' accumulators' sizes, else 8 bytes each where a tensor has
    8-byte elements), with the inputs ``stage(shape, bytes left)`` stages (a shape or None). Such trips take their
    vectors from ``element_sizes`` where given (:data:`TRIP_SUMS_ELEMENT_VECTORS`: the sizes less those of inputs
    read once a row; the caller gives them only where the row takes such vectors), else from ``sizes`` where the
    former's shape takes one trip, more than one row a block, or sums that do not fit. A row of several trips
    without them is not summed in the kernel."""
    sum_bytes = 8 if max(sizes, default=4) >= 8 else 4
    if SUMS_SHARED_BYTES:  # (a held row's sums: double where any tensor has 8-byte elements, an upper bound)
        sh = _cuda_row_shape(form, cols, sizes, n_sums, sums_shared=True)
        if sh.held and sh.block * sh.items * n_sums * sum_bytes <= SUMS_SHARED_BYTES:
            return replace(sh, sums_shared=True)
    sh = _cuda_row_shape(form, cols, sizes, n_sums)
    if sh.held:
        return sh
    sh = _cuda_row_shape(form, cols, sizes, n_sums, held=False)
    shapes = [sh]
    if TRIP_SUMS_ELEMENT_VECTORS and element_sizes and list(element_sizes) != list(sizes):
        shapes.insert(0, _cuda_row_shape(form, cols, element_sizes, n_sums, held=False))
    for cand in shapes:
        if cols <= cand.tpr * cand.items or not TRIP_SUMS or cand.block != cand.tpr:
            continue
        trips = replace(cand, sums_shared=True)
        need = trip_sums_bytes(trips, cols, sum_sizes or (sum_bytes,) * n_sums)
        if need <= limit:
            return (stage(trips, limit - need) if stage else None) or trips
    return sh
