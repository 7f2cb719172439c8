"""Code generation: a pure function from (group graph, input descriptions, value types, target) to source.

No CUDA or compiler imports here, so every kernel's text can be generated and checked on any machine; the
backends (``fuser.cpu``, ``fuser.cuda``) compile what this returns.

Values are computed in their *compute* type (float for float16/bfloat16/float32, double for float64, the
integer type itself for integers and bool): half-precision intermediates never round, as in the legacy
fuser, and only stores convert back to the storage type.
"""
from __future__ import annotations

import math
import os
import re
import string
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import ops, rng
from .cpu import templates as cpu_t
from .cuda import templates as cuda_t
from .descs import DENSE, REPEAT, ROWS, SCALAR, STRIDED, STRIDED_LAYOUTS, TensorDesc, compute_type, family, storage_type

TARGETS = ("cpu", "cuda")
REDUCED = (torch.float16, torch.bfloat16)
# CPU kernels split across OpenMP threads from this much work: elements x (ops + 16 per transcendental call,
# cpu_t.EXPENSIVE_FUNCTIONS), at least CPU_PARALLEL_MIN elements. 65536 puts a*b+c at 32768 elements, eager's
# own grain; the tanh-GELU at 2520. On the 2-core EPYC with the other core idle, 2 threads won already at 1024
# elements (GELU 26.9 against 29.5 us a call, warm threads); with the other core busy a parallel region waits
# for a descheduled thread, and work of that size gains less than it risks. FUSER_CPU_PARALLEL_WORK sets it
# for experiments (it changes the source: cached kernels follow it).
CPU_PARALLEL_WORK = int(os.environ.get("FUSER_CPU_PARALLEL_WORK", "65536"))
CPU_PARALLEL_MIN = 2048
CPU_ROW_CHUNK = 4096  # elements of one row per task of the vector path's row loop (a multiple of every trip)
# vectors per trip of the CPU vector loops, interleaved op by op. A tanh-GELU on one core of a 2-core EPYC
# (float32 and bfloat16, 2048x4096): 1 vector 32.4/37.5 ms, 2 vectors 29.9/32.8 ms, 4 vectors 28.0/30.5 ms.
CPU_VECTORS_PER_TRIP = int(os.environ.get("FUSER_CPU_VECTORS_PER_TRIP", "4"))


class NotFusable(Exception):
    """The group cannot be generated for these inputs (e.g. an integer op with no integer template); the
    executor falls back to the interpreter."""


@dataclass(frozen=True)
class NodeTypes:
    """dtype of a node's result, and the dtype its math runs in (they differ for comparisons)."""

    result: torch.dtype
    compute: torch.dtype


@dataclass(frozen=True)
class KernelOptions:
    """Target-specific knobs that change the source (and so belong in any cache key)."""

    index32: bool = True
    block_size: int = 256
    vectorize: bool = True
    fast_reduced: bool = True  # CUDA: ops.OpDef.fast expressions for float16/bfloat16 results


def literal(value, ctype: str) -> str:
    """``value`` (a Python bool/int/float constant) as a C expression of type ``ctype``."""
    if isinstance(value, bool):
        return f"(({ctype}){'true' if value else 'false'})"
    if isinstance(value, int):
        return f"(({ctype}){value}LL)" if -(2 ** 63) < value < 2 ** 63 else f"(({ctype}){float(value)!r})"
    suffix = "D" if ctype == "double" else "F"
    if math.isnan(value):
        return f"(({ctype})FZ_NAN_{suffix})"
    if math.isinf(value):
        return f"(({ctype})({'-' if value < 0 else ''}FZ_INF_{suffix}))"
    return f"(({ctype}){value!r})"


# CUDA holds integers narrower than 32 bits in int; each op's result still wraps to its dtype (a cast through it).
# With int8 values in int8 variables NVRTC (CUDA 13, sm_90) packed min/max into 16-bit SIMD and miscompiled
# clamp_min(clamp_max(x, -x), -1) on the vector path: x itself in some bytes (H100; issue 9's fuzz campaign).
_NARROW_INTS = (torch.int8, torch.uint8, torch.int16)


def value_type(dtype: torch.dtype, target: str) -> str:
    """C type a kernel holds values of ``dtype`` in: the compute type, or int for narrow integers on CUDA."""
    return "int" if target == "cuda" and dtype in _NARROW_INTS else compute_type(dtype)


def _converted(dtype: torch.dtype, target: str, expr: str) -> str:
    """``expr`` (an operand, or an op's result) converted to ``dtype`` as eager converts it (an int32 -3 is 253 in
    uint8), held in :func:`value_type`; a float16/bfloat16 value is held in float unrounded, as in the legacy fuser
    (a float Scalar of a float16 op is unrounded in eager too; see the README's known limitations)."""
    t = value_type(dtype, target)
    return f"({t})({storage_type(dtype)})({expr})" if t != compute_type(dtype) else f"({t})({expr})"


def _as_held(lit: str, ctype: str) -> str:
    return lit if lit.startswith(f"(({ctype})") else f"(({ctype}){lit})"


def typed_nodes(graph: torch._C.Graph) -> list[torch._C.Node]:
    """The nodes that have a result dtype (``compiler.infer_types`` gives one per node, in this order): all
    but constants and the lists a cat reads."""
    return [n for n in graph.nodes() if n.kind() not in ("prim::Constant", "prim::ListConstruct")]


def has_vector_path(inputs: Sequence[TensorDesc], target: str, out_layouts: Sequence[str] = ()) -> bool:
    """Whether a kernel gets the 16-byte vector loop: CUDA, every input dense, a broadcast scalar, or
    strided with a contiguous or repeated innermost dim, and every output dense."""
    return (target == "cuda" and all(d.layout != STRIDED for d in inputs)
            and all(lay == DENSE for lay in out_layouts))


def strided_operands(inputs: Sequence[TensorDesc], out_layouts: Sequence[str] = ()) -> int:
    """Operands whose strides are kernel arguments: the strided inputs, then the strided outputs (a cat's
    slices), in that order. Rows of the CUDA kernels' ``FzArgs.strides`` (and its ctypes mirror in
    ``fuser.cuda.launch``) and of the CPU kernels' strides array."""
    return sum(d.layout in STRIDED_LAYOUTS for d in inputs) + sum(lay in STRIDED_LAYOUTS for lay in out_layouts)


# per thread and loop trip, of the narrowest tensor (FUSER_VECTOR_BYTES sets it for experiments; it changes
# the source, so cached kernels follow it). On an H200, 16 beat 32 on a*b+c and fp32 rows, lost on fp16 GELU.
VECTOR_BYTES = int(os.environ.get("FUSER_VECTOR_BYTES", "16"))


def vector_width(inputs: Sequence[TensorDesc], out_dtypes: Sequence[torch.dtype]) -> int:
    """Elements per thread and trip on the CUDA vector path: ``VECTOR_BYTES`` of the narrowest vector-accessed
    tensor (16: one 16-byte access each), at most 16."""
    sizes = [torch.empty((), dtype=d.dtype).element_size() for d in inputs if d.layout in (DENSE, ROWS)]
    sizes += [torch.empty((), dtype=d).element_size() for d in out_dtypes]
    # ... and at most 32 bytes of the widest, so a float tensor beside a bool one keeps to 8 registers
    return max(1, min(16, VECTOR_BYTES // min(sizes), 32 // max(sizes))) if sizes else 1


def generate(graph: torch._C.Graph, inputs: Sequence[TensorDesc], n_scalars: int,
             node_types: Sequence[NodeTypes], target: str, name: str,
             options: KernelOptions = KernelOptions(), out_layouts: Sequence[str] = ()) -> str:
    """Source of one kernel.

    graph: the group's subgraph; its tensor inputs and its ``n_scalars`` float inputs in any order.
    inputs: one description per tensor input. node_types: one entry per :func:`typed_nodes` node, in order.
    target: ``"cpu"`` or ``"cuda"``. out_layouts: per kernel output (a cat's result is one output per piece),
    its layout class; empty: all dense.
    """
    if target not in TARGETS:
        raise ValueError(f"Unsupported target={target!r} (supported: {', '.join(TARGETS)})")
    g_inputs = list(graph.inputs())
    if len(g_inputs) != len(inputs) + n_scalars:
        raise ValueError(f"graph has {len(g_inputs)} inputs, descriptions give {len(inputs)} tensors "
                         f"and {n_scalars} scalars")
    nodes = typed_nodes(graph)
    if len(nodes) != len(node_types):
        raise ValueError(f"{len(nodes)} nodes but {len(node_types)} node types")

    # every value: C name and C compute type
    vname: dict[int, str] = {}
    vtype: dict[int, str] = {}
    vdtype: dict[int, Optional[torch.dtype]] = {}  # None: a float argument
    k = j = 0  # tensors and float arguments may interleave: each kind is numbered in its own order
    for v in g_inputs:
        if isinstance(v.type(), torch._C.TensorType) and k < len(inputs):
            d = inputs[k]
            vname[v.unique()], vtype[v.unique()], vdtype[v.unique()] = f"x{k}", value_type(d.dtype, target), d.dtype
            k += 1
        else:
            vname[v.unique()], vtype[v.unique()], vdtype[v.unique()] = f"s{j}", "double", None
            j += 1
    if (k, j) != (len(inputs), n_scalars):
        raise ValueError(f"graph has {k} tensor and {j} float inputs, descriptions give {len(inputs)} tensors "
                         f"and {n_scalars} scalars")

    body: list[str] = []
    n_random = 0
    vector = _CpuVector(inputs, target, options)
    for j, (node, nt) in enumerate(zip(nodes, node_types)):
        op = ops.lookup(node.schema())
        if op is None:
            raise NotFusable(f"no op-table entry for {node.schema()}")
        if op.concat:  # nothing to compute: its pieces are stored into its slices
            continue
        ctype = value_type(nt.compute, target)
        consts = {}
        variant = None
        if op.variant_arg is not None:
            variant = node.inputsAt(op.variant_arg).toIValue()
        tmpl = op.template(variant, family(nt.compute), target)
        if target == "cuda" and options.fast_reduced and nt.result in REDUCED and family(nt.compute) == "f":
            tmpl = op.fast_template(variant) or tmpl
        if tmpl is None:
            raise NotFusable(f"{op.name} has no {family(nt.compute)!r} expression ({nt.compute}, variant "
                             f"{variant!r})")
        rounding = target in op.round_operands and nt.compute in REDUCED  # scalars, on this target
        round_values = op.discrete and nt.compute in REDUCED  # computed operands, on every target
        if op.random:
            if nt.result != torch.float64 and nt.result not in rng.BITS:
                raise NotFusable(f"{op.name} of {nt.result}")
            if n_random >= rng.MAX_RANDOM_OPS:
                raise NotFusable(f"more than {rng.MAX_RANDOM_OPS} random ops in one group")
            options_given = [k for k, v in enumerate(node.inputs()) if k >= 2 and v.toIValue() is not None]
            if options_given:  # layout, device, pin_memory, memory_format: eager's job
                raise NotFusable(f"{op.name} with tensor options {options_given}")
            consts = {"r": str(n_random), "bits": str(rng.BITS.get(nt.result, 53)), "T": compute_type(nt.compute)}
            n_random += 1
            out = node.output()
            rtype = compute_type(nt.result)
            vname[out.unique()], vtype[out.unique()], vdtype[out.unique()] = f"v{j}", rtype, nt.result
            body.append(f"const {rtype} v{j} = ({rtype})({tmpl.substitute(consts)});")
            vector.add(node, op, variant, nt, consts, vname, vdtype, f"v{j}")
            continue
        for i, v in enumerate(node.inputs()):
            if i == op.variant_arg:
                continue
            arg = ops.ARG_NAMES[i]
            if v.node().kind() == "prim::Constant":
                val = v.toIValue()
                if isinstance(val, torch.Tensor):  # a 0-dim constant (traced Python scalar)
                    val = val.item()
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
                consts["scalar_" + arg] = "true" if vdtype[v.unique()] is None else "false"
                name_, t = vname[v.unique()], vtype[v.unique()]
                # round anything not loaded straight from memory in this dtype: eager compares stored values
                dt = vdtype[v.unique()]
                if dt is None:  # a float argument: rounded where eager rounds scalars
                    round_it = rounding
                else:  # a tensor value not loaded straight from memory in this dtype
                    round_it = (round_values or rounding) and (dt != nt.compute or v.node().kind() != "prim::Param")
                if round_it:
                    consts[arg] = f"fz_ld(fz_st<{storage_type(nt.compute)}>(({ctype}){name_}))"
                elif t == ctype and dt == nt.compute or i in op.keep_args:
                    consts[arg] = name_
                else:
                    consts[arg] = _converted(nt.compute, target, name_)
                consts["n" + arg] = f"(-{consts[arg]})"
        consts["T"] = ctype
        out = node.output()
        rtype = value_type(nt.result, target)
        vname[out.unique()], vtype[out.unique()], vdtype[out.unique()] = f"v{j}", rtype, nt.result
        body.append(f"const {rtype} v{j} = {_converted(nt.result, target, tmpl.substitute(consts))};")
        vector.add(node, op, variant, nt, consts, vname, vdtype, f"v{j}")

    # kernel outputs: a cat's result is written as its pieces, each converted to the cat's dtype the way eager
    # converts it: stored in its own dtype first (a float16 piece of a float32 cat holds float16 values)
    outputs, out_dtypes = [], []
    for o in graph.outputs():
        result = node_types[_index_of(nodes, o.node())].result
        if o.node().kind() != "aten::cat":
            outputs.append(vname[o.unique()])
            out_dtypes.append(result)
            continue
        for p in o.node().inputsAt(0).node().inputs():
            v, dt = vname[p.unique()], vdtype[p.unique()]
            if dt != result:
                v = f"fz_ld(fz_st<{storage_type(dt)}>(({compute_type(dt)}){v}))"
            outputs.append(v)
            out_dtypes.append(result)
    out_layouts = tuple(out_layouts) or (DENSE,) * len(outputs)
    if len(out_layouts) != len(outputs):
        raise ValueError(f"{len(outputs)} kernel outputs but {len(out_layouts)} output layouts")
    if target == "cpu":
        return _CpuGen(name, inputs, n_scalars, outputs, out_dtypes, vname, body, options, n_random > 0,
                       out_layouts, vector=vector.finish(graph, out_dtypes, vname, vdtype)).source()
    return _CudaGen(name, inputs, n_scalars, outputs, out_dtypes, vname, body, options, n_random > 0,
                    out_layouts).source()


# compute type -> the CPU vector path's value type (fuser/cpu/templates.py VECTOR_HEADER)
VECTOR_TYPES = {"float": "fz_vf", "double": "fz_vd"}
_CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")


def vector_ready(text: str) -> bool:
    """Whether a scalar expression compiles on vectors unchanged: no conditional operator, and every call one
    that the CPU vector header overloads for vectors (``cpu_t.VECTOR_FUNCTIONS``)."""
    return "?" not in text and "@IDX@" not in text and all(
        f in cpu_t.VECTOR_FUNCTIONS for f in _CALL.findall(text))


def vector_template(op: ops.OpDef, variant: Optional[str], fam: str) -> Optional[string.Template]:
    """The op's expression on the CPU vector path: the table's vector form, else its scalar one where that
    compiles on vectors; None: the op has none (its group keeps the scalar loop)."""
    text = op.vector_text(variant)
    if text is None:
        tmpl = op.template(variant, fam, "cpu")
        text = tmpl.template if tmpl is not None and vector_ready(tmpl.template) else None
    return None if text is None else string.Template(text)


class _CpuVector:
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
        self.nodes: list[tuple[str, string.Template, dict]] = []
        self.outputs: list[tuple] = []

    def stop(self) -> None:
        self.on = False

    def add(self, node, op: ops.OpDef, variant, nt: NodeTypes, consts: dict, vname: dict, vdtype: dict,
            out: str) -> None:
        if not self.on:
            return
        if self.ctype is None:
            self.ctype, self.vtype = compute_type(nt.compute), VECTOR_TYPES.get(compute_type(nt.compute))
        ctype, vt = self.ctype, self.vtype
        tmpl = vector_template(op, variant, family(nt.compute))
        if vt is None:
            return self.stop()
        mask = nt.result == torch.bool and op.compute == "common"  # a comparison
        if tmpl is None or compute_type(nt.compute) != ctype or (compute_type(nt.result) != ctype and not mask):
            return self.stop()
        args: dict = dict(consts, T=vt)
        for i, v in enumerate(node.inputs()):
            if op.random or i == op.variant_arg or i >= len(ops.ARG_NAMES):
                continue
            arg = ops.ARG_NAMES[i]
            if v.node().kind() == "prim::Constant" or vdtype[v.unique()] is None:  # broadcast
                for key in (arg, "n" + arg):
                    if key in consts:
                        args[key] = f"{vt}({consts[key]})"
                continue
            # a value of the group, already of the compute type (rounded to it where the scalar line rounds), or
            # a mask: as it is where the op keeps the operand's type (where's condition), else as 1 or 0
            name_, st = vname[v.unique()], storage_type(nt.compute)
            forms = {name_: None, _converted(nt.compute, "cpu", name_): None,
                     f"fz_ld(fz_st<{st}>(({ctype}){name_}))": st}
            if consts.get(arg) not in forms or (name_ in self.masks and forms[consts[arg]] is not None):
                return self.stop()
            args[arg] = (name_, forms[consts[arg]], name_ in self.masks and i not in op.keep_args)
        if mask:
            self.masks.add(out)
        self.nodes.append((out, tmpl, args))

    def finish(self, graph, out_dtypes, vname: dict, vdtype: dict) -> Optional["_CpuVector"]:
        """This, with the kernel outputs set; None: no vector path."""
        if not self.on or self.vtype is None:
            return None
        # kernel outputs in the scalar loop's order; a cat piece of another dtype is stored in its own dtype first
        pieces = [p for o in graph.outputs()
                  for p in ([o] if o.node().kind() != "aten::cat" else o.node().inputsAt(0).node().inputs())]
        for p, dt in zip(pieces, out_dtypes):
            name_, is_mask = vname[p.unique()], vname[p.unique()] in self.masks
            if dt == torch.bool and is_mask:  # stored as bools
                self.outputs.append((name_, None, False))
            elif compute_type(dt) == self.ctype:
                self.outputs.append((name_, None if is_mask or vdtype[p.unique()] == dt
                                     else storage_type(vdtype[p.unique()]), is_mask))
            else:
                return None
        return self

    @staticmethod
    def value(ref: tuple, copy: int) -> str:
        name_, rounded, mask_value = ref
        v = f"{name_}_{copy}"
        return f"fz_vmask_value({v})" if mask_value else v if rounded is None else f"fz_vround<{rounded}>({v})"

    def lines(self, copies: int) -> list[str]:
        """The ops on ``copies`` vectors, interleaved op by op."""
        out = []
        for name_, tmpl, args in self.nodes:
            for c in range(copies):
                subs = {k: self.value(a, c) if isinstance(a, tuple) else a for k, a in args.items()}
                subs.update({"n" + k: f"(-{subs[k]})" for k, a in args.items() if isinstance(a, tuple)})
                index = f"(unsigned long long)(i + {c} * W)" if c else "(unsigned long long)(i)"
                out.append(f"const {self.vtype} {name_}_{c} = {tmpl.substitute(subs).replace('@IDX@', index)};")
        return out

    def output(self, m: int, copy: int) -> str:
        return self.value(self.outputs[m], copy)


def _index_of(nodes: list, node) -> int:
    for j, n in enumerate(nodes):
        if n == node:
            return j
    raise ValueError("output not produced by a node of the group")


class _Gen:
    """What both targets share: pointer declarations, strided offsets and the per-element body."""

    indent = "    "

    def __init__(self, name, inputs, n_scalars, outputs, out_dtypes, vname, body, options, random, out_layouts):
        self.name, self.inputs, self.n_scalars = name, inputs, n_scalars
        self.outputs, self.out_dtypes, self.vname = outputs, out_dtypes, vname  # outputs: C expressions
        self.body, self.options, self.random = body, options, random
        self.out_layouts = out_layouts
        # random kernels take the launch's Philox state in rng.N_STATE float slots after the float arguments
        self.n_scalar_slots = n_scalars + (rng.N_STATE if random else 0)
        self.strided = [k for k, d in enumerate(inputs) if d.layout in STRIDED_LAYOUTS]
        self.strided_out = [m for m, lay in enumerate(out_layouts) if lay in STRIDED_LAYOUTS]
        # offset variables, in the order of the strides arrays: strided inputs, then strided outputs
        self.offset_names = [f"off{k}" for k in self.strided] + [f"ooff{m}" for m in self.strided_out]
    def pointer_decls(self, ptrs: str) -> list[str]:
        lines = []
        for k, d in enumerate(self.inputs):
            s = storage_type(d.dtype)
            lines.append(f"const {s}* __restrict__ t{k} = (const {s}*){ptrs}[{k}];")
        for m, dt in enumerate(self.out_dtypes):
            s = storage_type(dt)
            lines.append(f"{s}* __restrict__ o{m} = ({s}*){ptrs}[{len(self.inputs) + m}];")
        return lines

    def hoisted(self) -> list[str]:
        return [f"const {value_type(d.dtype, self.target)} x{k} = fz_ld(t{k}[0]);"
                for k, d in enumerate(self.inputs) if d.layout == SCALAR]

    def rng_state(self, scalars: str) -> list[str]:
        if not self.random:
            return []
        words = ", ".join(f"(unsigned int){scalars}[{self.n_scalars + w}]" for w in range(rng.N_STATE))
        return [f"const unsigned int fz_rs[{rng.N_STATE}] = {{{words}}};"]

    def element_body(self, load, store, index: str = "i") -> list[str]:
        lines = []
        for k, d in enumerate(self.inputs):
            if d.layout != SCALAR:
                lines.append(f"const {value_type(d.dtype, self.target)} x{k} = fz_ld({load(k, d)});")
        lines += [ln.replace("@IDX@", f"(unsigned long long)({index})") for ln in self.body]
        for m, (o, dt) in enumerate(zip(self.outputs, self.out_dtypes)):
            lines.append(f"{store(m)} = fz_st<{storage_type(dt)}>({o});")
        return lines

    def scalar_store(self, m):
        return f"o{m}[i]" if self.out_layouts[m] == DENSE else f"o{m}[ooff{m}]"

    def scalar_load(self, k, d):
        return f"t{k}[i]" if d.layout == DENSE else f"t{k}[off{k}]"

    def offsets(self, template, stride_ref, index="i", unroll=1, names=None) -> str:
        names = self.offset_names if names is None else names
        if not names:
            return ""
        divide = ("fz_div(r, args.magic[d], args.shift[d])" if self.options.index32 else "r / args.sizes[d]")
        return template.substitute(
            index=index, unroll=unroll, divide=divide,
            decls=", ".join(f"{name} = 0" for name in names),
            accumulate="\n".join(f"          {name} += m * {stride_ref(j, name)};" for j, name in enumerate(names)),
            max_dims=cuda_t.MAX_DIMS)

    @staticmethod
    def block(lines: list[str], indent: str) -> str:
        return "\n".join(indent + ln for ln in lines)


class _CpuGen(_Gen):
    target = "cpu"

    def __init__(self, *args, vector=None):
        super().__init__(*args)
        self.vector = vector  # a finished _CpuVector, or None: scalar loops only

    def source(self) -> str:
        params = self.pointer_decls("ptrs")
        params += [f"const double s{j} = scalars[{j}];" for j in range(self.n_scalars)]
        params += self.rng_state("scalars")
        params += [f"const int64_t* st{j} = strides + {j} * rank;" for j in range(len(self.offset_names))]
        body = self.element_body(self.scalar_load, self.scalar_store)
        hoisted = self.hoisted()
        work = len(self.body) + 16 * sum(len(cpu_t.EXPENSIVE_CALL.findall(ln)) for ln in self.body)
        threshold = max(CPU_PARALLEL_MIN, CPU_PARALLEL_WORK // max(1, work))
        rows = dict(parallel_threshold=threshold,
                    bases=", ".join(f"base{j} = 0" for j in range(len(self.offset_names))),
                    accumulate="\n".join(f"        base{j} += m * st{j}[d];" for j in range(len(self.offset_names))))
        offsets = [f"const int64_t {name} = base{j} + j * st{j}[rank - 1];" for j, name in enumerate(self.offset_names)]
        if self.vector is not None:
            vtype, wide, vbody = self.vector.vtype, self.vector_body(CPU_VECTORS_PER_TRIP), self.vector_body(1)
            hoisted += [f"const fz_v xs{k} = fz_vload_mask<fz_v>(t{k}, 0);" if d.dtype == torch.bool else
                        f"const fz_v xs{k} = fz_v(x{k});" for k, d in enumerate(self.inputs) if d.layout == SCALAR]
            if self.offset_names:
                loop = cpu_t.VECTOR_LOOP_ROWS.substitute(
                    rows, chunk=CPU_ROW_CHUNK, copies=CPU_VECTORS_PER_TRIP, offsets=self.block(offsets, "      "),
                    wide=self.block(wide, "      "), vbody=self.block(vbody, "      "),
                    body=self.block(body, "      "))
            else:
                loop = cpu_t.VECTOR_LOOP_FLAT.substitute(
                    parallel_threshold=threshold, copies=CPU_VECTORS_PER_TRIP,
                    wide=self.block(wide, "    "), vbody=self.block(vbody, "    "), body=self.block(body, "    "))
            return cpu_t.VECTOR_KERNEL.substitute(
                name=self.name, include=cpu_t.VECTOR_INCLUDE, rng=cpu_t.RNG if self.random else "", vtype=vtype,
                params=self.block(params, "  "), hoisted=self.block(hoisted, "  "), loop=loop)
        if self.offset_names:
            loop = cpu_t.LOOP_ROWS.substitute(rows, offsets=self.block(offsets, "      "),
                                              body=self.block(body, "      "))
        else:
            loop = cpu_t.LOOP_FLAT.substitute(parallel_threshold=threshold,
                                              body=self.block(body, "    "))
        return cpu_t.KERNEL.substitute(
            name=self.name, prelude=cpu_t.PRELUDE + (cpu_t.RNG if self.random else ""), params=self.block(params, "  "),
            hoisted=self.block(hoisted, "  "), loop=loop)

    def vector_body(self, copies: int) -> list[str]:
        """``copies`` vectors of elements side by side: loads (converted to the compute type), the ops, stores."""
        stride = {name: f"st{j}[rank - 1]" for j, name in enumerate(self.offset_names)}
        lines = []
        for k, d in enumerate(self.inputs):
            for c in range(copies):
                step = f" + {c} * W" if c else ""
                st = stride.get(f"off{k}")
                at = {DENSE: f"t{k} + i{step}", ROWS: f"t{k} + off{k}{step}", REPEAT: f"t{k} + off{k}",
                      STRIDED: f"t{k} + off{k}{step and f'{step} * {st}'}", SCALAR: f"t{k}"}[d.layout]
                if d.layout == SCALAR:
                    load = f"xs{k}"
                elif d.dtype == torch.bool:  # a mask
                    load = f"fz_vload_mask<fz_v>({at}, { {DENSE: 1, ROWS: 1, REPEAT: 0}.get(d.layout, st)})"
                else:
                    load = {DENSE: f"fz_vload({at})", ROWS: f"fz_vload({at})", REPEAT: f"fz_v(fz_ld(t{k}[off{k}]))",
                            STRIDED: f"fz_vgather({at}, {st})"}[d.layout]
                lines.append(f"const fz_v x{k}_{c} = {load};")
        lines += self.vector.lines(copies)
        for m, lay in enumerate(self.out_layouts):
            for c in range(copies):
                step, o, st = f" + {c} * W" if c else "", self.vector.output(m, c), stride.get(f"ooff{m}")
                at = {DENSE: f"o{m} + i{step}", ROWS: f"o{m} + ooff{m}{step}",
                      STRIDED: f"o{m} + ooff{m}{step and f'{step} * {st}'}"}[lay]
                if self.out_dtypes[m] == torch.bool:  # a mask
                    lines.append(f"fz_vstore_mask({at}, {1 if lay != STRIDED else st}, {o});")
                else:
                    lines.append(f"fz_vstore({at}, {o});" if lay != STRIDED else f"fz_vscatter({at}, {st}, {o});")
        return lines


class _CudaGen(_Gen):
    target = "cuda"

    def source(self) -> str:
        params = self.pointer_decls("args.ptrs")
        params += [f"const double s{j} = args.scalars[{j}];" for j in range(self.n_scalars)]
        params += self.rng_state("args.scalars")
        body = self.element_body(self.scalar_load, self.scalar_store)
        return cuda_t.KERNEL.substitute(
            name=self.name, prelude=cuda_t.PRELUDE + (cuda_t.RNG if self.random else ""),
            index_t="int" if self.options.index32 else "long long",
            max_dims=cuda_t.MAX_DIMS, n_strided_slots=max(1, len(self.offset_names)),
            n_ptrs=len(self.inputs) + len(self.outputs), n_scalar_slots=max(1, self.n_scalar_slots),
            block_size=self.options.block_size,
            params=self.block(params, "  "), hoisted=self.block(self.hoisted(), "  "),
            vector_loop=self.vector_loop(),
            offsets=self.offsets(cuda_t.OFFSETS, lambda j, name: f"args.strides[{j}][d]"),
            body=self.block(body, "    "))

    def vector_loop(self) -> str:
        if not self.options.vectorize or not has_vector_path(self.inputs, "cuda", self.out_layouts):
            return ""
        vec = vector_width(self.inputs, self.out_dtypes)
        if vec == 1:
            return ""
        vloads = []
        if self.strided:
            vloads.append(self.offsets(cuda_t.OFFSETS, lambda j, name: f"args.strides[{j}][d]", index="base",
                                       unroll=cuda_t.MAX_DIMS))
        for k, d in enumerate(self.inputs):
            st = storage_type(d.dtype)
            if d.layout in (DENSE, ROWS):
                where = "base" if d.layout == DENSE else f"off{k}"
                vloads.append(f"const fz_vec<{st}, {vec}> xv{k} = "
                              f"*reinterpret_cast<const fz_vec<{st}, {vec}>*>(t{k} + {where});")
            elif d.layout == REPEAT:
                vloads.append(f"const {value_type(d.dtype, self.target)} xr{k} = fz_ld(t{k}[off{k}]);")
        vdecls = [f"fz_vec<{storage_type(dt)}, {vec}> ov{m};" for m, dt in enumerate(self.out_dtypes)]
        vstores = [f"*reinterpret_cast<fz_vec<{storage_type(dt)}, {vec}>*>(o{m} + base) = ov{m};"
                   for m, dt in enumerate(self.out_dtypes)]
        vbody = self.element_body(lambda k, d: f"xr{k}" if d.layout == REPEAT else f"xv{k}.v[k]",
                                  lambda m: f"ov{m}.v[k]", index="base + k")
        return cuda_t.VECTOR_LOOP.substitute(
            vec=vec, vloads=self.block(vloads, "      "), vdecls=self.block(vdecls, "      "),
            vbody=self.block(vbody, "        "), vstores=self.block(vstores, "      "))
