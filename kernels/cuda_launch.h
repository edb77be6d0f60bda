// Internal: the kernel launchers of kernels/*_kernels.cu, called by the
// Status-returning wrappers (*_cuda.cc) after their checks. Kept free of absl
// so that nvcc only sees CUDA and the *.cuh math. Each enqueues its work on
// `stream`, does not synchronize, and returns the error of its own launches
// (never an earlier, unrelated one: see launch_kernel.cuh).
// Only with ACTSTASH_HAVE_CUDA.
#ifndef ACTSTASH_KERNELS_CUDA_LAUNCH_H_
#define ACTSTASH_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/strided_index.cuh"

namespace actstash::kernels::internal {

// One element per thread iteration (grid-stride); `layout` is coalesced,
// numel >= 1, elem_size in {1,2,4,8} and both pointers elem_size-aligned.
// `index32`: numel and the extent in elements fit in uint32_t.
cudaError_t LaunchStridedCopy(bool gather, const void* src, void* dst,
                              const IndexLayout<uint64_t>& layout, int elem_size, uint64_t numel,
                              bool index32, cudaStream_t stream);

// Writes Checksum64(data, size) to *device_result (8-byte aligned device
// memory) in three steps on `stream`: zero, accumulate, finish.
cudaError_t LaunchChecksum64(const void* data, uint64_t size, uint64_t* device_result,
                             cudaStream_t stream);

// Element-wise conversions of n >= 1 elements (bf16.cuh).
cudaError_t LaunchFp32ToBf16(const float* src, uint16_t* dst, uint64_t n, cudaStream_t stream);
cudaError_t LaunchBf16ToFp32(const uint16_t* src, float* dst, uint64_t n, cudaStream_t stream);
cudaError_t LaunchFp16ToBf16(const uint16_t* src, uint16_t* dst, uint64_t n, cudaStream_t stream);

}  // namespace actstash::kernels::internal

#endif  // ACTSTASH_KERNELS_CUDA_LAUNCH_H_
