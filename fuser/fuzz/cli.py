"""A differential fuzzer: random pointwise graphs over the op table, fused vs eager PyTorch.

``python -m fuser.fuzz``: the command line of a campaign (the package docstring of :mod:`fuser.fuzz` says what
it does)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .campaign import report_failures, run_campaign


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuser.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", type=int, default=1000, help="graphs to generate (default 1000)")
    ap.add_argument("--seed", type=int, default=None, help="campaign seed (default: random)")
    ap.add_argument("--start", type=int, default=0, help="index of the first graph (to replay one: --start I "
                                                          "--graphs 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--time-budget", type=float, default=None, help="stop generating after this many seconds")
    ap.add_argument("--out", default="fuzz_failures", help="where reproducers go (default ./fuzz_failures)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                    help="worker processes (1: run in this process)")
    ap.add_argument("--max-numel", type=int, default=None, help="largest map (default 1e5 cpu, 4e6 cuda)")
    ap.add_argument("--max-ops", type=int, default=40)
    ap.add_argument("--variants", type=int, default=2, help="input sets per graph")
    ap.add_argument("--max-shrink", type=int, default=8, help="mismatches to shrink")
    ap.add_argument("--shrink-budget", type=float, default=120.0, help="seconds per shrink")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from .. import settings
    if not settings.fusion_enabled(args.device):
        print(f"warning: {args.device} fusion is off here (no compiler / driver): everything falls back",
              file=sys.stderr)
    print(f"fuser fuzz: seed {seed}, device {args.device}, up to {args.graphs} graphs"
          + (f", {args.time_budget:.0f} s" if args.time_budget else ""), flush=True)
    camp = run_campaign(args.graphs, seed, args.device, args.time_budget, args.jobs, args.max_numel, args.max_ops,
                        args.variants, log=lambda s: print(s, flush=True), start=args.start)
    print(camp.summary(), flush=True)
    report_failures(camp, args.out, args.max_shrink, args.shrink_budget, log=lambda s: print(s, flush=True))
    return 1 if camp.failures else 0
