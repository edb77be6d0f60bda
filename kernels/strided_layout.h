// StridedLayout: how a (possibly non-contiguous) tensor lies in memory, and
// the host-side checks every gather/scatter runs before touching memory.
//
// Conventions (torch's): dimension 0 is the outermost; sizes and strides are
// in ELEMENTS, strides >= 0 (a 0 stride is a broadcast); the base pointer
// handed to a copy points at element (0, ..., 0), i.e. the storage offset is
// already applied. The "logical order" of the elements is row-major over
// `sizes` (last dimension fastest), which is the order of the contiguous side
// of every gather/scatter.
//
// Thread-safety: all functions are pure and may be called concurrently.
#ifndef ACTSTASH_KERNELS_STRIDED_LAYOUT_H_
#define ACTSTASH_KERNELS_STRIDED_LAYOUT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace actstash::kernels {

inline constexpr int kMaxDims = 8;

// Plain old data (trivially copyable; passed by value to CUDA kernels).
// Value-initialize (`StridedLayout layout{};`) and fill the first `ndim`
// entries; entries at and beyond `ndim` are ignored.
struct StridedLayout {
  int ndim;                   // 0..kMaxDims; 0 is a scalar (one element)
  int64_t sizes[kMaxDims];    // >= 0
  int64_t strides[kMaxDims];  // >= 0, in elements
  int elem_size;              // bytes: 1, 2, 4 or 8
};

// What a valid layout spans.
struct LayoutInfo {
  int64_t numel = 0;             // product of sizes (1 for ndim 0)
  int64_t contiguous_bytes = 0;  // numel * elem_size
  int64_t extent_bytes = 0;      // 1 + highest byte offset touched; 0 when numel is 0
};

// Validates `layout` (ndim in 0..8, sizes and strides >= 0, elem_size in
// {1,2,4,8}, and numel, numel*elem_size and the byte extent all fit in
// int64_t) and returns what it spans; INVALID_ARGUMENT says which rule broke.
// When numel is 0 the strides and the other sizes are not range-checked
// beyond being >= 0: nothing is touched.
absl::StatusOr<LayoutInfo> InspectLayout(const StridedLayout& layout);

// InspectLayout(layout).status().
absl::Status ValidateLayout(const StridedLayout& layout);

// OK when no two index tuples of a valid layout map to the same element, as
// proven by the sorted-stride test: ignoring size-1 dims, and visiting the
// rest in increasing stride order, every stride must exceed the highest
// offset reachable with the dims visited before it. Broadcasts (a 0 stride on
// a dim of size > 1) fail. The test is exact for every view torch builds by
// permuting, slicing (with steps), narrowing and unsqueezing a dense tensor;
// rare interleaved as_strided layouts that do not overlap (sizes {3,3},
// strides {2,3}) also fail it and are rejected: a scatter must never race.
// Returns INVALID_ARGUMENT naming the offending dim (or ValidateLayout's error).
absl::Status CheckNoInternalOverlap(const StridedLayout& layout);

// An equivalent layout with as few dims as possible: size-1 dims dropped and
// each dim merged into its inner neighbour when stride[d] == size[d+1] *
// stride[d+1]. Element i of the logical order lands on the same offset in
// both. An empty layout (numel 0) becomes {ndim 1, sizes {0}}; a
// single-element one becomes ndim 0. Precondition: ValidateLayout is OK.
StridedLayout CoalesceLayout(const StridedLayout& layout);

// The dense row-major layout of `sizes` (at most kMaxDims entries; the
// caller validates the result).
StridedLayout ContiguousLayout(absl::Span<const int64_t> sizes, int elem_size);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_STRIDED_LAYOUT_H_
