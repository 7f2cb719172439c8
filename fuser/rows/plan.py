"""The row plan: a group with reductions viewed as [rows, cols], or the reason it must fall back.

Every value of the group is element-level (one per (row, col): the tensor inputs, and nodes that read one) or
row-level (one per row: a reduction's result, and nodes that read only row-level values). The group's shapes come
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
own: a column kernel that recomputes the summed values from the inputs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import codegen, executor, ir, ops, settings
from ..codegen import REDUCED
from ..descs import DTYPES
from ..fallback import evaluate
from ..kernel_cache import KernelSpec
from . import decompose

MAX_LEAD_DIMS = 8  # compressed row dims (the CUDA argument struct's arrays)
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
# rows of 16384 bfloat16 (its sums' 8 floats a vector in 16-byte chunks, rows.codegen.trip_slot_chunk): 8 elements a
# trip in 16-byte vectors 102.9M instructions, 198 us, against 4 in 8-byte vectors (the float32 inputs' 16 bytes)
# 109.9M, 210 us. Held rows keep the narrower vectors: planned so, the bfloat16 training steps of rows of 4096 went
# from 0.79 to 0.67-0.68 of the copy floor (layer_norm) and 0.87 to 0.81-0.83 (rms_norm) (H200, 2026-12-01, two
# rounds alternating; rows of 512 within 0.02)
TRIP_SUMS_ELEMENT_VECTORS = True
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
# 0.61-0.73 against 0.71-0.84 held in registers by a cluster
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


TYPE_AS = "aten::type_as"


def needed(group: ir.Group, wanted: Sequence[ir.Value], held: frozenset = frozenset(),
           level: Optional[frozenset] = None) -> set:
    """ids of the element-level values (inputs and nodes) that computing ``wanted`` reads, ``wanted`` included; the
    walk stops at the values in ``held`` (kept in registers: read, not computed) and leaves out those of ``level``
    (computed once a row: :func:`row_level`'s; a column kernel's are ``outer.column_level``'s)."""
    level = row_level(group) if level is None else level
    producer = group._cache.get("producer")
    if producer is None:
        producer = group._cache["producer"] = {n.out.id: n for n in group.nodes}
    need, stack = set(), list(wanted)
    while stack:
        v = stack.pop()
        if v.id in need or v.id in level:
            continue
        need.add(v.id)
        if v.id in producer and v.id not in held:
            stack.extend(read_values(producer[v.id]))
    return need


def read_values(n: ir.Node) -> list:
    """The group values whose elements ``n`` reads: its values, less ``type_as``'s ``other``, of which it takes
    only the dtype (a backward's ``type_as(dy, y)``: y is neither computed nor held for it)."""
    if n.op == TYPE_AS:
        return [a for a in n.args[:1] if isinstance(a, ir.Value)]
    return n.values


def reduction_passes(group: ir.Group, merge: bool) -> list[list[ir.Node]]:
    """The group's reduction nodes in the passes along the row that accumulate them, in order: one each, or
    (``merge``, the CUDA kernels') consecutive ones whose inputs do not read each other's results in one pass: a
    layer_norm backward's sum(dy * w) and sum(dy * w * xhat) load dy and x together and wait for memory once a row,
    where a pass each loaded x only after the first sum's block reduction. A variance (a pass for its mean, one
    for the squared deviations) is a pass set of its own."""
    got = group._cache.get(("reduction_passes", merge))
    if got is not None:
        return got
    got, current = [], []
    for n in group.nodes:
        red = ops.reduction(n.op)
        if red is None:
            continue
        if (merge and current and not red.variance and not ops.reduction(current[0].op).variance
                and not {m.out.id for m in current} & needed(group, [n.args[0]], level=frozenset())):
            current.append(n)
            continue
        current = [n]
        got.append(current)
    group._cache[("reduction_passes", merge)] = got
    return got


def row_passes(group: ir.Group, merge: bool = False) -> list:
    """The passes of a row kernel along the row, in order: per set of :func:`reduction_passes` the values it
    accumulates (its reductions' inputs; a variance takes two passes, the mean's and the squared deviations'),
    then the element-level outputs'. ``merge``: the CUDA kernels' passes (sibling reductions share one)."""
    rows_v = row_level(group)
    passes = []
    for members in reduction_passes(group, merge):
        passes += [[n.args[0] for n in members]] * (2 if ops.reduction(members[0].op).variance else 1)
    elem_out = [o for o in group.outputs if o.id not in rows_v]
    if elem_out:
        passes.append(elem_out)
    return passes


def held_values(group: ir.Group) -> list:
    """For a row held in registers (``CudaShape.held``): per pass of :func:`row_passes`, the ids of the element-level
    values it finds in registers, kept by the passes before it. After each pass, what later passes read of what it
    computed or read is kept: walking back from each later pass's values, the first values met that this pass
    has (the cut). So a pass computes only what depends on the row-level values it is the first to see: softmax's
    output pass reads exp(x - max) from registers and divides, layer_norm's keeps x + bias + residual, then x - mean."""
    got = group._cache.get("held_values")
    if got is not None:
        return got
    passes = row_passes(group, merge=True)
    held: frozenset = frozenset()
    got = []
    for i, wanted in enumerate(passes):
        got.append(held)
        has = frozenset(needed(group, wanted, held) | held)  # what this pass reads or computes, and finds held
        keep: set = set()
        for later in passes[i + 1:]:
            keep |= needed(group, later, has) & has
        held = _without_casts(group, keep)
    group._cache["held_values"] = got
    return got


CASTS = frozenset((TYPE_AS, "aten::_to_copy"))


def _without_casts(group: ir.Group, keep: set) -> frozenset:
    """``keep`` less each cast of another value in it: the later pass converts again (an instruction or none)
    rather than holding both (a backward holds dy and ``type_as(dy, y)``, one more register an element)."""
    keep = set(keep)
    for vid in sorted(keep, reverse=True):
        n = group.producer(ir.Value(vid))
        if n is not None and n.op in CASTS and isinstance(n.args[0], ir.Value) and n.args[0].id in keep:
            keep.discard(vid)
    return frozenset(keep)


def kept_values(group: ir.Group, keepable: Callable[[int], bool]) -> list:
    """The CPU row kernel's values kept in a row-long scratch array (one per value and thread) rather than computed
    again: per pass of :func:`row_passes`, (the ids it reads from scratch, the ids it writes there). A pass keeps
    the ``keepable`` values (the codegen's: costly ones, exp, log..., and those reading several inputs) it computes
    that a later pass reads, walking back from that pass's values to the first values met that this pass computes.
    So softmax's output pass reads exp(x - max) from scratch and multiplies, as eager's kernel does; its backward
    computes exp once rather than three times; layer_norm(x + bias + residual) reads the sum from scratch in its
    variance and output passes. Other values are computed again (the row's inputs are in cache by then)."""
    passes = row_passes(group)
    held: frozenset = frozenset()
    got = []
    for i, wanted in enumerate(passes):
        computed = frozenset(v for v in needed(group, wanted, held) - held if keepable(v))
        keep: set = set()
        for later in passes[i + 1:]:
            keep |= needed(group, later, held | computed) & computed
        got.append((held, frozenset(keep)))
        held = held | keep
    return got


def pass_width(group: ir.Group, held: bool) -> tuple[int, int]:
    """(the most row values a pass of a CUDA row kernel holds per element, the inputs its first pass loads). A held
    row (``held``): the values a pass finds held or holds for later passes (a later pass loads its inputs a
    vector at a time); otherwise every pass loads what it reads, a trip at a time."""
    passes = row_passes(group, merge=True)
    holds = held_values(group) if held else [frozenset()] * len(passes)
    tensors = {v.id for v in group.inputs if v.is_tensor}
    width, first = 0, 0
    for i, wanted in enumerate(passes):
        now = holds[i]
        loads = tensors & needed(group, wanted, now) - now
        later = holds[i + 1] - now if i + 1 < len(holds) else frozenset()
        if i == 0:
            first = len(loads)
        # a pass's held values replace those it found element by element
        width = max(width, len(now), len(later)) if held else max(width, len(loads))
    return width, first


@dataclass(frozen=True)
class RowKey:
    """What a row kernel's source depends on: the target, the device, per tensor input its dtype and whether it
    is 0-dim (type promotion treats those apart), and on CUDA the row's :class:`CudaShape` (chosen from the row
    length) and, for a kernel that takes whole vectors only, each input's step along the row (``steps``). The
    other strides and sizes are launch arguments."""

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


def row_level(group: ir.Group) -> frozenset:
    """ids of the row-level values (see the module's doc); every other value is element-level. A group made by
    :func:`with_row_inputs` counts those inputs among them."""
    got = group._cache.get("row_level")
    if got is None:
        rows: set = set(group._cache.get("row_inputs", ()))
        floats = {v.id for v in group.inputs if not v.is_tensor}  # the same for every row and element
        for n in group.nodes:
            ids = {v.id for v in n.values} - floats
            red = ops.reduction(n.op)
            if (red is not None and red.kind not in ops.NORMALIZATIONS) or (red is None and ids and ids <= rows):
                rows.add(n.out.id)
        got = group._cache["row_level"] = frozenset(rows)
    return got


def with_row_inputs(group: ir.Group, positions: tuple[int, ...]) -> ir.Group:
    """``group`` (a copy) whose tensor inputs at ``positions`` are row-level values: one value a row, as a
    [rows..., 1...] input gives them (a normalization's statistics saved by its forward, ``RowKey.row_inputs``). The
    kernel loads each once a row and computes what depends only on them and the reductions once a row too, where
    an element-level input of that shape was loaded, and what it reads computed, at every element."""
    if not positions:
        return group
    copy = ir.Group(group.inputs, group.nodes, group.outputs)
    copy._cache["row_inputs"] = frozenset(group.inputs[j].id for j in positions)
    return copy


def row_inputs(group: ir.Group, shape: dict, full: tuple, k: int) -> tuple[int, ...]:
    """The positions of ``group``'s tensor inputs that hold one value a row (of shape [rows..., 1...], the row's
    dims all 1, where the row is longer than 1), where no reduction then reads a row-level value."""
    keep = tuple(full[:len(full) - k]) + (1,) * k
    if keep == tuple(full):
        return ()
    got = tuple(j for j, v in enumerate(group.inputs) if v.is_tensor and shape[v.id] == keep)
    if not got:
        return ()
    rows = row_level(with_row_inputs(group, got))
    return () if any(ops.reduction(n.op) is not None and n.args[0].id in rows for n in group.nodes) else got


SUM = "aten::sum.dim_IntList"


def column_sum_candidates(group: ir.Group) -> frozenset:
    """ids of the nodes that may be column sums (:func:`column_sum_form`): a sum that is an output, read by no
    node, of a value a node computes, with no dtype argument. The plan decides by the shapes which are."""
    got = group._cache.get("column_sum_candidates")
    if got is None:
        read = {v.id for n in group.nodes for v in n.values}
        outs = {v.id for v in group.outputs}
        computed = {n.out.id for n in group.nodes}
        got = group._cache["column_sum_candidates"] = frozenset(
            n.out.id for n in group.nodes if n.op == SUM and n.out.id in outs and n.out.id not in read
            and isinstance(n.args[0], ir.Value) and n.args[0].id in computed and n.args[1] and n.args[3] is None)
    return got


def column_sum_form(group: ir.Group, sums: tuple[int, ...]) -> ir.Group:
    """The group a row kernel with column sums runs: ``group`` without the sum nodes that make its outputs ``sums``
    (positions), each of those outputs replaced by the value it sums. The kernel computes that value element by
    element in its output pass, as any element-level output, and adds it into a partial row (a sum over the rows
    of each column: a weight's or a bias's gradient in a norm's backward) instead of storing it; a second stage
    adds the partial rows. So the backward reads x and dy once, where a column kernel would read them again.
    Cached on the group."""
    if not sums:
        return group
    cache = group._cache.setdefault("column_sum_form", {})
    got = cache.get(sums)
    if got is None:
        drop = {group.outputs[m].id for m in sums}
        summed = {n.out.id: n.args[0] for n in group.nodes if n.out.id in drop}
        got = cache[sums] = ir.Group(group.inputs, tuple(n for n in group.nodes if n.out.id not in drop),
                                     tuple(summed.get(v.id, v) for v in group.outputs))
    return got


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
                return (staged_shape(group, sh, cols, sizes[:len(tensors)], strides, left)
                        if settings.cuda_staged_rows and settings.cuda_vector_rows and _vectors(cols, strides, sh.vec)
                        else None)
            per_element = [sz for j, sz in enumerate(widths) if j >= n_in or col_strides[j] != 0]
            if not _vectors(cols, strides, 16 // max(per_element, default=4)):  # (their wider vectors would not fit
                per_element = None  # the row: it would be read an element at a time, unstaged)
            cuda_sh = _cuda_sums_shape(group, cols, widths, len(sums), shared_limit(device), stage,
                                       sum_sizes(out_dtypes, sums), per_element)
            if cols > cuda_sh.tpr * cuda_sh.items and not cuda_sh.trip_sums:
                return _sums_apart(spec, args, target,
                                   "column sums of a CUDA row kernel of several trips along the row, past a "
                                   "block's shared memory")
        else:
            cuda_sh = _cuda_row_shape(group, cols, widths, 0)
            if not cuda_sh.held and min(widths) >= CLUSTER_MIN_BYTES and _clusters(device):  # a cluster's
                cuda_sh = cluster_shape(cols, widths, *pass_width(group, True)) or cuda_sh
            if not cuda_sh.held:  # each pass loads what it reads
                cuda_sh = _cuda_row_shape(group, cols, widths, 0, held=False)
                # or keeps in shared memory what several passes read (a vectors-only kernel's: RowKey.steps below)
                if settings.cuda_vector_rows and _vectors(cols, strides, cuda_sh.vec):
                    cuda_sh = staged_shape(group, cuda_sh, cols, sizes[:len(tensors)], strides,
                                           stage_limit(device)) or cuda_sh
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
