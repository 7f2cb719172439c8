"""The CPU vector path's lines: the group's nodes over ATen's ``at::vec`` vectors, built beside the scalar
body, several vectors a loop trip interleaved op by op."""
from __future__ import annotations

import re
import string
from typing import Optional, Sequence

import torch

from .. import ir, ops
from ..cpu import templates as cpu_t
from ..descs import TensorDesc, compute_type, family, storage_type
from .common import KernelOptions, NodeTypes, _converted


# compute type -> the CPU vector path's value type (fuser/cpu/templates.py VECTOR_HEADER)
VECTOR_TYPES = {"float": "fz_vf", "double": "fz_vd"}
_CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")


def vector_ready(text: str) -> bool:
    """Whether a scalar expression compiles on vectors unchanged: no conditional operator, and every call one
    that the CPU vector header overloads for vectors (``cpu_t.VECTOR_FUNCTIONS``)."""
    return "?" not in text and "@IDX@" not in text and all(
        f in cpu_t.VECTOR_FUNCTIONS for f in _CALL.findall(text))


# the decompositions whose exp(x - max) takes at::vec's exp_u20 on the vector path (fz_exp_row, fuser/cpu/templates.py):
# a float32 exp within 2 ulp, where exp is SLEEF's 1-ulp one; the sum of a row's exps rounds more than either. A 2-core
# EPYC, softmax(x * 0.125) over [8 x 65536] float32: 356 -> 238-250 us a call (eager's two ops 355-366).
ROW_EXP_ORIGINS = frozenset({"aten::softmax", "aten::log_softmax"})


def vector_template(op: ops.OpDef, variant: Optional[str], fam: str) -> Optional[string.Template]:
    """The op's expression on the CPU vector path: the table's vector form, else its scalar one where that
    compiles on vectors; None: the op has none (its group keeps the scalar loop)."""
    text = op.vector_text(variant)
    if text is None:
        tmpl = op.template(variant, fam, "cpu")
        text = tmpl.template if tmpl is not None and vector_ready(tmpl.template) else None
    return None if text is None else string.Template(text)


class CpuVector:
    """The CPU vector path's lines, built beside the scalar ones: every value a vector of the group's one compute
    type (float for float16/bfloat16/float32, or double), constants and float arguments broadcast, bools masks of
    that type (lanes of all-one bits, as comparisons give them). Off for good once a node or an operand has no
    vector form (integers, mixed compute types): the kernel then keeps the scalar loop alone.

    Lines come in copies (``_0``, ``_1``... after every value's name), one per vector of a loop trip, interleaved op
    by op: the copies' independent chains keep the core busy through each other's latencies (SLEEF calls)."""

    def __init__(self, inputs: Sequence[TensorDesc], target: str, options: KernelOptions):
        ctypes_ = {compute_type(d.dtype) for d in inputs if d.dtype != torch.bool}
        # only bool inputs: the first node's compute type decides (where(c, 1.5, x) computes in float)
        self.ctype = ctypes_.pop() if len(ctypes_) == 1 else None
        self.on = target == "cpu" and options.vectorize and (self.ctype in VECTOR_TYPES or not ctypes_)
        self.vtype = VECTOR_TYPES.get(self.ctype)
        self.masks = {f"x{k}" for k, d in enumerate(inputs) if d.dtype == torch.bool}  # values that are masks
        # per node: (result name, template, its arguments with every group value as a _ref tuple)
        self.nodes: list[tuple[str, string.Template, dict, Optional[str], str]] = []
        self.vml = frozenset(options.vml)
        self.outputs: list[tuple] = []

    def stop(self) -> None:
        self.on = False

    def add(self, node, op: ops.OpDef, variant, nt: NodeTypes, consts: dict, vname: dict, vdtype: dict,
            out: str, round_to: Optional[str] = None) -> None:
        """Node ``node``'s line; ``round_to``: the storage type its result is rounded to (eager stores it)."""
        if not self.on:
            return
        if self.ctype is None:
            self.ctype, self.vtype = compute_type(nt.compute), VECTOR_TYPES.get(compute_type(nt.compute))
        ctype, vt = self.ctype, self.vtype
        tmpl = vector_template(op, variant, family(nt.compute))
        if op.name == "exp" and node.origin in ROW_EXP_ORIGINS and nt.compute == torch.float32:
            tmpl = string.Template("fz_exp_row($a)")
        if vt is None:
            return self.stop()
        mask = nt.result == torch.bool and op.compute == "common"  # a comparison
        if tmpl is None or compute_type(nt.compute) != ctype or (compute_type(nt.result) != ctype and not mask):
            return self.stop()
        args: dict = dict(consts, T=vt)
        for i, v in enumerate(node.args):
            if op.random or i == op.variant_arg or i >= len(ops.ARG_NAMES):
                continue
            arg = ops.ARG_NAMES[i]
            if not isinstance(v, ir.Value) or vdtype[v.id] is None:  # broadcast
                for key in (arg, "n" + arg):
                    if key in consts:
                        args[key] = f"{vt}({consts[key]})"
                continue
            # a value of the group, already of the compute type (rounded to it where the scalar line rounds), or
            # a mask: as it is where the op keeps the operand's type (where's condition), else as 1 or 0
            name_, st = vname[v.id], storage_type(nt.compute)
            forms = {name_: None, _converted(nt.compute, "cpu", name_): None,
                     f"fz_ld(fz_st<{st}>(({ctype}){name_}))": st}
            if consts.get(arg) not in forms or (name_ in self.masks and forms[consts[arg]] is not None):
                return self.stop()
            args[arg] = (name_, forms[consts[arg]], name_ in self.masks and i not in op.keep_args)
        if mask:
            self.masks.add(out)
        # a float32 result of an op eager computes with MKL's VML: the same call (bfloat16/float16 results: eager's
        # at::vec loops, as the template)
        vml = op.name if op.name in self.vml and nt.result == torch.float32 == nt.compute else ""
        self.nodes.append((out, tmpl, args, round_to, vml))

    def finish(self, group: ir.Group, out_dtypes, vname: dict, vdtype: dict) -> Optional["CpuVector"]:
        """This, with the kernel outputs set; None: no vector path."""
        if not self.on or self.vtype is None:
            return None
        # kernel outputs in the scalar loop's order; a cat piece of another dtype is stored in its own dtype first
        pieces = [p for o in group.outputs for p in (group.cat_pieces(o) or (o,))]
        for p, dt in zip(pieces, out_dtypes):
            name_, is_mask = vname[p.id], vname[p.id] in self.masks
            if dt == torch.bool and is_mask:  # stored as bools
                self.outputs.append((name_, None, False))
            elif compute_type(dt) == self.ctype:
                self.outputs.append((name_, None if is_mask or vdtype[p.id] == dt
                                     else storage_type(vdtype[p.id]), is_mask))
            else:
                return None
        return self

    @staticmethod
    def value(ref: tuple, copy: int) -> str:
        name_, rounded, mask_value = ref
        v = f"{name_}_{copy}"
        return f"fz_vmask_value({v})" if mask_value else v if rounded is None else f"fz_vround<{rounded}>({v})"

    def lines(self, copies: int, step: str = "W") -> list[str]:
        """The ops on ``copies`` vectors, interleaved op by op; copy c's first element is ``c * step`` past
        copy 0's in the map (random ops' index)."""
        out = []
        for name_, tmpl, args, round_to, vml in self.nodes:
            if vml:
                # the copies' vectors in one VML call, as eager makes it: eager's bits, and the call's own cost
                # (tens of ns) spread over a trip's vectors
                a = args["a"]
                ins = ", ".join(self.value(a, c) if isinstance(a, tuple) else a for c in range(copies))
                out += [f"const fz_vf {name_}_in[{copies}] = {{{ins}}};", f"fz_vf {name_}_out[{copies}];",
                        f"fz_vml_{vml}f({name_}_in, {name_}_out);"]
                out += [f"const fz_vf {name_}_{c} = {name_}_out[{c}];" for c in range(copies)]
                continue
            for c in range(copies):
                subs = {k: self.value(a, c) if isinstance(a, tuple) else a for k, a in args.items()}
                subs.update({"n" + k: f"(-{subs[k]})" for k, a in args.items() if isinstance(a, tuple)})
                index = f"(unsigned long long)(i + {c} * {step})" if c else "(unsigned long long)(i)"
                expr = tmpl.substitute(subs).replace('@IDX@', index)
                if round_to is not None:
                    expr = f"fz_vround<{round_to}>({expr})"
                out.append(f"const {self.vtype} {name_}_{c} = {expr};")
        return out

    def output(self, m: int, copy: int) -> str:
        return self.value(self.outputs[m], copy)
