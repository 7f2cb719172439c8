"""Benchmark fuser against eager, TorchScript (NNC and the legacy C++ fuser) and torch.compile.

Run as ``python -m fuser.bench`` (``--help`` for options). Every system runs in the same process, on the
same inputs, one cell (workload x dtype x size x system) at a time.

Workloads (float32, float16, bfloat16; a large and a small size each):

* ``mul_add``: ``a * b + c`` on 2^26 elements;
* ``gelu_bias``: tanh-form GELU of ``x + bias``, x 16384x4096, bias (4096,) broadcast over rows;
* ``lstm_cell``: an LSTM cell's pointwise tail after ``gates.chunk(4, 1)``, gates 16384x8192, cx 16384x2048;
* ``silu_scale``: ``x * sigmoid(x) * s`` with ``s`` a Python float argument, 2^26 elements;
* ``dropout_residual``: ``bias + dropout(x) + residual`` with dropout written as ``(rand_like(x) > p)``, bias
  (4096,) broadcast over x 16384x4096 (outputs checked for shape and dtype only: random values differ);
* ``gelu_bias_train``, ``lstm_cell_train`` (float32, bfloat16): forward + backward of those two, i.e. the
  gradients of every input (bias included: a broadcast input, its gradient summed over rows) for random
  output gradients. Floor bytes: inputs read twice (forward and backward), outputs written, output gradients
  read, input gradients written.

Systems (columns): ``eager`` (the plain Python function), ``ts_nnc`` (``torch.jit.script`` with the profiling
executor's defaults, i.e. NNC), ``ts_legacy`` (the legacy executor and PyTorch's legacy C++ fuser),
``compile`` (``torch.compile`` defaults) and ``fuser`` (``fuser.fuse`` of the scripted function, with
``fuser.install()`` in effect). Each cell builds its own function from the workload's source (TorchScript
through ``torch.jit.CompilationUnit``, eager and torch.compile through ``exec``), so no system sees another
cell's caches, specializations or recompilations.

Method:

* Large rows measure device time per call: CUDA events around batches of back-to-back calls after a warm-up
  past the profiling executor's profiled runs, median over batches divided by the batch length. The result is
  put against the copy-bandwidth floor: bytes = every input read once + every output written once, floor =
  bytes / copy rate, where the copy rate comes from ``dst.copy_(src)`` of 1 GiB in the same run (bytes read +
  written). ``fraction = floor / measured``: 1.0 means as fast as a plain copy of the same traffic.
* Small rows (about 1K elements) measure host time per call: wall clock of N back-to-back calls between two
  synchronizations, divided by N, median of a few repeats. Small working sets fit in L2, so calls rotate
  through several input sets.
* Each system's first call is checked against eager's output (max abs error) and timed with
  synchronization; for fuser that time includes generating and compiling the kernel
  (``fuser_first_call_ms``).
* A failing cell records its error and the run goes on.

``--models`` times real networks end to end instead (fuser/bench_models.py).

On CPU (``--device cpu``) time.perf_counter replaces CUDA events, large rows are smaller (``CPU_LARGE``: 4M
elements, past the L3 cache of small machines), the dtypes are float32 and bfloat16, the systems eager,
torch.compile and fuser (and ts_nnc where torch has LLVM), and each cell reads time per call and speed-up over
eager; ``--quick`` shrinks sizes and iteration counts for smoke tests. Output: a table on stdout, all raw numbers as JSON (``--json``), and a grouped bar
chart of the large rows' fractions of the floor (``--png``, needs matplotlib; skipped without it).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import typing
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

import fuser

# torch.jit.script and friends warn about TorchScript's deprecation since torch 2.11; the warning says
# nothing about the numbers measured here.
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SYSTEMS = ("eager", "ts_nnc", "ts_legacy", "compile", "fuser")
SIZES = ("large", "small")

# A working set this large streams from device memory whatever we do (H100/H200 L2 is 50 MB); smaller sets
# are rotated so back-to-back calls do not just re-read what the previous call left in L2.
ROTATE_BELOW_BYTES = 64 * 2 ** 20
N_ROTATED_SETS = 8

# max abs error allowed, relative to max |eager output|: fused systems compute half types in float and round
# once, eager rounds after every op, so a few ulps of the storage type are expected.
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


# ---------------------------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class Workload:
    """One benchmark function: TorchScript-compatible source and how to make its inputs."""

    name: str
    source: str  # defines one function named ``name``; valid as both Python and TorchScript
    shapes: dict  # size name ("large", "small", "quick") -> shape parameters for make_inputs
    make_inputs: Callable[[tuple, torch.dtype, torch.device], list]
    train: bool = False  # time forward + backward: gradients of every floating input for random output grads
    random: bool = False  # draws random numbers: outputs are checked for shape and dtype, not values
    dtypes: tuple = DTYPES


def _randn(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


WORKLOADS = (
    Workload(
        "mul_add",
        "def mul_add(a: Tensor, b: Tensor, c: Tensor) -> Tensor:\n"
        "    return a * b + c\n",
        {"large": (2 ** 26,), "small": (1024,), "quick": (2 ** 16,)},
        lambda s, dt, dev: [_randn(s, dt, dev) for _ in range(3)],
    ),
    Workload(
        "gelu_bias",
        "def gelu_bias(x: Tensor, b: Tensor) -> Tensor:\n"
        "    y = x + b\n"
        "    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))\n",
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s[1:], dt, dev)],
    ),
    Workload(
        "lstm_cell",
        "def lstm_cell(gates: Tensor, cx: Tensor) -> Tuple[Tensor, Tensor]:\n"
        "    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)\n"
        "    ingate = torch.sigmoid(ingate)\n"
        "    forgetgate = torch.sigmoid(forgetgate)\n"
        "    cellgate = torch.tanh(cellgate)\n"
        "    outgate = torch.sigmoid(outgate)\n"
        "    cy = forgetgate * cx + ingate * cellgate\n"
        "    hy = outgate * torch.tanh(cy)\n"
        "    return hy, cy\n",
        # (batch, hidden): gates are batch x 4*hidden, cx batch x hidden
        {"large": (16384, 2048), "small": (8, 32), "quick": (256, 128)},
        lambda s, dt, dev: [_randn((s[0], 4 * s[1]), dt, dev), _randn(s, dt, dev)],
    ),
    Workload(
        "silu_scale",
        "def silu_scale(x: Tensor, s: float) -> Tensor:\n"
        "    return x * torch.sigmoid(x) * s\n",
        {"large": (2 ** 26,), "small": (1024,), "quick": (2 ** 16,)},
        lambda s, dt, dev: [_randn(s, dt, dev), 1.7],
    ),
)


WORKLOADS += (
    Workload(
        "dropout_residual",
        "def dropout_residual(x: Tensor, bias: Tensor, residual: Tensor) -> Tensor:\n"
        "    return bias + (torch.rand_like(x) > 0.1).type_as(x) * x * (1.0 / 0.9) + residual\n",
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s[1:], dt, dev), _randn(s, dt, dev)],
        random=True,
    ),
)
_GELU_SRC = WORKLOADS[1].source.replace("def gelu_bias(", "def gelu_bias_train(")
_LSTM_SRC = WORKLOADS[2].source.replace("def lstm_cell(", "def lstm_cell_train(")
WORKLOADS += (
    Workload("gelu_bias_train", _GELU_SRC, WORKLOADS[1].shapes, WORKLOADS[1].make_inputs, train=True,
             dtypes=(torch.float32, torch.bfloat16)),
    Workload("lstm_cell_train", _LSTM_SRC, WORKLOADS[2].shapes, WORKLOADS[2].make_inputs, train=True,
             dtypes=(torch.float32, torch.bfloat16)),
)


def _train_step(fn: Callable) -> Callable:
    """fn's forward and backward: the inputs' gradients for the output gradients passed last."""
    def step(*args):
        inputs, grad_outputs = args[:-1], args[-1]
        wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        return torch.autograd.grad(_as_list(fn(*inputs)), wrt, grad_outputs)
    return step


def _python_function(wl: Workload) -> Callable:
    """A fresh Python function object from the workload's source (fresh code, so torch.compile's caches,
    keyed on the code object, start empty)."""
    namespace = {"torch": torch, "Tensor": torch.Tensor, "Tuple": typing.Tuple}
    exec(compile(wl.source, f"<fuser.bench:{wl.name}>", "exec"), namespace)
    return namespace[wl.name]


def _script_function(wl: Workload) -> torch.jit.ScriptFunction:
    """A fresh ScriptFunction: a new CompilationUnit each time, so no executor state (profiled shapes,
    legacy ArgumentSpecs, torch.jit.script's per-function cache) carries over between cells."""
    return getattr(torch.jit.CompilationUnit(wl.source), wl.name)


# ------------------------------------------------------------------------------------------------ systems

@contextlib.contextmanager
def _eager(wl: Workload) -> Iterator[Callable]:
    yield _python_function(wl)


@contextlib.contextmanager
def _ts_nnc(wl: Workload) -> Iterator[Callable]:
    yield _script_function(wl)


@contextlib.contextmanager
def _ts_legacy(wl: Workload) -> Iterator[Callable]:
    # The executor is chosen when a function first runs, so the flags must hold while the cell runs; they are
    # process-global, so they are restored afterwards for the other columns.
    old_profiling = torch._C._jit_set_profiling_executor(False)
    old_texpr = torch._C._jit_texpr_fuser_enabled()
    old_gpu = torch._C._jit_can_fuse_on_gpu()
    try:
        torch._C._jit_set_texpr_fuser_enabled(False)
        torch._C._jit_override_can_fuse_on_gpu(True)
        yield _script_function(wl)
    finally:
        torch._C._jit_set_profiling_executor(old_profiling)
        torch._C._jit_set_texpr_fuser_enabled(old_texpr)
        torch._C._jit_override_can_fuse_on_gpu(old_gpu)


@contextlib.contextmanager
def _compile(wl: Workload) -> Iterator[Callable]:
    torch._dynamo.reset()  # drop earlier cells' compiled code and guards
    try:
        yield torch.compile(_python_function(wl))
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def _fuser(wl: Workload) -> Iterator[Callable]:
    fuser.install()  # also keeps NNC off the pointwise ops, as a user of install() would have it
    try:
        yield fuser.fuse(_script_function(wl))
    finally:
        fuser.uninstall()


SYSTEM_CONTEXTS = {"eager": _eager, "ts_nnc": _ts_nnc, "ts_legacy": _ts_legacy, "compile": _compile,
                   "fuser": _fuser}


# ------------------------------------------------------------------------------------------------- timing

@dataclass(frozen=True)
class Config:
    """Iteration counts."""

    warmup: int  # calls after the first; must exceed the profiling executor's profiled runs
    warmup_s: float  # then keep calling for this long: clocks and caches settle over more than a few calls
    batch_calls: int  # back-to-back calls per timed batch (large rows)
    batches: int
    host_calls: int  # calls per host-time repeat (small rows)
    host_repeats: int
    copy_bytes: int
    copy_repeats: int


_PROFILED_RUNS = torch._C._jit_get_num_profiled_runs()
FULL = Config(warmup=max(5, _PROFILED_RUNS + 3), warmup_s=0.3, batch_calls=20, batches=7, host_calls=2000,
              host_repeats=5, copy_bytes=2 ** 30, copy_repeats=10)
QUICK = Config(warmup=max(4, _PROFILED_RUNS + 2), warmup_s=0.02, batch_calls=5, batches=3, host_calls=100,
               host_repeats=3, copy_bytes=2 ** 24, copy_repeats=5)

# ------------------------------------------------------------------------------------------------ the CPU
# Large rows on the CPU: calls of tens of ms, fewer per batch, more batches (a shared machine's stalls land in
# a few of them, and the median skips those)
CPU = Config(warmup=max(5, _PROFILED_RUNS + 3), warmup_s=0.3, batch_calls=3, batches=11, host_calls=500,
             host_repeats=7, copy_bytes=2 ** 28, copy_repeats=5)
CPU_LARGE = {"mul_add": (2 ** 22,), "gelu_bias": (1024, 4096), "lstm_cell": (1024, 1024), "silu_scale": (2 ** 22,),
             "dropout_residual": (1024, 4096)}  # the *_train rows take their forward's
CPU_DTYPES = (torch.float32, torch.bfloat16)


def cpu_name() -> str:
    """The processor's model name and core count (what the CPU rows ran on)."""
    model = platform.processor() or "cpu"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


def cpu_systems() -> tuple[str, ...]:
    """On the CPU: TorchScript's NNC only where torch was built with LLVM (else it is the interpreter), and not
    the legacy fuser (it fuses on CUDA only)."""
    return ("eager", *(("ts_nnc",) if torch._C._llvm_enabled() else ()), "compile", "fuser")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call_rotating(fn: Callable, sets: list, n: int) -> None:
    for i in range(n):
        fn(*sets[i % len(sets)])


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Keep Python's cyclic GC out of timed loops, as timeit does: a collection in one batch is noise."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def warm_up(fn: Callable, sets: list, device: torch.device, cfg: Config) -> int:
    """Run past the executors' profiling and optimizing calls, then for ``cfg.warmup_s`` more (a fixed few
    calls once left the first timed batches of a row several times slower than the rest). Returns calls."""
    _call_rotating(fn, sets, cfg.warmup)
    _sync(device)
    calls, t0 = cfg.warmup, time.perf_counter()
    while time.perf_counter() - t0 < cfg.warmup_s:
        _call_rotating(fn, sets, len(sets))
        _sync(device)
        calls += len(sets)
    return calls


def device_time_per_call_us(fn: Callable, sets: list, device: torch.device, cfg: Config) -> list[float]:
    """Per batch: device time of ``cfg.batch_calls`` back-to-back calls / batch_calls, in µs."""
    samples = []
    for _ in range(cfg.batches):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _call_rotating(fn, sets, cfg.batch_calls)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / cfg.batch_calls)
        else:
            t0 = time.perf_counter()
            _call_rotating(fn, sets, cfg.batch_calls)
            samples.append((time.perf_counter() - t0) * 1e6 / cfg.batch_calls)
    return samples


def host_time_per_call_us(fn: Callable, sets: list, device: torch.device, cfg: Config) -> list[float]:
    """Per repeat: wall clock of ``cfg.host_calls`` calls between synchronizations / host_calls, in µs."""
    samples = []
    for _ in range(cfg.host_repeats):
        _sync(device)
        t0 = time.perf_counter()
        _call_rotating(fn, sets, cfg.host_calls)
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e6 / cfg.host_calls)
    return samples


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """The time of one ``fn()`` in ms: CUDA events around it on CUDA (device time), perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_copy_rate(device: torch.device, cfg: Config) -> tuple[float, list[float]]:
    """Copy bandwidth in bytes/s (read + written) of ``dst.copy_(src)``: median and per-copy samples."""
    src = torch.ones(cfg.copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):  # first touches and allocator warm-up
        dst.copy_(src)
    _sync(device)
    rates = [2 * cfg.copy_bytes / (elapsed_ms(lambda: dst.copy_(src), device) / 1e3)
             for _ in range(cfg.copy_repeats)]
    del src, dst
    _free(device)
    return statistics.median(rates), rates


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- one cell

def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def max_abs_error(out, ref) -> float:
    """Largest |out - ref| over all outputs, in float64; inf when shapes or dtypes disagree."""
    outs, refs = _as_list(out), _as_list(ref)
    if len(outs) != len(refs):
        return math.inf
    err = 0.0
    for o, r in zip(outs, refs):
        if o.shape != r.shape or o.dtype != r.dtype:
            return math.inf
        if o.numel():
            err = max(err, (o.double() - r.double()).abs().max().item())
    return err


def _structure_error(out, ref) -> float:
    """0 when outputs match eager's in number, shapes and dtypes, else inf (random values cannot match)."""
    outs, refs = _as_list(out), _as_list(ref)
    same = len(outs) == len(refs) and all(o.shape == r.shape and o.dtype == r.dtype for o, r in zip(outs, refs))
    return 0.0 if same else math.inf


def _nbytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def run_cell(wl: Workload, system: str, size: str, sets: list, ref, device: torch.device,
             cfg: Config) -> dict:
    """Build ``system``'s function for ``wl``, check its first call and time it. Never raises: a failure
    is recorded under ``error``."""
    cell: dict = {}
    try:
        with SYSTEM_CONTEXTS[system](wl) as fn:
            if wl.train:
                fn = _train_step(fn)
            kernels_before = fuser.n_compiled_kernels()
            built_before = set(_fuser_build_ms())
            _sync(device)
            t0 = time.perf_counter()
            out = fn(*sets[0])
            _sync(device)
            cell["first_call_ms"] = (time.perf_counter() - t0) * 1e3
            cell["kernels_compiled_first_call"] = fuser.n_compiled_kernels() - kernels_before
            if system == "fuser":  # the kernel builds themselves (types, codegen, NVRTC, load)
                cell["kernel_build_ms"] = [ms for name, ms in _fuser_build_ms().items() if name not in built_before]
            cell["max_abs_err"] = max_abs_error(out, ref) if not wl.random else _structure_error(out, ref)
            del out
            cell["warmup_calls"] = warm_up(fn, sets, device, cfg)
            with _no_gc():
                if size == "large":
                    samples = cell["device_us_samples"] = device_time_per_call_us(fn, sets, device, cfg)
                else:
                    samples = cell["host_us_samples"] = host_time_per_call_us(fn, sets, device, cfg)
            cell["us_per_call"] = statistics.median(samples)
            if system == "fuser":
                cell["fuser_kernels_compiled_total"] = fuser.n_compiled_kernels() - kernels_before
    except Exception as e:  # one broken system must not end the run
        cell["error"] = f"{type(e).__name__}: {e}".strip()[:1000]
        with contextlib.suppress(Exception):
            _sync(device)
        _free(device)
    return cell


# ----------------------------------------------------------------------------------------------- one row

def run_row(wl: Workload, dtype: torch.dtype, size: str, systems: Sequence[str], device: torch.device,
            cfg: Config, quick: bool, copy_rate: float) -> dict:
    """All systems on one (workload, dtype, size)."""
    shape = wl.shapes["quick" if quick and size == "large" else size]
    if device.type == "cpu" and size == "large" and not quick:
        shape = CPU_LARGE.get(wl.name.removesuffix("_train"), shape)
    torch.manual_seed(0)
    make = wl.make_inputs
    if wl.train:  # floating inputs require grad; the output gradients ride along as the last argument
        def make(s, dt, dev):
            inputs = [v.requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for v in wl.make_inputs(s, dt, dev)]
            with torch.no_grad():
                outs = _as_list(_python_function(wl)(*inputs))
            return [*inputs, tuple(torch.randn_like(o) for o in outs)]
    first = make(shape, dtype, device)
    set_bytes = _nbytes(first) if not wl.train else _nbytes(first[:-1]) + _nbytes(first[-1])
    n_sets = 1 if set_bytes >= ROTATE_BELOW_BYTES else N_ROTATED_SETS
    sets = [first] + [make(shape, dtype, device) for _ in range(n_sets - 1)]
    eager_fn = _python_function(wl)
    ref = (_train_step(eager_fn) if wl.train else eager_fn)(*first)
    _sync(device)
    if wl.train:
        # forward: inputs read, outputs written; backward: output gradients and inputs read, gradients written
        with torch.no_grad():
            outs = _as_list(eager_fn(*first[:-1]))
        traffic = 2 * _nbytes(first[:-1]) + _nbytes(outs) + _nbytes(first[-1]) + _nbytes(_as_list(ref))
        del outs
    else:
        traffic = set_bytes + _nbytes(_as_list(ref))
    floor_us = traffic / copy_rate * 1e6
    row = {"workload": wl.name, "dtype": str(dtype).replace("torch.", ""), "size": size, "device_type": device.type,
           "input_shapes": [list(v.shape) if isinstance(v, torch.Tensor) else repr(v)
                            for v in (first[:-1] if wl.train else first)],
           "n_input_sets": n_sets, "bytes_per_call": traffic, "floor_us": floor_us, "cells": {}}
    ref_scale = max((r.abs().max().item() for r in _as_list(ref) if r.numel()), default=0.0)
    for system in systems:
        t0 = time.perf_counter()
        cell = run_cell(wl, system, size, sets, ref, device, cfg)
        cell["cell_wall_s"] = time.perf_counter() - t0
        if "max_abs_err" in cell:
            cell["mismatch"] = not cell["max_abs_err"] <= REL_TOL[dtype] * max(1.0, ref_scale)
        if size == "large" and "us_per_call" in cell:
            cell["fraction_of_floor"] = floor_us / cell["us_per_call"]
        row["cells"][system] = cell
    del sets, first, ref
    _free(device)
    return row


# ----------------------------------------------------------------------------------------------- reports

def _cell_text(row: dict, system: str) -> str:
    cell = row["cells"].get(system)
    if cell is None:
        return "-"
    if "error" in cell:
        return "ERR"
    flag = "!" if cell.get("mismatch") else ""
    if row.get("device_type") == "cpu":  # time per call, and speed-up over eager
        eager = row["cells"].get("eager", {}).get("us_per_call")
        speedup = f" {eager / cell['us_per_call']:.2f}x" if eager else ""
        return f"{cell['us_per_call']:.0f}us{speedup}{flag}" if row["size"] == "large" else \
            f"{cell['us_per_call']:.1f}us{speedup}{flag}"
    if row["size"] == "large":
        return f"{cell['fraction_of_floor']:.2f} ({cell['us_per_call']:.0f}us){flag}"
    return f"{cell['us_per_call']:.1f}us{flag}"


def format_table(rows: list[dict], systems: Sequence[str]) -> str:
    """One line per row, one column per system: large rows 'fraction of floor (µs per call)', small rows
    host µs per call. '!' marks a result that differs from eager's beyond tolerance."""
    header = ["workload", "dtype", "size", *systems]
    lines = [[r["workload"], r["dtype"], r["size"], *(_cell_text(r, s) for s in systems)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [fmt(header), fmt(["-" * w for w in widths]), *(fmt(l) for l in lines)]
    errors = [f"  {r['workload']}/{r['dtype']}/{r['size']}/{s}: {c['error'].splitlines()[0][:200]}"
              for r in rows for s, c in r["cells"].items() if "error" in c]
    if errors:
        out += ["", "errors:", *errors]
    mismatches = [f"  {r['workload']}/{r['dtype']}/{r['size']}/{s}: max abs err {c['max_abs_err']:.3g}"
                  for r in rows for s, c in r["cells"].items() if c.get("mismatch")]
    if mismatches:
        out += ["", "results differing from eager:", *mismatches]
    return "\n".join(out)


def _fuser_build_ms() -> dict:
    """name -> build time (ms) of every kernel fuser has built in this process."""
    from fuser.kernel_cache import STORE
    out = {}
    for key in range(len(STORE)):
        for k in STORE.get(key).kernels().values():
            if k is not None:
                out[k.name] = k.build_ms
    return out


def fuser_first_calls(rows: list[dict]) -> dict:
    """Per 'workload/dtype': fuser's first-call wall time (ms) from the first row that ran it, the one where
    its kernels were compiled (a later size with the same arg spec reuses them)."""
    result = {}
    for r in rows:
        cell = r["cells"].get("fuser", {})
        key = f"{r['workload']}/{r['dtype']}"
        if key not in result and "first_call_ms" in cell:
            result[key] = {"ms": cell["first_call_ms"], "size": r["size"],
                           "kernels_compiled": cell["kernels_compiled_first_call"],
                           "kernel_build_ms": cell.get("kernel_build_ms", [])}
    return result


def draw_chart(rows: list[dict], systems: Sequence[str], path: str, title: str) -> Optional[str]:
    """Grouped bars of the large rows' fraction of floor; returns why it was skipped, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    large = [r for r in rows if r["size"] == "large"]
    if not large:
        return "no large rows"
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(large) + 2), 4.8))
    for k, system in enumerate(systems):
        heights = [r["cells"].get(system, {}).get("fraction_of_floor", math.nan) for r in large]
        ax.bar([i + (k - (len(systems) - 1) / 2) * width for i in range(len(large))], heights, width,
               label=system)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(large)))
    ax.set_xticklabels([f"{r['workload']}\n{r['dtype']}" for r in large], fontsize=8)
    ax.set_ylabel("fraction of copy-bandwidth floor")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=len(systems))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _versions() -> dict:
    info = {"torch": torch.__version__, "fuser": fuser.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda}
    with contextlib.suppress(Exception):
        import triton
        info["triton"] = triton.__version__
    return info


# -------------------------------------------------------------------------------------------------- main

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fuser.bench", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few iterations (smoke test)")
    p.add_argument("--only", default="", help="run only workloads whose name contains this substring")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    p.add_argument("--json", default="bench_results.json", help="where to write all raw numbers")
    p.add_argument("--png", default="bench_results.png", help="where to draw the chart (needs matplotlib)")
    p.add_argument("--models", action="store_true",
                   help="time the model zoo instead (fuser/bench_models.py): ms per forward of Hugging Face models "
                        "for eager, ts_nnc, fuser, compile; --only filters models")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="with --models: the models' dtype")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    systems = SYSTEMS
    if args.models:
        from . import bench_models
        systems = bench_models.SYSTEMS
        if args.systems == list(SYSTEMS):  # the default: every system of this mode
            args.systems = list(systems)
    if args.device == "cpu" and not args.models and args.systems == list(SYSTEMS):
        args.systems = list(cpu_systems())
    unknown = sorted(set(args.systems) - set(systems))
    if unknown or not args.systems:
        p.error(f"unknown systems {unknown}; choose from {','.join(systems)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.models:
        from . import bench_models
        return bench_models.main(args)
    device = torch.device(args.device)
    cfg = QUICK if args.quick else CPU if device.type == "cpu" else FULL
    workloads = [wl for wl in WORKLOADS if args.only in wl.name]
    if not workloads:
        print(f"no workload matches --only {args.only!r}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    copy_rate, copy_samples = measure_copy_rate(device, cfg)
    print(f"device: {device_name}  torch {torch.__version__}  copy rate {copy_rate / 1e9:.1f} GB/s "
          f"(read + write)", file=sys.stderr)

    rows = []
    for wl in workloads:
        for size in SIZES:
            for dtype in [d for d in wl.dtypes if device.type != "cpu" or d in CPU_DTYPES]:
                t0 = time.perf_counter()
                rows.append(run_row(wl, dtype, size, args.systems, device, cfg, args.quick, copy_rate))
                print(f"  {wl.name:<10} {str(dtype)[6:]:<9} {size:<5} {time.perf_counter() - t0:6.1f}s",
                      file=sys.stderr)
    elapsed = time.perf_counter() - started

    first_calls = fuser_first_calls(rows)
    print(f"\n{device_name}, torch {torch.__version__}, copy rate {copy_rate / 1e9:.1f} GB/s; "
          + ("time per call and speed-up over eager (large rows: median of batches; small rows: host time), "
             f"{torch.get_num_threads()} threads\n" if device.type == "cpu" else
             "large rows: fraction of copy floor (us per call, device time); small rows: host us per call\n"))
    print(format_table(rows, args.systems))
    if first_calls:
        print("\nfuser_first_call_ms (first call of the fused function, compile included):")
        for key, v in first_calls.items():
            builds = ", ".join(f"{ms:.1f}" for ms in v["kernel_build_ms"]) or "-"
            print(f"  {key:<22} {v['ms']:8.1f} ms  ({v['kernels_compiled']} kernels compiled, {v['size']}; "
                  f"kernel build ms: {builds})")
    print(f"\ntotal {elapsed:.1f}s")

    result = {
        "meta": {"device": device_name, "device_type": device.type, **_versions(),
                 "copy_rate_bytes_per_s": copy_rate, "copy_rate_samples_bytes_per_s": copy_samples,
                 "copy_bytes": cfg.copy_bytes, "config": dataclasses.asdict(cfg), "quick": args.quick,
                 "systems": args.systems, "fuser_can_fuse_on_gpu": fuser.can_fuse_on_gpu(),
                 "fuser_can_fuse_on_cpu": fuser.can_fuse_on_cpu(), "elapsed_s": elapsed,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "fuser_first_call_ms": {k: v["ms"] for k, v in first_calls.items()},
        "fuser_first_call": first_calls,
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.json}")
    title = f"{device_name}, torch {torch.__version__}, copy {copy_rate / 1e9:.0f} GB/s"
    skipped = draw_chart(rows, args.systems, args.png, title)
    print(f"skipped {args.png}: {skipped}" if skipped else f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
