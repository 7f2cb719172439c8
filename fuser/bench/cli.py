"""Benchmark fuser against eager, TorchScript (NNC and the legacy C++ fuser) and torch.compile.

``python -m fuser.bench``: the command line (the package docstring of :mod:`fuser.bench` says what it
measures and how)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Optional, Sequence

import torch

import fuser

from .caches import COLD_CACHES, cold_caches  # noqa: F401 (COLD_CACHES: the tests read it here)
from .cpu import CPU, CPU_DTYPES, cpu_name, cpu_systems
from .report import _versions, draw_chart, first_call_table, format_table, fuser_first_calls, host_phases_table
from .rows import SIZES, run_row
from .systems import INTERLEAVED_SYSTEMS, SYSTEMS
from .timing import FULL, QUICK, measure_copy_rate, measure_host_floor
from .workloads import WORKLOADS


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fuser.bench", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few iterations (smoke test)")
    p.add_argument("--only", default="", help="run only workloads whose name contains this substring; a comma list "
                   "of them, each a substring or, after '=', an exact name (--only =softmax_scale,=sum0_mul)")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma list from {','.join(SIZES)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="time a row's systems in interleaved rounds, a batch of each in turn (the default on the CPU, "
                   "whose shared cores' speed drifts between cells; --no-interleave: one cell after another, the "
                   "default on CUDA); only where every system is one of " + ",".join(INTERLEAVED_SYSTEMS))
    p.add_argument("--json", default="bench_results.json", help="where to write all raw numbers")
    p.add_argument("--png", default="bench_results.png", help="where to draw the chart (needs matplotlib)")
    p.add_argument("--models", action="store_true",
                   help="time the model zoo instead (fuser/bench/models.py): ms per forward of Hugging Face models "
                        "for eager, ts_nnc, fuser, compile; --only filters models")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="with --models: the models' dtype")
    p.add_argument("--warm-caches", action="store_true",
                   help="keep the compilers' caches on disk (by default a run starts them empty: first calls are "
                        "cold compiles)")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if set(args.sizes) - set(SIZES) or not args.sizes:
        p.error(f"unknown sizes {sorted(set(args.sizes) - set(SIZES))}; choose from {','.join(SIZES)}")
    systems = SYSTEMS
    if args.models:
        from . import models
        systems = models.SYSTEMS
        if args.systems == list(SYSTEMS):  # the default: every system of this mode
            args.systems = list(systems)
    if args.device == "cpu" and not args.models and args.systems == list(SYSTEMS):
        args.systems = list(cpu_systems())
    unknown = sorted(set(args.systems) - set(systems))
    if unknown or not args.systems:
        p.error(f"unknown systems {unknown}; choose from {','.join(systems)}")
    if args.interleave is None:
        args.interleave = args.device == "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--warm-caches", action="store_true")
    with contextlib.ExitStack() as stack:
        if not pre.parse_known_args(argv)[0].warm_caches:
            stack.enter_context(cold_caches())
        return _main(parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    if args.models:
        from . import models
        return models.main(args)
    device = torch.device(args.device)
    cfg = QUICK if args.quick else CPU if device.type == "cpu" else FULL
    workloads = [wl for wl in WORKLOADS if _selected(wl.name, args.only)]
    if not workloads:
        print(f"no workload matches --only {args.only!r}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    copy_rate, copy_samples = measure_copy_rate(device, cfg)
    host_floor = measure_host_floor(device, cfg)
    print(f"device: {device_name}  torch {torch.__version__}  copy rate {copy_rate / 1e9:.1f} GB/s "
          f"(read + write); {_floor_text(host_floor)}", file=sys.stderr)

    rows = []

    def write_json(complete: bool) -> None:
        # rewritten after every row, so a run cut short (a time limit) keeps the rows it measured
        first = fuser_first_calls(rows)
        result = {
            "meta": {"device": device_name, "device_type": device.type, **_versions(),
                     "copy_rate_bytes_per_s": copy_rate, "copy_rate_samples_bytes_per_s": copy_samples,
                     "copy_bytes": cfg.copy_bytes, "host_floor_us": host_floor,
                     "config": dataclasses.asdict(cfg), "quick": args.quick,
                     "systems": args.systems, "interleaved": args.interleave,
                     "fuser_can_fuse_on_gpu": fuser.can_fuse_on_gpu(),
                     "fuser_can_fuse_on_cpu": fuser.can_fuse_on_cpu(), "elapsed_s": time.perf_counter() - started,
                     "complete": complete, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "fuser_first_call_ms": {k: v["ms"] for k, v in first.items()},
            "fuser_first_call": first,
            "rows": rows,
        }
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, args.json)

    for wl in workloads:
        for size in [s for s in SIZES if s in args.sizes]:
            for dtype in [d for d in wl.dtypes if device.type != "cpu" or d in CPU_DTYPES]:
                t0 = time.perf_counter()
                rows.append(run_row(wl, dtype, size, args.systems, device, cfg, args.quick, copy_rate,
                                    args.interleave))
                print(f"  {wl.name:<10} {str(dtype)[6:]:<9} {size:<5} {time.perf_counter() - t0:6.1f}s",
                      file=sys.stderr)
                write_json(complete=False)
    elapsed = time.perf_counter() - started

    first_calls = fuser_first_calls(rows)
    print(f"\n{device_name}, torch {torch.__version__}, copy rate {copy_rate / 1e9:.1f} GB/s, "
          f"{_floor_text(host_floor)}; "
          + ("time per call and speed-up over eager (large rows: median of batches; small rows: host time), "
             f"{torch.get_num_threads()} threads\n" if device.type == "cpu" else
             "large rows: fraction of copy floor (us per call, device time); small rows: host us per call\n"))
    print(format_table(rows, args.systems))
    phases = host_phases_table(rows, args.systems)
    if phases:
        print("\n" + phases)
    if first_calls:
        print("\nfuser_first_call_ms (first call of the fused function, compile included):")
        for key, v in first_calls.items():
            builds = ", ".join(f"{ms:.1f}" for ms in v["kernel_build_ms"]) or "-"
            print(f"  {key:<22} {v['ms']:8.1f} ms  ({v['kernels_compiled']} kernels compiled, {v['size']}; "
                  f"kernel build ms: {builds})")
    compiles = first_call_table(rows, args.systems)
    if compiles:
        print("\n" + compiles)
    print(f"\ntotal {elapsed:.1f}s")

    write_json(complete=True)
    print(f"wrote {args.json}")
    title = f"{device_name}, torch {torch.__version__}, copy {copy_rate / 1e9:.0f} GB/s"
    skipped = draw_chart(rows, args.systems, args.png, title)
    print(f"skipped {args.png}: {skipped}" if skipped else f"wrote {args.png}")
    return 0


def _floor_text(floor: dict) -> str:
    """The host floor (``timing.measure_host_floor``) in words."""
    return (f"host: an eager op {floor['eager_op']:.1f} us, an eager one-op training step "
            f"{floor['eager_train_step']:.1f} us")


def _selected(name: str, only: str) -> bool:
    """Whether ``--only`` selects workload ``name``: any of its comma-separated parts, a substring or '=' a name."""
    return any(name == part[1:] if part.startswith("=") else part in name for part in only.split(","))
