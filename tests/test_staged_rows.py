"""CUDA row kernels that keep a row in shared memory (fuser/rows/shape.py's ``staged_inputs``, ``CudaShape.staged``):
a row too long for a block's registers and not held by a cluster (2-byte tensors) is read again by each pass; the
inputs that several passes read and that differ from row to row are copied into shared memory at the row's start
(asynchronous copies, all in flight at once) and read back from there by every pass. The plan's choice (which
inputs, within the device's shared memory, the setting off); the kernels through the CUDA host emulation against eager and eager in float64 (rows that are a whole number
of trips and rows that are not, one and two staged inputs, a variance's two passes, more rows than the emulated
blocks so that a block stages a second row over its first), the source copying each staged input from global memory
once a row, and the harness failing a launch given too little shared memory; on a GPU (marked gpu), the
same groups through the executor and the TorchScript pass's native hot path."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import fuser
from helpers import row_kernels
from fuser import executor, native, rows
from fuser.cuda import emulate
from fuser.kernel_cache import STORE
from fuser.rows import emulate as row_emulate
from fuser.rows import launch
from fuser.rows import shape as row_shape

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_normalizations import CASES, _check, _group  # noqa: E402

ROWS = 5  # more rows than the emulation's blocks (3): a block stages a second row over its first


def _case(case_id: str):
    return next(c for c in CASES if c.id == case_id)


def _args(case, dtype, n: int) -> list:
    """The case's inputs with ROWS rows (its row-varying inputs extended by rows of other values)."""
    return [a if a.dim() < 2 else torch.cat([a] + [torch.randn_like(a[:1]) * 2] * (ROWS - a.shape[0]))
            for a in case.inputs(dtype, n)]


def _plan(case, n: int, args):
    return rows.plan(STORE.get(STORE.register(_group(case, n))), args, "cuda")


# (case, row length, dtype, the staged inputs): softmax's x but not its mask (one row for every row); both of the
# layer_norm block's row-varying inputs (x and residual) where two rows fit, x alone where only one does
_STAGED = [("softmax", 16384, torch.bfloat16, (0,)), ("softmax", 16392, torch.bfloat16, (0,)),
           ("log_softmax", 16392, torch.float16, (0,)), ("layer_norm_block", 16392, torch.bfloat16, (0, 2)),
           ("layer_norm_block", 65536, torch.bfloat16, (0,)), ("rms_norm-1e-06", 16392, torch.bfloat16, (0,)),
           ("rms_norm-1e-06", 65536, torch.bfloat16, (0,)), ("var.correction-1-keep", 16400, torch.bfloat16, (0,))]


@pytest.mark.parametrize("case_id,n,dtype,staged", _STAGED, ids=str)
def test_staged_rows_emulated_match_eager(case_id, n, dtype, staged):
    case = _case(case_id)
    args = _args(case, dtype, n)
    p = _plan(case, n, args)
    sh = p.key.shape
    assert not sh.held and sh.cluster == 1 and sh.staged == staged and sh.full == (n % (sh.tpr * sh.items) == 0)
    assert launch.plan_stage_bytes(p) == sum(-(-n * args[k].element_size() // 16) * 16 for k in staged)
    source = launch.source_for(STORE.get(STORE.register(_group(case, n))), p)[1]
    # each staged input is copied from global memory once a row, and read back from shared memory by every pass
    assert source.count("fz_row_fetch<") == len(staged) and not any(f"(xl{k}, t{k}, " in source for k in staged)
    assert all(f"fz_row_staged<{sh.items // sh.vec}, {sh.vec}, {sh.tpr}, {str(sh.full).lower()}>(xl{k}, fz_sg{k}"
               in source for k in staged)
    out = row_emulate.run(_group(case, n), args)
    assert out is not None
    _check(out, case, args)


def test_staged_plan_choice(monkeypatch):
    """Not for rows held in registers or by a cluster, nor for inputs that do not step by 1 along the row (no
    vectors-only kernel), nor for inputs one pass reads, nor where a block's rows do not fit; and not with
    settings.cuda_staged_rows off (FUSER_CUDA_STAGED_ROWS=0)."""
    soft = _case("softmax")
    for n, dtype in ((4096, torch.bfloat16), (16384, torch.float32), (65536, torch.float32)):
        sh = _plan(soft, n, _args(soft, dtype, n)).key.shape
        assert (sh.held or sh.cluster > 1) and not sh.staged
    x, mask = _args(soft, torch.bfloat16, 16384)
    padded = torch.randn(ROWS, 16384 + 64, dtype=torch.bfloat16)[:, :16384]  # rows apart by more than their length
    assert _plan(soft, 16384, [padded, mask]).key.shape.staged == (0,)
    strided = torch.randn(ROWS, 2 * 16384, dtype=torch.bfloat16)[:, ::2]
    p = _plan(soft, 16384, [strided, mask])
    assert p.key.steps is None and not p.key.shape.staged
    # layer_norm(x + bias + residual): the bias (one row for all) is not staged; gamma and beta are read once
    ln = _case("layer_norm_block")
    args = _args(ln, torch.bfloat16, 16384)
    assert _plan(ln, 16384, args).key.shape.staged == (0, 2)
    # the device's limit: one row of 32 KB fits 40 KB, two do not
    monkeypatch.setattr(row_shape, "stage_limit", lambda device: 40 * 1024)
    assert _plan(ln, 16384, args).key.shape.staged == (0,)
    monkeypatch.setattr(row_shape, "stage_limit", lambda device: 16 * 1024)
    assert _plan(ln, 16384, args).key.shape.staged == ()
    monkeypatch.undo()
    monkeypatch.setattr(fuser.settings, "cuda_staged_rows", False)
    assert row_shape.stage_limit(torch.device("cpu")) == 0
    assert _plan(ln, 16384, args).key.shape.staged == ()


def test_the_vector_choice_kernel_of_a_staged_plan_stages_nothing():
    """A launch whose pointers are not aligned for vectors runs the kernel with the run-time choice
    (launch.any_plan), which keeps no input in shared memory: misaligned views through the emulation."""
    case = _case("softmax")
    n = 16392
    x, mask = _args(case, torch.bfloat16, n)
    base = torch.empty(x.numel() + 1, dtype=x.dtype)
    shifted = base[1:].view(x.shape).copy_(x)  # rows one element off a 16-byte boundary
    p = _plan(case, n, [shifted, mask])
    assert p.key.shape.staged == (0,)
    assert launch.any_plan(p).key.shape.staged == () and launch.plan_stage_bytes(launch.any_plan(p)) == 0
    out = row_emulate.run(_group(case, n), [shifted, mask])
    assert out is not None
    _check(out, case, [shifted, mask])


def test_the_emulation_fails_a_staged_launch_with_too_little_shared_memory():
    """The harness gives a launch exactly the shared memory it asks for: a staged kernel given 16 bytes less than
    the plan's reaches past it, and the sanitizer says so (so the plan's size and the kernel's layout agree)."""
    case = _case("layer_norm_block")
    n = 16392
    args = _args(case, torch.bfloat16, n)
    p = _plan(case, n, args)
    em = emulate.default()
    name = row_emulate.kernel_for(_group(case, n), args, em)
    outputs = [torch.empty(s, dtype=dt) for s, dt in zip(p.out_shapes, p.out_dtypes)]
    struct = launch.args_struct(len(p.tensors), len(p.tensors) + len(outputs), len(p.scalars))
    a = launch.fill_args(struct, p.rows, p.cols, p.lead, p.strides, p.tensors, p.scalars, outputs, True)
    spans = row_emulate._spans(p.tensors, empty=0) + [(o.data_ptr(), o.numel() * o.element_size(), None)
                                                      for o in outputs]
    grid = launch.grid_for(p.rows, p.key.shape, emulate.EMU_BLOCKS)
    em.run(name, grid, p.key.shape.block, bytes(a), spans, shared=launch.plan_stage_bytes(p))
    with pytest.raises(emulate.EmulationError, match="heap-buffer-overflow"):
        em.run(name, grid, p.key.shape.block, bytes(a), spans, shared=launch.plan_stage_bytes(p) - 16)


@pytest.mark.gpu
@pytest.mark.parametrize("case_id,n,dtype,staged", _STAGED, ids=str)
def test_staged_rows_on_the_gpu(case_id, n, dtype, staged):
    case = _case(case_id)
    args = [a.cuda() for a in _args(case, dtype, n)]
    spec = STORE.get(STORE.register(_group(case, n)))
    out = executor.run(spec, args)
    assert out is not None, executor.plan(spec, args)
    assert [k for k in row_kernels(spec) if "fz_row_fetch<" in k.source]
    _check([o.cpu() for o in out], case, [a.cpu() for a in args])


SOURCE = """
import torch
from torch import Tensor


def staged_softmax(x: Tensor) -> Tensor:
    return torch.softmax(x * 0.125, -1)


def staged_layer_norm(x: Tensor, residual: Tensor, w: Tensor) -> Tensor:
    return torch.layer_norm(x + residual, [16384], None, None, 1e-5) * w
"""


@pytest.mark.gpu
def test_staged_rows_through_the_pass_and_the_native_hot_path(tmp_path):
    """Scripted functions through the pass: the first calls plan through Python, the next ones launch through the
    native hot path's record (its launch's shared memory), every call against eager in float64."""
    path = tmp_path / "staged_fns.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("staged_fns", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = ((mod.staged_softmax, lambda: [torch.randn(9, 65536, device="cuda", dtype=torch.bfloat16) * 4]),
             (mod.staged_layer_norm, lambda: [torch.randn(7, 16384, device="cuda", dtype=torch.bfloat16),
                                              torch.randn(7, 16384, device="cuda", dtype=torch.bfloat16),
                                              torch.randn(16384, device="cuda", dtype=torch.bfloat16)]))
    for fn, make in cases:
        fused = fuser.fuse(torch.jit.script(fn))
        hits = native.stats()["hits"] if native.loaded() else 0
        with torch.no_grad():
            for _ in range(5):
                args = make()
                got = fused(*args)
                want = fn(*[a.double() for a in args])
                torch.testing.assert_close(got.double(), want, rtol=2.4e-2, atol=2.4e-2 * want.abs().max().item())
        if native.loaded():
            assert native.stats()["hits"] - hits >= 2
