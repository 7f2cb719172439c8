"""The FusionDefinition part of ``python -m fuser demo``: one nvFuser-style definition, run and checked against
eager, printed, and its standalone repro."""
from __future__ import annotations

import torch

from .datatype import DataType
from .definition import FusionDefinition


def define(fd: FusionDefinition, rows: int, cols: int) -> None:
    t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Half)
    t1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Half)
    t2 = fd.ops.broadcast_in_dim(t1, shape=[rows, cols], broadcast_dims=[1])
    t3 = fd.ops.add(t0, t2)  # half operands: computed in float, as nvFuser
    t4 = fd.ops.gelu(t3, approximate="tanh")
    fd.add_output(fd.ops.cast(t4, DataType.Half))


def show(device: torch.device) -> bool:
    rows, cols = 64, 1024
    torch.manual_seed(0)
    inputs = [torch.randn(rows, cols, device=device, dtype=torch.half),
              torch.randn(cols, device=device, dtype=torch.half)]
    with FusionDefinition() as fd:
        define(fd, rows, cols)
    out, = fd.execute(inputs)
    ref = torch.nn.functional.gelu(inputs[0].float() + inputs[1].float(), approximate="tanh").half()
    err = (out.float() - ref.float()).abs().max().item()
    ok = err <= 2e-3 * max(1.0, ref.float().abs().max().item())
    print("\n=== FusionDefinition (nvFuser's Python frontend) ===")
    print(fd)
    print(f"ran {'as a compiled kernel' if fd.last_run_fused() else 'through the fallback'} on {device}; "
          f"max |fused - eager| = {err:.3g}  ({'OK' if ok else 'MISMATCH'})")
    print("Repro script (fd.repro_script_for(inputs)):")
    print(fd.repro_script_for(inputs))
    return ok
