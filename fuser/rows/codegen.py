"""The row kernel's source: a pure function from (group, input dtypes, node types, target) to C++ or CUDA.

Per row, one pass along the row per reduction, in the group's order: the element-level nodes that reduction's
input needs are computed again from the inputs in memory (correct for any row length; keeping the row in
registers is a later optimization), accumulated per thread, and on CUDA combined across the block. Then the
row-level nodes whose operands are ready. A last pass computes and stores the element-level outputs; the
row-level outputs are stored once per row. Each node's statement is the pointwise codegen's
(``codegen.body.node_statement``), so an op means the same in both kinds of kernel.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import ir, ops
from ..codegen import REDUCED, KernelOptions, NodeTypes, NotFusable, value_type
from ..codegen.body import node_statement
from ..cpu import templates as cpu_t
from ..cuda import templates as cuda_t
from ..codegen.cpu_vector import CpuVector
from ..codegen import CPU_VECTORS_PER_TRIP as COPIES
from ..descs import DENSE, TensorDesc, compute_type, storage_type
from . import templates as t
from .plan import row_level

CPU_PARALLEL_WORK = 32768  # elements of work from which a CPU row kernel splits its rows across threads


def accumulator_type(red: ops.Reduction, nt: NodeTypes, target: str) -> str:
    """The C type a reduction accumulates in (see ``ops.Reduction.wide``)."""
    if not red.wide:
        return compute_type(nt.compute)
    return "double" if target == "cpu" or nt.compute == torch.float64 else "float"


def generate(group: ir.Group, inputs: Sequence[torch.dtype], node_types: Sequence[NodeTypes], target: str,
             name: str, n_scalar_slots: int, vectorize: bool = False, round_reduced: bool = False) -> str:
    """Source of the row kernel ``name``; ``inputs``: the tensor inputs' dtypes. Raises NotFusable where an op
    has no expression for its types (the executor falls back). ``vectorize``: the CPU kernel's passes get
    at::vec loops (see :class:`_Vector`) where every node has a vector form. ``round_reduced``: as
    ``KernelOptions.round_reduced`` for the pointwise nodes (a reduction's float16/bfloat16 result is rounded
    always: once per row, it costs nothing)."""
    rows_v = row_level(group)
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

    statement: dict[int, str] = {}  # per non-reduction node's value: its C statement
    vector_args: dict[int, tuple] = {}  # per non-reduction node's value: what CpuVector.add takes
    # the values holding a number of their float16/bfloat16 dtype exactly (see codegen.body.generate)
    exact: set = {v.id for v in group.inputs}
    reductions = []  # (node, position, reduction, node types)
    options = KernelOptions(index32=False, vectorize=False, round_reduced=round_reduced)
    for pos, (n, nt) in enumerate(zip(group.nodes, node_types)):
        red = ops.reduction(n.op)
        if red is not None:
            vname[n.out.id], vtype[n.out.id], vdtype[n.out.id] = f"v{pos}", value_type(nt.result, target), nt.result
            if nt.result in REDUCED and not n.origin:  # rounded to its dtype below, as eager stores it
                exact.add(n.out.id)
            reductions.append((n, pos, red, nt))
            continue
        op = ops.of(n.op)
        if op is None or op.random or op.concat:
            raise NotFusable(f"{n.op} in a row kernel")
        statement[n.out.id], variant, consts, round_to = node_statement(group, n, op, nt, pos, target, options,
                                                                        vname, vtype, vdtype, exact)
        vector_args[n.out.id] = (n, op, variant, nt, consts, pos, round_to)

    producer = {n.out.id: n for n in group.nodes}
    order = {n.out.id: pos for pos, n in enumerate(group.nodes)}

    def needed(wanted: Sequence[ir.Value]) -> set:
        """The element-level values (inputs and nodes) that computing ``wanted`` reads, ``wanted`` included."""
        need, stack = set(), [v for v in wanted]
        while stack:
            v = stack.pop()
            if v.id in need or v.id in rows_v:
                continue
            need.add(v.id)
            if v.id in producer:
                stack.extend(producer[v.id].values)
        return need

    vector = _Vector(group, inputs, rows_v, vname, vdtype, vector_args, tensor_index, order) if (
        target == "cpu" and vectorize) else None

    def element_lines(wanted: Sequence[ir.Value]) -> list[str]:
        """Loads and statements of the element-level values ``wanted`` needs, in the group's order."""
        need = needed(wanted)
        lines = []
        for v in group.inputs:
            if v.id in need and v.is_tensor:
                kk = tensor_index[v.id]
                lines.append(f"const {vtype[v.id]} x{kk} = fz_ld(t{kk}[off{kk} + c * cs{kk}]);")
        lines += [statement[i] for i in sorted(need - set(tensor_index) - {v.id for v in group.inputs},
                                                key=order.__getitem__)]
        return lines

    indent = "      "
    phases: list[str] = []
    ready = {v.id for v in group.inputs if not v.is_tensor}
    shared = set()
    cuda = target == "cuda"
    for n, pos, red, nt in reductions:
        u = n.args[0]
        acc_t = accumulator_type(red, nt, target)
        x = vname[u.id]
        if vdtype[u.id] != nt.compute:  # eager converts the input to the reduction's dtype first
            x = (f"fz_ld(fz_st<{storage_type(nt.compute)}>(({compute_type(vdtype[u.id])}){x}))"
                 if nt.compute in REDUCED else f"({compute_type(nt.compute)})({x})")
        ident = red.identity.replace("$A", acc_t)
        body = element_lines([u]) + [f"acc{pos} = {red.combine}::f(acc{pos}, ({acc_t})({x}));"]
        after = []
        if red.variance:  # a first pass for the row's mean; this pass sums the squared deviations from it
            body = element_lines([u]) + [f"{{ const {acc_t} dv = ({acc_t})({x}) - mean{pos}; acc{pos} += dv * dv; }}"]
            mean_after = [f"const {acc_t} mean{pos} = accm{pos} / ({acc_t})cols;"]
            if cuda:
                mean_after.insert(0, f"accm{pos} = fz_block_reduce<fz_rsum>(accm{pos}, fz_sh_{acc_t});")
            phases.append(t.PHASE.substitute(
                acc_decl=f"{acc_t} accm{pos} = {ident};", first="threadIdx.x" if cuda else f"c0_{pos}m",
                step="blockDim.x" if cuda else "1",
                body="\n".join(indent + ln for ln in element_lines([u]) + [f"accm{pos} += ({acc_t})({x});"]),
                after="\n".join("    " + ln for ln in mean_after)))
            if not cuda:
                phases[-1] = f"    const int64_t c0_{pos}m = 0;\n" + phases[-1]
            if vector is not None:
                vector.on = False  # no vector form of the two passes (yet): scalar loops
        elif vector is not None:
            vector.reduction(u, red, pos, acc_t, vdtype[u.id] == nt.compute, needed([u]))
        if cuda:
            shared.add(acc_t)
            after.append(f"acc{pos} = fz_block_reduce<{red.combine}>(acc{pos}, fz_sh_{acc_t});")
        result = f"acc{pos} / ({acc_t})cols" if red.mean else f"acc{pos}"
        if red.variance:  # eager's divisor max(0, n - correction): n <= correction gives inf or NaN as eager's
            c = ops.correction(n.op, n.args)
            result = f"acc{pos} / ({acc_t})((double)cols - {c!r} > 0 ? (double)cols - {c!r} : 0.0)"
        rtype = value_type(nt.result, target)
        if nt.result in REDUCED and not n.origin:  # an eager op of its own: its result is stored in its dtype
            result = f"fz_ld(fz_st<{storage_type(nt.result)}>((float)({result})))"
        after.append(f"const {rtype} v{pos} = ({rtype})({result});")
        ready.add(n.out.id)
        for m in group.nodes:  # row-level nodes whose operands are ready now
            if m.out.id in rows_v and m.out.id not in ready and ops.reduction(m.op) is None and all(
                    v.id in ready for v in m.values):
                after.append(statement[m.out.id])
                ready.add(m.out.id)
        vectorized = vector is not None and vector.on
        phases.append(t.PHASE.substitute(
            acc_decl="" if vectorized else f"{acc_t} acc{pos} = {ident};",
            first="threadIdx.x" if cuda else f"c0_{pos}", step="blockDim.x" if cuda else "1",
            body="\n".join(indent + ln for ln in body), after="\n".join("    " + ln for ln in after)))
        if not cuda:
            phases[-1] = (vector.parts[-1] if vectorized else f"    const int64_t c0_{pos} = 0;") + "\n" + phases[-1]

    position = {n.out.id: pos for pos, n in enumerate(group.nodes)}
    elem_out = [(m, o) for m, o in enumerate(group.outputs) if o.id not in rows_v]
    row_out = [(m, o) for m, o in enumerate(group.outputs) if o.id in rows_v]

    def store(m: int, o: ir.Value, at: str) -> str:
        dt = node_types[position[o.id]].result
        return f"o{m}[{at}] = fz_st<{storage_type(dt)}>({vname[o.id]});"

    if elem_out:
        body = element_lines([o for _, o in elem_out]) + [store(m, o, "row * cols + c") for m, o in elem_out]
        phases.append(t.PHASE.substitute(acc_decl="", first="threadIdx.x" if cuda else "c0_out",
                                          step="blockDim.x" if cuda else "1",
                                          body="\n".join(indent + ln for ln in body), after=""))
        if not cuda:
            if vector is not None:
                vector.stores([(m, o, node_types[position[o.id]].result) for m, o in elem_out],
                              needed([o for _, o in elem_out]))
            phases[-1] = (vector.parts[-1] if vector is not None and vector.on else
                          "    const int64_t c0_out = 0;") + "\n" + phases[-1]
    if row_out:
        stores = [store(m, o, "row") for m, o in row_out]
        if cuda:
            phases.append("    if (threadIdx.x == 0) {\n" + "\n".join("      " + s for s in stores) + "\n    }")
        else:
            phases += ["    " + s for s in stores]

    out_dtypes = [node_types[position[o.id]].result for o in group.outputs]
    params = [f"const {storage_type(dt)}* __restrict__ t{kk} = (const {storage_type(dt)}*)PTRS[{kk}];"
              for kk, dt in enumerate(inputs)]
    params += [f"{storage_type(dt)}* __restrict__ o{m} = ({storage_type(dt)}*)PTRS[{len(inputs) + m}];"
               for m, dt in enumerate(out_dtypes)]
    params += [f"const double s{jj} = SCALARS[{jj}];" for jj in range(j)]
    ptrs, scalars = ("args.ptrs", "args.scalars") if cuda else ("ptrs", "scalars")
    params = ["  " + p.replace("PTRS", ptrs).replace("SCALARS", scalars) for p in params]
    n_in = len(inputs)
    if cuda:
        size, stride = "args.sizes[d]", lambda kk, d: f"args.strides[{kk}][{d}]"
    else:
        size, stride = "sizes[d]", lambda kk, d: f"strides[{kk} * (rank + 1) + {d}]"
    offsets = t.OFFSETS.substitute(
        decls=", ".join(f"off{kk} = 0" for kk in range(n_in)) if n_in else "fz_unused = 0", size=size,
        accumulate="\n".join(f"        off{kk} += m * {stride(kk, 'd')};" for kk in range(n_in)),
        col_strides="\n".join(f"    const long long cs{kk} = {stride(kk, t.MAX_DIMS if cuda else 'rank')};"
                               for kk in range(n_in)))
    if cuda:
        return t.CUDA_KERNEL.substitute(
            name=name, prelude=cuda_t.PRELUDE, row_prelude=t.ROW_PRELUDE.substitute(
                fn="__device__ __forceinline__", block_reduce=t.BLOCK_REDUCE),
            max_dims=t.MAX_DIMS, n_stride_rows=max(1, n_in), n_ptrs=n_in + len(out_dtypes),
            n_scalar_slots=max(1, n_scalar_slots), block_size=t.BLOCK_SIZE, params="\n".join(params),
            shared="\n".join(f"  __shared__ {a} fz_sh_{a}[{t.BLOCK_SIZE}];" for a in sorted(shared)),
            offsets=offsets, phases="\n".join(phases))
    if vector is not None and not vector.on:  # some pass has no vector form: scalar loops throughout
        return generate(group, inputs, node_types, target, name, n_scalar_slots, vectorize=False,
                        round_reduced=round_reduced)
    work = 1 + len(statement) + len(reductions)
    vectorized = vector is not None
    if vectorized:
        offsets += "\n    const bool vec_ok = " + " && ".join(
            [f"(cs{kk} == 0 || cs{kk} == 1)" for kk in range(n_in)] + ["true"]) + ";"
    return t.CPU_KERNEL.substitute(
        name=name, prelude=cpu_t.VECTOR_INCLUDE if vectorized else cpu_t.PRELUDE,
        row_prelude=t.ROW_PRELUDE.substitute(fn="inline", block_reduce=""),
        vector_types=t.CPU_VECTOR_TYPES.substitute(vtype=vector.vtype) if vectorized else "",
        params="\n".join(params), parallel_threshold=max(1, CPU_PARALLEL_WORK // work), offsets=offsets,
        phases="\n".join(phases))


class _Vector:
    """The CPU kernel's vector loops: each pass along the row runs ``CPU_VECTORS_PER_TRIP`` vectors a trip over
    at::vec (the pointwise kernels' ``CpuVector`` lines: the same op forms), then the scalar loop takes the tail
    from where they stopped. Row-level values enter as broadcasts. A row whose inputs step by 0 or 1 along it
    takes them (``vec_ok``, per row: strides are launch arguments); otherwise the scalar loop runs alone. Off for
    the kernel (``on`` False) when a node has no vector form, the inputs mix compute types or hold bools, a
    reduction converts its input, or an output's type is not the vectors'."""

    def __init__(self, group, inputs, rows_v, vname, vdtype, vector_args, tensor_index, order):
        self.group, self.inputs, self.vname, self.vector_args = group, inputs, vname, vector_args
        self.tensor_index, self.order = tensor_index, order
        self.vdtype = {**vdtype, **{i: None for i in rows_v}}  # row-level values: broadcasts (as float arguments)
        self.on = not any(dt == torch.bool for dt in inputs)
        self.descs = [TensorDesc(dt, DENSE, False) for dt in inputs]
        self.vtype = None
        self.parts: list[str] = []

    def _lines(self, need: set):
        """(loads, op lines) for ``copies`` vectors, or None (no vector form)."""
        cv = CpuVector(self.descs, "cpu", KernelOptions())
        for i in sorted(need - set(self.tensor_index) - {v.id for v in self.group.inputs}, key=self.order.__getitem__):
            n, op, variant, nt, consts, pos, round_to = self.vector_args[i]
            cv.add(n, op, variant, nt, consts, self.vname, self.vdtype, f"v{pos}", round_to)
        if not cv.on or cv.vtype is None:
            self.on = False
            return None
        if self.vtype is None:
            self.vtype, self.ctype = cv.vtype, cv.ctype
        elif cv.vtype != self.vtype:
            self.on = False
            return None
        loads = [f"const fz_v x{k}_{c} = cs{k} ? fz_vload(t{k} + off{k} + c + {c} * W) : fz_v(fz_ld(t{k}[off{k}]));"
                 for i, k in self.tensor_index.items() if i in need for c in range(COPIES)]
        return cv, loads + cv.lines(COPIES)

    def reduction(self, u, red, pos: int, acc_t: str, same_type: bool, need: set) -> None:
        got = self._lines(need) if self.on and same_type else None
        if got is None:
            self.on = False
            return
        cv, lines = got
        value = self.vname[u.id]
        if u.id not in self.tensor_index and compute_type(self.vdtype[u.id]) != self.ctype:
            self.on = False
            return
        self.parts.append(t.CPU_VECTOR_PASS.substitute(
            pos=pos, ident=red.identity.replace("$A", acc_t),
            decls="\n".join(f"      fz_v vacc{pos}_{c} = fz_v({red.identity.replace('$A', self.ctype)});"
                            for c in range(COPIES)),
            copies=COPIES, lines="\n".join("          " + ln for ln in lines),
            accumulate="\n".join(f"          vacc{pos}_{c} = {red.combine}::f(vacc{pos}_{c}, {value}_{c});"
                                  for c in range(COPIES)),
            combine="\n".join(f"      vacc{pos}_0 = {red.combine}::f(vacc{pos}_0, vacc{pos}_{c});"
                               for c in range(1, COPIES)),
            ctype=self.ctype, acc_t=acc_t, combine_fn=red.combine))

    def stores(self, outs, need: set) -> None:
        got = self._lines(need) if self.on else None
        if got is None or any(compute_type(dt) != self.ctype or self.vdtype[o.id] != dt for _, o, dt in outs):
            self.on = False
            return
        cv, lines = got
        if any(self.vname[o.id] in cv.masks for _, o, _ in outs):
            self.on = False
            return
        lines += [f"fz_vstore(o{m} + row * cols + c + {c} * W, {self.vname[o.id]}_{c});"
                  for m, o, _ in outs for c in range(COPIES)]
        self.parts.append(t.CPU_VECTOR_STORES.substitute(copies=COPIES,
                                                         lines="\n".join("        " + ln for ln in lines)))
