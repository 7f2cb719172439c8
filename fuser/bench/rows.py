"""One row of the benchmark: every system on one (workload, dtype, size), on the same inputs, each cell's
first call checked against eager's output and then timed."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import statistics
import time
from typing import Sequence

import torch

import fuser
from fuser import native

from .caches import own_builds
from .cpu import cpu_shape
from .systems import INTERLEAVED_SYSTEMS, SYSTEM_CONTEXTS, systems_side_by_side
from .timing import (Config, _free, _no_gc, _sync, device_time_per_call_us, host_time_per_call_us,
                     warm_up)
from .workloads import Workload, _as_list, _python_function, _train_step


SIZES = ("large", "small")

# A working set this large streams from device memory whatever we do (H100/H200 L2 is 50 MB); smaller sets
# are rotated so back-to-back calls do not just re-read what the previous call left in L2.
ROTATE_BELOW_BYTES = 64 * 2 ** 20
N_ROTATED_SETS = 8

# max abs error allowed, relative to max |eager output|: fused systems compute half types in float and round
# once, eager rounds after every op, so a few ulps of the storage type are expected.
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
FUSER_SYSTEMS = ("fuser", "compile_fuser")


def _fuser_build_ms() -> dict:
    """name -> build time (ms) of every kernel fuser has built in this process."""
    from fuser.kernel_cache import STORE
    out = {}
    for key in range(len(STORE)):
        for k in STORE.get(key).kernels().values():
            if k is not None:
                out[k.name] = k.build_ms
    return out


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
    """Bytes the tensors hold: an expanded (stride-0) dim counts once, as a broadcast operand is read once."""
    return sum(math.prod(s for s, st in zip(v.shape, v.stride()) if st != 0) * v.element_size() * (v.numel() > 0)
               for v in values if isinstance(v, torch.Tensor))


def _first_call(wl: Workload, system: str, fn, sets: list, ref, device: torch.device, cfg: Config,
                cell: dict) -> int:
    """``fn``'s first call, timed (its builds) and checked against eager's ``ref``, then its warm-up; into
    ``cell``. Returns the process's compiled kernels before it (for :func:`_finish`)."""
    kernels_before = fuser.n_compiled_kernels()
    # a fuser system's first call builds its kernels even where the other fuser system of the row made the same
    # group and built them already in this process (caches.own_builds)
    with own_builds() if system in FUSER_SYSTEMS else contextlib.nullcontext():
        built_before = set(_fuser_build_ms())
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*sets[0])
        _sync(device)
        cell["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        if system in FUSER_SYSTEMS:  # the kernel builds themselves (types, codegen, NVRTC, load)
            cell["kernel_build_ms"] = [ms for name, ms in _fuser_build_ms().items() if name not in built_before]
    cell["kernels_compiled_first_call"] = fuser.n_compiled_kernels() - kernels_before
    cell["max_abs_err"] = max_abs_error(out, ref) if not wl.random else _structure_error(out, ref)
    del out
    cell["warmup_calls"] = warm_up(fn, sets, device, cfg)
    return kernels_before


# what the process did during a cell's timed calls (getrusage of the whole process, every thread): the processor time
# besides the wall clock, page faults and context switches, per call (``process_per_call``); and the machine's steal
# time (a virtual machine's processors running another guest: /proc/stat, every processor, Linux only)
_USAGE = ("ru_utime", "ru_stime", "ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")
_TICK_S = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _steal_s() -> float:
    """Seconds of steal time of every processor since boot (0 where /proc/stat has none)."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
        return int(fields[8]) * _TICK_S if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def _samples(fn, size: str, sets: list, device: torch.device, cfg: Config,
             cell: dict) -> tuple[str, list[float]]:
    """(the cell's key, samples) of ``cfg.batches`` batches (large rows: device time) or ``cfg.host_repeats``
    repeats (small rows: host time); the process's usage over them added to ``cell["_usage"]``."""
    u0, steal0 = resource.getrusage(resource.RUSAGE_SELF), _steal_s()
    with _no_gc():
        if size == "large":
            key, got = "device_us_samples", device_time_per_call_us(fn, sets, device, cfg)
        else:
            key, got = "host_us_samples", host_time_per_call_us(fn, sets, device, cfg)
    u1, steal1 = resource.getrusage(resource.RUSAGE_SELF), _steal_s()
    calls = len(got) * (cfg.batch_calls if size == "large" else cfg.host_calls)  # each sample's calls
    acc = cell.setdefault("_usage", [0] * (len(_USAGE) + 2))
    acc[0] += calls
    for k, name in enumerate(_USAGE, 1):
        acc[k] += getattr(u1, name) - getattr(u0, name)
    acc[-1] += steal1 - steal0
    return key, got


def _threads() -> int:
    """The process's threads now (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            return next((int(ln.split()[1]) for ln in fh if ln.startswith("Threads:")), 0)
    except OSError:
        return 0


def _usage_per_call(cell: dict) -> None:
    acc = cell.pop("_usage", None)
    if not acc or not acc[0]:
        return
    n = acc[0]
    cell["process_per_call"] = {"user_us": acc[1] / n * 1e6, "sys_us": acc[2] / n * 1e6, "minor_faults": acc[3] / n,
                                "major_faults": acc[4] / n, "voluntary_switches": acc[5] / n,
                                "involuntary_switches": acc[6] / n, "machine_steal_us": acc[7] / n * 1e6,
                                "threads": _threads()}


def _finish(system: str, fn, size: str, sets: list, device: torch.device, cfg: Config, cell: dict,
            kernels_before: int) -> None:
    """A timed cell's median, and for fuser's systems the host phases (small rows) and kernels built."""
    key = "device_us_samples" if size == "large" else "host_us_samples"
    cell["us_per_call"] = statistics.median(cell[key])
    _usage_per_call(cell)
    if system in FUSER_SYSTEMS:
        if size != "large":
            cell.update(_host_phases(fn, sets, device, cfg))
        cell["fuser_kernels_compiled_total"] = fuser.n_compiled_kernels() - kernels_before


def _failed(cell: dict, e: Exception, device: torch.device) -> None:
    cell.pop("_usage", None)
    cell["error"] = f"{type(e).__name__}: {e}".strip()[:1000]
    with contextlib.suppress(Exception):
        _sync(device)
    _free(device)


def run_cell(wl: Workload, system: str, size: str, sets: list, ref, device: torch.device,
             cfg: Config) -> dict:
    """Build ``system``'s function for ``wl``, check its first call and time it. Never raises: a failure
    is recorded under ``error``."""
    cell: dict = {}
    try:
        with SYSTEM_CONTEXTS[system](wl) as fn:
            if wl.train:
                fn = _train_step(fn)
            before = _first_call(wl, system, fn, sets, ref, device, cfg, cell)
            key, cell[key] = _samples(fn, size, sets, device, cfg, cell)
            _finish(system, fn, size, sets, device, cfg, cell, before)
    except Exception as e:  # one broken system must not end the run
        _failed(cell, e, device)
    return cell


def run_cells_interleaved(wl: Workload, systems: Sequence[str], size: str, sets: list, ref,
                          device: torch.device, cfg: Config) -> dict:
    """Every system's function built, checked and warmed up first, all alive at once, then timed in rounds: a
    round takes one batch (large rows) or one host-time repeat (small rows) of each system in turn, the order
    rotated from round to round, so that a shared machine's slow seconds fall on every system alike rather than on
    whichever cell ran then. Each cell's median over the rounds. For systems that can run side by side
    (:data:`INTERLEAVED_SYSTEMS`); never raises: a failing system is recorded under ``error`` and leaves the
    rounds."""
    cells: dict = {s: {} for s in systems}
    live: dict = {}
    before: dict = {}  # per system: the compiled kernels before its first call
    one = dataclasses.replace(cfg, batches=1, host_repeats=1)
    with contextlib.ExitStack() as stack, systems_side_by_side():
        for system in systems:
            t0 = time.perf_counter()
            try:
                fn = stack.enter_context(SYSTEM_CONTEXTS[system](wl))
                if wl.train:
                    fn = _train_step(fn)
                before[system] = _first_call(wl, system, fn, sets, ref, device, cfg, cells[system])
                live[system] = fn
            except Exception as e:
                _failed(cells[system], e, device)
            cells[system]["cell_wall_s"] = time.perf_counter() - t0
        rounds = cfg.batches if size == "large" else cfg.host_repeats
        for r in range(rounds):
            order = list(live)
            order = order[r % len(order):] + order[:r % len(order)] if order else order
            for system in order:
                t0 = time.perf_counter()
                try:
                    key, got = _samples(live[system], size, sets, device, one, cells[system])
                    cells[system].setdefault(key, []).extend(got)
                except Exception as e:
                    _failed(cells[system], e, device)
                    del live[system]
                cells[system]["cell_wall_s"] += time.perf_counter() - t0
        for system, fn in live.items():
            try:
                _finish(system, fn, size, sets, device, cfg, cells[system], before[system])
            except Exception as e:
                _failed(cells[system], e, device)
    for cell in cells.values():
        cell["interleaved"] = True
    return cells


def _host_phases(fn, sets: list, device: torch.device, cfg: Config) -> dict:
    """One more repeat of host timing with the native hot path's phase clock on (``fuser.native.phases``): the
    calls it served per call of ``fn`` (a call may run several groups; 0: every call went through Python) and
    each phase's µs per call of ``fn``. The clock's own reads (about 20-50 ns a phase) are in its figures."""
    if native.phases(True) is None:
        return {}
    try:
        host_time_per_call_us(fn, sets, device, dataclasses.replace(cfg, host_repeats=1))
    finally:
        got = native.phases(False)
    n = cfg.host_calls
    return {"native_calls_per_call": got["calls"] / n,
            "host_phases_us": {p: got[p] / n / 1e3 for p in native.PHASES}}


def run_row(wl: Workload, dtype: torch.dtype, size: str, systems: Sequence[str], device: torch.device,
            cfg: Config, quick: bool, copy_rate: float, interleave: bool = False) -> dict:
    """All systems on one (workload, dtype, size): one cell after another, or (``interleave``, where every
    system is one of :data:`INTERLEAVED_SYSTEMS`) timed in interleaved rounds (:func:`run_cells_interleaved`)."""
    shape = wl.shapes["quick" if quick and size == "large" else size]
    if device.type == "cpu" and size == "large" and not quick:
        shape = cpu_shape(wl.name, shape)
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
    if interleave and len(systems) > 1 and set(systems) <= set(INTERLEAVED_SYSTEMS):
        cells = run_cells_interleaved(wl, systems, size, sets, ref, device, cfg)
    else:
        cells = {}
        for system in systems:
            t0 = time.perf_counter()
            cells[system] = run_cell(wl, system, size, sets, ref, device, cfg)
            cells[system]["cell_wall_s"] = time.perf_counter() - t0
    for system in systems:
        cell = cells[system]
        if "max_abs_err" in cell:
            cell["mismatch"] = not cell["max_abs_err"] <= REL_TOL[dtype] * max(1.0, ref_scale)
        if size == "large" and "us_per_call" in cell:
            cell["fraction_of_floor"] = floor_us / cell["us_per_call"]
        row["cells"][system] = cell
    del sets, first, ref
    _free(device)
    return row
