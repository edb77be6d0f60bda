// Saved-variable hooks for libtorch 1.13: an autograd Engine subclass that
// hands out OffloadHooks while an OffloadScope is active (see torch.h).
#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
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

// This thread's scopes, innermost last; a null entry turns offload off.
thread_local std::vector<std::shared_ptr<Offloader>> tls_scopes;

std::unique_ptr<SavedVariableHooks> MakeHooks();

// The base engine plus default saved-variable hooks (what PythonEngine adds
// for Python's saved_tensors_hooks). One instance per process.
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

 private:
  HookEngine() = default;
};

std::atomic<bool> installed{false};

bool HookEngineIsDefault() {
  return installed.load() && &Engine::get_default_engine() == &HookEngine::Get();
}

// Whether the elements of `t` are distinct (a dense tensor or a view with
// gaps, not a broadcast or an as_strided overlap).
bool NonOverlapping(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements covered by the dims so far
  for (const auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * size;
  }
  return true;
}

}  // namespace

namespace internal {

// One saved tensor: either kept (a detached alias) or stored in the daemon.
// Autograd calls pack once on the saving thread, unpack any number of times
// from backward, and destroys the hooks with the saved variable.
class OffloadHooks final : public SavedVariableHooks {
 public:
  explicit OffloadHooks(std::shared_ptr<Offloader> offloader) : offloader_(std::move(offloader)) {}

  ~OffloadHooks() override {
    if (!stored_) return;
    // The Offloader (which owns the client) outlives this work: its
    // destructor waits for the engines.
    Client* client = offloader_->client_.get();
    if (engine_ != nullptr) {
      // Placed: behind the fetches of it (fetch stream) and its store (waited
      // for), so no copy still uses the memory; released even if the copy
      // failed (the reservation exists).
      engine_->SubmitAsync(
          CopyStream::kFetch, [client, nbytes = nbytes_, state = state_, stored = stored_,
                               counters = offloader_->counters_]() {
            if (stored->Wait().ok()) {  // a failed copy was counted out by its drop work
              counters->live_tensors -= 1;
              counters->live_bytes -= nbytes;
            }
            return client->Release(*state->ticket);
          });
      return;
    }
    // Behind the store on the same stream: never blocks the freeing thread.
    offloader_->options_.copy_engine->SubmitAsync(
        CopyStream::kStore,
        [client, nbytes = nbytes_, state = state_,
         counters = offloader_->counters_]() -> absl::Status {
          if (!state->ticket.ok()) return absl::OkStatus();  // counted out when it failed
          counters->live_tensors -= 1;
          counters->live_bytes -= nbytes;
          return client->Release(*state->ticket);
        });
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    // Autograd checks versions only for tensors saved without hooks.
    version_ = tensor.unsafeGetTensorImpl()->version_counter();
    saved_version_ = version_.current_version();
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    Offloader::Counters& counters = *offloader_->counters_;
    if (!Eligible(tensor, nbytes)) {
      kept_ = tensor.detach();  // detached: no cycle through its grad_fn
      counters.tensors_kept += 1;
      counters.bytes_kept += nbytes;
      return;
    }
    sizes_ = tensor.sizes().vec();
    strides_ = tensor.strides().vec();
    options_ = tensor.options();
    dense_ = tensor.is_non_overlapping_and_dense();
    nbytes_ = nbytes;
    state_ = std::make_shared<State>();
    // Counted before the work that may count a failure out.
    counters.tensors_offloaded += 1;
    counters.bytes_offloaded += nbytes;
    counters.live_tensors += 1;
    const uint64_t live = (counters.live_bytes += nbytes);
    uint64_t peak = counters.peak_live_bytes.load();
    while (live > peak && !counters.peak_live_bytes.compare_exchange_weak(peak, live)) {
    }
    Client* client = offloader_->client_.get();
    std::shared_ptr<Offloader::Counters> shared_counters = offloader_->counters_;
    if (client->attached()) {
      StorePlaced(tensor);
      return;
    }
    state_->src = dense_ ? tensor.detach() : tensor.contiguous();
    stored_ = offloader_->options_.copy_engine->SubmitAsync(
        CopyStream::kStore, [client, nbytes, state = state_, shared_counters]() -> absl::Status {
          state->ticket = client->Store(state->src.data_ptr(), nbytes);
          if (!state->ticket.ok()) {
            shared_counters->store_failures += 1;
            shared_counters->live_tensors -= 1;
            shared_counters->live_bytes -= nbytes;
            return state->ticket.status();  // src stays: unpack returns it
          }
          state->src.reset();  // the daemon has the bytes
          return absl::OkStatus();
        });
  }

  at::Tensor call_unpack_hook() override {
    TORCH_CHECK(version_.current_version() == saved_version_,
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: saved at version ",
                saved_version_, ", is at version ", version_.current_version(),
                " (tensor saved with actstash hooks)");
    if (!stored_) return kept_;
    if (engine_ != nullptr) return FetchPlaced();
    stored_->Wait().IgnoreError();  // a failed store left the tensor in state_->src
    if (!state_->ticket.ok()) return Restride(state_->src);
    at::Tensor out =
        dense_ ? at::empty_strided(sizes_, strides_, options_) : at::empty(sizes_, options_);
    const absl::Status status =
        offloader_->client_->Fetch(*state_->ticket, out.data_ptr(), nbytes_);
    TORCH_CHECK(status.ok(), "actstash: fetching a saved tensor failed: ", status.ToString());
    offloader_->counters_->tensors_fetched += 1;
    offloader_->counters_->bytes_fetched += nbytes_;
    return Restride(out);
  }

 private:
  // Shared by these hooks and their copy work.
  struct State {
    at::Tensor src;  // until stored; kept when the store failed
    absl::StatusOr<Ticket> ticket = absl::UnavailableError("not stored yet");
  };

  // Reserves memory in the client's leases and has the engine of the
  // tensor's device copy (dense) or gather (a view with gaps) it there after
  // the current stream. The source is dropped once the copy is done; a
  // failure keeps it (unpack returns it) and is counted out.
  void StorePlaced(const at::Tensor& tensor) {
    engine_ = EngineFor(tensor.device());
    stream_ = StreamOf(tensor.device());
    Client* client = offloader_->client_.get();
    std::shared_ptr<Offloader::Counters> counters = offloader_->counters_;
    state_->src = tensor.detach();
    absl::StatusOr<Reservation> reserved = client->Reserve(nbytes_);
    absl::StatusOr<std::shared_ptr<CopyEvent>> event =
        reserved.ok() ? absl::UnknownError("not started") : reserved.status();
    if (reserved.ok()) {
      state_->ticket = reserved->ticket;
      if (!dense_ && tensor.is_cuda() && !reserved->pinned) {
        // A GPU kernel cannot gather into unpinned host memory: pack on the
        // device (a temporary, held until copied) and copy that.
        state_->src = tensor.contiguous();
        event = engine_->CopyAsync(CopyStream::kStore, reserved->data, state_->src.data_ptr(),
                                   nbytes_, stream_);
      } else if (dense_) {
        event = engine_->CopyAsync(CopyStream::kStore, reserved->data, tensor.data_ptr(), nbytes_,
                                   stream_);
      } else {
        const TensorLayout layout{sizes_, strides_, static_cast<int>(tensor.element_size())};
        event = engine_->GatherAsync(CopyStream::kStore, reserved->data, nbytes_, tensor.data_ptr(),
                                     layout, stream_);
      }
      if (!event.ok()) (void)client->Release(reserved->ticket);
    }
    if (!event.ok()) {  // nothing in flight: keep the tensor, as autograd would
      counters->store_failures += 1;
      counters->live_tensors -= 1;
      counters->live_bytes -= nbytes_;
      kept_ = tensor.detach();
      state_.reset();
      engine_ = nullptr;
      return;
    }
    stored_ = *std::move(event);
    // Drops the source once copied (host work after the store stream's
    // copies); a failed copy keeps it for unpack.
    engine_->SubmitAsync(
        CopyStream::kStore,
        [state = state_, stored = stored_, counters, nbytes = nbytes_]() -> absl::Status {
          if (stored->Wait().ok()) {
            state->src.reset();
          } else {
            counters->store_failures += 1;
            counters->live_tensors -= 1;
            counters->live_bytes -= nbytes;
          }
          return absl::OkStatus();
        });
  }

  at::Tensor FetchPlaced() {
    // The store is normally long done by backward; a failed one left the
    // tensor in state_->src (its drop work does not touch it then).
    if (!stored_->Wait().ok()) return Restride(state_->src);
    at::Tensor out =
        dense_ ? at::empty_strided(sizes_, strides_, options_) : at::empty(sizes_, options_);
    const StreamHandle stream = StreamOf(out.device());
    absl::StatusOr<StoredBytes> where = offloader_->client_->Locate(*state_->ticket);
    absl::StatusOr<std::shared_ptr<CopyEvent>> fetched =
        where.ok() ? absl::UnknownError("not started") : where.status();
    if (where.ok()) {
      fetched =
          engine_->CopyAsync(CopyStream::kFetch, out.data_ptr(), where->data, nbytes_, stream);
    }
    absl::Status status = fetched.status();
    if (status.ok()) status = engine_->OrderAfterAsync(stream, **fetched);
    TORCH_CHECK(status.ok(), "actstash: fetching a saved tensor failed: ", status.ToString());
    offloader_->counters_->tensors_fetched += 1;
    offloader_->counters_->bytes_fetched += nbytes_;
    return Restride(out);
  }

  CopyEngine* EngineFor(const c10::Device& device) const {
    return device.is_cuda() ? offloader_->options_.cuda_engine.get()
                            : offloader_->options_.copy_engine.get();
  }

  StreamHandle StreamOf(const c10::Device& device) const {
    if (!device.is_cuda() || !offloader_->options_.current_stream) return StreamHandle{0};
    return StreamHandle{offloader_->options_.current_stream(device.index())};
  }

  bool Eligible(const at::Tensor& t, uint64_t nbytes) const {
    if (nbytes == 0 || nbytes < offloader_->options_.min_bytes) return false;
    // A CUDA tensor only on the engine's own device: its streams and events
    // order copies against that device's streams, not another's.
    const OffloadOptions& options = offloader_->options_;
    const bool device_ok =
        t.device().is_cpu() ||
        (t.device().is_cuda() && options.cuda_engine != nullptr &&
         t.device().index() == options.cuda_engine->device() && offloader_->client_->attached());
    if (t.layout() != at::kStrided || !device_ok || t.is_quantized() || t.is_nested() ||
        t.is_conj() || t.is_neg() || !t.has_storage()) {
      return false;
    }
    if (t.is_leaf() && t.requires_grad()) return false;  // a parameter: kept anyway
    if (t.is_view()) {
      const at::TensorBase& base = t._base();  // e.g. weight.t(): aliases a parameter
      if (base.is_leaf() && base.requires_grad()) return false;
    }
    return NonOverlapping(t);
  }

  // Gives a contiguous copy of a view with gaps that view's strides back, so
  // backward's kernels see the layout they would have seen.
  at::Tensor Restride(const at::Tensor& t) const {
    if (dense_ || t.strides() == at::IntArrayRef(strides_)) return t;
    at::Tensor out = at::empty_strided(sizes_, strides_, options_);
    out.copy_(t);
    return out;
  }

  std::shared_ptr<Offloader> offloader_;
  c10::VariableVersion version_;  // the saved tensor's counter
  uint32_t saved_version_ = 0;
  at::Tensor kept_;  // not offloaded
  // Offloaded:
  std::shared_ptr<State> state_;
  std::shared_ptr<CopyEvent> stored_;
  // Placed stores only: the engine that copied it (the Offloader's).
  CopyEngine* engine_ = nullptr;
  StreamHandle stream_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  at::TensorOptions options_;
  bool dense_ = true;
  uint64_t nbytes_ = 0;
};

}  // namespace internal

namespace {

std::unique_ptr<SavedVariableHooks> MakeHooks() {
  if (tls_scopes.empty() || tls_scopes.back() == nullptr) return nullptr;
  if (!at::SavedTensorDefaultHooks::is_enabled()) return nullptr;  // a torch feature opted out
  return std::make_unique<internal::OffloadHooks>(tls_scopes.back());
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
  return std::shared_ptr<Offloader>(new Offloader(std::move(client), std::move(options)));
}

Offloader::Offloader(std::shared_ptr<Client> client, OffloadOptions options)
    : client_(std::move(client)),
      options_(std::move(options)),
      counters_(std::make_shared<Counters>()) {}

Offloader::~Offloader() { Synchronize(); }  // queued work uses client_

void Offloader::Synchronize() {
  options_.copy_engine->Synchronize();
  if (options_.cuda_engine != nullptr) options_.cuda_engine->Synchronize();
}

OffloadStats Offloader::stats() const {
  const Counters& c = *counters_;
  OffloadStats s;
  s.tensors_offloaded = c.tensors_offloaded;
  s.bytes_offloaded = c.bytes_offloaded;
  s.tensors_kept = c.tensors_kept;
  s.bytes_kept = c.bytes_kept;
  s.tensors_fetched = c.tensors_fetched;
  s.bytes_fetched = c.bytes_fetched;
  s.store_failures = c.store_failures;
  s.live_tensors = c.live_tensors;
  s.live_bytes = c.live_bytes;
  s.peak_live_bytes = c.peak_live_bytes;
  return s;
}

OffloadScope::OffloadScope(std::shared_ptr<Offloader> offloader)
    : depth_(tls_scopes.size()), active_(HookEngineIsDefault()) {
  tls_scopes.push_back(std::move(offloader));
}

OffloadScope::~OffloadScope() {
  if (tls_scopes.size() != depth_ + 1) {
    std::fprintf(stderr, "actstash: OffloadScopes destroyed out of order or on another thread\n");
    std::abort();
  }
  tls_scopes.pop_back();
}

std::shared_ptr<Offloader> CurrentOffloader() {
  return tls_scopes.empty() ? nullptr : tls_scopes.back();
}

}  // namespace actstash::torch
