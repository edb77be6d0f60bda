#include "kernels/bf16_cuda.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_launch.h"
#include "kernels/cuda_status.h"

namespace actstash::kernels {
namespace {

template <typename In, typename Out>
absl::Status CheckArrays(const char* what, const In* src, Out* dst) {
  const auto s = reinterpret_cast<uintptr_t>(src);
  const auto d = reinterpret_cast<uintptr_t>(dst);
  if (s == 0 || d == 0 || s % alignof(In) != 0 || d % alignof(Out) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null or misaligned array with n > 0"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Fp32ToBf16Async(const float* src, uint16_t* dst, size_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  absl::Status checked = CheckArrays("Fp32ToBf16Async", src, dst);
  if (!checked.ok()) return checked;
  ACTSTASH_CUDA_RETURN_IF_ERROR(internal::LaunchFp32ToBf16(src, dst, n, stream));
  return absl::OkStatus();
}

absl::Status Bf16ToFp32Async(const uint16_t* src, float* dst, size_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  absl::Status checked = CheckArrays("Bf16ToFp32Async", src, dst);
  if (!checked.ok()) return checked;
  ACTSTASH_CUDA_RETURN_IF_ERROR(internal::LaunchBf16ToFp32(src, dst, n, stream));
  return absl::OkStatus();
}

absl::Status Fp16ToBf16Async(const uint16_t* src, uint16_t* dst, size_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  absl::Status checked = CheckArrays("Fp16ToBf16Async", src, dst);
  if (!checked.ok()) return checked;
  ACTSTASH_CUDA_RETURN_IF_ERROR(internal::LaunchFp16ToBf16(src, dst, n, stream));
  return absl::OkStatus();
}

}  // namespace actstash::kernels
