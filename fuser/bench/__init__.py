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
  (``fuser_first_call_ms``). The compilers' caches on disk start empty (``--warm-caches`` keeps the user's):
  fuser's, Inductor's and Triton's, and the CUDA driver's, which NVRTC 12.9 on uses too (a kernel NVRTC compiled
  before in another process, say by the tests, comes back in a few ms), which is also switched off. Each fuser
  system's first call builds its own kernels: what the other one built in the row (the TorchScript pass and the
  torch.compile backend often make the same group) is set aside for it (:func:`.caches.own_builds`).
* A failing cell records its error and the run goes on.

``--models`` times real networks end to end instead (:mod:`fuser.bench.models`).

On CPU (``--device cpu``) time.perf_counter replaces CUDA events, and :mod:`.cpu` sets the large rows' sizes
(4M elements), the dtypes (float32, bfloat16), the systems (eager, torch.compile, fuser; ts_nnc where torch has
LLVM) and cells of time per call and speed-up over eager; ``--quick`` shrinks sizes and iteration counts for
smoke tests. Output: a table on stdout, all raw numbers as JSON (``--json``), and a grouped bar
chart of the large rows' fractions of the floor (``--png``, needs matplotlib; skipped without it).

The package, one module per job: :mod:`.workloads` (the functions and their inputs) -> :mod:`.systems` (the
columns) and :mod:`.timing` (warm-up, device and host time, the copy rate) -> :mod:`.rows` (one row: every
system's cell, checked and timed) -> :mod:`.report` (table, first calls, chart) -> :mod:`.cli` (``python -m
fuser.bench``); :mod:`.cpu` holds the CPU's sizes, dtypes, systems and timing; :mod:`.models` is the model zoo of ``--models``, timed end to end with :mod:`.timing`'s clocks.
This module re-exports their public names.
"""
from .cli import main, parse_args
from .report import draw_chart, format_table, fuser_first_calls
from .rows import N_ROTATED_SETS, REL_TOL, ROTATE_BELOW_BYTES, SIZES, max_abs_error, run_cell, run_row
from .systems import SYSTEM_CONTEXTS, SYSTEMS
from .timing import (FULL, QUICK, Config, _sync, device_time_per_call_us, elapsed_ms,
                     host_time_per_call_us, measure_copy_rate, warm_up)
from .workloads import DTYPES, WORKLOADS, Workload, _python_function, _script_function

__all__ = ["DTYPES", "FULL", "N_ROTATED_SETS", "QUICK", "REL_TOL", "ROTATE_BELOW_BYTES", "SIZES", "SYSTEMS",
           "SYSTEM_CONTEXTS", "WORKLOADS", "Config", "Workload", "device_time_per_call_us", "draw_chart",
           "elapsed_ms", "format_table", "fuser_first_calls", "host_time_per_call_us", "main", "max_abs_error",
           "measure_copy_rate", "parse_args", "run_cell", "run_row", "warm_up"]
__all__ += ["_python_function", "_script_function", "_sync"]  # from before the split (tests: _script_function)
