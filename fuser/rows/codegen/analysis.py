"""What a row or column kernel decides about its values before it writes a line: the C type each reduction
accumulates in, which float16/bfloat16 values it rounds as eager stores them, which means it centers and which
variances it roots in double, and the names of the group's inputs in the source."""
from __future__ import annotations

from typing import Sequence

import torch

from ... import ir, ops
from ...codegen import REDUCED, NodeTypes, value_type
from ...descs import compute_type


def accumulator_type(red: ops.Reduction, nt: NodeTypes, target: str) -> str:
    """The C type a reduction accumulates in (row and column kernels): ``ops.Reduction.wide`` ones in float on CUDA
    (double for float64) and in double on the CPU; max and min in the compute type (they are exact)."""
    if not red.wide:
        return compute_type(nt.compute)
    return "double" if target == "cpu" or nt.compute == torch.float64 else "float"


def stores_rounded(n: ir.Node, red, nt: NodeTypes, exact: set) -> bool:
    """Whether a reduction's float16/bfloat16 result is rounded to its dtype in the kernel, as eager stores it: an
    eager op of its own (not a step of a decomposed one, ``n.origin``). A max or min of values held unrounded in
    float (``exact`` lacks its operand) is one of them, and stays in float as they do: rounded, a finite float
    value past the dtype's range (65504 for float16) would give an inf max beside the finite element it came
    from, whose difference is -inf where eager (inf - inf) gives NaN and the float64 truth 0."""
    if nt.result not in REDUCED or n.origin:
        return False
    return red.wide or n.args[0].id in exact


def rounded_operands(group: ir.Group) -> frozenset:
    """The value ids a row kernel rounds to their float16/bfloat16 dtype where it computes them, as eager
    stores them: the operands of reductions that are eager ops of their own (not steps of a decomposed one,
    ``n.origin``). Eager sums the stored, rounded values; holding the operand unrounded in float, the kernel summed
    other values, and its element-level uses differed from the rounded result beside them (``stores_rounded``): the
    CUDA fuzzer's ``x / y - sum(x / y, -1, keepdim=True)`` over a one-element float16 row gave 1.98, the rounding
    error of ``x / y``, where eager and the float64 truth give 0. Rounded where it is computed, every use sees
    eager's value. ``node_statement`` rounds it (``KernelOptions.round_reduced``), so a float32 value, a group
    input and a composite's step (softmax's, layer_norm's: eager's one kernel holds them in float) stay as they
    are. Only the ``wide`` reductions' (sum, mean, var): a max or min is one of its unrounded operands and stays in
    float with them (``stores_rounded``), so ``x - amax(x)`` keeps the float64 truth past float16's range, where
    eager's rounded values give inf - inf = NaN (tests/test_reductions.py). Not in column kernels
    (``outer_codegen``): they take such a use of their own sum only over columns of one row, and rounding each element
    cost ``(x * y).sum(0)`` in bfloat16 a third of its speed (H200, [16384 x 4096], 64 -> 86 us)."""
    return frozenset(n.args[0].id for n in group.nodes if getattr(ops.reduction(n.op), "wide", False)
                     and not n.origin and n.args and isinstance(n.args[0], ir.Value))


def centered_means(group: ir.Group) -> frozenset:
    """The value ids of means that the group subtracts from their own input (``x - mean(x)``: layer_norm's
    steps). Their kernels make the mean of a row of equal values exact, as eager's Welford mean is: each CUDA
    thread sums its differences from the first value it sees, then adds that value times its count in double (exact
    but in float64: see the README's limitations); the CPU kernel takes the row's first value plus the mean of the
    differences from it, which its vector lanes (each shifted by its own first value) and scalar loops sum in
    double. A float sum of n equal values rounds: a 71,305-element row of -1234.567 gave a mean off by about 3e-4,
    which the rstd of the zero variance (316 for eps 1e-5) magnified into outputs of up to 0.96, where eager's are
    0. (On an H200 this cost a 65,536-element float32 row 0.56 -> 0.48 of the copy floor, as a sum in double per
    element did.) A backward's means (``Node.origin`` "autograd": layer_norm's mean(dy * w), subtracted from dy * w)
    are plain sums, as eager's backward kernels form them: they divide no variance, and its shifted sum in double
    cost each element four more instructions."""
    means = {n.out.id: n.args[0].id for n in group.nodes if getattr(ops.reduction(n.op), "mean", False)
             and n.origin != ir.AUTOGRAD}
    return frozenset(m.args[1].id for m in group.nodes if m.op.split(".")[0] == "aten::sub"
                     and all(isinstance(a, ir.Value) for a in m.args[:2]) and means.get(m.args[1].id) == m.args[0].id)


def rooted_variances(group: ir.Group) -> dict:
    """Per variance value id that a step of ``aten::std`` takes the square root of: that sqrt node. The CPU row
    kernel holds such a variance in double and takes its root there, as eager's CPU kernel does (its Welford
    accumulates in double and roots before the result is stored): a float32 variance past float's range has a
    finite root (std of [7.1e19, 0] is 5.0e19 in eager; the CPU fuzzer found inf). CUDA eager holds it in
    float, as the CUDA kernel does."""
    var = {n.out.id for n in group.nodes if getattr(ops.reduction(n.op), "variance", False)}
    return {n.args[0].id: n for n in group.nodes if n.origin == "aten::std" and n.op == "aten::sqrt"
            and isinstance(n.args[0], ir.Value) and n.args[0].id in var}


def input_names(group: ir.Group, inputs: Sequence[torch.dtype], target: str) -> tuple[dict, dict, dict, dict, int]:
    """The group inputs' names in a row or column kernel's source: (per value id its name, its C type, its dtype
    (None for a float), per tensor input's value id its index among the tensor inputs, the number of float
    inputs). The k-th tensor input is ``x<k>`` (of ``inputs[k]``), the j-th float input ``s<j>`` (a double)."""
    vname: dict[int, str] = {}
    vtype: dict[int, str] = {}
    vdtype: dict = {}
    tensor_index: dict[int, int] = {}
    k = j = 0
    for v in group.inputs:
        if v.is_tensor:
            vname[v.id], vtype[v.id], vdtype[v.id] = f"x{k}", value_type(inputs[k], target), inputs[k]
            tensor_index[v.id] = k
            k += 1
        else:
            vname[v.id], vtype[v.id], vdtype[v.id] = f"s{j}", "double", None
            j += 1
    return vname, vtype, vdtype, tensor_index, j
