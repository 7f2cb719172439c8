"""Which devices fuse: detected once, overridable by the user (``override_can_fuse_on_cpu/gpu``)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

_override_cpu: Optional[bool] = None
_override_gpu: Optional[bool] = None


@functools.lru_cache(maxsize=None)
def _cpu_available() -> bool:
    from .cpu import compiler
    return compiler.available()


@functools.lru_cache(maxsize=None)
def _gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def can_fuse_on_cpu() -> bool:
    """Whether groups on CPU tensors run as generated kernels (a working C++ compiler is needed)."""
    return _cpu_available() if _override_cpu is None else (_override_cpu and _cpu_available())


def can_fuse_on_gpu() -> bool:
    """Whether groups on CUDA tensors run as generated kernels (CUDA and cuda-python are needed)."""
    return _gpu_available() if _override_gpu is None else (_override_gpu and _gpu_available())


def override_can_fuse_on_cpu(value: bool) -> None:
    global _override_cpu
    _override_cpu = bool(value)


def override_can_fuse_on_gpu(value: bool) -> None:
    global _override_gpu
    _override_gpu = bool(value)
