"""The kernel text around the body: pointer declarations, strided offsets, the CPU loops (scalar and vector,
OpenMP across rows) and the CUDA grid-stride loops (16-byte vector and scalar paths, 32- and 64-bit index
math), from the templates in ``fuser/cpu/templates.py`` and ``fuser/cuda/templates.py``."""
from __future__ import annotations

import torch

from .. import rng
from ..cpu import templates as cpu_t
from ..cuda import templates as cuda_t
from ..descs import DENSE, REPEAT, ROWS, SCALAR, STRIDED, STRIDED_LAYOUTS, storage_type
from .common import (CPU_PARALLEL_MIN, CPU_PARALLEL_WORK, CPU_ROW_CHUNK, CPU_TILE_CHUNK, CPU_TILE_ROWS,
                     CPU_VECTORS_PER_TRIP, POINTWISE_HEAVY_THREADS, POINTWISE_MAX_VECTORS, POINTWISE_THREADS,
                     TILE_SCALAR, TILE_VEC_THREADS, has_tiled_path, has_vector_path, tile_shape, tile_vec_width,
                     tiled_vector, value_type, vector_width)


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

    def element_body(self, load, store, index: str = "i", body=None, raw=frozenset()) -> list[str]:
        """An element's loads, ``body`` (the kernel's, by default) with its index, and stores (``raw``: the outputs
        stored as the element's float, rounded later)."""
        lines = []
        for k, d in enumerate(self.inputs):
            if d.layout != SCALAR:
                lines.append(f"const {value_type(d.dtype, self.target)} x{k} = fz_ld({load(k, d)});")
        lines += [ln.replace("@IDX@", f"(unsigned long long)({index})") for ln in (self.body if body is None else body)]
        for m, (o, dt) in enumerate(zip(self.outputs, self.out_dtypes)):
            lines.append(f"{store(m)} = (float)({o});" if m in raw else f"{store(m)} = fz_st<{storage_type(dt)}>({o});")
        return lines

    def scalar_store(self, m):
        return f"o{m}[i]" if self.out_layouts[m] == DENSE else f"o{m}[ooff{m}]"

    def scalar_load(self, k, d):
        return f"t{k}[i]" if d.layout == DENSE else f"t{k}[off{k}]"

    def offsets(self, template, stride_ref, index="i", unroll=1, names=None, two_dims=False) -> str:
        """The offsets ``names`` of the strided inputs at element ``index`` (``template``: the walk over the dims,
        each stride ``stride_ref(j, name, dim)``, ``dim`` the kernel's expression of the dim); ``two_dims``: before the walk, the case of a map of
        two dims (``cuda_t.OFFSETS_2D``)."""
        names = self.offset_names if names is None else names
        if not names:
            return ""
        fast = ""
        if two_dims:
            fast = cuda_t.OFFSETS_2D.substitute(index=index, divide=self.divide_by_size("1"), accumulate="\n".join(
                f"      {name} = m * {stride_ref(j, name, '1')} + q * {stride_ref(j, name, '0')};"
                for j, name in enumerate(names)))
        return template.substitute(
            index=index, unroll=unroll, divide=self.divide_by_size(), fast=fast,
            decls=", ".join(f"{name} = 0" for name in names),
            accumulate="\n".join(f"          {name} += m * {stride_ref(j, name, 'd')};" for j, name in enumerate(names)),
            max_dims=cuda_t.MAX_DIMS)

    def divide_by_size(self, d: str = "d") -> str:
        """``r / args.sizes[d]`` in the kernel: by the launcher's magic numbers where the index is 32 bits."""
        return f"fz_div(r, args.magic[{d}], args.shift[{d}])" if self.options.index32 else f"r / args.sizes[{d}]"

    @staticmethod
    def block(lines: list[str], indent: str) -> str:
        return "\n".join(indent + ln for ln in lines)


class CpuGen(_Gen):
    target = "cpu"

    def __init__(self, *args, vector=None):
        super().__init__(*args)
        self.vector = vector  # a finished CpuVector, or None: scalar loops only

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
            partial = any(cpu_t.EXPENSIVE_CALL.search(ln) for ln in self.body)
            nbody = self.vector_body(1, True) if partial else None
            flat_tail = (cpu_t.FLAT_TAIL_PARTIAL.substitute(nbody=self.block(nbody, "    "))
                         if partial else cpu_t.FLAT_TAIL.substitute(body=self.block(body, "    ")))
            tail = (cpu_t.ROW_TAIL_PARTIAL.substitute(offsets=self.block(offsets, "      "),
                                                      nbody=self.block(nbody, "      "))
                    if partial else cpu_t.ROW_TAIL.substitute(offsets=self.block(offsets, "      "),
                                                              body=self.block(body, "      ")))
            hoisted += [f"const fz_v xs{k} = fz_vload_mask<fz_v>(t{k}, 0);" if d.dtype == torch.bool else
                        f"const fz_v xs{k} = fz_v(x{k});" for k, d in enumerate(self.inputs) if d.layout == SCALAR]
            gathered = any(d.layout == STRIDED for d in self.inputs) or STRIDED in self.out_layouts
            if self.offset_names and gathered:
                loop = cpu_t.VECTOR_LOOP_TILES.substitute(
                    rows, chunk=CPU_TILE_CHUNK, tile_rows=CPU_TILE_ROWS, copies=CPU_VECTORS_PER_TRIP,
                    offsets=self.block(offsets, "      "), wide=self.block(wide, "      "),
                    vbody=self.block(vbody, "      "), tail=tail, jstart="row < rdone ? jrem : j0",
                    **self.transpose_blocks(rows))
            elif self.offset_names:
                loop = cpu_t.VECTOR_LOOP_ROWS.substitute(
                    rows, chunk=CPU_ROW_CHUNK, copies=CPU_VECTORS_PER_TRIP, offsets=self.block(offsets, "      "),
                    wide=self.block(wide, "      "), vbody=self.block(vbody, "      "), tail=tail, jstart="j0")
            else:
                loop = cpu_t.VECTOR_LOOP_FLAT.substitute(
                    parallel_threshold=threshold, copies=CPU_VECTORS_PER_TRIP,
                    wide=self.block(wide, "    "), vbody=self.block(vbody, "    "), tail=flat_tail)
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

    def transpose_blocks(self, rows: dict) -> dict:
        """``cpu_t.VECTOR_LOOP_TILES``' block form (``cpu_t.TRANSPOSE_BLOCKS``), its ``block_setup`` and
        ``blocks``: where every gathered operand is an input of values (no mask; no output scattered), and the
        option is on. Each such input's W x W block is transposed (``fz_transpose``) into a local buffer; at run
        time the form needs rank 2 or more and those inputs stepping by 1 along the rows."""
        staged = [k for k, d in enumerate(self.inputs) if d.layout == STRIDED]
        if (not self.options.transpose_blocks or not staged or STRIDED in self.out_layouts
                or any(self.inputs[k].dtype == torch.bool for k in staged)):
            return dict(block_setup="", blocks="")
        row = {name: j for j, name in enumerate(self.offset_names)}
        unit = " && ".join(f"st{row[f'off{k}']}[rank - 2] == 1" for k in staged)
        transposes = []
        for k in staged:
            j = row[f"off{k}"]
            transposes += [f"{self.vector.ctype} fz_tb{k}[fz_v::size() * fz_v::size()];",
                           f"fz_transpose(t{k} + base{j} + jb * st{j}[rank - 1], st{j}[rank - 1], fz_tb{k});"]
        offsets = [f"const int64_t {name} = base{j} + mb * st{j}[rank - 2] + jb * st{j}[rank - 1];"
                   for name, j in row.items()]
        blocks = cpu_t.TRANSPOSE_BLOCKS.substitute(
            rows, copies=CPU_VECTORS_PER_TRIP, transposes=self.block(transposes, "          "),
            offsets=self.block(offsets, "            "),
            body=self.block(self.vector_body(CPU_VECTORS_PER_TRIP, block=True), "            "))
        return dict(block_setup=f"  const bool fz_blocks = rank >= 2 && {unit};", blocks=blocks)

    def vector_body(self, copies: int, partial: bool = False, block: bool = False) -> list[str]:
        """``copies`` vectors of elements side by side: loads (converted to the compute type), the ops, stores;
        ``partial``: one vector of the first ``n`` elements only (a tail), its other lanes 0 and not stored;
        ``block``: in a block of ``cpu_t.TRANSPOSE_BLOCKS``, copy c in the c-th row after row ``mb`` of the block,
        the gathered inputs read from their transposed blocks."""
        stride = {name: f"st{j}[rank - 1]" for j, name in enumerate(self.offset_names)}
        down = {name: f"st{j}[rank - 2]" for j, name in enumerate(self.offset_names)}  # to the next row

        def steps(c: int, off: str, layout: str) -> tuple[str, str]:
            """Copy c's steps from copy 0: in the map's order, and from offset ``off`` of an operand of ``layout``
            (along a row: W elements for rows, which step by 1, W strides for a strided operand)."""
            if not c:
                return "", ""
            if block:
                return f" + {c} * inner", f" + {c} * {down[off]}" if off else ""
            return f" + {c} * W", f" + {c} * W" + (f" * {stride[off]}" if layout == STRIDED else "")

        lines = []
        for k, d in enumerate(self.inputs):
            for c in range(copies):
                step, ostep = steps(c, f"off{k}" if f"off{k}" in stride else "", d.layout)
                st = stride.get(f"off{k}")
                repeat_step = ostep if block else ""  # (a value repeated along the row: the next row's in a block)
                at = {DENSE: f"t{k} + i{step}", ROWS: f"t{k} + off{k}{ostep}", REPEAT: f"t{k} + off{k}{repeat_step}",
                      STRIDED: f"t{k} + off{k}{ostep}", SCALAR: f"t{k}"}[d.layout]
                step_k = {DENSE: 1, ROWS: 1, REPEAT: 0}.get(d.layout, st)
                if d.layout == SCALAR:
                    load = f"xs{k}"
                elif d.dtype == torch.bool:  # a mask
                    load = (f"fz_vload_mask_n<fz_v>({at}, {step_k}, n)" if partial else
                            f"fz_vload_mask<fz_v>({at}, {step_k})")
                elif partial and d.layout != REPEAT:
                    load = f"fz_vgather_n({at}, {step_k}, n)"
                elif block and d.layout == STRIDED:
                    load = f"fz_vload(fz_tb{k} + (mb + {c}) * W)"
                else:
                    load = {DENSE: f"fz_vload({at})", ROWS: f"fz_vload({at})", REPEAT: f"fz_v(fz_ld(*({at})))",
                            STRIDED: f"fz_vgather({at}, {st})"}[d.layout]
                lines.append(f"const fz_v x{k}_{c} = {load};")
        lines += self.vector.lines(copies, "inner" if block else "W")
        for m, lay in enumerate(self.out_layouts):
            for c in range(copies):
                o, st = self.vector.output(m, c), stride.get(f"ooff{m}")
                step, ostep = steps(c, f"ooff{m}" if f"ooff{m}" in stride else "", lay)
                at = {DENSE: f"o{m} + i{step}", ROWS: f"o{m} + ooff{m}{ostep}",
                      STRIDED: f"o{m} + ooff{m}{ostep}"}[lay]
                if self.out_dtypes[m] == torch.bool:  # a mask
                    lines.append(f"fz_vstore_mask_n({at}, {1 if lay != STRIDED else st}, {o}, n);" if partial else
                                 f"fz_vstore_mask({at}, {1 if lay != STRIDED else st}, {o});")
                elif partial:
                    lines.append(f"fz_vscatter_n({at}, {1 if lay != STRIDED else st}, {o}, n);")
                else:
                    lines.append(f"fz_vstore({at}, {o});" if lay != STRIDED else f"fz_vscatter({at}, {st}, {o});")
        return lines


class CudaGen(_Gen):
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
            block_size=self.options.block_size, min_blocks=self.min_blocks(),
            params=self.block(params, "  "), hoisted=self.block(self.hoisted(), "  "),
            tiled_loop=self.tiled_loop(), vector_loop=self.vector_loop(),
            offsets=self.offsets(cuda_t.OFFSETS, lambda j, name, dim: f"args.strides[{j}][{dim}]"),
            body=self.block(body, "    "))

    def min_blocks(self) -> str:
        """``__launch_bounds__``' minimum blocks an SM (with its comma), or "": for kernels with the tiled path's
        vector form over 2-byte staged inputs, ``common.TILE_VEC_THREADS`` threads; for other kernels whose vector
        path holds 8 elements a thread (2-byte tensors), ``common.POINTWISE_THREADS``, or
        ``common.POINTWISE_HEAVY_THREADS`` where more than ``common.POINTWISE_MAX_VECTORS`` tensors move in vectors."""
        if has_tiled_path(self.inputs, "cuda", self.out_layouts) and tiled_vector(self.inputs, self.options):
            # (4-byte staged inputs: no bound; at 40 registers ptxas spilled an erf and a tanh over float32 beside a
            # bool mask, 48 without the bound)
            blocks = TILE_VEC_THREADS // self.options.block_size if tile_vec_width(self.inputs) == 8 else 0
        elif (self.options.vectorize and has_vector_path(self.inputs, "cuda", self.out_layouts)
              and vector_width(self.inputs, self.out_dtypes) >= 8):
            vectors = sum(d.layout in (DENSE, ROWS) for d in self.inputs) + len(self.out_dtypes)
            threads = POINTWISE_THREADS if vectors <= POINTWISE_MAX_VECTORS else POINTWISE_HEAVY_THREADS
            blocks = threads // self.options.block_size
        else:
            blocks = 0
        return f", {blocks}" if blocks > 0 else ""

    def tiled_loop(self) -> str:
        """The transposing path (``cuda_t.TILED_LOOP``): every generically strided input staged through a
        shared-memory tile; the other operands read where they are. Its scalar form, and before it the vector form
        where ``common.tiled_vector`` says so (it runs where the operands allow whole vectors)."""
        if not has_tiled_path(self.inputs, "cuda", self.out_layouts):
            return ""
        row = {name: j for j, name in enumerate(self.offset_names)}  # strides row of each offset
        staged = [k for k, d in enumerate(self.inputs) if d.layout == STRIDED]
        loop = self._tiled_skeleton("args.tile_dim >= 0", TILE_SCALAR, row, *self._tiled_scalar(row, staged))
        if not tiled_vector(self.inputs, self.options):
            return loop
        ready, *form = self._tiled_vector(row, staged)
        return ready + self._tiled_skeleton("fz_vec_tiles", tile_shape(self.inputs, self.options), row, *form) + loop

    def _tiled_skeleton(self, condition: str, tile: tuple, row: dict, setup: str, tiles: list, trip: str) -> str:
        """``cuda_t.TILED_LOOP`` around one form's constants, shared tiles and tile work."""
        if self.options.index32:  # the tile counts' dividers once per thread, the sizes' from the launcher
            dividers = ("    unsigned int ma, sha, mb, shb;\n"
                        "    fz_divider((unsigned int)ta, ma, sha);\n    fz_divider((unsigned int)tb, mb, shb);\n")
            div = {"div_ta": "fz_div(r, ma, sha)", "div_tb": "fz_div(r, mb, shb)"}
        else:
            dividers, div = "", {"div_ta": "r / ta", "div_tb": "r / tb"}
        return cuda_t.TILED_LOOP.substitute(
            condition=condition, dividers=dividers, div_d=self.divide_by_size(), **div, tile_a=tile[0], tile_b=tile[1],
            setup=setup, tiles=self.block(tiles, "    "), trip=trip,
            bases=", ".join(f"base{j} = 0" for j in row.values()),
            accumulate="\n".join(f"            base{j} += m * args.strides[{j}][d];" for j in row.values()),
            corner="\n".join(f"        base{j} += b0 * args.strides[{j}][bd] + a0 * args.strides[{j}][ad];"
                             for j in row.values()))

    def _tiled_scalar(self, row: dict, staged: list) -> tuple[str, list[str], str]:
        """The scalar form's constants, shared tiles and tile work (``cuda_t.TILED_TRIP``)."""
        tiles = [f"__shared__ {value_type(self.inputs[k].dtype, self.target)} fz_tile{k}[tile_a][33];"
                 for k in staged]
        stage = [cuda_t.TILE_STAGE.substitute(tile=f"fz_tile{k}", k=k, base=f"base{row[f'off{k}']}", j=row[f"off{k}"])
                 for k in staged] + ["__syncthreads();"]
        offsets = [f"const fz_index {name} = base{j} + e * args.strides[{j}][bd] + al * args.strides[{j}][ad];"
                   for name, j in row.items() if name not in {f"off{k}" for k in staged}]
        held = [k for k, d in enumerate(self.inputs) if d.layout not in (STRIDED, SCALAR)]
        pre_decls = [f"{value_type(self.inputs[k].dtype, self.target)} fz_pre{k}[(tile_b / rows) * (tile_a / 32)];"
                     for k in held]
        preload = [f"fz_pre{k}[q] = fz_ld({self.scalar_load(k, self.inputs[k])});" for k in held]
        body = self.element_body(lambda k, d: f"fz_tile{k}[al][e]" if d.layout == STRIDED else f"fz_pre{k}[q]",
                                 self.scalar_store)
        setup = cuda_t.TILED_SETUP.substitute(rows=self.options.block_size // 32)
        trip = cuda_t.TILED_TRIP.substitute(
            stage="\n".join(ln if ln.startswith("      for") or ln.startswith(" ") else "      " + ln
                            for ln in stage),
            pre_decls=self.block(pre_decls, "      "), preload=self.block(preload, "            "),
            offsets=self.block(offsets, "            "), body=self.block(body, "            "))
        return setup, tiles, trip

    def _tiled_vector(self, row: dict, staged: list) -> tuple[str, str, list[str], str]:
        """The vector form's condition (``cuda_t.TILED_READY_VEC``), constants, shared tiles and tile work
        (``cuda_t.TILED_TRIP_VEC``)."""
        vw, block = tile_vec_width(self.inputs), self.options.block_size
        tile_a, tile_b = tile_shape(self.inputs, self.options)
        if tile_a * tile_b % (vw * block):
            raise ValueError(f"a {tile_a} x {tile_b} tile is no whole number of {vw}-element vectors per thread of a "
                             f"{block}-thread block")

        def aligned(ptr: str, dtype) -> str:  # the pointer a multiple of its vector's alignment (fz_vec's)
            return f"fz_aligned({ptr}, {min(16, vw * torch.empty((), dtype=dtype).element_size())})"

        checks, preload, pre_decls = [], [], []
        for k in staged:
            checks.append(f"fz_vec_strides(args.strides[{row[f'off{k}']}], args.rank, bd, {vw}) && "
                          f"{aligned(f't{k}', self.inputs[k].dtype)}")
        for k, d in enumerate(self.inputs):
            if d.layout in (STRIDED, SCALAR):
                continue
            s = storage_type(d.dtype)
            if d.layout == REPEAT:  # one element along a
                j = row[f"off{k}"]
                pre_decls.append(f"{s} dr{k}[per];")
                preload.append(f"dr{k}[it] = t{k}[base{j} + e * args.strides[{j}][bd]];")
                continue
            at = "i"
            if d.layout == ROWS:
                j = row[f"off{k}"]
                at = f"base{j} + e * args.strides[{j}][bd] + c * vw"
                checks.append(f"fz_vec_strides(args.strides[{j}], args.rank, ad, {vw}) && {aligned(f't{k}', d.dtype)}")
            else:
                checks.append(aligned(f"t{k}", d.dtype))
            pre_decls.append(f"fz_vec<{s}, vw> dv{k}[per];")
            preload.append(f"dv{k}[it] = *reinterpret_cast<const fz_vec<{s}, vw>*>(t{k} + {at});")
        checks += [aligned(f"o{m}", dt) for m, dt in enumerate(self.out_dtypes)]
        ready = cuda_t.TILED_READY_VEC.substitute(vw=vw, checks="".join(f" &&\n        {c}" for c in checks))
        tiles = [f"__shared__ __align__(16) {storage_type(self.inputs[k].dtype)} fz_tile{k}[tile_b * tile_a];"
                 for k in staged]
        subs = [dict(k=k, j=row[f"off{k}"], s=storage_type(self.inputs[k].dtype), block_size=block) for k in staged]
        tile_reads = [f"const fz_vec<{s['s']}, vw> tv{s['k']} = *reinterpret_cast<const fz_vec<{s['s']}, vw>*>("
                      f"fz_tile{s['k']} + e * tile_a + (c ^ (e / vw)) * vw);" for s in subs]
        out_decls = [f"fz_vec<{storage_type(dt)}, vw> ov{m};" for m, dt in enumerate(self.out_dtypes)]
        stores = [f"*reinterpret_cast<fz_vec<{storage_type(dt)}, vw>*>(o{m} + i) = ov{m};"
                  for m, dt in enumerate(self.out_dtypes)]
        loads = {STRIDED: "tv{k}.v[k]", DENSE: "dv{k}[it].v[k]", ROWS: "dv{k}[it].v[k]", REPEAT: "dr{k}[it]"}
        body = self.element_body(lambda k, d: loads[d.layout].format(k=k), lambda m: f"ov{m}.v[k]", index="i + k")
        setup = cuda_t.TILED_SETUP_VEC.substitute(vw=vw, block_size=block)
        trip = cuda_t.TILED_TRIP_VEC.substitute(
            block_size=block, stage_loads="\n".join(cuda_t.TILE_STAGE_VEC.substitute(s) for s in subs),
            pre_decls=self.block(pre_decls, "      "), preload=self.block(preload, "          "),
            stage_stores="\n".join(cuda_t.TILE_STORE_VEC.substitute(s) for s in subs),
            tile_reads=self.block(tile_reads, "          "), out_decls=self.block(out_decls, "          "),
            body=self.block(body, "            "), stores=self.block(stores, "          "))
        return ready, setup, tiles, trip

    def vector_loop(self) -> str:
        if not self.options.vectorize or not has_vector_path(self.inputs, "cuda", self.out_layouts):
            return ""
        vec = vector_width(self.inputs, self.out_dtypes)
        if vec == 1:
            return ""
        vloads = []
        if self.offset_names:  # strided inputs' offsets, and rows outputs'
            vloads.append(self.offsets(cuda_t.OFFSETS, lambda j, name, dim: f"args.strides[{j}][{dim}]", index="base",
                                       unroll=cuda_t.MAX_DIMS, two_dims=True))
        words = set()  # bfloat16 inputs read as 32-bit words of two elements (fz_word_bf16)
        for k, d in enumerate(self.inputs):
            st = storage_type(d.dtype)
            if d.layout in (DENSE, ROWS):
                where = "base" if d.layout == DENSE else f"off{k}"
                if d.dtype == torch.bfloat16 and vec % 2 == 0:
                    words.add(k)
                    st, n = "unsigned int", vec // 2
                else:
                    n = vec
                vloads.append(f"const fz_vec<{st}, {n}> xv{k} = "
                              f"*reinterpret_cast<const fz_vec<{st}, {n}>*>(t{k} + {where});")
            elif d.layout == REPEAT:
                vloads.append(f"const {value_type(d.dtype, self.target)} xr{k} = fz_ld(t{k}[off{k}]);")
        # float16 / bfloat16 outputs rounded two at a time (fz_pack2) into 32-bit words, from the element's floats
        pairs = {m: storage_type(dt) for m, dt in enumerate(self.out_dtypes)
                 if dt in (torch.float16, torch.bfloat16) and vec % 2 == 0}
        vdecls = [f"float of{m}[{vec}];" if m in pairs else f"fz_vec<{storage_type(dt)}, {vec}> ov{m};"
                  for m, dt in enumerate(self.out_dtypes)]
        packs = [ln for m, st in pairs.items() for ln in (
            f"fz_vec<unsigned int, {vec // 2}> ov{m};", "#pragma unroll", f"for (int k = 0; k < {vec // 2}; ++k) "
            f"ov{m}.v[k] = fz_pack2<{st}>(of{m}[2 * k], of{m}[2 * k + 1]);")]
        vstores = packs + [
            f"*reinterpret_cast<fz_vec<{'unsigned int' if m in pairs else storage_type(dt)}, "
            f"{vec // 2 if m in pairs else vec}>*>"
            f"(o{m} + {'ooff' + str(m) if self.out_layouts and self.out_layouts[m] == ROWS else 'base'}) = ov{m};"
            for m, dt in enumerate(self.out_dtypes)]
        # random numbers: the vector's Philox blocks once, before its elements (rng.vector_words)
        rng_words, body = rng.vector_words(self.body, vec, "v", "k")
        vloads += rng_words

        def load(k, d):
            return f"xr{k}" if d.layout == REPEAT else f"fz_word_bf16(xv{k}.v[k / 2], k & 1)" if k in words else \
                f"xv{k}.v[k]"
        vbody = self.element_body(load,
                                  lambda m: f"of{m}[k]" if m in pairs else f"ov{m}.v[k]", index="base + k",
                                  body=body, raw=set(pairs))
        return cuda_t.VECTOR_LOOP.substitute(
            vec=vec, vloads=self.block(vloads, "      "), vdecls=self.block(vdecls, "      "),
            vbody=self.block(vbody, "        "), vstores=self.block(vstores, "      "))
