"""Transparent huge pages for large CPU outputs: the calls Python serves do what the native hot path's
``advise_huge_pages`` (``fuser/native/hotpath.cpp``, where the measurements are) does for the calls it serves.

An output of more than :data:`HUGE_MIN` bytes is a mapping of its own (glibc maps every block above 32 MB apart; one
of 32 MB or less may sit in the heap, whose mapping a hint would mark for every later block there), whose first
touch by the kernel faults a 4 KB page at a time; ``madvise(MADV_HUGEPAGE)`` over its whole 2 MB pages, before the
kernel writes it, makes those faults 512 times fewer where the system's transparent huge pages are in "madvise" mode.
A hint: where it fails or THP is "never", nothing changes. ``FUSER_CPU_HUGE_PAGES=0`` turns it off (read at import).
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Iterable, Optional

import torch

HUGE_PAGE = 2 << 20
HUGE_MIN = 32 << 20
MADV_HUGEPAGE = 14  # (Linux, every architecture)
ON = os.environ.get("FUSER_CPU_HUGE_PAGES", "1") != "0"


@functools.lru_cache(maxsize=None)
def _madvise() -> Optional[object]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def advise(outputs: Iterable[torch.Tensor]) -> None:
    """Ask for huge pages over each CPU output's whole 2 MB pages, for outputs of more than :data:`HUGE_MIN` bytes."""
    if not ON:
        return
    for t in outputs:
        n = t.untyped_storage().nbytes()
        if n <= HUGE_MIN or t.device.type != "cpu":
            continue
        madvise = _madvise()
        if madvise is None:
            return
        p = t.untyped_storage().data_ptr()
        first, end = (p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), (p + n) & ~(HUGE_PAGE - 1)
        if end > first:
            madvise(first, end - first, MADV_HUGEPAGE)


__all__ = ["HUGE_MIN", "HUGE_PAGE", "ON", "advise"]
