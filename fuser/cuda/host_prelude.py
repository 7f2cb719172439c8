"""Host C++ that lets the generated CUDA kernels compile with g++ and run on the CPU (data for
``fuser.cuda.emulate``, filled with strict substitution).

A CUDA kernel's source is ``templates.PRELUDE`` (+ ``templates.RNG``) followed by its own text (``FzArgs``,
the kernel). The emulator swaps that prelude, found verbatim, for :data:`PRELUDE`: the same template
(``templates.PRELUDE_TEMPLATE``) with its PTX pieces, the float16 conversions and an empty-asm
optimization barrier, written in host C++. So
everything else of the prelude (helpers, ``fz_div``, ``fz_tanh_fast``, limits, vectors, the bfloat16 store
of devices before sm_80) and all of the kernel's own text run as NVRTC sees them. What the CUDA language
and NVRTC provide without a header comes from :data:`HEADER`, once per translation unit: qualifiers as
macros, ``threadIdx``/``blockIdx``/``blockDim``/``gridDim``, ``__syncthreads`` and the intrinsics the
templates call, emulated bit for bit where CUDA documents the bits (``__fdividef`` of a divisor above 2^126
is 0, ``__expf`` flushes subnormal results to 0; the 2-ulp approximation error of ``ex2.approx`` is not
modelled, the rounding of ``x * log2(e)`` before it is).

Threads are fibers (``ucontext``), one per thread of a block, on stacks announced to AddressSanitizer. The
scheduler runs a block's fibers in turn; ``__syncthreads()`` parks the calling fiber, and when every fiber
waits, the barrier opens and the next phase runs them in the reverse order (a kernel that needs a barrier
it lacks sees its writes in another order). A fiber that returns while others wait is an error (CUDA
leaves it undefined). ``__shared__`` is ``static``: one copy that a block's fibers share; blocks run one
after another, so that is one copy per block. Dynamic shared memory (a source's ``templates.STAGE``, swapped for
:data:`STAGE`) is a heap block of exactly the launch's bytes per CTA, filled with 0xbe bytes when its cluster starts
(a read before any write shows) and freed when the cluster ends, so an access past it is an ASan error.

Thread block clusters (sm_90): a source's ``templates.CLUSTER`` is swapped for :data:`CLUSTER`, and a launch in
clusters of N blocks runs one cluster after another, a fiber per thread of its N CTAs. They take turns: CTA 0 runs
its phases until each of its threads waits at the cluster barrier (``fz_cluster_sync``) or has returned, then
CTA 1, and so on (the next round in the reverse order, so that a get lacking its barrier reads a stale or
missing slot whichever CTA it reads); when every thread of the cluster waits there, the barrier opens and the round
repeats. So no
two CTAs use the static ``__shared__`` arrays at once, but an array does not keep a CTA's contents across a
cluster barrier (the other CTAs ran in between). Distributed shared memory is a table of the runtime:
``fz_cluster_put`` also stores its value there, under (slot address, rank), and ``fz_cluster_get`` reads it
there. Errors: a get of a slot that CTA never put, or of a CTA that has exited (its entries go then, as its
shared memory does on a GPU: a cluster kernel ends with a cluster barrier), a cluster barrier that waits for
threads that returned, and a ``__syncthreads()`` that waits for threads at the cluster barrier.
"""
from string import Template

from ..c_helpers import HELPERS
from . import templates

# once per translation unit, before any kernel's namespace
HEADER = r"""// fuser: the CUDA device environment on the host (fuser/cuda/host_prelude.py)
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __cluster_dims__(...)

struct fz_dim3 { unsigned int x, y, z; };
namespace fz_emu {
extern fz_dim3 thread_idx, block_idx, block_dim, grid_dim;
void syncthreads();
// thread block clusters (CLUSTER below)
unsigned cluster_rank();
void cluster_sync();
void cluster_put(const void* slot, const void* value, size_t size);
void cluster_get(const void* slot, unsigned rank, void* value, size_t size);
// dynamic shared memory (STAGE below): the running CTA's
unsigned char* dyn_smem();
typedef void (*entry_fn)(const void* args);
// what the server needs to know of one kernel: how to call it and where its FzArgs keeps the pointers
struct KernelInfo { const char* name; entry_fn entry; size_t args_size; size_t ptrs_offset; size_t n_ptrs; };
}  // namespace fz_emu
#define threadIdx (fz_emu::thread_idx)
#define blockIdx (fz_emu::block_idx)
#define blockDim (fz_emu::block_dim)
#define gridDim (fz_emu::grid_dim)
#define __syncthreads() fz_emu::syncthreads()

// warp shuffles: every thread of the block leaves its value in a slot, a barrier, it reads its source's slot, a
// barrier (the slots are free again). Stricter than CUDA's warp-wide exchange: every thread of the block must
// call it the same number of times, which the row kernels do (rows past the end take part too).
template <class T> inline T fz_emu_exchange(T v, unsigned src) {
  static T slots[1024];
  slots[fz_emu::thread_idx.x] = v;
  fz_emu::syncthreads();
  if (src >= fz_emu::block_dim.x) { fprintf(stderr, "fuser emulation: a shuffle reads past the block\n"); abort(); }
  const T r = slots[src];
  fz_emu::syncthreads();
  return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  (void)width;
  return fz_emu_exchange(v, fz_emu::thread_idx.x ^ (unsigned)lane_mask);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
  return fz_emu_exchange(v, (fz_emu::thread_idx.x & ~(unsigned)(width - 1)) + (unsigned)src);
}

static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return (unsigned int)(((unsigned long long)a * b) >> 32);
}
static inline int __clz(unsigned int x) { return x ? __builtin_clz(x) : 32; }
static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
static inline unsigned int __float_as_uint(float f) { unsigned int x; memcpy(&x, &f, 4); return x; }
static inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
static inline long long __double_as_longlong(double d) { long long x; memcpy(&x, &d, 8); return x; }
// ex2.approx.ftz.f32(x * log2(e)): results in the subnormal range are flushed to a zero of their sign
// (a macro: glibc's math.h declares a __expf of its own)
static inline float fz_emu_expf(float x) {
  const float r = exp2f(x * 0x1.715476p+0f);
  return fabsf(r) < 0x1p-126f ? copysignf(0.f, r) : r;
}
#define __expf(x) fz_emu_expf(x)
// div.approx.f32, x * (1 / y): the reciprocal of |y| > 2^126 is subnormal and flushed, so the quotient is
// a zero (or NaN for an infinite x)
static inline float __fdividef(float x, float y) {
  return fabsf(y) > 0x1p126f ? x * copysignf(0.f, y) : x / y;
}
"""

# float16 conversions on the host: GCC's _Float16 converts like PTX cvt (round to nearest even, overflow
# to infinity, NaN stays NaN; subnormals kept)
HALF_LOAD = r"""__device__ __forceinline__ float fz_ld(fz_half h) {
  _Float16 v; memcpy(&v, &h.x, 2); return (float)v;
}
"""
HALF_STORE = r"""template <> __device__ __forceinline__ fz_half fz_st<fz_half, float>(float f) {
  const _Float16 v = (_Float16)f; fz_half h; memcpy(&h.x, &v, 2); return h;
}
"""

# the host compiler keeps IEEE and wrapping semantics without an optimization barrier
OPAQUE = r"""__device__ __forceinline__ int fz_opaque(int x) { return x; }
__device__ __forceinline__ long long fz_opaque(long long x) { return x; }
"""

# ex2.approx.ftz.f32 and rcp.approx.ftz.f32: a subnormal operand is a zero of its sign, and so is a subnormal
# result (the approximation error is not modelled)
FAST_MATH = r"""static inline float fz_emu_flush(float x) { return fabsf(x) < 0x1p-126f ? copysignf(0.f, x) : x; }
__device__ __forceinline__ float fz_ex2_ftz(float x) { return fz_emu_flush(exp2f(fz_emu_flush(x))); }
__device__ __forceinline__ float fz_rcp_ftz(float x) { return fz_emu_flush(1.f / fz_emu_flush(x)); }
"""

# replaces templates.PRELUDE in each kernel's source
PRELUDE = templates.PRELUDE_TEMPLATE.substitute(half_load=HALF_LOAD, half_store=HALF_STORE, helpers=HELPERS,
                                                opaque=OPAQUE, fast_math=FAST_MATH)

# replaces templates.CLUSTER where a kernel's source has it. ``__shared__`` is one static copy for every CTA, so
# a put also leaves its value with the runtime, under (slot, the putting CTA's rank), and a get reads it there
CLUSTER = r"""// fuser: thread block clusters, on the host (fuser/cuda/host_prelude.py)
__device__ __forceinline__ unsigned fz_cluster_rank() { return fz_emu::cluster_rank(); }
__device__ __forceinline__ void fz_cluster_sync() { fz_emu::cluster_sync(); }
template <class A> __device__ __forceinline__ void fz_cluster_put(A* p, A v) {
  *p = v;
  fz_emu::cluster_put(p, &v, sizeof(A));
}
template <class A> __device__ __forceinline__ A fz_cluster_get(const A* p, unsigned rank) {
  static_assert(sizeof(A) == 4 || sizeof(A) == 8, "cluster slots of 4 or 8 bytes");
  A v;
  fz_emu::cluster_get(p, rank, &v, sizeof(A));
  return v;
}
"""

# replaces templates.STAGE where a kernel's source has it: the running CTA's dynamic shared memory
STAGE = r"""// fuser: dynamic shared memory, on the host (fuser/cuda/host_prelude.py)
__device__ __forceinline__ unsigned char* fz_dyn_smem() { return fz_emu::dyn_smem(); }
template <int B> __device__ __forceinline__ void fz_cp(void* dst, const void* src) {
  static_assert(B == 4 || B == 8 || B == 16, "copies of 4, 8 or 16 bytes");
  if (reinterpret_cast<uintptr_t>(dst) % B || reinterpret_cast<uintptr_t>(src) % B) {
    fprintf(stderr, "fuser emulation: a copy of %d bytes into shared memory is not aligned to them\n", B);
    abort();
  }
  memcpy(dst, src, B);
}
__device__ __forceinline__ void fz_cp_wait() {}
"""

# one kernel: its host source in a namespace of its own (preludes define the same names), and a
# non-template entry the server calls with a pointer to the FzArgs bytes
KERNEL_UNIT = Template(r"""namespace fzk_${name} {
${source}
static void fz_entry(const void* args) { ${name}(*static_cast<const FzArgs*>(args)); }
${entries}}  // namespace fzk_${name}
""")
# another kernel of the same source (fuser.cuda.emulate.Emulator.add's entries), launched by its own name
KERNEL_ENTRY = Template(r"""static void fz_entry_${entry}(const void* args) {
  ${entry}(*static_cast<const FzArgs*>(args));
}
""")

KERNEL_INFO = Template(r"""  {"${entry}", &fzk_${name}::${fn}, sizeof(fzk_${name}::FzArgs),
   offsetof(fzk_${name}::FzArgs, ptrs), sizeof(fzk_${name}::FzArgs::ptrs) / sizeof(void*)},""")

# a batch of kernels, compiled to its own object (batches compile in parallel)
BATCH_UNIT = Template(r"""${header}
${kernels}
extern const fz_emu::KernelInfo fz_batch_${index}[] = {
${infos}
};
extern const size_t fz_batch_${index}_size = sizeof(fz_batch_${index}) / sizeof(fz_batch_${index}[0]);
""")

BATCH_DECL = Template(r"""extern const fz_emu::KernelInfo fz_batch_${index}[];
extern const size_t fz_batch_${index}_size;""")

# the fiber runtime and the server: requests on stdin, results on stdout (fuser.cuda.emulate writes and
# reads this protocol; all numbers little-endian)
#   request:  u32 name length, name, u32 grid, u32 block, u32 cluster (CTAs per cluster, 1 to 16, dividing
#             grid), u32 dynamic shared memory bytes a CTA, u32 args length, FzArgs bytes, u32 tensors,
#             per tensor: u64 address the launcher put in FzArgs, u64 bytes, u32 is output, then an input's
#             bytes (the span of memory its view may address)
#   response: u32 0, then per output u64 bytes and the bytes; or u32 1, u32 length, a message
# A sanitizer report ends the process (its log is a file the emulator reads).
MAIN_UNIT = Template(r"""${header}
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#include <string>
#include <unordered_map>
#include <vector>

${batch_decls}

namespace fz_emu {
fz_dim3 thread_idx, block_idx, block_dim, grid_dim;

namespace {
// AT_BARRIER: in __syncthreads(); AT_CLUSTER: in fz_cluster_sync()
enum State { READY, AT_BARRIER, AT_CLUSTER, DONE };
// ASan's redzones make frames several times their size
const size_t kStackSize = 256 << 10;
struct Fiber { ucontext_t context; char* stack; State state; };
std::vector<Fiber> fibers;  // fiber t of a cluster: thread t % block of its CTA t / block
ucontext_t scheduler;
const void* scheduler_bottom = nullptr;
size_t scheduler_size = 0;
unsigned current = 0;
entry_fn entry = nullptr;
const void* entry_args = nullptr;
const char* running = "(none)";
// the running cluster: its first block, its CTAs, the running fiber's CTA
unsigned cluster_base = 0, cluster_ctas = 1, rank = 0;
// what each CTA of the running cluster put, by slot address (a CTA's entries go when it exits)
std::vector<std::unordered_map<const void*, uint64_t>> puts;
std::vector<bool> exited;
// the launch's dynamic shared memory a CTA, and the running cluster's blocks of it (one a CTA)
uint32_t smem_bytes = 0;
std::vector<unsigned char*> smem;

void to_scheduler(bool finished) {
  void* fake_stack = nullptr;
  // a finished fiber's stack is dead to ASan (nullptr); a parked one keeps it
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake_stack, scheduler_bottom, scheduler_size);
  swapcontext(&fibers[current].context, &scheduler);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
}

void fiber_main() {
  __sanitizer_finish_switch_fiber(nullptr, &scheduler_bottom, &scheduler_size);
  entry(entry_args);
  fibers[current].state = DONE;
  to_scheduler(true);
}

void resume(unsigned t) {
  current = t;
  rank = t / block_dim.x;
  thread_idx = {t % block_dim.x, 0, 0};
  block_idx = {cluster_base + rank, 0, 0};
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, fibers[t].stack, kStackSize);
  swapcontext(&scheduler, &fibers[t].context);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
}

[[noreturn]] __attribute__((format(printf, 1, 2))) void fail(const char* what, ...) {
  fprintf(stderr, "fuser emulation: ");
  va_list rest;
  va_start(rest, what);
  vfprintf(stderr, what, rest);
  va_end(rest);
  fprintf(stderr, " (kernel %s, block %u)\n", running, block_idx.x);
  abort();
}

// Runs CTA r's fibers in phases (each __syncthreads() ends one; the next runs them in the other order) until
// every one waits at the cluster barrier or has returned. True when all have returned.
bool run_cta(unsigned r, unsigned& phase) {
  const unsigned n = block_dim.x, first = r * n;
  for (;; ++phase) {
    for (unsigned k = 0; k < n; ++k) {
      const unsigned t = first + (phase % 2 ? n - 1 - k : k);
      if (fibers[t].state == READY) resume(t);
    }
    unsigned done = 0, synced = 0;
    for (unsigned t = first; t < first + n; ++t) {
      done += fibers[t].state == DONE;
      synced += fibers[t].state == AT_BARRIER;
    }
    if (synced == 0) {
      ++phase;
      return done == n;
    }
    if (done) fail("__syncthreads() waits for threads that have returned");
    if (synced < n) fail("__syncthreads() waits for threads that wait at the cluster barrier");
    for (unsigned t = first; t < first + n; ++t) fibers[t].state = READY;
  }
}

// Cluster c: its CTAs one after another, each up to the cluster barrier (so no two use the static __shared__
// arrays at once), in rank order and the reverse in turn (a get that lacks its barrier sees the other CTAs' puts
// of one round or the next); when all wait there, the barrier opens and they run again, until all have returned.
void run_cluster(unsigned c) {
  const unsigned n = cluster_ctas * block_dim.x;
  cluster_base = c * cluster_ctas;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = fibers[t];
    // the stack's top holds fiber_main's frame, which never returns: clear what ASan marked there
    __asan_unpoison_memory_region(f.stack + kStackSize - (64 << 10), 64 << 10);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackSize;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
    f.state = READY;
  }
  puts.assign(cluster_ctas, {});
  exited.assign(cluster_ctas, false);
  smem.assign(cluster_ctas, nullptr);
  for (unsigned r = 0; r < cluster_ctas; ++r) {
    smem[r] = static_cast<unsigned char*>(malloc(smem_bytes + (smem_bytes == 0)));
    if (!smem[r]) fail("no memory for dynamic shared memory");
    memset(smem[r], 0xbe, smem_bytes);
  }
  struct FreeSmem { ~FreeSmem() { for (unsigned char* b : smem) free(b); smem.clear(); } } free_smem;
  std::vector<unsigned> phases(cluster_ctas, 0);
  for (unsigned round = 0;; ++round) {
    for (unsigned k = 0; k < cluster_ctas; ++k) {
      const unsigned r = round % 2 ? cluster_ctas - 1 - k : k;  // the other order each round
      if (!exited[r] && run_cta(r, phases[r])) {
        exited[r] = true;
        puts[r].clear();
      }
    }
    unsigned done = 0;
    for (unsigned t = 0; t < n; ++t) done += fibers[t].state == DONE;
    if (done == n) return;
    if (done) {  // name a thread that returned
      unsigned t = 0;
      while (fibers[t].state != DONE) ++t;
      block_idx = {cluster_base + t / block_dim.x, 0, 0};
      fail("fz_cluster_sync() waits for threads that have returned, among them thread %u", t % block_dim.x);
    }
    for (unsigned t = 0; t < n; ++t) fibers[t].state = READY;
  }
}
}  // namespace

void syncthreads() {
  fibers[current].state = AT_BARRIER;
  to_scheduler(false);
}

unsigned cluster_rank() { return rank; }

unsigned char* dyn_smem() {
  if (smem_bytes == 0) fail("a kernel uses dynamic shared memory, and its launch gave it none");
  return smem[rank];
}

void cluster_sync() {
  fibers[current].state = AT_CLUSTER;
  to_scheduler(false);
}

void cluster_put(const void* slot, const void* value, size_t size) {
  uint64_t& bits = puts[rank][slot];
  memcpy(&bits, value, size);
}

void cluster_get(const void* slot, unsigned r, void* value, size_t size) {
  if (r >= cluster_ctas) fail("fz_cluster_get() reads CTA %u of a cluster of %u", r, cluster_ctas);
  if (exited[r])
    fail("fz_cluster_get() reads the shared memory of CTA %u (block %u), which has exited", r, cluster_base + r);
  const auto found = puts[r].find(slot);
  if (found == puts[r].end()) fail("fz_cluster_get() reads a slot that CTA %u never put", r);
  memcpy(value, &found->second, size);
}

void launch(const KernelInfo& k, const void* args, unsigned grid, unsigned block, unsigned cluster, uint32_t shared) {
  while (fibers.size() < (size_t)cluster * block) {
    void* stack = mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
    if (stack == MAP_FAILED) fail("no memory for a fiber stack");
    fibers.push_back(Fiber{{}, static_cast<char*>(stack), DONE});
  }
  entry = k.entry;
  entry_args = args;
  running = k.name;
  grid_dim = {grid, 1, 1};
  block_dim = {block, 1, 1};
  cluster_ctas = cluster;
  smem_bytes = shared;
  for (unsigned c = 0; c < grid / cluster; ++c) run_cluster(c);
  running = "(none)";
}
}  // namespace fz_emu

namespace {
void death_note() {
  fprintf(stderr, "fuser emulation: died in kernel %s, block %u, thread %u\n", fz_emu::running,
          fz_emu::block_idx.x, fz_emu::thread_idx.x);
}

bool read_exact(void* p, size_t n) { return n == 0 || fread(p, 1, n, stdin) == n; }
template <class T> T read_value() {
  T v;
  if (!read_exact(&v, sizeof v)) exit(3);  // the emulator went away mid-request
  return v;
}
void write_exact(const void* p, size_t n) {
  if (n && fwrite(p, 1, n, stdout) != n) exit(4);
}
void reply_error(const std::string& message) {
  const uint32_t status = 1, n = (uint32_t)message.size();
  write_exact(&status, 4);
  write_exact(&n, 4);
  write_exact(message.data(), n);
  fflush(stdout);
}

// one tensor in a heap block of exactly its span, at the launcher's address modulo 16 (the vector path
// was chosen for that alignment); the bytes before it are poisoned, so both ends are redzones to ASan
// (ASan tracks 8-byte granules: a view starting mid-granule leaves up to 7 bytes before it unguarded)
struct Buffer {
  char* block = nullptr;
  char* data = nullptr;
  size_t lead = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (block) {
      __asan_unpoison_memory_region(block, lead);
      free(block);
    }
  }
};
}  // namespace

int main() {
  __sanitizer_set_death_callback(death_note);
  std::unordered_map<std::string, const fz_emu::KernelInfo*> kernels;
  const struct { const fz_emu::KernelInfo* infos; size_t n; } batches[] = {${batch_refs}};
  for (const auto& b : batches)
    for (size_t i = 0; i < b.n; ++i) kernels[b.infos[i].name] = &b.infos[i];
  for (;;) {
    uint32_t name_size;
    if (fread(&name_size, 1, 4, stdin) != 4) return 0;  // no more requests
    std::string name(name_size, '\0');
    if (!read_exact(&name[0], name_size)) return 3;
    const uint32_t grid = read_value<uint32_t>(), block = read_value<uint32_t>();
    const uint32_t cluster = read_value<uint32_t>();
    const uint32_t shared = read_value<uint32_t>();
    const uint32_t args_size = read_value<uint32_t>();
    std::vector<char> args(args_size);
    if (!read_exact(args.data(), args_size)) return 3;
    const uint32_t n_tensors = read_value<uint32_t>();
    std::vector<Buffer> buffers(n_tensors);
    std::vector<uint64_t> addresses(n_tensors), sizes(n_tensors);
    std::vector<uint32_t> is_output(n_tensors);
    std::vector<std::vector<char>> sent(n_tensors);
    for (uint32_t k = 0; k < n_tensors; ++k) {
      addresses[k] = read_value<uint64_t>();
      sizes[k] = read_value<uint64_t>();
      is_output[k] = read_value<uint32_t>();
      Buffer& b = buffers[k];
      b.lead = addresses[k] % 16;
      if (posix_memalign(reinterpret_cast<void**>(&b.block), 16, b.lead + sizes[k] + (sizes[k] == 0))) return 5;
      __asan_poison_memory_region(b.block, b.lead);
      b.data = b.block + b.lead;
      if (is_output[k]) {
        memset(b.data, 0xbe, sizes[k]);  // what the kernel does not write shows as 0xbe bytes
      } else {
        sent[k].resize(sizes[k]);
        if (!read_exact(sent[k].data(), sizes[k])) return 3;
        if (sizes[k]) memcpy(b.data, sent[k].data(), sizes[k]);
      }
    }
    auto found = kernels.find(name);
    if (found == kernels.end()) {
      reply_error("no kernel " + name + " in this executable");
      continue;
    }
    const fz_emu::KernelInfo& info = *found->second;
    if (args_size != info.args_size) {
      reply_error("FzArgs is " + std::to_string(info.args_size) + " bytes in kernel " + name +
                  " but the launcher filled " + std::to_string(args_size) +
                  ": its ctypes mirror disagrees with the kernel's struct");
      continue;
    }
    if (n_tensors != info.n_ptrs) {
      reply_error("kernel " + name + " takes " + std::to_string(info.n_ptrs) + " pointers, the launch sent " +
                  std::to_string(n_tensors) + " tensors");
      continue;
    }
    if (cluster < 1 || cluster > 16 || grid % cluster != 0) {
      reply_error("kernel " + name + " launched on " + std::to_string(grid) + " blocks in clusters of " +
                  std::to_string(cluster) + ": a cluster has 1 to 16 blocks, and the grid whole clusters");
      continue;
    }
    // an exact-size copy of the argument bytes, the launcher's addresses replaced by the buffers'
    void* launch_args = malloc(args_size);
    memcpy(launch_args, args.data(), args_size);
    char* ptrs = static_cast<char*>(launch_args) + info.ptrs_offset;
    std::string mismatch;
    for (uint32_t k = 0; k < n_tensors; ++k) {
      uint64_t p;
      memcpy(&p, ptrs + 8 * k, 8);
      if (p != addresses[k] && mismatch.empty())
        mismatch = "FzArgs.ptrs[" + std::to_string(k) + "] of kernel " + name + " is not the address of tensor " +
                   std::to_string(k) + ": the launcher's struct layout disagrees with the kernel's";
      memcpy(ptrs + 8 * k, &buffers[k].data, 8);
    }
    if (!mismatch.empty()) {
      free(launch_args);
      reply_error(mismatch);
      continue;
    }
    alarm(${timeout_s});  // a kernel that never ends is killed (SIGALRM) rather than hanging the tests
    fz_emu::launch(info, launch_args, grid, block, cluster, shared);
    alarm(0);
    free(launch_args);
    for (uint32_t k = 0; k < n_tensors; ++k)
      if (!is_output[k] && sizes[k] && memcmp(buffers[k].data, sent[k].data(), sizes[k]) != 0) {
        mismatch = "kernel " + name + " wrote into input " + std::to_string(k);
        break;
      }
    if (!mismatch.empty()) {
      reply_error(mismatch);
      continue;
    }
    const uint32_t ok = 0;
    write_exact(&ok, 4);
    for (uint32_t k = 0; k < n_tensors; ++k)
      if (is_output[k]) {
        write_exact(&sizes[k], 8);
        write_exact(buffers[k].data, sizes[k]);
      }
    fflush(stdout);
  }
}
""")
