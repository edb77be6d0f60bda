// CudaCopyEngine over a GpuRuntime. See gpu_copy_engine.h for the design.
//
// Locks: each Lane has `mu_` (serializes enqueues on its stream: the after-
// event record and wait, the dep waits, the copy and its completion record
// are contiguous; guards the in-flight queue) and `done_mu_` (the completion
// thread's queue). Order: mu_ before done_mu_. GpuCopyEvent has its own leaf
// lock. The submitting thread may block on the GPU while holding mu_ (the
// in-flight bound): that is the backpressure.
#include "client/copy/gpu_copy_engine.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/copy/host_event.h"
#include "client/copy/tensor_layout.h"
#include "common/status_macros.h"

namespace actstash::client_internal {
namespace {

// A copy's completion: a GPU event recorded after the copy (or a status known
// at submission, with no event). Owns the event: destroyed exactly once, by
// the last owner, which may outlive the engine (the runtime is kept alive).
class GpuCopyEvent final : public CopyEvent {
 public:
  // Takes `event` (created, maybe not yet recorded: then it reads as done).
  GpuCopyEvent(std::shared_ptr<GpuRuntime> runtime, GpuEvent event)
      : runtime_(std::move(runtime)), event_(event) {}
  // Complete with `status`; nothing was enqueued.
  GpuCopyEvent(std::shared_ptr<GpuRuntime> runtime, absl::Status status)
      : runtime_(std::move(runtime)), event_(0), done_(true), status_(std::move(status)) {}
  ~GpuCopyEvent() override {
    if (event_ != 0) runtime_->DestroyEvent(event_).IgnoreError();
  }
  GpuCopyEvent(const GpuCopyEvent&) = delete;
  GpuCopyEvent& operator=(const GpuCopyEvent&) = delete;

  // The status once done; nullopt while pending. Never blocks.
  std::optional<absl::Status> Poll() const {
    absl::MutexLock lock(&mu_);
    if (done_) return status_;
    absl::StatusOr<bool> done = runtime_->QueryEvent(event_);
    if (done.ok() && !*done) return std::nullopt;
    done_ = true;
    status_ = done.status();
    return status_;
  }
  bool Done() const override { return Poll().has_value(); }
  absl::Status Wait() const override {
    {
      absl::MutexLock lock(&mu_);
      if (done_) return status_;
    }
    absl::Status status = runtime_->SynchronizeEvent(event_);  // unlocked: Done() stays cheap
    absl::MutexLock lock(&mu_);
    if (!done_) {
      done_ = true;
      status_ = std::move(status);
    }
    return status_;
  }

  const GpuRuntime* runtime() const { return runtime_.get(); }
  GpuEvent event() const { return event_; }

 private:
  const std::shared_ptr<GpuRuntime> runtime_;
  const GpuEvent event_;
  mutable absl::Mutex mu_;
  mutable bool done_ ABSL_GUARDED_BY(mu_) = false;
  mutable absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Enqueues the copy itself on the given stream.
using EnqueueFn = std::function<absl::Status(GpuStream)>;

// One copy stream: its GPU stream, the event that orders it after callers'
// streams, the copies in flight and the completion thread.
class Lane {
 public:
  static absl::StatusOr<std::unique_ptr<Lane>> Create(std::shared_ptr<GpuRuntime> runtime,
                                                      uint32_t max_in_flight) {
    ACTSTASH_ASSIGN_OR_RETURN(const GpuStream stream, runtime->CreateStream());
    absl::StatusOr<GpuEvent> after = runtime->CreateEvent();
    if (!after.ok()) {
      runtime->DestroyStream(stream).IgnoreError();
      return after.status();
    }
    return std::unique_ptr<Lane>(new Lane(std::move(runtime), stream, *after, max_in_flight));
  }

  // Drains (Synchronize), stops the completion thread, destroys the handles.
  ~Lane() {
    Synchronize();
    {
      absl::MutexLock lock(&done_mu_);
      stopping_ = true;
    }
    thread_.join();
    runtime_->DestroyEvent(after_event_).IgnoreError();
    runtime_->DestroyStream(stream_).IgnoreError();
  }

  // The copy protocol (gpu_copy_engine.h). `gpu_deps`: this engine's pending
  // events; other deps were waited for by the caller.
  absl::StatusOr<std::shared_ptr<CopyEvent>> Enqueue(StreamHandle after,
                                                     const std::vector<GpuEvent>& gpu_deps,
                                                     const EnqueueFn& copy) {
    ACTSTASH_ASSIGN_OR_RETURN(const GpuEvent done, runtime_->CreateEvent());
    auto event = std::make_shared<GpuCopyEvent>(runtime_, done);  // destroys `done` on errors
    absl::MutexLock lock(&mu_);
    BoundInFlightLocked();
    ACTSTASH_RETURN_IF_ERROR(runtime_->RecordEvent(after_event_, after.value));
    ACTSTASH_RETURN_IF_ERROR(runtime_->StreamWaitEvent(stream_, after_event_));
    for (GpuEvent dep : gpu_deps) {
      ACTSTASH_RETURN_IF_ERROR(runtime_->StreamWaitEvent(stream_, dep));
    }
    ACTSTASH_RETURN_IF_ERROR(copy(stream_));
    ACTSTASH_RETURN_IF_ERROR(runtime_->RecordEvent(done, stream_));
    in_flight_.push_back(event);
    return event;
  }

  std::shared_ptr<CopyEvent> Submit(std::function<absl::Status()> work) {
    auto result = std::make_shared<HostEvent>();
    absl::StatusOr<GpuEvent> created = runtime_->CreateEvent();
    if (!created.ok()) {
      result->Complete(created.status());
      return result;
    }
    auto marker = std::make_shared<GpuCopyEvent>(runtime_, *created);
    absl::MutexLock lock(&mu_);
    absl::Status recorded = runtime_->RecordEvent(*created, stream_);
    if (!recorded.ok()) {
      result->Complete(std::move(recorded));
      return result;
    }
    absl::MutexLock done_lock(&done_mu_);
    ++submitted_;
    done_queue_.push_back(HostWork{std::move(marker), std::move(work), result});
    return result;
  }

  // Returns when every copy enqueued and all host work submitted before the
  // call have completed.
  void Synchronize() {
    std::vector<std::shared_ptr<GpuCopyEvent>> pending;
    uint64_t ticket = 0;
    {
      absl::MutexLock lock(&mu_);
      pending.assign(in_flight_.begin(), in_flight_.end());
      absl::MutexLock done_lock(&done_mu_);
      ticket = submitted_;
    }
    for (const auto& event : pending) event->Wait().IgnoreError();
    {
      absl::MutexLock done_lock(&done_mu_);
      auto reached = [this, ticket]()
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(done_mu_) { return finished_ >= ticket; };
      done_mu_.Await(absl::Condition(&reached));
    }
    absl::MutexLock lock(&mu_);
    ReapLocked();
  }

 private:
  struct HostWork {
    std::shared_ptr<GpuCopyEvent> marker;  // recorded on the stream at submission
    std::function<absl::Status()> work;
    std::shared_ptr<HostEvent> result;
  };

  Lane(std::shared_ptr<GpuRuntime> runtime, GpuStream stream, GpuEvent after_event,
       uint32_t max_in_flight)
      : runtime_(std::move(runtime)),
        stream_(stream),
        after_event_(after_event),
        max_in_flight_(max_in_flight),
        thread_([this] { RunCompletions(); }) {}

  // Drops completed copies from the front of the queue.
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!in_flight_.empty() && in_flight_.front()->Poll().has_value()) in_flight_.pop_front();
  }

  // Makes room for one more copy: waits (on the host) for the oldest ones.
  void BoundInFlightLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ReapLocked();
    while (in_flight_.size() >= max_in_flight_) {
      in_flight_.front()->Wait().IgnoreError();  // its error is its event's business
      in_flight_.pop_front();
    }
  }

  void RunCompletions() {
    while (true) {
      HostWork item;
      {
        absl::MutexLock lock(&done_mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(done_mu_) {
          return stopping_ || !done_queue_.empty();
        };
        done_mu_.Await(absl::Condition(&ready));
        if (done_queue_.empty()) return;
        item = std::move(done_queue_.front());
        done_queue_.pop_front();
      }
      absl::Status status = item.marker->Wait();
      if (status.ok()) status = item.work();
      item.marker.reset();  // destroy the GPU event before reporting
      item.work = nullptr;
      item.result->Complete(std::move(status));
      absl::MutexLock lock(&done_mu_);
      ++finished_;
    }
  }

  const std::shared_ptr<GpuRuntime> runtime_;
  const GpuStream stream_;
  const GpuEvent after_event_;
  const uint32_t max_in_flight_;

  absl::Mutex mu_;
  std::deque<std::shared_ptr<GpuCopyEvent>> in_flight_ ABSL_GUARDED_BY(mu_);

  absl::Mutex done_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::deque<HostWork> done_queue_ ABSL_GUARDED_BY(done_mu_);
  uint64_t submitted_ ABSL_GUARDED_BY(done_mu_) = 0;
  uint64_t finished_ ABSL_GUARDED_BY(done_mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(done_mu_) = false;

  std::thread thread_;  // last: starts after the members it uses
};

class GpuCopyEngine final : public CopyEngine {
 public:
  GpuCopyEngine(std::shared_ptr<GpuRuntime> runtime, int device, std::unique_ptr<Lane> store,
                std::unique_ptr<Lane> fetch)
      : runtime_(std::move(runtime)), device_(device) {
    lanes_[0] = std::move(store);
    lanes_[1] = std::move(fetch);
  }
  ~GpuCopyEngine() override = default;  // each Lane drains

  int device() const override { return device_; }

  std::shared_ptr<CopyEvent> SubmitAsync(CopyStream stream,
                                         std::function<absl::Status()> work) override {
    return lane(stream).Submit(std::move(work));
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> CopyAsync(CopyStream stream, void* dst,
                                                       const void* src, size_t nbytes,
                                                       StreamHandle after, CopyDeps deps) override {
    if (nbytes > 0 && (dst == nullptr || src == nullptr)) {
      return absl::InvalidArgumentError("CopyAsync: null pointer with a non-empty copy");
    }
    return Submit(stream, after, deps, [this, dst, src, nbytes](GpuStream s) {
      return nbytes == 0 ? absl::OkStatus() : runtime_->MemcpyAsync(dst, src, nbytes, s);
    });
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> GatherAsync(CopyStream stream, void* dst,
                                                         size_t dst_bytes, const void* src,
                                                         const TensorLayout& layout,
                                                         StreamHandle after,
                                                         CopyDeps deps) override {
    ACTSTASH_ASSIGN_OR_RETURN(const kernels::StridedLayout strided,
                              CheckGather(src, layout, dst, dst_bytes));
    return Submit(stream, after, deps, [this, dst, dst_bytes, src, strided](GpuStream s) {
      return runtime_->GatherAsync(src, strided, dst, dst_bytes, s);
    });
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> ScatterAsync(CopyStream stream, void* dst,
                                                          const TensorLayout& layout,
                                                          const void* src, size_t src_bytes,
                                                          StreamHandle after,
                                                          CopyDeps deps) override {
    ACTSTASH_ASSIGN_OR_RETURN(const kernels::StridedLayout strided,
                              CheckScatter(src, src_bytes, dst, layout));
    return Submit(stream, after, deps, [this, dst, src, src_bytes, strided](GpuStream s) {
      return runtime_->ScatterAsync(src, src_bytes, dst, strided, s);
    });
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> ConvertAsync(CopyStream stream, void* dst,
                                                          const void* src, size_t elements,
                                                          Conversion conversion, StreamHandle after,
                                                          CopyDeps deps) override {
    ACTSTASH_RETURN_IF_ERROR(CheckConversion(dst, src, elements, conversion));
    return Submit(stream, after, deps, [this, dst, src, elements, conversion](GpuStream s) {
      return elements == 0 ? absl::OkStatus()
                           : runtime_->ConvertAsync(dst, src, elements, conversion, s);
    });
  }

  absl::Status OrderAfterAsync(StreamHandle stream, const CopyEvent& event) override {
    const GpuCopyEvent* own = Own(&event);
    if (own == nullptr) return event.Wait();
    if (std::optional<absl::Status> done = own->Poll()) return *done;
    return runtime_->StreamWaitEvent(stream.value, own->event());
  }

  void Synchronize() override {
    for (auto& lane : lanes_) lane->Synchronize();
  }

 private:
  Lane& lane(CopyStream stream) { return *lanes_[stream == CopyStream::kStore ? 0 : 1]; }

  // `event` when it is one of this engine's copy events (same runtime).
  const GpuCopyEvent* Own(const CopyEvent* event) const {
    const auto* own = dynamic_cast<const GpuCopyEvent*>(event);
    return own != nullptr && own->runtime() == runtime_.get() ? own : nullptr;
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> Submit(CopyStream stream, StreamHandle after,
                                                    CopyDeps deps, const EnqueueFn& copy) {
    std::vector<GpuEvent> gpu_deps;
    for (const std::shared_ptr<CopyEvent>& dep : deps) {
      if (dep == nullptr) continue;
      const GpuCopyEvent* own = Own(dep.get());
      std::optional<absl::Status> done = own != nullptr ? own->Poll() : dep->Wait();
      if (!done.has_value()) {
        gpu_deps.push_back(own->event());  // `deps` keeps it alive through the call
      } else if (!done->ok()) {
        return std::shared_ptr<CopyEvent>(std::make_shared<GpuCopyEvent>(runtime_, *done));
      }
    }
    return lane(stream).Enqueue(after, gpu_deps, copy);
  }

  const std::shared_ptr<GpuRuntime> runtime_;
  const int device_;
  std::unique_ptr<Lane> lanes_[2];
};

}  // namespace

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateGpuCopyEngine(
    std::unique_ptr<GpuRuntime> runtime, const CudaCopyEngineOptions& options) {
  if (options.max_in_flight == 0) {
    return absl::InvalidArgumentError("CudaCopyEngineOptions.max_in_flight must be at least 1");
  }
  std::shared_ptr<GpuRuntime> shared = std::move(runtime);
  ACTSTASH_ASSIGN_OR_RETURN(std::unique_ptr<Lane> store,
                            Lane::Create(shared, options.max_in_flight));
  ACTSTASH_ASSIGN_OR_RETURN(std::unique_ptr<Lane> fetch,
                            Lane::Create(shared, options.max_in_flight));
  return std::unique_ptr<CopyEngine>(
      new GpuCopyEngine(std::move(shared), options.device, std::move(store), std::move(fetch)));
}

}  // namespace actstash::client_internal
