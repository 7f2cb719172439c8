"""Source templates of the row kernels (data, filled by ``fuser.rows.codegen`` with strict substitution).

CPU ABI (the pointwise kernels' signature, read differently): ``void name(int64_t rows, int64_t rank,
const int64_t* sizes, const int64_t* strides, void* const* ptrs, const double* scalars)``; ``sizes``: the
``rank`` row dims, then the row length; ``strides``: per tensor input ``rank`` strides over the row dims, then its
stride along the row. CUDA: one by-value ``FzArgs`` (mirrored by ``fuser.rows.launch.args_struct``); one block
per row, grid-stride over rows. Both kernels start from their target's pointwise prelude (so the CUDA host
emulation swaps it as for every CUDA kernel) and add :data:`ROW_PRELUDE`.
"""
from string import Template

MAX_DIMS = 8  # row dims (fuser.rows.plan.MAX_LEAD_DIMS)
BLOCK_SIZE = 256  # CUDA threads per row: a power of two (the block reduction halves it)

# combine functions of the reductions (ops.Reduction.combine); CUDA: the block reduction through shared memory,
# a fixed tree (deterministic), every thread gets the result
ROW_PRELUDE = Template(r"""
struct fz_rsum { template <class A> static ${fn} A f(A a, A b) { return a + b; } };
struct fz_rmax { template <class A> static ${fn} A f(A a, A b) { return fz_max(a, b); } };
struct fz_rmin { template <class A> static ${fn} A f(A a, A b) { return fz_min(a, b); } };
${block_reduce}""")

BLOCK_REDUCE = r"""template <class Op, class A> __device__ __forceinline__ A fz_block_reduce(A v, A* sh) {
  const int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) sh[t] = Op::f(sh[t], sh[t + s]);
    __syncthreads();
  }
  const A r = sh[0];
  __syncthreads();  // sh is free for the next reduction
  return r;
}
"""

CPU_KERNEL = Template(r"""// fuser CPU row kernel ${name}
${prelude}
${row_prelude}
extern "C" void ${name}(int64_t rows, int64_t rank, const int64_t* sizes, const int64_t* strides,
                        void* const* ptrs, const double* scalars) {
  (void)scalars;
${vector_types}
${params}
  const int64_t cols = sizes[rank];
#pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= ${parallel_threshold})
  for (int64_t row = 0; row < rows; ++row) {
${offsets}
${phases}
  }
}
""")

CUDA_KERNEL = Template(r"""// fuser CUDA row kernel ${name}
${prelude}
${row_prelude}
struct FzArgs {
  long long rows;
  long long cols;
  long long sizes[${max_dims}];
  long long strides[${n_stride_rows}][${max_dims} + 1];  // per tensor input: row dims, then along the row
  int rank;
  void* ptrs[${n_ptrs}];
  double scalars[${n_scalar_slots}];
};

extern "C" __global__ void __launch_bounds__(${block_size}) ${name}(const FzArgs args) {
  const long long rows = args.rows, cols = args.cols;
  const int rank = args.rank;
${params}
${shared}
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
${offsets}
${phases}
  }
}
""")

# the offsets of a row's first element in each input: one divmod walk over the row dims per row
OFFSETS = Template(r"""    long long ${decls};
    {
      long long r = row;
      for (int d = (int)rank - 1; d >= 0; --d) {
        const long long q = r / ${size}, m = r - q * ${size};
        r = q;
${accumulate}
      }
    }
${col_strides}""")

# one pass along the row: ${body} per element (the threads of a block share the row on CUDA)
PHASE = Template(r"""    ${acc_decl}
    for (long long c = ${first}; c < cols; c += ${step}) {
${body}
    }
${after}""")

# the CPU kernel's vector loops (fuser.rows.codegen._Vector), over the vector header's at::vec types
CPU_VECTOR_TYPES = Template(r"""  typedef ${vtype} fz_v;
  const int64_t W = fz_v::size();""")

# a pass of a reduction: trips of ${copies} vectors while the row steps by 0 or 1 in every input (vec_ok), the
# partial results combined in a fixed order, then the scalar loop from c0_${pos} on
CPU_VECTOR_PASS = Template(r"""    int64_t c0_${pos} = 0;
    ${acc_t} acc${pos} = ${ident};
    if (vec_ok && cols >= ${copies} * W) {
${decls}
      for (; c0_${pos} + ${copies} * W <= cols; c0_${pos} += ${copies} * W) {
        const int64_t c = c0_${pos};
${lines}
${accumulate}
      }
${combine}
      ${ctype} fz_h[64];
      vacc${pos}_0.store(fz_h);
      for (int64_t l = 0; l < W; ++l) acc${pos} = ${combine_fn}::f(acc${pos}, (${acc_t})fz_h[l]);
    }""")

# the pass that stores the element-level outputs: trips of ${copies} vectors, then the scalar loop from c0_out on
CPU_VECTOR_STORES = Template(r"""    int64_t c0_out = 0;
    if (vec_ok) {
      for (; c0_out + ${copies} * W <= cols; c0_out += ${copies} * W) {
        const int64_t c = c0_out;
${lines}
      }
    }""")
