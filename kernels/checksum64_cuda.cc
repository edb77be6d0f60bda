#include "kernels/checksum64_cuda.h"

#include <cstdint>

#include "kernels/cuda_launch.h"
#include "kernels/cuda_status.h"

namespace actstash::kernels {

absl::Status Checksum64Async(const void* data, size_t size, uint64_t* device_result,
                             cudaStream_t stream) {
  if (device_result == nullptr || reinterpret_cast<uintptr_t>(device_result) % 8 != 0) {
    return absl::InvalidArgumentError("Checksum64Async: result must be 8-byte aligned memory");
  }
  if (data == nullptr && size > 0) {
    return absl::InvalidArgumentError("Checksum64Async: null data with size > 0");
  }
  ACTSTASH_CUDA_RETURN_IF_ERROR(internal::LaunchChecksum64(data, size, device_result, stream));
  return absl::OkStatus();
}

}  // namespace actstash::kernels
