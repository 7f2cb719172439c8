// fuser's native hot path: the kernel of the TorchScript operator fuser::fusion_group in C++.
//
// A call whose inputs match a signature prepared by Python (fuser/native/record.py) allocates its outputs and
// launches the compiled kernel here: the CPU kernel's function, or cuLaunchKernel on torch's current stream. Every
// other call (a new signature, autograd, a transform, a random or row kernel, a lazy tensor bit) goes to the Python
// operator fuser::fusion_group_py, which runs the group as before and, when asked to, prepares the signature for
// next time. Nothing here decides anything about a group: it replays what Python prepared, or hands over.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <cmath>
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
using CpuKernel = void (*)(int64_t, int64_t, const int64_t*, const int64_t*, void* const*, const double*);

enum Kind : int64_t { kCpu = 0, kCuda = 1, kPython = 2 };

struct Out {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
};

struct Limit {
  int64_t index;
  bool nonfinite;
  double lo, hi;
};

// One prepared input signature of one group: what to check, what to allocate, what to launch.
struct Launch {
  std::vector<int64_t> sig;  // per tensor: dtype, device type, device index, dim, sizes, strides
  int64_t n_tensors = 0, n_scalars = 0;
  int64_t kind = kPython;
  int64_t numel = 0;
  c10::Device device{c10::kCPU};
  std::vector<Out> outs;
  std::vector<Limit> limits;
  void* fn = nullptr;
  // CPU
  int64_t rank = 0;
  std::vector<int64_t> sizes, strides;
  // CUDA: the by-value argument struct with everything but pointers, the vector flag and float arguments
  std::vector<uint8_t> args;
  int64_t ptrs_off = 0, vec_off = 0, scalars_off = 0, block = 0, grid_vec = 0, grid_scalar = 0;
  bool vec_shape = false;
  void* ctx = nullptr;
  std::vector<int64_t> align;  // per pointer (inputs, outputs): bytes the vector path needs, 0: any
};

constexpr size_t kMaxPerGroup = 64;

struct Group {
  std::string digest;
  std::vector<std::shared_ptr<const Launch>> launches;
};

std::shared_mutex table_mutex;
std::unordered_map<int64_t, Group> table;
std::atomic<int64_t> n_hits{0}, n_misses{0}, n_handed{0};

CuLaunch cu_launch = nullptr;
CuCtxGetCurrent cu_ctx_get_current = nullptr;
std::once_flag cuda_once;

void load_driver() {
  std::call_once(cuda_once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) return;
    cu_launch = reinterpret_cast<CuLaunch>(dlsym(lib, "cuLaunchKernel"));
    cu_ctx_get_current = reinterpret_cast<CuCtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
  });
}

// Keys a plain dense tensor carries besides its backend's: autograd, autocast, ADInplaceOrView. Anything else (a
// negated, conjugated or zero tensor, a Python subclass, a functorch wrapper, a sparse or nested layout) is not a
// plain tensor's memory: Python decides.
const c10::DispatchKeySet kIgnored = c10::autograd_dispatch_keyset | c10::autocast_dispatch_keyset |
                                     c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);
const c10::DispatchKeySet kPlainCpu(c10::DispatchKey::CPU);
const c10::DispatchKeySet kPlainCuda(c10::DispatchKey::CUDA);

bool matches(const Launch& l, at::TensorList inputs) {
  const int64_t* s = l.sig.data();
  for (const at::Tensor& t : inputs) {
    if (static_cast<int64_t>(t.scalar_type()) != s[0]) return false;
    const c10::Device d = t.device();
    if (static_cast<int64_t>(d.type()) != s[1] || d.index() != s[2]) return false;
    const int64_t dim = t.dim();
    if (dim != s[3]) return false;
    s += 4;
    if (std::memcmp(t.sizes().data(), s, dim * sizeof(int64_t)) != 0) return false;
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

// Whether the call may take a prepared launch at all: no autograd to record, no forward-mode tangent, no functorch
// transform, plain dense tensors.
bool plain_call(at::TensorList inputs) {
  if (inputs.empty()) return false;
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) return false;
  const bool grad = c10::GradMode::is_enabled();
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) return false;
    const c10::DispatchKeySet rest = t.key_set() - kIgnored;
    if (rest != kPlainCpu && rest != kPlainCuda) return false;
    if (t.unsafeGetTensorImpl()->autograd_meta() != nullptr) {
      if (grad && t.requires_grad()) return false;
      if (t._fw_grad(0).defined()) return false;
    }
  }
  return true;
}

void launch_cuda(const Launch& l, at::TensorList inputs, at::ArrayRef<double> scalars,
                 const std::vector<at::Tensor>& outs) {
  thread_local std::vector<uint8_t> buf;
  buf.assign(l.args.begin(), l.args.end());
  uint8_t* base = buf.data();
  bool vec = l.vec_shape;
  size_t k = 0;
  auto put = [&](const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::memcpy(base + l.ptrs_off + 8 * k, &a, 8);
    if (l.align[k] && a % l.align[k]) vec = false;
    ++k;
  };
  for (const at::Tensor& t : inputs) put(t.data_ptr());
  for (const at::Tensor& o : outs) put(o.data_ptr());
  const int32_t v = vec ? 1 : 0;
  std::memcpy(base + l.vec_off, &v, 4);
  if (!scalars.empty()) std::memcpy(base + l.scalars_off, scalars.data(), scalars.size() * sizeof(double));
  const auto grid = static_cast<unsigned>(vec ? l.grid_vec : l.grid_scalar);
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(l.device).native_handle();
  void* params[1] = {base};
  const int err = cu_launch(l.fn, grid, 1, 1, static_cast<unsigned>(l.block), 1, 1, 0, stream, params, nullptr);
  TORCH_CHECK(err == 0, "fuser: cuLaunchKernel failed with CUresult ", err);
}

void launch_cpu(const Launch& l, at::TensorList inputs, at::ArrayRef<double> scalars,
                const std::vector<at::Tensor>& outs) {
  void* ptrs[64];
  std::vector<void*> many;
  void** p = ptrs;
  const size_t n = inputs.size() + outs.size();
  if (n > 64) {
    many.resize(n);
    p = many.data();
  }
  size_t k = 0;
  for (const at::Tensor& t : inputs) p[k++] = t.data_ptr();
  for (const at::Tensor& o : outs) p[k++] = o.data_ptr();
  const double none = 0.0;
  reinterpret_cast<CpuKernel>(l.fn)(l.numel, l.rank, l.sizes.data(), l.strides.data(), p,
                                    scalars.empty() ? &none : scalars.data());
}

std::vector<at::Tensor> fusion_group(at::TensorList inputs, at::ArrayRef<double> scalars, int64_t key,
                                     c10::string_view digest, c10::string_view ir) {
  if (!plain_call(inputs)) return hand_over(inputs, scalars, key, digest, ir, false);
  std::shared_ptr<const Launch> found;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    auto it = table.find(key);
    if (it != table.end() && c10::string_view(it->second.digest) == digest) {
      for (const auto& l : it->second.launches) {
        if (l->n_tensors == static_cast<int64_t>(inputs.size()) &&
            l->n_scalars == static_cast<int64_t>(scalars.size()) && matches(*l, inputs)) {
          found = l;
          break;
        }
      }
    }
  }
  if (!found) return hand_over(inputs, scalars, key, digest, ir, true);
  const Launch& l = *found;
  if (l.kind == kPython) return hand_over(inputs, scalars, key, digest, ir, false);
  for (const Limit& lim : l.limits) {
    const double x = scalars[lim.index];
    if (!(lim.lo <= x && x <= lim.hi) && !(lim.nonfinite && !std::isfinite(x)))
      return hand_over(inputs, scalars, key, digest, ir, false);  // eager raises or converts otherwise
  }
  if (l.kind == kCuda) {
    // the prepared context and device must be this thread's current ones; otherwise Python switches to them
    auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    void* ctx = nullptr;
    if (guard->getDevice() != l.device || cu_ctx_get_current(&ctx) != 0 || ctx != l.ctx)
      return hand_over(inputs, scalars, key, digest, ir, false);
  }
  std::vector<at::Tensor> outs;
  outs.reserve(l.outs.size());
  const auto options = at::TensorOptions().device(l.device);
  for (const Out& o : l.outs) outs.push_back(at::empty_strided(o.sizes, o.strides, options.dtype(o.dtype)));
  n_hits.fetch_add(1, std::memory_order_relaxed);
  if (l.numel == 0) return outs;
  if (l.kind == kCuda)
    launch_cuda(l, inputs, scalars, outs);
  else
    launch_cpu(l, inputs, scalars, outs);
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

void put(int64_t key, c10::string_view digest, std::vector<int64_t> sig, std::vector<int64_t> rec,
         std::vector<double> floats) {
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
      l->sizes = r.take(l->rank);
      l->strides = r.take(r.next());
      if (l->strides.empty()) l->strides.push_back(0);
    } else {
      TORCH_CHECK(l->kind == kCuda, "fuser native record: unknown kind ", l->kind);
      load_driver();
      TORCH_CHECK(cu_launch && cu_ctx_get_current, "fuser native: libcuda.so.1 has no cuLaunchKernel");
      l->block = r.next();
      l->grid_vec = r.next();
      l->grid_scalar = r.next();
      l->vec_shape = r.next() != 0;
      l->ctx = reinterpret_cast<void*>(r.next());
      l->ptrs_off = r.next();
      l->vec_off = r.next();
      l->scalars_off = r.next();
      l->align = r.take(r.next());
      TORCH_CHECK(static_cast<int64_t>(l->align.size()) == l->n_tensors + static_cast<int64_t>(l->outs.size()),
                  "fuser native record: pointers");
      const std::vector<int64_t> bytes = r.take(r.next());
      l->args.assign(bytes.begin(), bytes.end());
      TORCH_CHECK(l->ptrs_off + 8 * static_cast<int64_t>(l->align.size()) <= static_cast<int64_t>(l->args.size()) &&
                      l->vec_off + 4 <= static_cast<int64_t>(l->args.size()) &&
                      l->scalars_off + 8 * l->n_scalars <= static_cast<int64_t>(l->args.size()),
                  "fuser native record: argument offsets");
    }
  }
  TORCH_CHECK(r.i == rec.size(), "fuser native record: trailing values");
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  Group& g = table[key];
  if (g.digest != std::string(digest)) {
    g.digest = std::string(digest);
    g.launches.clear();
  }
  if (g.launches.size() >= kMaxPerGroup) g.launches.clear();  // bounded, as the executor's geometry cache
  g.launches.push_back(std::move(l));
}

void clear() {
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table.clear();
}

std::vector<int64_t> stats() {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  int64_t launches = 0;
  for (const auto& kv : table) launches += static_cast<int64_t>(kv.second.launches.size());
  return {n_hits.load(), n_misses.load(), n_handed.load(), launches};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fuser, m) {
  m.def("_native_put(int key, str digest, int[] sig, int[] rec, float[] floats) -> ()", &put);
  m.def("_native_clear() -> ()", &clear);
  m.def("_native_stats() -> int[]", &stats);
  m.def("_native_scalar_type(ScalarType dtype) -> int",
        [](c10::ScalarType dtype) -> int64_t { return static_cast<int64_t>(dtype); });
}

// CPU and CUDA for calls without autograd keys (inference mode), their Autograd keys for the others: a kernel
// registered here takes precedence over the Python CompositeImplicitAutograd one for these keys only
#define FUSER_NATIVE_IMPLS(m)                            \
  m.impl("fusion_group", &fusion_group);                 \
  m.impl("broadcasting_chunk", &broadcasting_chunk);     \
  m.impl("batch_norm_params", &batch_norm_params)
TORCH_LIBRARY_IMPL(fuser, CPU, m) { FUSER_NATIVE_IMPLS(m); }
TORCH_LIBRARY_IMPL(fuser, CUDA, m) { FUSER_NATIVE_IMPLS(m); }
TORCH_LIBRARY_IMPL(fuser, AutogradCPU, m) { FUSER_NATIVE_IMPLS(m); }
TORCH_LIBRARY_IMPL(fuser, AutogradCUDA, m) { FUSER_NATIVE_IMPLS(m); }
