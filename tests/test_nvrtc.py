"""NVRTC's flags (``fuser.cuda.driver.NvrtcOptions``): ``--minimal`` (NVRTC 12.4 on) leaves the machine code of
every kind of kernel as it was: a pointwise kernel, a row kernel and both column kernels (whole vectors, element by
element) compile to the same CUBIN bytes with it and without it, for sm_80 and sm_90. Needs no GPU."""
from __future__ import annotations

import pytest
import torch

from helpers import reduce_node
from fuser import codegen, compiler, ir, rows
from fuser.cuda import driver
from fuser.descs import DENSE, ArgSpec, TensorDesc
from fuser.kernel_cache import STORE
from fuser.rows import outer_launch


def _spec(group: ir.Group):
    return STORE.get(STORE.register(group))


def _sources() -> dict:
    """A kernel of each kind, generated for CUDA from seeded random bfloat16 inputs."""
    gen = torch.Generator().manual_seed(7)
    b = ir.Builder()
    x, y = b.input(), b.input()
    t = b.call("aten::tanh", b.call("aten::mul", b.call("aten::add", x, y, 1), 0.5))
    pointwise = _spec(b.build([b.call("aten::mul", t, y)]))
    arg_spec = ArgSpec("cuda", 0, (TensorDesc(torch.bfloat16, DENSE),) * 2, True, (DENSE,))
    types = compiler.infer_types(pointwise, arg_spec, "cpu")
    out = {"pointwise": codegen.generate(pointwise.group, arg_spec.inputs, types, "cuda", "k_pointwise")}

    b = ir.Builder()
    x = b.input()
    softmax = _spec(b.build([b.add("aten::softmax.int", b.call("aten::mul", x, 0.5), -1, None)]))
    p = rows.plan(softmax, [torch.randn(64, 4096, dtype=torch.bfloat16, generator=gen)], "cuda")
    out["row"] = rows.launch.source_for(softmax, p)[1]

    b = ir.Builder()
    x, y = b.input(), b.input()
    prod = b.call("aten::mul", b.call("aten::sigmoid", x), y)
    columns = _spec(b.build([prod, reduce_node(b, "sum", prod, (0,), False)]))
    args = [torch.randn(64, 256, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    p = rows.plan(columns, args, "cuda")
    assert isinstance(p, rows.OuterPlan) and p.key.vectors
    out["columns"] = outer_launch.source_for(columns, p)[1]
    out["columns_any"] = outer_launch.source_for(columns, outer_launch.any_plan(p))[1]
    return out


@pytest.mark.skipif(driver.nvrtc_version() < (12, 4), reason="--minimal is NVRTC 12.4's")
@pytest.mark.parametrize("arch", (80, 90))
def test_minimal_leaves_every_kind_of_kernel_the_same_machine_code(arch, monkeypatch):
    options = driver.NvrtcOptions(arch)
    assert b"--minimal" in options.flags()
    with_it = {k: driver.compile_source(s, k, options) for k, s in _sources().items()}
    flags = options.flags()
    monkeypatch.setattr(driver.NvrtcOptions, "flags", lambda self: [f for f in flags if f != b"--minimal"])
    without = {k: driver.compile_source(s, k, options) for k, s in _sources().items()}
    for kind in with_it:
        assert len(with_it[kind]) > 1000 and with_it[kind] == without[kind], kind
