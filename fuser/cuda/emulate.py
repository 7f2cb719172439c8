"""Run the CUDA kernels fuser generates on the CPU, under AddressSanitizer and UBSan (CI has no GPU).

NVRTC compiles every CUDA kernel in CI, but nothing runs them there. This harness compiles the same source
with the system C++ compiler and runs it on the host, so the CUDA path's index math (32-bit with
magic-number division, 64-bit), vector and scalar loops, argument struct and launcher run in CI, and memory
errors fail loudly. It is a tool at the top of the pipeline, beside the executor; the production path
never imports it. Data flows one way:

* plan: ``executor.plan(spec, inputs, target="cuda")`` on CPU tensors (broadcast, compression, layout
  classes, cat slices, index width) exactly as for CUDA tensors;
* kernel: ``compiler.build(spec, arg_spec, load=...)`` types the group and generates its CUDA source
  (``codegen`` for target "cuda"); the loader hands the source to an :class:`Emulator` instead of NVRTC;
* arguments: the bytes that ``launch.LaunchArgs.fill`` writes, the code that fills ``FzArgs`` before every
  ``cuLaunchKernel`` (sizes, magic/shift dividers, strides, rank, the vector flag from the pointers'
  alignment, pointers, float arguments, the Philox state);
* host build: each source's ``templates.PRELUDE`` is swapped for ``host_prelude.PRELUDE``, and its
  ``templates.CLUSTER`` (thread block clusters) and its ``templates.STAGE`` (dynamic shared memory), where it has
  them, for ``host_prelude.CLUSTER`` and ``host_prelude.STAGE`` (the kernel's
  own text is untouched), and wrapped in a namespace of its own. Kernels compile in batches, one object per
  batch and the batches in parallel, linked with the fiber runtime and a request server into one executable:
  ``g++ -O0 -fsanitize=address,undefined -fno-sanitize-recover=all -ffp-contract=off``;
* run: an ASan-instrumented library cannot be loaded into an uninstrumented Python, so the executable runs
  as a subprocess serving launch requests (the protocol is written above ``host_prelude.MAIN_UNIT``). Per
  launch it gets the grid, block and cluster sizes, the FzArgs bytes and the bytes of each tensor's span (the
  memory its view may address), puts every tensor in a heap block of exactly that size (both ends are
  redzones), points FzArgs' pointers at them (after checking the struct's size and the pointers' offset
  against the kernel's own ``FzArgs``), runs :data:`EMU_BLOCKS` blocks (clusters, for a cluster kernel) of the
  launcher's block size one after another (so grid-stride loops wrap), each thread a fiber (see
  ``host_prelude``; a cluster's blocks take turns between cluster barriers), checks the inputs are unchanged and
  returns the outputs' bytes, which are written back through the output views (a cat's slices included).
  Output memory starts as 0xbe bytes, so an element no thread writes shows.

A sanitizer report, a failed harness check or a kernel running past :data:`EMU_TIMEOUT_S` raises
:class:`EmulationError` with the report.
"""
from __future__ import annotations

import ctypes
import math
import os
import re
import resource
import struct
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Optional, Sequence

import torch

from .. import compiler, executor, ir, rng, ts_ir
from ..errors import CompileError, numbered
from ..kernel_cache import STORE, KernelSpec
from . import host_prelude, launch, templates

EMU_BLOCKS = 3  # blocks per emulated launch: few enough to be quick, enough for grid-stride loops to wrap
EMU_TIMEOUT_S = 60  # per launch
BATCH_KERNELS = 48  # kernels per translation unit (units compile in parallel)
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all")
# -O0: the level that compiles fastest, and every access is instrumented. ASan's documentation recommends -O1 for
# speed of the program; here the compiles dominate: on the 2-core development machine (2026-11-27) -O1 / -O0 with -g0 took
# 53.0 / 29.6 s for the 1208 pointwise kernels of tests/test_cuda_emulated.py's layouts and ops (the tests 94.7 /
# 69.7 s in all, so the launches ran no slower) and 193.6 / 138.2 s for the 160 row kernels of
# tests/test_normalizations.py's emulated tests. -g1 (line numbers for the sanitizers' reports) costs about a tenth
# more at -O0, three tenths at -O1.
# -ffp-contract=off: no multiply-adds g++ would form on its own, as on the CPU backend. The kernels read
# memory through other types (fz_vec over a float array), as CUDA code does: no strict aliasing.
FLAGS = ("-std=c++17", "-O0", "-g1", "-fno-omit-frame-pointer", *SANITIZE, "-ffp-contract=off",
         "-fno-strict-aliasing", "-Wno-unknown-pragmas")
_SANITIZER_ENV = {
    # LeakSanitizer needs ptrace, which containers often forbid; leaks are not what this looks for
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


class EmulationError(RuntimeError):
    """A kernel failed under the host emulation: a sanitizer report, or a check of the harness."""


def host_source(source: str) -> str:
    """The host C++ of a generated CUDA kernel: its prelude (and cluster primitives, where it has them) swapped
    for the host's, the rest as is."""
    n = source.count(templates.PRELUDE)
    if n != 1:
        raise ValueError(f"expected fuser.cuda.templates.PRELUDE once in the kernel source, found it {n} times")
    for piece in ("CLUSTER", "STAGE"):
        n = source.count(getattr(templates, piece))
        if n > 1:
            raise ValueError(f"expected fuser.cuda.templates.{piece} at most once in the kernel source, found it {n} "
                             "times")
    return (source.replace(templates.PRELUDE, host_prelude.PRELUDE).replace(templates.CLUSTER, host_prelude.CLUSTER)
            .replace(templates.STAGE, host_prelude.STAGE))


def compiler_command() -> str:
    return os.environ.get("CXX") or "g++"


class _Executable:
    """A linked batch of kernels, and its server process (started on first use, again after a crash)."""

    def __init__(self, path: str, units: dict[str, str]):
        self.path, self.units = path, units  # units: file name -> source, for error messages
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = ""
        self.n_starts = 0

    def _start(self) -> subprocess.Popen:
        self.n_starts += 1
        self.log_path = f"{self.path}.{self.n_starts}.log"
        env = dict(os.environ)
        for k, v in _SANITIZER_ENV.items():  # the user's options come last, so they win
            env[k] = v + (":" + env[k] if env.get(k) else "")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([self.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=env)
        return self.proc

    def request(self, payload: bytes, n_outputs: int) -> list[bytes]:
        """Send one launch; the outputs' bytes, or EmulationError."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        try:
            proc.stdin.write(payload)
            proc.stdin.flush()
            status = proc.stdout.read(4)
            if len(status) == 4 and struct.unpack("<I", status)[0] == 1:  # a check of the harness failed
                n, = struct.unpack("<I", proc.stdout.read(4))
                raise EmulationError(proc.stdout.read(n).decode(errors="replace"))
            if len(status) == 4:
                outputs = []
                for _ in range(n_outputs):
                    n, = struct.unpack("<Q", proc.stdout.read(8))
                    outputs.append(proc.stdout.read(n))
                return outputs
        except (BrokenPipeError, struct.error):
            pass
        proc.wait()
        self.proc = None
        raise EmulationError(self._crash_report(proc.returncode))

    def _crash_report(self, returncode: int) -> str:
        with open(self.log_path, errors="replace") as fh:
            log = fh.read()[-20000:]
        why = "timed out (SIGALRM)" if returncode == -14 else f"exit status {returncode}"
        lines = [f"the emulated kernel's process ended ({why}):", log.rstrip()]
        # the sanitizers name a line of a translation unit: show it
        m = re.search(r"(batch\d+\.cpp):(\d+)", log)
        if m and m.group(1) in self.units:
            line = int(m.group(2))
            text = numbered(self.units[m.group(1)]).splitlines()
            lines += [f"--- {m.group(1)} around line {line} ---", *text[max(0, line - 8):line + 4]]
        return "\n".join(lines)

    def close(self) -> None:
        _stop(self.proc)
        self.proc = None


def _stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        proc.stdin.close()  # the server's request loop ends at end of input
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Emulator:
    """CUDA kernels built for the host, and the executables that run them.

    Kernels are registered as :func:`kernel_for` (or :func:`run_graph`) builds them and compiled together
    the first time one of them runs (or at :meth:`compile_pending`): register every kernel a test session
    needs first, and they compile as a few parallel units instead of one executable each.
    """

    def __init__(self, jobs: Optional[int] = None):
        self.jobs = jobs or os.cpu_count() or 1
        self._lock = threading.RLock()
        self._pending: dict[str, str] = {}  # name -> CUDA source, not compiled yet
        self._sources: dict[str, str] = {}  # every registered name -> its CUDA source
        self._where: dict[str, _Executable] = {}
        self._entries: dict[str, tuple] = {}  # name -> the other kernels its source defines (launched by name too)
        self._kernels: dict = {}  # (spec key, arg spec) -> compiler.CompiledKernel or None
        self._executables: list[_Executable] = []
        self._dir = tempfile.TemporaryDirectory(prefix="fuser-emu-")
        self.n_launches = 0
        self.compile_seconds = 0.0  # wall time
        self.compile_cpu_seconds = 0.0  # the compilers' processor time (over all jobs)
        weakref.finalize(self, _close, self._executables, self._dir)

    @property
    def n_kernels(self) -> int:
        """Kernels compiled for the host so far."""
        return len(self._where)

    def kernel(self, spec: KernelSpec, arg_spec) -> Optional[compiler.CompiledKernel]:
        """The CUDA kernel of ``spec`` for ``arg_spec`` (device type "cuda"), its source registered here."""
        key = (spec.key, arg_spec)
        with self._lock:
            if key not in self._kernels:
                self._kernels[key] = compiler.build(spec, arg_spec, load=self._load, probe_device="cpu")
            return self._kernels[key]

    def add(self, name: str, source: str, entries: tuple = ()) -> None:
        """Register CUDA kernel source ``source`` (which holds ``templates.PRELUDE`` and defines ``FzArgs``
        with a ``ptrs`` array and ``extern "C"`` kernel ``name``, and the kernels ``entries`` taking the same
        ``FzArgs``: a module of several kernels) for the next batch."""
        with self._lock:
            known = self._sources.setdefault(name, source)
            if known != source:
                raise ValueError(f"kernel name {name} stands for two sources")
            if entries:
                self._entries[name] = tuple(entries)
            if name not in self._where:
                self._pending[name] = source

    def _load(self, source, name, arg_spec, n_strided, kernel_dtypes, n_slots, vec, waves) -> tuple:
        self.add(name, source)
        n_ptrs = len(arg_spec.inputs) + len(kernel_dtypes)
        backend = EmulatedKernel(self, name, arg_spec.index32, n_strided, n_ptrs, n_slots, vec,
                                 launch.vector_alignment(arg_spec, kernel_dtypes, vec))
        return backend, False  # compiled later, in a batch

    def compile_pending(self) -> None:
        """Compile every registered kernel not compiled yet, into one executable."""
        with self._lock:
            names = sorted(self._pending)
            if not names:
                return
            t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            n_units = max(min(self.jobs, len(names)), math.ceil(len(names) / BATCH_KERNELS))
            units = {}
            for b in range(n_units):
                chunk = names[b::n_units]
                units[f"batch{b}.cpp"] = host_prelude.BATCH_UNIT.substitute(
                    header=host_prelude.HEADER, index=b,
                    kernels="\n".join(host_prelude.KERNEL_UNIT.substitute(name=n, source=host_source(
                        self._pending[n]), entries="".join(host_prelude.KERNEL_ENTRY.substitute(entry=e)
                                                           for e in self._entries.get(n, ()))) for n in chunk),
                    infos="\n".join(host_prelude.KERNEL_INFO.substitute(name=n, entry=e, fn="fz_entry" + (
                        "" if e == n else "_" + e)) for n in chunk for e in (n, *self._entries.get(n, ()))))
            units["main.cpp"] = host_prelude.MAIN_UNIT.substitute(
                header=host_prelude.HEADER, timeout_s=EMU_TIMEOUT_S,
                batch_decls="\n".join(host_prelude.BATCH_DECL.substitute(index=b) for b in range(n_units)),
                batch_refs=", ".join(f"{{fz_batch_{b}, fz_batch_{b}_size}}" for b in range(n_units)))
            build = tempfile.mkdtemp(prefix="build-", dir=self._dir.name)
            cxx = compiler_command()

            def compile_unit(item):
                file, text = item
                src = os.path.join(build, file)
                with open(src, "w") as fh:
                    fh.write(text)
                r = subprocess.run([cxx, *FLAGS, "-c", src, "-o", src + ".o"], capture_output=True, text=True)
                if r.returncode != 0:
                    raise CompileError(f"{cxx} (CUDA host emulation)", text, [*FLAGS, "-c"], r.stderr + r.stdout)
                return src + ".o"

            with ThreadPoolExecutor(self.jobs) as pool:
                objects = list(pool.map(compile_unit, units.items()))
            exe_path = os.path.join(build, "kernels")
            r = subprocess.run([cxx, *SANITIZE, *objects, "-o", exe_path], capture_output=True, text=True)
            if r.returncode != 0:
                raise CompileError(f"{cxx} (CUDA host emulation, link)", "", list(SANITIZE), r.stderr + r.stdout)
            exe = _Executable(exe_path, units)
            self._executables.append(exe)
            for n in names:
                for e in (n, *self._entries.get(n, ())):
                    self._where[e] = exe
            self._pending.clear()
            self.compile_seconds += time.perf_counter() - t0
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
            self.compile_cpu_seconds += cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime

    def run(self, name: str, grid: int, block: int, args: bytes, tensors: Sequence[tuple],
            cluster: int = 1, shared: int = 0) -> list[bytes]:
        """Launch kernel ``name`` on ``grid`` blocks of ``block`` threads with FzArgs bytes ``args``, in
        clusters of ``cluster`` blocks (1 to 16, dividing ``grid``; a kernel's ``__cluster_dims__`` is not read),
        with ``shared`` bytes of dynamic shared memory a block.
        ``tensors``: per pointer, (address in ``args``, span in bytes, the input's bytes or None for an output).
        Returns the outputs' bytes."""
        with self._lock:
            if name not in self._where:
                if name not in self._pending and not any(name in es for es in self._entries.values()):
                    raise KeyError(f"no kernel {name} registered with this emulator")
                self.compile_pending()
            parts = [struct.pack("<I", len(name)), name.encode(),
                     struct.pack("<IIIII", grid, block, cluster, shared, len(args)), args, struct.pack("<I", len(tensors))]
            for address, size, data in tensors:
                parts.append(struct.pack("<QQI", address, size, data is None))
                if data is not None:
                    parts.append(data)
            self.n_launches += 1
            return self._where[name].request(b"".join(parts), sum(data is None for _, _, data in tensors))

    def close(self) -> None:
        _close(self._executables, self._dir)


def _close(executables: list, directory: tempfile.TemporaryDirectory) -> None:
    for exe in executables:
        exe.close()
    directory.cleanup()


def _span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last addressable element (its strides are never negative)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _span_bytes(t: torch.Tensor) -> bytes:
    flat = t.as_strided((_span(t),), (1,)).contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


class EmulatedKernel:
    """The backend of a CUDA kernel built for the emulator; :meth:`launch` takes what CudaKernel.launch takes."""

    def __init__(self, emulator: Emulator, name: str, index32: bool, n_strided: int, n_ptrs: int, n_scalars: int,
                 vec: int, vec_align: tuple):
        self.emulator, self.name, self.vec = emulator, name, vec
        self.args = launch.LaunchArgs(launch.args_struct(index32, n_strided, n_ptrs, n_scalars), vec_align)
        self.last_vec = None  # whether the last launch took the vector path
        self._lock = threading.Lock()  # one FzArgs per kernel here, not one per thread

    def launch(self, geo, tensors, scalars, outputs, vectorize: Optional[bool] = None) -> None:
        """Run on the host, as the launcher would on a GPU. ``vectorize``: None, the launcher decides; False,
        the scalar path even where the vector path could run (as a misaligned pointer makes it);
        True, the vector path, or ValueError where it cannot run."""
        with self._lock:
            self._launch(geo, tensors, scalars, outputs, vectorize)

    def _launch(self, geo, tensors, scalars, outputs, vectorize) -> None:
        vec_ok = self.args.fill(geo, tensors, scalars, outputs)
        if vectorize is False:
            vec_ok = self.args.args.vec = False
        elif vectorize and not vec_ok:
            raise ValueError(f"kernel {self.name}: the vector path does not run for these inputs")
        self.last_vec = bool(vec_ok)
        work = geo.numel // self.vec if vec_ok else geo.numel
        grid = min(EMU_BLOCKS, max(1, math.ceil(work / launch.BLOCK_SIZE)))
        spans = [(t.data_ptr(), _span(t) * t.element_size(), _span_bytes(t)) for t in tensors]
        spans += [(o.data_ptr(), _span(o) * o.element_size(), None) for o in outputs]
        results = self.emulator.run(self.name, grid, launch.BLOCK_SIZE, bytes(self.args.args), spans)
        for o, data in zip(outputs, results):
            written = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(o.dtype)
            o.copy_(written.as_strided(o.shape, o.stride(), 0))


_default: Optional[Emulator] = None
_default_lock = threading.Lock()


def default() -> Emulator:
    """The process's emulator (run_graph's and kernel_for's unless given another)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Emulator()
        return _default


def summary() -> Optional[str]:
    """A line on what the process's emulator did (for a test session's report); None if it was not used."""
    if _default is None:
        return None
    em = _default
    return (f"CUDA host emulation: {em.n_kernels} kernels compiled by {compiler_command()} "
            f"{' '.join(SANITIZE)} in {em.compile_seconds:.1f} s ({em.compile_cpu_seconds:.1f} s of processor time, "
            f"{em.jobs} jobs), {em.n_launches} launches")


def _plan(group, inputs: Sequence, index32: Optional[bool]):
    # a test tool, so a door of its own: it takes a group, or a TorchScript graph it lowers
    spec = STORE.get(STORE.register(group if isinstance(group, ir.Group) else ts_ir.lower(group)))
    with torch.no_grad():
        p = executor.plan(spec, list(inputs), target="cuda")
    if isinstance(p, str) or spec.has_reduction:  # a row kernel: fuser.rows.emulate runs those
        return spec, None
    if p.tensors[0].device.type != "cpu":
        raise ValueError(f"the CUDA emulator runs CPU tensors, got {p.tensors[0].device}")
    if index32 is not None and index32 != p.arg_spec.index32:
        if index32:
            raise ValueError("these inputs need 64-bit indexing (an offset reaches executor.INDEX32_LIMIT)")
        p.arg_spec = replace(p.arg_spec, index32=False)
    return spec, p


def kernel_for(graph: torch.Graph, inputs: Sequence, index32: Optional[bool] = None,
               emulator: Optional[Emulator] = None) -> Optional[compiler.CompiledKernel]:
    """The CUDA kernel :func:`run_graph` runs for these inputs (None: the group falls back), registered with
    the emulator so that it compiles in the next batch."""
    emulator = emulator or default()
    spec, p = _plan(graph, inputs, index32)
    return None if p is None else emulator.kernel(spec, p.arg_spec)


def run_graph(graph: torch.Graph, inputs: Sequence, index32: Optional[bool] = None,
              vectorize: Optional[bool] = None, rng_state: Optional[tuple[int, int]] = None,
              emulator: Optional[Emulator] = None) -> Optional[list[torch.Tensor]]:
    """Run ``graph`` as one fusion group on CPU ``inputs`` through its CUDA kernel, emulated on the host.

    Returns the outputs, or None where a GPU would fall back too (the executor's plan says why).
    index32: the kernel's index width (None: the plan's choice; False: 64-bit even where 32 bits suffice).
    vectorize: see :meth:`EmulatedKernel.launch`. rng_state: (seed, offset) of the Philox generator for
    ``rand_like`` (None: a fresh draw from torch's CPU generator, as the CPU backend does). Float arguments
    are not range-checked as ``executor.run`` checks them.
    """
    emulator = emulator or default()
    spec, p = _plan(graph, inputs, index32)
    kernel = None if p is None else emulator.kernel(spec, p.arg_spec)
    if kernel is None:
        return None
    geo = executor.Geometry(p, kernel)
    outputs, kernel_outputs = executor.concat_outputs(geo, torch.device("cpu"))
    if geo.numel == 0:
        return outputs
    scalars = list(p.scalars)
    if kernel.random:
        scalars += rng.state_words(*rng_state) if rng_state else rng.launch_state(torch.device("cpu"))
    kernel.backend.launch(geo, p.tensors, scalars, kernel_outputs, vectorize)
    return outputs
