"""The column kernel's source (``fuser/rows/outer.py``'s plans): a pure function from (group, input dtypes, node
types, target) to C++ or CUDA.

One pass down each column: per element the prologue (the element-level nodes the reductions and the element-level
outputs need, loaded from the inputs in memory), every reduction accumulated (they all reduce the same column), the
element-level outputs stored; then per column the reductions' results (a mean divides by the column's length), the
epilogue (the column-level nodes, in the group's order) and the column-level outputs. Each node's statement is the
pointwise codegen's (``codegen.body.node_statement``), so an op means the same in every kind of kernel. On the
CPU, where every node the pass computes has an at::vec form, a vector pass (:func:`_cpu_vector_pass`) takes the
whole vectors of a chunk's columns first (``CpuVector``'s lines: the pointwise kernels' vector forms).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import ir, ops
from ..codegen import REDUCED, KernelOptions, NodeTypes, NotFusable, value_type
from ..codegen.body import node_statement
from ..codegen.cpu_vector import CpuVector
from ..cpu import templates as cpu_t
from ..cuda import templates as cuda_t
from ..descs import DENSE, TensorDesc, compute_type, storage_type
from . import outer_templates as t
from . import templates as row_t
from .codegen.analysis import accumulator_type, input_names, stores_rounded
from .outer import column_level
from .passes import needed

CPU_PARALLEL_WORK = 32768  # elements of work from which a CPU column kernel splits its chunks across threads


def generate(group: ir.Group, inputs: Sequence[torch.dtype], node_types: Sequence[NodeTypes], target: str,
             name: str, n_scalar_slots: int, round_reduced: bool = False, cvec: int = 1, steps: tuple = (),
             vectors: bool = False, vectorize: bool = False, index64: bool = True,
             walk: bool = True) -> str:
    """Source of the column kernel ``name``; ``inputs``: the tensor inputs' dtypes. Raises NotFusable where an op
    has no expression for its types (the executor falls back). ``round_reduced``: as
    ``KernelOptions.round_reduced`` for the pointwise nodes (a reduction's float16/bfloat16 result is rounded
    always: once per column, it costs nothing). ``cvec``: CUDA, consecutive columns a thread takes
    (``outer.OuterKey.cvec``): its per-element lines run per column v of the thread's, on arrays of ``cvec``;
    ``steps``: per tensor input, whether it steps by 1 along the columns (else by 0); ``vectors`` (``cvec`` > 1): the
    thread's columns of a row are loaded and stored as whole vectors (``OuterKey.vectors``: the launch's pointers allow
    them), else element by element. ``vectorize``: the CPU
    kernel gets an at::vec pass over whole vectors of a chunk's columns (:func:`_cpu_vector_pass`) where every
    node it computes has a vector form; the scalar loop takes the rest. ``index64``: CUDA, the block index and the
    walks over the column dims divide in 64 bits (``OuterKey.index64``), else in 32. ``walk``: CUDA, the columns may
    span several dims (``OuterKey.walk``); else a column's offsets are column * stride."""
    cuda = target == "cuda"
    cols_v = column_level(group)
    vname, vtype, vdtype, tensor_index, j = input_names(group, inputs, target)
    n_in = len(inputs)

    statement: dict[int, str] = {}
    exact: set = {v.id for v in group.inputs}  # (see codegen.body.generate)
    reductions = []  # (node, position, reduction, node types, accumulator type)
    vector_args: dict[int, tuple] = {}  # per non-reduction node's value: what CpuVector.add takes
    options = KernelOptions(index32=False, vectorize=False, round_reduced=round_reduced)
    for pos, (n, nt) in enumerate(zip(group.nodes, node_types)):
        red = ops.reduction(n.op)
        if red is not None:
            if red.variance or red.composite:
                raise NotFusable(f"{n.op} in a column kernel")
            vname[n.out.id], vtype[n.out.id], vdtype[n.out.id] = f"v{pos}", value_type(nt.result, target), nt.result
            if stores_rounded(n, red, nt, exact):
                exact.add(n.out.id)
            reductions.append((n, pos, red, nt, accumulator_type(red, nt, target)))
            continue
        op = ops.of(n.op)
        if op is None or op.random or op.concat:
            raise NotFusable(f"{n.op} in a column kernel")
        statement[n.out.id], variant, consts, round_to = node_statement(group, n, op, nt, pos, target, options,
                                                                        vname, vtype, vdtype, exact)
        vector_args[n.out.id] = (n, op, variant, nt, consts, round_to)

    order = {n.out.id: pos for pos, n in enumerate(group.nodes)}
    position = order
    elem_out = [(m, o) for m, o in enumerate(group.outputs) if o.id not in cols_v]
    col_out = [(m, o) for m, o in enumerate(group.outputs) if o.id in cols_v]

    def words(k: int) -> bool:
        """CUDA, ``cvec`` even: input ``k`` is bfloat16, loaded as 32-bit words of two columns (``fz_col_load``'s
        word form), each widened where used by one shift or mask (``fz_word_bf16``)."""
        return cuda and cvec % 2 == 0 and inputs[k] == torch.bfloat16

    def element_lines(wanted: Sequence[ir.Value], row, loaded: bool = False) -> list[str]:
        """Loads (of row ``row``: an offset, ``#`` standing for the input's number, or a function of that number)
        and statements of the element-level values ``wanted`` needs (they never read a column-level value), in the
        group's order. ``loaded``: the inputs are in arrays ``xl<k>`` already (:func:`vector_loads`), read at the
        thread's column ``v``."""
        need = needed(group, wanted, level=cols_v)
        at = row if callable(row) else (lambda k: row.replace("#", str(k)))
        lines = [f"const {vtype[v.id]} x{k} = " + (
                     (f"fz_word_bf16(xl{k}.v[v / 2], v & 1);" if words(k) else
                      f"fz_ld(xl{k}.v[v]);" if inputs[k] in REDUCED else f"xl{k}[v];") if loaded else
                     f"fz_ld(t{k}[{'off' if cuda else 'coff'}{k}{'' if cuda else '[j]'}{at(k)}]);")
                 for v in group.inputs if v.is_tensor and v.id in need for k in (tensor_index[v.id],)]
        return lines + [statement[i] for i in sorted(need & set(statement), key=order.__getitem__)]

    def vector_loads(wanted: Sequence[ir.Value], vec: bool) -> list[str]:
        """CUDA, ``cvec`` > 1: a row's ``cvec`` columns of each input the values ``wanted`` read, all loads first
        (``vec``: whole vectors of the inputs that step along the columns); float16/bfloat16 ones kept in their
        storage type until used (``fz_col_load``)."""
        need = needed(group, wanted, level=cols_v)
        return [(f"fz_vec<unsigned int, {cvec // 2}> xl{k};\n" if words(k) else
                 f"fz_vec<{storage_type(inputs[k])}, {cvec}> xl{k};\n" if inputs[k] in REDUCED else
                 f"{storage_type(inputs[k])} xl{k}[{cvec}];\n") +
                f"fz_col_load<{cvec}, {(1 if vec else 2) if steps[k] else 0}>(xl{k}, t{k}, off{k} + r * rs{k});"
                for v in group.inputs if v.is_tensor and v.id in need for k in (tensor_index[v.id],)]

    def per_column(lines: Sequence[str]) -> list[str]:
        """``lines`` run for each of the thread's ``cvec`` columns (``v``)."""
        return ["#pragma unroll", f"for (int v = 0; v < {cvec}; ++v) {{", *["  " + ln for ln in lines], "}"]

    def store(m: int, o: ir.Value, at: str) -> str:
        return f"o{m}[{at}] = fz_st<{storage_type(node_types[position[o.id]].result)}>({vname[o.id]});"

    def vector_stores(lines: Sequence[str]) -> list[str]:
        """CUDA, whole vectors: the thread's ``cvec`` columns of a row, ``lines`` (:func:`per_column`), then each
        element-level output's vector ``ov<m>`` stored at once (16 bytes at most; the launch's pointers allow it:
        ``outer.plan``'s ``vec_align`` counts these outputs; float16 / bfloat16 ones rounded in pairs, ``ow<m>``). H200,
        gelu(x + b)'s bfloat16 backward over [16384, 4096], 8 columns a thread: 121 us so, 198 us with 8 stores of
        2 bytes; NVVM stored those vectors in pieces (six 2-byte stores and a 4-byte one) until the thread's first
        column was written from ``b % tiles`` (outer_templates.CUDA_KERNEL)."""
        types = {m: storage_type(node_types[position[o.id]].result) for m, o in elem_out}
        # float16 / bfloat16 outputs: the columns' floats, rounded two at a time into 32-bit words (fz_pack2)
        pairs = {m for m, o in elem_out if cvec % 2 == 0 and node_types[position[o.id]].result in REDUCED}
        packs = [ln for m in sorted(pairs) for ln in (
            f"fz_vec<unsigned int, {cvec // 2}> ow{m};", "#pragma unroll", f"for (int w = 0; w < {cvec // 2}; ++w) "
            f"ow{m}.v[w] = fz_pack2<{types[m]}>(of{m}[2 * w], of{m}[2 * w + 1]);",
            f"*reinterpret_cast<fz_vec<unsigned int, {cvec // 2}>*>(o{m} + r * cols + c) = ow{m};")]
        return ([f"float of{m}[{cvec}];" if m in pairs else f"fz_vec<{types[m]}, {cvec}> ov{m};" for m, _ in elem_out]
                + per_column([*lines, *[f"of{m}[v] = (float)({vname[o.id]});" if m in pairs else
                                        f"ov{m}.v[v] = fz_st<{types[m]}>({vname[o.id]});" for m, o in elem_out]])
                + packs + [f"*reinterpret_cast<fz_vec<{types[m]}, {cvec}>*>(o{m} + r * cols + c) = ov{m};"
                           for m, _ in elem_out if m not in pairs])

    # the pass: per element of the column (CUDA, cvec > 1: a row's loads of the thread's columns, then per column)
    wide = cuda and cvec > 1
    wanted = [n.args[0] for n, *_ in reductions] + [o for _, o in elem_out]
    body = element_lines(wanted, " + r * rs#", loaded=wide)
    acc = (lambda pos: f"acc{pos}[v]" if wide else f"acc{pos}") if cuda else (lambda pos: f"acc{pos}[j]")
    for n, pos, red, nt, acc_t in reductions:
        u = n.args[0]
        x = vname[u.id]
        if vdtype[u.id] != nt.compute:  # eager converts the input to the reduction's dtype first
            x = (f"fz_ld(fz_st<{storage_type(nt.compute)}>(({compute_type(vdtype[u.id])}){x}))"
                 if nt.compute in REDUCED else f"({compute_type(nt.compute)})({x})")
        body.append(f"{acc(pos)} = {red.combine}::f({acc(pos)}, ({acc_t})({x}));")
    computed = list(body)
    body += [store(m, o, "r * cols + c" + (" + v" if wide else "")) for m, o in elem_out]
    heavy = len(body) > t.HEAVY_ELEMENT_LINES and max((dt.itemsize for dt in inputs), default=0) >= 4
    # (a whole-vector kernel's element by element twin, for launches whose pointers are misaligned, takes one row a
    # trip: gelu(x + b)'s bfloat16 backward so compiles in 0.3 s, not 1.1 s, with 63 registers, not 64 and a spill)
    rows = (f"FZ_COL_ROWS({1 if heavy or (wide and not vectors) else t.ROWS_UNROLLED}, "
            f"{'long long' if index64 else 'int'}) {{")
    if wide:  # whole vectors (``vectors``: the launch's pointers allow them), else element by element
        row_loops = [rows] + ["  " + x for x in [ln for y in vector_loads(wanted, vectors) for ln in y.split("\n")]
                              + (vector_stores(computed) if vectors else per_column(body))] + ["}"]
    else:
        row_loops = [rows] + ["  " + ln for ln in body] + ["}"]

    epilogue = [m for m in group.nodes if m.out.id in cols_v and m.out.id in statement]
    epilogue_operands = [v for m in epilogue for v in m.values if v.id not in cols_v]

    def finish(acc: Callable[[int], str], at: str = "c", row: str = "") -> list[str]:
        """Per column: the reductions' results, the epilogue, the column-level outputs (column ``at``; its
        element-level inputs read at offset ``row`` past the column's first)."""
        lines = []
        for n, pos, red, nt, acc_t in reductions:
            result = f"{acc(pos)} / ({acc_t})red" if red.mean else acc(pos)
            rtype = value_type(nt.result, target)
            if n.out.id in exact:  # rounded as eager stores it (stores_rounded)
                result = f"fz_ld(fz_st<{storage_type(nt.result)}>((float)({result})))"
            lines.append(f"const {rtype} v{pos} = ({rtype})({result});")
        # their element-level operands: one value a column (the plan checked), read at the column's first row
        lines += element_lines(epilogue_operands, row)
        lines += [statement[m.out.id] for m in epilogue]
        return lines + [store(m, o, at) for m, o in col_out]

    out_dtypes = [node_types[position[o.id]].result for o in group.outputs]
    ptrs, scalars = ("args.ptrs", "args.scalars") if cuda else ("ptrs", "scalars")
    params = [f"const {storage_type(dt)}* __restrict__ t{kk} = (const {storage_type(dt)}*){ptrs}[{kk}];"
              for kk, dt in enumerate(inputs)]
    params += [f"{storage_type(dt)}* __restrict__ o{m} = ({storage_type(dt)}*){ptrs}[{n_in + m}];"
               for m, dt in enumerate(out_dtypes)]
    params += [f"const double s{jj} = {scalars}[{jj}];" for jj in range(j)]
    params = ["  " + p for p in params]
    decls = ", ".join(f"off{kk} = 0" for kk in range(n_in)) if n_in else "fz_unused = 0"

    def block(lines: Sequence[str], indent: str) -> str:
        return "\n".join(indent + ln for ln in lines)

    if cuda:
        indent = "      "
        accs = [(pos, red, acc_t) for _, pos, red, _, acc_t in reductions]

        def offsets(column: str) -> str:  # column ``column``'s first element in each input
            if walk:
                return t.OFFSETS.substitute(
                    indent=indent, decls=decls, column=column, size="args.sizes[d]",
                    quotient=row_t.quotient("q0", "args.sizes[d]", index64),
                    accumulate="\n".join(f"{indent}    off{kk} += m * args.strides[{kk}][d];" for kk in range(n_in)))
            return t.OFFSETS_ONE.substitute(
                indent=indent, decls=decls, column=column,
                accumulate="\n".join(f"{indent}  off{kk} = q0 * args.strides[{kk}][0];" for kk in range(n_in)))

        return t.CUDA_KERNEL.substitute(
            name=name, prelude=cuda_t.PRELUDE,
            row_prelude=row_t.row_prelude("cuda", t.LANE_REDUCE),
            max_dims=t.MAX_DIMS, n_stride_rows=max(1, n_in), n_ptrs=n_in + len(out_dtypes) + 1,
            n_scalar_slots=max(1, n_scalar_slots), block_size=t.BLOCK_SIZE, params="\n".join(params),
            min_blocks=f", {t.VECTOR_BLOCKS_AN_SM}" if wide and vectors else "",
            ws_index=n_in + len(out_dtypes),
            shared="\n".join(f"  __shared__ {a} fz_sh_{a}[{t.BLOCK_SIZE}];" for a in sorted({a for *_, a in accs})),
            index="long long" if index64 else "unsigned int",
            offsets=offsets("live ? c : 0")
            + "\n" + block([f"const long long rs{kk} = args.strides[{kk}][{t.MAX_DIMS}];" for kk in range(n_in)],
                           indent),
            offsets1=offsets("c"),
            acc_decls=block([f"{a} acc{pos}[{cvec}];" for pos, _, a in accs] + per_column(
                [f"acc{pos}[v] = {red.identity.replace('$A', a)};" for pos, red, a in accs]) if wide else
                [f"{a} acc{pos} = {red.identity.replace('$A', a)};" for pos, red, a in accs], indent),
            acc_decls1=block([f"{a} acc{pos} = {red.identity.replace('$A', a)};" for pos, red, a in accs], indent),
            row_loops=block(row_loops, indent + "  "), cvec=cvec,
            lane_reduce=block((per_column if wide else list)(
                [f"{acc(pos)} = fz_lane_reduce<{red.combine}>({acc(pos)}, fz_sh_{a}, tile);"
                 for pos, red, a in accs]), indent),
            finish=block(per_column(finish(acc, "c + v", lambda k: " + v" if steps[k] else "")) if wide else
                         finish(acc), indent + "    "),
            finish1=block(finish(lambda pos: f"acc{pos}"), indent),
            partial=block((per_column if wide else list)(
                [f"ws[(split * {len(accs)} + {i}) * cols + c{' + v' if wide else ''}] = (double){acc(pos)};"
                 for i, (pos, _, _) in enumerate(accs)]), indent + "    "),
            combine=block([f"acc{pos} = {red.combine}::f(acc{pos}, ({a})ws[(s * {len(accs)} + {i}) * cols + c]);"
                           for i, (pos, red, a) in enumerate(accs)], indent + "  "))
    indent = "      "
    work = 1 + len(statement) + len(reductions)
    vector = _cpu_vector_pass(group, inputs, wanted, vname, vdtype, vector_args, tensor_index, order, reductions,
                              [(m, o, node_types[position[o.id]].result) for m, o in elem_out]) if vectorize else None
    if vector is not None:
        params.append(row_t.CPU_VECTOR_TYPES.substitute(vtype=vector[0]))
    return t.CPU_KERNEL.substitute(
        name=name, head=row_t.CPU_HEAD.substitute(
            prelude=cpu_t.VECTOR_INCLUDE if vector is not None else cpu_t.PRELUDE,
            row_prelude=row_t.row_prelude("cpu", ""), name=name, count="red"),
        vector=vector[1] if vector is not None else "",
        params="\n".join(params), chunk=t.CPU_CHUNK, parallel_threshold=max(1, CPU_PARALLEL_WORK // work),
        red_strides=block([f"const int64_t rs{kk} = strides[{kk} * (rank + 1) + rank];" for kk in range(n_in)], "  "),
        col_arrays=block([f"int64_t coff{kk}[{t.CPU_CHUNK}];" for kk in range(n_in)]
                         + [f"{a} acc{pos}[{t.CPU_CHUNK}];" for _, pos, _, _, a in reductions], "    "),
        offsets=t.CPU_OFFSETS.substitute(
            max_dims=t.MAX_DIMS, decls=decls,
            accumulate="\n".join(f"        off{kk} += m * strides[{kk} * (rank + 1) + d];" for kk in range(n_in))),
        linear_from="0" if needed(group, epilogue_operands, level=cols_v) & tensor_index.keys() else "jv",
        col_linear=block([f"coff{kk}[j] = off{kk} + j * strides[{kk} * (rank + 1) + rank - 1];"
                          for kk in range(n_in)], "        "),
        col_offsets=block([f"coff{kk}[j] = off{kk};" for kk in range(n_in)], "        "),
        col_init=block([f"acc{pos}[j] = {red.identity.replace('$A', a)};" for _, pos, red, _, a in reductions],
                       indent),
        step=t.CPU_STEP.substitute(
            forward="\n".join(f"          off{kk} += strides[{kk} * (rank + 1) + d];" for kk in range(n_in)),
            back="\n".join(f"          off{kk} -= sizes[d] * strides[{kk} * (rank + 1) + d];"
                            for kk in range(n_in))),
        body=block(body, indent + "  "), finish=block(finish(acc), indent))


def _cpu_vector_pass(group: ir.Group, inputs: Sequence[torch.dtype], wanted: Sequence[ir.Value], vname: dict,
                     vdtype: dict, vector_args: dict, tensor_index: dict, order: dict, reductions: list,
                     elem_out: list) -> Optional[tuple[str, str]]:
    """(vector type, the CPU kernel's vector pass: ``outer_templates.CPU_VECTOR_PASS``) for the element-level values
    ``wanted`` (the reductions' operands, the element-level outputs ``elem_out``: (index, value, dtype))
    over at::vec (the pointwise kernels' ``CpuVector`` lines: the same op forms), or None where a node has no
    vector form, the inputs mix compute types or hold bools, a reduction converts its operand, or an element-level
    output's type is not the vectors'."""
    if any(dt == torch.bool for dt in inputs):
        return None
    need = needed(group, wanted, level=column_level(group))
    cv = CpuVector([TensorDesc(dt, DENSE, False) for dt in inputs], "cpu", KernelOptions())
    for i in sorted(need & vector_args.keys(), key=order.__getitem__):
        n, op, variant, nt, consts, round_to = vector_args[i]
        cv.add(n, op, variant, nt, consts, vname, vdtype, vname[i], round_to)
    if not cv.on or cv.vtype is None:
        return None
    ctype = cv.ctype
    for n, _, _, nt, _ in reductions:
        u = n.args[0]
        if vdtype[u.id] != nt.compute or compute_type(nt.compute) != ctype or vname[u.id] in cv.masks:
            return None
    if any(compute_type(dt) != ctype or vdtype[o.id] != dt or vname[o.id] in cv.masks for _, o, dt in elem_out):
        return None
    loaded = sorted(k for i, k in tensor_index.items() if i in need)
    ind = " " * 14

    def trip(rows: int) -> list[str]:
        """A vector of columns of ``rows`` rows from r on: the loads, the ops (a copy a row), each accumulator
        read, combined with the rows in order, stored."""
        lines = [f"const fz_v x{k}_{c} = cs{k} ? fz_vload(p{k} + {c} * rs{k} + j) : fz_v(fz_ld(p{k}[{c} * rs{k}]));"
                 for c in range(rows) for k in loaded]
        lines += cv.lines(rows)
        for n, pos, red, _, _ in reductions:
            lines.append(f"fz_v a{pos} = fz_vload(vacc{pos} + j);")
            lines += [f"a{pos} = {red.combine}::f(a{pos}, {vname[n.args[0].id]}_{c});" for c in range(rows)]
            lines.append(f"fz_vstore(vacc{pos} + j, a{pos});")
        return lines + [f"fz_vstore(o{m} + (r + {c}) * cols + c0 + j, {vname[o.id]}_{c});"
                        for c in range(rows) for m, o, _ in elem_out]
    steps = []
    for k in loaded:
        steps += [f"const int64_t cs{k} = rank > 0 ? strides[{k} * (rank + 1) + rank - 1] : 0;",
                  f"vec_ok = vec_ok && (cs{k} == 0 || cs{k} == 1);"]
    source = t.CPU_VECTOR_PASS.substitute(
        rows=t.CPU_FOLD_ROWS, steps="\n".join(" " * 6 + ln for ln in steps),
        vacc_decls="\n".join(f"{' ' * 8}alignas(64) {ctype} vacc{pos}[{t.CPU_CHUNK}];" for _, pos, *_ in reductions),
        vacc_init="\n".join(f"{' ' * 12}fz_vstore(vacc{pos} + j, fz_v({red.identity.replace('$A', ctype)}));"
                            for _, pos, red, _, _ in reductions),
        row_bases="\n".join(f"{' ' * 12}const {storage_type(inputs[k])}* p{k} = t{k} + off{k} + r * rs{k};"
                            for k in loaded),
        unroll=t.CPU_UNROLL_ROWS, lines="\n".join(ind + ln for ln in trip(1)),
        lines_unrolled="\n".join(ind + ln for ln in trip(t.CPU_UNROLL_ROWS)),
        fold="\n".join(f"{' ' * 12}acc{pos}[j] = {red.combine}::f(acc{pos}[j], ({acc_t})vacc{pos}[j]);"
                       for _, pos, red, _, acc_t in reductions))
    return cv.vtype, source
