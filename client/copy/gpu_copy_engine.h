// The CudaCopyEngine's logic over a GpuRuntime (gpu_runtime.h): pure C++, no
// CUDA headers, always compiled, so that the CPU tests run it against a
// simulated device. CreateCudaCopyEngine (cuda_runtime.cc) hands it the real
// runtime. Private to the client library.
//
// The engine owns two non-blocking streams, one per CopyStream (kStore: D2H,
// kFetch: H2D), each with a completion thread for SubmitAsync's host work.
// A copy: records an event on the caller's stream `after` and makes the copy
// stream wait for it; waits for each dep (one of this engine's copy events:
// the copy stream waits for its GPU event; any other CopyEvent: the
// submitting thread waits for it on the host before enqueuing; a dep known to
// have failed fails the copy, with nothing enqueued); enqueues the copy; and
// records the completion event its CopyEvent queries (Done) and synchronizes
// (Wait). At most `max_in_flight` copies per stream are incomplete: past it,
// the submitting thread waits for the oldest. Events of SubmitAsync are host
// events (foreign as deps). If the stream's earlier work failed, SubmitAsync's
// `work` does not run and its event carries that error.
//
// Thread-safety: the engine is thread-safe (any thread may submit); its
// events are thread-safe and may outlive it (they keep the runtime alive).
#ifndef ACTSTASH_CLIENT_COPY_GPU_COPY_ENGINE_H_
#define ACTSTASH_CLIENT_COPY_GPU_COPY_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "actstash/copy_engine.h"
#include "client/copy/gpu_runtime.h"

namespace actstash::client_internal {

// INVALID_ARGUMENT when options.max_in_flight is 0; the runtime's error when
// a stream or an event cannot be created. `options.device` is the runtime's
// business (CudaRuntime is created for it) and is not used here.
absl::StatusOr<std::unique_ptr<CopyEngine>> CreateGpuCopyEngine(
    std::unique_ptr<GpuRuntime> runtime, const CudaCopyEngineOptions& options);

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_COPY_GPU_COPY_ENGINE_H_
