// CopyEngine: asynchronous copies ordered on streams, completed through
// events. Two implementations sit behind the interface:
//  - HostCopyEngine (always built): one worker thread per CopyStream; a
//    caller's "stream" is its own thread, whose work is finished when it
//    calls, so `after` handles are ignored and OrderAfterAsync blocks.
//  - CudaCopyEngine (builds with CUDA): dedicated non-blocking CUDA streams
//    for stores (D2H) and fetches (H2D) on one device; each copy waits for an
//    event recorded on the caller's stream, and OrderAfterAsync makes the
//    caller's stream wait for the copy (cudaStreamWaitEvent): no host sync.
//
// Every *Async call returns at once and does not synchronize; work on one
// CopyStream runs in submission order; an event completes when its work has.
// Buffers handed to a copy must stay valid, and sources unmodified, until its
// event is done: the engine does not keep them alive.
#ifndef ACTSTASH_COPY_ENGINE_H_
#define ACTSTASH_COPY_ENGINE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace actstash {

// Thread-safe. Shared between the engine and whoever waits on it.
class CopyEvent {
 public:
  virtual ~CopyEvent() = default;
  // True once the work finished (successfully or not). Never blocks.
  virtual bool Done() const = 0;
  // Blocks until done; returns the work's status.
  virtual absl::Status Wait() const = 0;
};

enum class CopyStream { kStore = 0, kFetch = 1 };

// A caller's stream. CUDA: a cudaStream_t as an integer (0 is the legacy
// default stream; from torch, `torch.cuda.current_stream().cuda_stream`).
// HostCopyEngine ignores it.
struct StreamHandle {
  uintptr_t value = 0;
};

// A strided tensor, torch's conventions: sizes and strides in elements
// (strides >= 0; 0 is a broadcast), dim 0 outermost, the pointer handed with
// it addresses element (0, ..., 0). At most 8 dims; element size 1, 2, 4, 8.
struct TensorLayout {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int element_size = 1;
};

// Element conversions a copy can apply (kernels/bf16.cuh): the lossy fp32 →
// bf16 downcast (round to nearest even; NaN stays NaN, ±Inf and ±0 kept)
// that halves offloaded bytes, and the exact way back.
enum class Conversion { kFp32ToBf16, kBf16ToFp32 };

// Work that must wait for earlier events besides the caller's stream.
using CopyDeps = absl::Span<const std::shared_ptr<CopyEvent>>;

// Thread-safe: any thread may submit. Destruction finishes queued work first.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;

  // Runs host `work` after everything submitted to `stream` before has
  // completed (CUDA: on the engine's completion thread, never on a CUDA
  // callback: `work` may block and call CUDA). The event carries its status.
  virtual std::shared_ptr<CopyEvent> SubmitAsync(CopyStream stream,
                                                 std::function<absl::Status()> work) = 0;

  // Copies `nbytes` from `src` to `dst` on `stream`, after all work submitted
  // so far to the caller's stream `after` and after `deps`. CUDA: any pair of
  // host (pinned or not) and device memory of the engine's device. Errors
  // reported here mean nothing was enqueued; errors of the copy itself (or of
  // a dep) come through the event.
  virtual absl::StatusOr<std::shared_ptr<CopyEvent>> CopyAsync(CopyStream stream, void* dst,
                                                               const void* src, size_t nbytes,
                                                               StreamHandle after,
                                                               CopyDeps deps = {}) = 0;

  // Packs the strided tensor at `src` into `dst` (contiguous, `dst_bytes`),
  // ordered like CopyAsync. CUDA: `dst` may be registered (mapped) pinned
  // host memory: no device temporary. INVALID_ARGUMENT for a bad layout, a
  // short or overlapping destination (nothing enqueued).
  virtual absl::StatusOr<std::shared_ptr<CopyEvent>> GatherAsync(CopyStream stream, void* dst,
                                                                 size_t dst_bytes, const void* src,
                                                                 const TensorLayout& layout,
                                                                 StreamHandle after,
                                                                 CopyDeps deps = {}) = 0;

  // The inverse of GatherAsync: unpacks contiguous `src` into the strided
  // tensor at `dst`. A destination that overlaps itself is INVALID_ARGUMENT.
  virtual absl::StatusOr<std::shared_ptr<CopyEvent>> ScatterAsync(CopyStream stream, void* dst,
                                                                  const TensorLayout& layout,
                                                                  const void* src, size_t src_bytes,
                                                                  StreamHandle after,
                                                                  CopyDeps deps = {}) = 0;

  // Converts `elements` contiguous elements from `src` into `dst` (fp32 is 4
  // bytes, bf16 2), ordered like CopyAsync. CUDA: either side may be device
  // or registered host memory. INVALID_ARGUMENT for a null or misaligned
  // pointer or overlapping ranges (nothing enqueued).
  virtual absl::StatusOr<std::shared_ptr<CopyEvent>> ConvertAsync(CopyStream stream, void* dst,
                                                                  const void* src, size_t elements,
                                                                  Conversion conversion,
                                                                  StreamHandle after,
                                                                  CopyDeps deps = {}) = 0;

  // Orders all work submitted to the caller's `stream` from now on after
  // `event`. CUDA: cudaStreamWaitEvent, the calling thread does not wait.
  // HostCopyEngine: blocks the calling thread until the event is done.
  // Returns the event's error when it is known to have failed.
  virtual absl::Status OrderAfterAsync(StreamHandle stream, const CopyEvent& event) = 0;

  // Blocks until every stream is idle.
  virtual void Synchronize() = 0;

  // The CUDA device whose tensors this engine copies; -1 for the host engine.
  virtual int device() const = 0;
};

struct HostCopyEngineOptions {
  // Before each piece of work, sleep a random time in [0, max_injected_delay]
  // (tests: makes ordering bugs between compute and copies show up).
  std::chrono::microseconds max_injected_delay{0};
  uint64_t seed = 0;
  // > 0: a simulated link of this many bytes per second in each direction
  // (a test knob: a CPU run with a GPU's ratio of compute to PCIe). A
  // stream's copies (CopyAsync, GatherAsync, ScatterAsync, ConvertAsync:
  // the bytes they write) each take at least bytes / rate, one after the
  // other as on a link; the two streams are the two directions and do not
  // wait for each other. SubmitAsync's work is not counted.
  uint64_t link_bytes_per_second = 0;
};

// Two worker threads: one per stream.
std::unique_ptr<CopyEngine> CreateHostCopyEngine(const HostCopyEngineOptions& options = {});

struct CudaCopyEngineOptions {
  int device = 0;
  // Copies enqueued but not yet complete, per stream; a submission past it
  // waits (on the host) for the oldest one. Bounds events and pinned buffers
  // in flight.
  uint32_t max_in_flight = 64;
};

// FAILED_PRECONDITION when the library was built without CUDA; the CUDA
// error (with file:line) when the device cannot be used.
absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(
    const CudaCopyEngineOptions& options = {});

// Whether this build has CUDA support and a usable device (driver present).
bool CudaDeviceAvailable();

}  // namespace actstash

#endif  // ACTSTASH_COPY_ENGINE_H_
