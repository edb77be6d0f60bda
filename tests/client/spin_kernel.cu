#include "tests/client/spin_kernel.h"

namespace actstash::testing {
namespace {

__global__ void SpinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void FillKernel(uint8_t* bytes, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    bytes[i] = static_cast<uint8_t>(seed + i * 7);
  }
}

}  // namespace

cudaError_t LaunchSpin(int64_t cycles, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<long long>(cycles));
  return cudaGetLastError();
}

cudaError_t LaunchFill(uint8_t* bytes, size_t n, uint32_t seed, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const size_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  FillKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(bytes, n, seed);
  return cudaGetLastError();
}

}  // namespace actstash::testing
