// SimGpuRuntime: a simulated device implementing GpuRuntime for CPU tests of
// the CUDA engine's logic. Each stream is a worker thread running a FIFO of
// ops; "device memory" is host memory. Semantics follow CUDA:
//  - RecordEvent makes a new record (the event's latest) and enqueues an op
//    that completes it; StreamWaitEvent enqueues an op that blocks the stream
//    until the record that was the latest AT THE TIME OF THE CALL completes;
//    QueryEvent/SynchronizeEvent look at the latest record at their call; an
//    event never recorded is done.
//  - MemcpyAsync is a memcpy; GatherAsync/ScatterAsync run the kernels' CPU
//    implementations (their checks run at the call, as the CUDA ones do).
//  - Errors are sticky per stream: an op that fails (only LaunchHostAsync's
//    work can) puts its stream in error; later work on it is skipped, its
//    records carry the error, and a stream that waits for such an event
//    takes the error too (as a faulted CUDA context spreads it).
// Optional delays: each op sleeps a random time in [0, max_op_delay] plus
// its stream's extra delay (SetStreamDelay: a deliberately slow "compute
// stream"). Stream 0 (the legacy default stream) always exists.
//
// Counters let tests check leaks (events and streams created/destroyed,
// handles used after destruction) and the in-flight bound (the most copies
// ever enqueued but not yet finished on one stream).
//
// Thread-safety: every method is thread-safe. Destruction stops and joins
// the stream threads; work still queued runs first.
#ifndef ACTSTASH_TESTS_CLIENT_SIM_GPU_RUNTIME_H_
#define ACTSTASH_TESTS_CLIENT_SIM_GPU_RUNTIME_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "client/copy/gpu_runtime.h"

namespace actstash::client_internal::testing {

struct SimOptions {
  std::chrono::microseconds max_op_delay{0};
  uint64_t seed = 1;
};

class SimGpuRuntime final : public GpuRuntime {
 public:
  explicit SimGpuRuntime(const SimOptions& options = {});
  ~SimGpuRuntime() override;
  SimGpuRuntime(const SimGpuRuntime&) = delete;
  SimGpuRuntime& operator=(const SimGpuRuntime&) = delete;

  // GpuRuntime. Unknown (or destroyed) handles are INVALID_ARGUMENT and
  // counted in bad_handle_uses().
  absl::StatusOr<GpuStream> CreateStream() override;
  absl::Status DestroyStream(GpuStream stream) override;  // waits for its work
  absl::StatusOr<GpuEvent> CreateEvent() override;
  absl::Status DestroyEvent(GpuEvent event) override;
  absl::Status RecordEvent(GpuEvent event, GpuStream stream) override;
  absl::Status StreamWaitEvent(GpuStream stream, GpuEvent event) override;
  absl::Status MemcpyAsync(void* dst, const void* src, size_t nbytes, GpuStream stream) override;
  absl::Status GatherAsync(const void* src, const kernels::StridedLayout& src_layout, void* dst,
                           size_t dst_bytes, GpuStream stream) override;
  absl::Status ConvertAsync(void* dst, const void* src, size_t elements, Conversion conversion,
                            GpuStream stream) override;
  absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                            const kernels::StridedLayout& dst_layout, GpuStream stream) override;
  absl::StatusOr<bool> QueryEvent(GpuEvent event) override;
  absl::Status SynchronizeEvent(GpuEvent event) override;

  // Test-only: runs `work` on `stream` in order, like a compute kernel; a
  // failed status puts the stream in error.
  absl::Status LaunchHostAsync(GpuStream stream, std::function<absl::Status()> work);
  // Every op on `stream` sleeps `delay` more.
  void SetStreamDelay(GpuStream stream, std::chrono::microseconds delay);
  // Blocks until `stream` has run everything enqueued so far.
  void SynchronizeStream(GpuStream stream);

  int64_t events_created() const;
  int64_t events_destroyed() const;
  int64_t live_events() const;
  int64_t streams_created() const;    // not counting stream 0
  int64_t streams_destroyed() const;  // not counting stream 0
  int64_t bad_handle_uses() const;
  int64_t ops_enqueued() const;
  // The most copies (memcpy, gather, scatter) ever pending at once on `stream`.
  int64_t max_copies_in_flight(GpuStream stream) const;

 private:
  struct Mark;
  struct EventState;
  struct Op;
  struct Stream;

  Stream* FindStreamLocked(GpuStream stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<EventState> FindEventLocked(GpuEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Enqueue(GpuStream stream, Op op);
  void Run(Stream* stream);
  void StopAndJoin(std::unique_ptr<Stream> stream);

  const SimOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<GpuStream, std::unique_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<GpuEvent, std::shared_ptr<EventState>> events_ ABSL_GUARDED_BY(mu_);
  GpuStream next_stream_ ABSL_GUARDED_BY(mu_) = 1;
  GpuEvent next_event_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t events_created_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t events_destroyed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t streams_created_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t streams_destroyed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bad_handle_uses_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ops_enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  // Kept after a stream is destroyed.
  absl::flat_hash_map<GpuStream, int64_t> max_copies_ ABSL_GUARDED_BY(mu_);
};

// A GpuRuntime that forwards to `runtime`: hands an engine a runtime the test
// keeps (and inspects) after the engine and its events are gone.
std::unique_ptr<GpuRuntime> ShareRuntime(std::shared_ptr<GpuRuntime> runtime);

}  // namespace actstash::client_internal::testing

#endif  // ACTSTASH_TESTS_CLIENT_SIM_GPU_RUNTIME_H_
