// CUDA kernels of the strided gather/scatter (strided_copy_cuda.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_launch.h"
#include "kernels/launch_kernel.cuh"
#include "kernels/strided_index.cuh"

namespace actstash::kernels::internal {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 8192;

template <int kElem>
struct Word;
template <>
struct Word<1> {
  using Type = uint8_t;
};
template <>
struct Word<2> {
  using Type = uint16_t;
};
template <>
struct Word<4> {
  using Type = uint32_t;
};
template <>
struct Word<8> {
  using Type = unsigned long long;
};

// Element i of the logical order <-> element LinearToOffset(i) of the strided
// side. The strided side may be mapped host memory: each element is touched
// once, by one thread, and consecutive threads touch consecutive contiguous
// elements (coalesced on that side).
template <typename Index, int kElem, bool kGather>
__global__ void StridedCopyKernel(const void* __restrict__ src, void* __restrict__ dst,
                                  IndexLayout<Index> layout, uint64_t numel) {
  using T = typename Word<kElem>::Type;
  const T* in = static_cast<const T*>(src);
  T* out = static_cast<T*>(dst);
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += step) {
    const Index offset = LinearToOffset<Index>(static_cast<Index>(i), layout);
    if (kGather) {
      out[i] = in[offset];
    } else {
      out[offset] = in[i];
    }
  }
}

template <typename Index, int kElem>
cudaError_t Launch(bool gather, const void* src, void* dst, const IndexLayout<uint64_t>& wide,
                   uint64_t numel, cudaStream_t stream) {
  IndexLayout<Index> layout{};
  layout.ndim = wide.ndim;
  for (int d = 0; d < wide.ndim; ++d) {
    layout.sizes[d] = static_cast<Index>(wide.sizes[d]);
    layout.strides[d] = static_cast<Index>(wide.strides[d]);
  }
  uint64_t blocks = (numel + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return LaunchKernel(
      gather ? StridedCopyKernel<Index, kElem, true> : StridedCopyKernel<Index, kElem, false>,
      static_cast<unsigned>(blocks), kThreads, stream, src, dst, layout, numel);
}

template <typename Index>
cudaError_t LaunchForIndex(bool gather, const void* src, void* dst,
                           const IndexLayout<uint64_t>& layout, int elem_size, uint64_t numel,
                           cudaStream_t stream) {
  switch (elem_size) {
    case 1:
      return Launch<Index, 1>(gather, src, dst, layout, numel, stream);
    case 2:
      return Launch<Index, 2>(gather, src, dst, layout, numel, stream);
    case 4:
      return Launch<Index, 4>(gather, src, dst, layout, numel, stream);
    case 8:
      return Launch<Index, 8>(gather, src, dst, layout, numel, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchStridedCopy(bool gather, const void* src, void* dst,
                              const IndexLayout<uint64_t>& layout, int elem_size, uint64_t numel,
                              bool index32, cudaStream_t stream) {
  if (index32) {
    return LaunchForIndex<uint32_t>(gather, src, dst, layout, elem_size, numel, stream);
  }
  return LaunchForIndex<uint64_t>(gather, src, dst, layout, elem_size, numel, stream);
}

}  // namespace actstash::kernels::internal
