"""Transparent huge pages for large CPU outputs (fuser/cpu/pages.py for the calls Python serves, the native hot
path's advise_huge_pages for the calls it serves): an output of more than 32 MB is madvise'd MADV_HUGEPAGE before the
kernel writes it, which the kernel shows as the "hg" flag of the output's mapping in /proc/self/smaps; a pointwise
group, a row group and the native hot path; the values eager's; nothing asked where the setting is off. The native
hot path's large outputs come from a cache of freed large blocks (hotpath.cpp's LargeCache): reuse, the values,
no sharing between live outputs, resize_, the off switch."""
from __future__ import annotations

import os
import subprocess
import sys

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


def _affine_args(rows: int = 4096):
    """x [rows, 4096], col [rows, 1], row [4096]: an output of rows x 16 KB (64 MB by default)."""
    return [torch.randn(rows, 4096), torch.randn(rows, 1), torch.randn(4096)]


MID_ROWS = range(20, 56, 3)  # 12 output sizes from 320 KB to 880 KB, more than the 8 mid-size blocks kept


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


# ------------------------------------------------------------------------- the native hot path's large blocks

def _affine_fused():
    def affine(x, col, row):
        return x * col + row

    return fuser.fuse(torch.jit.script(affine))


@pytest.mark.skipif(not native.loaded(), reason="the native hot path is not loaded")
def test_a_freed_large_output_serves_the_next_call():
    """An output of more than 32 MB freed before the next call: the next call's output takes its block (mapped
    already: no page to fault in), and its values are the call's own; an output still alive keeps its block (the
    next one gets another), and a block serves an output up to an eighth smaller, not a much smaller one."""
    ff = _affine_fused()
    args = _affine_args()
    x, col, row = args
    with torch.no_grad():
        for _ in range(3):
            ff(*args)  # profiled and warmed
        out = ff(*args)
        addr = out.data_ptr()
        del out
        before = native.stats()["new_large_blocks"]
        for _ in range(4):
            x.normal_()
            out = ff(*args)
            assert out.data_ptr() == addr
            assert_same(out, x * col + row)
            del out
        assert native.stats()["new_large_blocks"] == before
        kept = ff(*args)
        other = ff(*args)  # the first still alive: another block
        assert kept.data_ptr() != other.data_ptr()
        assert_same(kept, x * col + row) and assert_same(other, x * col + row)
        del kept, other
        # a slightly smaller output (3840 rows: 60 MB of the 64 MB block) takes a cached block; a much smaller one
        # (2304 rows: 36 MB) does not
        for rows, reused in ((3840, True), (2304, False)):
            small = _affine_args(rows)
            for _ in range(3):
                ff(*small)
            block = ff(*args)
            addr = block.data_ptr()
            del block
            got = ff(*small)
            assert (got.data_ptr() == addr) == reused, rows
            assert_same(got, small[0] * small[1] + small[2])
            del got


def _push_out_mid_size_blocks(ff) -> None:
    """Eight outputs of 37 x 4096 floats (592 KB) alive at once, then freed: the cache keeps the latest 8 mid-size
    blocks, so the blocks earlier tests of this process left there are gone, and an output of another size (more
    than 1/8 away) takes a new block."""
    a = _affine_args(37)
    for _ in range(3):
        ff(*a)
    outs = [ff(*a) for _ in range(8)]
    del outs


@pytest.mark.skipif(not native.loaded(), reason="the native hot path is not loaded")
@pytest.mark.parametrize("rows", [17, 1024])  # outputs of 272 KB and 16 MB: above the small blocks' 64 KB
def test_a_freed_mid_size_output_serves_the_next_call(rows):
    """An output between the small blocks and the huge-page ones (glibc's heap otherwise, whose trimmed blocks fault
    in again): a freed one's block serves the next call's output, values its own; one alive keeps its block, and a
    larger size does not take a smaller block; resize_ of one copies its values."""
    ff = _affine_fused()
    x, col, row = args = _affine_args(rows)
    with torch.no_grad():
        _push_out_mid_size_blocks(ff)  # (a block of an earlier test's output could serve this size)
        first = native.stats()["new_large_blocks"]
        for _ in range(3):
            ff(*args)
        out = ff(*args)
        assert native.stats()["new_large_blocks"] > first  # the block cache's, not c10's allocator's
        addr = out.data_ptr()
        assert addr % 64 == 0
        del out
        before = native.stats()["new_large_blocks"]
        for _ in range(3):
            x.normal_()
            out = ff(*args)
            assert out.data_ptr() == addr  # the block freed last
            assert_same(out, x * col + row)
            del out
        assert native.stats()["new_large_blocks"] == before
        kept = ff(*args)
        other = ff(*args)
        assert kept.data_ptr() != other.data_ptr()
        assert_same(kept, x * col + row) and assert_same(other, x * col + row)
        del other
        bigger = _affine_args(2 * rows)
        for _ in range(3):
            ff(*bigger)
        got = ff(*bigger)
        assert_same(got, bigger[0] * bigger[1] + bigger[2])
        want = kept.clone()
        kept.resize_(rows + 3, 4096)
        assert_same(kept[:rows], want)


@pytest.mark.skipif(not native.loaded(), reason="the native hot path is not loaded")
def test_the_block_cache_keeps_the_latest_blocks():
    """Outputs of more distinct sizes than the cache holds, each freed: the oldest blocks leave the cache, so the
    latest size's block serves its next call (a full cache that kept its first blocks took a new one each time)."""
    ff = _affine_fused()
    with torch.no_grad():
        sets = [_affine_args(rows) for rows in MID_ROWS]
        for args in sets:
            for _ in range(3):
                ff(*args)
        for args in sets:
            ff(*args)
        before = native.stats()["new_large_blocks"]
        for _ in range(3):
            got = ff(*sets[-1])
            assert_same(got, sets[-1][0] * sets[-1][1] + sets[-1][2])
            del got
        assert native.stats()["new_large_blocks"] == before


@pytest.mark.skipif(not native.loaded(), reason="the native hot path is not loaded")
def test_mid_size_blocks_do_not_push_out_a_huge_pages_block():
    """A 64 MB output freed, then more mid-size outputs freed than the cache keeps of them: the next 64 MB output still
    takes the cached huge-page block (the kinds are kept apart)."""
    ff = _affine_fused()
    big = _affine_args()
    mids = [_affine_args(rows) for rows in MID_ROWS]
    with torch.no_grad():
        for args in [big] + mids:
            for _ in range(3):
                ff(*args)
        ff(*big)  # freed at once: its block cached
        for args in mids:
            ff(*args)
        before = native.stats()["new_large_blocks"]
        got = ff(*big)
        assert native.stats()["new_large_blocks"] == before
        assert_same(got, big[0] * big[1] + big[2])


@pytest.mark.skipif(not native.loaded(), reason="the native hot path is not loaded")
def test_a_large_output_from_a_cached_block_resizes():
    """resize_ of an output whose storage is a large block (the storage keeps the block allocator): a larger size
    copies the values into a new block and frees the old one; its values kept."""
    ff = _affine_fused()
    args = _affine_args()
    with torch.no_grad():
        for _ in range(4):
            out = ff(*args)
    want = out.clone()
    out.resize_(4096 + 512, 4096)
    assert_same(out[:4096], want)
    out[4096:] = 1.0
    assert bool((out[4096:] == 1.0).all())


def test_large_block_off_switch(tmp_path):
    """FUSER_CPU_BLOCK_CACHE=0: large outputs from c10's allocator (no large block mapped), still with huge pages
    asked for; on: one block serves every call whose output was freed."""
    script = tmp_path / "large.py"
    script.write_text(
        "import torch, fuser\n"
        "from fuser import native\n"
        "assert native.ensure(block=True)\n"
        "def f(x, col, row):\n    return x * col + row\n"
        "ff = fuser.fuse(torch.jit.script(f))\n"
        "x, col, row = torch.randn(4096, 4096), torch.randn(4096, 1), torch.randn(4096)\n"
        "with torch.no_grad():\n"
        "    for _ in range(6):\n"
        "        out = ff(x, col, row)\n"
        "        del out\n"
        "    out = ff(x, col, row)\n"
        "assert torch.equal(out, f(x, col, row))\n"
        "hg = any('hg' in ln for ln in open('/proc/self/smaps') if ln.startswith('VmFlags'))\n"
        "print(native.stats()['hits'], native.stats()['new_large_blocks'], int(hg))\n")
    for setting, blocks in (("0", lambda n: n == 0), ("1", lambda n: 1 <= n <= 2)):
        env = dict(os.environ, FUSER_CPU_BLOCK_CACHE=setting,
                   PYTHONPATH=os.path.dirname(os.path.dirname(fuser.__file__)))
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        hits, new_large, hg = map(int, r.stdout.split())
        assert hits >= 2 and blocks(new_large) and hg == 1, (setting, hits, new_large, hg)
