"""The one gate to cuda-python: error checking for every driver/NVRTC call, and NVRTC compilation.

NVRTC needs no GPU (the ``nvidia-cuda-nvrtc`` wheel carries the library), so :func:`compile_source` runs in
CI and checks that generated kernels compile for every target architecture.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..errors import CompileError, DriverError


def _bindings():
    from cuda.bindings import driver, nvrtc
    return driver, nvrtc


def check(err, name: str) -> None:
    """Raise :class:`DriverError` naming the call ``name`` unless ``err`` is success."""
    driver, nvrtc = _bindings()
    if isinstance(err, nvrtc.nvrtcResult):
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, msg = nvrtc.nvrtcGetErrorString(err)
            raise DriverError(f"{name} failed: {err.name}: {msg.decode(errors='replace')}")
    elif err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        text = msg.decode(errors="replace") if msg else "unknown error"
        raise DriverError(f"{name} failed: {getattr(err, 'name', err)}: {text}")


def call(fn, *args):
    """Call a cuda-python binding, raise :class:`DriverError` naming the call on failure, return the values.

    Bindings return ``(error, *values)``; this returns None, the one value, or the tuple of values.
    """
    result = fn(*args)
    check(result[0], fn.__name__)
    values = result[1:]
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    _, nvrtc = _bindings()
    return tuple(call(nvrtc.nvrtcVersion))


@functools.lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    _, nvrtc = _bindings()
    return tuple(call(nvrtc.nvrtcGetSupportedArchs))


@dataclass(frozen=True)
class NvrtcOptions:
    """What NVRTC is asked for. ``cubin``: machine code for ``sm_<arch>``; otherwise PTX for
    ``compute_<arch>`` that the driver finishes at load time."""

    arch: int
    cubin: bool = True
    # NVRTC's --Ofast-compile level ("" for none; "min", "mid", "max" trade optimization for compile time)
    fast_compile: str = os.environ.get("FUSER_NVRTC_FAST_COMPILE", "")
    # multiplies and adds contracted into FMAs (--fmad=true); see fuser.cuda.launch.contracts for where
    fmad: bool = False

    def flags(self) -> list[bytes]:
        target = f"sm_{self.arch}" if self.cubin else f"compute_{self.arch}"
        # --fmad=false by default: a multiply and an add that eager runs as two ops (two kernels, two roundings) stay
        # two roundings, as -ffp-contract=off keeps them on the CPU; the fma() calls the op table writes where eager's
        # own kernel has one are kept
        fmad = b"--fmad=true" if self.fmad else b"--fmad=false"
        flags = [f"--gpu-architecture={target}".encode(), b"-std=c++17", b"-DNDEBUG", fmad]
        if self.fast_compile:
            flags.append(f"--Ofast-compile={self.fast_compile}".encode())
        if nvrtc_version() >= (12, 4):
            # NVRTC 12.4 on: leave out what the kernels never use (texture and surface types, the device runtime's
            # functions, launches from device code, the runtime's and driver's types): the same code (test_nvrtc),
            # less time in the front end (NVRTC 13.0 here, sm_90: 5-10% of a row kernel's compile)
            flags.append(b"--minimal")
        return flags


def options_for(capability: tuple[int, int]) -> NvrtcOptions:
    """Machine code for the device's own architecture when NVRTC knows it, else PTX for the newest
    architecture it knows that the device can run."""
    arch = capability[0] * 10 + capability[1]
    archs = supported_archs()
    if arch in archs:
        return NvrtcOptions(arch, cubin=True)
    older = [a for a in archs if a <= arch]
    if not older:
        raise DriverError(f"NVRTC {nvrtc_version()} supports architectures {archs}, none of which runs on "
                          f"a device of compute capability {capability}")
    return NvrtcOptions(max(older), cubin=False)


def compile_source(source: str, name: str, options: NvrtcOptions) -> bytes:
    """CUBIN (or PTX) of ``source``; raises :class:`CompileError` with NVRTC's log and the numbered source."""
    _, nvrtc = _bindings()
    prog = call(nvrtc.nvrtcCreateProgram, source.encode(), f"{name}.cu".encode(), 0, [], [])
    try:
        flags = options.flags()
        err, = nvrtc.nvrtcCompileProgram(prog, len(flags), flags)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = call(nvrtc.nvrtcGetProgramLogSize, prog)
            log = b" " * size
            call(nvrtc.nvrtcGetProgramLog, prog, log)
            raise CompileError("NVRTC", source, [f.decode() for f in flags], log.decode(errors="replace"))
        if options.cubin:
            size = call(nvrtc.nvrtcGetCUBINSize, prog)
            image = b" " * size
            call(nvrtc.nvrtcGetCUBIN, prog, image)
        else:
            size = call(nvrtc.nvrtcGetPTXSize, prog)
            image = b" " * size
            call(nvrtc.nvrtcGetPTX, prog, image)
        return image
    finally:
        call(nvrtc.nvrtcDestroyProgram, prog)

