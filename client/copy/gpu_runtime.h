// GpuRuntime: exactly the CUDA runtime calls CudaCopyEngine needs, behind an
// interface, so that the engine's logic (gpu_copy_engine.cc) is plain C++
// and is tested on the CPU against a simulated device
// (tests/client/sim_gpu_runtime.h). The real one is CudaRuntime
// (cuda_runtime.cc, only with ACTSTASH_HAVE_CUDA). Private to the client.
//
// Handles are opaque integers: a GpuStream is a cudaStream_t (0 is the legacy
// default stream, as in StreamHandle), a GpuEvent a cudaEvent_t (0 is never a
// valid event). Semantics are CUDA's:
//  - work on one stream runs in submission order; streams run concurrently;
//  - RecordEvent captures the work submitted to the stream so far; an event
//    may be recorded again, and the latest record replaces the earlier one;
//  - StreamWaitEvent makes work submitted to the stream later wait for the
//    most recent record of the event AT THE TIME OF THE CALL (recording it
//    again afterwards does not affect the wait); the host does not wait;
//  - QueryEvent and SynchronizeEvent look at the most recent record; an event
//    never recorded is done;
//  - an error of asynchronous work (a faulting copy) is reported by later
//    queries and synchronizations, and spreads to work ordered after it.
// Errors returned by the *Async calls themselves mean nothing was enqueued.
//
// Thread-safety: implementations are safe to call from any thread at once. A
// handle must not be used after (or while) it is destroyed; destroying an
// event or a stream with work pending is allowed (the work still runs).
#ifndef ACTSTASH_CLIENT_COPY_GPU_RUNTIME_H_
#define ACTSTASH_CLIENT_COPY_GPU_RUNTIME_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "actstash/copy_engine.h"
#include "kernels/strided_layout.h"

namespace actstash::client_internal {

using GpuStream = uintptr_t;
using GpuEvent = uintptr_t;

class GpuRuntime {
 public:
  virtual ~GpuRuntime() = default;

  // cudaStreamCreateWithFlags(cudaStreamNonBlocking) / cudaStreamDestroy.
  virtual absl::StatusOr<GpuStream> CreateStream() = 0;
  virtual absl::Status DestroyStream(GpuStream stream) = 0;

  // cudaEventCreateWithFlags(cudaEventDisableTiming...) / cudaEventDestroy.
  virtual absl::StatusOr<GpuEvent> CreateEvent() = 0;
  virtual absl::Status DestroyEvent(GpuEvent event) = 0;

  // cudaEventRecord(event, stream).
  virtual absl::Status RecordEvent(GpuEvent event, GpuStream stream) = 0;
  // cudaStreamWaitEvent(stream, event).
  virtual absl::Status StreamWaitEvent(GpuStream stream, GpuEvent event) = 0;

  // cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream).
  virtual absl::Status MemcpyAsync(void* dst, const void* src, size_t nbytes, GpuStream stream) = 0;
  // kernels::GatherAsync / kernels::ScatterAsync (their checks and contracts).
  virtual absl::Status GatherAsync(const void* src, const kernels::StridedLayout& src_layout,
                                   void* dst, size_t dst_bytes, GpuStream stream) = 0;
  virtual absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                                    const kernels::StridedLayout& dst_layout, GpuStream stream) = 0;

  // kernels::Fp32ToBf16Async / Bf16ToFp32Async of `elements` elements.
  virtual absl::Status ConvertAsync(void* dst, const void* src, size_t elements,
                                    Conversion conversion, GpuStream stream) = 0;

  // cudaEventQuery: true when done, false when not yet, or the error of the
  // work it captured. Never blocks.
  virtual absl::StatusOr<bool> QueryEvent(GpuEvent event) = 0;
  // cudaEventSynchronize: blocks until done; the error of the work, if any.
  virtual absl::Status SynchronizeEvent(GpuEvent event) = 0;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_COPY_GPU_RUNTIME_H_
