// Checksum64 (kernels/checksum64.cuh) on a CUDA stream; the value equals
// Checksum64Cpu of the same bytes. Only with ACTSTASH_HAVE_CUDA.
//
// Asynchronous: enqueued on `stream`, does NOT synchronize; read the result
// after the stream has run it. `data` must be readable by kernels on the
// current device (device, managed or mapped pinned host memory; any
// alignment, 8-byte aligned is fastest). `device_result` is 8 bytes of
// 8-byte aligned DEVICE memory (it is zeroed with cudaMemsetAsync and
// accumulated with device atomics), not touched by anything else until the
// stream has run the checksum.
// Errors: INVALID_ARGUMENT for a null or misaligned result pointer or null
// data with size > 0; launch failures as the CUDA error.
// Thread-safety: stateless; safe to call from several threads.
#ifndef ACTSTASH_KERNELS_CHECKSUM64_CUDA_H_
#define ACTSTASH_KERNELS_CHECKSUM64_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace actstash::kernels {

absl::Status Checksum64Async(const void* data, size_t size, uint64_t* device_result,
                             cudaStream_t stream);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_CHECKSUM64_CUDA_H_
