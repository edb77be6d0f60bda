// actstash for libtorch (C++) trainers: saved-tensor offload and checkpoint.
//
//   std::shared_ptr<actstash::Client> client = std::move(*actstash::Client::Connect({}));
//   auto offloader = *actstash::torch::Offloader::Create(client);
//   at::Tensor loss;
//   {
//     actstash::torch::OffloadScope scope(offloader);  // this thread only
//     loss = model->forward(batch);     // saved activations go to actstashd
//   }
//   loss.backward();                    // fetched back as backward needs them
//
//   // Recompute `block` in backward; its input waits in actstashd meanwhile.
//   at::Tensor y = actstash::torch::Checkpoint(block, x, offloader);
//
// How the hooks get in (libtorch 1.13). Autograd asks
// Engine::get_default_engine().get_default_saved_variable_hooks() for every
// tensor it saves (SavedVariable's constructor); the base engine answers
// nullptr. C++ has no registration API for default hooks (the
// at::SavedTensorDefaultHooks stack holds Python callables, used by the Python
// engine only), so, as torch's own PythonEngine does, this library subclasses
// torch::autograd::Engine, overrides that method (it consults the scopes of
// the calling thread) and makes the subclass the default engine with
// torch::autograd::set_default_engine_stub(). Consequences:
//   - The engine is replaced process-wide on the first Offloader::Create (or
//     InstallSavedVariableHooks); without a scope it behaves as the base one.
//     Install it before the first backward if you can.
//   - It cannot coexist with torch's Python engine (a process that imported
//     torch in Python): InstallSavedVariableHooks then fails with
//     FAILED_PRECONDITION rather than replace it; use the Python package there.
//     (Importing torch's Python module later replaces this engine: scopes then
//     do nothing, which OffloadScope::active() reports.)
//   - Autograd skips its version-counter check for tensors saved with hooks;
//     the hooks here do that check themselves, so modifying a saved tensor in
//     place still fails in backward as it does without offload.
//
// Thread-safety: Offloader is thread-safe and shared (std::shared_ptr) by its
// scopes and by every saved tensor it holds, so it lives until the last of
// them is gone. OffloadScope affects only the thread that made it and must be
// destroyed on that thread, scopes nested LIFO. Setup errors are absl::Status;
// errors inside autograd (a failed fetch in backward, a saved tensor modified
// in place, a misused Checkpoint) throw c10::Error, as torch's own do.
#ifndef ACTSTASH_TORCH_H_
#define ACTSTASH_TORCH_H_

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"

namespace actstash::torch {

// Makes this library's autograd engine the process's default engine (once;
// later calls return the first result). Offloader::Create calls it.
// FAILED_PRECONDITION when another engine subclass (Python's) is installed.
absl::Status InstallSavedVariableHooks();

struct OffloadOptions {
  // Saved tensors smaller than this stay in the trainer's memory.
  size_t min_bytes = 64 << 10;
  // Copies CPU tensors: stores, fetches and the releases queued behind them.
  // Null: a HostCopyEngine owned by the Offloader.
  std::shared_ptr<CopyEngine> copy_engine;
  // Copies the CUDA tensors of its device (CreateCudaCopyEngine): straight
  // into the client's leased, pinned memory, ordered after the current
  // stream; fetched back with the current stream waiting for the copy.
  // Tensors on other devices, and all CUDA tensors when null, stay on the GPU
  // (counted as kept). Needs an attached client.
  std::shared_ptr<CopyEngine> cuda_engine;
  // The current CUDA stream of a device, as an integer cudaStream_t (libtorch
  // with CUDA: c10::cuda::getCurrentCUDAStream(device).stream()). Required
  // with a cuda_engine (INVALID_ARGUMENT otherwise).
  std::function<uintptr_t(int device)> current_stream;
};

struct OffloadStats {
  uint64_t tensors_offloaded = 0;  // stores started
  uint64_t bytes_offloaded = 0;
  uint64_t tensors_kept = 0;  // saved tensors left in memory (not eligible)
  uint64_t bytes_kept = 0;
  uint64_t tensors_fetched = 0;  // unpacks served from the daemon
  uint64_t bytes_fetched = 0;
  uint64_t store_failures = 0;  // stores that failed: the tensor stayed in memory
  // Offloaded (store queued or done, not failed) and not yet released.
  uint64_t live_tensors = 0;
  uint64_t live_bytes = 0;
  uint64_t peak_live_bytes = 0;
};

namespace internal {
class OffloadHooks;
}  // namespace internal

// Stores saved tensors through one Client. A saved tensor is offloaded when
// it is on the CPU (or on a GPU, with a cuda_engine), strided, at least min_bytes, not a leaf that
// requires grad (a parameter) nor a view of one, not quantized/conjugated/nested, and its elements
// do not overlap (dense, or a view with gaps: gathered, and given its strides back when fetched).
// Others are kept as autograd keeps them. With an attached client, memory is reserved in the
// client's leases on the packing thread and the engine copies (or gathers) the tensor into it on
// its store stream; otherwise Client::Store runs on the store stream. The source tensor is held
// until its store is done and then dropped. A failed store (quota, daemon gone) keeps the tensor in
// memory instead (store_failures). Fetches are issued by the thread that unpacks (backward's) after
// its store is done (a host wait), on the engine's fetch stream; CPU: the unpack waits for the
// copy, CUDA: the current stream does. There is no prefetch. Each stored buffer is released (queued
// behind its store) when autograd drops the saved variable: after backward, or with the graph.
class Offloader {
 public:
  // `client` must be non-null; it is shared with the caller.
  static absl::StatusOr<std::shared_ptr<Offloader>> Create(std::shared_ptr<Client> client,
                                                           OffloadOptions options = {});
  // Waits for the copy work submitted so far (stores and releases).
  ~Offloader();
  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;

  OffloadStats stats() const;
  // Blocks until every store and release submitted so far has finished.
  void Synchronize();
  Client& client() const { return *client_; }
  const OffloadOptions& options() const { return options_; }

 private:
  friend class internal::OffloadHooks;
  struct Counters {
    std::atomic<uint64_t> tensors_offloaded{0}, bytes_offloaded{0}, tensors_kept{0}, bytes_kept{0},
        tensors_fetched{0}, bytes_fetched{0}, store_failures{0}, live_tensors{0}, live_bytes{0},
        peak_live_bytes{0};
  };
  Offloader(std::shared_ptr<Client> client, OffloadOptions options);

  std::shared_ptr<Client> client_;
  OffloadOptions options_;  // copy_engine always set
  // Shared with queued copy work, which never holds the Offloader itself (its
  // last reference must not drop on a copy thread).
  std::shared_ptr<Counters> counters_;
};

// While alive, tensors that autograd saves on this thread go through
// `offloader`; a null offloader turns offload off inside the scope (an inner
// OffloadScope(nullptr) in an outer one). Saved tensors stay with their
// offloader after the scope ends: backward usually runs outside the scope.
// Not copyable or movable; destroy on the creating thread, in LIFO order.
class OffloadScope {
 public:
  explicit OffloadScope(std::shared_ptr<Offloader> offloader);
  ~OffloadScope();
  OffloadScope(const OffloadScope&) = delete;
  OffloadScope& operator=(const OffloadScope&) = delete;

  // False when this library's engine is not (or no longer) torch's default
  // engine, so that hooks cannot run: see InstallSavedVariableHooks.
  bool active() const { return active_; }

 private:
  size_t depth_;
  bool active_;
};

// The offloader of the innermost scope on this thread, or null.
std::shared_ptr<Offloader> CurrentOffloader();

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) without keeping its interior for backward (fn runs with
// grad mode off), and recomputes it with grad on, from detached copies of the
// saved inputs, when backward reaches it; gradients flow to the inputs and to
// whatever fn uses that requires grad (its parameters). The CPU RNG state of
// the forward is replayed, so dropout masks match, and restored afterwards.
// With an offloader, the inputs are saved through it (as in an OffloadScope);
// without one, through the calling thread's current scope, if any. The
// recomputation's own saved tensors stay in memory (it runs with offload off).
// Semantics of torch.utils.checkpoint(use_reentrant=True), except that the
// graph is recorded even when no input requires grad (so fn's parameters get
// gradients). fn must be deterministic given the RNG state; autocast and
// non-CPU RNG state are not captured. fn may be called twice; it must not
// keep references across calls. Thread-safety: as fn.
std::vector<at::Tensor> Checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                   std::shared_ptr<Offloader> offloader = nullptr);
// One input, one output.
at::Tensor Checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& input,
                      std::shared_ptr<Offloader> offloader = nullptr);

}  // namespace actstash::torch

#endif  // ACTSTASH_TORCH_H_
