// TensorLayout (public, vectors) to kernels::StridedLayout (fixed arrays), and
// the argument checks every engine runs before it enqueues a gather or a
// scatter. Private to the client library.
//
// Thread-safety: pure functions; safe to call concurrently.
#ifndef ACTSTASH_CLIENT_COPY_TENSOR_LAYOUT_H_
#define ACTSTASH_CLIENT_COPY_TENSOR_LAYOUT_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "actstash/copy_engine.h"
#include "kernels/strided_layout.h"

namespace actstash::client_internal {

// INVALID_ARGUMENT when `layout` has more than kernels::kMaxDims dims,
// sizes.size() != strides.size(), an element size other than 1, 2, 4, 8, or
// fails kernels::ValidateLayout (negative sizes or strides, overflow).
absl::StatusOr<kernels::StridedLayout> ToStridedLayout(const TensorLayout& layout);

// ToStridedLayout plus kernels::CheckStridedCopy for a gather of the tensor
// at `src` into `dst` (`dst_bytes`): INVALID_ARGUMENT for a short or
// overlapping destination or a null pointer.
absl::StatusOr<kernels::StridedLayout> CheckGather(const void* src, const TensorLayout& layout,
                                                   const void* dst, size_t dst_bytes);

// The same for a scatter of `src` (`src_bytes`) into the tensor at `dst`;
// a destination that may overlap itself is INVALID_ARGUMENT too.
absl::StatusOr<kernels::StridedLayout> CheckScatter(const void* src, size_t src_bytes,
                                                    const void* dst, const TensorLayout& layout);

// ConvertAsync's argument checks: non-null, aligned to the element sizes,
// non-overlapping (`elements` == 0 is always fine).
absl::Status CheckConversion(void* dst, const void* src, size_t elements, Conversion conversion);

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_COPY_TENSOR_LAYOUT_H_
