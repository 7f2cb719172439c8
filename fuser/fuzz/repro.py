"""Reproducers: a failing program as a runnable Python file that is also a pytest regression test."""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .ir import render
from .judge import Verdict
from .program import DTYPE_NAMES, Program


def _py_value(x) -> str:
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return repr(x)
    return repr(x)


def eager_code(p: Program) -> list:
    """The program as eager Python, one torch.ops.aten call per line (for reading)."""
    lines = []
    for j, n in enumerate(p.nodes):
        pos, kw = [], []
        for a, (aname, atype, kwo) in zip(n.args, n.schema.args):
            s = (f"t{a.v[1]}" if a.kind == "val" and a.v[0] == "t" else f"v{a.v[1]}" if a.kind == "val" else
                 f"f{a.v}" if a.kind == "float" else _py_value(a.v) if a.kind == "const" else "None"
                 if a.kind == "none" else repr(a.v) if a.kind == "str" else repr(a.v) if a.kind == "bool" else
                 repr(list(a.v)) if a.kind == "ints" else
                 f"torch.tensor({_py_value(a.v)}, dtype=torch.{DTYPE_NAMES[a.dtype]})")
            (kw.append(f"{aname}={s}") if kwo else pos.append(s))
        lines.append(f"v{j} = torch.ops.aten.{n.schema.kind.split('::')[1]}.{n.schema.overload or 'default'}"
                     f"({', '.join(pos + kw)})")
    lines.append(f"outputs = [{', '.join(f'v{r[1]}' for r in p.outputs)}]")
    return lines


def reproducer(p: Program, verdict: Verdict, device: str, origin: str, out_dir: Optional[str] = None,
               stem: str = "repro") -> str:
    """A runnable Python file reproducing ``p`` (a pytest test and a script)."""
    ir = render(p)
    total = sum(t.storage.numel() for t in p.tensors)
    data_file = None
    if total > 4096 and out_dir is not None:
        data_file = f"{stem}.pt"
        torch.save([t.storage for t in p.tensors], os.path.join(out_dir, data_file))
    in_lines = []
    for k, t in enumerate(p.tensors):
        dt = f"torch.{DTYPE_NAMES[t.dtype]}"
        if data_file is None:
            vals = ", ".join(_py_value(x) for x in t.storage.tolist())
            src = (f"torch.tensor([{vals}], dtype=torch.float64).to({dt})" if t.dtype.is_floating_point
                   else f"torch.tensor([{vals}], dtype={dt})")
        else:
            src = f"_DATA[{k}]"
        in_lines.append(f"    t{k} = {src}.to(device).as_strided({list(t.size)}, {list(t.stride)}, {t.offset})"
                        f"  # {t.layout}")
    floats = ", ".join(_py_value(f) for f in p.floats)
    detail = "\n".join("#   " + ln for ln in verdict.detail.splitlines())
    eager = "\n".join("#   " + ln for ln in eager_code(p))
    names = [f"t{k}" for k in range(len(p.tensors))] + [f"f{k}" for k in range(len(p.floats))]
    float_lines = "".join(f"    f{k} = {_py_value(f)}\n" for k, f in enumerate(p.floats))
    load = (f"_DATA = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), {data_file!r}))\n"
            if data_file else "")
    how = "fused" if verdict.fused else "fell back: " + verdict.reason
    return f'''"""fuser differential fuzzer failure: {verdict.kind} ({how}).

{origin}
Run: python {stem}.py   or   pytest {stem}.py
"""
import math
import os

import torch

from fuser.fuzz import check, parse_graph

nan, inf = math.nan, math.inf
DEVICE = {device!r}
{load}
# What it found:
{detail}
#
# The same graph in eager PyTorch:
{eager}

IR = """{ir}"""


def make_inputs(device=DEVICE):
{chr(10).join(in_lines) if in_lines else "    pass"}
{float_lines}    return [{", ".join(names)}]


def test_fuzz_repro():
    verdict = check(parse_graph(IR), make_inputs())
    assert verdict.ok, verdict.kind + ": " + verdict.detail


if __name__ == "__main__":
    graph = parse_graph(IR)
    args = make_inputs()
    print(graph)
    for a in args:
        print(a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), a) if isinstance(a, torch.Tensor) else print(a)
    v = check(graph, args)
    print("OK" if v.ok else f"MISMATCH {{v.kind}} (fused={{v.fused}}): {{v.detail}}")
'''
