"""CPU backend: compile generated C++ with the system compiler into a shared library, load it with ctypes.

The compiler is ``$CXX`` (or ``g++``), run through ``subprocess`` so its own message reaches the user in a
:class:`fuser.errors.CompileError`. OpenMP is used when a test program builds with ``-fopenmp``.

Vector kernels (``fuser/cpu/templates.py``) include ATen's ``at::vec`` headers, built for the instruction set
eager's own kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``: AVX2 or AVX-512 on x86-64; other
machines keep the scalar loops). Those headers take g++ about 1.7 s to parse, so they are precompiled once into a
toolchain directory (:func:`toolchain`), after which a kernel builds in about 0.3 s. The SLEEF functions they call
are resolved at load time in torch's own ``libtorch_cpu.so``, which the process has loaded already: kernels link
against a symbol-less stub of it (reading the real 400 MB library would cost the link 0.2-0.5 s).

Compiled kernels are kept on disk (``fuser.disk_cache``: the user's 0700 directory, a labeled digest, atomic
writes; the key holds the compiler, its flags, the machine's instruction set and torch's version). A shared object
is loaded only from a private copy of an entry that this cache wrote and whose checksum holds.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .. import disk_cache
from ..errors import CompileError
from . import templates

# no -fno-math-errno: with it g++ 12 folds sin(atan(x)) into x / sqrt(1 + x*x), which gives 1 for NaN (fuzzer).
# -ffp-contract=off: a multiply and an add that are two ops in eager stay two roundings here (a*b + c with a
# huge a*b is inf in eager); the fma() calls the op table writes where eager has one are kept.
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fwrapv", "-ffp-contract=off")

# per ATen CPU capability: g++ flags of the instruction set (as torch's own build of that capability)
ISA_FLAGS = {
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
    "AVX512": ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"),
}

# int64 numel, int64 rank, int64* sizes, int64* strides, void** ptrs, double* scalars
_ARGTYPES = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


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
        # -march=native: kernels are built on and for this machine (the disk cache's key holds the machine's
        # instruction set), and fma() is an instruction only where the target has one
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


@functools.lru_cache(maxsize=None)
def _identity(cxx: str) -> str:
    """What decides a compiled object besides its source and flags: compiler version, machine, torch."""
    import torch
    version = _run([cxx, "--version"]).stdout.splitlines()[:1]
    cpu = ""
    try:  # -march=native depends on the processor; the model and flag lines name it
        with open("/proc/cpuinfo") as fh:
            cpu = "".join(sorted({ln for ln in fh if ln.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor()
    return "\n".join([*version, platform.machine(), cpu, torch.__version__, os.path.dirname(torch.__file__)])


# ------------------------------------------------------------------------------------------ the vector path

@dataclass(frozen=True)
class Toolchain:
    """What vector kernels compile with: the instruction set's flags, the directory of the (precompiled)
    vector header, and the directory of the link stub."""

    isa: str
    flags: tuple[str, ...]
    header_dir: str
    stub_dir: str
    torch_lib: str
    build_s: float  # seconds this process spent making it (the precompiled header's build, or its check)


def vector_capability() -> Optional[str]:
    """The ATen CPU capability whose ``at::vec`` the vector kernels use, or None where they are off
    (``FUSER_CPU_VECTORIZE=0``, not x86-64, no AVX2, or torch's headers missing)."""
    if os.environ.get("FUSER_CPU_VECTORIZE", "1") in ("0", ""):
        return None
    import torch
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    cap = torch.backends.cpu.get_cpu_capability()  # honours ATEN_CPU_CAPABILITY, as eager's dispatch does
    if cap not in ISA_FLAGS or not (_torch_include() / "ATen" / "cpu" / "vec" / "vec.h").is_file():
        return None
    return cap


def _torch_include() -> Path:
    import torch
    return Path(torch.__file__).parent / "include"


_toolchain_lock = threading.Lock()
_toolchain: dict = {}  # "value": Toolchain or None once decided


def toolchain() -> Optional[Toolchain]:
    """The vector kernels' toolchain, made on first use (once per process, and again if its directory was removed;
    the precompiled header once per machine, compiler and torch when the disk cache is on); None where vector
    kernels are off or it failed."""
    with _toolchain_lock:  # another thread needing it would wait for the same build anyway
        made = _toolchain.get("value")
        if made is not None and not os.path.isfile(os.path.join(made.header_dir, templates.VECTOR_HEADER_NAME)):
            del _toolchain["value"]  # its directory went (a cache directory removed: the benchmark's cold caches)
        if "value" not in _toolchain:
            cap = vector_capability()
            _toolchain["value"] = None if cap is None or not available() else _make_toolchain(cap)
        return _toolchain["value"]


def _vector_flags(cap: str) -> tuple[str, ...]:
    return (*flags(), *ISA_FLAGS[cap], f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}",
            "-I", str(_torch_include()))


def _private_dir(path: Path) -> bool:
    """Create ``path`` (mode 0700) if needed; whether it is a directory of this user that others cannot write."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return path.is_dir() and mine and not st.st_mode & 0o022


def _make_toolchain(cap: str) -> Optional[Toolchain]:
    import torch
    t0 = time.perf_counter()
    cxx = compiler()
    vflags = _vector_flags(cap)
    base = disk_cache.directory()
    if base is not None:
        key = disk_cache.key([("what", "cpu-toolchain"), ("identity", _identity(cxx)),
                              ("flags", " ".join(vflags)), ("header", templates.VECTOR_HEADER)])
        where = base / f"cpu-toolchain-{key[:24]}"
        if not _private_dir(where):
            where = None
    else:
        where = None
    if where is None:  # no disk cache: this process's own, removed at exit
        tmp = tempfile.TemporaryDirectory(prefix="fuser-cpu-toolchain-")
        _toolchain["tmp"] = tmp
        where = Path(tmp.name)
    header = where / templates.VECTOR_HEADER_NAME
    if not header.is_file() or header.read_text() != templates.VECTOR_HEADER:
        disk_cache.write_file(header, templates.VECTOR_HEADER.encode())
    if not _precompiled_ok(header):
        if not _precompile(cxx, vflags, header):
            return None
    # libtorch_cpu.so's soname and no symbols: the kernel records the dependency, and the dynamic loader binds
    # its SLEEF calls to the library the process has loaded already (rpath: torch's lib directory). Only the
    # linker reads it; kept beside the header
    stub = where / "stub" / "libtorch_cpu.so"
    if not stub.is_file():
        stub.parent.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=stub.parent, prefix=".tmp-", suffix=".so")
        os.close(fd)
        empty = tmp + ".c"
        Path(empty).write_text("")
        r = _run([cxx, "-shared", "-fPIC", "-x", "c", empty, "-Wl,-soname,libtorch_cpu.so", "-o", tmp])
        os.unlink(empty)
        if r.returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, stub)
    torch_lib = str(Path(torch.__file__).parent / "lib")
    return Toolchain(cap, vflags, str(where), str(stub.parent), torch_lib, time.perf_counter() - t0)


def _precompiled_ok(header: Path) -> bool:
    """Whether ``header``'s precompiled form exists and matches the digest written beside it."""
    gch = header.with_name(header.name + ".gch")
    digest = disk_cache.read(header.with_name(header.name + ".gch.sha256"))
    if digest is None or not gch.is_file():
        return False
    h = hashlib.sha256()
    with open(gch, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest().encode() == digest


def _precompile(cxx: str, vflags: tuple[str, ...], header: Path) -> bool:
    """Precompile ``header`` (about 4 s); written atomically, with its digest. False if g++ cannot."""
    gch = header.with_name(header.name + ".gch")
    fd, tmp = tempfile.mkstemp(dir=header.parent, prefix=".tmp-", suffix=".gch")
    os.close(fd)
    try:
        r = _run([cxx, *[f for f in vflags if f != "-shared"], "-x", "c++-header", str(header), "-o", tmp])
        if r.returncode != 0:
            return False
        data = Path(tmp).read_bytes()
        os.replace(tmp, gch)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    disk_cache.write(header.with_name(header.name + ".gch.sha256"), hashlib.sha256(data).hexdigest().encode())
    return True


# ---------------------------------------------------------------------------------------------- kernels

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

    def launch(self, numel: int, rank: int, sizes, strides, ptrs, scalars) -> None:
        """sizes ... scalars: addresses, or ctypes arrays (passed by reference)."""
        self._fn(numel, rank, sizes, strides, ptrs, scalars)


def is_vector_source(source: str) -> bool:
    """Whether a kernel's source is a vector kernel (includes the vector header)."""
    return templates.VECTOR_INCLUDE in source


def compile_kernel(source: str, name: str) -> tuple[CpuKernel, bool]:
    """Compile ``source`` (which defines ``extern "C" void name(...)``) and load it: (kernel, whether it was
    compiled now; False: loaded from the disk cache)."""
    cxx = compiler()
    ok, _ = _probe(cxx)
    if not ok:
        raise RuntimeError(f"no working C++ compiler: tried CXX={cxx!r}. Install g++ or set $CXX, or turn "
                           "the CPU backend off with fuser.override_can_fuse_on_cpu(False).")
    tc = toolchain() if is_vector_source(source) else None
    if is_vector_source(source) and tc is None:
        raise RuntimeError("a vector kernel without the vector toolchain (fuser.cpu.compiler.toolchain() failed); "
                           "set FUSER_CPU_VECTORIZE=0 to generate scalar kernels only")
    cmd_flags = list(flags()) if tc is None else [
        *tc.flags, "-I", tc.header_dir, "-Winvalid-pch", "-L", tc.stub_dir, "-Wl,--no-as-needed", "-ltorch_cpu",
        f"-Wl,-rpath,{tc.torch_lib}"]
    tmp = tempfile.TemporaryDirectory(prefix="fuser-cpu-")
    lib = os.path.join(tmp.name, f"{name}.so")
    compiled = []

    def build() -> bytes:
        src = os.path.join(tmp.name, f"{name}.cpp")
        with open(src, "w") as fh:
            fh.write(source)
        r = _run([cxx, src, *cmd_flags, "-o", lib])
        if r.returncode != 0:
            tmp.cleanup()
            raise CompileError(cxx, source, cmd_flags, r.stderr + r.stdout)
        compiled.append(True)
        with open(lib, "rb") as fh:
            return fh.read()

    # what the object depends on: compiler, flags, the header (its directory's name holds the header's digest)
    key_flags = list(flags()) if tc is None else [*tc.flags, tc.header_dir, tc.torch_lib]
    fields = [("what", "cpu-kernel"), ("identity", _identity(cxx)), ("flags", " ".join(key_flags)),
              ("name", name), ("source", source)]
    image = disk_cache.get_or_build(fields, build, ".so")
    if not compiled:  # from the disk cache: loaded from this process's private copy of the checked entry
        with open(lib, "wb") as fh:
            fh.write(image)
    return CpuKernel(name, lib, tmp), bool(compiled)
