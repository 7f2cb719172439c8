"""MKL's vector math (VML) where eager's CPU ops use it: torch's x86-64 wheels link MKL into libtorch_cpu and export
its VML functions, and eager's float32 tanh, log, atan... call them (``at::vml``). A fused kernel calling the same
function gets eager's bits, and on Intel processors for the ops of ``templates.VML_FUNCTIONS`` in less time than
SLEEF's 1-ulp functions when one call takes a loop trip's vectors. Used only on Intel processors (MKL runs its
generic code paths on others: on a 2-core AMD EPYC with AVX-512, 2026-11-30, the float32 GELU block over 4M
elements took 10.2 ms with VML's tanh and 3.9 ms with SLEEF's, torch.compile 4.8), and only for the ops a probe of
this process finds exported and giving eager's bits."""
from __future__ import annotations

import ctypes
import os
import threading

import torch

from .templates import VML_FUNCTIONS

MODE = 0x140102  # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: at::vml's mode (templates.VECTOR_HEADER's FZ_VML)
_UNIT = {"asin", "acos"}  # domain [-1, 1]
_POSITIVE = {"log", "log10", "log2"}


def _sample(op: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(4096, generator=gen) * 4
    if op in _UNIT:
        x = torch.rand(4096, generator=gen) * 2 - 1
    elif op in _POSITIVE:
        x = x.abs() * 100
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0, 9.0, -9.0, 20.0, 1e30, -1e30,
                             float("inf"), float("-inf"), float("nan")])
    return torch.cat([x, torch.rand(1024, generator=gen) * 1e-3, specials])


_lock = threading.Lock()
_found: list = []  # the probe's answer, once made


def eager_ops() -> tuple[str, ...]:
    """The ops of ``VML_FUNCTIONS`` whose VML function kernels call: on an Intel processor (:func:`intel`), those
    libtorch_cpu exports and that give the results of torch's op bit for bit on float32 (random values, tiny ones,
    signed zeros, subnormals, infinities, NaN); none elsewhere. ``FUSER_CPU_VML=0``: none; ``FUSER_CPU_VML=1``: the
    probe's on any processor. Probed once per process, outside any mode a caller has on (a fake-tensor or dispatch
    mode of a tracer), without autograd."""
    with _lock:
        if not _found:
            setting = os.environ.get("FUSER_CPU_VML", "")
            if setting == "0" or (setting != "1" and not intel()):
                _found.append(())
            else:
                from torch.utils._python_dispatch import _disable_current_modes
                with _disable_current_modes(), torch.inference_mode():
                    _found.append(_probe())
        return _found[0]


def intel() -> bool:
    """Whether this is an Intel processor (/proc/cpuinfo's vendor_id), where MKL runs its tuned code paths."""
    try:
        with open("/proc/cpuinfo") as fh:
            return any(ln.startswith("vendor_id") and "GenuineIntel" in ln for ln in fh)
    except OSError:
        return False


def _probe() -> tuple[str, ...]:
    """The ops of ``VML_FUNCTIONS`` whose VML function libtorch_cpu exports and gives torch's op's bits."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return ()
    gen = torch.Generator().manual_seed(0)
    found = []
    for op, name in VML_FUNCTIONS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
        fn.restype = None
        x = _sample(op, gen)
        out = torch.empty_like(x)
        fn(x.numel(), x.data_ptr(), out.data_ptr(), MODE)
        ref = getattr(torch, op)(x)
        if bool(((out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())).all()):
            found.append(op)
    return tuple(found)
