#include "kernels/strided_copy.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/strided_index.cuh"

namespace actstash::kernels {
namespace {

IndexLayout<uint64_t> ToIndexLayout(const StridedLayout& coalesced) {
  IndexLayout<uint64_t> out{};
  out.ndim = coalesced.ndim;
  for (int d = 0; d < coalesced.ndim; ++d) {
    out.sizes[d] = static_cast<uint64_t>(coalesced.sizes[d]);
    out.strides[d] = static_cast<uint64_t>(coalesced.strides[d]);
  }
  return out;
}

// Row by row: the offset of each innermost row comes from LinearToOffset (the
// GPU's math), the row itself is one memcpy when it is dense.
template <int kElem, bool kGather>
void CopyRows(const uint8_t* src, uint8_t* dst, const IndexLayout<uint64_t>& layout,
              uint64_t numel) {
  const int last = layout.ndim - 1;
  const uint64_t inner = layout.ndim > 0 ? layout.sizes[last] : 1;
  const uint64_t inner_stride = layout.ndim > 0 ? layout.strides[last] : 0;
  const uint64_t rows = numel / inner;
  for (uint64_t row = 0; row < rows; ++row) {
    const uint64_t first = row * inner;
    const uint64_t strided = LinearToOffset<uint64_t>(first, layout) * kElem;
    const uint64_t dense = first * kElem;
    if (inner_stride == 1) {
      if (kGather) {
        std::memcpy(dst + dense, src + strided, inner * kElem);
      } else {
        std::memcpy(dst + strided, src + dense, inner * kElem);
      }
      continue;
    }
    const uint64_t step = inner_stride * kElem;
    for (uint64_t j = 0; j < inner; ++j) {
      if (kGather) {
        std::memcpy(dst + dense + j * kElem, src + strided + j * step, kElem);
      } else {
        std::memcpy(dst + strided + j * step, src + dense + j * kElem, kElem);
      }
    }
  }
}

template <bool kGather>
void CopyStrided(const void* src, void* dst, const StridedLayout& layout, int64_t numel) {
  const StridedLayout coalesced = CoalesceLayout(layout);
  const IndexLayout<uint64_t> index = ToIndexLayout(coalesced);
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  const auto n = static_cast<uint64_t>(numel);
  switch (layout.elem_size) {
    case 1:
      return CopyRows<1, kGather>(s, d, index, n);
    case 2:
      return CopyRows<2, kGather>(s, d, index, n);
    case 4:
      return CopyRows<4, kGather>(s, d, index, n);
    default:
      return CopyRows<8, kGather>(s, d, index, n);
  }
}

}  // namespace

absl::StatusOr<LayoutInfo> CheckStridedCopy(const void* strided, const StridedLayout& layout,
                                            const void* contiguous, size_t contiguous_bytes,
                                            bool strided_is_destination) {
  ACTSTASH_ASSIGN_OR_RETURN(const LayoutInfo info, InspectLayout(layout));
  const char* side = strided_is_destination ? "source" : "destination";
  if (contiguous_bytes < static_cast<uint64_t>(info.contiguous_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("strided copy: the contiguous ", side, " has ",
                                                   contiguous_bytes, " bytes, the tensor needs ",
                                                   info.contiguous_bytes));
  }
  if (info.numel == 0) return info;
  if (strided == nullptr || contiguous == nullptr) {
    return absl::InvalidArgumentError("strided copy: null pointer with a non-empty tensor");
  }
  if (strided_is_destination) ACTSTASH_RETURN_IF_ERROR(CheckNoInternalOverlap(layout));
  const auto s = reinterpret_cast<uintptr_t>(strided);
  const auto c = reinterpret_cast<uintptr_t>(contiguous);
  if (s < c + static_cast<uint64_t>(info.contiguous_bytes) &&
      c < s + static_cast<uint64_t>(info.extent_bytes)) {
    return absl::InvalidArgumentError(
        "strided copy: the contiguous buffer overlaps the strided tensor's extent");
  }
  return info;
}

absl::Status GatherCpu(const void* src, const StridedLayout& src_layout, void* dst,
                       size_t dst_bytes) {
  ACTSTASH_ASSIGN_OR_RETURN(const LayoutInfo info,
                            CheckStridedCopy(src, src_layout, dst, dst_bytes, false));
  if (info.numel > 0) CopyStrided<true>(src, dst, src_layout, info.numel);
  return absl::OkStatus();
}

absl::Status ScatterCpu(const void* src, size_t src_bytes, void* dst,
                        const StridedLayout& dst_layout) {
  ACTSTASH_ASSIGN_OR_RETURN(const LayoutInfo info,
                            CheckStridedCopy(dst, dst_layout, src, src_bytes, true));
  if (info.numel > 0) CopyStrided<false>(src, dst, dst_layout, info.numel);
  return absl::OkStatus();
}

}  // namespace actstash::kernels
