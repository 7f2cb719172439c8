"""Every entry of the op table, end to end on the CPU backend against eager, and its CUDA source through
NVRTC for sm_80 and sm_90 (no GPU needed)."""
import pytest
import torch
from helpers import FMA_OPS, build, cases, check_fused_multiply_adds, check_op_against_eager

import fuser
from fuser import codegen, compiler, ops
from fuser.descs import DENSE, REPEAT, ROWS, STRIDED, ArgSpec, TensorDesc, family
from fuser.kernel_cache import STORE
from fuser.ts_ir import lower

CASES = cases()
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32)


def test_every_op_has_a_case():
    assert {c.op for c in CASES} == {n for n, op in ops.OPS_BY_NAME.items() if not op.concat}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op_cpu_vs_eager(case, dtype):
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")
    check_op_against_eager(case, dtype)


@pytest.mark.parametrize("arch", (80, 90))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op_cuda_source_compiles(case, arch):
    """Generate each op's CUDA kernel for every layout class (dense and row-strided inputs take the vector
    path) in several dtypes and compile it with NVRTC."""
    from fuser.cuda import driver
    b = build(case)
    spec = STORE.get(STORE.register(lower(b.graph)))
    n_t = spec.n_tensor_inputs
    for dtype, layout in ((torch.float32, DENSE), (torch.float16, STRIDED), (torch.int32, STRIDED),
                          (torch.float64, DENSE), (torch.bfloat16, ROWS), (torch.float32, REPEAT)):
        descs = tuple(TensorDesc(torch.bool if n == "condition" else dtype, layout) for n in b.tensor_args)
        assert len(descs) == n_t
        arg_spec = ArgSpec("cuda", 0, descs, True)
        try:
            types = compiler.infer_types(spec, arg_spec, "cpu")  # dtypes only: probed on the CPU
        except Exception:
            continue  # eager rejects these dtypes
        try:
            src = codegen.generate(spec.group, descs, types, "cuda", "k")
        except codegen.NotFusable:
            assert family(types[-1].compute) == "i"
            continue
        image = driver.compile_source(src, "k", driver.NvrtcOptions(arch))
        assert len(image) > 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("op", sorted(FMA_OPS))
def test_fused_multiply_adds_match_eager_bitwise(op, dtype):
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")
    check_fused_multiply_adds(op, dtype, "cpu")
