// The compute kernel of gpu_copy_bench's overlap measurement.
#include "bench/gpu_copy_bench.h"
#include "kernels/launch_kernel.cuh"

namespace actstash::bench {
namespace {

__global__ void Spin(float* out, long long iters) {
  const unsigned tid = blockIdx.x * blockDim.x + threadIdx.x;
  float a = 1.0f + 1e-7f * static_cast<float>(tid), b = 0.5f, c = 0.25f, d = 0.125f;
  for (long long i = 0; i < iters; ++i) {
    a = fmaf(a, 0.999999f, 1e-6f);
    b = fmaf(b, 0.999999f, 1e-6f);
    c = fmaf(c, 0.999999f, 1e-6f);
    d = fmaf(d, 0.999999f, 1e-6f);
  }
  out[tid] = a + b + c + d;
}

}  // namespace

cudaError_t LaunchSpin(float* out, unsigned blocks, unsigned threads, long long iters,
                       cudaStream_t stream) {
  return kernels::internal::LaunchKernel(Spin, blocks, threads, stream, out, iters);
}

}  // namespace actstash::bench
