// Strided gather/scatter on the CPU: pack a non-contiguous tensor into a
// contiguous buffer (gather) and unpack it back (scatter). The CUDA versions
// (strided_copy_cuda.h) share these checks and the coalesced layouts (their
// index math is strided_index.cuh; the CPU walks rows and cache-blocked,
// register-transposed tiles). See strided_layout.h for the conventions.
//
// Thread-safety: the functions keep no state; concurrent calls are safe when
// they write disjoint memory.
#ifndef ACTSTASH_KERNELS_STRIDED_COPY_H_
#define ACTSTASH_KERNELS_STRIDED_COPY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/strided_layout.h"

namespace actstash::kernels {

// Copies the elements of the strided tensor at `src` (element (0,...,0);
// `src_layout.extent_bytes` bytes from there are read) in logical order into
// the first numel * elem_size bytes of `dst`. Broadcasts (0 strides) and
// overlapping source layouts are fine. Errors (nothing is written):
// INVALID_ARGUMENT for an invalid layout, dst_bytes < numel * elem_size, a
// null pointer with numel > 0, or `dst` overlapping the source's extent.
absl::Status GatherCpu(const void* src, const StridedLayout& src_layout, void* dst,
                       size_t dst_bytes);

// The inverse: writes the first numel * elem_size bytes of `src`, in logical
// order, into the strided tensor at `dst`; bytes of dst's extent that no
// element maps to are left as they were. A destination that may overlap
// itself (CheckNoInternalOverlap) is INVALID_ARGUMENT, as are the errors of
// GatherCpu (src_bytes too small, null, `src` overlapping dst's extent).
absl::Status ScatterCpu(const void* src, size_t src_bytes, void* dst,
                        const StridedLayout& dst_layout);

// The checks above, shared with the CUDA versions: validates the layout, the
// contiguous buffer's size, null pointers, the two ranges' disjointness and,
// for a scatter (`strided_is_destination`), the destination's overlap.
// Returns the layout's LayoutInfo.
absl::StatusOr<LayoutInfo> CheckStridedCopy(const void* strided, const StridedLayout& layout,
                                            const void* contiguous, size_t contiguous_bytes,
                                            bool strided_is_destination);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_STRIDED_COPY_H_
