// Saved-variable hooks for libtorch 1.13: an autograd Engine subclass that
// hands out OffloadHooks while an OffloadScope is active (see torch.h).
#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <typeinfo>
#include <utility>

#include "actstash/torch.h"

namespace actstash::torch {
namespace {

using ::torch::autograd::Engine;
using ::torch::autograd::SavedVariableHooks;

// This thread's hook sources, innermost last; a null entry turns hooks off.
thread_local std::vector<std::shared_ptr<internal::HookSource>> tls_scopes;

std::unique_ptr<SavedVariableHooks> MakeHooks();

// The default engine once hooks are installed: torch's base engine plus
// default saved-variable hooks (what PythonEngine adds for Python's
// saved_tensors_hooks). One instance per process.
//
// It only hands out hooks; every backward runs on the base engine. libtorch
// expects one Engine per process: its device worker threads are started once
// per process (torch 2.x keeps the once-flag in a function-local static), by
// whichever engine executes first. An engine of its own would find no device
// queue when a CUDA backward had already run on the base engine (a warm-up
// step before the Offloader was created) and fail torch's internal assert in
// Engine::ready_queue. CPU work runs on the caller's thread, so only a device
// shows it.
class HookEngine final : public Engine {
 public:
  static Engine& Get() {
    static HookEngine engine;
    return engine;
  }
  ~HookEngine() override { Engine::stop(); }
  std::unique_ptr<SavedVariableHooks> get_default_saved_variable_hooks() override {
    return MakeHooks();
  }
  ::torch::autograd::variable_list execute(const ::torch::autograd::edge_list& roots,
                                           const ::torch::autograd::variable_list& inputs,
                                           bool keep_graph, bool create_graph, bool accumulate_grad,
                                           const ::torch::autograd::edge_list& outputs) override {
    return Engine::get_base_engine().execute(roots, inputs, keep_graph, create_graph,
                                             accumulate_grad, outputs);
  }
  c10::intrusive_ptr<at::ivalue::Future> execute_with_graph_task(
      const std::shared_ptr<::torch::autograd::GraphTask>& graph_task,
      std::shared_ptr<::torch::autograd::Node> graph_root,
      ::torch::autograd::InputBuffer&& input_buffer) override {
    return Engine::get_base_engine().execute_with_graph_task(graph_task, std::move(graph_root),
                                                             std::move(input_buffer));
  }

 private:
  HookEngine() = default;
};

std::atomic<bool> installed{false};

bool HookEngineIsDefault() {
  return installed.load() && &Engine::get_default_engine() == &HookEngine::Get();
}

// Whether the elements of `t` are distinct apart from broadcast dimensions
// (stride 0): a dense tensor, a view with gaps, or a broadcast of one — not
// an as_strided overlap. Python's _overlapping is the same rule.
bool DistinctButForBroadcasts(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != 0) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements covered by the dims so far
  for (const auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * size;
  }
  return true;
}

// Owner references for the engine: TensorImpls and SavedMeta, both
// intrusively counted.
void IncRef(void* p) {
  c10::raw::intrusive_ptr::incref(static_cast<c10::intrusive_ptr_target*>(p));
}
void DecRef(void* p) {
  c10::raw::intrusive_ptr::decref(static_cast<c10::intrusive_ptr_target*>(p));
}

void* OwnerOf(const at::Tensor& t) {
  return static_cast<c10::intrusive_ptr_target*>(t.unsafeGetTensorImpl());
}

// A tensor from a reference the engine handed over.
at::Tensor TakeTensor(void* owner) {
  auto* impl = static_cast<c10::TensorImpl*>(static_cast<c10::intrusive_ptr_target*>(owner));
  return at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl));
}

// What a prefetch needs to allocate a saved tensor's destination (the engine's
// cookie of that tensor).
struct SavedMeta : c10::intrusive_ptr_target {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::TensorOptions options;
  bool dense = true;
  uint64_t nbytes = 0;

  at::Tensor Allocate() const {
    return dense ? at::empty_strided(sizes, strides, options) : at::empty(sizes, options);
  }
  // Gives a contiguous copy of a view with gaps or a broadcast that view's
  // strides back, so backward's kernels see the layout they would have seen
  // (and produce the same bits). A broadcast keeps one copy along its
  // stride-0 dimensions, viewed with the saved strides.
  at::Tensor Restride(const at::Tensor& t) const {
    if (dense || t.strides() == at::IntArrayRef(strides)) return t;
    bool broadcast = false;
    for (size_t d = 0; d < sizes.size(); ++d) broadcast |= strides[d] == 0 && sizes[d] > 1;
    if (!broadcast) {
      at::Tensor out = at::empty_strided(sizes, strides, options);
      out.copy_(t);
      return out;
    }
    at::Tensor compact = t.reshape(sizes);
    std::vector<int64_t> base_strides = strides;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (strides[d] != 0) continue;
      if (sizes[d] > 1) compact = compact.narrow(static_cast<int64_t>(d), 0, 1);
      base_strides[d] = 1;
    }
    at::Tensor base = at::empty_strided(compact.sizes(), base_strides, options);
    base.copy_(compact);
    return base.as_strided(sizes, strides);
  }
};

}  // namespace

namespace internal {

// One saved tensor: kept (a detached alias) or handed to the engine. Autograd
// calls pack once on the saving thread, unpack any number of times from
// backward, and destroys the hooks with the saved variable.
class OffloadHooks final : public SavedVariableHooks {
 public:
  // check_version false: the unpack does not compare versions (Checkpoint's
  // boundary: fn may change its input in place after it was stored).
  OffloadHooks(std::shared_ptr<Offloader> offloader, bool check_version)
      : offloader_(std::move(offloader)), check_version_(check_version) {}

  ~OffloadHooks() override {
    if (id_ != 0) offloader_->engine_->Release(id_);
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    // Autograd checks versions only for tensors saved without hooks.
    version_ = tensor.unsafeGetTensorImpl()->version_counter();
    const uint64_t saved_version = version_.current_version();
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    const OffloadOptions& options = offloader_->options_;
    SavedTensorEngine& engine = *offloader_->engine_;
    saved_version_ = saved_version;
    // Below min_bytes the engine reads nothing but the size (and counts it as
    // small before any other reason, as for Python): no metadata is made.
    const KeepReason keep = nbytes < options.min_bytes ? KeepReason::kSmall : KeepReasonOf(tensor);
    if (keep != KeepReason::kCount) {
      kept_ = tensor.detach();  // detached: no cycle through its grad_fn
      SavedTensorInfo info;
      info.nbytes = nbytes;
      engine.Pack(info, keep, options.min_bytes);
      return;
    }
    meta_ = c10::make_intrusive<SavedMeta>();
    meta_->sizes = tensor.sizes().vec();
    meta_->strides = tensor.strides().vec();
    meta_->options = tensor.options();
    meta_->dense = tensor.is_non_overlapping_and_dense();
    meta_->nbytes = nbytes;
    device_ = tensor.device();
    at::Tensor source = tensor.detach();  // held by the engine while it copies
    SavedTensorInfo info;
    info.data = reinterpret_cast<uintptr_t>(source.data_ptr());
    info.nbytes = nbytes;
    info.element_size = static_cast<int>(tensor.element_size());
    info.is_fp32 = tensor.scalar_type() == at::kFloat;
    info.dense = meta_->dense;
    info.ndim = static_cast<int>(tensor.dim());
    info.sizes = meta_->sizes.data();
    info.strides = meta_->strides.data();
    info.device = device_.is_cuda() ? device_.index() : -1;
    info.stream = StreamOf(device_);
    info.version = saved_version;
    info.owner = OwnerOf(source);
    info.cookie = static_cast<c10::intrusive_ptr_target*>(meta_.get());
    info.sync = !check_version_;  // a boundary input: fn may change it in place next
    id_ = engine.Pack(info, KeepReason::kCount, options.min_bytes);
    // A failed reservation keeps the tensor here, as autograd would.
    (void)engine.TakeError();
    if (id_ == 0) kept_ = std::move(source);
  }

  at::Tensor call_unpack_hook() override {
    if (id_ == 0) {
      TORCH_CHECK(
          !check_version_ || !kept_.defined() || version_.current_version() == saved_version_,
          "one of the variables needed for gradient computation has been modified by an "
          "inplace operation (tensor saved with actstash hooks)");
      return kept_;
    }
    SavedTensorEngine& engine = *offloader_->engine_;
    absl::StatusOr<UnpackResult> r = engine.UnpackBegin(
        id_, check_version_ ? version_.current_version() : SavedTensorEngine::kUnknownVersion,
        offloader_->options_.prefetch);
    TORCH_CHECK(r.ok(), r.status().code() == absl::StatusCode::kFailedPrecondition
                            ? std::string(r.status().message())
                            : "actstash: fetching a saved tensor failed: " + r.status().ToString());
    // What was handed over is owned before anything else can throw.
    at::Tensor handed;
    if (r->kind == UnpackKind::kSource || r->kind == UnpackKind::kPrefetched) {
      handed = TakeTensor(r->owner);
    }
    const StreamHandle stream = StreamOf(device_);
    switch (r->kind) {
      case UnpackKind::kSource:
        Prefetch(*r);
        return meta_->Restride(handed);
      case UnpackKind::kView: {
        // Reads the leased bytes in place; the engine frees them once the
        // saved variable and every tensor on this memory are gone.
        std::shared_ptr<Offloader> keep_alive = offloader_;
        auto done = [keep_alive, id = id_](void*) { keep_alive->engine_->ViewDone(id); };
        void* data = const_cast<void*>(r->data);
        at::Tensor view =
            meta_->dense ? at::from_blob(data, meta_->sizes, meta_->strides, done, meta_->options)
                         : at::from_blob(data, meta_->sizes, done, meta_->options);
        Prefetch(*r);
        return meta_->Restride(view);
      }
      case UnpackKind::kPrefetched: {
        at::Tensor out = std::move(handed);
        const absl::Status status = engine.Finish(id_, stream);
        Prefetch(*r);
        if (out.is_cuda()) {
          // Allocated on the stream current when the prefetch was issued:
          // the caching allocator must not reuse it before the stream that
          // uses it now is done with it.
          out.record_stream(
              c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(out.device()));
        }
        TORCH_CHECK(status.ok(), "actstash: fetching a saved tensor failed: ", status.ToString());
        return meta_->Restride(out);
      }
      case UnpackKind::kDestination:
        break;
    }
    at::Tensor out = meta_->Allocate();
    const absl::Status status =
        engine.FetchInto(id_, reinterpret_cast<uintptr_t>(out.data_ptr()), meta_->nbytes, stream);
    // Prefetches only now: the fetch stream is first in, first out, and the
    // copy needed now must not queue behind copies needed later.
    Prefetch(*r);
    TORCH_CHECK(status.ok(), "actstash: fetching a saved tensor failed: ", status.ToString());
    return meta_->Restride(out);
  }

 private:
  KeepReason KeepReasonOf(const at::Tensor& t) const {
    const OffloadOptions& options = offloader_->options_;
    if (t.layout() != at::kStrided || t.is_quantized() || t.is_nested() || t.is_conj() ||
        t.is_neg() || !t.has_storage() || !DistinctButForBroadcasts(t)) {
      return KeepReason::kLayout;
    }
    // The order of Python's _keep_flag: layout, device, parameter.
    // A CUDA tensor only on the engine's own device: its streams and events
    // order copies against that device's streams, not another's.
    if (!t.device().is_cpu() &&
        !(t.device().is_cuda() && options.cuda_engine != nullptr &&
          t.device().index() == options.cuda_engine->device() && offloader_->client_->attached())) {
      return KeepReason::kDevice;
    }
    if (t.is_leaf() && t.requires_grad()) return KeepReason::kParameter;  // kept anyway
    if (t.is_view()) {
      const at::TensorBase& base = t._base();  // e.g. weight.t(): aliases a parameter
      if (base.is_leaf() && base.requires_grad()) return KeepReason::kParameter;
    }
    return KeepReason::kCount;
  }

  StreamHandle StreamOf(const c10::Device& device) const {
    if (!device.is_cuda() || !offloader_->options_.current_stream) return StreamHandle{};
    return StreamHandle{offloader_->options_.current_stream(device.index())};
  }

  // Starts the fetches the engine offered (the next tensors backward reads).
  // Speculative: a failure (e.g. out of memory) leaves the fetch to that
  // tensor's own unpack. Never throws.
  void Prefetch(const UnpackResult& r) const noexcept {
    std::vector<c10::intrusive_ptr<SavedMeta>> metas;  // every cookie handed over is taken
    for (void* cookie : r.prefetch_cookies) {
      metas.push_back(c10::intrusive_ptr<SavedMeta>::reclaim(
          static_cast<SavedMeta*>(static_cast<c10::intrusive_ptr_target*>(cookie))));
    }
    for (size_t i = 0; i < metas.size(); ++i) {
      try {
        at::Tensor dst = metas[i]->Allocate();
        (void)offloader_->engine_->Prefetch(r.prefetch_ids[i],
                                            reinterpret_cast<uintptr_t>(dst.data_ptr()),
                                            metas[i]->nbytes, OwnerOf(dst), StreamOf(dst.device()));
      } catch (const std::exception&) {
      }
    }
  }

  std::shared_ptr<Offloader> offloader_;
  const bool check_version_;
  c10::VariableVersion version_;  // the saved tensor's counter
  uint64_t saved_version_ = 0;    // when packed
  at::Tensor kept_;               // not offloaded
  uint64_t id_ = 0;               // offloaded: the engine's id
  c10::intrusive_ptr<SavedMeta> meta_;
  c10::Device device_ = c10::Device(c10::kCPU);
};

ScopedHookSource::ScopedHookSource(std::shared_ptr<HookSource> source) : depth_(tls_scopes.size()) {
  tls_scopes.push_back(std::move(source));
}

ScopedHookSource::~ScopedHookSource() {
  if (tls_scopes.size() != depth_ + 1) {
    std::fprintf(stderr, "actstash: scopes destroyed out of order or on another thread\n");
    std::abort();
  }
  tls_scopes.pop_back();
}

}  // namespace internal

namespace {

std::unique_ptr<SavedVariableHooks> MakeHooks() {
  if (tls_scopes.empty() || tls_scopes.back() == nullptr) return nullptr;
  if (!at::SavedTensorDefaultHooks::is_enabled()) return nullptr;  // a torch feature opted out
  return tls_scopes.back()->MakeHooks();
}

}  // namespace

absl::Status InstallSavedVariableHooks() {
  static const absl::Status status = []() -> absl::Status {
    Engine& current = Engine::get_default_engine();
    if (typeid(current) != typeid(Engine)) {
      return absl::FailedPreconditionError(
          std::string("actstash: torch's default autograd engine is already replaced (by ") +
          typeid(current).name() +
          ", e.g. torch's Python engine); saved-variable hooks cannot be installed from C++");
    }
    ::torch::autograd::set_default_engine_stub(&HookEngine::Get);
    installed = true;
    return absl::OkStatus();
  }();
  return status;
}

absl::StatusOr<std::shared_ptr<Offloader>> Offloader::Create(std::shared_ptr<Client> client,
                                                             OffloadOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("actstash: null client");
  if (absl::Status status = InstallSavedVariableHooks(); !status.ok()) return status;
  if (options.copy_engine == nullptr) options.copy_engine = CreateHostCopyEngine();
  if (options.cuda_engine != nullptr && !options.current_stream) {
    // Copies ordered after stream 0 while the trainer runs on another stream
    // would read activations before they are written.
    return absl::InvalidArgumentError(
        "actstash: OffloadOptions.cuda_engine needs current_stream (e.g. [](int d) { return "
        "reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(d).stream()); })");
  }
  EngineOptions engine_options;
  engine_options.inline_store_bytes = options.inline_store_bytes;
  engine_options.cpu_views = options.cpu_views;
  engine_options.prefetch = options.prefetch;
  engine_options.downcast_bf16 = options.downcast_bf16;
  engine_options.on_failure = FailurePolicy::kRaise;  // taken per tensor: it stays in memory
  engine_options.host_engine = options.copy_engine;
  if (options.cuda_engine != nullptr && options.cuda_engine->device() >= 0) {
    engine_options.cuda_engines.resize(options.cuda_engine->device() + 1);
    engine_options.cuda_engines[options.cuda_engine->device()] = options.cuda_engine;
  }
  engine_options.cuda = options.cuda_engine != nullptr;
  if (options.device_pool >= 0) {
    if (options.cuda_engine == nullptr) {
      return absl::InvalidArgumentError("actstash: OffloadOptions.device_pool needs a cuda_engine");
    }
    engine_options.device_pool = options.device_pool;
    engine_options.pool_importer = options.cuda_engine->device();
  }
  engine_options.acquire_owner = &IncRef;
  engine_options.release_owner = &DecRef;
  absl::StatusOr<std::unique_ptr<SavedTensorEngine>> engine =
      SavedTensorEngine::Create(client, std::move(engine_options));
  if (!engine.ok()) return engine.status();
  return std::shared_ptr<Offloader>(
      new Offloader(std::move(client), std::move(options), std::move(*engine)));
}

Offloader::Offloader(std::shared_ptr<Client> client, OffloadOptions options,
                     std::unique_ptr<SavedTensorEngine> engine)
    : client_(std::move(client)), options_(std::move(options)), engine_(std::move(engine)) {}

Offloader::~Offloader() { engine_.reset(); }  // waits for its copies (they use client_)

void Offloader::Synchronize() { engine_->Synchronize(); }

std::unique_ptr<SavedVariableHooks> Offloader::MakeHooks() {
  return std::make_unique<internal::OffloadHooks>(shared_from_this(), /*check_version=*/true);
}

std::unique_ptr<SavedVariableHooks> Offloader::MakeBoundaryHooks() {
  return std::make_unique<internal::OffloadHooks>(shared_from_this(), /*check_version=*/false);
}

OffloadStats Offloader::stats() const { return engine_->stats(); }

OffloadScope::OffloadScope(std::shared_ptr<Offloader> offloader)
    : scope_(std::move(offloader)), active_(HookEngineIsDefault()) {}

OffloadScope::~OffloadScope() = default;

std::shared_ptr<Offloader> CurrentOffloader() {
  return tls_scopes.empty() ? nullptr : std::dynamic_pointer_cast<Offloader>(tls_scopes.back());
}

}  // namespace actstash::torch
