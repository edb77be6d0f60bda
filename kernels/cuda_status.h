// The one macro that turns a cudaError_t into an absl::Status (with the CUDA
// error name and string and the caller's file:line). Only for translation
// units built with CUDA (ACTSTASH_HAVE_CUDA).
#ifndef ACTSTASH_KERNELS_CUDA_STATUS_H_
#define ACTSTASH_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace actstash::internal {

inline absl::Status CudaErrorToStatus(cudaError_t error, const char* expr, const char* file,
                                      int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code = error == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(
      code, absl::StrCat(file, ":", line, ": ", expr, " failed: ", cudaGetErrorName(error), " (",
                         cudaGetErrorString(error), ")"));
}

}  // namespace actstash::internal

// Evaluates a CUDA runtime call; a Status expression (OK on cudaSuccess).
#define ACTSTASH_CUDA_STATUS(expr) \
  ::actstash::internal::CudaErrorToStatus((expr), #expr, __FILE__, __LINE__)

// Returns the Status of a failed CUDA runtime call from the enclosing function.
#define ACTSTASH_CUDA_RETURN_IF_ERROR(expr)                            \
  do {                                                                 \
    ::absl::Status actstash_cuda_status_ = ACTSTASH_CUDA_STATUS(expr); \
    if (!actstash_cuda_status_.ok()) return actstash_cuda_status_;     \
  } while (false)

#endif  // ACTSTASH_KERNELS_CUDA_STATUS_H_
