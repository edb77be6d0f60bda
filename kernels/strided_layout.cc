#include "kernels/strided_layout.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"

namespace actstash::kernels {
namespace {

bool MulOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }
bool AddOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out); }

}  // namespace

absl::StatusOr<LayoutInfo> InspectLayout(const StridedLayout& layout) {
  if (layout.ndim < 0 || layout.ndim > kMaxDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("strided layout: ndim ", layout.ndim, " is outside 0..", kMaxDims));
  }
  const int elem = layout.elem_size;
  if (elem != 1 && elem != 2 && elem != 4 && elem != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("strided layout: element size ", elem, " is not 1, 2, 4 or 8 bytes"));
  }
  bool empty = false;
  for (int d = 0; d < layout.ndim; ++d) {
    if (layout.sizes[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("strided layout: size[", d, "] = ", layout.sizes[d], " is negative"));
    }
    if (layout.strides[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("strided layout: stride[", d, "] = ", layout.strides[d], " is negative"));
    }
    empty = empty || layout.sizes[d] == 0;
  }
  LayoutInfo info;
  if (empty) return info;
  int64_t numel = 1;
  int64_t max_offset = 0;  // in elements
  for (int d = 0; d < layout.ndim; ++d) {
    int64_t reach = 0;
    if (MulOverflows(numel, layout.sizes[d], &numel) ||
        MulOverflows(layout.sizes[d] - 1, layout.strides[d], &reach) ||
        AddOverflows(max_offset, reach, &max_offset)) {
      return absl::InvalidArgumentError(
          absl::StrCat("strided layout: element count or extent overflows 64 bits at dim ", d));
    }
  }
  int64_t extent_elems = 0;
  if (MulOverflows(numel, elem, &info.contiguous_bytes) ||
      AddOverflows(max_offset, 1, &extent_elems) ||
      MulOverflows(extent_elems, elem, &info.extent_bytes)) {
    return absl::InvalidArgumentError("strided layout: byte extent overflows 64 bits");
  }
  info.numel = numel;
  return info;
}

absl::Status ValidateLayout(const StridedLayout& layout) { return InspectLayout(layout).status(); }

absl::Status CheckNoInternalOverlap(const StridedLayout& layout) {
  absl::Status valid = ValidateLayout(layout);
  if (!valid.ok()) return valid;
  std::pair<int64_t, int> dims[kMaxDims];  // (stride, dim) of dims with size > 1
  int count = 0;
  for (int d = 0; d < layout.ndim && d < kMaxDims; ++d) {
    if (layout.sizes[d] == 0) return absl::OkStatus();  // nothing is written
    if (layout.sizes[d] <= 1) continue;
    int i = count++;  // insertion sort by stride (at most 8 entries)
    for (; i > 0 && dims[i - 1].first > layout.strides[d]; --i) dims[i] = dims[i - 1];
    dims[i] = {layout.strides[d], d};
  }
  int64_t max_offset = 0;  // highest offset reachable with the dims visited so far
  for (int i = 0; i < count; ++i) {
    const auto [stride, d] = dims[i];
    if (stride == 0) {
      return absl::InvalidArgumentError(absl::StrCat("strided layout overlaps itself: dim ", d,
                                                     " (size ", layout.sizes[d],
                                                     ") is a broadcast (stride 0)"));
    }
    if (stride <= max_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "strided layout may overlap itself: stride ", stride, " of dim ", d,
          " does not exceed the reach ", max_offset, " of the dims with smaller strides"));
    }
    max_offset += (layout.sizes[d] - 1) * stride;  // no overflow: the layout is valid
  }
  return absl::OkStatus();
}

StridedLayout CoalesceLayout(const StridedLayout& layout) {
  StridedLayout out{};
  out.elem_size = layout.elem_size;
  for (int d = 0; d < layout.ndim; ++d) {
    if (layout.sizes[d] == 0) {
      out.ndim = 1;
      out.sizes[0] = 0;
      out.strides[0] = 1;
      return out;
    }
  }
  // Walk from the innermost dim outwards, building the result innermost-last.
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
  int n = 0;  // dims collected, innermost first
  for (int d = layout.ndim - 1; d >= 0; --d) {
    const int64_t size = layout.sizes[d];
    const int64_t stride = layout.strides[d];
    if (size == 1) continue;
    int64_t merged_stride = 0;
    if (n > 0 && !MulOverflows(sizes[n - 1], strides[n - 1], &merged_stride) &&
        stride == merged_stride) {
      sizes[n - 1] *= size;  // cannot overflow: bounded by numel
      continue;
    }
    sizes[n] = size;
    strides[n] = stride;
    ++n;
  }
  out.ndim = n;
  for (int i = 0; i < n; ++i) {
    out.sizes[i] = sizes[n - 1 - i];
    out.strides[i] = strides[n - 1 - i];
  }
  return out;
}

StridedLayout ContiguousLayout(absl::Span<const int64_t> sizes, int elem_size) {
  StridedLayout out{};
  out.ndim = static_cast<int>(sizes.size());
  out.elem_size = elem_size;
  const int n = std::min<int>(out.ndim, kMaxDims);
  uint64_t stride = 1;  // wraps (never UB) on absurd sizes; ValidateLayout rejects those
  for (int d = n - 1; d >= 0; --d) {
    out.sizes[d] = sizes[d];
    out.strides[d] = static_cast<int64_t>(stride);
    stride *= sizes[d] > 0 ? static_cast<uint64_t>(sizes[d]) : 1;
  }
  return out;
}

}  // namespace actstash::kernels
