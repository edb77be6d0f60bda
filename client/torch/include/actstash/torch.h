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
#include "actstash/saved_tensors.h"

namespace torch::autograd {
struct SavedVariableHooks;
}  // namespace torch::autograd

namespace actstash::torch {

// Makes this library's autograd engine the process's default engine (once;
// later calls return the first result). Offloader::Create calls it.
// FAILED_PRECONDITION when another engine subclass (Python's) is installed.
absl::Status InstallSavedVariableHooks();

// The engine's settings among these default to EngineOptions' (one place).
struct OffloadOptions {
  // Saved tensors smaller than this stay in the trainer's memory.
  size_t min_bytes = kDefaultMinBytes;
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
  // CPU stores up to this size are copied on the packing thread (no thread
  // hand-off); larger ones on the copy engine's store stream. 0: all on the
  // engine (tests that inject copy delays).
  uint64_t inline_store_bytes = EngineOptions{}.inline_store_bytes;
  // Backward reads offloaded CPU tensors in place in leased memory (no copy);
  // false: copied into fresh tensors, prefetched.
  bool cpu_views = EngineOptions{}.cpu_views;
  // Fetches started ahead, in reverse save order (copies into fresh tensors).
  int prefetch = EngineOptions{}.prefetch;
  // Dense fp32 tensors stored as bf16 (lossy: half the bytes).
  bool downcast_bf16 = EngineOptions{}.downcast_bf16;
  // A GPU ordinal of the daemon's device pool (actstashd --device-pool):
  // CUDA tensors of the cuda_engine's device go there instead of pinned host
  // memory. -1: none. The client must have been connected with
  // ClientOptions::cuda_device set to that engine's device.
  int device_pool = EngineOptions{}.device_pool;
};

// The engine's counters (SavedTensorEngine), for this offloader: the one
// schema of actstash/saved_tensors.h (store_failures: stores that failed
// after they started; a tensor kept because offload is off after a failure
// counts in kept_by_reason[KeepReason::kFailed]).
using OffloadStats = EngineStats;

namespace internal {
class OffloadHooks;
// What an OffloadScope or a Checkpoint frame pushes on the calling thread:
// the source of the hooks autograd attaches to each saved variable.
class HookSource {
 public:
  virtual ~HookSource() = default;
  virtual std::unique_ptr<::torch::autograd::SavedVariableHooks> MakeHooks() = 0;
};
// Pushes `source` on this thread's stack for its lifetime (LIFO).
class ScopedHookSource {
 public:
  explicit ScopedHookSource(std::shared_ptr<HookSource> source);
  ~ScopedHookSource();
  ScopedHookSource(const ScopedHookSource&) = delete;
  ScopedHookSource& operator=(const ScopedHookSource&) = delete;

 private:
  size_t depth_;
};
}  // namespace internal

// Stores saved tensors through one Client, on a SavedTensorEngine (the same
// engine the Python package uses). A saved tensor is offloaded when it is on
// the CPU (or on the cuda_engine's GPU), strided, at least min_bytes, not a
// leaf that requires grad (a parameter) nor a view of one, not
// quantized/conjugated/nested, and its elements do not overlap (dense, or a
// view with gaps: gathered, and given its strides back when fetched). Others
// are kept as autograd keeps them. The engine stores small CPU tensors on the
// packing thread and others on the copy engine after the producer's stream,
// holding the source until stored; backward reads CPU tensors in place
// (cpu_views) or fetches them, prefetching in reverse save order; each
// stored buffer is released when autograd drops the saved variable and no
// view reads it. A failed store keeps the tensor in memory (store_failures).
class Offloader : public internal::HookSource, public std::enable_shared_from_this<Offloader> {
 public:
  // `client` must be non-null; it is shared with the caller.
  static absl::StatusOr<std::shared_ptr<Offloader>> Create(std::shared_ptr<Client> client,
                                                           OffloadOptions options = {});
  // Waits for the copy work submitted so far (stores and releases).
  ~Offloader() override;
  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;

  OffloadStats stats() const;
  // Blocks until every store and release submitted so far has finished.
  void Synchronize();
  Client& client() const { return *client_; }
  const OffloadOptions& options() const { return options_; }
  std::unique_ptr<::torch::autograd::SavedVariableHooks> MakeHooks() override;
  // Hooks that skip the version check at unpack, for Checkpoint's inputs (fn
  // may change them in place after they were stored; the stored bytes are
  // what the recomputation needs).
  std::unique_ptr<::torch::autograd::SavedVariableHooks> MakeBoundaryHooks();

 private:
  friend class internal::OffloadHooks;
  Offloader(std::shared_ptr<Client> client, OffloadOptions options,
            std::unique_ptr<SavedTensorEngine> engine);
  std::shared_ptr<Client> client_;
  OffloadOptions options_;  // copy_engine always set
  std::unique_ptr<SavedTensorEngine> engine_;
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
  internal::ScopedHookSource scope_;
  bool active_;
};

// The offloader of the innermost scope on this thread, or null.
std::shared_ptr<Offloader> CurrentOffloader();

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) without keeping its interior for backward, and recomputes
// it when backward first needs one of the tensors it saved: the semantics of
// torch.utils.checkpoint(use_reentrant=False). fn runs with grad mode on, so
// the graph runs through it to the inputs and to whatever fn uses that
// requires grad (its parameters); the tensors fn saves are dropped at once
// and refilled by the recomputation, which replays the CPU RNG state of the
// forward (dropout masks match) and restores the state after. The
// recomputation must save tensors of the same shapes and dtypes in the same
// order, else backward fails (c10::Error). With an offloader (or, without
// one, the offloader of the calling thread's current scope), the inputs are
// stored through it until the recomputation (the boundary); else they are
// held in memory. Installs this library's engine (InstallSavedVariableHooks;
// c10::Error where it cannot). The recomputation's own saved tensors stay in
// memory. Autocast and non-CPU RNG state are not captured. Thread-safety: as
// fn; the recomputation runs on the thread that runs backward.
std::vector<at::Tensor> Checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                   std::shared_ptr<Offloader> offloader = nullptr);
// One input, one output.
at::Tensor Checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& input,
                      std::shared_ptr<Offloader> offloader = nullptr);

}  // namespace actstash::torch

#endif  // ACTSTASH_TORCH_H_
