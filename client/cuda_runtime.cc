// CudaRuntime: GpuRuntime over cudart, and the public CUDA entry points
// (CreateCudaCopyEngine, CudaDeviceAvailable). Only with ACTSTASH_HAVE_CUDA;
// cuda_copy_engine_stub.cc stands in without CUDA.
#include <cuda_runtime_api.h>

#include <memory>
#include <utility>

#include "actstash/copy_engine.h"
#include "client/gpu_copy_engine.h"
#include "client/gpu_runtime.h"
#include "common/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/strided_copy_cuda.h"

namespace actstash {
namespace client_internal {
namespace {

cudaStream_t ToStream(GpuStream stream) { return reinterpret_cast<cudaStream_t>(stream); }
cudaEvent_t ToEvent(GpuEvent event) { return reinterpret_cast<cudaEvent_t>(event); }

// Makes `device` current on the calling thread for its lifetime and then
// restores the thread's previous device (the engine is called from the
// user's threads, whose current device is theirs).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    status_ = ACTSTASH_CUDA_STATUS(cudaGetDevice(&previous_));
    if (status_.ok() && previous_ != device) {
      status_ = ACTSTASH_CUDA_STATUS(cudaSetDevice(device));
      restore_ = status_.ok();
    }
  }
  ~ScopedDevice() {
    if (restore_) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  absl::Status status_;
};

#define ACTSTASH_USE_DEVICE(device)   \
  ScopedDevice scoped_device(device); \
  ACTSTASH_RETURN_IF_ERROR(scoped_device.status())

// Thread-safe: cudart is; the object holds only the device number.
class CudaRuntime final : public GpuRuntime {
 public:
  explicit CudaRuntime(int device) : device_(device) {}

  absl::StatusOr<GpuStream> CreateStream() override {
    ACTSTASH_USE_DEVICE(device_);
    cudaStream_t stream = nullptr;
    ACTSTASH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return reinterpret_cast<GpuStream>(stream);
  }
  absl::Status DestroyStream(GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    return ACTSTASH_CUDA_STATUS(cudaStreamDestroy(ToStream(stream)));
  }

  // Blocking sync: the threads waiting on events (completion threads, the
  // in-flight bound) sleep instead of spinning on a CPU core.
  absl::StatusOr<GpuEvent> CreateEvent() override {
    ACTSTASH_USE_DEVICE(device_);
    cudaEvent_t event = nullptr;
    ACTSTASH_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync));
    return reinterpret_cast<GpuEvent>(event);
  }
  absl::Status DestroyEvent(GpuEvent event) override {
    ACTSTASH_USE_DEVICE(device_);
    return ACTSTASH_CUDA_STATUS(cudaEventDestroy(ToEvent(event)));
  }

  absl::Status RecordEvent(GpuEvent event, GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    return ACTSTASH_CUDA_STATUS(cudaEventRecord(ToEvent(event), ToStream(stream)));
  }
  absl::Status StreamWaitEvent(GpuStream stream, GpuEvent event) override {
    ACTSTASH_USE_DEVICE(device_);
    return ACTSTASH_CUDA_STATUS(cudaStreamWaitEvent(ToStream(stream), ToEvent(event), 0));
  }

  absl::Status MemcpyAsync(void* dst, const void* src, size_t nbytes, GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    return ACTSTASH_CUDA_STATUS(
        cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, ToStream(stream)));
  }
  absl::Status GatherAsync(const void* src, const kernels::StridedLayout& src_layout, void* dst,
                           size_t dst_bytes, GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    return kernels::GatherAsync(src, src_layout, dst, dst_bytes, ToStream(stream));
  }
  absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                            const kernels::StridedLayout& dst_layout, GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    return kernels::ScatterAsync(src, src_bytes, dst, dst_layout, ToStream(stream));
  }

  absl::StatusOr<bool> QueryEvent(GpuEvent event) override {
    ACTSTASH_USE_DEVICE(device_);
    const cudaError_t error = cudaEventQuery(ToEvent(event));
    if (error == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is an answer, not an error to keep
      return false;
    }
    ACTSTASH_CUDA_RETURN_IF_ERROR(error);
    return true;
  }
  absl::Status SynchronizeEvent(GpuEvent event) override {
    ACTSTASH_USE_DEVICE(device_);
    return ACTSTASH_CUDA_STATUS(cudaEventSynchronize(ToEvent(event)));
  }

 private:
  const int device_;
};

#undef ACTSTASH_USE_DEVICE

}  // namespace
}  // namespace client_internal

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(
    const CudaCopyEngineOptions& options) {
  int count = 0;
  ACTSTASH_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  {
    // An invalid device or an unusable driver fails here, with the CUDA error.
    client_internal::ScopedDevice scoped(options.device);
    ACTSTASH_RETURN_IF_ERROR(scoped.status());
    ACTSTASH_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // creates the context
  }
  return client_internal::CreateGpuCopyEngine(
      std::make_unique<client_internal::CudaRuntime>(options.device), options);
}

bool CudaDeviceAvailable() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();  // clear a "no device" / "no driver" error
  return ok;
}

}  // namespace actstash
