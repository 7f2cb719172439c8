"""The compilers' caches during a run: on disk empty from the start (:func:`cold_caches`), and every first call of
a fuser system building its own kernels (:func:`own_builds`), so that a first call's time is a cold compile's."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Optional

from fuser import native
from fuser.kernel_cache import STORE

# the caches on disk a first call may find kernels in: fuser's, Inductor's (its FX graph and AOTAutograd caches
# too), Triton's, and the CUDA driver's compute cache, where NVRTC 12.9 on keeps what it compiled (PTX and CUBIN
# by source and options) when a driver is present
COLD_CACHES = ("FUSER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH")
# and the driver's compute cache off: within the run NVRTC would give a second compile of one source (the
# TorchScript pass and the torch.compile backend often make the same kernel) back from it (Triton hands the driver
# machine code, which that cache does not hold)
COLD_OFF = ("CUDA_CACHE_DISABLE",)

_cold: dict = {}  # "base": cold_caches' temporary directory while it holds


@contextlib.contextmanager
def cold_caches() -> Iterator[str]:
    """While it holds, each of :data:`COLD_CACHES` names an empty directory of a new temporary one and each of
    :data:`COLD_OFF` is 1 (removed afterwards, and the variables restored); entered before CUDA initializes (the
    driver reads its cache's place then). Yields that directory."""
    base = tempfile.mkdtemp(prefix="fuser-bench-caches-")
    saved = {var: os.environ.get(var) for var in COLD_CACHES + COLD_OFF}
    try:
        for var in COLD_CACHES:
            os.environ[var] = os.path.join(base, var.lower())
        for var in COLD_OFF:
            os.environ[var] = "1"
        _cold["base"] = base
        yield base
    finally:
        _cold.pop("base", None)
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def own_builds() -> Iterator[Optional[str]]:
    """While it holds, what runs builds fuser's kernels anew: those built so far are set aside
    (``KernelStore.kernels_set_aside``), the native hot path forgets its prepared launches, and under
    :func:`cold_caches` fuser's disk cache is a new empty directory (yielded; None otherwise). For a first call of
    the TorchScript pass or the torch.compile backend after the other made the same group in the row."""
    base = _cold.get("base")
    saved = os.environ.get("FUSER_CACHE_DIR")
    place = tempfile.mkdtemp(dir=base, prefix="fuser-") if base is not None else None
    native.clear()
    try:
        if place is not None:
            os.environ["FUSER_CACHE_DIR"] = place
        with STORE.kernels_set_aside():
            yield place
    finally:
        if place is not None:
            if saved is None:
                os.environ.pop("FUSER_CACHE_DIR", None)
            else:
                os.environ["FUSER_CACHE_DIR"] = saved
