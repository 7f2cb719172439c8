"""Transparent huge pages for large CPU outputs (fuser/cpu/pages.py for the calls Python serves, the native hot
path's advise_huge_pages for the calls it serves): an output of more than 32 MB is madvise'd MADV_HUGEPAGE before the
kernel writes it, which the kernel shows as the "hg" flag of the output's mapping in /proc/self/smaps; a pointwise
group, a row group and the native hot path; the values eager's; nothing asked where the setting is off."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_same

import fuser
from fuser import executor, native
from fuser.cpu import pages
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/proc/self/smaps") and os.path.isdir("/sys/kernel/mm/transparent_hugepage")),
    reason="Linux with transparent huge pages")

AFFINE = """graph(%x : Tensor, %col : Tensor, %row : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %col)
  %r : Tensor = aten::add(%a, %row, %one)
  return (%r)"""

SOFTMAX = """graph(%x : Tensor):
  %dim : int = prim::Constant[value=-1]()
  %none : NoneType = prim::Constant()
  %r : Tensor = aten::softmax(%x, %dim, %none)
  return (%r)"""


def _flags(address: int) -> list[str]:
    """The VmFlags of the mapping of /proc/self/smaps that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _inside(t: torch.Tensor) -> int:
    """An address of ``t`` past its first 2 MB boundary (the hint covers whole 2 MB pages only)."""
    return t.data_ptr() + 2 * pages.HUGE_PAGE


def _affine_args():
    return [torch.randn(4096, 4096), torch.randn(4096, 1), torch.randn(4096)]  # a 64 MB output


def test_a_pointwise_groups_large_output_asks_for_huge_pages():
    x, col, row = args = _affine_args()
    out, = executor.run(STORE.get(STORE.register(lower(torch.parse_ir(AFFINE)))), args)
    assert_same(out, x * col + row)
    assert "hg" in _flags(_inside(out))


def test_a_row_groups_large_output_asks_for_huge_pages():
    x = torch.randn(2048, 8192)
    out, = executor.run(STORE.get(STORE.register(lower(torch.parse_ir(SOFTMAX)))), [x])
    assert_same(out, torch.softmax(x, -1))
    assert "hg" in _flags(_inside(out))


@pytest.mark.skipif(not native.loaded(), reason="the native hot path is not loaded")
def test_the_native_hot_paths_large_output_asks_for_huge_pages():
    def affine(x, col, row):
        return x * col + row

    ff = fuser.fuse(torch.jit.script(affine))
    x, col, row = args = _affine_args()
    before = native.stats()["hits"]
    with torch.no_grad():
        for _ in range(4):
            out = ff(*args)
    assert native.stats()["hits"] - before >= 2  # served natively
    assert_same(out, x * col + row)
    assert "hg" in _flags(_inside(out))


def test_nothing_is_asked_when_off_or_for_a_smaller_output(monkeypatch):
    """No madvise call for an output of 32 MB or for any output with the setting off (counted at the call: a flag
    of the mapping could come from an earlier advised block at the same addresses); then one, and the flag."""
    calls = []
    real = pages._madvise()
    if real is None:
        pytest.skip("no madvise here")

    def counted(*a):
        calls.append(a)
        return real(*a)

    monkeypatch.setattr(pages, "_madvise", lambda: counted)
    big, small = torch.empty(pages.HUGE_MIN // 4 + 2 ** 18), torch.empty(pages.HUGE_MIN // 4)
    pages.advise([small])
    assert calls == []
    monkeypatch.setattr(pages, "ON", False)
    pages.advise([big])
    assert calls == []
    monkeypatch.setattr(pages, "ON", True)
    pages.advise([big])
    assert len(calls) == 1 and calls[0][2] == pages.MADV_HUGEPAGE
    assert "hg" in _flags(_inside(big))
