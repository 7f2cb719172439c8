"""Compilation at run time: specialize a kernel spec to an arg spec and build it for the device.

Types come from eager PyTorch itself: the group runs once op by op through eager's ATen ops on zero-element
(or 0-dim) tensors of the arg spec's dtypes, on the arg spec's device, with every intermediate value as an
output. That gives each value exactly eager's result dtype, type promotion included (int + float, 0-dim
tensors, Python scalars), and an input combination eager rejects raises here, so the executor falls back and
eager's own error reaches the user. Running on the device matters: eager's CUDA kernels refuse a 0-dim CPU
tensor (a traced constant) in some arguments that its CPU kernels take (clamp's tensor bounds, addcmul's
self and tensor1, lerp's end), and ``type_as`` of a CPU tensor moves the value to the CPU.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import codegen, ir, ops, rng, settings
from .descs import DTYPES, STRIDED_LAYOUTS, ArgSpec, TensorDesc
from .fallback import evaluate
from .kernel_cache import KernelSpec

_counter_lock = threading.Lock()
_n_compiled = 0


def n_compiled_kernels() -> int:
    """Kernels compiled by this process so far (kernels loaded from the disk cache are not compiled)."""
    return _n_compiled


def _count_compile() -> None:
    global _n_compiled
    with _counter_lock:
        _n_compiled += 1


@dataclass
class CompiledKernel:
    """A kernel ready to launch for one (spec, arg spec)."""

    name: str
    arg_spec: ArgSpec
    out_dtypes: tuple[torch.dtype, ...]
    source: str
    strided: tuple[int, ...]  # indices of the strided tensor inputs, in kernel order
    vec: int  # CUDA vector width (1: no vector path)
    backend: object  # fuser.cpu.compiler.CpuKernel or fuser.cuda.launch.CudaKernel
    build_ms: float = 0.0  # wall time of build(): types, codegen, compile (or disk-cache load), load
    # per float argument: (index, lowest, highest, non-finite allowed) over the dtypes its ops convert it to;
    # a value outside makes eager raise (or convert differently), so such calls fall back
    scalar_limits: tuple = ()
    random: bool = False  # draws random numbers: each launch appends rng.launch_state() to the float arguments
    tile: tuple = codegen.TILE_SCALAR  # CUDA: the tiled path's tile (codegen.tile_shape), for the launch grid


def _sample(desc: TensorDesc, rank: int = 1, device: Optional[torch.device] = None) -> torch.Tensor:
    if desc.zero_dim:
        return torch.ones((), dtype=desc.dtype, device=device)
    return torch.empty((0,) + (1,) * (rank - 1), dtype=desc.dtype, device=device)


def _sample_rank(spec: KernelSpec) -> int:
    """Rank of the probe tensors: enough for every cat's dim (a cat on dim 2 needs 3-d pieces)."""
    return max([1] + [d + 1 if d >= 0 else -d for c in spec.concats if c is not None for d in (c[0],)])


class DeviceChange(RuntimeError):
    """A value of the group leaves the inputs' device in eager (``type_as`` of a CPU tensor)."""


def infer_types(spec: KernelSpec, arg_spec: ArgSpec, device: Optional[torch.device] = None) -> list[codegen.NodeTypes]:
    """Result and compute dtype of every node of ``spec.group`` for inputs like ``arg_spec``, probed on
    ``device`` (default: the arg spec's).

    Raises whatever eager raises for such inputs there, and :class:`DeviceChange` where a value would leave
    that device.
    """
    device = arg_spec.device if device is None else torch.device(device)
    group = spec.group
    descs = iter(arg_spec.inputs)
    rank = _sample_rank(spec)
    samples = [_sample(next(descs), rank, device) if is_t else 1.0 for is_t in spec.input_is_tensor]
    values = evaluate(group, samples, every_value=True)[len(group.outputs):]
    where = next(t.device for t in samples if isinstance(t, torch.Tensor))  # with the index torch gave it
    for n, val in zip(group.nodes, values):
        if val.device != where:
            raise DeviceChange(f"{n.op} gives a {val.device} tensor from inputs on {where}")
    by_value = {v.id: s for v, s in zip(group.inputs, samples)}
    by_value.update({n.out.id: val for n, val in zip(group.nodes, values)})
    types = []
    for n, val in zip(group.nodes, values):
        op = ops.of(n.op)
        if op is not None and op.compute == "common":
            a, b = (by_value[v.id] if isinstance(v, ir.Value) else v.tensor() if isinstance(v, ir.TensorConst)
                    else v for v in n.args)
            common = torch.result_type(a, b)
        else:
            common = val.dtype
        types.append(codegen.NodeTypes(val.dtype, common))
    return types


def build(spec: KernelSpec, arg_spec: ArgSpec, load: Optional[Callable] = None,
          probe_device: Optional[torch.device] = None) -> Optional[CompiledKernel]:
    """Generate and compile the kernel of ``spec`` for ``arg_spec``; None where fusion is not possible
    for these inputs (the caller falls back).

    ``load(source, name, arg_spec, n_strided, kernel_dtypes, n_scalar_slots, vec, waves) -> (backend, compiled)``
    turns the source into the kernel's backend; default: the arg spec's device's (g++ for the CPU, NVRTC and
    the driver for CUDA). The CUDA emulator passes its own (``fuser.cuda.emulate``), and ``probe_device`` (where
    the type probe runs; default: the arg spec's device) for its CPU tensors.
    """
    t0 = time.perf_counter()
    if spec.flat is not None:  # permutes inside: the plan reads each input through its view (fuser/views.py)
        spec = spec.flat
    if any(d.dtype not in DTYPES for d in arg_spec.inputs) or spec.concat_consumed or any(
            spec.group.is_input(v) for v in spec.group.outputs):  # a kernel's outputs are fresh tensors
        return None
    try:
        types = infer_types(spec, arg_spec, probe_device)
    except Exception:  # eager rejects these inputs: the fallback will raise eager's error
        return None
    if any(t.result not in DTYPES or t.compute not in DTYPES for t in types):
        return None
    target = "cuda" if arg_spec.device_type == "cuda" else "cpu"
    options = codegen.KernelOptions(index32=arg_spec.index32,
                                    fast_reduced=os.environ.get("FUSER_FAST_REDUCED", "1") != "0",
                                    round_reduced=settings.round_reduced,
                                    vectorize=target == "cuda" or _cpu_vectorize(), tile_vec=settings.cuda_tile_vec,
                                    vml=_cpu_vml_ops() if target == "cpu" else (),
                                    transpose_blocks=target == "cpu" and settings.cpu_transpose_blocks)
    # deterministic across processes (the disk cache keys on the source, which holds the name); the options change
    # the source, so they are part of it: one name, one source
    name = "fused_" + hashlib.sha256(f"{spec.text}\n{arg_spec!r}\n{target}\n{options!r}".encode()).hexdigest()[:16]
    try:
        source = codegen.generate(spec.group, arg_spec.inputs, types, target, name, options, arg_spec.outputs)
    except codegen.NotFusable:
        return None
    group = spec.group
    position = {n.out.id: k for k, n in enumerate(group.nodes)}
    out_dtypes = tuple(types[position[v.id]].result for v in group.outputs)
    # a cat's result is written piece by piece: one kernel output per piece
    kernel_dtypes = tuple(dt for pieces, dt in zip(spec.pieces, out_dtypes) for _ in (pieces or (None,)))
    strided = tuple(k for k, d in enumerate(arg_spec.inputs) if d.layout in STRIDED_LAYOUTS)
    n_strided = codegen.strided_operands(arg_spec.inputs, arg_spec.outputs)
    vector = codegen.has_vector_path(arg_spec.inputs, target, arg_spec.outputs)
    vec = codegen.vector_width(arg_spec.inputs, kernel_dtypes) if vector else 1
    n_slots = len(spec.input_is_tensor) - spec.n_tensor_inputs + (rng.N_STATE if spec.random else 0)
    op_names = [getattr(ops.of(n.op), "name", n.op) for n in spec.group.nodes]
    waves = codegen.grid_waves(op_names, arg_spec.inputs, vec, target, arg_spec.outputs)
    load = load or (_load_cpu if target == "cpu" else _load_cuda)
    backend, compiled = load(source, name, arg_spec, n_strided, kernel_dtypes, n_slots, vec, waves)
    if compiled:
        _count_compile()
    if os.environ.get("PYTORCH_FUSION_DEBUG", "0") not in ("", "0", "explain"):  # explain: fuser.explain's tables
        print(f"fuser: compiled {name} for {arg_spec}\n{source}", file=sys.stderr)
    return CompiledKernel(name, arg_spec, out_dtypes, source, strided, vec, backend,
                          (time.perf_counter() - t0) * 1e3, _scalar_limits(spec, types), spec.random,
                          codegen.tile_shape(arg_spec.inputs, options))


def _cpu_vectorize() -> bool:
    """Whether CPU kernels get vector loops (the at::vec toolchain is usable on this machine)."""
    from .cpu import compiler as cpu_compiler
    return cpu_compiler.toolchain() is not None


def _cpu_vml_ops() -> tuple:
    """The ops whose float32 results CPU kernels take from MKL's VML, as eager does (fuser.cpu.vml)."""
    from .cpu import vml
    return vml.eager_ops()


def _load_cpu(source: str, name: str, *_) -> tuple:
    from .cpu import compiler as cpu_compiler
    return cpu_compiler.compile_kernel(source, name)


def _load_cuda(*args) -> tuple:
    from .cuda import launch as cuda_launch
    return cuda_launch.load_kernel(*args)


def _scalar_limits(spec: KernelSpec, types) -> tuple:
    scalars = [v for v in spec.group.inputs if not v.is_tensor]
    limits = []
    for j, v in enumerate(scalars):
        lo, hi, nonfinite = -float("inf"), float("inf"), True
        for n, t in zip(spec.group.nodes, types):
            if any(i.id == v.id for i in n.values):
                info = torch.finfo(t.compute) if t.compute.is_floating_point else (
                    None if t.compute == torch.bool else torch.iinfo(t.compute))
                if info is None:
                    continue
                lo, hi = max(lo, float(info.min)), min(hi, float(info.max))
                nonfinite = nonfinite and t.compute.is_floating_point
        limits.append((j, lo, hi, nonfinite))
    return tuple(limits)
