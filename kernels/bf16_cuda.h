// The bf16 conversions of bf16.h on a CUDA stream, bit-identical to the CPU
// versions (same element math, kernels/bf16.cuh). Only with
// ACTSTASH_HAVE_CUDA.
//
// Asynchronous: enqueued on `stream`, do NOT synchronize. Arrays hold n
// elements, are readable/writable by kernels on the current device (device,
// managed or mapped pinned host memory), naturally aligned, and do not
// overlap. Errors: INVALID_ARGUMENT for null or misaligned pointers with
// n > 0 (nothing enqueued); launch failures as the CUDA error.
// Thread-safety: stateless; safe to call from several threads.
#ifndef ACTSTASH_KERNELS_BF16_CUDA_H_
#define ACTSTASH_KERNELS_BF16_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace actstash::kernels {

absl::Status Fp32ToBf16Async(const float* src, uint16_t* dst, size_t n, cudaStream_t stream);
absl::Status Bf16ToFp32Async(const uint16_t* src, float* dst, size_t n, cudaStream_t stream);
absl::Status Fp16ToBf16Async(const uint16_t* src, uint16_t* dst, size_t n, cudaStream_t stream);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_BF16_CUDA_H_
