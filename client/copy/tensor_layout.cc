#include "client/copy/tensor_layout.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/strided_copy.h"

namespace actstash::client_internal {

absl::StatusOr<kernels::StridedLayout> ToStridedLayout(const TensorLayout& layout) {
  if (layout.sizes.size() != layout.strides.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor layout: ", layout.sizes.size(), " sizes but ", layout.strides.size(), " strides"));
  }
  if (layout.sizes.size() > static_cast<size_t>(kernels::kMaxDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor layout: ", layout.sizes.size(), " dims, at most ", kernels::kMaxDims));
  }
  const int e = layout.element_size;
  if (e != 1 && e != 2 && e != 4 && e != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor layout: element size ", e, ", expected 1, 2, 4 or 8"));
  }
  kernels::StridedLayout out{};
  out.ndim = static_cast<int>(layout.sizes.size());
  out.elem_size = e;
  for (int d = 0; d < out.ndim; ++d) {
    out.sizes[d] = layout.sizes[d];
    out.strides[d] = layout.strides[d];
  }
  ACTSTASH_RETURN_IF_ERROR(kernels::ValidateLayout(out));
  return out;
}

absl::StatusOr<kernels::StridedLayout> CheckGather(const void* src, const TensorLayout& layout,
                                                   const void* dst, size_t dst_bytes) {
  ACTSTASH_ASSIGN_OR_RETURN(const kernels::StridedLayout strided, ToStridedLayout(layout));
  ACTSTASH_RETURN_IF_ERROR(
      kernels::CheckStridedCopy(src, strided, dst, dst_bytes, /*strided_is_destination=*/false)
          .status());
  return strided;
}

absl::StatusOr<kernels::StridedLayout> CheckScatter(const void* src, size_t src_bytes,
                                                    const void* dst, const TensorLayout& layout) {
  ACTSTASH_ASSIGN_OR_RETURN(const kernels::StridedLayout strided, ToStridedLayout(layout));
  ACTSTASH_RETURN_IF_ERROR(
      kernels::CheckStridedCopy(dst, strided, src, src_bytes, /*strided_is_destination=*/true)
          .status());
  return strided;
}

absl::Status CheckConversion(void* dst, const void* src, size_t elements, Conversion conversion) {
  if (elements == 0) return absl::OkStatus();
  const size_t in = conversion == Conversion::kFp32ToBf16 ? 4 : 2;
  const size_t out = conversion == Conversion::kFp32ToBf16 ? 2 : 4;
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError("ConvertAsync: null pointer with a non-empty conversion");
  }
  const auto s = reinterpret_cast<uintptr_t>(src);
  const auto d = reinterpret_cast<uintptr_t>(dst);
  if (s % in != 0 || d % out != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ConvertAsync: pointers must be aligned to their element sizes (", in, " and ",
                     out, " bytes)"));
  }
  if (elements > SIZE_MAX / 4) return absl::InvalidArgumentError("ConvertAsync: too many elements");
  if (s < d + elements * out && d < s + elements * in) {
    return absl::InvalidArgumentError("ConvertAsync: source and destination overlap");
  }
  return absl::OkStatus();
}

}  // namespace actstash::client_internal
