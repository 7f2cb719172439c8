"""How the benchmark times: iteration counts, warm-up, device time of back-to-back batches (large rows),
host time per call (small rows), and the copy rate that sets the floor."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


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


def measure_host_floor(device: torch.device, cfg: Config) -> dict:
    """PyTorch's own host time per call on ``device`` (µs, median of ``cfg.host_repeats``): one eager op on a small
    tensor (``eager_op``), and an eager training step of that op, ``torch.autograd.grad(x * 2, x, g)`` (its
    backward one more op: ``eager_train_step``). Every system's training step pays the autograd engine's part of the
    latter (on CUDA it hands the backward to a thread of its own and back), so a training row whose kernels take
    about that long is bound by the host as much as by the device."""
    x = torch.randn(8, 512, device=device)
    xg, g = x.clone().requires_grad_(), torch.randn_like(x)
    got = {}
    for name, fn in (("eager_op", lambda: x * 2), ("eager_train_step", lambda: torch.autograd.grad(xg * 2, xg, g))):
        for _ in range(cfg.warmup):
            fn()
        got[name] = statistics.median(host_time_per_call_us(lambda *_: fn(), [()], device, cfg))
    return got


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
