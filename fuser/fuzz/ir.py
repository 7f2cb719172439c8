"""Programs as TorchScript IR text, and IR text back to a graph (NaN and exact 0-dim tensor constants
included, which ``torch.parse_ir`` alone loses)."""
from __future__ import annotations

import math
import re

import torch

from .program import _TCONST_TYPES, Program


_NAN_MARK = "0.0"


def _fmt_scalar(v) -> str:
    if isinstance(v, bool):
        raise TypeError("bool scalars do not match Scalar in TorchScript IR")
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    return repr(float(v))


def render(p: Program) -> str:
    """The TorchScript IR of ``p``: tensor inputs ``%t*`` first, then float inputs ``%f*``."""
    ins = [f"%t{k} : Tensor" for k in range(len(p.tensors))] + [f"%f{k} : float" for k in range(len(p.floats))]
    lines = []
    for j, n in enumerate(p.nodes):
        names = []
        for i, (a, (aname, atype, _)) in enumerate(zip(n.args, n.schema.args)):
            c = f"%c{j}_{i}"
            if a.kind == "val":
                names.append(f"%{a.v[0] if a.v[0] == 't' else 'v'}{a.v[1]}")
                continue
            if a.kind == "float":
                names.append(f"%f{a.v}")
                continue
            if a.kind == "const":
                ty = "int" if isinstance(a.v, int) else "float"
                lines.append(f"  {c} : {ty} = prim::Constant[value={_fmt_scalar(a.v)}]()")
            elif a.kind == "bool":
                lines.append(f"  {c} : bool = prim::Constant[value={int(a.v)}]()")
            elif a.kind == "ints":
                lines.append(f"  {c} : int[] = prim::Constant[value=[{', '.join(map(str, a.v))}]]()")
            elif a.kind == "none":
                lines.append(f"  {c} : NoneType = prim::Constant()")
            elif a.kind == "str":
                lines.append(f'  {c} : str = prim::Constant[value="{a.v}"]()')
            elif a.kind == "tconst":
                lines.append(f"  {c} : {_TCONST_TYPES[a.dtype]}(requires_grad=0, device=cpu) = "
                             f"prim::Constant[value={{{_fmt_scalar(a.v)}}}]()")
            names.append(c)
        lines.append(f"  %v{j} : Tensor = {n.schema.kind}({', '.join(names)})")
    outs = ", ".join(f"%v{r[1]}" for r in p.outputs)
    return f"graph({', '.join(ins)}):\n" + "\n".join(lines) + f"\n  return ({outs})\n"


_CONST_RE = re.compile(r"^\s*%[\w.]+ : (\w+(?:\[\])?)(\([^)]*\))? = prim::Constant(\[value=(.*)\])?\(\)\s*$")
_TYPE_DTYPES = {v: k for k, v in _TCONST_TYPES.items()}


def _parse_number(s: str):
    s = s.strip()
    if s in ("nan", "-nan"):
        return float("nan")
    if s in ("inf", "-inf"):
        return float(s)
    try:
        return int(s)
    except ValueError:
        return float(s)


def parse_graph(text: str) -> torch._C.Graph:
    """``torch.parse_ir`` of ``text``, also accepting ``value=nan`` float constants and exact 0-dim tensor
    constants (``Double(requires_grad=0, device=cpu) = prim::Constant[value={-0.25}]()``; the IR parser
    itself drops a tensor constant's minus sign and has no NaN literal)."""
    patches, out_lines = [], []
    for line in text.splitlines():
        m = _CONST_RE.match(line)
        if m is None:
            out_lines.append(line)
            continue
        ty, _, _, value = m.groups()
        if ty == "float" and value is not None and value.strip() in ("nan", "-nan"):
            patches.append(("f", float("nan")))
            line = line.replace(f"[value={value}]", f"[value={_NAN_MARK}]")
        elif ty in _TYPE_DTYPES and value is not None and value.startswith("{"):
            v = _parse_number(value.strip("{}"))
            patches.append(("t", torch.tensor(v, dtype=_TYPE_DTYPES[ty])))
            line = line.replace(f"[value={value}]", "[value={0}]")
        else:
            patches.append(None)
        out_lines.append(line)
    g = torch.parse_ir("\n".join(out_lines), parse_tensor_constants=True)
    consts = [n for n in g.nodes() if n.kind() == "prim::Constant"]
    if len(consts) != len(patches):
        raise ValueError("constants of the parsed graph do not match the text")
    for n, patch in zip(consts, patches):
        if patch is None:
            continue
        if patch[0] == "f":
            n.f_("value", patch[1])
        else:
            n.t_("value", patch[1])
    return g
