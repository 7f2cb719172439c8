"""The benchmark on the CPU (``--device cpu``): its large rows' sizes, dtypes, systems, timing and the processor's
name. Large rows of 4M elements pass the L3 cache of small machines (16 MB on the 2-core EPYC of the README)
while keeping a call of eager's in tens of ms; each cell reads time per call and speed-up over eager."""
from __future__ import annotations

import contextlib
import os
import platform

import torch

from .timing import _PROFILED_RUNS, Config

# calls of tens of ms: fewer per batch, more batches (a shared machine's stalls land in a few of them, and the
# median skips those)
CPU = Config(warmup=max(5, _PROFILED_RUNS + 3), warmup_s=0.3, batch_calls=3, batches=11, host_calls=500,
             host_repeats=7, copy_bytes=2 ** 28, copy_repeats=5)
CPU_LARGE = {"mul_add": (2 ** 22,), "gelu_bias": (1024, 4096), "lstm_cell": (1024, 1024), "silu_scale": (2 ** 22,),
             "dropout_residual": (1024, 4096)}  # the *_train rows take their forward's
# issue 12's normalization rows: 4M elements at each row length
CPU_LARGE.update({f"{op}{suffix}": (2 ** 22 // cols, cols) for op in ("softmax_scale", "layer_norm_affine", "rms_norm_weight")
                  for suffix, cols in (("", 4096), ("_r512", 512), ("_r16k", 16384), ("_r64k", 65536))})
CPU_LARGE["bias_residual_layer_norm"] = (1024, 4096)
CPU_LARGE["sum0_mul"] = (1024, 4096)  # issue 12's sum over dim 0: 4M elements
CPU_LARGE["channels_last_affine_relu"] = (32, 256, 56, 56)  # the GPU's row takes batch 64
CPU_DTYPES = (torch.float32, torch.bfloat16)


def cpu_shape(name: str, shape: tuple) -> tuple:
    """A workload's large shape on the CPU."""
    return CPU_LARGE.get(name.removesuffix("_train"), shape)


def cpu_name() -> str:
    """The processor's model name, core count and the instruction set eager dispatches to."""
    model = platform.processor() or "cpu"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


def cpu_systems() -> tuple[str, ...]:
    """TorchScript's NNC only where torch was built with LLVM (else it is the interpreter), and not the legacy
    fuser (it fuses on CUDA only)."""
    return ("eager", *(("ts_nnc",) if torch._C._llvm_enabled() else ()), "compile", "fuser", "compile_fuser")


def cpu_cell_text(row: dict, cell: dict, flag: str) -> str:
    """Time per call and speed-up over eager."""
    eager = row["cells"].get("eager", {}).get("us_per_call")
    speedup = f" {eager / cell['us_per_call']:.2f}x" if eager else ""
    digits = 0 if row["size"] == "large" else 1
    return f"{cell['us_per_call']:.{digits}f}us{speedup}{flag}"
