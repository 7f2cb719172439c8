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
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import ops, rng
from .cpu import templates as cpu_t
from .cuda import templates as cuda_t
from .descs import DENSE, REPEAT, ROWS, SCALAR, STRIDED, STRIDED_LAYOUTS, TensorDesc, compute_type, family, storage_type

TARGETS = ("cpu", "cuda")
REDUCED = (torch.float16, torch.bfloat16)
CPU_PARALLEL_THRESHOLD = 32768  # elements; below it OpenMP's start-up costs more than it saves


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
    gen = _CpuGen if target == "cpu" else _CudaGen
    return gen(name, inputs, n_scalars, outputs, out_dtypes, vname, body, options, n_random > 0,
               out_layouts).source()


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

    def source(self) -> str:
        params = self.pointer_decls("ptrs")
        params += [f"const double s{j} = scalars[{j}];" for j in range(self.n_scalars)]
        params += self.rng_state("scalars")
        params += [f"const int64_t* st{j} = strides + {j} * rank;" for j in range(len(self.offset_names))]
        body = self.element_body(self.scalar_load, self.scalar_store)
        if self.offset_names:
            loop = cpu_t.LOOP_ROWS.substitute(
                parallel_threshold=CPU_PARALLEL_THRESHOLD,
                bases=", ".join(f"base{j} = 0" for j in range(len(self.offset_names))),
                accumulate="\n".join(f"        base{j} += m * st{j}[d];" for j in range(len(self.offset_names))),
                offsets="\n".join(f"      const int64_t {name} = base{j} + j * st{j}[rank - 1];"
                                  for j, name in enumerate(self.offset_names)),
                body=self.block(body, "      "))
        else:
            loop = cpu_t.LOOP_FLAT.substitute(parallel_threshold=CPU_PARALLEL_THRESHOLD,
                                              body=self.block(body, "    "))
        return cpu_t.KERNEL.substitute(
            name=self.name, prelude=cpu_t.PRELUDE + (cpu_t.RNG if self.random else ""), params=self.block(params, "  "),
            hoisted=self.block(self.hoisted(), "  "), loop=loop)


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
