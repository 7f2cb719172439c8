"""The per-element body of a kernel: each node of the group as one C statement over its operands, in the
values' compute types, with the op table's expression for the node's target and compute family (see
``fuser/ops.py``), then the kernel's outputs (a cat's result as its pieces)."""
from __future__ import annotations

import string
from typing import Optional, Sequence

import torch

from .. import ir, ops, rng
from ..descs import DENSE, TensorDesc, compute_type, family, storage_type
from .common import (REDUCED, TARGETS, KernelOptions, NodeTypes, NotFusable, _as_held, _converted, literal,
                     value_type)
from .cpu_vector import CpuVector
from .emit import CpuGen, CudaGen


def generate(group: ir.Group, inputs: Sequence[TensorDesc], node_types: Sequence[NodeTypes], target: str,
             name: str, options: KernelOptions = KernelOptions(), out_layouts: Sequence[str] = ()) -> str:
    """Source of one kernel.

    group: the fusion group; its tensor inputs and float inputs in any order.
    inputs: one description per tensor input. node_types: one entry per node of the group, in order.
    target: ``"cpu"`` or ``"cuda"``. out_layouts: per kernel output (a cat's result is one output per piece),
    its layout class; empty: all dense.
    """
    if target not in TARGETS:
        raise ValueError(f"Unsupported target={target!r} (supported: {', '.join(TARGETS)})")
    n_tensors = sum(v.is_tensor for v in group.inputs)
    n_scalars = len(group.inputs) - n_tensors
    if n_tensors != len(inputs):
        raise ValueError(f"the group has {n_tensors} tensor inputs, descriptions give {len(inputs)}")
    nodes = group.nodes
    if len(nodes) != len(node_types):
        raise ValueError(f"{len(nodes)} nodes but {len(node_types)} node types")
    if any(group.is_input(v) for v in group.outputs):
        raise NotFusable("an output is an input (a kernel's outputs are fresh tensors)")

    # every value: C name and C compute type
    vname: dict[int, str] = {}
    vtype: dict[int, str] = {}
    vdtype: dict[int, Optional[torch.dtype]] = {}  # None: a float argument
    k = j = 0  # tensors and float arguments may interleave: each kind is numbered in its own order
    for v in group.inputs:
        if v.is_tensor:
            d = inputs[k]
            vname[v.id], vtype[v.id], vdtype[v.id] = f"x{k}", value_type(d.dtype, target), d.dtype
            k += 1
        else:
            vname[v.id], vtype[v.id], vdtype[v.id] = f"s{j}", "double", None
            j += 1

    body: list[str] = []
    n_random = 0
    # values that hold exactly a number of their float16/bfloat16 dtype: the inputs, and each result of an op of
    # its own (eager stores it, rounded, before the next op reads it); a step of a decomposed op stays unrounded
    exact: set[int] = {v.id for v in group.inputs}
    vector = CpuVector(inputs, target, options)
    for j, (node, nt) in enumerate(zip(nodes, node_types)):
        op = ops.of(node.op)
        if op is None:
            raise NotFusable(f"no op-table entry for {node.op}")
        if op.concat:  # nothing to compute: its pieces are stored into its slices
            continue
        variant = node.args[op.variant_arg] if op.variant_arg is not None else None
        if op.random:
            if nt.result != torch.float64 and nt.result not in rng.BITS:
                raise NotFusable(f"{op.name} of {nt.result}")
            if n_random >= rng.MAX_RANDOM_OPS:
                raise NotFusable(f"more than {rng.MAX_RANDOM_OPS} random ops in one group")
            options_given = [k for k, v in enumerate(node.args) if k >= 2 and v is not None]
            if options_given:  # layout, device, pin_memory, memory_format: eager's job
                raise NotFusable(f"{op.name} with tensor options {options_given}")
            consts = {"r": str(n_random), "bits": str(rng.BITS.get(nt.result, 53)), "T": compute_type(nt.compute)}
            n_random += 1
            out = node.out
            rtype = compute_type(nt.result)
            vname[out.id], vtype[out.id], vdtype[out.id] = f"v{j}", rtype, nt.result
            expr = op.template(variant, family(nt.compute), target).substitute(consts)
            body.append(f"const {rtype} v{j} = ({rtype})({expr});")
            vector.add(node, op, variant, nt, consts, vname, vdtype, f"v{j}")
            exact.add(out.id)  # rng.BITS: a multiple of 2^-bits below 1, which its dtype holds
            continue
        line, variant, consts, round_to = node_statement(group, node, op, nt, j, target, options, vname, vtype,
                                                         vdtype, exact)
        body.append(line)
        vector.add(node, op, variant, nt, consts, vname, vdtype, f"v{j}", round_to)

    # kernel outputs: a cat's result is written as its pieces, each converted to the cat's dtype the way eager
    # converts it: stored in its own dtype first (a float16 piece of a float32 cat holds float16 values)
    outputs, out_dtypes = [], []
    position = {n.out.id: k for k, n in enumerate(nodes)}
    for o in group.outputs:
        result = node_types[position[o.id]].result
        pieces = group.cat_pieces(o)
        if pieces is None:
            outputs.append(vname[o.id])
            out_dtypes.append(result)
            continue
        for p in pieces:
            v, dt = vname[p.id], vdtype[p.id]
            if dt != result:
                v = f"fz_ld(fz_st<{storage_type(dt)}>(({compute_type(dt)}){v}))"
            outputs.append(v)
            out_dtypes.append(result)
    out_layouts = tuple(out_layouts) or (DENSE,) * len(outputs)
    if len(out_layouts) != len(outputs):
        raise ValueError(f"{len(outputs)} kernel outputs but {len(out_layouts)} output layouts")
    if target == "cpu":
        return CpuGen(name, inputs, n_scalars, outputs, out_dtypes, vname, body, options, n_random > 0,
                       out_layouts, vector=vector.finish(group, out_dtypes, vname, vdtype)).source()
    return CudaGen(name, inputs, n_scalars, outputs, out_dtypes, vname, body, options, n_random > 0,
                    out_layouts).source()


# t + c, t - c, c - t (args: t, c, alpha) for a constant c, by op: whether alpha scales t rather than c
_OFFSETS = {"aten::add.Scalar": False, "aten::sub.Scalar": False, "aten::add.Tensor": False,
            "aten::sub.Tensor": False, "aten::rsub.Scalar": True, "aten::rsub.Tensor": True}


def offset_uses_only(group: ir.Group, v: ir.Value) -> bool:
    """Whether ``v`` is read only by additions or subtractions of a constant of magnitude 1/2 or more (times an
    alpha of magnitude at most 1 where alpha scales ``v``), and is no output of the group: then an error of ``v``
    that is small in absolute terms stays small relative to each sum (``ops.OpDef.fast_offset``). Also taken: a
    ``type_as`` whose ``other`` it is (that gives only a dtype: no read of the value), and its square ``v * v``
    read only so (tanh's derivative, 1 - t * t: an absolute error e of t below 1/16 gives t * t one of at most
    e / 8). Not followed: ``type_as(v, other)``, whose dtype is not known here: to bool it tests v != 0, which the
    absolute form's 0 for a tiny nonzero v would flip."""
    if any(o.id == v.id for o in group.outputs):
        return False
    readers = [n for n in group.nodes if any(a.id == v.id for a in n.values)]
    if not readers:
        return False
    for n in readers:
        first = n.args[0] if n.args else None
        reads_first = isinstance(first, ir.Value) and first.id == v.id
        if n.op == "aten::type_as" and not reads_first:
            continue
        if n.op == "aten::mul.Tensor" and all(isinstance(a, ir.Value) and a.id == v.id for a in n.args[:2]):
            if not offset_uses_only(group, n.out):
                return False
            continue
        alpha_scales_t = _OFFSETS.get(n.op)
        if alpha_scales_t is None or len(n.args) < 3:
            return False
        t, c, alpha = n.args[:3]
        if not isinstance(t, ir.Value) or t.id != v.id:
            return False
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (c, alpha)):
            return False
        if alpha_scales_t:
            if abs(c) < 0.5 or abs(alpha) > 1:
                return False
        elif abs(c * alpha) < 0.5:
            return False
    return True


def node_statement(group: ir.Group, node: ir.Node, op: ops.OpDef, nt: NodeTypes, j: int, target: str,
                   options: KernelOptions, vname: dict, vtype: dict, vdtype: dict,
                   exact: set) -> tuple[str, object, dict, Optional[str]]:
    """The C statement of a pointwise node (not random, not cat) that defines ``v{j}``: (statement, the op's
    variant, the template's substitutions, the storage type its result is rounded to or None). Reads the C
    names, types and dtypes of its operands from ``vname``/``vtype``/``vdtype`` and adds its own result's there;
    ``exact``: the values that hold a number of their dtype exactly (see :func:`generate`), which it extends."""
    ctype = value_type(nt.compute, target)
    consts = {}
    variant = None
    if op.variant_arg is not None:
        variant = node.args[op.variant_arg]
    tmpl = op.template(variant, family(nt.compute), target)
    if target == "cuda" and options.fast_reduced and nt.result in REDUCED and family(nt.compute) == "f":
        if op.fast_offset and offset_uses_only(group, node.out):
            tmpl = string.Template(op.fast_offset)
        else:
            tmpl = op.fast_template(variant) or tmpl
    if tmpl is None:
        raise NotFusable(f"{op.name} has no {family(nt.compute)!r} expression ({nt.compute}, variant "
                         f"{variant!r})")
    rounding = target in op.round_operands and nt.compute in REDUCED  # scalars, on this target
    round_values = op.discrete and nt.compute in REDUCED  # computed operands, on every target
    if op.cast and any(a not in (None, False) for a in node.args[2:]):
        raise NotFusable(f"{node.op} with tensor options other than dtype")
    for i, v in enumerate(node.args):
        if i == op.variant_arg or (op.cast and i > 0):
            continue
        arg = ops.ARG_NAMES[i]
        if not isinstance(v, ir.Value):
            val = v
            if isinstance(val, ir.TensorConst):  # a 0-dim constant (traced Python scalar)
                if val.shape != ():
                    raise NotFusable(f"{op.name}: a constant tensor of shape {val.shape}")
                val = val.values[0]
            consts["has_" + arg] = "false" if val is None else "true"
            if val is None:
                bound = op.none_as.get(i)
                if bound is None:
                    raise NotFusable(f"{op.name}: argument {i} is None")
                consts[arg] = f"FZ_{bound.upper()}({ctype})"
            else:
                if rounding and not isinstance(val, bool):
                    val = torch.tensor(val, dtype=torch.float64).to(nt.compute).item()
                # converted to the compute dtype as eager converts a Scalar (uint8(-7) is 249), then held
                consts[arg] = _as_held(literal(val, compute_type(nt.compute)), ctype)
                # negated in the Scalar's own type, as eager's -alpha: an int 0 stays +0
                consts["n" + arg] = _as_held(literal(val if isinstance(val, bool) else -val,
                                                     compute_type(nt.compute)), ctype)
            consts["scalar_" + arg] = "true"  # a Python scalar in eager (a CPU scalar to its CUDA kernels)
        else:
            consts["has_" + arg] = "true"
            consts["scalar_" + arg] = "true" if vdtype[v.id] is None else "false"
            name_, t = vname[v.id], vtype[v.id]
            # round anything not loaded straight from memory in this dtype: eager compares stored values
            dt = vdtype[v.id]
            if dt is None:  # a float argument: rounded where eager rounds scalars
                round_it = rounding
            else:  # a tensor value not loaded straight from memory in this dtype
                round_it = (round_values or rounding) and (dt != nt.compute or v.id not in exact)
                # a tensor of another dtype (an int32 exponent of a bfloat16 pow): eager casts it to the
                # float16/bfloat16 compute dtype first (259 is 260 in bfloat16, and (-2)^260 is inf where (-2)^259
                # is -inf: the CUDA fuzzer). Not for the ops whose eager kernels read a 0-dim operand in its own
                # dtype (``ops.OpDef.scalars_as_given``; which operands are 0-dim is not known here), not inside a decomposed eager op (its one kernel
                # reads its steps' operands as they are), not for casts or kept arguments
                round_it = round_it or (nt.compute in REDUCED and dt != nt.compute and dt != torch.bool
                                        and not op.scalars_as_given and not op.cast
                                        and i not in op.keep_args and not node.origin)
            if round_it:
                consts[arg] = f"fz_ld(fz_st<{storage_type(nt.compute)}>(({ctype}){name_}))"
            elif t == ctype and dt == nt.compute or i in op.keep_args:
                consts[arg] = name_
            else:
                consts[arg] = _converted(nt.compute, target, name_)
            consts["n" + arg] = f"(-{consts[arg]})"
    consts["T"] = ctype
    out = node.out
    rtype = value_type(nt.result, target)
    vname[out.id], vtype[out.id], vdtype[out.id] = f"v{j}", rtype, nt.result
    expr = _converted(nt.result, target, tmpl.substitute(consts))
    round_result = options.round_reduced and nt.result in REDUCED and not node.origin
    if round_result:  # eager's result, stored in its dtype
        expr = f"fz_ld(fz_st<{storage_type(nt.result)}>({expr}))"
        exact.add(out.id)
    return f"const {rtype} v{j} = {expr};", variant, consts, storage_type(nt.result) if round_result else None
