"""Which devices fuse: detected once, overridable by the user (``override_can_fuse_on_cpu/gpu``)."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

_override_cpu: Optional[bool] = None
_override_gpu: Optional[bool] = None
# A pass failure raises instead of leaving that graph unfused with a warning. The tests set it
# (FUSER_STRICT_PASS=1), so that an invalid graph fails the test that made it.
strict_pass: bool = os.environ.get("FUSER_STRICT_PASS", "") == "1"
# Round the float16/bfloat16 result of each op that is an eager op of its own (ir.Node.origin empty) before the next
# op reads it, as eager stores it: a chain of such ops then gives eager's bits. Off by default: the conversions cost
# bandwidth on CUDA (H100, GELU block of 16384x4096: 0.92 of the copy floor unrounded, 0.43 rounded in bfloat16,
# 0.71 in float16). Read when a kernel is built (FUSER_ROUND_REDUCED=1 turns it on).
round_reduced: bool = os.environ.get("FUSER_ROUND_REDUCED", "") == "1"
# CUDA backwards sum a broadcast input's gradient inside the kernel that computes the gradients (fuser/grad_sums.py's
# fused form: a norm's weight and bias in the row kernel, a pointwise backward's bias in a column kernel; on the CPU
# row backwards always do, pointwise ones never: grad_sums._fused_first). On by default; FUSER_CUDA_COLUMN_SUMS=0 turns it off. (It was off for a while: the
# traced tiny GPT-2's CUDA gradient test failed with it on, one bias-gradient element 2.3e-5 from eager's. Against
# float64, on an H100, every parameter's gradient was as close with it as without it and as eager's: that attention
# bias's error 4.6e-5 on, 3.1e-5 off, eager 2.1e-5, over terms up to 300; the test's tolerance now allows eager's
# own rounding error, tests/test_models.py.) Read on each backward call.
cuda_column_sums: bool = os.environ.get("FUSER_CUDA_COLUMN_SUMS", "1") != "0"
# CUDA kernels whose outputs and floating inputs are all float16/bfloat16 may be compiled with multiplies and adds
# contracted into FMAs (NVRTC --fmad=true; fuser/cuda/launch.py's contracts says why their results would stay within eager's
# tolerance). Off by default: on an H200 it cut a hand-edited equivalent of gelu(x + b)'s bfloat16 backward column
# kernel (8 columns a thread) from 121 to 117.5 us, but the benchmark's training step as generated took 199-200 us
# with it and 200-201 us without (two processes each, 2026-12-01), and gpu_check ran without it.
# FUSER_CUDA_CONTRACT=1 turns it on. Read when a kernel is loaded (the flag is in the disk cache's key).
cuda_contract: bool = os.environ.get("FUSER_CUDA_CONTRACT", "0") == "1"
# The CUDA tiled (transposing) path in its vector form for float16/bfloat16 staged inputs (cuda/templates.py's
# TILED_TRIP_VEC): 8-element vectors on both sides of the shared-memory tile, where the 2-byte element per lane and
# access of the scalar form left those kernels bound by instruction issue. Read when a kernel is built (it changes
# the source, and so every cache key); FUSER_CUDA_TILE_VEC=0 keeps the scalar form for every dtype.
cuda_tile_vec: bool = os.environ.get("FUSER_CUDA_TILE_VEC", "1") != "0"
# CUDA rows too long for a block's registers are held by the CTAs of a thread block cluster on sm_90 and later
# (fuser/rows/shape.py's cluster_shape), for tensors of 4 bytes or more. On by default; FUSER_CUDA_CLUSTERS=0 turns
# them off (each pass reads the row again). Read when a row kernel is planned.
cuda_clusters: bool = os.environ.get("FUSER_CUDA_CLUSTERS", "1") != "0"
# CUDA devices that ran no cluster of a cluster row kernel at once (fuser/rows/launch.py found it at load: MPS, a
# partition leaving a GPC too few SMs): the row plan gives them no more cluster kernels
cuda_no_clusters: set = set()
# A CUDA row kernel whose inputs all step by 1 or 0 along the row, in a signature that allows whole vectors, takes
# only the vector path: its loads and stores have no runtime choice of form, where the choice made ptxas keep a
# pass's loaded values in registers on both sides (H200, bias + residual + layer_norm of [16384 x 4096] in bfloat16,
# 128 registers a thread with the choice, 66 without; 0.67 of the copy floor against 0.95). A launch whose pointers
# are not aligned for vectors runs the row kernel with the choice, built then (fuser/rows/launch.py). On by default;
# FUSER_CUDA_VECTOR_ROWS=0 turns it off. Read when a row kernel is planned.
cuda_vector_rows: bool = os.environ.get("FUSER_CUDA_VECTOR_ROWS", "1") != "0"
# A CUDA row kernel of a row read again by each pass (too long for registers, no cluster) keeps the inputs that several
# passes read in shared memory, so that the row comes from global memory once (fuser/rows/shape.py's staged_inputs):
# vectors-only kernels, while the rows of a block fit the device's shared memory. On by default;
# FUSER_CUDA_STAGED_ROWS=0 turns it off. Read when a row kernel is planned.
cuda_staged_rows: bool = os.environ.get("FUSER_CUDA_STAGED_ROWS", "1") != "0"
# On the CPU, a group's backward reads the transcendental values the cost model picks from its forward instead of
# recomputing them (fuser/saving.py). On by default; FUSER_CPU_SAVE=0 turns it off. Read on each forward call under
# autograd that Python runs (the native hot path keeps what a signature was prepared with: fuser.native.clear()).
cpu_save: bool = os.environ.get("FUSER_CPU_SAVE", "1") != "0"
# A group's layer_norm and rms_norm write their statistics (mean and rstd, rstd) for its backward, which reads them
# instead of forming them again (fuser/backward.py). On by default; FUSER_SAVE_STATISTICS=0 turns it off (read as
# cpu_save is).
save_statistics: bool = os.environ.get("FUSER_SAVE_STATISTICS", "1") != "0"
# The CPU vector path reads a transposed input (one that steps by 1 along the rows and far along the inner dim) in
# blocks of W x W elements transposed through a local buffer (cpu/templates.py's TRANSPOSE_BLOCKS), where a gather per
# vector touched W cache lines and W pages for each row. On by default; FUSER_CPU_TRANSPOSE_BLOCKS=0 turns it off.
# Read when a kernel is built (it changes the source).
cpu_transpose_blocks: bool = os.environ.get("FUSER_CPU_TRANSPOSE_BLOCKS", "1") != "0"
# The torch.compile door builds the kernels of a graph's groups when it compiles the graph, all at once on worker
# threads, from Dynamo's example inputs (fuser/dynamo/prebuild.py): NVRTC and the C compiler run without the GIL, so a
# graph's kernels, and a training step's backward kernels, build side by side instead of one after another at their
# first calls. On by default; FUSER_PREBUILD=0 turns it off. Read when a graph is compiled.
prebuild: bool = os.environ.get("FUSER_PREBUILD", "1") != "0"
# device type -> fusion on; filled lazily, cleared by the overrides. The executor reads it on every call.
enabled: dict[str, bool] = {}
# called after an override changes what fuses (the native hot path forgets its prepared launches)
on_change: list = []


@functools.lru_cache(maxsize=None)
def _cpu_available() -> bool:
    from .cpu import compiler
    return compiler.available()


@functools.lru_cache(maxsize=None)
def _gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def can_fuse_on_cpu() -> bool:
    """Whether groups on CPU tensors run as generated kernels (a working C++ compiler is needed)."""
    return _cpu_available() if _override_cpu is None else (_override_cpu and _cpu_available())


def can_fuse_on_gpu() -> bool:
    """Whether groups on CUDA tensors run as generated kernels (CUDA and cuda-python are needed)."""
    return _gpu_available() if _override_gpu is None else (_override_gpu and _gpu_available())


def fusion_enabled(device_type: str) -> bool:
    on = enabled.get(device_type)
    if on is None:
        on = enabled[device_type] = (can_fuse_on_cpu() if device_type == "cpu" else
                                     can_fuse_on_gpu() if device_type == "cuda" else False)
    return on


def override_can_fuse_on_cpu(value: Optional[bool]) -> None:
    global _override_cpu
    _override_cpu = None if value is None else bool(value)
    enabled.clear()
    for listener in on_change:
        listener()


def override_can_fuse_on_gpu(value: Optional[bool]) -> None:
    global _override_gpu
    _override_gpu = None if value is None else bool(value)
    enabled.clear()
    for listener in on_change:
        listener()
