// DeviceMemory on the CUDA runtime (built only with ACTSTASH_HAVE_CUDA).
#include <cuda_runtime_api.h>

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/units.h"
#include "kernels/cuda_status.h"
#include "server/pool/device_memory.h"

namespace actstash::server {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "IPC handle size changed");

void* Pointer(const DeviceRegion& region) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(region.address));
}

class CudaDeviceMemory final : public DeviceMemory {
 public:
  explicit CudaDeviceMemory(int count) : count_(count), streams_(count, nullptr) {}
  ~CudaDeviceMemory() override {
    absl::MutexLock lock(&mu_);
    for (int device = 0; device < count_; ++device) {
      if (streams_[device] == nullptr) continue;
      if (cudaSetDevice(device) == cudaSuccess) cudaStreamDestroy(streams_[device]);
    }
  }

  int device_count() const override { return count_; }

  std::string Describe(int device) const override {
    cudaDeviceProp prop{};
    if (absl::Status s = ACTSTASH_CUDA_STATUS(cudaGetDeviceProperties(&prop, device)); !s.ok()) {
      return std::string(s.message());
    }
    size_t free = 0, total = 0;
    if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
      return prop.name;
    }
    return absl::StrCat(prop.name, ", ", FormatBytes(free), " of ", FormatBytes(total), " free");
  }

  absl::StatusOr<DeviceRegion> Allocate(int device, uint64_t bytes) override {
    if (absl::Status s = Select(device); !s.ok()) return s;
    void* ptr = nullptr;
    ACTSTASH_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, bytes));
    DeviceRegion region;
    region.device = device;
    region.address = reinterpret_cast<uintptr_t>(ptr);
    region.bytes = bytes;
    return region;
  }

  absl::StatusOr<std::string> ExportIpcHandle(const DeviceRegion& region) override {
    if (absl::Status s = Select(region.device); !s.ok()) return s;
    cudaIpcMemHandle_t handle{};
    ACTSTASH_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, Pointer(region)));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }

  absl::Status Zero(const DeviceRegion& region, uint64_t offset, uint64_t bytes) override {
    if (offset > region.bytes || bytes > region.bytes - offset) {
      return absl::InternalError(absl::StrCat("zeroing [", offset, ", +", bytes,
                                              ") outside a region of ", region.bytes, " bytes"));
    }
    if (absl::Status s = Select(region.device); !s.ok()) return s;
    absl::StatusOr<cudaStream_t> stream = StreamFor(region.device);
    if (!stream.ok()) return stream.status();
    ACTSTASH_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(static_cast<char*>(Pointer(region)) + offset, 0, bytes, *stream));
    return ACTSTASH_CUDA_STATUS(cudaStreamSynchronize(*stream));
  }

  absl::Status Free(const DeviceRegion& region) override {
    if (absl::Status s = Select(region.device); !s.ok()) return s;
    return ACTSTASH_CUDA_STATUS(cudaFree(Pointer(region)));
  }

 private:
  absl::Status Select(int device) const {
    if (device < 0 || device >= count_) {
      return absl::FailedPreconditionError(
          absl::StrCat("no CUDA device ", device, " (", count_, " visible)"));
    }
    return ACTSTASH_CUDA_STATUS(cudaSetDevice(device));
  }

  // The device's scrub stream, created on first use (the device is selected).
  absl::StatusOr<cudaStream_t> StreamFor(int device) {
    absl::MutexLock lock(&mu_);
    if (streams_[device] == nullptr) {
      cudaStream_t stream = nullptr;
      ACTSTASH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      streams_[device] = stream;
    }
    return streams_[device];
  }

  const int count_;
  absl::Mutex mu_;
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateCudaDeviceMemory() {
  int count = 0;
  absl::Status status = ACTSTASH_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device (", status.message(), ")"));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device");
  return std::unique_ptr<DeviceMemory>(new CudaDeviceMemory(count));
}

}  // namespace actstash::server
