// fuser's native hot path: the kernel of the TorchScript operator fuser::fusion_group in C++.
//
// A call whose inputs match a signature prepared by Python (fuser/native/record.py) allocates its outputs and
// launches the compiled kernel here: the CPU kernel's function, or cuLaunchKernel on torch's current stream. Every
// other call (a new signature, a transform, a random kernel while the stream captures a graph, a lazy tensor bit,
// autograd where no backward was prepared) goes to the Python operator fuser::fusion_group_py, which runs the group
// as before and, when asked to, prepares the signature for next time. Nothing here decides anything about a group:
// it replays what Python prepared (a random kernel's launch state drawn as Python draws it), or hands over.
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <dlfcn.h>
#include <sys/mman.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using CuLaunch = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);
using CuCtxGetCurrent = int (*)(void**);
using CuStreamIsCapturing = int (*)(void*, int*);
using CpuKernel = void (*)(int64_t, int64_t, const int64_t*, const int64_t*, void* const*, const double*);

enum Kind : int64_t { kCpu = 0, kCuda = 1, kPython = 2 };

struct Out {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  int64_t pieces = 1, step = 0;  // a cat's result: the kernel writes it through one pointer per piece, step bytes apart
};

// A buffer a CUDA launch allocates per call (through the caching allocator, on the current stream, released once the
// launches are queued: later work on that stream runs after them): its pointer follows the outputs'.
struct Temp {
  c10::ScalarType dtype;
  int64_t numel = 0;  // 0: a null pointer
};

// A kernel launched after the first, on the same argument struct; an int32 written into it first (a stage number).
struct Then {
  void* fn = nullptr;
  int64_t grid = 0, block = 0;
  int64_t patch_off = -1;  // -1: nothing written
  int32_t patch = 0;
};

enum Form : int64_t { kPlainForm = 0, kRowSums = 1, kColumns = 2 };

struct Limit {
  int64_t index;
  bool nonfinite;
  double lo, hi;
};

struct Backward;

// One group a summing backward launches (see Backward::steps).
struct SumStep {
  int64_t key = 0, kind = 0, n_out = 0;  // kind: 0 a part, 1 a fused form, 2 a column group
  std::string digest;
  std::vector<std::pair<int64_t, int64_t>> inputs;  // (-1, the backward's input) or (an earlier step, its output)
};

// One prepared input signature of one group: what to check, what to allocate, what to launch.
struct Launch {
  std::vector<int64_t> sig;  // per tensor: dtype, device type, device index, dim, sizes, strides
  int64_t n_tensors = 0, n_scalars = 0;
  int64_t kind = kPython;
  int64_t numel = 0;
  c10::Device device{c10::kCPU};
  std::vector<Out> outs;
  int64_t n_kernel_outs = 0;  // the pointers the kernel writes through (a cat's result: one per piece)
  std::vector<Limit> limits;
  void* fn = nullptr;
  // CPU
  int64_t rank = 0;
  std::vector<int64_t> sizes, strides;
  // CPU and CUDA
  bool random = false;  // the kernel draws rand_like's numbers: a launch state after the float arguments
  // CUDA: the by-value argument struct with everything but pointers, the vector flag and float arguments
  std::vector<uint8_t> args;
  int64_t ptrs_off = 0, vec_off = 0, scalars_off = 0, block = 0, grid_vec = 0, grid_scalar = 0;
  int64_t smem = 0;  // the first kernel's dynamic shared memory (a staged row kernel's)
  int64_t vec_shape = 0;  // 0: no vectors; 1: where the pointers are aligned; 2: vectors only (else Python's)
  void* ctx = nullptr;
  std::vector<int64_t> align;  // per pointer (inputs, outputs): bytes the vector path needs, 0: any
  int64_t form = kPlainForm;  // a row kernel with column sums, a column kernel: counted (stats)
  std::vector<Temp> temps;  // a row kernel's partial rows, a column kernel's workspace
  std::vector<Then> then;  // the column sums' second kernel, a column kernel's stage 1
  // training (a call autograd records): which inputs require grad, and the backward
  std::vector<uint8_t> requires_grad;
  std::shared_ptr<const Backward> backward;
};

// The backward of a group call recorded by the hot path: the backward group of the pattern where every
// differentiable output gets a gradient, run through fuser::fusion_group (this hot path, or Python); any other
// pattern, or no backward group, through the Python operator fuser::fusion_group_backward_py.
struct Backward {
  int64_t key = 0;  // the forward group's, for fusion_group_backward_py
  std::string digest;
  std::vector<int64_t> py_meta;  // what fusion_group_backward_py needs to rebuild the call
  std::vector<uint8_t> saved;  // per tensor input: saved for the backward
  std::vector<uint8_t> differentiable;  // per output
  std::vector<uint8_t> saved_out;  // per output: saved for the backward (a softmax's result, which it reads)
  // the outputs the call returns; the kernel's others are extra outputs the backward alone reads (values a CPU
  // backward reads saved, fuser/saving.py): saved, never returned, and recomputed under create_graph (Python's)
  int64_t n_visible = 0;
  bool has_group = false;
  int64_t bw_key = 0;
  std::string bw_digest;
  // per backward input: (0 tensor, 1 float, 2 output grad, 3 saved output), index
  std::vector<std::pair<int64_t, int64_t>> inputs;
  std::vector<int64_t> grad_inputs;  // per backward output: the forward tensor input it is the gradient of
  std::vector<int64_t> zero_inputs;  // forward tensor inputs whose gradient is zero
  std::vector<std::pair<int64_t, int64_t>> aliases;  // (forward tensor input, backward output) sharing a gradient
  // per tensor whose every chunk along dim is a tensor input (autodiff._chunked_inputs): those inputs, in chunk
  // order. The node's edge for the first is that tensor's, the others have none, and the first's gradient is the
  // whole tensor's (the backward group's cat output, or Python's)
  struct Chunks {
    int64_t dim = 0;
    std::vector<int64_t> inputs;
  };
  std::vector<Chunks> chunks;
  // where inputs' gradients are summed over the rows (a bias, a norm's weight and bias): the groups
  // fuser/grad_sums.py's run launches instead, run when grad mode is off (as Python's backward does): a row
  // backward's fused form (the sums inside its row kernel), or a backward's main group and column groups
  std::vector<SumStep> steps;
  std::vector<std::array<int64_t, 3>> step_takes;  // (forward tensor input, step, its output)
};

constexpr size_t kMaxPerGroup = 64;

struct Group {
  std::string digest;
  std::vector<std::shared_ptr<const Launch>> launches;
};

std::shared_mutex table_mutex;
std::unordered_map<int64_t, Group> table;
// Bumped by every change of the table (under its lock): a thread's last hit (see LastHit) is good while it holds.
std::atomic<uint64_t> table_generation{0};

// The launch this thread's last served call took, for its group (key, digest): the next call of the same signature
// takes it without the table's lock, its lookup and a shared_ptr copy (about 60 ns of a 3 us call on the CPU).
struct LastHit {
  int64_t key = -1;
  uint64_t generation = 0;
  std::string digest;
  std::shared_ptr<const Launch> launch;
};
thread_local LastHit last_hit;
std::atomic<int64_t> n_hits{0}, n_misses{0}, n_handed{0}, n_fused{0}, n_columns{0}, n_split{0};
std::atomic<int64_t> n_cuda_row_sums{0}, n_cuda_column_kernels{0};  // CUDA launches of those forms
std::atomic<int64_t> n_new_blocks{0};  // blocks the CPU block cache took from the heap (see BlockAllocator)

// A CPU output of more than kHugeMin bytes asks the kernel for transparent huge pages (madvise MADV_HUGEPAGE over its
// whole 2 MB pages) before the kernel first writes it: a fresh allocation of that size is a new mapping (glibc maps
// every block above 32 MB on its own; one of 32 MB or less may sit in the heap, whose mapping the hint would mark for
// every later block there), and its first touch faults a page at a time. Where THP is in "madvise" mode (the
// usual default) that is 512 times fewer faults; in "always" mode the pages are huge already, in "never" the hint does
// nothing. On a 2-core Xeon VM (madvise mode), allocating and filling 256 MB of float32: 144-156 ms, with the hint
// 40-58 ms. FUSER_CPU_HUGE_PAGES=0 turns it off (read once).
constexpr size_t kHugePage = size_t(2) << 20, kHugeMin = size_t(32) << 20;

bool huge_pages_on() {
  static const bool on = [] {
    const char* v = std::getenv("FUSER_CPU_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

void advise_huge_pages(const at::Tensor& t) {
#ifdef MADV_HUGEPAGE
  const size_t n = t.storage().nbytes();
  if (n <= kHugeMin || !huge_pages_on()) return;
  const auto p = reinterpret_cast<uintptr_t>(t.storage().data());
  const uintptr_t first = (p + kHugePage - 1) & ~(kHugePage - 1), end = (p + n) & ~(kHugePage - 1);
  if (end > first) madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE);  // a hint: a failure is none
#endif
}

// Small CPU outputs (up to kSmallMax bytes) come from blocks this thread keeps: each size class (a power of two from
// 64 bytes) holds up to kPerClass freed blocks for the next output of its size, where c10's CPU allocator calls
// posix_memalign and free for every tensor (glibc's aligned path, its free consolidating the heap: about 0.2 us of a
// 3 us call of a small group on a 2-core EPYC). A block is freed into the cache of the thread that drops the tensor,
// or to the heap when that cache is full or its thread is exiting. The storage keeps this allocator, so resize_
// works as on any CPU tensor; larger sizes are large blocks (below). FUSER_CPU_BLOCK_CACHE=0 turns it off (read once).
constexpr size_t kSmallMax = size_t(64) << 10, kBlockHeader = 64, kMinBlock = 64;
constexpr int kClasses = 11, kPerClass = 8;  // 64 B .. 64 KB

struct BlockCache {
  std::array<std::array<void*, kPerClass>, kClasses> blocks{};
  std::array<int, kClasses> n{};
  ~BlockCache();
};
thread_local bool block_cache_gone = false;  // (trivial: readable while the thread's objects are destroyed)
thread_local BlockCache block_cache;
BlockCache::~BlockCache() {
  block_cache_gone = true;
  for (int c = 0; c < kClasses; ++c)
    for (int k = 0; k < n[c]; ++k) std::free(blocks[c][k]);
}

void release_block(void* base) {
  const int c = *static_cast<const int*>(base);
  if (!block_cache_gone) {
    BlockCache& cache = block_cache;
    if (cache.n[c] < kPerClass) {
      cache.blocks[c][cache.n[c]++] = base;
      return;
    }
  }
  std::free(base);
}

// Larger CPU outputs (more than kSmallMax bytes) come from a process-wide cache of freed large blocks, at most
// kLargeBlocks of them and kLargeKeep bytes together: a call's output reuses the block of an output freed since,
// whose pages are mapped already. A fresh block is a new mapping whose every page the kernel's first writes fault in
// (2 MB at a time with huge pages) and zero: part of each large call's time, and on a VM that reports freed memory
// to its host (Firecracker's free page reporting), mapped again on the host's side after other code freed a lot: a
// 2-core EPYC VM, gelu_bias_transposed float32 [16384 x 4096] (a 256 MB output), 70-80 ms a call, 150-300 ms right
// after eager's calls of the same function freed gigabytes (same faults, 230-280 ms more system time). A block
// serves an output of its size or up to an eighth smaller. Blocks of kHugeMin bytes or less are whole 4 KB pages from
// the heap: c10's allocator gave those to glibc, whose heap handed a freed 16 MB block back to the kernel and faulted
// it in again where other code's frees had trimmed it (softmax_scale_r16k_train float32 [256 x 16384] on the 2-core
// EPYC, in the benchmark's process: 2,478 page faults and 3.5 ms of system time in a 7.9 ms step).
// FUSER_CPU_BLOCK_CACHE=0 turns it off with the small one.
constexpr size_t kLargeKeep = size_t(1) << 30;
// blocks kept, per kind: up to kHugeMin bytes, and above (huge pages): a step that frees many mid-size outputs does
// not push out the huge-page blocks of the large ones
constexpr std::array<size_t, 2> kLargeBlocks{8, 4};
std::atomic<int64_t> n_new_large{0};  // large blocks mapped (see LargeCache)

struct LargeBlock {
  void* base;
  size_t bytes;
};
struct LargeCache {
  std::mutex mu;
  std::array<std::vector<LargeBlock*>, 2> blocks;  // freed, per kind (huge: more than kHugeMin bytes), the latest last
  size_t bytes = 0;
  ~LargeCache();
};
int large_kind(size_t bytes) { return bytes > kHugeMin ? 1 : 0; }
std::atomic<bool> large_cache_gone{false};
LargeCache large_cache;
LargeCache::~LargeCache() {
  large_cache_gone = true;
  for (auto& kind : blocks) {
    for (LargeBlock* b : kind) {
      std::free(b->base);
      delete b;
    }
  }
}

// A freed block joins the cache, the oldest of its kind leaving it (to the heap) where that kind would hold more than
// kLargeBlocks, then the oldest of either where the cache would hold more than kLargeKeep bytes: blocks of sizes no
// call takes any more do not stay.
void release_large(void* ctx) {
  auto* b = static_cast<LargeBlock*>(ctx);
  std::vector<LargeBlock*> gone;
  if (!large_cache_gone && b->bytes <= kLargeKeep) {
    std::lock_guard<std::mutex> guard(large_cache.mu);
    const int kind = large_kind(b->bytes);
    const auto evict = [&](std::vector<LargeBlock*>& from) {
      large_cache.bytes -= from.front()->bytes;
      gone.push_back(from.front());
      from.erase(from.begin());
    };
    auto& mine = large_cache.blocks[kind];
    while (mine.size() >= kLargeBlocks[kind]) evict(mine);
    for (int k : {kind, 1 - kind}) {
      auto& from = large_cache.blocks[k];
      while (!from.empty() && large_cache.bytes + b->bytes > kLargeKeep) evict(from);
    }
    mine.push_back(b);
    large_cache.bytes += b->bytes;
  } else {
    gone.push_back(b);
  }
  for (LargeBlock* g : gone) {  // (outside the lock: freeing a mapping takes the kernel's time)
    std::free(g->base);
    delete g;
  }
}

c10::DataPtr allocate_large(size_t nbytes) {
  // huge pages above kHugeMin; below it, whole 4 KB pages at c10's alignment (64 bytes)
  const bool huge = nbytes > kHugeMin;
  const size_t align = huge ? kHugePage : kBlockHeader, page = huge ? kHugePage : size_t(4096);
  const size_t bytes = (nbytes + page - 1) & ~(page - 1);
  LargeBlock* b = nullptr;
  {
    std::lock_guard<std::mutex> guard(large_cache.mu);
    auto& cached = large_cache.blocks[large_kind(bytes)];
    int best = -1;
    for (int k = (int)cached.size() - 1; k >= 0; --k)  // the smallest that fits, the latest of equals
      if (cached[k]->bytes >= bytes && cached[k]->bytes - bytes <= cached[k]->bytes / 8 &&
          (best < 0 || cached[k]->bytes < cached[best]->bytes))
        best = k;
    if (best >= 0) {
      b = cached[best];
      cached.erase(cached.begin() + best);
      large_cache.bytes -= b->bytes;
    }
  }
  if (b == nullptr) {
    void* base = std::aligned_alloc(align, bytes);
    if (base == nullptr) return at::getCPUAllocator()->allocate(nbytes);  // (c10's raises its out-of-memory error)
    n_new_large.fetch_add(1, std::memory_order_relaxed);
#ifdef MADV_HUGEPAGE
    if (huge && huge_pages_on()) madvise(base, bytes, MADV_HUGEPAGE);  // before the first write (advise_huge_pages)
#endif
    b = new LargeBlock{base, bytes};
  }
  return {b->base, b, &release_large, c10::Device(c10::DeviceType::CPU)};
}

struct BlockAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes > kSmallMax) return allocate_large(nbytes);
    if (nbytes == 0) return at::getCPUAllocator()->allocate(nbytes);
    int c = 0;
    while ((kMinBlock << c) < nbytes) ++c;
    void* base = nullptr;
    if (!block_cache_gone && block_cache.n[c] > 0) base = block_cache.blocks[c][--block_cache.n[c]];
    if (base == nullptr) {
      n_new_blocks.fetch_add(1, std::memory_order_relaxed);
      base = std::aligned_alloc(kBlockHeader, kBlockHeader + (kMinBlock << c));
      if (base == nullptr) return at::getCPUAllocator()->allocate(nbytes);  // (c10's raises its out-of-memory error)
      *static_cast<int*>(base) = c;
    }
    return {static_cast<char*>(base) + kBlockHeader, base, &release_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};
BlockAllocator block_allocator;

at::Tensor empty_cpu_output(const Out& o) {
  static const bool cached = [] {
    const char* v = std::getenv("FUSER_CPU_BLOCK_CACHE");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (!cached) {
    at::Tensor t = at::detail::empty_strided_cpu(o.sizes, o.strides, o.dtype);
    advise_huge_pages(t);
    return t;
  }
  return at::detail::empty_strided_generic(o.sizes, o.strides, &block_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::CPU), o.dtype);
}

// A CUDA output on the current device, which is `device` (fusion_group checked it): the allocator at::empty_strided
// takes (torch's CUDA caching allocator, on the current stream; a graph capture's pool while one captures), called
// without the dispatcher's round trip and its device guard (about 1 us of a 10 us call on an H200's host, 2 of them
// for two outputs). The allocator is the one the first output of this process came from: torch allows no other once
// it has allocated (CUDAPluggableAllocator's swap refuses an initialized allocator).
std::atomic<c10::Allocator*> cuda_allocator{nullptr};

at::Tensor empty_cuda_output(const Out& o, c10::Device device) {
  c10::Allocator* a = cuda_allocator.load(std::memory_order_acquire);
  if (a == nullptr) {
    at::Tensor t = at::empty_strided(o.sizes, o.strides, at::TensorOptions().device(device).dtype(o.dtype));
    if (c10::Allocator* taken = t.storage().allocator()) cuda_allocator.store(taken, std::memory_order_release);
    return t;
  }
  return at::detail::empty_strided_generic(o.sizes, o.strides, a, c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                           o.dtype);
}

// The host time of a served call by phase (fuser.native.PHASES; the benchmark's breakdown): off unless
// _native_phases turned it on, when each served call adds its phases' steady-clock times (one branch a phase
// otherwise). A call handed to Python adds nothing.
enum Phase { kClassify, kLookup, kChecks, kAlloc, kPack, kLaunch, kRecord, kPhases };
std::atomic<bool> timing{false};
std::array<std::atomic<int64_t>, kPhases> phase_ns{};
std::atomic<int64_t> n_timed{0};

struct PhaseTimer {
  bool on = false;
  std::chrono::steady_clock::time_point last;
  std::array<int64_t, kPhases> ns{};
  void start() {
    on = timing.load(std::memory_order_relaxed);
    if (!on) return;
    ns.fill(0);
    last = std::chrono::steady_clock::now();
  }
  void mark(Phase p) {  // the time since the last mark is phase p's
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    ns[p] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
    last = now;
  }
  void served() {
    if (!on) return;
    for (int p = 0; p < kPhases; ++p) phase_ns[p].fetch_add(ns[p], std::memory_order_relaxed);
    n_timed.fetch_add(1, std::memory_order_relaxed);
    on = false;
  }
};
thread_local PhaseTimer timer;

// [calls timed, ns of each phase] since the last call, the counts reset; timing on from now on or not
std::vector<int64_t> phases(bool on) {
  timing.store(on);
  std::vector<int64_t> out{n_timed.exchange(0)};
  for (auto& p : phase_ns) out.push_back(p.exchange(0));
  return out;
}

CuLaunch cu_launch = nullptr;
CuCtxGetCurrent cu_ctx_get_current = nullptr;
CuStreamIsCapturing cu_stream_is_capturing = nullptr;
std::once_flag cuda_once;

void load_driver() {
  std::call_once(cuda_once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) return;
    cu_launch = reinterpret_cast<CuLaunch>(dlsym(lib, "cuLaunchKernel"));
    cu_ctx_get_current = reinterpret_cast<CuCtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
    cu_stream_is_capturing = reinterpret_cast<CuStreamIsCapturing>(dlsym(lib, "cuStreamIsCapturing"));
  });
}

// Keys a plain dense tensor carries besides its backend's: autograd, autocast, ADInplaceOrView. Anything else (a
// negated, conjugated or zero tensor, a Python subclass, a functorch wrapper, a sparse or nested layout) is not a
// plain tensor's memory: Python decides.
const c10::DispatchKeySet kIgnored = c10::autograd_dispatch_keyset | c10::autocast_dispatch_keyset |
                                     c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);
const c10::DispatchKeySet kPlainCpu(c10::DispatchKey::CPU);
const c10::DispatchKeySet kPlainCuda(c10::DispatchKey::CUDA);

// A group input of a chunked call as the hot path reads it (see chunked_call): chunk `index` of equal parts of
// `len` along `dim` of the argument `arg`, described without a tensor of its own (a TensorImpl made and freed per
// chunk per call cost more than the rest of a small call's checks); dim -1: the argument itself.
struct InView {
  const at::Tensor* arg = nullptr;
  int64_t dim = -1, len = 0, index = 0;
};

const at::Tensor& tensor_of(const at::Tensor& t) { return t; }
const at::Tensor& tensor_of(const InView& v) { return *v.arg; }
void* data_of(const at::Tensor& t) { return t.data_ptr(); }
void* data_of(const InView& v) {
  char* p = static_cast<char*>(v.arg->data_ptr());
  return v.dim < 0 ? p : p + v.index * v.len * v.arg->stride(v.dim) * static_cast<int64_t>(v.arg->element_size());
}

template <class In>
bool matches(const Launch& l, c10::ArrayRef<In> inputs) {
  const int64_t* s = l.sig.data();
  for (const In& in : inputs) {
    const at::Tensor& t = tensor_of(in);
    if (static_cast<int64_t>(t.scalar_type()) != s[0]) return false;
    const c10::Device d = t.device();
    if (static_cast<int64_t>(d.type()) != s[1] || d.index() != s[2]) return false;
    const int64_t dim = t.dim();
    if (dim != s[3]) return false;
    s += 4;
    if constexpr (std::is_same_v<In, InView>) {
      const int64_t* sizes = t.sizes().data();
      for (int64_t k = 0; k < dim; ++k)
        if ((k == in.dim ? in.len : sizes[k]) != s[k]) return false;
    } else if (std::memcmp(t.sizes().data(), s, dim * sizeof(int64_t)) != 0) {
      return false;
    }
    s += dim;
    if (std::memcmp(t.strides().data(), s, dim * sizeof(int64_t)) != 0) return false;
    s += dim;
  }
  return true;
}

using PyGroup = std::vector<at::Tensor>(at::TensorList, at::ArrayRef<double>, int64_t, c10::string_view,
                                        c10::string_view, bool);

std::vector<at::Tensor> hand_over(at::TensorList inputs, at::ArrayRef<double> scalars, int64_t key,
                                  c10::string_view digest, c10::string_view ir, bool offer) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fuser::fusion_group_py", "").typed<PyGroup>();
  (offer ? n_misses : n_handed).fetch_add(1, std::memory_order_relaxed);
  return op.call(inputs, scalars, key, digest, ir, offer);
}

enum Call { kNotPlain, kPlain, kGrad };

// Whether the call may take a prepared launch at all (plain dense tensors, no forward-mode tangent, no functorch
// transform), and whether autograd must record it (grad mode on and an input requires grad).
Call classify(at::TensorList inputs) {
  if (inputs.empty()) return kNotPlain;
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) return kNotPlain;
  bool requires_grad = false;
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) return kNotPlain;
    const c10::DispatchKeySet rest = t.key_set() - kIgnored;
    if (rest != kPlainCpu && rest != kPlainCuda) return kNotPlain;
    if (t.unsafeGetTensorImpl()->autograd_meta() != nullptr) {
      if (t._fw_grad(0).defined()) return kNotPlain;
      requires_grad = requires_grad || t.requires_grad();
    }
  }
  return requires_grad && c10::GradMode::is_enabled() ? kGrad : kPlain;
}

// A random kernel's launch state: kStateSlots float slots after its float arguments (fuser.rng.N_STATE), the seed's
// and the offset's uint32 words, low word first (exact in the kernel's double slots), as fuser.rng.state_words
// writes them.
constexpr int64_t kStateSlots = 4;

// A record's random flag: the launch state's slot count (fuser.rng.N_STATE, which must be this file's), 0: none
bool state_slots(int64_t n) {
  TORCH_CHECK(n == 0 || n == kStateSlots, "fuser native record: a launch state of ", n, " slots, not ", kStateSlots);
  return n != 0;
}

std::vector<double> with_state(at::ArrayRef<double> scalars, uint64_t seed, uint64_t offset) {
  std::vector<double> all(scalars.begin(), scalars.end());
  for (const uint64_t x : {seed, offset}) {
    all.push_back(static_cast<double>(x & 0xFFFFFFFFull));
    all.push_back(static_cast<double>(x >> 32));
  }
  return all;
}

// A random CPU kernel's float arguments and its launch state, drawn as fuser.rng.launch_state draws it (the same
// op on the default CPU generator: a 63-bit seed and offset), so a run through this path draws the numbers the
// Python path would.
std::vector<double> with_launch_state(at::ArrayRef<double> scalars) {
  const at::Tensor drawn = at::empty({2}, at::kLong).random_();
  const int64_t* v = drawn.data_ptr<int64_t>();
  return with_state(scalars, static_cast<uint64_t>(v[0]), static_cast<uint64_t>(v[1]));
}

// A random CUDA kernel's float arguments and its launch state, drawn as fuser.rng.launch_state draws it: torch's
// default generator of the device, its seed and Philox offset, the offset advanced by 4 for the next launch (or
// eager op). nullopt while the current stream captures a graph (the generator refuses its offset then; Python's
// path falls back to eager's ops, which capture).
std::optional<std::vector<double>> with_cuda_launch_state(at::ArrayRef<double> scalars, c10::Device device) {
  if (cu_stream_is_capturing == nullptr) return std::nullopt;
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
  int capturing = 1;
  if (cu_stream_is_capturing(stream, &capturing) != 0 || capturing != 0) return std::nullopt;
  at::Generator gen = at::globalContext().defaultGenerator(device);
  uint64_t seed = 0, offset = 0;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    offset = gen.get_offset();
    gen.set_offset(offset + 4);  // torch's Philox offsets move in steps of 4
    seed = gen.current_seed();
  }
  return with_state(scalars, seed, offset);
}

// false, launching nothing, where the kernel takes vectors only and a pointer is not aligned for them, or where a
// random kernel's launch state cannot be drawn (the stream captures a graph)
template <class In>
bool launch_cuda(const Launch& l, c10::ArrayRef<In> inputs, at::ArrayRef<double> scalars,
                 const std::vector<at::Tensor>& outs) {
  thread_local std::vector<uint8_t> buf;
  buf.assign(l.args.begin(), l.args.end());
  uint8_t* base = buf.data();
  bool vec = l.vec_shape != 0;
  size_t k = 0;
  auto put = [&](const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::memcpy(base + l.ptrs_off + 8 * k, &a, 8);
    if (l.align[k] && a % l.align[k]) vec = false;
    ++k;
  };
  for (const In& t : inputs) put(data_of(t));
  for (size_t j = 0; j < outs.size(); ++j)
    for (int64_t p = 0; p < l.outs[j].pieces; ++p) put(static_cast<char*>(outs[j].data_ptr()) + p * l.outs[j].step);
  if (!vec && l.vec_shape == 2) return false;
  // a random kernel's launch state, drawn only now that the launch is sure (a drawn state advances the generator)
  std::optional<std::vector<double>> drawn;
  if (l.random) {
    drawn = with_cuda_launch_state(scalars, l.device);
    if (!drawn) return false;
    scalars = *drawn;
  }
  // the buffers: on the current device (fusion_group checked it is l.device), from the caching allocator on its
  // current stream, the stream the kernels go on; freed when this returns, after the launches are queued
  std::vector<at::Tensor> temps;
  if (!l.temps.empty()) {
    temps.reserve(l.temps.size());
    const auto options = at::TensorOptions().device(l.device);
    for (size_t t = 0; t < l.temps.size(); ++t) {
      uintptr_t a = 0;
      if (l.temps[t].numel > 0) {
        temps.push_back(at::empty({l.temps[t].numel}, options.dtype(l.temps[t].dtype)));
        a = reinterpret_cast<uintptr_t>(temps.back().data_ptr());
      }
      std::memcpy(base + l.ptrs_off + 8 * (k + t), &a, 8);
    }
  }
  const int32_t v = vec ? 1 : 0;
  if (l.vec_off >= 0) std::memcpy(base + l.vec_off, &v, 4);
  if (!scalars.empty()) std::memcpy(base + l.scalars_off, scalars.data(), scalars.size() * sizeof(double));
  const auto grid = static_cast<unsigned>(vec ? l.grid_vec : l.grid_scalar);
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(l.device).native_handle();
  void* params[1] = {base};
  timer.mark(kPack);
  int err = cu_launch(l.fn, grid, 1, 1, static_cast<unsigned>(l.block), 1, 1, static_cast<unsigned>(l.smem), stream,
                      params, nullptr);
  TORCH_CHECK(err == 0, "fuser: cuLaunchKernel failed with CUresult ", err);
  for (const Then& t : l.then) {  // (cuLaunchKernel copied the arguments: they may change for the next)
    if (t.patch_off >= 0) std::memcpy(base + t.patch_off, &t.patch, 4);
    err = cu_launch(t.fn, static_cast<unsigned>(t.grid), 1, 1, static_cast<unsigned>(t.block), 1, 1, 0, stream,
                    params, nullptr);
    TORCH_CHECK(err == 0, "fuser: cuLaunchKernel (a second kernel) failed with CUresult ", err);
  }
  timer.mark(kLaunch);
  if (l.form == kRowSums) n_cuda_row_sums.fetch_add(1, std::memory_order_relaxed);
  if (l.form == kColumns) n_cuda_column_kernels.fetch_add(1, std::memory_order_relaxed);
  return true;
}

template <class In>
void launch_cpu(const Launch& l, c10::ArrayRef<In> inputs, at::ArrayRef<double> scalars,
                const std::vector<at::Tensor>& outs) {
  void* ptrs[64];
  std::vector<void*> many;
  void** p = ptrs;
  const size_t n = inputs.size() + static_cast<size_t>(l.n_kernel_outs);
  if (n > 64) {
    many.resize(n);
    p = many.data();
  }
  size_t k = 0;
  for (const In& t : inputs) p[k++] = data_of(t);
  for (size_t j = 0; j < outs.size(); ++j)
    for (int64_t q = 0; q < l.outs[j].pieces; ++q) p[k++] = static_cast<char*>(outs[j].data_ptr()) + q * l.outs[j].step;
  const double none = 0.0;
  timer.mark(kPack);
  reinterpret_cast<CpuKernel>(l.fn)(l.numel, l.rank, l.sizes.data(), l.strides.data(), p,
                                    scalars.empty() ? &none : scalars.data());
  timer.mark(kLaunch);
}

bool grads_match(const Launch& l, at::TensorList inputs) {
  size_t k = 0;
  for (const at::Tensor& t : inputs)
    if (static_cast<uint8_t>(t.requires_grad()) != l.requires_grad[k++]) return false;
  return true;
}

std::vector<at::Tensor> record_call(std::shared_ptr<const Launch> found, at::TensorList inputs,
                                    at::ArrayRef<double> scalars, std::vector<at::Tensor> outs,
                                    const std::vector<torch::autograd::Edge>& sources);

// The edge of the tensor that c's inputs are every chunk of: their autograd edges are outputs 0..n-1, in order, of
// one split node (eager's chunk or split_with_sizes) with n outputs along c.dim; nullopt where they are not. Its
// backward would cat their gradients into that tensor's: the edge takes the whole one instead.
std::optional<torch::autograd::Edge> chunk_source(const Backward::Chunks& c, at::TensorList inputs) {
  const size_t n = c.inputs.size();
  const auto first = torch::autograd::impl::gradient_edge(inputs[c.inputs[0]]);
  auto* node = first.function.get();
  if (node == nullptr || node->num_inputs() != n) return std::nullopt;
  int64_t dim = -1;
  c10::SymInt whole;
  auto read = [&](const auto* split) {  // the split's dim and the size of the tensor it splits along it
    const auto nd = static_cast<int64_t>(split->self_sym_sizes.size());
    const int64_t d = split->dim < 0 ? split->dim + nd : split->dim;
    if (0 <= d && d < nd) {
      dim = d;
      whole = split->self_sym_sizes[d];
    }
  };
  if (auto* s = dynamic_cast<torch::autograd::generated::SplitBackward0*>(node))
    read(s);
  else if (auto* s = dynamic_cast<torch::autograd::generated::SplitWithSizesBackward0*>(node))
    read(s);
  const at::Tensor& t0 = inputs[c.inputs[0]];
  if (dim < 0 || dim != c.dim || dim >= t0.dim() || whole != t0.size(dim) * static_cast<int64_t>(n))
    return std::nullopt;
  for (size_t k = 0; k < n; ++k) {
    const auto e = torch::autograd::impl::gradient_edge(inputs[c.inputs[k]]);
    if (e.function.get() != node || e.input_nr != k || inputs[c.inputs[k]].sizes() != t0.sizes()) return std::nullopt;
  }
  return node->next_edge(0);
}

// A chunked call's arguments (fuser::fusion_group<m>_c<n>): its tensors, and per group input (argument, chunk index,
// chunks, dim), the argument itself where chunks is 1.
struct Chunked {
  at::TensorList args;
  at::IntArrayRef chunks;
};

std::vector<at::Tensor> chunk_inputs(const Chunked& c);

// inputs: the group's tensors, or (InView) the chunks of a chunked call's arguments, a plain call's (chunked_call
// classified them), made as eager makes them for anything handed to Python
template <class In>
std::vector<at::Tensor> serve(c10::ArrayRef<In> inputs, at::ArrayRef<double> scalars, int64_t key,
                              c10::string_view digest, c10::string_view ir, const Chunked* chunked) {
  constexpr bool kViews = std::is_same_v<In, InView>;
  timer.start();
  const auto handed = [&](bool offer) {
    if constexpr (kViews)
      return hand_over(chunk_inputs(*chunked), scalars, key, digest, ir, offer);
    else
      return hand_over(inputs, scalars, key, digest, ir, offer);
  };
  Call call = kPlain;
  if constexpr (!kViews) {
    call = classify(inputs);
    if (call == kNotPlain) return handed(false);
  }
  timer.mark(kClassify);
  const bool grad = call == kGrad;
  const auto fits = [&](const Launch& l) {
    if (l.n_tensors != static_cast<int64_t>(inputs.size()) || l.n_scalars != static_cast<int64_t>(scalars.size()) ||
        l.requires_grad.empty() == grad || !matches(l, inputs))
      return false;
    if constexpr (kViews)
      return true;
    else
      return !grad || grads_match(l, inputs);
  };
  LastHit& last = last_hit;
  const Launch* hit = nullptr;
  if (last.key == key && last.generation == table_generation.load(std::memory_order_acquire) &&
      c10::string_view(last.digest) == digest && fits(*last.launch)) {
    hit = last.launch.get();
  } else {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    auto it = table.find(key);
    if (it != table.end() && c10::string_view(it->second.digest) == digest) {
      for (const auto& l : it->second.launches) {
        if (fits(*l)) {
          last.key = key;
          last.generation = table_generation.load(std::memory_order_relaxed);  // (changed under the lock only)
          if (c10::string_view(last.digest) != digest) last.digest = std::string(digest);
          last.launch = l;
          hit = l.get();
          break;
        }
      }
    }
  }
  if (hit == nullptr) return handed(true);
  timer.mark(kLookup);
  // (the last hit holds the launch alive: no call below reaches a table change on this thread before it is used,
  // record_call takes a reference of its own)
  std::shared_ptr<const Launch> found = grad ? last.launch : nullptr;
  const Launch& l = *hit;
  if (l.kind == kPython) return handed(false);
  std::vector<torch::autograd::Edge> sources;  // per chunked tensor, its edge
  if constexpr (!kViews) {
    if (grad) {
      for (const auto& c : l.backward->chunks) {
        auto e = chunk_source(c, inputs);
        if (!e) return handed(false);  // chunks of no one tensor: Python's
        sources.push_back(std::move(*e));
      }
    }
  }
  for (const Limit& lim : l.limits) {
    const double x = scalars[lim.index];
    if (!(lim.lo <= x && x <= lim.hi) && !(lim.nonfinite && !std::isfinite(x)))
      return handed(false);  // eager raises or converts otherwise
  }
  if (l.kind == kCuda) {
    // the prepared context and device must be this thread's current ones; otherwise Python switches to them
    auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    void* ctx = nullptr;
    if (guard->getDevice() != l.device || cu_ctx_get_current(&ctx) != 0 || ctx != l.ctx)
      return handed(false);
  }
  timer.mark(kChecks);
  std::vector<at::Tensor> outs;
  outs.reserve(l.outs.size());
  if (l.kind == kCpu) {  // (the CPU factory itself: the dispatcher's round trip costs about as much as a small kernel)
    for (const Out& o : l.outs) {
      outs.emplace_back(empty_cpu_output(o));  // (large ones with huge pages asked for)
    }
  } else {
    for (const Out& o : l.outs) outs.emplace_back(empty_cuda_output(o, l.device));
  }
  timer.mark(kAlloc);
  if (l.numel != 0) {
    if (l.kind == kCuda) {
      if (!launch_cuda(l, inputs, scalars, outs)) return handed(false);
    } else if (l.random)
      launch_cpu(l, inputs, with_launch_state(scalars), outs);
    else
      launch_cpu(l, inputs, scalars, outs);
  }
  n_hits.fetch_add(1, std::memory_order_relaxed);
  if constexpr (!kViews) {
    if (grad) {
      auto recorded = record_call(std::move(found), inputs, scalars, std::move(outs), sources);
      timer.mark(kRecord);
      timer.served();
      return recorded;
    }
  }
  timer.served();
  return outs;
}

std::vector<at::Tensor> fusion_group(at::TensorList inputs, at::ArrayRef<double> scalars, int64_t key,
                                     c10::string_view digest, c10::string_view ir) {
  return serve(inputs, scalars, key, digest, ir, nullptr);
}

// A chunked call's group inputs as prim::ConstantChunk makes them: at::chunk (eager's errors), and the interpreter's
// error where a chunk the group takes is not among those made.
std::vector<at::Tensor> chunk_inputs(const Chunked& c) {
  std::vector<at::Tensor> inputs;
  inputs.reserve(c.chunks.size() / 4);
  std::vector<std::pair<std::array<int64_t, 3>, std::vector<at::Tensor>>> made;
  for (size_t k = 0; k + 3 < c.chunks.size(); k += 4) {
    const int64_t j = c.chunks[k], i = c.chunks[k + 1], n = c.chunks[k + 2], dim = c.chunks[k + 3];
    TORCH_CHECK(0 <= j && j < static_cast<int64_t>(c.args.size()), "fuser: a chunked call's argument out of range");
    if (n == 1) {
      inputs.push_back(c.args[j]);
      continue;
    }
    const std::array<int64_t, 3> id{j, n, dim};
    auto it = made.begin();
    while (it != made.end() && it->first != id) ++it;
    if (it == made.end()) it = made.insert(made.end(), {id, at::chunk(c.args[j], n, dim)});
    TORCH_CHECK(i < static_cast<int64_t>(it->second.size()), "Expected chunk to return at least ", n,
                " outputs, but got only ", it->second.size());
    inputs.push_back(it->second[i]);
  }
  return inputs;
}

// A chunked call: a plain one (no autograd to record) whose every chunk is one of equal parts reads them as InViews
// (checked and launched as eager's views would be); any other takes eager's chunks.
std::vector<at::Tensor> chunked_call(at::TensorList args, at::IntArrayRef chunks, at::ArrayRef<double> scalars,
                                     int64_t key, c10::string_view digest, c10::string_view ir, size_t n_out) {
  std::vector<at::Tensor> outs;
  const Chunked c{args, chunks};
  if (chunks.empty()) {
    outs = serve(args, scalars, key, digest, ir, nullptr);
  } else {
    const size_t n_in = chunks.size() / 4;
    std::array<InView, 8> few;
    std::vector<InView> many;
    InView* in = few.data();
    if (n_in > few.size()) {
      many.resize(n_in);
      in = many.data();
    }
    bool light = chunks.size() % 4 == 0 && classify(args) == kPlain;
    for (size_t k = 0; light && k < n_in; ++k) {
      const int64_t j = chunks[4 * k], i = chunks[4 * k + 1], n = chunks[4 * k + 2];
      int64_t dim = chunks[4 * k + 3];
      if (j < 0 || j >= static_cast<int64_t>(args.size()) || n < 1 || i < 0 || i >= n) {
        light = false;
        break;
      }
      const at::Tensor& w = args[j];
      const int64_t nd = w.dim();
      if (dim < 0) dim += nd;
      light = 0 <= dim && dim < nd && w.size(dim) > 0 && w.size(dim) % n == 0;
      if (!light) break;  // (at::chunk's own error for a dim out of range: the eager path below)
      in[k] = n == 1 ? InView{&w} : InView{&w, dim, w.size(dim) / n, i};
    }
    if (light)
      outs = serve(c10::ArrayRef<InView>(in, n_in), scalars, key, digest, ir, &c);
    else
      outs = serve(at::TensorList(chunk_inputs(c)), scalars, key, digest, ir, nullptr);
  }
  TORCH_CHECK(outs.size() == n_out, "fuser: a group call of ", n_out, " outputs: the group gave ", outs.size());
  return outs;
}

template <size_t M>
struct Results;
template <>
struct Results<1> {
  using type = at::Tensor;
  static type of(std::vector<at::Tensor>&& o) { return std::move(o[0]); }
};
template <>
struct Results<2> {
  using type = std::tuple<at::Tensor, at::Tensor>;
  static type of(std::vector<at::Tensor>&& o) { return {std::move(o[0]), std::move(o[1])}; }
};
template <>
struct Results<3> {
  using type = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
  static type of(std::vector<at::Tensor>&& o) { return {std::move(o[0]), std::move(o[1]), std::move(o[2])}; }
};

// fuser::fusion_group<m>_c<n> (fuser.graph_fuser.CHUNK_CALLS): m outputs, n tensor arguments
template <size_t M>
typename Results<M>::type group_c1(const at::Tensor& t0, at::IntArrayRef chunks, at::ArrayRef<double> scalars,
                                   int64_t key, c10::string_view digest, c10::string_view ir);
template <size_t M>
typename Results<M>::type group_c2(const at::Tensor& t0, const at::Tensor& t1, at::IntArrayRef chunks,
                                   at::ArrayRef<double> scalars, int64_t key, c10::string_view digest,
                                   c10::string_view ir);
template <size_t M>
typename Results<M>::type group_c3(const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& t2,
                                   at::IntArrayRef chunks, at::ArrayRef<double> scalars, int64_t key,
                                   c10::string_view digest, c10::string_view ir);
template <size_t M>
typename Results<M>::type group_c4(const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& t2,
                                   const at::Tensor& t3, at::IntArrayRef chunks, at::ArrayRef<double> scalars,
                                   int64_t key, c10::string_view digest, c10::string_view ir);

// A group of one output (fuser::fusion_group1): the same call, its output returned alone, so that TorchScript
// neither builds a list of it nor unpacks one
at::Tensor fusion_group1(at::TensorList inputs, at::ArrayRef<double> scalars, int64_t key, c10::string_view digest,
                         c10::string_view ir) {
  std::vector<at::Tensor> outs = fusion_group(inputs, scalars, key, digest, ir);
  TORCH_CHECK(outs.size() == 1, "fuser::fusion_group1: the group gave ", outs.size(), " outputs");
  return std::move(outs[0]);
}

// A group of one output and 1-4 tensor inputs (fuser::fusion_group1_t<n>): its tensors as arguments of their own,
// so that TorchScript builds no list of them and the call unboxes no vector (fuser.graph_fuser.FIXED_INPUTS). The
// call's list is of borrowed tensors (no reference counts touched): the arguments outlive it.
template <size_t N>
struct Borrowed {
  std::array<at::Tensor, N> tensors;
  template <class... T>
  explicit Borrowed(const T&... ts) : tensors{c10::MaybeOwnedTraits<at::Tensor>::createBorrow(ts)...} {}
  ~Borrowed() {
    for (at::Tensor& t : tensors) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
};

at::Tensor fusion_group1_t1(const at::Tensor& t0, at::ArrayRef<double> scalars, int64_t key, c10::string_view digest,
                            c10::string_view ir) {
  const Borrowed<1> in(t0);
  return fusion_group1(in.tensors, scalars, key, digest, ir);
}
at::Tensor fusion_group1_t2(const at::Tensor& t0, const at::Tensor& t1, at::ArrayRef<double> scalars, int64_t key,
                            c10::string_view digest, c10::string_view ir) {
  const Borrowed<2> in(t0, t1);
  return fusion_group1(in.tensors, scalars, key, digest, ir);
}
at::Tensor fusion_group1_t3(const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& t2,
                            at::ArrayRef<double> scalars, int64_t key, c10::string_view digest, c10::string_view ir) {
  const Borrowed<3> in(t0, t1, t2);
  return fusion_group1(in.tensors, scalars, key, digest, ir);
}
at::Tensor fusion_group1_t4(const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& t2, const at::Tensor& t3,
                            at::ArrayRef<double> scalars, int64_t key, c10::string_view digest, c10::string_view ir) {
  const Borrowed<4> in(t0, t1, t2, t3);
  return fusion_group1(in.tensors, scalars, key, digest, ir);
}

template <size_t M>
typename Results<M>::type group_c1(const at::Tensor& t0, at::IntArrayRef chunks, at::ArrayRef<double> scalars,
                                   int64_t key, c10::string_view digest, c10::string_view ir) {
  const Borrowed<1> in(t0);
  return Results<M>::of(chunked_call(in.tensors, chunks, scalars, key, digest, ir, M));
}
template <size_t M>
typename Results<M>::type group_c2(const at::Tensor& t0, const at::Tensor& t1, at::IntArrayRef chunks,
                                   at::ArrayRef<double> scalars, int64_t key, c10::string_view digest,
                                   c10::string_view ir) {
  const Borrowed<2> in(t0, t1);
  return Results<M>::of(chunked_call(in.tensors, chunks, scalars, key, digest, ir, M));
}
template <size_t M>
typename Results<M>::type group_c3(const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& t2,
                                   at::IntArrayRef chunks, at::ArrayRef<double> scalars, int64_t key,
                                   c10::string_view digest, c10::string_view ir) {
  const Borrowed<3> in(t0, t1, t2);
  return Results<M>::of(chunked_call(in.tensors, chunks, scalars, key, digest, ir, M));
}
template <size_t M>
typename Results<M>::type group_c4(const at::Tensor& t0, const at::Tensor& t1, const at::Tensor& t2,
                                   const at::Tensor& t3, at::IntArrayRef chunks, at::ArrayRef<double> scalars,
                                   int64_t key, c10::string_view digest, c10::string_view ir) {
  const Borrowed<4> in(t0, t1, t2, t3);
  return Results<M>::of(chunked_call(in.tensors, chunks, scalars, key, digest, ir, M));
}

// ---- autograd

using torch::autograd::variable_list;
// the autograd graph's node pointer: std::shared_ptr<Node> in older torch, c10::intrusive_ptr<Node> in newer
using NodePtr = decltype(torch::autograd::Edge().function);

template <class P, class T>
P make_node() {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>)
    return std::shared_ptr<T>(new T(), [](T* p) { deleteNode(p); });  // torch's deleter, found through T's base
  else
    return c10::make_intrusive<T>();
}

using PyBackward = c10::List<std::optional<at::Tensor>>(int64_t, c10::string_view,
                                                        const c10::List<std::optional<at::Tensor>>&,
                                                        at::ArrayRef<double>, at::ArrayRef<int64_t>,
                                                        const c10::List<std::optional<at::Tensor>>&);
using GroupOp = std::vector<at::Tensor>(at::TensorList, at::ArrayRef<double>, int64_t, c10::string_view,
                                        c10::string_view);

// Whether a and b are one shape but for dims of size 1.
bool same_dims(c10::IntArrayRef a, c10::IntArrayRef b) {
  size_t i = 0, j = 0;
  while (true) {
    while (i < a.size() && a[i] == 1) ++i;
    while (j < b.size() && b[j] == 1) ++j;
    if (i == a.size() || j == b.size()) return i == a.size() && j == b.size();
    if (a[i++] != b[j++]) return false;
  }
}

struct FusedGroupBackward : public torch::autograd::Node {
  std::shared_ptr<const Backward> bw;
  std::vector<torch::autograd::SavedVariable> saved;  // per tensor input (empty where not saved)
  std::vector<torch::autograd::SavedVariable> saved_out;  // per output (empty where not saved)
  std::vector<double> scalars;
  std::vector<int64_t> out_index;  // per input of this node (a differentiable output): the output's index
  size_t n_outputs = 0;
  std::vector<std::vector<int64_t>> sizes;  // per tensor input
  std::vector<at::TensorOptions> options;  // per tensor input

  std::string name() const override { return "FusedGroupBackward"; }

  void release_variables() override {
    for (auto& s : saved) s.reset_data();
    for (auto& s : saved_out) s.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const size_t n_t = saved.size();
    variable_list result(n_t);
    bool all = true, any = false;
    for (const auto& g : grads) {
      all = all && g.defined();
      any = any || g.defined();
    }
    if (!any) return result;
    std::vector<at::Tensor> unpacked(n_t);
    for (size_t k = 0; k < n_t; ++k)
      if (bw->saved[k]) unpacked[k] = saved[k].unpack();
    std::vector<at::Tensor> outputs(n_outputs);  // saved as outputs: unpacked with this node as their grad_fn
    for (size_t k = 0; k < n_outputs; ++k)
      if (bw->saved_out[k]) outputs[k] = saved_out[k].unpack(getptr());
    const bool extras = bw->n_visible < static_cast<int64_t>(n_outputs);
    if (!all || !bw->has_group || (extras && c10::GradMode::is_enabled())) {  // another pattern (or double backward
      // through extra outputs, which have no history): Python's backward, which builds its group
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("fuser::fusion_group_backward_py", "")
                           .typed<PyBackward>();
      c10::List<std::optional<at::Tensor>> s, g;
      for (auto& t : unpacked) s.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
      for (auto& t : outputs) s.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
      std::vector<std::optional<at::Tensor>> full(n_outputs);
      for (size_t j = 0; j < grads.size(); ++j)
        if (grads[j].defined()) full[out_index[j]] = grads[j];
      for (auto& x : full) g.push_back(x);
      auto out = op.call(bw->key, bw->digest, s, scalars, bw->py_meta, g);
      for (size_t k = 0; k < n_t && k < out.size(); ++k) {
        std::optional<at::Tensor> r = out.get(k);
        if (r.has_value()) result[k] = *r;
      }
      for (size_t c = 0; c < bw->chunks.size(); ++c) {  // the chunked tensors' gradients, last: on their first
        const auto& ks = bw->chunks[c].inputs;           // chunk's edge (the tensor's)
        for (int64_t k : ks) result[k] = at::Tensor();
        std::optional<at::Tensor> r = out.size() > n_t + c ? out.get(n_t + c) : std::nullopt;
        if (r.has_value()) result[ks[0]] = *r;
      }
      return result;
    }
    std::vector<at::Tensor> output_grads(n_outputs);
    for (size_t j = 0; j < grads.size(); ++j) output_grads[out_index[j]] = grads[j];
    std::vector<at::Tensor> tensors;
    std::vector<double> floats;
    for (const auto& [kind, index] : bw->inputs) {
      if (kind == 0)
        tensors.push_back(unpacked[index]);
      else if (kind == 1)
        floats.push_back(scalars[index]);
      else if (kind == 2)
        tensors.push_back(output_grads[index]);
      else
        tensors.push_back(outputs[index]);
    }
    if (!bw->steps.empty() && !c10::GradMode::is_enabled()) return summed(tensors, floats, std::move(result));
    std::vector<at::Tensor> outs = group().call(tensors, floats, bw->bw_key, bw->bw_digest, "");
    TORCH_CHECK(outs.size() == bw->grad_inputs.size(), "fuser: the backward group returned ", outs.size(),
                " gradients, expected ", bw->grad_inputs.size());
    for (const auto& [k, r] : bw->aliases) shaped(result, k, outs[r]);
    for (size_t r = 0; r < outs.size(); ++r) shaped(result, bw->grad_inputs[r], std::move(outs[r]));
    for (int64_t k : bw->zero_inputs) result[k] = at::zeros(sizes[k], options[k]);
    return result;
  }

  static c10::TypedOperatorHandle<GroupOp>& group() {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fuser::fusion_group", "").typed<GroupOp>();
    return op;
  }

  // The gradient of tensor input k from a group's output g: of k's shape and dtype.
  void shaped(variable_list& result, int64_t k, at::Tensor g) const {
    bool whole = false;  // a chunked tensor's gradient (a cat output)
    for (const auto& c : bw->chunks) whole = whole || k == c.inputs[0];
    const c10::IntArrayRef want(sizes[k]);
    // a sum kept as [1, cols] is a view of the shape (as autodiff.input_grads takes it); else eager's sum
    if (!whole && g.sizes() != want) g = g.numel() == c10::multiply_integers(want) && same_dims(g.sizes(), want)
                                             ? g.reshape(want) : g.sum_to_size(want);
    if (g.scalar_type() != options[k].dtype().toScalarType()) g = g.to(options[k].dtype().toScalarType());
    result[k] = std::move(g);
  }

  // The backward whose summed gradients grad_sums.run computes: its steps (``bw_tensors``, ``bw_floats``: the
  // backward group's arguments, in bw->inputs' order), each through fuser::fusion_group.
  variable_list summed(const std::vector<at::Tensor>& bw_tensors, const std::vector<double>& bw_floats,
                       variable_list result) const {
    std::vector<int64_t> tensor_at(bw->inputs.size()), float_at(bw->inputs.size());  // per backward argument
    for (size_t i = 0, t = 0, f = 0; i < bw->inputs.size(); ++i) {
      if (bw->inputs[i].first == 1) {
        tensor_at[i] = -1;
        float_at[i] = static_cast<int64_t>(f++);
      } else {
        tensor_at[i] = static_cast<int64_t>(t++);
      }
    }
    std::vector<std::vector<at::Tensor>> outs(bw->steps.size());
    for (size_t s = 0; s < bw->steps.size(); ++s) {
      const SumStep& step = bw->steps[s];
      std::vector<at::Tensor> tensors;
      std::vector<double> floats;
      for (const auto& [src, i] : step.inputs) {
        if (src >= 0)
          tensors.push_back(outs[src][i]);
        else if (tensor_at[i] >= 0)
          tensors.push_back(bw_tensors[tensor_at[i]]);
        else
          floats.push_back(bw_floats[float_at[i]]);
      }
      outs[s] = group().call(tensors, floats, step.key, step.digest, "");
      TORCH_CHECK(static_cast<int64_t>(outs[s].size()) == step.n_out, "fuser: a summing backward group returned ",
                  outs[s].size(), " outputs, expected ", step.n_out);
      if (step.kind == 1) n_fused.fetch_add(1, std::memory_order_relaxed);
      if (step.kind == 2) n_columns.fetch_add(1, std::memory_order_relaxed);
    }
    if (bw->steps.size() > 1 || bw->steps[0].kind != 1) n_split.fetch_add(1, std::memory_order_relaxed);
    for (const auto& [k, s, r] : bw->step_takes) shaped(result, k, outs[s][r]);
    for (int64_t k : bw->zero_inputs) result[k] = at::zeros(sizes[k], options[k]);
    return result;
  }
};

// sources: per entry of bw.chunks, the edge of the tensor those inputs are the chunks of (chunk_source)
std::vector<at::Tensor> record_call(std::shared_ptr<const Launch> found, at::TensorList inputs,
                                    at::ArrayRef<double> scalars, std::vector<at::Tensor> outs,
                                    const std::vector<torch::autograd::Edge>& sources) {
  const Backward& bw = *found->backward;
  NodePtr node_ptr = make_node<NodePtr, FusedGroupBackward>();
  auto* node = static_cast<FusedGroupBackward*>(node_ptr.get());
  node->bw = found->backward;
  auto edges = torch::autograd::collect_next_edges(inputs);
  for (size_t c = 0; c < bw.chunks.size(); ++c) {  // fusion_group found the tensors they are chunks of
    const auto& ks = bw.chunks[c].inputs;
    edges[ks[0]] = sources[c];
    for (size_t k = 1; k < ks.size(); ++k) edges[ks[k]] = torch::autograd::Edge();
  }
  node->set_next_edges(std::move(edges));
  node->saved.resize(inputs.size());
  node->sizes.reserve(inputs.size());
  node->options.reserve(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (bw.saved[k]) node->saved[k] = torch::autograd::SavedVariable(inputs[k], false);
    node->sizes.push_back(inputs[k].sizes().vec());
    node->options.push_back(inputs[k].options());
  }
  node->scalars.assign(scalars.begin(), scalars.end());
  node->n_outputs = outs.size();
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!bw.differentiable[k]) continue;
    node->out_index.push_back(static_cast<int64_t>(k));
    torch::autograd::create_gradient_edge(outs[k], node_ptr);
  }
  node->saved_out.resize(outs.size());
  for (size_t k = 0; k < outs.size(); ++k)  // after the edges: saved as this node's outputs (no reference cycle)
    if (bw.saved_out[k])
      node->saved_out[k] = torch::autograd::SavedVariable(outs[k], static_cast<int64_t>(k) < bw.n_visible);
  outs.resize(bw.n_visible);  // (the extra outputs: the backward's alone)
  return outs;
}

// fuser::broadcasting_chunk (chunk motion, fuser/torch_ops.py): chunk k of every input as the chunked broadcast
// result would see it. The common case here; an empty or out-of-range dim, a chunk count eager would not give, or
// anything but plain tensors go to the Python operator, which raises eager's errors.
std::vector<at::Tensor> broadcasting_chunk(at::TensorList inputs, int64_t chunks, int64_t dim, int64_t n) {
  static auto py = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fuser::broadcasting_chunk_py", "")
                       .typed<std::vector<at::Tensor>(at::TensorList, int64_t, int64_t, int64_t)>();
  bool plain = !inputs.empty() && chunks > 0 && n > 0;
  std::vector<int64_t> shape;
  for (const at::Tensor& t : inputs) {
    if (!plain) break;
    if (!t.defined()) {
      plain = false;
      break;
    }
    const c10::DispatchKeySet rest = t.key_set() - kIgnored;
    if (rest != kPlainCpu && rest != kPlainCuda) {
      plain = false;
      break;
    }
    // broadcast, as torch.broadcast_shapes; a mismatch goes to Python for eager's error
    const auto sizes = t.sizes();
    if (sizes.size() > shape.size()) shape.insert(shape.begin(), sizes.size() - shape.size(), 1);
    const size_t off = shape.size() - sizes.size();
    for (size_t d = 0; d < sizes.size(); ++d) {
      int64_t& s = shape[off + d];
      if (s == sizes[d] || sizes[d] == 1) continue;
      if (s == 1)
        s = sizes[d];
      else
        plain = false;
    }
  }
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (!plain || dim < -nd || dim >= nd) return py.call(inputs, chunks, dim, n);
  const int64_t d = dim < 0 ? dim + nd : dim;
  const int64_t size = shape[d];
  if (size <= 0) return py.call(inputs, chunks, dim, n);
  const int64_t split = (size + chunks - 1) / chunks;  // eager's chunk: pieces of ceil(size / chunks)
  std::vector<int64_t> sizes;
  for (int64_t at = 0; at < size; at += split) sizes.push_back(std::min(split, size - at));
  if (static_cast<int64_t>(sizes.size()) != n) return py.call(inputs, chunks, dim, n);
  std::vector<at::Tensor> out;
  out.reserve(inputs.size() * n);
  for (const at::Tensor& t : inputs) {
    const int64_t td = d - (nd - t.dim());
    if (td < 0 || (t.size(td) == 1 && size != 1)) {
      for (int64_t k = 0; k < n; ++k) out.push_back(t);
    } else {
      for (auto& piece : t.split_with_sizes(sizes, td)) out.push_back(std::move(piece));
    }
  }
  return out;
}

struct BnKey {
  int64_t n, nd, dtype, device;
  std::array<std::array<intptr_t, 4>, 4> v;  // per vector: TensorImpl, data pointer, length, stride
  bool operator==(const BnKey& o) const {
    return n == o.n && nd == o.nd && dtype == o.dtype && device == o.device && v == o.v;
  }
};
struct BnKeyHash {
  size_t operator()(const BnKey& k) const {
    size_t h = std::hash<int64_t>()(((k.n * 16 + k.nd) * 64 + k.dtype) * 4096 + k.device);
    for (const auto& e : k.v)
      for (intptr_t x : e) h = h * 1000003u ^ std::hash<intptr_t>()(x);
    return h;
  }
};
// entries a thread keeps at most (then it starts again): the views hold their vectors' memory (a model's batch norms'
// parameters: 50 batch norms of 1280 channels, 1 MB) after the model is gone, until then or fuser.native.clear()
constexpr size_t kBnKept = 1024;
std::unordered_map<BnKey, std::vector<at::Tensor>, BnKeyHash>& bn_kept() {
  thread_local std::unordered_map<BnKey, std::vector<at::Tensor>, BnKeyHash> kept;
  return kept;
}

// fuser::batch_norm_params (the inference batch norm decomposition, fuser/torch_ops.py): the per-channel vectors
// shaped to broadcast along dim 1, in the dtype eager's kernel computes in. The common case here; everything else
// (eager's errors, other shapes or dtypes) goes to the Python operator.
std::vector<at::Tensor> batch_norm_params(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                          const std::optional<at::Tensor>& bias, const at::Tensor& running_mean,
                                          const at::Tensor& running_var) {
  static auto py = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fuser::batch_norm_params_py", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                      const std::optional<at::Tensor>&, const at::Tensor&,
                                                      const at::Tensor&)>();
  std::vector<at::Tensor> vecs;
  if (weight.has_value() && weight->defined()) vecs.push_back(*weight);
  if (bias.has_value() && bias->defined()) vecs.push_back(*bias);
  vecs.push_back(running_mean);
  vecs.push_back(running_var);
  const int64_t nd = input.dim();
  bool plain = input.defined() && nd >= 2 && input.numel() > 0;
  const c10::ScalarType in_type = plain ? input.scalar_type() : c10::ScalarType::Float;
  const bool reduced = in_type == c10::ScalarType::Half || in_type == c10::ScalarType::BFloat16;
  const int64_t channels = plain ? input.size(1) : 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  for (size_t k = 0; plain && k < vecs.size(); ++k) {
    const at::Tensor& t = vecs[k];
    if (!t.defined() || t.dim() != 1 || t.size(0) != channels || t.device() != input.device()) {
      plain = false;
      break;
    }
    if (k == 0) dtype = t.scalar_type();
    if (t.scalar_type() != dtype) plain = false;
  }
  if (plain && !(dtype == in_type || (dtype == c10::ScalarType::Float && reduced))) plain = false;
  if (!plain) return py.call(input, weight, bias, running_mean, running_var);
  const bool grad = c10::GradMode::is_enabled();
  // A forward passes the same parameters each time: their views are kept (per thread), keyed by each vector's
  // TensorImpl, memory, length and stride, their dtype and device and the input's rank, and returned again without building new ones
  // (four views cost about 3.5 us on a 2-core EPYC, and a MobileNetV2 forward calls this 50 times). A kept view
  // aliases its vector's memory (in-place updates show through it) and holds that storage, so no other tensor
  // gets the same data pointer while its entry lives. Not kept: vectors converted to float (copies) and views
  // that autograd records.
  bool keep = dtype != c10::ScalarType::Half && dtype != c10::ScalarType::BFloat16;
  for (const at::Tensor& t : vecs) keep = keep && !(grad && t.requires_grad());
  BnKey key{};
  if (keep) {
    key.n = static_cast<int64_t>(vecs.size());
    key.nd = nd;
    key.dtype = static_cast<int64_t>(dtype);
    key.device = static_cast<int64_t>(input.device().type()) * 1024 + input.device().index();
    for (size_t k = 0; k < vecs.size(); ++k) {
      const at::Tensor& t = vecs[k];
      key.v[k] = {reinterpret_cast<intptr_t>(t.unsafeGetTensorImpl()), reinterpret_cast<intptr_t>(t.data_ptr()),
                  t.size(0), t.stride(0)};
    }
    auto& kept = bn_kept();
    auto it = kept.find(key);
    if (it != kept.end()) return it->second;
  }
  std::vector<int64_t> shape(nd - 1, 1), strides(nd - 1, 1);
  shape[0] = channels;
  for (at::Tensor& t : vecs) {
    if (dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16) t = t.to(c10::ScalarType::Float);
    if (grad && t.requires_grad()) {
      t = t.view(shape);
    } else {
      strides[0] = t.stride(0);
      t = t.as_strided(shape, strides);
    }
  }
  if (keep) {
    auto& kept = bn_kept();
    if (kept.size() >= kBnKept) kept.clear();
    kept.emplace(key, vecs);
  }
  return vecs;
}

// Reads the flat integer record that fuser/native/record.py writes.
struct Reader {
  const std::vector<int64_t>& v;
  size_t i = 0;
  int64_t next() {
    TORCH_CHECK(i < v.size(), "fuser native record: truncated");
    return v[i++];
  }
  std::vector<int64_t> take(int64_t n) {
    TORCH_CHECK(n >= 0 && i + n <= v.size(), "fuser native record: truncated");
    std::vector<int64_t> out(v.begin() + i, v.begin() + i + n);
    i += n;
    return out;
  }
};

std::shared_ptr<Launch> parse(const std::vector<int64_t>& sig, const std::vector<int64_t>& rec,
                              const std::vector<double>& floats) {
  auto l = std::make_shared<Launch>();
  Reader s{sig};
  l->n_tensors = s.next();
  l->n_scalars = s.next();
  l->sig.assign(sig.begin() + 2, sig.end());
  TORCH_CHECK(l->n_tensors > 0 && l->sig.size() >= 4, "fuser native record: no tensors");
  l->device = c10::Device(static_cast<c10::DeviceType>(l->sig[1]), static_cast<c10::DeviceIndex>(l->sig[2]));
  Reader r{rec};
  l->kind = r.next();
  if (l->kind != kPython) {
    l->numel = r.next();
    const int64_t n_out = r.next();
    for (int64_t j = 0; j < n_out; ++j) {
      Out o;
      o.dtype = static_cast<c10::ScalarType>(r.next());
      const int64_t dim = r.next();
      o.sizes = r.take(dim);
      o.strides = r.take(dim);
      o.pieces = r.next();
      o.step = r.next();
      TORCH_CHECK(o.pieces >= 1 && o.step >= 0, "fuser native record: output pieces");
      l->n_kernel_outs += o.pieces;
      l->outs.push_back(std::move(o));
    }
    const int64_t n_limits = r.next();
    TORCH_CHECK(static_cast<int64_t>(floats.size()) == 2 * n_limits, "fuser native record: limits");
    for (int64_t j = 0; j < n_limits; ++j) {
      Limit lim;
      lim.index = r.next();
      TORCH_CHECK(0 <= lim.index && lim.index < l->n_scalars, "fuser native record: limit index");
      lim.nonfinite = r.next() != 0;
      lim.lo = floats[2 * j];
      lim.hi = floats[2 * j + 1];
      l->limits.push_back(lim);
    }
    l->fn = reinterpret_cast<void*>(r.next());
    if (l->kind == kCpu) {
      l->rank = r.next();
      l->sizes = r.take(r.next());
      l->strides = r.take(r.next());
      if (l->strides.empty()) l->strides.push_back(0);
      l->random = state_slots(r.next());
    } else {
      TORCH_CHECK(l->kind == kCuda, "fuser native record: unknown kind ", l->kind);
      load_driver();
      TORCH_CHECK(cu_launch && cu_ctx_get_current, "fuser native: libcuda.so.1 has no cuLaunchKernel");
      l->block = r.next();
      l->smem = r.next();
      TORCH_CHECK(0 <= l->smem && l->smem < (int64_t(1) << 31), "fuser native record: shared memory");
      l->grid_vec = r.next();
      l->grid_scalar = r.next();
      l->vec_shape = r.next();
      TORCH_CHECK(0 <= l->vec_shape && l->vec_shape <= 2, "fuser native record: vector form");
      l->ctx = reinterpret_cast<void*>(r.next());
      l->ptrs_off = r.next();
      l->vec_off = r.next();
      l->scalars_off = r.next();
      l->align = r.take(r.next());
      TORCH_CHECK(static_cast<int64_t>(l->align.size()) == l->n_tensors + l->n_kernel_outs,
                  "fuser native record: pointers");
      const std::vector<int64_t> bytes = r.take(r.next());
      l->args.assign(bytes.begin(), bytes.end());
      const auto size = static_cast<int64_t>(l->args.size());
      l->form = r.next();
      TORCH_CHECK(kPlainForm <= l->form && l->form <= kColumns, "fuser native record: form ", l->form);
      const int64_t n_temps = r.next();
      TORCH_CHECK(n_temps >= 0, "fuser native record: buffers");
      for (int64_t t = 0; t < n_temps; ++t) {
        Temp temp;
        temp.dtype = static_cast<c10::ScalarType>(r.next());
        temp.numel = r.next();
        TORCH_CHECK(temp.numel >= 0 && (temp.dtype == c10::ScalarType::Float || temp.dtype == c10::ScalarType::Double),
                    "fuser native record: buffer");
        l->temps.push_back(temp);
      }
      const int64_t n_then = r.next();
      TORCH_CHECK(n_then >= 0, "fuser native record: kernels");
      for (int64_t t = 0; t < n_then; ++t) {
        Then then;
        then.fn = reinterpret_cast<void*>(r.next());
        then.grid = r.next();
        then.block = r.next();
        then.patch_off = r.next();
        const int64_t patch = r.next();
        TORCH_CHECK(then.fn && then.grid > 0 && then.block > 0 && then.patch_off >= -1 && then.patch_off + 4 <= size &&
                        patch == static_cast<int32_t>(patch),
                    "fuser native record: a second kernel");
        then.patch = static_cast<int32_t>(patch);
        l->then.push_back(then);
      }
      l->random = state_slots(r.next());
      TORCH_CHECK(!l->random || (l->form == kPlainForm && l->then.empty() && l->temps.empty()),
                  "fuser native record: a random kernel's form");
      TORCH_CHECK(l->fn && l->block > 0 && l->grid_vec > 0 && l->grid_scalar > 0, "fuser native record: launch");
      TORCH_CHECK(l->ptrs_off + 8 * static_cast<int64_t>(l->align.size() + l->temps.size()) <= size &&
                      l->vec_off + 4 <= static_cast<int64_t>(l->args.size()) && l->vec_off >= -1 &&
                      l->ptrs_off >= 0 && l->scalars_off >= 0 &&
                      l->scalars_off + 8 * (l->n_scalars + (l->random ? kStateSlots : 0)) <= static_cast<int64_t>(l->args.size()),
                  "fuser native record: argument offsets");
    }
  }
  TORCH_CHECK(r.i == rec.size(), "fuser native record: trailing values");
  return l;
}

void insert(int64_t key, c10::string_view digest, std::shared_ptr<Launch> l) {
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table_generation.fetch_add(1, std::memory_order_release);
  Group& g = table[key];
  if (g.digest != std::string(digest)) {
    g.digest = std::string(digest);
    g.launches.clear();
  }
  if (g.launches.size() >= kMaxPerGroup) g.launches.clear();  // bounded, as the executor's geometry cache
  g.launches.push_back(std::move(l));
}

void put(int64_t key, c10::string_view digest, std::vector<int64_t> sig, std::vector<int64_t> rec,
         std::vector<double> floats) {
  insert(key, digest, parse(sig, rec, floats));
}

// A call autograd records: the forward as put's, the inputs' requires_grad, and the backward (bw: saved inputs,
// differentiable outputs, saved outputs, the outputs returned, then whether a backward group is prepared, its inputs
// and outputs; see record.py).
void put_train(int64_t key, c10::string_view digest, std::vector<int64_t> sig, std::vector<int64_t> rec,
               std::vector<double> floats, std::vector<int64_t> grads, std::vector<int64_t> bw_rec,
               c10::string_view bw_digest, std::vector<std::string> step_digests, std::vector<int64_t> py_meta) {
  auto l = parse(sig, rec, floats);
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == l->n_tensors, "fuser native record: requires_grad");
  l->requires_grad.assign(grads.begin(), grads.end());
  if (l->kind == kPython) {  // calls of this signature go to Python
    insert(key, digest, std::move(l));
    return;
  }
  auto bw = std::make_shared<Backward>();
  bw->key = key;
  bw->digest = std::string(digest);
  bw->py_meta = std::move(py_meta);
  Reader r{bw_rec};
  for (int64_t k = 0; k < l->n_tensors; ++k) bw->saved.push_back(static_cast<uint8_t>(r.next() != 0));
  const int64_t n_out = static_cast<int64_t>(l->outs.size());
  for (int64_t k = 0; k < n_out; ++k) bw->differentiable.push_back(static_cast<uint8_t>(r.next() != 0));
  for (int64_t k = 0; k < n_out; ++k) bw->saved_out.push_back(static_cast<uint8_t>(r.next() != 0));
  bw->n_visible = r.next();
  TORCH_CHECK(0 < bw->n_visible && bw->n_visible <= n_out, "fuser native record: returned outputs");
  for (int64_t k = bw->n_visible; k < n_out; ++k)
    TORCH_CHECK(!bw->differentiable[k] && bw->saved_out[k], "fuser native record: an extra output");
  const int64_t n_chunked = r.next();
  for (int64_t c = 0; c < n_chunked; ++c) {
    Backward::Chunks chunks;
    chunks.dim = r.next();
    chunks.inputs = r.take(r.next());
    TORCH_CHECK(chunks.inputs.size() >= 2, "fuser native record: chunks");
    for (int64_t k : chunks.inputs) TORCH_CHECK(0 <= k && k < l->n_tensors, "fuser native record: chunk input");
    bw->chunks.push_back(std::move(chunks));
  }
  bw->has_group = r.next() != 0;
  if (bw->has_group) {
    bw->bw_key = r.next();
    bw->bw_digest = std::string(bw_digest);
    const int64_t n_in = r.next();
    for (int64_t j = 0; j < n_in; ++j) {
      const int64_t kind = r.next(), index = r.next();
      const int64_t bound = kind == 0 ? l->n_tensors : kind == 1 ? l->n_scalars : n_out;
      TORCH_CHECK(0 <= kind && kind <= 3 && 0 <= index && index < bound, "fuser native record: backward input");
      TORCH_CHECK(kind != 0 || bw->saved[index], "fuser native record: a backward input that is not saved");
      TORCH_CHECK(kind != 3 || bw->saved_out[index], "fuser native record: a backward output that is not saved");
      TORCH_CHECK(kind != 2 || bw->differentiable[index], "fuser native record: a gradient that never arrives");
      bw->inputs.emplace_back(kind, index);
    }
    for (int64_t k : r.take(r.next())) {
      TORCH_CHECK(0 <= k && k < l->n_tensors, "fuser native record: gradient input");
      bw->grad_inputs.push_back(k);
    }
    for (int64_t k : r.take(r.next())) {
      TORCH_CHECK(0 <= k && k < l->n_tensors, "fuser native record: zero input");
      bw->zero_inputs.push_back(k);
    }
    const int64_t n_alias = r.next();
    for (int64_t j = 0; j < n_alias; ++j) {
      const int64_t k = r.next(), out = r.next();
      TORCH_CHECK(0 <= k && k < l->n_tensors && 0 <= out && out < static_cast<int64_t>(bw->grad_inputs.size()),
                  "fuser native record: gradient alias");
      bw->aliases.emplace_back(k, out);
    }
    const int64_t n_steps = r.next();
    TORCH_CHECK(n_steps == 0 || static_cast<int64_t>(step_digests.size()) == n_steps,
                "fuser native record: step digests");
    for (int64_t s = 0; s < n_steps; ++s) {
      SumStep step;
      step.key = r.next();
      step.kind = r.next();
      step.digest = step_digests[s];
      step.n_out = r.next();
      const int64_t n_in = r.next();
      for (int64_t j = 0; j < n_in; ++j) {
        const int64_t src = r.next(), i = r.next();
        TORCH_CHECK(src < 0 ? 0 <= i && i < static_cast<int64_t>(bw->inputs.size())
                            : src < s && 0 <= i && i < bw->steps[src].n_out,
                    "fuser native record: step input");
        step.inputs.emplace_back(src < 0 ? -1 : src, i);
      }
      bw->steps.push_back(std::move(step));
    }
    const int64_t n_takes = n_steps ? r.next() : 0;
    for (int64_t j = 0; j < n_takes; ++j) {
      const int64_t k = r.next(), s = r.next(), out = r.next();
      TORCH_CHECK(0 <= k && k < l->n_tensors && 0 <= s && s < n_steps && 0 <= out && out < bw->steps[s].n_out,
                  "fuser native record: summed gradient");
      bw->step_takes.push_back({k, s, out});
    }
  }
  TORCH_CHECK(r.i == bw_rec.size(), "fuser native record: trailing backward values");
  l->backward = std::move(bw);
  insert(key, digest, std::move(l));
}

void clear() {
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table_generation.fetch_add(1, std::memory_order_release);
  table.clear();
  bn_kept().clear();  // (the calling thread's)
}

std::vector<int64_t> stats() {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  int64_t launches = 0;
  for (const auto& kv : table) launches += static_cast<int64_t>(kv.second.launches.size());
  return {n_hits.load(), n_misses.load(), n_handed.load(), launches, n_fused.load(), n_columns.load(), n_split.load(),
          n_cuda_row_sums.load(), n_cuda_column_kernels.load(), n_new_blocks.load(), n_new_large.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fuser, m) {
  m.def("_native_put(int key, str digest, int[] sig, int[] rec, float[] floats) -> ()", &put);
  m.def("_native_put_train(int key, str digest, int[] sig, int[] rec, float[] floats, int[] grads, int[] bw, "
        "str bw_digest, str[] step_digests, int[] py_meta) -> ()", &put_train);
  m.def("_native_clear() -> ()", &clear);
  m.def("_native_stats() -> int[]", &stats);
  m.def("_native_phases(bool on) -> int[]", &phases);
  m.def("_native_scalar_type(ScalarType dtype) -> int",
        [](c10::ScalarType dtype) -> int64_t { return static_cast<int64_t>(dtype); });
}

#define FUSER_CHUNK_IMPLS(m, M)                          \
  m.impl("fusion_group" #M "_c1", &group_c1<M>);         \
  m.impl("fusion_group" #M "_c2", &group_c2<M>);         \
  m.impl("fusion_group" #M "_c3", &group_c3<M>);         \
  m.impl("fusion_group" #M "_c4", &group_c4<M>)
// CPU and CUDA for calls without autograd keys (inference mode), their Autograd keys for the others: a kernel
// registered here takes precedence over the Python CompositeImplicitAutograd one for these keys only
#define FUSER_NATIVE_IMPLS(m)                            \
  m.impl("fusion_group", &fusion_group);                 \
  m.impl("fusion_group1", &fusion_group1);               \
  m.impl("fusion_group1_t1", &fusion_group1_t1);         \
  m.impl("fusion_group1_t2", &fusion_group1_t2);         \
  m.impl("fusion_group1_t3", &fusion_group1_t3);         \
  m.impl("fusion_group1_t4", &fusion_group1_t4);         \
  FUSER_CHUNK_IMPLS(m, 1);                               \
  FUSER_CHUNK_IMPLS(m, 2);                               \
  FUSER_CHUNK_IMPLS(m, 3);                               \
  m.impl("broadcasting_chunk", &broadcasting_chunk);     \
  m.impl("batch_norm_params", &batch_norm_params)
TORCH_LIBRARY_IMPL(fuser, CPU, m) { FUSER_NATIVE_IMPLS(m); }
TORCH_LIBRARY_IMPL(fuser, CUDA, m) { FUSER_NATIVE_IMPLS(m); }
TORCH_LIBRARY_IMPL(fuser, AutogradCPU, m) { FUSER_NATIVE_IMPLS(m); }
TORCH_LIBRARY_IMPL(fuser, AutogradCUDA, m) { FUSER_NATIVE_IMPLS(m); }
