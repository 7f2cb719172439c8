"""The row kernel's source: a pure function from (group, input dtypes, node types, target) to C++ or CUDA.

Per row, one pass along the row per reduction, in the group's order: the element-level nodes that reduction's
input needs are computed again from the inputs (compute is cheap, bytes are not), accumulated per thread, and on
CUDA combined across the row's threads. Then the row-level nodes whose operands are ready. A last pass computes and
stores the element-level outputs; the row-level outputs are stored once per row. On CUDA a row that fits a
thread's registers (``shape.CudaShape.held``) is read once: the inputs that several passes read are loaded into
registers first, and the passes read those; a row held by the CTAs of a cluster (``shape.CudaShape.cluster``) the
same, each CTA its segment, its reductions combined across the CTAs; a longer row is read again by each pass,
its inputs that several passes read copied into shared memory at the row's start where they fit
(``shape.CudaShape.staged``).
Each node's statement is the pointwise codegen's (``codegen.body.node_statement``), so an op means the same in
both kinds of kernel.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from ... import ir, ops
from ...codegen import REDUCED, KernelOptions, NodeTypes, NotFusable, value_type
from ...codegen.body import node_statement
from ...cpu import templates as cpu_t
from ...cuda import templates as cuda_t
from ...descs import compute_type, storage_type
from .. import templates as t
from ..passes import held_values, kept_values, needed as _needed, reduction_passes, row_level, row_passes
from ..shape import CudaShape
from .analysis import (accumulator_type, centered_means, input_names, rooted_variances, rounded_operands,
                       stores_rounded)
from .cpu_vector import _Vector
from .sum_slots import block_parts, trip_slot, trip_slot_chunk

CPU_PARALLEL_WORK = 32768  # elements of work from which a CPU row kernel splits its rows across threads
_SUM = ops.reduction("aten::sum.dim_IntList")  # (a column sum accumulates as a sum does)
CPU_MAX_PARTS = 64  # a CPU row kernel's parts of the rows at most, each with its partial row of column sums
CPU_PART_ROWS = 16  # rows a part at least (its partial row is zeroed, then read by the second stage: parts x cols)...
# ...except that rows of CPU_PART_WORK elements or more make up to CPU_MIN_PARTS parts of fewer rows, so that a few
# long rows still split across threads (one part a row made the partial rows as large as the gradient: [64 x 65536]
# bfloat16, two threads, 17.6-18.3 ms a backward against torch.compile's 2.6-3.3, most of it in page faults)
CPU_PART_WORK = 2 ** 16
CPU_MIN_PARTS = 4
# ops whose results a CPU row kernel keeps in a scratch row for later passes rather than computing them again
# (passes.kept_values): a SLEEF call or more per element
CPU_KEPT_OPS = frozenset({"exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh", "sigmoid", "erf", "erfc",
                          "erfinv", "gelu", "silu", "mish", "softplus", "elu", "sin", "cos", "tan", "asin", "acos",
                          "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "pow", "atan2", "lgamma", "digamma"})


def _paired(merged: list, shape) -> bool:
    """Rewrites, in place, the reduce lines of a CUDA pass's sibling reductions (``merged``) two at a time where they
    combine alike in the same accumulator type: one ``fz_row_reduce2`` (templates.ROW_REDUCE) for both, the
    first's line, and the second's dropped, so the pair crosses the block's barriers once. Each value's sum is formed
    in the same order as alone. Whether any pair was made."""
    open_: dict = {}  # (combine, accumulator type) -> the merged index waiting for a partner
    made = False
    for i, m in enumerate(merged):
        if m[4] is None:
            continue
        combine, acc_t, pos, at = m[4]
        j = open_.pop((combine, acc_t), None)
        if j is None:
            open_[(combine, acc_t)] = i
            continue
        _, _, pos0, at0 = merged[j][4]
        merged[j][3][at0] = (f"fz_row_reduce2<{combine}, {shape.tpr}, {shape.block // 32}>(acc{pos0}, acc{pos}, "
                             f"fz_sh_{acc_t});")
        del m[3][at]
        made = True
    return made


def _finite(expr: str) -> str:
    """C: whether the double ``expr`` is finite (a shifted sum is used where it is; the plain one where an inf or a
    NaN in the row made it inf or NaN)."""
    return f"fabs({expr}) <= 1.7976931348623157e308"


def _compensated(acc: str, comp: str, value: str) -> str:
    """C: ``acc += value`` in float with Kahan's compensation: ``comp`` carries the rounding error each addition
    made, and the next subtracts it first (``acc - comp`` is the better sum at the end). 0 while the sum is not
    finite, so an inf in the row still gives inf (inf - inf would make the compensation NaN). Its steps are adds
    and subtracts, which neither ``--fmad=true`` (``settings.cuda_contract``: it contracts a multiply into the add
    after it, at most the value's own) nor anything NVRTC does by default reassociates; a reassociated form would
    lose the error it tracks."""
    return (f"{{ const float ky = (float)({value}) - {comp}; const float kt = {acc} + ky; "
            f"{comp} = fabsf(kt) <= 3.402823466e38f ? (kt - {acc}) - ky : 0.0f; {acc} = kt; }}")


def generate(group: ir.Group, inputs: Sequence[torch.dtype], node_types: Sequence[NodeTypes], target: str,
             name: str, n_scalar_slots: int, vectorize: bool = False, round_reduced: bool = False,
             shape: CudaShape = None, sums: tuple[int, ...] = (), steps: Optional[tuple[int, ...]] = None,
             index64: bool = True, walk: bool = True) -> str:
    """Source of the row kernel ``name``; ``inputs``: the tensor inputs' dtypes. Raises NotFusable where an op
    has no expression for its types (the executor falls back). ``vectorize``: the CPU kernel's passes get
    at::vec loops (see :class:`_Vector`) where every node has a vector form. ``round_reduced``: as
    ``KernelOptions.round_reduced`` for the pointwise nodes (a reduction's float16/bfloat16 result is rounded
    always: once per row, it costs nothing; so is the operand of an eager op's reduction, per element:
    :func:`rounded_operands`). ``shape``: the CUDA kernel's (``shape.cuda_shape``). ``sums``: the
    outputs that are column sums (``passes.column_sum_form``: ``group`` is the form's, those outputs the values
    summed): on the CPU added into a partial row per part of the rows, on CUDA into each thread's registers or
    shared slots over its rows (a row of one trip), or a slot per column in shared memory (a row of several trips,
    one a block: ``CudaShape.trip_sums``), then written as its slot's or block's partial row; a second stage adds
    the partial rows.
    ``steps``: CUDA, per tensor input its step along the row (``plan.RowKey.steps``) in a kernel that takes whole
    vectors only (``fz_row_vec``; no launch's ``args.vec`` checked); None: loads and stores check it.
    ``index64``: CUDA, the walk over the row dims divides in 64 bits (``plan.RowKey.index64``), else in 32.
    ``walk``: the rows may span several dims (``plan.RowKey.walk``); else a row's offsets are row * stride."""
    rows_v = row_level(group)
    vname, vtype, vdtype, tensor_index, j = input_names(group, inputs, target)

    statement: dict[int, str] = {}  # per non-reduction node's value: its C statement
    vector_args: dict[int, tuple] = {}  # per non-reduction node's value: what CpuVector.add takes
    # the values holding a number of their float16/bfloat16 dtype exactly (see codegen.body.generate)
    exact: set = {v.id for v in group.inputs}
    reductions = []  # (node, position, reduction, node types)
    options = KernelOptions(index32=False, vectorize=False, round_reduced=round_reduced)
    operands = rounded_operands(group)  # rounded where computed, as eager stores them
    for pos, (n, nt) in enumerate(zip(group.nodes, node_types)):
        red = ops.reduction(n.op)
        if red is not None:
            vname[n.out.id], vtype[n.out.id], vdtype[n.out.id] = f"v{pos}", value_type(nt.result, target), nt.result
            if stores_rounded(n, red, nt, exact):  # rounded to its dtype below, as eager stores it
                exact.add(n.out.id)
            reductions.append((n, pos, red, nt))
            continue
        op = ops.of(n.op)
        if op is None or op.random or op.concat:
            raise NotFusable(f"{n.op} in a row kernel")
        opts = replace(options, round_reduced=True) if n.out.id in operands else options
        statement[n.out.id], variant, consts, round_to = node_statement(group, n, op, nt, pos, target, opts,
                                                                        vname, vtype, vdtype, exact)
        vector_args[n.out.id] = (n, op, variant, nt, consts, pos, round_to)

    rooted = rooted_variances(group) if target == "cpu" else {}
    for var_id, root in rooted.items():  # the variance in double, its root taken there (rooted_variances)
        vtype[var_id] = "double"
        statement[root.out.id] = (f"const {vtype[root.out.id]} {vname[root.out.id]} = "
                                  f"({vtype[root.out.id]})(sqrt({vname[var_id]}));")
    order = {n.out.id: pos for pos, n in enumerate(group.nodes)}

    vector = _Vector(group, inputs, rows_v, vname, vdtype, vector_args, tensor_index, order) if (
        target == "cpu" and vectorize) else None

    cuda = target == "cuda"
    # CUDA column sums: a row of one trip (held in registers or not: tb is 0), so a thread's columns, element
    # i * vec + v of its trip, are the same every row; or a row of several trips, one a block, a slot per column in
    # shared memory (CudaShape.trip_sums: column tb + (i * tpr + lane) * vec + v, again the thread's own)
    # CUDA, a row held in registers: per pass, the values it finds in registers (passes.held_values), in arrays
    # h_<name>[items]; the pass being generated is counted in npass
    holds = held_values(group) if cuda and shape.held else [frozenset()] * len(row_passes(group, merge=cuda))
    npass = [0]
    assert not shape or not shape.staged or steps is not None, "a staged row kernel takes whole vectors only"
    producer = {n.out.id: n for n in group.nodes}
    # CPU: per pass, the values it reads from scratch rows and those it writes there (passes.kept_values): costly
    # ones, and those that read two tensor inputs or more (x + bias + residual: one scratch row read instead of
    # several inputs' loads)
    tensor_ids = set(tensor_index)
    kept = None if cuda else kept_values(group, lambda i: i in producer and vtype.get(i) in ("float", "double") and (
        producer[i].op.split("::")[-1].split(".")[0] in CPU_KEPT_OPS
        or len(tensor_ids & _needed(group, [producer[i].out])) >= 2))

    def element_lines(wanted: Sequence[ir.Value], p: int = 0) -> list[str]:
        """Loads and statements of the element-level values ``wanted`` needs, in the group's order. CUDA: inputs
        come from the pass's loads (:func:`cuda_loads`), held values from registers, and the values later passes
        hold are put there. CPU (pass ``p``): kept values from their scratch rows, and those later passes keep
        are written there."""
        held = holds[npass[0]] if cuda else kept[p][0]
        need = _needed(group, wanted, held)
        lines = []
        for v in group.inputs:
            if v.id in need and v.is_tensor and v.id not in held:
                kk = tensor_index[v.id]
                per_item = cuda and shape.held and npass[0] > 0
                src = (f"xl{kk}[{'' if per_item else f'i * {shape.vec} + '}v]" if cuda else
                       f"fz_ld(t{kk}[off{kk} + c * cs{kk}])")
                lines.append(f"const {vtype[v.id]} x{kk} = {src};")
        lines += [f"const {vtype[i]} {vname[i]} = " + (f"h_{vname[i]}[i * {shape.vec} + v];" if cuda else
                                                        f"fz_s_{vname[i]}[c];")
                  for i in sorted(need & held, key=lambda i: (i in order, order.get(i, 0), vname[i]))]
        lines += [statement[i] for i in sorted(need - held - set(tensor_index) - {v.id for v in group.inputs},
                                                key=order.__getitem__)]
        if cuda and npass[0] + 1 < len(holds):
            lines += [f"h_{vname[i]}[i * {shape.vec} + v] = {vname[i]};"
                      for i in sorted(holds[npass[0] + 1] - held, key=lambda i: (i in order, order.get(i, 0), vname[i]))]
        if not cuda:
            lines += [f"fz_s_{vname[i]}[c] = {vname[i]};" for i in sorted(kept[p][1], key=order.__getitem__)]
        return lines

    def cuda_loads(wanted: Sequence[ir.Value]) -> tuple[list[str], list[str]]:
        """A CUDA pass's loads of the inputs it reads that are not held (``fz_row_trip``): (a trip's elements,
        every load issued before the pass uses any; a vector's, per item). A held row's later passes read their
        inputs per item (a weight and bias next to held values: registers for the held ones), others per trip."""
        held = holds[npass[0]]
        need = _needed(group, wanted, held)
        per_item = shape.held and npass[0] > 0
        n, at = (1, f"tb + i * {shape.tpr * shape.vec}") if per_item else (shape.items // shape.vec, "tb")
        full = str(shape.full).lower()

        def load(k: int) -> str:
            if k in shape.staged:  # copied into shared memory at the row's start (CUDA_STAGE's fz_row_fetch)
                return f"fz_row_staged<{n}, {shape.vec}, {shape.tpr}, {full}>(xl{k}, fz_sg{k}, {at}, lane, cols);"
            if steps is not None:
                return (f"fz_row_vec<{n}, {shape.vec}, {shape.tpr}, {full}, {steps[k]}>(xl{k}, t{k}, off{k}, {at}, "
                        f"lane, cols);")
            return (f"fz_row_trip<{n}, {shape.vec}, {shape.tpr}, {full}>(xl{k}, t{k}, off{k}, cs{k}, {at}, lane, cols, "
                    f"args.vec);")
        loads = [f"{vtype[v.id]} xl{tensor_index[v.id]}[{n * shape.vec}];\n" + load(tensor_index[v.id])
                 for v in group.inputs if v.is_tensor and v.id in need and v.id not in held]
        return ([], loads) if per_item else (loads, [])

    def cuda_pass(acc_decl: str, wanted, body: list, after: list, item_decls: list = (), after_item: list = ()) -> str:
        """A CUDA pass along the row (``templates.CUDA_PASS``): ``body`` per element, ``item_decls`` and
        ``after_item`` around each item's vector of elements, ``after`` once the row is done."""
        trips = ("for (int tb = 0; tb < 1; ++tb)" if shape.held else
                 f"for (int tb = 0; tb < cols; tb += {shape.tpr * shape.items})")
        loads, item_loads = cuda_loads(wanted)
        npass[0] += 1
        return t.CUDA_PASS.substitute(
            acc_decl=acc_decl, trips=trips, nv=shape.items // shape.vec, tpr=shape.tpr, vec=shape.vec,
            loads="\n".join("      " + ln for x in loads for ln in x.split("\n")),
            item_decls="\n".join("        " + ln for x in [*item_loads, *item_decls] for ln in x.split("\n")),
            body="\n".join("          " + ln for ln in body),
            after_item="\n".join("        " + ln for ln in after_item), after="\n".join("    " + ln for ln in after))

    def guarded(lines: list) -> list:  # CUDA: an element before the row's end (every row computes: see CUDA_KERNEL)
        return lines if shape.full else ["if (cb + v < cols) {"] + ["  " + ln for ln in lines] + ["}"]

    indent = "      "
    phases: list[str] = []
    ready = {v.id for v in group.inputs if not v.is_tensor or v.id in rows_v}
    for m in group.nodes:  # row-level nodes of row-level inputs alone: once a row, before its passes
        if m.out.id in rows_v and ops.reduction(m.op) is None and all(v.id in ready for v in m.values):
            phases.append("    " + statement[m.out.id])
            ready.add(m.out.id)
    shared = set()
    cl = cuda and shape.cluster > 1  # the row spans the CTAs of a cluster (shape.cluster_shape)
    # a cluster kernel's reductions combine the CTAs' results (templates.CLUSTER_REDUCE; fz_cn counts them)
    reduce_fn = (f"fz_cluster_reduce<{{}}, {shape.tpr}, {shape.cluster}>" if cl else
                 f"fz_row_reduce<{{}}, {shape.tpr}>" if cuda else None)
    red_tail = ", fz_cn" if cl else ""
    # the row length in the reductions' divisors: a cluster CTA's cols counts only its own segment's columns
    ncols = "fz_ncols" if cl else "cols"
    cpass = 0  # the CPU pass being generated (kept's index)
    centered = centered_means(group)
    cuda_sets = reduction_passes(group, merge=True) if cuda else []
    merged: list = []  # CUDA: the pieces of the current pass's reductions (acc_decl, input, accumulate, after,
    # pairable: (combine, accumulator type, pos, its reduce line's index in after) or None)
    paired = False  # some pass combines two reductions' block results at once (fz_row_reduce2)
    n_sets = 0  # CUDA: the reduction sets emitted so far
    for n, pos, red, nt in reductions:
        u = n.args[0]
        acc_t = accumulator_type(red, nt, target)
        pairable = None
        x = vname[u.id]
        if vdtype[u.id] != nt.compute:  # eager converts the input to the reduction's dtype first
            x = (f"fz_ld(fz_st<{storage_type(nt.compute)}>(({compute_type(vdtype[u.id])}){x}))"
                 if nt.compute in REDUCED else f"({compute_type(nt.compute)})({x})")
        ident = red.identity.replace("$A", acc_t)
        accumulate = f"acc{pos} = {red.combine}::f(acc{pos}, ({acc_t})({x}));"
        after = []
        # a thread adding many of a long row's elements in float (shape.COMPENSATED_PER_THREAD): Kahan's sum (sum,
        # mean, var's squared deviations), its compensation kc folded in before the threads combine
        kahan = cuda and shape.compensated and acc_t == "float" and red.combine == "fz_rsum"
        if kahan:
            accumulate = _compensated(f"acc{pos}", f"kc{pos}", x)
        if red.variance:  # a first pass for the row's mean; this pass sums the squared deviations from it
            add = _compensated(f"acc{pos}", f"kc{pos}", "dv * dv") if kahan else f"acc{pos} += dv * dv;"
            accumulate = f"{{ const {acc_t} dv = ({acc_t})({x}) - mean{pos}; {add} }}"
            # the mean in double (as the CPU's accumulators are): a float sum of huge equal values rounds, and the
            # deviations from a mean off by an ulp of 1e30 square past float's range, where eager's Welford gives 0
            mean_t = "double"
            mean_body = element_lines([u], cpass) + [f"accm{pos} += ({mean_t})({x});"]
            cpass += 1
            mean_after = [f"const {acc_t} mean{pos} = ({acc_t})(accm{pos} / (double){ncols});"]
            if not cuda:  # the row's sum of its differences from its first value, that value added after: the mean
                # of equal values is exact (a double sum of three 1e30 float64 values, divided by 3, is not: the
                # CUDA fuzzer found a variance of 3e28 where eager's Welford gives 0); the plain sum where the
                # shifted one is not finite (an inf in the row)
                mean_body[-1] = (f"{{ const double xv = (double)({x}); if (c == 0) shm{pos} = xv; "
                                 f"accm{pos} += xv; acsm{pos} += xv - shm{pos}; }}")
                mean_after = [f"const {acc_t} mean{pos} = ({acc_t})({_finite(f'acsm{pos}')} ? "
                              f"shm{pos} + acsm{pos} / (double)cols : accm{pos} / (double)cols);"]
            if cuda:
                shared.add(mean_t)
                mean_after.insert(0, f"accm{pos} = {reduce_fn.format('fz_rsum')}(accm{pos}, fz_sh_{mean_t}{red_tail});")
                phases.append(cuda_pass(f"{mean_t} accm{pos} = 0.0;", [u], guarded(mean_body), mean_after))
            else:
                phases.append(f"    const int64_t c0_{pos}m = 0;\n" + t.PHASE.substitute(
                    acc_decl=f"{acc_t} accm{pos} = {ident}; double acsm{pos} = 0, shm{pos} = 0;", first=f"c0_{pos}m",
                    step="1",
                    body="\n".join(indent + ln for ln in mean_body),
                    after="\n".join("    " + ln for ln in mean_after)))
            if vector is not None:
                vector.on = False  # no vector form of the two passes (yet): scalar loops
        elif vector is not None:
            vector.reduction(u, red, pos, acc_t, vdtype[u.id] == nt.compute, *kept[cpass], [u],
                             shifted=n.out.id in centered)
        acc_decl = f"{acc_t} acc{pos} = {ident};"
        result = f"acc{pos} / ({acc_t}){ncols}" if red.mean else f"acc{pos}"
        if cuda and n.out.id in centered:  # each thread sums its differences from the first value it sees, then
            # adds back that value times its count in double (centered_means: exact for a row of equal values); its
            # plain sum where that is not finite (an inf in the row: inf - inf would make the mean NaN)
            acc_decl += f" {acc_t} acs{pos} = 0; {acc_t} sh{pos} = 0; int cn{pos} = 0;"
            shifted = (_compensated(f"acs{pos}", f"kc{pos}", f"xv - sh{pos}") if kahan else
                       f"acs{pos} += xv - sh{pos};")
            accumulate = (f"{{ const {acc_t} xv = ({acc_t})({x}); if (cn{pos} == 0) sh{pos} = xv; "
                          f"acc{pos} += xv; {shifted} ++cn{pos}; }}")
            shared.add("double")
            after += [f"acs{pos} -= kc{pos};"] if kahan else []
            after += [f"double accd{pos} = {_finite(f'(double)acs{pos}')} ? (double)acs{pos} + "
                      f"(double)cn{pos} * (double)sh{pos} : (double)acc{pos};",
                      f"accd{pos} = {reduce_fn.format(red.combine)}(accd{pos}, fz_sh_double{red_tail});"]
            result = f"accd{pos} / (double){ncols}"
        elif cuda:
            shared.add(acc_t)
            after += [f"acc{pos} -= kc{pos};"] if kahan else []
            after.append(f"acc{pos} = {reduce_fn.format(red.combine)}(acc{pos}, fz_sh_{acc_t}{red_tail});")
            if not cl and not kahan:  # may pair with a sibling's (see _paired)
                pairable = (red.combine, acc_t, pos, len(after) - 1)
        centered_cpu = not cuda and n.out.id in centered
        if centered_cpu:  # the row's differences from its first value (cref, read before the pass), summed in double
            # by the vector lanes (_Vector.reduction) and the scalar loop; the mean is that value plus their mean, exact
            # for a row of equal values in every dtype (count x value is not, in float64: layer_norm of a float64 row
            # of 1e30 gave +-1 where eager gives 0); the plain sum where the shifted one is not finite (an inf)
            accumulate = (f"{{ const {acc_t} xv = ({acc_t})({x}); acc{pos} += xv; "
                          f"accs{pos} += (double)xv - cref{pos}; }}")
            result = f"({_finite(f'accs{pos}')} ? cref{pos} + accs{pos} / (double)cols : acc{pos} / ({acc_t})cols)"
        if red.variance:  # eager's divisor max(0, n - correction): n <= correction gives inf or NaN as eager's
            c = ops.correction(n.op, n.args)
            result = f"acc{pos} / ({acc_t})((double){ncols} - {c!r} > 0 ? (double){ncols} - {c!r} : 0.0)"
        rtype = vtype[n.out.id]
        if n.out.id in exact:  # rounded as eager stores it (stores_rounded)
            result = f"fz_ld(fz_st<{storage_type(nt.result)}>((float)({result})))"
        after.append(f"const {rtype} v{pos} = ({rtype})({result});")
        ready.add(n.out.id)
        for m in group.nodes:  # row-level nodes whose operands are ready now
            if m.out.id in rows_v and m.out.id not in ready and ops.reduction(m.op) is None and all(
                    v.id in ready for v in m.values):
                after.append(statement[m.out.id])
                ready.add(m.out.id)
        if cuda:  # the pass is emitted with its set's last reduction (passes.reduction_passes: siblings share one)
            merged.append((acc_decl + (f" float kc{pos} = 0.0f;" if kahan else ""), u, accumulate, after, pairable))
            if n is cuda_sets[n_sets][-1]:
                paired = (shape.tpr > 32 and _paired(merged, shape)) or paired
                wanted = [m[1] for m in merged]
                phases.append(cuda_pass(" ".join(m[0] for m in merged), wanted,
                                        guarded(element_lines(wanted) + [m[2] for m in merged]),
                                        [ln for m in merged for ln in m[3]]))
                n_sets, merged = n_sets + 1, []
            continue
        body = element_lines([u], cpass) + [accumulate]
        cpass += 1
        vectorized = vector is not None and vector.on
        phases.append(t.PHASE.substitute(
            acc_decl="" if vectorized else f"{acc_t} acc{pos} = {ident};", first=f"c0_{pos}", step="1",
            body="\n".join(indent + ln for ln in body), after="\n".join("    " + ln for ln in after)))
        phases[-1] = (vector.parts[-1] if vectorized else f"    const int64_t c0_{pos} = 0;") + "\n" + phases[-1]
        if centered_cpu:  # the row's first value of the pass's input: its element lines at column 0
            first = "\n".join("      " + ln for ln in element_lines([u], cpass - 1))
            phases[-1] = (f"    double cref{pos} = 0, accs{pos} = 0;\n    if (cols > 0) {{\n"
                          f"      const int64_t c = 0;\n{first}\n      cref{pos} = (double)({x});\n    }}\n"
                          + phases[-1])

    position = {n.out.id: pos for pos, n in enumerate(group.nodes)}
    elem_out = [(m, o) for m, o in enumerate(group.outputs) if o.id not in rows_v]
    row_out = [(m, o) for m, o in enumerate(group.outputs) if o.id in rows_v]

    def store(m: int, o: ir.Value, at: str) -> str:
        dt = node_types[position[o.id]].result
        return f"o{m}[{at}] = fz_st<{storage_type(dt)}>({vname[o.id]});"

    # a thread's column sum slot of element i * vec + v: in registers, or its own column of a shared array
    sum_at = (f"(i * {shape.block} + threadIdx.x) * {shape.vec} + v" if shape and shape.sums_shared else
              f"i * {shape.vec if shape else 1} + v")
    if elem_out and cuda:  # each item's values into a vector per output, stored whole where the launch allows
        out_row = "row * fz_ncols + fz_c0" if cl else "row * cols"
        wanted = [o for _, o in elem_out]
        kept_out = [(m, o) for m, o in elem_out if m not in sums]
        out_t = {m: storage_type(node_types[position[o.id]].result) for m, o in kept_out}
        # float16 / bfloat16 outputs: the item's floats, rounded two at a time into 32-bit words (fz_pack2) before
        # the stores (0 past the row's end where a row is not whole trips, as nothing computes them)
        pairs = {m for m, o in kept_out if node_types[position[o.id]].result in REDUCED and shape.vec % 2 == 0}
        decls = [f"float wf{m}[{shape.vec}]{'' if shape.full else ' = {}'};" if m in pairs else
                 f"fz_vec<{out_t[m]}, {shape.vec}> w{m};" for m, o in kept_out]
        # column sums: a live row's values added into the thread's registers, or its shared slots (its columns are
        # the same every row)
        acc_t = {m: accumulator_type(_SUM, node_types[position[o.id]], target) for m, o in elem_out if m in sums}
        shared_sums = [(m, o) for m, o in elem_out if m in sums] if shape.sums_shared else []
        # shared slots: an item's values into a vector (0 past the row's end), added to its slots whole (trip sums:
        # in 16-byte chunks, trip_slot_chunk)
        decls += [f"fz_vec<{acc_t[m]}, {shape.vec}> a{m} = {{}};" for m, _ in shared_sums]
        body = guarded(element_lines(wanted) + [f"wf{m}[v] = (float)({vname[o.id]});" if m in pairs else
                                                store(m, o, "v").replace(f"o{m}[v]", f"w{m}.v[v]")
                                                for m, o in kept_out] + [
            f"a{m}.v[v] = ({acc_t[m]})({vname[o.id]});" if shape.sums_shared else
            f"if (live) fz_a{m}[{sum_at}] += ({acc_t[m]})({vname[o.id]});" for m, o in elem_out if m in sums])
        stores = [ln for m in sorted(pairs) for ln in (
            f"fz_vec<unsigned int, {shape.vec // 2}> w{m};", "#pragma unroll",
            f"for (int v = 0; v < {shape.vec // 2}; ++v) w{m}.v[v] = fz_pack2<{out_t[m]}>(wf{m}[2 * v], wf{m}[2 * v + 1]);")]
        stores += [f"if (live{'' if shape.full else ' && cb < cols'}) {{"]
        stores += ["  if (args.vec) {"] if steps is None else []
        stores += [f"    *reinterpret_cast<fz_vec<{'unsigned int' if m in pairs else out_t[m]}, "
                   f"{shape.vec // 2 if m in pairs else shape.vec}>*>(o{m} + {out_row} + cb) = w{m};" for m, o in kept_out]
        if steps is None:
            stores += ["  } else {", "#pragma unroll", f"    for (int v = 0; v < {shape.vec}; ++v) {{",
                       f"      if ({'true' if shape.full else 'cb + v < cols'}) {{"]
            stores += [f"        o{m}[{out_row} + cb + v] = "
                       + (f"fz_word_half<{out_t[m]}>(w{m}.v[v / 2], v & 1);" if m in pairs else f"w{m}.v[v];")
                       for m, _ in kept_out]
            stores += ["      }", "    }", "  }"]
        stores += ["}"]
        # (a live row's: one branch around the adds, where a select an element zeroed a row past the end's values)
        stores += ["if (live) {"] if shared_sums else []
        for m, _ in shared_sums:  # (trip sums: the slots of the item's columns, trip_slot_chunk's layout)
            q = trip_slot_chunk(shape, acc_t[m]) if shape.trip_sums else shape.vec
            vt = f"fz_vec<{acc_t[m]}, {q}>"
            for k in range(shape.vec // q):
                at = (trip_slot(shape, acc_t[m], str(k), f"cb / {shape.vec}") if shape.trip_sums else
                      f"(i * {shape.block} + threadIdx.x) * {shape.vec}")
                stores += [f"  {{ {vt}* const s = reinterpret_cast<{vt}*>(fz_a{m} + {at}); {vt} t = *s;",
                           "#pragma unroll", f"    for (int v = 0; v < {q}; ++v) t.v[v] += a{m}.v[{k * q} + v];",
                           "    *s = t; }"]
        stores += ["}"] if shared_sums else []
        phases.append(cuda_pass("", wanted, body, [], item_decls=decls, after_item=stores))
    elif elem_out:
        body = element_lines([o for _, o in elem_out], cpass) + [
            store(m, o, "row * cols + c") if m not in sums else
            f"fz_p{m}[c] += ({compute_type(node_types[position[o.id]].result)})({vname[o.id]});"
            for m, o in elem_out]
        phases.append(t.PHASE.substitute(acc_decl="", first="c0_out", step="1",
                                          body="\n".join(indent + ln for ln in body), after=""))
        if vector is not None:
            vector.stores([(m, o, node_types[position[o.id]].result) for m, o in elem_out], *kept[cpass],
                          [o for _, o in elem_out], sums)
        phases[-1] = (vector.parts[-1] if vector is not None and vector.on else
                      "    const int64_t c0_out = 0;") + "\n" + phases[-1]
    if row_out:
        stores = [store(m, o, "row") for m, o in row_out]
        if cuda:
            phases.append(f"    if (live && lane == 0{' && fz_c0 == 0' if cl else ''}) {{\n"
                          + "\n".join("      " + s for s in stores) + "\n    }")
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
    offsets = (t.OFFSETS if walk else t.OFFSETS_ONE).substitute(
        decls=", ".join(f"off{kk} = 0" for kk in range(n_in)) if n_in else "fz_unused = 0", size=size,
        quotient=t.quotient("r", size, index64 or not cuda),
        accumulate="\n".join(f"        off{kk} += m * {stride(kk, 'd')};" for kk in range(n_in)),
        accumulate1="\n".join(f"      off{kk} = row * {stride(kk, 0)};" for kk in range(n_in)),
        col_strides="\n".join(f"    const long long cs{kk} = {stride(kk, t.MAX_DIMS if cuda else 'rank')};"
                               for kk in range(n_in)))
    # row-level inputs (passes.with_row_inputs): one value a row, loaded at its start (a CUDA row that is not live
    # reads the last row's: plan's CUDA_KERNEL)
    row_loads = "".join(f"\n    const {vtype[v.id]} {vname[v.id]} = fz_ld(t{tensor_index[v.id]}[off{tensor_index[v.id]}]);"
                        for v in group.inputs if v.is_tensor and v.id in rows_v)
    if cuda:
        ever = sorted(set().union(*holds), key=lambda i: vname[i])
        cache = [f"    {vtype[i]} h_{vname[i]}[{shape.items}];" for i in ever]
        sum_t = {m: accumulator_type(_SUM, node_types[position[group.outputs[m].id]], target) for m in sums}
        n_ptrs = n_in + len(out_dtypes)
        # (32-bit byte counts: a block's dynamic shared memory is below 2^18 bytes)
        stage_row = [f"((unsigned)cols * (unsigned)sizeof({storage_type(inputs[k])}) + 15u) / 16u * 16u"
                     for k in shape.staged]
        sums_decl = "\n".join(
            f"  __shared__ __align__(16) {sum_t[m]} fz_a{m}[{shape.items * shape.block}];  // (a thread's own slots)\n"
            f"  for (int k = 0; k < {shape.items // shape.vec}; ++k)\n"
            f"    reinterpret_cast<fz_vec<{sum_t[m]}, {shape.vec}>*>(fz_a{m})[k * {shape.block} + threadIdx.x] = "
            f"fz_vec<{sum_t[m]}, {shape.vec}>{{}};"
            if shape.sums_shared else f"  {sum_t[m]} fz_a{m}[{shape.items}] = {{}};" for m in sums)
        rpb = shape.block // shape.tpr
        if sums and shape.trip_sums:  # a slot per column of the row's whole trips, after the staged row
            assert shape.block == shape.tpr, "trip sums take one row a block (shape._cuda_sums_shape)"
            trip = shape.tpr * shape.items
            lines = [f"  const int fz_span = (cols + {trip - 1}) / {trip} * {trip};  // (whole trips' columns)"]
            at = ["0"] + stage_row  # each sum's slots after the staged rows and the sums before it
            for m in sums:
                lines.append(f"  {sum_t[m]}* const fz_a{m} = reinterpret_cast<{sum_t[m]}*>(fz_dyn_smem() + "
                             f"{' + '.join(at)});")
                at.append(f"(unsigned)fz_span * (unsigned)sizeof({sum_t[m]})")
            sums_decl = "\n".join(lines)

            def slot_of(m: int) -> str:  # column c's slot
                q = trip_slot_chunk(shape, sum_t[m])
                if q == shape.vec:
                    return "c"
                return trip_slot(shape, sum_t[m], f"(c % {shape.vec}) / {q}", f"c / {shape.vec}") + f" + c % {q}"
            sums_decl += (f"\n  for (int c = threadIdx.x; c < fz_span; c += {shape.block}) {{"
                          + "".join(f" fz_a{m}[c] = 0;" for m in sums) + " }\n  __syncthreads();")
            sums_store = t.CUDA_PARTS_STORE_TRIPS.substitute(block=shape.block, stores="\n".join(
                f"    (({sum_t[m]}*)args.ptrs[{n_ptrs + k}])[(long long)blockIdx.x * cols + c] = fz_a{m}[{slot_of(m)}];"
                for k, m in enumerate(sums)))
        elif sums and block_parts(shape):  # the block's rows' slots added first (templates.CUDA_PARTS_STORE_BLOCK)
            at = f"(i * {shape.block} + {{}}) * {shape.vec} + v"
            sums_store = t.CUDA_PARTS_STORE_BLOCK.substitute(
                nv=shape.items // shape.vec, tpr=shape.tpr, vec=shape.vec, block=shape.block,
                check="true" if shape.full else "cb + v < cols", stores="\n".join(
                    f"        {{ {sum_t[m]} s = fz_a{m}[{at.format('ln')}];\n"
                    f"          for (int r = 1; r < {rpb}; ++r) s += fz_a{m}[{at.format(f'r * {shape.tpr} + ln')}];\n"
                    f"          (({sum_t[m]}*)args.ptrs[{n_ptrs + k}])[(long long)blockIdx.x * cols + cb + v] = s; }}"
                    for k, m in enumerate(sums)))
        else:
            sums_store = t.CUDA_PARTS_STORE.substitute(
                nv=shape.items // shape.vec, tpr=shape.tpr, vec=shape.vec, rpb=rpb,
                check="true" if shape.full else "cb + v < cols", stores="\n".join(
                    f"        (({sum_t[m]}*)args.ptrs[{n_ptrs + k}])[slot * cols + cb + v] = fz_a{m}[{sum_at}];"
                    for k, m in enumerate(sums))) if sums else ""
        parts_kernel = t.CUDA_PARTS_KERNEL.substitute(name=name, sums="\n".join(
            f"    {{ {sum_t[m]} s = 0; if (c < cols) for (long long q = g; q < args.slots; q += 8) "
            f"s += (({sum_t[m]}*)args.ptrs[{n_ptrs + k}])[q * cols + c]; fz_sh{m}[g][lc] = s; }}"
            for k, m in enumerate(sums)), stores="\n".join(
            f"      {{ {sum_t[m]} s = fz_sh{m}[0][lc]; for (int k = 1; k < 8; ++k) s += fz_sh{m}[k][lc]; "
            f"o{m}[c] = fz_st<{storage_type(out_dtypes[m])}>(({compute_type(out_dtypes[m])})s); }}" for m in sums),
            params="\n".join(
                f"  {storage_type(out_dtypes[m])}* __restrict__ o{m} = "
                f"({storage_type(out_dtypes[m])}*)args.ptrs[{n_in + m}];\n  __shared__ {sum_t[m]} fz_sh{m}[8][32];"
                for m in sums)) if sums else ""
        assert not (cl and sums), "a cluster kernel has no column sums (plan.py)"
        if cl:  # the CTA's segment: its inputs' offsets start at its first column
            offsets += "".join(f"\n    off{kk} += (long long)fz_c0 * cs{kk};" for kk in range(n_in))
        offsets += row_loads
        if shape.staged:  # each thread's vectors of the row's staged inputs, in flight at once
            offsets += "".join(f"\n    fz_row_fetch<{shape.vec}, {shape.tpr}>(fz_sg{k}, t{k}, off{k}, lane, cols);"
                               for k in shape.staged) + "\n    fz_cp_wait();"
        n_sh = max(1, shape.block // 32) * (2 if paired else 1) + (2 if cl else 0)
        stage = []
        if shape.staged:  # (shape.stage_row_bytes's layout)
            row = stage_row
            stage = [t.CUDA_STAGE.substitute(row_at="" if rpb == 1 else (
                f" + (threadIdx.x / {shape.tpr}u) * ({' + '.join(row)})"), pointers="\n".join(
                f"  {storage_type(inputs[k])}* const fz_sg{k} = ({storage_type(inputs[k])}*)(fz_stage"
                + "".join(f" + {r}" for r in row[:i]) + ");" for i, k in enumerate(shape.staged)))]
        return t.CUDA_KERNEL.substitute(
            sums_decl=sums_decl, sums_store=t.CUDA_CLUSTER_END if cl else sums_store, parts_kernel=parts_kernel,
            name=name, prelude=cuda_t.PRELUDE + (cuda_t.CLUSTER if cl else "") + (cuda_t.STAGE if shape.staged or shape.trip_sums else ""),
            row_prelude=t.row_prelude(
                "cuda", t.ROW_REDUCE + (t.CLUSTER_REDUCE if cl else "") + (t.ROW_FETCH if shape.staged else "")),
            cluster_dims=f"__cluster_dims__({shape.cluster}, 1, 1) " if cl else "",
            cols=t.CUDA_CLUSTER_COLS.substitute(seg=shape.tpr * shape.items) if cl else t.CUDA_COLS,
            first_block=f"(blockIdx.x / {shape.cluster})" if cl else "blockIdx.x",
            n_blocks=f"(gridDim.x / {shape.cluster})" if cl else "gridDim.x",
            max_dims=t.MAX_DIMS, n_stride_rows=max(1, n_in), n_ptrs=n_in + len(out_dtypes) + len(sums),
            n_scalar_slots=max(1, n_scalar_slots), block=shape.block,
            min_blocks=f", {shape.min_blocks}" if shape.min_blocks > 1 else "",
            tpr=shape.tpr, rpb=shape.block // shape.tpr,
            items=shape.items, vec=shape.vec, params="\n".join(params),
            shared="\n".join([f"  __shared__ {a} fz_sh_{a}[{n_sh}];" for a in sorted(shared)] + stage),
            offsets=offsets, cache="\n".join(cache), phases="\n".join(phases))
    if vector is not None and not vector.on:  # some pass has no vector form: scalar loops throughout
        return generate(group, inputs, node_types, target, name, n_scalar_slots, vectorize=False,
                        round_reduced=round_reduced, sums=sums)
    work = 1 + len(statement) + len(reductions)
    vectorized = vector is not None
    offsets += row_loads
    if vectorized:
        offsets += "\n    const bool vec_ok = " + " && ".join(
            [f"(cs{kk} == 0 || cs{kk} == 1)" for kk in range(n_in)] + ["true"]) + ";"
    scratch = sorted(set().union(*(k for _, k in kept)), key=order.__getitem__)
    threshold = max(1, CPU_PARALLEL_WORK // work)
    var, count = ("part", "fz_parts") if sums else ("row", "rows")
    cond = t.CPU_PARALLEL.substitute(count=count, parallel_threshold=threshold)
    parallel, end = "", ""
    loop, loop_end = t.CPU_FOR.substitute(cond=cond, count=count, var=var), "  });"
    if scratch:  # a row of each kept value per thread
        parallel = t.CPU_PARALLEL_SCRATCH.substitute(cond=cond, scratch="\n".join(
            f"  {vtype[i]}* __restrict__ fz_s_{vname[i]} = new {vtype[i]}[cols > 0 ? cols : 1];" for i in scratch))
        end = "".join(f"  delete[] fz_s_{vname[i]};\n" for i in scratch) + "  });\n"
        loop, loop_end = t.CPU_SHARE_FOR.substitute(count=count, var=var), "  }"
    parts = parts_sum = ""
    if sums:
        part_t = {m: compute_type(out_dtypes[m]) for m in sums}
        parts = t.CPU_PARTS.substitute(parallel_threshold=threshold, max_parts=CPU_MAX_PARTS,
                                       part_rows=CPU_PART_ROWS, part_work=CPU_PART_WORK, min_parts=CPU_MIN_PARTS,
                                       alloc="\n".join(
            f"  {part_t[m]}* const fz_pb{m} = new {part_t[m]}[fz_parts * cols > 0 ? fz_parts * cols : 1];"
            for m in sums))
        loop += "\n" + t.CPU_PARTS_LOOP.substitute(zero="\n".join(
            f"    {part_t[m]}* __restrict__ const fz_p{m} = fz_pb{m} + part * cols;\n"
            f"    for (int64_t c = 0; c < cols; ++c) fz_p{m}[c] = 0;" for m in sums))
        loop_end = "  }\n" + loop_end
        parts_sum = t.CPU_PARTS_SUM.substitute(
            parallel_threshold=threshold, free="\n".join(f"  delete[] fz_pb{m};" for m in sums),
            sums="\n".join(f"      for (int64_t c = c0; c < c1; ++c) fz_pb{m}[c] += fz_pb{m}[q * cols + c];"
                           for m in sums),
            stores="\n".join(f"      o{m}[c] = fz_st<{storage_type(out_dtypes[m])}>(fz_pb{m}[c]);" for m in sums))
    return t.CPU_KERNEL.substitute(
        name=name, head=t.CPU_HEAD.substitute(
            prelude=cpu_t.VECTOR_INCLUDE if vectorized else cpu_t.PRELUDE,
            row_prelude=t.row_prelude("cpu", t.CPU_LANE_REDUCE if vectorized else ""),
            name=name, count="rows"),
        vector_types=t.CPU_VECTOR_TYPES.substitute(vtype=vector.vtype) if vectorized else "",
        params="\n".join(params), parallel=parallel, end=end, offsets=offsets, phases="\n".join(phases),
        parts=parts, loop=loop, loop_end=loop_end, parts_sum=parts_sum)
