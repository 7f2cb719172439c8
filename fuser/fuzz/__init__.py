"""A differential fuzzer: random pointwise graphs over the op table, fused vs eager PyTorch.

``python -m fuser.fuzz --graphs N --seed S --device cpu|cuda [--time-budget SECONDS] [--out DIR] [--jobs J]``

Each graph is a random DAG of 1 to 40 ops drawn from every schema of :data:`fuser.ops._OPS` (scalar
arguments as constants, NaN/inf included, or as ``float`` graph inputs; optional clamp bounds as None; gelu
variants; 0-dim tensor constants), with several outputs, intermediate values among them. It runs as one
fusion group (what :func:`fuser.debug_launch_graph` does: register, then ``executor.run``, falling back to the
interpreter) on random inputs: float32/float64/float16/bfloat16 and integer/bool dtypes, mixed so that they
promote; shapes from 0-dim and zero-element to ~1e5 elements (several million on CUDA); broadcasting (size-1
dims, stride-0 expanded views, rank mismatch), transposes, steps, row slices and offset views; values with
NaN, +-inf, -0.0, huge and tiny magnitudes.

Judging (:func:`check`): the same outputs, dtypes, shapes and devices as eager PyTorch run op by op through
``torch.ops.aten``; values equal within the dtype's tolerance, or at least as close to a float64 reference
(the same graph on inputs upcast to float64) as eager is; NaN where eager has NaN. Elements downstream of a
discontinuity (a comparison, rounding, fmod, a domain edge, ...) whose argument is a *computed* value within
its error estimate of the edge are not judged (fusion keeps float intermediates for half dtypes, and libm and
eager's vectorized math differ in the last bits, so such elements can legitimately differ); the share of
judged elements is reported. Where eager raises, the fused path must raise the same type of exception.

Every mismatch is shrunk (outputs and ops dropped, shapes cut, layouts and dtypes simplified, while the same
kind of mismatch persists) and saved under ``--out`` as a runnable reproducer / regression test.

The package, one module per job, data flowing one way: :mod:`.program` (the op catalog, programs and their
inputs) and :mod:`.ir` (programs as TorchScript IR and back) -> :mod:`.generator` (random programs and input
sets) -> :mod:`.eager`, :mod:`.edges` and :mod:`.judge` (eager op by op, the excuses near discontinuities, the
verdict) -> :mod:`.worker` (child processes) -> :mod:`.shrinker` and :mod:`.repro` (smaller failing programs,
reproducer files) -> :mod:`.campaign` (runs, summaries, reports) -> :mod:`.cli` (``python -m fuser.fuzz``).
This module re-exports their public names: reproducers do ``from fuser.fuzz import check, parse_graph``.
"""
from .campaign import Campaign, GraphResult, report_failures, run_campaign, run_graph
from .cli import main
from .eager import eager_eval
from .edges import uncertainty
from .generator import (ARG_POOLS, FLOAT_POOL, INT_POOL, LAYOUTS, Generated, Recipe, build_case, generate,
                        graph_seed)
from .ir import parse_graph, render
from .judge import TOL, Verdict, check, check_program
from .program import BY_OP, CATALOG, DTYPE_NAMES, OP_NAMES, Arg, OpSchema, PNode, Program, TensorInput
from .repro import eager_code, reproducer
from .shrinker import shrink
from .worker import Evaluator

__all__ = ["ARG_POOLS", "BY_OP", "CATALOG", "DTYPE_NAMES", "FLOAT_POOL", "INT_POOL", "LAYOUTS", "OP_NAMES", "TOL",
           "Arg", "Campaign", "Evaluator", "Generated", "GraphResult", "OpSchema", "PNode", "Program", "Recipe",
           "TensorInput", "Verdict", "build_case", "check", "check_program", "eager_code", "eager_eval", "generate",
           "graph_seed", "main", "parse_graph", "render", "report_failures", "reproducer", "run_campaign",
           "run_graph", "shrink", "uncertainty"]
