"""What every part of code generation shares: its errors and options, value types and C literals, and the
layout facts the compiler also asks (which kernels get a vector path, how many strided operands, what width)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..descs import DENSE, ROWS, STRIDED, STRIDED_LAYOUTS, TensorDesc, compute_type, storage_type

TARGETS = ("cpu", "cuda")
REDUCED = (torch.float16, torch.bfloat16)
# CPU kernels split across OpenMP threads from this much work: elements x (ops + 16 per transcendental call,
# cpu_t.EXPENSIVE_FUNCTIONS), at least CPU_PARALLEL_MIN elements. 65536 puts a*b+c at 32768 elements, eager's
# own grain; the tanh-GELU at 2520. On the 2-core EPYC with the other core idle, 2 threads won already at 1024
# elements (GELU 26.9 against 29.5 us a call, warm threads); with the other core busy a parallel region waits
# for a descheduled thread, and work of that size gains less than it risks. FUSER_CPU_PARALLEL_WORK sets it
# for experiments (it changes the source: cached kernels follow it).
CPU_PARALLEL_WORK = int(os.environ.get("FUSER_CPU_PARALLEL_WORK", "65536"))
CPU_PARALLEL_MIN = 2048
CPU_ROW_CHUNK = 4096  # elements of one row per task of the vector path's row loop (a multiple of every trip)
CPU_TILE_ROWS = 16  # rows a task of the vector path's tiled loop (an operand gathered along the inner dim)
CPU_TILE_CHUNK = 256  # elements of a row per tiled task: a gathered operand's lines for them stay in L1
# vectors per trip of the CPU vector loops, interleaved op by op. A tanh-GELU on one core of a 2-core EPYC
# (float32 and bfloat16, 2048x4096): 1 vector 32.4/37.5 ms, 2 vectors 29.9/32.8 ms, 4 vectors 28.0/30.5 ms.
CPU_VECTORS_PER_TRIP = int(os.environ.get("FUSER_CPU_VECTORS_PER_TRIP", "4"))


class NotFusable(Exception):
    """The group cannot be generated for these inputs (e.g. an integer op with no integer template); the
    executor falls back to the interpreter."""


@dataclass(frozen=True)
class NodeTypes:
    """dtype of a node's result, and the dtype its math runs in (they differ for comparisons)."""

    result: torch.dtype
    compute: torch.dtype


@dataclass(frozen=True)
class KernelOptions:
    """Target-specific knobs that change the source (and so belong in any cache key)."""

    index32: bool = True
    block_size: int = 256
    vectorize: bool = True
    fast_reduced: bool = True  # CUDA: ops.OpDef.fast expressions for float16/bfloat16 results
    round_reduced: bool = False  # round each eager op's float16/bfloat16 result as eager stores it (settings.py)
    tile_vec: bool = True  # CUDA: the tiled path's vector form where it applies (settings.cuda_tile_vec)
    vml: tuple = ()  # CPU vector path: the ops whose float32 results come from MKL's VML, as eager's (fuser.cpu.vml)
    transpose_blocks: bool = True  # CPU vector path: transposed inputs in W x W blocks (settings.cpu_transpose_blocks)


def literal(value, ctype: str) -> str:
    """``value`` (a Python bool/int/float constant) as a C expression of type ``ctype``."""
    if isinstance(value, bool):
        return f"(({ctype}){'true' if value else 'false'})"
    if isinstance(value, int):
        return f"(({ctype}){value}LL)" if -(2 ** 63) < value < 2 ** 63 else f"(({ctype}){float(value)!r})"
    suffix = "D" if ctype == "double" else "F"
    if math.isnan(value):
        return f"(({ctype})FZ_NAN_{suffix})"
    if math.isinf(value):
        return f"(({ctype})({'-' if value < 0 else ''}FZ_INF_{suffix}))"
    return f"(({ctype}){value!r})"


# CUDA holds integers narrower than 32 bits in int; each op's result still wraps to its dtype (a cast through it).
# With int8 values in int8 variables NVRTC (CUDA 13, sm_90) packed min/max into 16-bit SIMD and miscompiled
# clamp_min(clamp_max(x, -x), -1) on the vector path: x itself in some bytes (H100; issue 9's fuzz campaign).
_NARROW_INTS = (torch.int8, torch.uint8, torch.int16)


def value_type(dtype: torch.dtype, target: str) -> str:
    """C type a kernel holds values of ``dtype`` in: the compute type, or int for narrow integers on CUDA."""
    return "int" if target == "cuda" and dtype in _NARROW_INTS else compute_type(dtype)


def _converted(dtype: torch.dtype, target: str, expr: str) -> str:
    """``expr`` (an operand, or an op's result) converted to ``dtype`` as eager converts it (an int32 -3 is 253 in
    uint8), held in :func:`value_type` (a float16/bfloat16 value in float: ``body.generate`` rounds the results that
    eager stores)."""
    t = value_type(dtype, target)
    return f"({t})({storage_type(dtype)})({expr})" if t != compute_type(dtype) else f"({t})({expr})"


def _as_held(lit: str, ctype: str) -> str:
    return lit if lit.startswith(f"(({ctype})") else f"(({ctype}){lit})"


def has_vector_path(inputs: Sequence[TensorDesc], target: str, out_layouts: Sequence[str] = ()) -> bool:
    """Whether a kernel gets the 16-byte vector loop: CUDA, every input dense, a broadcast scalar, or
    strided with a contiguous or repeated innermost dim, and every output dense or rows (contiguous along the
    innermost dim: a slice of a wider tensor, such as a chunk's gradient written into its piece of the whole)."""
    return (target == "cuda" and all(d.layout != STRIDED for d in inputs)
            and all(lay in (DENSE, ROWS) for lay in out_layouts))


def has_tiled_path(inputs: Sequence[TensorDesc], target: str, out_layouts: Sequence[str] = ()) -> bool:
    """Whether a kernel gets the CUDA tiled loop (``cuda.templates.TILED_LOOP``): some input generically strided
    (a transposed one reads along another dim than the map's innermost), every output dense, and the scalar form's
    shared tiles (a [64][33] tile of values per strided input) within :data:`SHARED_BYTES` (three float64 inputs
    take 50688 bytes: ptxas refused the kernel, the CUDA fuzzer, seed 608887534)."""
    staged = [d for d in inputs if d.layout == STRIDED]
    return (target == "cuda" and bool(staged) and all(lay == DENSE for lay in out_layouts)
            and sum(TILE_SCALAR[0] * 33 * _value_bytes(d.dtype) for d in staged) <= SHARED_BYTES)


def _value_bytes(dtype: torch.dtype) -> int:
    """Bytes of a CUDA kernel's value of ``dtype`` (:func:`value_type`: float16/bfloat16 in float, narrow
    integers in int)."""
    size = torch.empty((), dtype=dtype).element_size()
    return max(4, size) if dtype.is_floating_point or dtype in _NARROW_INTS else size


# The CUDA tiled path's tiles, (along the map's innermost dim a, along the staged inputs' fastest dim b), in elements.
# Scalar form (cuda/templates.py's TILED_TRIP): an element per lane and access. Vector form (TILED_TRIP_VEC, for staged
# inputs all of 2 or all of 4 bytes): vectors of TILE_VEC_BYTES (8 or 4 elements) along b when staging and along a on
# the dense side; its shared tile swizzles the vectors' chunks along a (8 chunks of 8 elements, 16 of 4), so TILE_VEC_A
# is 64, and TILE_VEC_B 32 or 64 for 2-byte elements (FUSER_CUDA_TILE_VEC_B, for experiments: it changes the source), 32
# for 4-byte ones (the same bytes and vectors a thread as 2-byte elements' 64 x 32). From NVRTC on this machine (sm_90,
# the float16 GELU of a transposed view plus a residual; no GPU here, so no timings): 64 x 32 gives each thread one
# vector a tensor (8 elements: 32 bytes of loads in flight with two tensors, 48 KB an SM at 1536 threads, where HBM3
# wants 40-64 KB), about 65 SASS instructions an element in the tile loop (its static count over a thread's elements;
# the scalar form: 97); 64 x 64 two vectors (96 KB in flight), about 51 an element, but its 16 copies of the body beside
# the scalar form's 8 took NVRTC 2.6 times the scalar form's time for a body of nine transcendental ops, and spilled (64
# x 32: 2.1 times, none; the GELU 1.8 times for both). Measured on an H100 (2026-11-25, the benchmark's
# gelu_transposed_residual at 16384 x 4096, torch.profiler kernel times, one process per setting in one run), float16 /
# bfloat16: scalar form 198 / 188 us, 64 x 32 164 / 162 us, 64 x 64 149 / 148 us (0.91 of the copy floor; float32 and a
# transposed input beside a row bias unchanged). So 64 x 64. 4-byte elements: H200 (2026-11-29, gelu_transposed_residual
# float32, fuser alone, the scalar and vector forms in turn, two rounds) 203.2-204.0 / 199.3-202.0 us a call, 198.7
# against torch.compile's 195.4 in one run.
TILE_SCALAR = (64, 32)
TILE_VEC_BYTES = 16
TILE_VEC_A = 64
TILE_VEC_B = int(os.environ.get("FUSER_CUDA_TILE_VEC_B", "64"))
if TILE_VEC_B not in (32, 64):
    raise ValueError(f"FUSER_CUDA_TILE_VEC_B={TILE_VEC_B} (supported: 32, 64)")
# Threads an SM a kernel with the vector form over 2-byte staged inputs asks registers for (__launch_bounds__' minimum
# blocks; 0: no bound; FUSER_CUDA_TILE_VEC_THREADS for experiments): 1536, 40 registers. Unbounded, NVRTC gave the GELU
# at 64 x 64 48 registers (5 blocks); bounded, 40, no spills, the index math partly on the uniform datapath. 2048 (32
# registers) spilled the transcendental body's kernel, which needs 40 in the scalar form too.
TILE_VEC_THREADS = int(os.environ.get("FUSER_CUDA_TILE_VEC_THREADS", "1536"))
# ... and a kernel whose vector path holds 8 elements a thread (2-byte tensors; FUSER_CUDA_POINTWISE_THREADS for
# experiments): 2048, 32 registers, so an SM holds the most threads it can and has the most loads in flight. Unbounded,
# NVRTC (CUDA 13.0) gave the float16 GELU over rows with a bias 39 registers (6 blocks an SM, 65% occupancy, issue
# slots 72% busy, DRAM 70%); bounded, 32, no spills. H200, torch.profiler kernel time per call, [16384 x 4096], two
# rounds: GELU + bias float16 74.7 -> 69.8 us, bfloat16 72.6 -> 70.8, dropout + residual float16 111.0 -> 101.0,
# bfloat16 112.1 -> 106.6, the GELU of a transposed input float16 74.2 -> 69.0; every other row of the benchmark
# within 0.5%. Kernels of 4-byte tensors keep no bound: the float32 LSTM cell's went 219 -> 224 us with it.
POINTWISE_THREADS = int(os.environ.get("FUSER_CUDA_POINTWISE_THREADS", "2048"))
# ... where the vectors a thread holds fit those 32 registers: at most POINTWISE_MAX_VECTORS tensors read or written in
# vectors (each of 8 2-byte elements takes 4 registers); a kernel of more asks for POINTWISE_HEAVY_THREADS (64
# registers). The LSTM cell's forward (5 inputs, 2 outputs) keeps 2048; its backward (7 inputs, 5 outputs: the gates'
# gradient written into four column slices) spilled there. H200, [16384 x 2048] bfloat16, torch.profiler kernel time
# per call (2026-11-30): 328 us in the per-element loop (before rows outputs took the vector loop), in the vector loop
# 805 us at 32 registers, 523 at 40, 193 at 64, 203 unbounded (two runs). FUSER_CUDA_POINTWISE_MAX_VECTORS and
# FUSER_CUDA_POINTWISE_HEAVY_THREADS are for experiments.
POINTWISE_MAX_VECTORS = int(os.environ.get("FUSER_CUDA_POINTWISE_MAX_VECTORS", "7"))
POINTWISE_HEAVY_THREADS = int(os.environ.get("FUSER_CUDA_POINTWISE_HEAVY_THREADS", "1024"))


# Static shared memory a CUDA kernel may declare (48 KB). A kernel with the vector form declares both forms' tiles: per
# staged input the scalar form's [64][33] values (4 bytes at least) and the vector form's 64 x tile_b 2-byte
# elements; 64 x 64 fits two staged inputs, 64 x 32 three (an H100's ptxas refused three at 64 x 64: 49920 bytes).
# The scalar form alone must fit too (has_tiled_path): two staged 8-byte inputs, five 4-byte ones.
SHARED_BYTES = 48 * 1024


def tile_vec_width(inputs: Sequence[TensorDesc]) -> int:
    """Elements a vector of the tiled path's vector form: 16 bytes of the staged inputs' elements (8 of 2 bytes,
    4 of 4 bytes)."""
    return TILE_VEC_BYTES // max(torch.empty((), dtype=d.dtype).element_size() for d in inputs if d.layout == STRIDED)


def _vector_tile(inputs: Sequence[TensorDesc], options: KernelOptions) -> Optional[tuple[int, int]]:
    staged = [d for d in inputs if d.layout == STRIDED]
    sizes = {torch.empty((), dtype=d.dtype).element_size() for d in staged}
    if not (options.tile_vec and len(sizes) == 1 and sizes <= {2, 4}):
        return None
    size, = sizes
    scalar = len(staged) * TILE_SCALAR[0] * 33 * 4  # (2-byte dtypes compute in float or int: 4 bytes)
    # 4-byte elements: a tile of the same bytes as 2-byte elements' 64 x 32 (the same vectors a thread)
    for tile_b in dict.fromkeys((TILE_VEC_B, 32) if size == 2 else (32,)):
        if scalar + len(staged) * TILE_VEC_A * tile_b * size <= SHARED_BYTES:
            return TILE_VEC_A, tile_b
    return None


def tiled_vector(inputs: Sequence[TensorDesc], options: KernelOptions) -> bool:
    """Whether a kernel's tiled path (see :func:`has_tiled_path`) takes the vector form: the option on, every
    staged input (``STRIDED``) of 2-byte elements (float16, bfloat16, int16) or every one of 4-byte elements
    (float32, int32), and both forms' shared tiles within :data:`SHARED_BYTES`."""
    return _vector_tile(inputs, options) is not None


def tile_shape(inputs: Sequence[TensorDesc], options: KernelOptions) -> tuple[int, int]:
    """The CUDA tiled path's tile, (along a, along b), for a kernel of these inputs and options: 64 x 64 for the
    vector form where the shared tiles fit, else 64 x 32."""
    return _vector_tile(inputs, options) or TILE_SCALAR


def strided_operands(inputs: Sequence[TensorDesc], out_layouts: Sequence[str] = ()) -> int:
    """Operands whose strides are kernel arguments: the strided inputs, then the strided outputs (a cat's
    slices), in that order. Rows of the CUDA kernels' ``FzArgs.strides`` (and its ctypes mirror in
    ``fuser.cuda.launch``) and of the CPU kernels' strides array."""
    return sum(d.layout in STRIDED_LAYOUTS for d in inputs) + sum(lay in STRIDED_LAYOUTS for lay in out_layouts)


# per thread and loop trip, of the narrowest tensor (FUSER_VECTOR_BYTES sets it for experiments; it changes
# the source, so cached kernels follow it). On an H200, 16 beat 32 on a*b+c and fp32 rows, lost on fp16 GELU.
VECTOR_BYTES = int(os.environ.get("FUSER_VECTOR_BYTES", "16"))


def vector_width(inputs: Sequence[TensorDesc], out_dtypes: Sequence[torch.dtype]) -> int:
    """Elements per thread and trip on the CUDA vector path: ``VECTOR_BYTES`` (16) of the widest vector-accessed
    tensor, so that each access of a warp is one contiguous run of its lanes' vectors: the widest tensor moves 16
    bytes a lane, narrower ones fewer. (Vectors of 16 bytes of the narrowest made a float32 tensor beside a float16
    one two 16-byte accesses a lane, each touching every other 16 bytes of its sectors: on an H100 a float16
    tensor plus a float32 bias giving float32, 16384 x 4096, took 175 us that way, 145 us this way, torch.compile 141.)"""
    sizes = [torch.empty((), dtype=d.dtype).element_size() for d in inputs if d.layout in (DENSE, ROWS)]
    sizes += [torch.empty((), dtype=d).element_size() for d in out_dtypes]
    return max(1, min(16, VECTOR_BYTES // max(sizes))) if sizes else 1


# Ops of a few instructions an element: no special function, division or long sequence (a kernel of only these is
# bound by memory, not by its instructions; see grid_waves)
CHEAP_OPS = frozenset({
    "abs", "add", "addcmul", "cast", "ceil", "clamp", "clamp_max", "clamp_max_tensor", "clamp_min", "clamp_min_tensor",
    "clamp_tensor", "eq", "floor", "frac", "ge", "gt", "hardsigmoid", "hardswish", "hardtanh", "le", "leaky_relu",
    "lerp", "lt", "maximum", "minimum", "mul", "ne", "neg", "relu", "relu6", "round", "rsub", "sub", "threshold",
    "trunc", "type_as", "where"})
# Blocks a CUDA pointwise kernel with an index walk (a broadcast or chunked operand) launches, in waves of what the
# GPU holds at once (fuser.cuda.launch.CudaKernel; 0: a block per 256 vectors, one trip a thread). Walking kernels
# took 8 waves (launch.GRID_WAVES), as the 2-byte GELU rows, bound by their instructions, ran fastest so; cheap bodies
# over 4-element vectors run fastest with one trip a thread. H200 (2026-11-29, fuser alone, two rounds, fraction of
# the copy floor, 8 waves / one trip): float16 + float32 bias (reduced_plus_float_bias) 0.91-0.93 / 0.94-0.96,
# outer_affine float32 0.95-0.98 / 0.97-1.00, channels_last affine + relu float32 0.93 / 0.94-0.96 (at batch 128:
# 0.96-0.98 / 1.00); where 8 waves stay: the GELU float16/bfloat16 0.87-0.91 / 0.80-0.82, channels_last
# float16/bfloat16 (8-element vectors) 0.86-0.88 / 0.82-0.86.
CHEAP_WAVES = 0
# ... and where a body over 4-element vectors is not all cheap ops (sigmoids, tanhs, erfs: float32 GELU, SiLU, the
# LSTM cell), 32 waves of grid-striding blocks, walking or not. H200 (2026-11-29, fuser alone, one process a setting
# in turn, two rounds, us a call, float32): walking, 8 / 16 / 32 waves / one trip: lstm_cell 225.0 / 218.9-220.4 /
# 216.7-216.8 / 216.3-219.0, gelu_bias 133.7 / 132.2-132.4 / 131.3 / 136.0-136.5, gelu_bias_transposed (a walk over
# the permuted view) 134.8 / 132.2-133.2 / 131.9-132.4 / 137.5; dense silu_scale, one trip / 8 / 16 / 32 waves:
# 136.9-137.1 / 134.1-135.5 / 132.1-134.2 / 132.0-132.1 (torch.compile in one run with fuser: 216.5, 132.1, 132.1,
# 131.3). Cheap dense bodies keep one trip a thread (mul_add 242.5 / 247.4 at 8 waves) and 2-byte bodies their 8
# waves (FUSER_CUDA_HEAVY_WAVES: experiments).
HEAVY_WAVES = int(os.environ.get("FUSER_CUDA_HEAVY_WAVES", "32"))


def grid_waves(op_names: Sequence[str], inputs: Sequence[TensorDesc], vec: int, target: str,
               out_layouts: Sequence[str] = ()) -> Optional[int]:
    """The launch's waves for a CUDA pointwise kernel of these ops and inputs without a tiled path, or None: the
    launcher's default (8 waves where the kernel walks, one trip a thread where it does not). Vectors of 2 to 4
    elements whose ops are all in ``CHEAP_OPS``: ``CHEAP_WAVES``; 4-element vectors of other ops: ``HEAVY_WAVES``."""
    if target != "cuda" or not 2 <= vec <= 4 or has_tiled_path(inputs, target, out_layouts):
        return None
    if all(n in CHEAP_OPS for n in op_names):
        return CHEAP_WAVES
    return HEAVY_WAVES if vec == 4 else None

