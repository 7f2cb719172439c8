"""Source templates of the row kernels (data, filled by ``fuser.rows.codegen`` with strict substitution).

CPU ABI (the pointwise kernels' signature, read differently): ``void name(int64_t rows, int64_t rank,
const int64_t* sizes, const int64_t* strides, void* const* ptrs, const double* scalars)``; ``sizes``: the
``rank`` row dims, then the row length; ``strides``: per tensor input ``rank`` strides over the row dims, then its
stride along the row. CUDA: one by-value ``FzArgs`` (mirrored by ``fuser.rows.launch.args_struct``); a row is
shared by a power of two of consecutive threads (``fuser.rows.shape.CudaShape``), a block holds one or more rows and
grid-strides over them; or (``CudaShape.cluster``) the CTAs of a thread block cluster share a row, a segment each
(:data:`CUDA_CLUSTER_COLS`, :data:`CLUSTER_REDUCE`), a cluster per row in turn. A staged kernel
(``CudaShape.staged``) keeps rows of some inputs in dynamic shared memory (:data:`CUDA_STAGE`, :data:`ROW_FETCH`).
Both kernels start from their target's pointwise prelude (so the CUDA host emulation swaps it as for every CUDA
kernel) and add :data:`ROW_PRELUDE`.
"""
from string import Template

MAX_DIMS = 8  # row dims (fuser.rows.plan.MAX_LEAD_DIMS)

# combine functions of the reductions (ops.Reduction.combine); CUDA adds the row reduction across a row's threads.
# ${max} / ${min}: the max and min a reduction combines with (row_prelude): on CUDA fz_max_nan / fz_min_nan (one
# max.NaN / min.NaN instruction from sm_80 on, see fuser/cuda/templates.py), on the CPU eager's fz_max / fz_min
ROW_PRELUDE = Template(r"""
struct fz_rsum { template <class A> static ${fn} A f(A a, A b) { return a + b; } };
struct fz_rmax { template <class A> static ${fn} A f(A a, A b) { return ${max}(a, b); } };
struct fz_rmin { template <class A> static ${fn} A f(A a, A b) { return ${min}(a, b); } };
${row_reduce}""")


def row_prelude(target: str, row_reduce: str) -> str:
    """:data:`ROW_PRELUDE` for ``target`` ("cuda" or "cpu"), followed by ``row_reduce`` (the target's reduction
    helpers): its qualifiers and the max and min its reductions combine with."""
    if target == "cuda":
        return ROW_PRELUDE.substitute(fn="__device__ __forceinline__", max="fz_max_nan", min="fz_min_nan",
                                      row_reduce=row_reduce)
    return ROW_PRELUDE.substitute(fn="inline", max="fz_max", min="fz_min", row_reduce=row_reduce)


# CPU: a vector's lanes combined in double (or the accumulator's type) as a tree, halves pairwise (a fixed order;
# the lanes' chains are independent, where one running sum over them waits on each add); sums widened to double
# vectors in registers first (a shifted pass's lane sums, see CPU_VECTOR_PASS, gathered over the copies so)
CPU_LANE_REDUCE = r"""template <class Op, class A, class V> static inline A fz_lane_tree(const V& v) {
  typename V::value_type h[V::size()];
  v.store(h);
  A a[V::size()];
  for (int l = 0; l < V::size(); ++l) a[l] = (A)h[l];
  for (int w = V::size() / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) a[l] = Op::f(a[l], a[l + w]);
  return a[0];
}
// a vector's lanes in double, in registers: a float vector's halves widened, their sum (fz_wsum) or the sum of their
// differences from c (fz_wdiff); a double vector as it is
static inline void fz_widen(const fz_vf& v, fz_vd& lo, fz_vd& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 m = v;
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(m));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1)));
#else
  const __m256 m = v;
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(m));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(m, 1));
#endif
}
static inline fz_vd fz_wsum(const fz_vd& v) { return v; }
static inline fz_vd fz_wsum(const fz_vf& v) { fz_vd lo, hi; fz_widen(v, lo, hi); return lo + hi; }
static inline fz_vd fz_wdiff(const fz_vd& v, const fz_vd& c) { return v - c; }
static inline fz_vd fz_wdiff(const fz_vf& v, const fz_vd& c) { fz_vd lo, hi; fz_widen(v, lo, hi); return (lo - c) + (hi - c); }
"""

# CUDA: the TPR threads of a row (a power of two; TPR consecutive threads of the block) combine their partial
# results: a butterfly of warp shuffles (a fixed order: deterministic), then, for rows wider than a warp, each
# warp's result through shared memory, lane l of every warp of the row reading warp l's (l below the row's warps,
# lane l + k * warps the same one again) and a second butterfly over them (the same fixed tree in every warp: every
# warp of the row gets the same value; a thread reading all the row's warps' results one after another took 64
# loads and adds a row at 1024 threads with two sums). Every thread of the block calls
# it the same number of times (rows past the end take part with the identity), so the barriers are uniform.
# Every thread of a row gets the value of the row's first lane: on the GPU the butterfly's lanes already hold the same
# bits (its combines give one result in either operand order), but the host emulation's a + b of two NaNs keeps the
# first operand's payload, so its lanes may differ.
ROW_REDUCE = r"""// W lanes of a warp (a power of two, at most 32) combine v by a butterfly of shuffles; each gets its group's lane 0's
template <class Op, int W, class A> __device__ __forceinline__ A fz_warp_tree(A v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v = Op::f(v, __shfl_xor_sync(0xffffffffu, v, o));
  return __shfl_sync(0xffffffffu, v, 0, W);
}

// a row of NWR warps: lane l of each reads warp l's slot (lane l + k * NWR the same one again) of sh, a slot a warp of
// the block
template <int TPR, int NWR = (TPR > 32 ? TPR / 32 : 1)> __device__ __forceinline__ int fz_row_warp_slot() {
  return (threadIdx.x / TPR) * NWR + (threadIdx.x & (NWR - 1));
}

template <class Op, int TPR, class A> __device__ __forceinline__ A fz_row_reduce(A v, A* sh) {
  v = fz_warp_tree<Op, (TPR < 32 ? TPR : 32)>(v);
  if (TPR > 32) {
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x / 32] = v;
    __syncthreads();
    v = fz_warp_tree<Op, (TPR > 32 ? TPR / 32 : 1)>(sh[fz_row_warp_slot<TPR>()]);
    __syncthreads();  // sh is free for the next reduction
  }
  return v;
}

// two values of the rows reduced at once, each as fz_row_reduce forms it (the same order of combining), the block's
// step crossing the barriers once; sh holds 2 * NW slots (NW: the block's warps)
template <class Op, int TPR, int NW, class A> __device__ __forceinline__ void fz_row_reduce2(A& a, A& b, A* sh) {
  a = fz_warp_tree<Op, (TPR < 32 ? TPR : 32)>(a);
  b = fz_warp_tree<Op, (TPR < 32 ? TPR : 32)>(b);
  if (TPR > 32) {
    if ((threadIdx.x & 31) == 0) {
      sh[threadIdx.x / 32] = a;
      sh[NW + threadIdx.x / 32] = b;
    }
    __syncthreads();
    const int at = fz_row_warp_slot<TPR>();
    a = fz_warp_tree<Op, (TPR > 32 ? TPR / 32 : 1)>(sh[at]);
    b = fz_warp_tree<Op, (TPR > 32 ? TPR / 32 : 1)>(sh[NW + at]);
    __syncthreads();  // sh is free for the next reduction
  }
}

// a vector of V elements at q as the kernel's value type C: bfloat16 pairs widened from their 32-bit words (the low
// element a shift, the high one a mask; from the 16-bit lanes, sm_90 took two instructions for a high element),
// other types element by element
template <int V, class C, class S> __device__ __forceinline__ void fz_vec_ld(C* dst, const S* q) {
  const fz_vec<S, V> w = *reinterpret_cast<const fz_vec<S, V>*>(q);
#pragma unroll
  for (int v = 0; v < V; ++v) dst[v] = (C)fz_ld(w.v[v]);
}
template <int V> __device__ __forceinline__ void fz_vec_ld(float* dst, const fz_bf16* q) {
  if (V % 2) {
    const fz_vec<fz_bf16, V> w = *reinterpret_cast<const fz_vec<fz_bf16, V>*>(q);
#pragma unroll
    for (int v = 0; v < V; ++v) dst[v] = fz_ld(w.v[v]);
    return;
  }
  constexpr int W = V / 2 > 0 ? V / 2 : 1;
  const fz_vec<unsigned int, W> u = *reinterpret_cast<const fz_vec<unsigned int, W>*>(q);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    dst[2 * k] = __uint_as_float(u.v[k] << 16);
    dst[2 * k + 1] = __uint_as_float(u.v[k] & 0xffff0000u);
  }
}
// a thread's elements of one trip along a row (NV vectors of V elements, vector i at column
// tb + (i * TPR + lane) * V), as the kernel's value type C, every load issued before any is used: whole vectors
// where the launch allows them (args.vec: the row starts, the row length and the pointers suit them; a vector
// past the row's end reads the row's last one instead, and is not used), a tensor that does not step along the
// row gives its one element, otherwise element by element (0 past the row's end). An empty row: no loads (on
// CUDA an empty tensor's pointer is null). FULL: the row is a whole number of trips
// (fuser.rows.shape.CudaShape.full): no element is past its end.
template <int NV, int V, int TPR, bool FULL, class C, class S> __device__ __forceinline__ void fz_row_trip(
    C* dst, const S* __restrict__ p, long long off, long long cs, int tb, int lane, int cols, int vec) {
  if (!FULL && cols <= 0) return;
  if (vec && cs) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      int cb = tb + (i * TPR + lane) * V;
      if (!FULL) cb = cb < cols ? cb : cols - V;
      fz_vec_ld<V>(dst + i * V, p + off + cb);
    }
  } else if (vec) {
    const C x = (C)fz_ld(p[off]);
#pragma unroll
    for (int k = 0; k < NV * V; ++k) dst[k] = x;
  } else {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int c = tb + (i * TPR + lane) * V + v;
        dst[i * V + v] = FULL || c < cols ? (C)fz_ld(p[off + c * cs]) : (C)0;
      }
    }
  }
}
// the same trip in a kernel that takes whole vectors only (fuser.rows.plan.RowKey.steps): STEP, the tensor's step
// along the row, 1 (vectors) or 0 (the row's one value); no choice made at run time
template <int NV, int V, int TPR, bool FULL, int STEP, class C, class S> __device__ __forceinline__ void fz_row_vec(
    C* dst, const S* __restrict__ p, long long off, int tb, int lane, int cols) {
  if (!FULL && cols <= 0) return;
  if (STEP == 0) {
    const C x = (C)fz_ld(p[off]);
#pragma unroll
    for (int k = 0; k < NV * V; ++k) dst[k] = x;
    return;
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    int cb = tb + (i * TPR + lane) * V;
    if (!FULL) cb = cb < cols ? cb : cols - V;
    fz_vec_ld<V>(dst + i * V, p + off + cb);
  }
}
template <int NV, int V, int TPR, bool FULL, class C, class S> __device__ __forceinline__ void fz_row_staged(
    C* dst, const S* st, int tb, int lane, int cols) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int cb = tb + (i * TPR + lane) * V;
    if (FULL || cb < cols) {
      fz_vec_ld<V>(dst + i * V, st + cb);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) dst[i * V + v] = (C)0;
    }
  }
}
"""

# a staged kernel's copies of its rows into shared memory (with fuser/cuda/templates.py's STAGE, which it calls)
ROW_FETCH = r"""// a staged input (fuser.rows.shape.CudaShape.staged) in a vectors-only kernel: at a row's start each
// thread copies the vectors of the row it will read (those of its lane in every trip) into the row's copy in shared
// memory, st[cb], all of them in flight at once (fz_cp), and waits for its own (fz_cp_wait); the passes read them back
// (fz_row_staged). A thread reads only what it copied, so no barrier is needed, and a vector past the row's end (the
// row length is a whole number of vectors) is neither copied nor read: its elements are 0 and not used.
template <int V, int TPR, class S> __device__ __forceinline__ void fz_row_fetch(S* st, const S* __restrict__ p,
                                                                               long long off, int lane, int cols) {
  for (int cb = lane * V; cb < cols; cb += TPR * V) fz_cp<V * sizeof(S)>(st + cb, p + off + cb);
}
"""

# a staged kernel's copies of its rows in shared memory (CudaShape.staged): per row of the block, a row of each
# staged input, each rounded up to 16 bytes (fuser.rows.shape.stage_row_bytes); fz_sg<k>: this thread's row's copy
# of input k. row_at: the offset of the thread's row (none where a block is one row), in 32-bit arithmetic
CUDA_STAGE = Template(r"""  unsigned char* const fz_stage = fz_dyn_smem()${row_at};
${pointers}""")

# a row held by the N CTAs of a thread block cluster (fuser.rows.shape.cluster_shape; a block is one row, TPR its
# threads): each CTA reduces its segment (fz_row_reduce), thread 0 puts the result into a slot of its shared
# memory, and after the cluster barrier lanes 0..N-1 of every warp read the N CTAs' slots, combined in rank order
# by every thread (a fixed order: every CTA gets the same value). Two slots a type, taken in turn by the kernel's
# count of reductions (cn): a slot is written again two reductions later, after a barrier that every CTA reaches
# only once it has read the slot, so one barrier a reduction suffices. sh holds TPR / 32 values and the two slots.
CLUSTER_REDUCE = r"""template <class Op, int TPR, int N, class A> __device__ __forceinline__ A fz_cluster_reduce(A v, A* sh,
                                                                                       unsigned& cn) {
  v = fz_row_reduce<Op, TPR>(v, sh);
  A* const slot = sh + TPR / 32 + (cn++ & 1u);
  if (threadIdx.x == 0) fz_cluster_put(slot, v);
  fz_cluster_sync();
  const unsigned l = threadIdx.x & 31u;
  const A mine = l < (unsigned)N ? fz_cluster_get(slot, l) : v;
  A r = __shfl_sync(0xffffffffu, mine, 0);
#pragma unroll
  for (int k = 1; k < N; ++k) r = Op::f(r, __shfl_sync(0xffffffffu, mine, k));
  return r;
}
"""

# the start of a CPU row or column kernel (fuser/rows/outer_templates.py's too): its preludes and the CPU ABI's
# signature (fuser.cpu.compiler.CpuKernel.launch's arguments; ${count}: the first one's name, rows or red)
CPU_HEAD = Template(r"""${prelude}
${row_prelude}
extern "C" void ${name}(int64_t ${count}, int64_t rank, const int64_t* sizes, const int64_t* strides,
                        void* const* ptrs, const double* scalars) {
  (void)scalars;""")

CPU_KERNEL = Template(r"""// fuser CPU row kernel ${name}
${head}
${vector_types}
${params}
  const int64_t cols = sizes[rank];
${parts}
${parallel}
${loop}
${offsets}
${phases}
${loop_end}
${end}${parts_sum}
}
""")

# the loop over rows (or parts of rows): fz_for splits it across threads where ${cond} holds; inside a
# parallel region (CPU_PARALLEL_SCRATCH) each thread takes its share, as a static schedule would
CPU_FOR = Template("  fz_for(${cond}, ${count}, [&](int64_t ${var}) FZ_BODY {")
CPU_SHARE_FOR = Template("  for (int64_t ${var} = ${count} * fz_tid / fz_nt, fz_end = ${count} * (fz_tid + 1) / fz_nt;"
                         " ${var} < fz_end; ++${var}) {")

# column sums (fuser.rows.passes.column_sum_form): the rows in parts of consecutive rows (${part_rows} at least, or up
# to ${min_parts} parts of fewer rows where there are ${part_work} elements a part: a few long rows; each part's
# partial row costs cols more elements to zero and add up), their number fixed by the row and column counts
# (not by the threads, so the sums do not depend on how many there are), each part adding
# its rows' values into a partial row of its own (in the values' compute type); then the partial rows added
# in order into the first, 256 columns at a time (independent adds along the columns: vector code, where a
# column's chain of adds would wait on each), and stored
CPU_PARTS = Template(r"""  const int64_t fz_pw = rows * cols / ${part_work} < rows ? rows * cols / ${part_work} : rows;
  const int64_t fz_pm = fz_pw < ${min_parts} ? fz_pw : ${min_parts};
  const int64_t fz_pr = rows / ${part_rows} > fz_pm ? rows / ${part_rows} : fz_pm;
  const int64_t fz_parts = rows * cols < ${parallel_threshold} || fz_pr < 2 ? 1 : fz_pr < ${max_parts} ? fz_pr : ${max_parts};
${alloc}""")
CPU_PARTS_LOOP = Template(r"""${zero}
  for (int64_t row = rows * part / fz_parts, row_end = rows * (part + 1) / fz_parts; row < row_end; ++row) {""")
CPU_PARTS_SUM = Template(r"""  fz_for(fz_parts > 1 && fz_parts * cols >= ${parallel_threshold}, (cols + 255) / 256, [&](int64_t cb) FZ_BODY {
    const int64_t c0 = cb * 256, c1 = cols - c0 < 256 ? cols : c0 + 256;
    for (int64_t q = 1; q < fz_parts; ++q) {
${sums}
    }
    for (int64_t c = c0; c < c1; ++c) {
${stores}
    }
  });
${free}""")

# the CPU row kernel's rows (or parts: ${count}) go across threads from ${parallel_threshold} elements; with scratch
# rows (fuser.rows.passes.kept_values) a parallel region allocates each thread's (${scratch}) around the loop
CPU_PARALLEL = Template("${count} > 1 && rows * cols >= ${parallel_threshold}")
CPU_PARALLEL_SCRATCH = Template(r"""  fz_region(${cond}, [&](int64_t fz_tid, int64_t fz_nt) FZ_BODY {
${scratch}""")

CUDA_KERNEL = Template(r"""// fuser CUDA row kernel ${name}
${prelude}
${row_prelude}
struct FzArgs {
  long long rows;
  long long cols;
  long long sizes[${max_dims}];
  long long strides[${n_stride_rows}][${max_dims} + 1];  // per tensor input: row dims, then along the row
  int rank;
  int vec;  // the launch may read and write whole vectors of ${vec} elements (fuser.rows.launch)
  void* ptrs[${n_ptrs}];
  double scalars[${n_scalar_slots}];
  long long slots;  // column sums: the partial rows (fuser.rows.launch)
};

// ${tpr} threads a row, ${rpb} rows a block; a thread holds ${items} elements of a row a trip, in vectors of ${vec}
// (element i*${vec}+v of its trip: column ((i*${tpr} + lane)*${vec} + v))
extern "C" __global__ void ${cluster_dims}__launch_bounds__(${block}${min_blocks}) ${name}(const FzArgs args) {
  const long long rows = args.rows;
${cols}
  const int rank = args.rank;
  const int lane = threadIdx.x % ${tpr};
${params}
${shared}
${sums_decl}
  for (long long base = (long long)${first_block} * ${rpb}; base < rows; base += (long long)${n_blocks} * ${rpb}) {
    // a row past the end (the last block's) computes the last row again and stores nothing, so no element needs
    // a check of its row
    const bool live = base + threadIdx.x / ${tpr} < rows;
    const long long row = live ? base + threadIdx.x / ${tpr} : rows - 1;
${offsets}
${cache}
${phases}
  }
${sums_store}
}
${parts_kernel}""")

# column sums (fuser.rows.passes.column_sum_form) of a row of one trip: a thread's columns are the same for
# every row it takes (the grid-strided rows of its slot, blockIdx.x * rows a block + its row in the block), so it adds
# its live rows' values in registers and writes them once, as its slot's partial row (every slot writes its row,
# zeros where it took none); a second kernel adds the slots' partial rows in a fixed order
CUDA_PARTS_STORE = Template(r"""  {
    const long long slot = (long long)blockIdx.x * ${rpb} + threadIdx.x / ${tpr};
#pragma unroll
    for (int i = 0; i < ${nv}; ++i) {
      const int cb = (i * ${tpr} + lane) * ${vec};
#pragma unroll
      for (int v = 0; v < ${vec}; ++v) {
        if (${check}) {
${stores}
        }
      }
    }
  }""")
# ...and where the slots are in shared memory (CudaShape.sums_shared) and a block takes several rows: the block
# adds its rows' slots first (each column's in row order), and writes one partial row, so the second kernel reads
# ${rpb} times fewer (the slots of a block of rows of 512 made that kernel the step's third largest)
CUDA_PARTS_STORE_BLOCK = Template(r"""  __syncthreads();
  for (int e = threadIdx.x; e < ${nv} * ${tpr}; e += ${block}) {
    const int i = e / ${tpr}, ln = e % ${tpr};
    const int cb = (i * ${tpr} + ln) * ${vec};
#pragma unroll
    for (int v = 0; v < ${vec}; ++v) {
      if (${check}) {
${stores}
      }
    }
  }""")
# ...and where the row takes several trips (CudaShape.trip_sums): a slot per column in dynamic shared memory, each
# thread adding its own columns of each trip; the block writes them as its partial row (the block is the row's)
CUDA_PARTS_STORE_TRIPS = Template(r"""  __syncthreads();
  for (long long c = threadIdx.x; c < cols; c += ${block}) {
${stores}
  }""")
CUDA_PARTS_KERNEL = Template(r"""
// the second kernel: a block takes 32 columns at a time; its 8 warps add every 8th slot's partial rows each (32
// consecutive columns a load), then the first warp adds the 8 warps' sums in order (a fixed order: deterministic)
extern "C" __global__ void __launch_bounds__(256) ${name}_sum(const FzArgs args) {
  const long long cols = args.cols;
  const int g = threadIdx.x / 32, lc = threadIdx.x % 32;
${params}
  for (long long c0 = (long long)blockIdx.x * 32; c0 < cols; c0 += (long long)gridDim.x * 32) {
    const long long c = c0 + lc;
${sums}
    __syncthreads();
    if (g == 0 && c < cols) {
${stores}
    }
    __syncthreads();
  }
}
""")

# one pass along the row: trips of ${items} elements a thread (one trip where the row is held in registers)
CUDA_PASS = Template(r"""    ${acc_decl}
    ${trips} {
${loads}
#pragma unroll
      for (int i = 0; i < ${nv}; ++i) {
        const int cb = tb + (i * ${tpr} + lane) * ${vec};
${item_decls}
#pragma unroll
        for (int v = 0; v < ${vec}; ++v) {
${body}
        }
${after_item}
      }
    }
${after}""")

# the row length of a kernel (CUDA_KERNEL's ${cols}); a cluster's CTA holds the columns of its segment (SEG of
# them from fz_c0 on; fewer for the last CTA of a row that is not a whole number of segments): cols
# counts them, fz_ncols is the row's length; the CTAs of a cluster take the same rows, a cluster's rows in turn
CUDA_COLS = "  const int cols = (int)args.cols;  // below 2^31 (fuser.rows.plan)"
CUDA_CLUSTER_COLS = Template(r"""  const int fz_ncols = (int)args.cols;  // below 2^31 (fuser.rows.plan)
  const int fz_c0 = (int)fz_cluster_rank() * ${seg};
  const int cols = fz_ncols - fz_c0 < ${seg} ? fz_ncols - fz_c0 : ${seg};
  unsigned fz_cn = 0;  // the reductions so far (fz_cluster_reduce's slots)""")
# a CTA of a cluster leaves only when every CTA has read its slots
CUDA_CLUSTER_END = "  fz_cluster_sync();"

def quotient(value: str, size: str, index64: bool = True) -> str:
    """C for ``value / size`` of a divmod walk over dims, both at least 0: in 64 bits, or where every value the walk
    divides is below 2^31 (``index64`` False: a CUDA kernel's ``RowKey.index64`` / ``OuterKey.index64``) in 32. A
    64-bit division is a long subroutine: with the two walks of a column kernel in 32 bits, (x * y).sum(0)'s kernel
    took NVRTC 10-20% less time and its CUBIN 12% fewer bytes (NVRTC 13.0 here, sm_90)."""
    return f"{value} / {size}" if index64 else f"(long long)((unsigned int)({value}) / (unsigned int)({size}))"


# the offsets of a row's first element in each input: one divmod walk over the row dims per row (none for one), its
# quotients by :func:`quotient`
OFFSETS = Template(r"""    long long ${decls};
    if (rank == 1) {
${accumulate1}
    } else {
      long long r = row;
      for (int d = (int)rank - 1; d >= 0; --d) {
        const long long q = ${quotient}, m = r - q * ${size};
        r = q;
${accumulate}
      }
    }
${col_strides}""")

# ...and where the rows span one dim or none (``plan.RowKey.walk`` False; with none, the one row is row 0)
OFFSETS_ONE = Template(r"""    long long ${decls};
    {
${accumulate1}
    }
${col_strides}""")

# the CPU kernel's pass along the row: ${body} per element
PHASE = Template(r"""    ${acc_decl}
    for (long long c = ${first}; c < cols; c += ${step}) {
${body}
    }
${after}""")

# the CPU kernel's vector loops (fuser.rows.codegen.cpu_vector._Vector), over the vector header's at::vec types
CPU_VECTOR_TYPES = Template(r"""  typedef ${vtype} fz_v;
  const int64_t W = fz_v::size();""")

# a pass of a reduction: trips of ${copies} vectors while the row steps by 0 or 1 in every input (vec_ok), the
# partial results combined in a fixed order, then the scalar loop from c0_${pos} on
# A shifted pass (a centered mean, see codegen.centered_means): each vector sums its differences from the values it
# held in the first trip (vs<pos>_<copy>, in ${shift_set}), and ${shift_add} adds them, and each shift's difference
# from the row's first value times the trips, to the row's differences from that value (accs<pos>).
CPU_VECTOR_PASS = Template(r"""    int64_t c0_${pos} = 0;
    ${acc_t} acc${pos} = ${ident};
    if (vec_ok && cols >= ${copies} * W) {
${decls}
      for (; c0_${pos} + ${copies} * W <= cols; c0_${pos} += ${copies} * W) {
        const int64_t c = c0_${pos};
${lines}
${shift_set}${accumulate}
      }
${combine}
      acc${pos} = ${combine_fn}::f(acc${pos}, ${lanes});
${shift_add}    }""")

# the pass that stores the element-level outputs: trips of ${copies} vectors, then the scalar loop from c0_out on
CPU_VECTOR_STORES = Template(r"""    int64_t c0_out = 0;
    if (vec_ok) {
      for (; c0_out + ${copies} * W <= cols; c0_out += ${copies} * W) {
        const int64_t c = c0_out;
${lines}
      }
    }""")
