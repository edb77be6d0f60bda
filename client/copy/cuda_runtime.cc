// CudaRuntime: GpuRuntime over cudart, and the public CUDA entry points
// (CreateCudaCopyEngine, CudaDeviceAvailable). Only with ACTSTASH_HAVE_CUDA;
// cuda_copy_engine_stub.cc stands in without CUDA.
#include <cuda_runtime_api.h>

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "actstash/copy_engine.h"
#include "client/copy/gpu_copy_engine.h"
#include "client/copy/gpu_runtime.h"
#include "common/cuda_device_guard.h"
#include "common/status_macros.h"
#include "kernels/bf16_cuda.h"
#include "kernels/cuda_status.h"
#include "kernels/strided_copy_cuda.h"

namespace actstash {
namespace client_internal {
namespace {

cudaStream_t ToStream(GpuStream stream) { return reinterpret_cast<cudaStream_t>(stream); }
cudaEvent_t ToEvent(GpuEvent event) { return reinterpret_cast<cudaEvent_t>(event); }

// The engine's device for one call; the calling thread's own context (a
// trainer's) is given back, and none is created on GPU 0 for threads that
// had none (common/cuda_device_guard.h).
#define ACTSTASH_USE_DEVICE(device)       \
  ScopedCudaDevice scoped_device(device); \
  ACTSTASH_RETURN_IF_ERROR(scoped_device.status())

// The address a kernel must use for `p`: registered (mapped) host memory is
// reached through its device pointer, which equals the host pointer only
// where cudaDevAttrCanUseHostPointerForRegisteredMem is 1; device and
// managed memory as they are. Pageable host memory cannot be written or
// read by a kernel: FAILED_PRECONDITION (callers copy a packed tensor
// instead).
absl::StatusOr<void*> KernelAddress(const void* p) {
  cudaPointerAttributes attributes{};
  ACTSTASH_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, p));
  switch (attributes.type) {
    case cudaMemoryTypeHost:
      if (attributes.devicePointer == nullptr) break;
      return attributes.devicePointer;
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return const_cast<void*>(p);
    default:
      break;
  }
  return absl::FailedPreconditionError(
      "a strided copy kernel needs device memory or host memory registered (mapped) with CUDA");
}

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
    ACTSTASH_ASSIGN_OR_RETURN(void* kernel_src, KernelAddress(src));
    ACTSTASH_ASSIGN_OR_RETURN(void* kernel_dst, KernelAddress(dst));
    return kernels::GatherAsync(kernel_src, src_layout, kernel_dst, dst_bytes, ToStream(stream));
  }
  absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                            const kernels::StridedLayout& dst_layout, GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    ACTSTASH_ASSIGN_OR_RETURN(void* kernel_src, KernelAddress(src));
    ACTSTASH_ASSIGN_OR_RETURN(void* kernel_dst, KernelAddress(dst));
    return kernels::ScatterAsync(kernel_src, src_bytes, kernel_dst, dst_layout, ToStream(stream));
  }

  absl::Status ConvertAsync(void* dst, const void* src, size_t elements, Conversion conversion,
                            GpuStream stream) override {
    ACTSTASH_USE_DEVICE(device_);
    ACTSTASH_ASSIGN_OR_RETURN(void* kernel_src, KernelAddress(src));
    ACTSTASH_ASSIGN_OR_RETURN(void* kernel_dst, KernelAddress(dst));
    if (conversion == Conversion::kFp32ToBf16) {
      return kernels::Fp32ToBf16Async(static_cast<const float*>(kernel_src),
                                      static_cast<uint16_t*>(kernel_dst), elements,
                                      ToStream(stream));
    }
    return kernels::Bf16ToFp32Async(static_cast<const uint16_t*>(kernel_src),
                                    static_cast<float*>(kernel_dst), elements, ToStream(stream));
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
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " does not exist (", count, " visible)"));
  }
  {
    // An unusable driver fails here, with the CUDA error.
    ScopedCudaDevice scoped(options.device);
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
