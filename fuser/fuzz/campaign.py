"""Campaigns: graphs of one seed run in worker processes (two input sets each), counted and summarized; then
mismatches shrunk and saved as reproducers."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from .generator import _inputs_for_variant, build_case
from .ir import render
from .judge import Verdict, check_program
from .program import CATALOG, DTYPE_NAMES, REDUCTION_CATALOG, VIEW_CATALOG
from .repro import reproducer
from .shrinker import shrink
from .worker import Evaluator, _worker_init


# ----------------------------------------------------------------------------------------------------------
# one graph of a campaign (runs in a worker process)


@dataclass
class GraphResult:
    index: int
    runs: int = 0
    fused: int = 0
    raises: int = 0
    reasons: dict = field(default_factory=dict)
    judged: int = 0
    total: int = 0
    finite: int = 0
    n_ops: int = 0
    ops: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # [(variant, Program, Verdict)]
    seconds: float = 0.0


def run_graph(seed: int, index: int, device: str = "cpu", max_numel: int = 100_000, max_ops: int = 40,
              variants: int = 2) -> GraphResult:
    t0 = time.perf_counter()
    res = GraphResult(index)
    g = build_case(seed, index, max_numel, max_ops)
    res.n_ops = len(g.program.nodes)
    for n in g.program.nodes:
        res.ops[n.schema.id] = res.ops.get(n.schema.id, 0) + 1
    for v in range(variants):
        p = _inputs_for_variant(g, v, seed, index, max_numel)
        for t in p.tensors:
            res.dtypes[DTYPE_NAMES[t.dtype]] = res.dtypes.get(DTYPE_NAMES[t.dtype], 0) + 1
            res.layouts[t.layout] = res.layouts.get(t.layout, 0) + 1
        try:
            verdict = check_program(p, device)
        except Exception as ex:  # noqa: BLE001 (a bug of the fuzzer itself, or of parsing)
            verdict = Verdict(False, "fuzzer_error", "".join(traceback.format_exception(ex))[-3000:])
        res.runs += 1
        if verdict.kind == "raises":
            res.raises += 1
        elif verdict.fused:
            res.fused += 1
        else:
            res.reasons[verdict.reason] = res.reasons.get(verdict.reason, 0) + 1
        res.judged += verdict.judged
        res.total += verdict.total
        res.finite += verdict.finite
        if not verdict.ok:
            res.failures.append((v, p, verdict))
    res.seconds = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------------------------------------
# campaigns


@dataclass
class Campaign:
    seed: int
    device: str
    graphs: int = 0
    runs: int = 0
    fused: int = 0
    raises: int = 0
    reasons: collections.Counter = field(default_factory=collections.Counter)
    judged: int = 0
    total: int = 0
    finite: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)
    dtypes: collections.Counter = field(default_factory=collections.Counter)
    layouts: collections.Counter = field(default_factory=collections.Counter)
    n_ops: collections.Counter = field(default_factory=collections.Counter)
    failures: list = field(default_factory=list)  # [(index, variant, Program, Verdict)]
    seconds: float = 0.0

    def add(self, r: GraphResult):
        self.graphs += 1
        self.runs += r.runs
        self.fused += r.fused
        self.raises += r.raises
        self.reasons.update(r.reasons)
        self.judged += r.judged
        self.total += r.total
        self.finite += r.finite
        self.ops.update(r.ops)
        self.dtypes.update(r.dtypes)
        self.layouts.update(r.layouts)
        self.n_ops[min(40, (r.n_ops + 4) // 5 * 5)] += 1
        for v, p, verdict in r.failures:
            self.failures.append((r.index, v, p, verdict))

    def summary(self) -> str:
        not_raising = self.runs - self.raises
        lines = [
            f"seed {self.seed} on {self.device}: {self.graphs} graphs, {self.runs} runs in {self.seconds:.0f} s",
            f"  fused {self.fused} of {not_raising} runs where eager does not raise "
            f"({100 * self.fused / max(1, not_raising):.1f}%); {self.raises} runs where eager raises",
            f"  fallback reasons: {dict(self.reasons.most_common())}",
            f"  output elements judged: {self.judged} of {self.total} "
            f"({100 * self.judged / max(1, self.total):.2f}%; the rest excused as near a discontinuity); "
            f"finite in eager: {100 * self.finite / max(1, self.total):.1f}%",
            f"  ops per graph (bucketed by 5): {dict(sorted(self.n_ops.items()))}",
            f"  schemas used: {len(self.ops)} of {len(CATALOG) + len(REDUCTION_CATALOG) + len(VIEW_CATALOG)}"
            + (f" (never: {sorted(set(e.id for e in CATALOG + REDUCTION_CATALOG + VIEW_CATALOG) - set(self.ops))})"
               if len(self.ops) < len(CATALOG) + len(REDUCTION_CATALOG) + len(VIEW_CATALOG) else ""),
            f"  input dtypes: {dict(self.dtypes.most_common())}",
            f"  input layouts: {dict(self.layouts.most_common())}",
            f"  mismatches: {len(self.failures)}",
        ]
        return "\n".join(lines)


def _run_graph_task(seed, index, device, max_numel, max_ops, variants, deadline, threads):
    _worker_init(threads)
    if deadline is not None and time.time() > deadline:
        return None
    return run_graph(seed, index, device, max_numel, max_ops, variants)


def run_campaign(graphs: int, seed: int, device: str = "cpu", time_budget: Optional[float] = None,
                 jobs: int = 1, max_numel: Optional[int] = None, max_ops: int = 40, variants: int = 2,
                 log: Callable[[str], None] = print, start: int = 0) -> Campaign:
    """Run graphs ``start .. start + graphs - 1`` of the campaign ``seed`` (stopping after ``time_budget``
    seconds); ``jobs`` worker processes (1: in this process)."""
    if max_numel is None:
        max_numel = 100_000 if device == "cpu" else 4_000_000
    camp = Campaign(seed, device)
    t0 = time.time()
    deadline = None if time_budget is None else t0 + time_budget
    indices = list(range(start, start + graphs))
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))

    def report(r: GraphResult):
        camp.add(r)
        for v, p, verdict in r.failures:
            log(f"MISMATCH graph {r.index} (seed {seed}) input set {v}: {verdict.kind}: "
                f"{verdict.detail.splitlines()[0] if verdict.detail else ''}")
        if camp.graphs % 100 == 0:
            log(f"  ... {camp.graphs} graphs, {camp.fused}/{camp.runs - camp.raises} fused, "
                f"{len(camp.failures)} mismatches, {time.time() - t0:.0f} s")

    if jobs <= 1:
        for i in indices:
            if deadline is not None and time.time() > deadline:
                break
            report(run_graph(seed, i, device, max_numel, max_ops, variants))
    else:
        ctx = multiprocessing.get_context("spawn")
        pending = collections.deque(indices)
        while pending:
            pool = cf.ProcessPoolExecutor(jobs, mp_context=ctx)
            inflight: dict = {}
            broken: list = []
            try:
                while pending or inflight:
                    while pending and len(inflight) < 2 * jobs:
                        i = pending.popleft()
                        inflight[pool.submit(_run_graph_task, seed, i, device, max_numel, max_ops, variants,
                                             deadline, threads)] = i
                    done, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        i = inflight.pop(fut)
                        try:
                            r = fut.result()
                        except cf.process.BrokenProcessPool:
                            broken.append(i)
                            continue
                        if r is not None:
                            report(r)
                        elif deadline is not None:
                            pending.clear()
                    if broken:
                        broken.extend(inflight.values())
                        inflight.clear()
                        break
            finally:
                pool.shutdown(wait=not broken, cancel_futures=True)
            for i in broken:  # isolate the graph(s) that crashed the worker
                ev = Evaluator(device)
                try:
                    r = ev._pool().submit(_run_graph_task, seed, i, device, max_numel, max_ops, variants,
                                          None, threads).result()
                    report(r)
                except cf.process.BrokenProcessPool:
                    g = build_case(seed, i, max_numel, max_ops)
                    r = GraphResult(i, runs=1)
                    r.failures.append((0, g.program, Verdict(False, "crash", "the worker process died")))
                    report(r)
                finally:
                    ev.close()
    camp.seconds = time.time() - t0
    return camp


def report_failures(camp: Campaign, out_dir: Optional[str], max_shrink: int = 8, shrink_budget: float = 120.0,
                    log: Callable[[str], None] = print) -> list:
    """Shrink (up to ``max_shrink``) mismatches, print their reproducers and save them under ``out_dir``.
    Returns the paths written."""
    if not camp.failures:
        return []
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    written = []
    ev = Evaluator(camp.device)
    seen = set()
    shrunk = 0
    per_kind: collections.Counter = collections.Counter()
    graphs_done = set()
    try:
        for index, variant, p, verdict in camp.failures:
            stem = f"fuzz_{camp.device}_s{camp.seed}_g{index}_v{variant}_{verdict.kind}"
            origin = (f"Found by: python -m fuser.fuzz --seed {camp.seed} --device {camp.device} --start {index} "
                      f"--graphs 1  (input set {variant})")
            # shrink up to max_shrink mismatches, at most 3 of one kind, one per graph and kind
            if (shrunk < max_shrink and per_kind[verdict.kind] < 3 and (index, verdict.kind) not in graphs_done):
                shrunk += 1
                per_kind[verdict.kind] += 1
                graphs_done.add((index, verdict.kind))
                log(f"shrinking graph {index} input set {variant} ({verdict.kind}, {len(p.nodes)} ops) ...")
                small, sv, steps = shrink(p, verdict, ev, shrink_budget, log)
            else:
                small, sv = p, verdict
            sig = (sv.kind, tuple(sorted({nd.schema.id for nd in small.nodes})),
                   tuple(DTYPE_NAMES[t.dtype] for t in small.tensors))
            dup = sig in seen
            seen.add(sig)
            src = reproducer(small, sv, camp.device, origin + ("\nShrunk from " + str(len(p.nodes)) + " ops."
                                                               if small is not p else ""), out_dir, stem)
            log("=" * 100)
            log(f"MISMATCH {sv.kind} graph {index} input set {variant}"
                + (" (same signature as an earlier one)" if dup else ""))
            log(sv.detail)
            log("IR:\n" + render(small))
            for k, t in enumerate(small.tensors):
                vals = t.view().tolist() if t.storage.numel() <= 64 else "(values in the reproducer)"
                log(f"  t{k}: {t.describe()} = {vals}")
            for k, f in enumerate(small.floats):
                log(f"  f{k} = {f!r}")
            if out_dir:
                path = os.path.join(out_dir, stem + ".py")
                with open(path, "w") as fh:
                    fh.write(src)
                written.append(path)
                log(f"saved {path}")
    finally:
        ev.close()
    return written
