// Index math of the CUDA strided gather/scatter (strided_copy_kernels.cu),
// on the same coalesced layouts the CPU implementation (strided_copy.cc)
// walks with counters and cache tiles; tests check it against a naive walk
// on the CPU (tests/kernels/strided_copy_test.cc).
#ifndef ACTSTASH_KERNELS_STRIDED_INDEX_CUH_
#define ACTSTASH_KERNELS_STRIDED_INDEX_CUH_

#include "kernels/hd.cuh"

namespace actstash::kernels {

// A coalesced StridedLayout in the index type the copy runs with (uint32_t
// when numel and the extent fit, else uint64_t: 64-bit division is several
// times slower on a GPU). Trivially copyable; a kernel parameter.
template <typename Index>
struct IndexLayout {
  int ndim;  // 0..8; 0 is a single element at offset 0
  Index sizes[8];
  Index strides[8];  // in elements
};

// Offset (in elements) of element `linear` of the logical (row-major) order:
// per-dim div/mod from the innermost dim outwards. Precondition: linear <
// numel; every size of a non-empty layout is >= 1, so no division by zero.
template <typename Index>
ACTSTASH_HD inline Index LinearToOffset(Index linear, const IndexLayout<Index>& layout) {
  Index offset = 0;
  for (int d = layout.ndim - 1; d > 0; --d) {
    const Index size = layout.sizes[d];
    const Index next = linear / size;
    offset += (linear - next * size) * layout.strides[d];
    linear = next;
  }
  if (layout.ndim > 0) offset += linear * layout.strides[0];  // linear < sizes[0] here
  return offset;
}

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_STRIDED_INDEX_CUH_
