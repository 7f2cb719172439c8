"""Build and load the native hot path (``hotpath.cpp``): a shared library linked against this process's torch.

Built once per machine, compiler, torch and source (the disk cache holds the object under a digest of all four,
with the same rules as kernels: the user's 0700 directory, a checked payload, atomic writes), then copied to a
private temporary directory and loaded from there with ``torch.ops.load_library``. Without the disk cache nothing
is built unless ``FUSER_NATIVE=1`` asks for it (a build costs tens of seconds: once per process would be worse
than the Python path it replaces for most programs).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from .. import disk_cache
from ..cpu import compiler as cpu_compiler
from ..errors import CompileError

SOURCE = Path(__file__).with_name("hotpath.cpp")


def _torch_dirs() -> tuple[list[str], str]:
    root = Path(torch.__file__).parent
    inc = root / "include"
    return [str(inc), str(inc / "torch" / "csrc" / "api" / "include")], str(root / "lib")


def command(cxx: str, src: str, out: str) -> list[str]:
    """The compiler command that builds ``src`` into the shared library ``out``."""
    includes, lib = _torch_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f for d in includes for f in ("-isystem", d)], src, "-o", out,
            "-L", lib, "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-ldl"]


class Built:
    """The loaded library: where it lies and what loading it cost."""

    def __init__(self, path: str, compiled: bool, seconds: float, tmp: tempfile.TemporaryDirectory):
        self.path, self.compiled, self.seconds, self._tmp = path, compiled, seconds, tmp


def build_and_load() -> Built:
    """Compile (or take from the disk cache) and load the library; raises CompileError or OSError."""
    t0 = time.perf_counter()
    cxx = cpu_compiler.compiler()
    source = SOURCE.read_text()
    tmp = tempfile.TemporaryDirectory(prefix="fuser-native-")
    lib = os.path.join(tmp.name, "fuser_native.so")
    compiled = []

    def build() -> bytes:
        src = os.path.join(tmp.name, "hotpath.cpp")
        with open(src, "w") as fh:
            fh.write(source)
        cmd = command(cxx, src, lib)
        r = cpu_compiler._run(cmd)
        if r.returncode != 0:
            raise CompileError(cxx, source, cmd[1:], r.stderr + r.stdout)
        compiled.append(True)
        with open(lib, "rb") as fh:
            return fh.read()

    fields = [("what", "native-hotpath"), ("identity", cpu_compiler._identity(cxx)),
              ("command", " ".join(command(cxx, "SRC", "OUT"))), ("source", source)]
    image = disk_cache.get_or_build(fields, build, ".so") if disk_cache.directory() is not None else build()
    if not compiled:  # from the disk cache: loaded from this process's private copy of the checked entry
        with open(lib, "wb") as fh:
            fh.write(image)
    torch.ops.load_library(lib)
    return Built(lib, bool(compiled), time.perf_counter() - t0, tmp)


def wanted() -> Optional[bool]:
    """``FUSER_NATIVE``: "0" off, "1" on even without the disk cache; unset: on where the disk cache is."""
    v = os.environ.get("FUSER_NATIVE", "")
    if v == "0":
        return False
    if v == "1":
        return True
    return disk_cache.directory() is not None
