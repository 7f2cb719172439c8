"""CPU backend: compile generated C++ with the system compiler into a shared library, load it with ctypes.

The compiler is ``$CXX`` (or ``g++``), run through ``subprocess`` so its own message reaches the user in a
:class:`fuser.errors.CompileError`. OpenMP is used when a test program builds with ``-fopenmp``.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from typing import Optional, Sequence

from ..errors import CompileError

# no -fno-math-errno: with it g++ 12 folds sin(atan(x)) into x / sqrt(1 + x*x), which gives 1 for NaN (fuzzer).
# -ffp-contract=off: a multiply and an add that are two ops in eager stay two roundings here (a*b + c with a
# huge a*b is inf in eager); the fma() calls the op table writes where eager has one are kept.
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fwrapv", "-ffp-contract=off")

# int64 numel, int64 rank, int64* sizes, int64* strides, void** ptrs, double* scalars
_ARGTYPES = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

_lock = threading.Lock()


def compiler() -> str:
    return os.environ.get("CXX") or "g++"


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


@functools.lru_cache(maxsize=None)
def _probe(cxx: str) -> tuple[bool, tuple[str, ...]]:
    """(compiler works, extra flags): whether ``cxx`` builds a shared library, and with OpenMP or not."""
    if shutil.which(cxx) is None:
        return False, ()
    src = '#include <cmath>\nextern "C" double f(double x) {\n#pragma omp parallel for\n' \
          'for (int i = 0; i < 4; ++i) x += std::sqrt(x);\nreturn x; }\n'
    with tempfile.TemporaryDirectory(prefix="fuser-probe-") as d:
        path = os.path.join(d, "probe.cpp")
        with open(path, "w") as fh:
            fh.write(src)
        # -march=native: kernels are built on and for this machine (never cached on disk), and fma() is an
        # instruction only where the target has one
        for extra in (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ()):
            r = _run([cxx, *BASE_FLAGS, *extra, path, "-o", os.path.join(d, "probe.so")])
            if r.returncode == 0:
                return True, extra
    return False, ()


def available() -> bool:
    """Whether a working C++ compiler was found (the CPU backend is on by default when it is)."""
    return _probe(compiler())[0]


def flags() -> tuple[str, ...]:
    return BASE_FLAGS + _probe(compiler())[1]


class CpuKernel:
    """A compiled CPU kernel: call :meth:`launch` with the ABI of ``fuser/cpu/templates.py``."""

    def __init__(self, name: str, library_path: str, tmpdir: tempfile.TemporaryDirectory):
        self.name = name
        self._lib = ctypes.CDLL(library_path)
        self._fn = getattr(self._lib, name)
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = None
        # the library file can go once loaded; the directory is removed with the kernel
        weakref.finalize(self, tmpdir.cleanup)

    def launch(self, numel: int, rank: int, sizes: int, strides: int, ptrs: int, scalars: int) -> None:
        self._fn(numel, rank, sizes, strides, ptrs, scalars)


def compile_kernel(source: str, name: str) -> CpuKernel:
    """Compile ``source`` (which defines ``extern "C" void name(...)``) and load it."""
    cxx = compiler()
    ok, _ = _probe(cxx)
    if not ok:
        raise RuntimeError(f"no working C++ compiler: tried CXX={cxx!r}. Install g++ or set $CXX, or turn "
                           "the CPU backend off with fuser.override_can_fuse_on_cpu(False).")
    tmp = tempfile.TemporaryDirectory(prefix="fuser-cpu-")
    src = os.path.join(tmp.name, f"{name}.cpp")
    lib = os.path.join(tmp.name, f"{name}.so")
    with open(src, "w") as fh:
        fh.write(source)
    cmd = [cxx, *flags(), src, "-o", lib]
    r = _run(cmd)
    if r.returncode != 0:
        tmp.cleanup()
        raise CompileError(cxx, source, cmd[1:-3], r.stderr + r.stdout)
    return CpuKernel(name, lib, tmp)
