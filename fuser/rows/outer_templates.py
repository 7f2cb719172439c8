"""Source templates of the column kernels (``fuser/rows/outer.py``: reductions over the leading dims, F viewed as
[red, cols]), data filled by ``fuser.rows.outer_codegen`` with strict substitution.

CPU ABI (the pointwise and row kernels' signature): ``void name(int64_t red, int64_t rank, const int64_t* sizes,
const int64_t* strides, void* const* ptrs, const double* scalars)``; ``sizes``: the ``rank`` compressed column
dims, then their product (the columns); ``strides``: per tensor input ``rank`` strides over the column dims, then its stride along the
reduced dims. Blocks of :data:`CPU_CHUNK` columns: per row, the chunk's columns (consecutive in a row-major
input), each column's accumulators in an array; chunks split across threads. Where the group has vector forms, an
at::vec pass takes the chunk's whole vectors of columns (:data:`CPU_VECTOR_PASS`) and the scalar loop the rest.

CUDA: one by-value ``FzArgs`` (mirrored by ``fuser.rows.outer_launch.args_struct``); one 1-D grid, 256 threads
a block seen as ``tile`` threads along the columns (consecutive threads, consecutive columns: coalesced; each
thread ``cvec`` consecutive columns, loaded, and its element-level outputs stored, as one vector a row; a launch
whose pointers do not allow that takes the plan's second kernel, element by element: ``OuterKey.vectors``) times ``256 / tile`` lanes, each lane accumulating every ``lanes``-th row of its split of the column; the lanes combine through
shared memory in a fixed tree. ``stage`` 0 with one split stores the results; with ``splits`` > 1 each block
writes its partial results to the workspace (double: a float accumulator converts to it and back exactly) and
``stage`` 1 (a second launch, one thread a column) combines the splits in order: deterministic, no atomics.
"""
from string import Template

MAX_DIMS = 8  # column dims (fuser.rows.outer.MAX_COL_DIMS)
BLOCK_SIZE = 256  # CUDA threads a block: a power of two (the lanes' tree halves it)
# rows of a thread's split a CUDA trip unrolls: 8 (several rows' loads in flight), or 1 where the element work is
# long (more than HEAVY_ELEMENT_LINES lines) over 4-byte values, whose registers then go to the work. H200, gelu(x + b)'s
# backward (x's gradient and b's summed, [16384, 4096], 39 lines), the training step by rows unrolled 8 / 4 / 2 / 1,
# one process each, side by side (2026-11-30): float32 424 / 411 / 357 (spilled) / 333 us, bfloat16 210 / 216 / 229
# (spilled) / 218 us
ROWS_UNROLLED, HEAVY_ELEMENT_LINES = 8, 24
# blocks an SM __launch_bounds__ asks ptxas to leave room for in a whole-vector kernel (OuterKey.vectors). H200, the
# training step of gelu(x + b) over [16384, 4096], fuser alone, two runs each (2026-12-02): with no minimum the
# bfloat16 backward's column kernel took 77 registers (3 blocks an SM) and 225-227 us, float32 374-376 us; held to 4
# blocks (64 registers, 28 bytes spilled) 198-203 us and 338-341 us; the kernel with both loops 193 us (bfloat16)
VECTOR_BLOCKS_AN_SM = 4
CPU_CHUNK = 512  # columns a CPU chunk accumulates at once
CPU_FOLD_ROWS = 64  # rows the CPU vector pass sums in the compute type before folding into the accumulators
CPU_UNROLL_ROWS = 4  # rows a trip of the CPU vector pass (the rows' order kept: the same sums as one at a time)

# the lanes of a block combined per column: after it every thread holds its column's result
LANE_REDUCE = r"""template <class Op, class A> __device__ __forceinline__ A fz_lane_reduce(A v, A* sh, int tile) {
  const int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s >= tile; s >>= 1) {  // s is a multiple of tile: t and t + s share a column
    if (t < s) sh[t] = Op::f(sh[t], sh[t + s]);
    __syncthreads();
  }
  const A r = sh[t % tile];
  __syncthreads();  // sh is free for the next reduction
  return r;
}

// a thread's V consecutive columns of one row of an input; MODE (known when the kernel is generated, so no load
// waits on a branch): 0 the input does not step along the columns (one element), 1 a whole vector (the launch's
// pointers allow it), 2 element by element. Into a vector of the storage type where the kernel converts the values
// (2-byte floats: converted where they are used, so that loads of several rows in flight hold their bytes, not V
// floats each), else into an array of the values
template <int V, int MODE, class S> __device__ __forceinline__ void fz_col_load(
    fz_vec<S, V>& dst, const S* __restrict__ p, long long at) {
  if (MODE == 1) {
    dst = *reinterpret_cast<const fz_vec<S, V>*>(p + at);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) dst.v[v] = p[at + (MODE == 2 ? v : 0)];
  }
}
// bfloat16 as 32-bit words of two columns (widened where used by fz_word_bf16)
template <int V, int MODE> __device__ __forceinline__ void fz_col_load(
    fz_vec<unsigned int, V / 2>& dst, const fz_bf16* __restrict__ p, long long at) {
  if (MODE == 1) {
    dst = *reinterpret_cast<const fz_vec<unsigned int, V / 2>*>(p + at);
  } else {
#pragma unroll
    for (int w = 0; w < V / 2; ++w)
      dst.v[w] = (unsigned int)p[at + (MODE == 2 ? 2 * w : 0)].x | ((unsigned int)p[at + (MODE == 2 ? 2 * w + 1 : 0)].x << 16);
  }
}
template <int V, int MODE, class S> __device__ __forceinline__ void fz_col_load(
    S* dst, const S* __restrict__ p, long long at) {
  if (MODE == 1) {
    const fz_vec<S, V> w = *reinterpret_cast<const fz_vec<S, V>*>(p + at);
#pragma unroll
    for (int v = 0; v < V; ++v) dst[v] = w.v[v];
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) dst[v] = p[at + (MODE == 2 ? v : 0)];
  }
}

// the rows of a thread's split, unrolled n times: several rows' loads in flight (the sums keep the rows' order)
#define FZ_PRAGMA(x) _Pragma(#x)
// (I: the row index's type, 32 bits where OuterKey.index64 is False: NVRTC unrolled a 32-bit loop in less time)
#define FZ_COL_ROWS(n, I) FZ_PRAGMA(unroll n) for (I r = (I)(split * args.rows_per_split) + ty; r < (I)r1; r += lanes)
"""

# the offsets of column c's first element in each input: a divmod walk over the column dims (templates.quotient)
OFFSETS = Template(r"""${indent}long long ${decls};
${indent}{
${indent}  long long q0 = ${column};
${indent}  for (int d = (int)rank - 1; d >= 0; --d) {
${indent}    const long long q = ${quotient}, m = q0 - q * ${size};
${indent}    q0 = q;
${accumulate}
${indent}  }
${indent}}""")

# ...and where the columns span one dim or none (``OuterKey.walk`` False; with none, the one column is column 0)
OFFSETS_ONE = Template(r"""${indent}long long ${decls};
${indent}{
${indent}  const long long q0 = ${column};
${accumulate}
${indent}}""")

# CPU: the offsets of the chunk's first column c0 in each input (a divmod walk over the column dims, once a
# chunk), then an odometer over the column dims steps them from one column to the next
CPU_OFFSETS = Template(r"""    int64_t ci[${max_dims}];  // the column's index along each column dim
    long long ${decls};
    {
      long long q0 = c0;
      for (int d = (int)rank - 1; d >= 0; --d) {
        const long long q = q0 / sizes[d], m = q0 - q * sizes[d];
        q0 = q;
        ci[d] = m;
${accumulate}
      }
    }""")
CPU_STEP = Template(r"""        for (int d = (int)rank - 1; d >= 0; --d) {
${forward}
          if (++ci[d] < sizes[d]) break;
${back}
          ci[d] = 0;
        }""")

# (${head}: fuser/rows/templates.py's CPU_HEAD)
CPU_KERNEL = Template(r"""// fuser CPU column kernel ${name}
${head}
${params}
  const int64_t cols = sizes[rank];
${red_strides}
  // columns a chunk: ${chunk}, or fewer (a multiple of 16, at least 64) where that leaves fewer than 8 chunks to
  // share among the threads; decided by the columns alone, as is each column's order of sums
  const int64_t cw = cols >= 8 * ${chunk} ? ${chunk} : (((cols + 7) / 8 + 15) / 16 * 16 > 64 ? ((cols + 7) / 8 + 15) / 16 * 16 : 64);
  const int64_t chunks = (cols + cw - 1) / cw;
  fz_for(chunks > 1 && red * cols >= ${parallel_threshold}, chunks, [&](int64_t chunk) FZ_BODY {
    const int64_t c0 = chunk * cw;
    const int64_t nc = cols - c0 < cw ? cols - c0 : cw;
${col_arrays}
${offsets}
    // the chunk within one run of the innermost column dim: its columns' offsets step by that dim's strides
    const bool run = rank > 0 && ci[rank - 1] + nc <= sizes[rank - 1];
    for (int64_t j = 0; j < nc; ++j) {
${col_init}
    }
    int64_t jv = 0;  // the chunk's columns the vector pass took (it reads the offsets of the chunk's first column)
${vector}
    // the offsets of the columns the scalar loop takes (of them all where the epilogue reads an input)
    if (run) {
      for (int64_t j = ${linear_from}; j < nc; ++j) {
${col_linear}
      }
    } else {
      for (int64_t j = 0; j < nc; ++j) {
${col_offsets}
${step}
      }
    }
    for (int64_t r = 0; r < red; ++r) {
      for (int64_t j = jv; j < nc; ++j) {
        const int64_t c = c0 + j;
${body}
      }
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c = c0 + j;
${finish}
    }
  });
}
""")

# the CPU vector pass (at::vec, fz_v of W lanes): where the chunk lies in one run of the innermost column dim and
# every input it loads steps by 0 or 1 along it, the chunk's whole vectors of columns (the first jv), row by row
# (each row's columns read in order: the prefetchers' stream); each column's accumulators in an array of the compute type
# (vacc), folded into the scalar accumulators (acc, as the scalar loop's: double for sums) every ${rows} rows: a
# fixed order for a given shape and strides, whatever the thread count (deterministic)
CPU_VECTOR_PASS = Template(r"""    {
      bool vec_ok = run && nc >= W;
${steps}
      if (vec_ok) {
        jv = nc / W * W;
${vacc_decls}
        for (int64_t r0 = 0; r0 < red; r0 += ${rows}) {
          const int64_t r1 = red - r0 < ${rows} ? red : r0 + ${rows};
          for (int64_t j = 0; j < jv; j += W) {
${vacc_init}
          }
          int64_t r = r0;
          for (; r + ${unroll} <= r1; r += ${unroll}) {  // ${unroll} rows a trip: each vector's accumulator read once
${row_bases}
            for (int64_t j = 0; j < jv; j += W) {
${lines_unrolled}
            }
          }
          for (; r < r1; ++r) {
${row_bases}
            for (int64_t j = 0; j < jv; j += W) {
${lines}
            }
          }
          for (int64_t j = 0; j < jv; ++j) {
${fold}
          }
        }
      }
    }""")

CUDA_KERNEL = Template(r"""// fuser CUDA column kernel ${name}
${prelude}
${row_prelude}
struct FzArgs {
  long long red;
  long long cols;
  long long splits;  // blocks along each column (stage 0)
  long long rows_per_split;
  long long sizes[${max_dims}];
  long long strides[${n_stride_rows}][${max_dims} + 1];  // per tensor input: column dims, then along the column
  int rank;
  int stage;
  int tile;  // threads a block along the columns: a power of two, at most 32
  int vec;  // the launch's pointers allow whole vectors of ${cvec} columns (each kernel takes one form: unread)
  void* ptrs[${n_ptrs}];  // inputs, outputs, the workspace
  double scalars[${n_scalar_slots}];
};

extern "C" __global__ void __launch_bounds__(${block_size}${min_blocks}) ${name}(const FzArgs args) {
  const long long red = args.red, cols = args.cols;
  const int rank = args.rank;
${params}
  double* __restrict__ ws = (double*)args.ptrs[${ws_index}];
${shared}
  if (args.stage == 0) {
    const int tile = args.tile, lanes = (int)blockDim.x / tile;
    const int tx = (int)threadIdx.x % tile, ty = (int)threadIdx.x / tile;
    // the block's index and its tile's and split's: in 32 bits where tiles * splits < 2^31 (fuser.rows.outer:
    // OuterKey.index64; a 64-bit division takes ptxas longer and the kernel more instructions)
    const ${index} tiles = ((${index})cols / ${cvec} + tile - 1) / tile;  // (cols: a multiple of ${cvec}, fuser.rows.outer)
    for (${index} b = blockIdx.x; b < tiles * (${index})args.splits; b += gridDim.x) {
      const ${index} split = b / tiles;
      // the thread's first column, from b % tiles: written b - split * tiles, NVVM lost that c is a multiple of
      // ${cvec} and stored each 16-byte vector of 2-byte elements as six 2-byte and one 4-byte stores
      const long long c = ((b % tiles) * tile + tx) * ${cvec};
      const bool live = c < cols;
${offsets}
      const long long r1 = (split + 1) * args.rows_per_split < red ? (split + 1) * args.rows_per_split : red;
${acc_decls}
      if (live) {
${row_loops}
      }
${lane_reduce}
      if (ty == 0 && live) {
        if (args.splits == 1) {
${finish}
        } else {
${partial}
        }
      }
    }
  } else {
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += (long long)gridDim.x * blockDim.x) {
${offsets1}
${acc_decls1}
      for (long long s = 0; s < args.splits; ++s) {
${combine}
      }
${finish1}
    }
  }
}
""")
