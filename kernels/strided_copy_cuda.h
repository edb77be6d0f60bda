// Strided gather/scatter on a CUDA stream: the GPU versions of
// strided_copy.h, with the same checks and index math. Only with
// ACTSTASH_HAVE_CUDA.
//
// Pointers must be usable by kernels on the current device: device memory,
// managed memory, or mapped pinned host memory (cudaHostAlloc with
// cudaHostAllocMapped, or cudaHostRegister'ed with cudaHostRegisterMapped:
// its device pointer from cudaHostGetDevicePointer, which is the host pointer
// itself where cudaDevAttrCanUseHostPointerForRegisteredMem is 1). This is
// how CudaCopyEngine packs a non-contiguous tensor straight into a pinned
// segment: no device temporaries are allocated. Both pointers must be aligned
// to elem_size.
//
// Asynchronous: the copy is enqueued on `stream` and these functions do NOT
// synchronize; the buffers must stay valid, and must not be modified, until
// the stream has run the copy. A dense layout becomes one cudaMemcpyAsync.
// Errors: INVALID_ARGUMENT from the checks of GatherCpu/ScatterCpu or a
// misaligned pointer (nothing enqueued); a launch failure as the CUDA error
// (ACTSTASH_CUDA_RETURN_IF_ERROR). Faults during the copy surface at the
// stream's next synchronization, as for any CUDA work.
// Thread-safety: stateless; safe to call from several threads.
#ifndef ACTSTASH_KERNELS_STRIDED_COPY_CUDA_H_
#define ACTSTASH_KERNELS_STRIDED_COPY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/strided_layout.h"

namespace actstash::kernels {

// GatherCpu's contract, on `stream`.
absl::Status GatherAsync(const void* src, const StridedLayout& src_layout, void* dst,
                         size_t dst_bytes, cudaStream_t stream);

// ScatterCpu's contract, on `stream`.
absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                          const StridedLayout& dst_layout, cudaStream_t stream);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_STRIDED_COPY_CUDA_H_
