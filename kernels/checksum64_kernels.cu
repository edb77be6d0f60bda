// CUDA kernels of Checksum64 (checksum64_cuda.h). One warp per 4096-byte
// block at a time: lane l hashes words l, l+32, ... (each warp load is 256
// contiguous bytes) and mixes its state; the mixed states are folded in lane
// order through shuffles (every lane computes the same fold); block hashes
// are summed per warp and added atomically (the sum is order-independent).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/checksum64.cuh"
#include "kernels/cuda_launch.h"
#include "kernels/launch_kernel.cuh"

namespace actstash::kernels::internal {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr uint64_t kMaxBlocks = 2048;

__global__ void Checksum64Kernel(const unsigned char* __restrict__ data, uint64_t size,
                                 uint64_t blocks, unsigned long long* sum) {
  const int lane = static_cast<int>(threadIdx.x) & (kChecksumLanes - 1);
  const uint64_t warp =
      (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kChecksumLanes;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kChecksumLanes;
  unsigned long long local = 0;
  for (uint64_t b = warp; b < blocks; b += warps) {  // uniform across the warp
    const uint64_t begin = b * kChecksumBlockBytes;
    const uint64_t left = size - begin;
    const uint32_t len =
        static_cast<uint32_t>(left < kChecksumBlockBytes ? left : kChecksumBlockBytes);
    const unsigned long long mixed = ChecksumMix64(ChecksumLane(data + begin, len, b, lane));
    uint64_t fold = kChecksumFoldInit;
    for (int l = 0; l < kChecksumLanes; ++l) {
      fold = ChecksumFoldMixed(fold, __shfl_sync(0xFFFFFFFFu, mixed, l));
    }
    local += ChecksumFoldFinish(fold);
  }
  if (lane == 0 && local != 0) atomicAdd(sum, local);
}

__global__ void Checksum64FinishKernel(unsigned long long* result, uint64_t size) {
  *result = ChecksumFinish(*result, size);
}

}  // namespace

cudaError_t LaunchChecksum64(const void* data, uint64_t size, uint64_t* device_result,
                             cudaStream_t stream) {
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "64-bit atomics");
  auto* result = reinterpret_cast<unsigned long long*>(device_result);
  cudaError_t error = cudaMemsetAsync(result, 0, sizeof(*result), stream);
  if (error != cudaSuccess) return error;
  const uint64_t blocks = (size + kChecksumBlockBytes - 1) / kChecksumBlockBytes;
  if (blocks > 0) {
    const uint64_t warps_per_cta = kThreads / kChecksumLanes;
    uint64_t ctas = (blocks + warps_per_cta - 1) / warps_per_cta;
    if (ctas > kMaxBlocks) ctas = kMaxBlocks;
    error = LaunchKernel(Checksum64Kernel, static_cast<unsigned>(ctas), kThreads, stream,
                         static_cast<const unsigned char*>(data), size, blocks, result);
    if (error != cudaSuccess) return error;
  }
  return LaunchKernel(Checksum64FinishKernel, 1, 1, stream, result, size);
}

}  // namespace actstash::kernels::internal
