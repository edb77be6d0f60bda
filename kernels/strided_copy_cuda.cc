#include "kernels/strided_copy_cuda.h"

#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_launch.h"
#include "kernels/cuda_status.h"
#include "kernels/strided_copy.h"

namespace actstash::kernels {
namespace {

absl::Status CopyAsync(bool gather, const void* src, void* dst, const StridedLayout& layout,
                       const LayoutInfo& info, cudaStream_t stream) {
  if (info.numel == 0) return absl::OkStatus();
  const auto elem = static_cast<uintptr_t>(layout.elem_size);
  if (reinterpret_cast<uintptr_t>(src) % elem != 0 ||
      reinterpret_cast<uintptr_t>(dst) % elem != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("strided copy: pointers must be aligned to the element size ", elem));
  }
  const StridedLayout coalesced = CoalesceLayout(layout);
  if (coalesced.ndim == 0 || (coalesced.ndim == 1 && coalesced.strides[0] == 1)) {
    ACTSTASH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        dst, src, static_cast<size_t>(info.contiguous_bytes), cudaMemcpyDefault, stream));
    return absl::OkStatus();
  }
  IndexLayout<uint64_t> index{};
  index.ndim = coalesced.ndim;
  for (int d = 0; d < coalesced.ndim; ++d) {
    index.sizes[d] = static_cast<uint64_t>(coalesced.sizes[d]);
    index.strides[d] = static_cast<uint64_t>(coalesced.strides[d]);
  }
  constexpr int64_t kMax32 = std::numeric_limits<uint32_t>::max();
  const bool index32 = info.numel <= kMax32 && info.extent_bytes / layout.elem_size <= kMax32;
  ACTSTASH_CUDA_RETURN_IF_ERROR(
      internal::LaunchStridedCopy(gather, src, dst, index, layout.elem_size,
                                  static_cast<uint64_t>(info.numel), index32, stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status GatherAsync(const void* src, const StridedLayout& src_layout, void* dst,
                         size_t dst_bytes, cudaStream_t stream) {
  absl::StatusOr<LayoutInfo> info = CheckStridedCopy(src, src_layout, dst, dst_bytes, false);
  if (!info.ok()) return info.status();
  return CopyAsync(true, src, dst, src_layout, *info, stream);
}

absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                          const StridedLayout& dst_layout, cudaStream_t stream) {
  absl::StatusOr<LayoutInfo> info = CheckStridedCopy(dst, dst_layout, src, src_bytes, true);
  if (!info.ok()) return info.status();
  return CopyAsync(false, src, dst, dst_layout, *info, stream);
}

}  // namespace actstash::kernels
