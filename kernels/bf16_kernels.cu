// CUDA kernels of the bf16 conversions (bf16_cuda.h): element-wise,
// grid-stride, the math of bf16.cuh.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/bf16.cuh"
#include "kernels/cuda_launch.h"
#include "kernels/launch_kernel.cuh"

namespace actstash::kernels::internal {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 8192;

struct Fp32ToBf16Op {
  __device__ uint16_t operator()(float x) const { return Fp32BitsToBf16Bits(__float_as_uint(x)); }
};
struct Bf16ToFp32Op {
  __device__ float operator()(uint16_t x) const { return __uint_as_float(Bf16BitsToFp32Bits(x)); }
};
struct Fp16ToBf16Op {
  __device__ uint16_t operator()(uint16_t x) const { return Fp16BitsToBf16Bits(x); }
};

template <typename In, typename Out, typename Op>
__global__ void ConvertKernel(const In* __restrict__ src, Out* __restrict__ dst, uint64_t n) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    dst[i] = Op()(src[i]);
  }
}

template <typename In, typename Out, typename Op>
cudaError_t LaunchConvert(const In* src, Out* dst, uint64_t n, cudaStream_t stream) {
  uint64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return LaunchKernel(ConvertKernel<In, Out, Op>, static_cast<unsigned>(blocks), kThreads, stream,
                      src, dst, n);
}

}  // namespace

cudaError_t LaunchFp32ToBf16(const float* src, uint16_t* dst, uint64_t n, cudaStream_t stream) {
  return LaunchConvert<float, uint16_t, Fp32ToBf16Op>(src, dst, n, stream);
}

cudaError_t LaunchBf16ToFp32(const uint16_t* src, float* dst, uint64_t n, cudaStream_t stream) {
  return LaunchConvert<uint16_t, float, Bf16ToFp32Op>(src, dst, n, stream);
}

cudaError_t LaunchFp16ToBf16(const uint16_t* src, uint16_t* dst, uint64_t n, cudaStream_t stream) {
  return LaunchConvert<uint16_t, uint16_t, Fp16ToBf16Op>(src, dst, n, stream);
}

}  // namespace actstash::kernels::internal
