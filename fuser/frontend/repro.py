"""Reproducers: a definition printed as runnable Python in nvFuser's style (``print(fd)``, the
``PYTORCH_NVFUSER_DUMP=python_definition`` dump), and standalone scripts that re-create a fusion and run it on
inputs like the given ones (``fd.repro_script_for(inputs)``)."""
from __future__ import annotations

import math
import os
import sys

import torch

from .datatype import DataType
from .records import Record, Ref

DUMP_VARS = ("PYTORCH_NVFUSER_DUMP", "NVFUSER_DUMP")


def literal(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    if isinstance(v, complex):
        return f"complex({literal(v.real)}, {literal(v.imag)})"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(literal(x) for x in v) + "]"
    if isinstance(v, (DataType, Ref)) or v is None or isinstance(v, (bool, int)):
        return repr(v)
    if isinstance(v, str):
        return repr(v)
    raise TypeError(f"cannot print {v!r}")


def record_line(r: Record) -> str:
    args = [literal(a) for a in r.args] + [f"{k}={literal(v)}" for k, v in r.kwargs]
    call = ("fd." if r.name.startswith(("define_", "add_output")) else "fd.ops.") + f"{r.name}({', '.join(args)})"
    if not r.outputs:
        return call
    return ", ".join(repr(o) for o in r.outputs) + " = " + call


def definition_text(records, fusion_id) -> str:
    name = "nvfuser_incomplete_fusion" if fusion_id is None else f"nvfuser_fusion_id{fusion_id}"
    lines = [f"def {name}(fd : FusionDefinition) -> None :"]
    lines += ["    " + record_line(r) for r in records]
    return "\n".join(lines) + "\n"


def dump_requested() -> bool:
    return any("python_definition" in os.environ.get(v, "").split(",") for v in DUMP_VARS)


def dump(text: str) -> None:
    print(text, file=sys.stdout, flush=True)


def _make_tensor(t: torch.Tensor) -> str:
    shape, strides = tuple(t.shape), tuple(t.stride())
    n = 0 if t.numel() == 0 else 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    dt, dev = str(t.dtype), str(t.device)
    if t.dtype == torch.bool:
        base = f"(torch.rand({n}, device={dev!r}) < 0.5)"
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        base = f"torch.randn({n}, dtype={dt}, device={dev!r})"
    else:
        base = f"torch.randint(-8, 9, ({n},), dtype={dt}, device={dev!r})"
    return f"{base}.as_strided({shape!r}, {strides!r})"


def script(records, fusion_id, inputs) -> str:
    """A standalone script: the definition, inputs like ``inputs`` (shapes, strides, dtypes, devices; random
    values) and the run. ``python repro.py saved_inputs.pt outputs.pt`` runs it on saved inputs instead and saves
    the outputs (both with ``torch.save``)."""
    name = f"nvfuser_fusion_id{fusion_id}"
    made = []
    for x in inputs:
        made.append(_make_tensor(x) if isinstance(x, torch.Tensor) else literal(x))
    body = definition_text(records, fusion_id)
    return f'''# A fuser FusionDefinition repro (torch {torch.__version__}).
# python this.py [inputs.pt [outputs.pt]]: run on fresh random inputs, or on inputs saved with torch.save
import sys

import torch
from fuser.frontend import DataType, FusionDefinition

{body}

with FusionDefinition() as fd:
    {name}(fd)


def make_inputs():
    return [
{"".join(f"        {m},{chr(10)}" for m in made)}    ]


if __name__ == "__main__":
    inputs = torch.load(sys.argv[1]) if len(sys.argv) > 1 else make_inputs()
    outputs = fd.execute(inputs)
    if len(sys.argv) > 2:
        torch.save(outputs, sys.argv[2])
    else:
        for out in outputs:
            print(out)
'''
