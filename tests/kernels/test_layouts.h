// Test helpers for kernels/: an independent (naive) strided index, and random
// layouts the way torch makes them (permuted, sliced with steps, narrowed,
// broadcast) or arbitrary ones. Shared by the CPU and GPU tests.
#ifndef ACTSTASH_TESTS_KERNELS_TEST_LAYOUTS_H_
#define ACTSTASH_TESTS_KERNELS_TEST_LAYOUTS_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/strided_layout.h"

namespace actstash::kernels::testing {

inline int64_t Numel(const StridedLayout& layout) {
  int64_t numel = 1;
  for (int d = 0; d < layout.ndim; ++d) numel *= layout.sizes[d];
  return numel;
}

// Offset (in elements) of element `linear` in row-major order, written
// without any of the code under test.
inline int64_t NaiveOffset(const StridedLayout& layout, int64_t linear) {
  int64_t index[kMaxDims] = {};
  for (int d = layout.ndim - 1; d >= 0; --d) {
    index[d] = linear % layout.sizes[d];
    linear /= layout.sizes[d];
  }
  int64_t offset = 0;
  for (int d = 0; d < layout.ndim; ++d) offset += index[d] * layout.strides[d];
  return offset;
}

// Elements spanned from element (0,...,0): 1 + max offset (0 when empty).
inline int64_t NaiveExtent(const StridedLayout& layout) {
  if (Numel(layout) == 0) return 0;
  int64_t max = 0;
  for (int d = 0; d < layout.ndim; ++d) max += (layout.sizes[d] - 1) * layout.strides[d];
  return max + 1;
}

inline std::string Describe(const StridedLayout& layout) {
  return absl::StrCat("sizes {", absl::StrJoin(layout.sizes, layout.sizes + layout.ndim, ","),
                      "} strides {",
                      absl::StrJoin(layout.strides, layout.strides + layout.ndim, ","), "} elem ",
                      layout.elem_size);
}

// A view of a dense tensor: random base shape (at most ~30000 elements),
// each dim sliced (start, step 1-3, length; often the whole dim), dims
// permuted, optionally some dims broadcast (stride 0, any size), size-1 dims
// given odd strides, and now and then one dim emptied. Never overlaps itself
// unless `broadcast`. `*storage_offset` is the offset of element (0,...,0) in
// the base tensor, `*base_numel` the base tensor's element count.
inline StridedLayout RandomView(std::mt19937_64& rng, int elem_size, bool broadcast,
                                int64_t* storage_offset, int64_t* base_numel) {
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int ndim = static_cast<int>(uniform(0, kMaxDims));
  const int64_t max_size = ndim <= 2 ? 150 : ndim <= 4 ? 14 : 5;
  std::vector<int64_t> base(ndim);
  for (int64_t& size : base) size = uniform(0, 9) == 0 ? 1 : uniform(2, max_size);
  auto product = [&base] {
    return std::accumulate(base.begin(), base.end(), int64_t{1}, std::multiplies<>());
  };
  while (product() > 30000) --*std::max_element(base.begin(), base.end());
  StridedLayout layout = ContiguousLayout(base, elem_size);
  *base_numel = product();
  *storage_offset = 0;
  for (int d = 0; d < ndim; ++d) {
    const bool whole = uniform(0, 1) == 0;
    const int64_t start = whole ? 0 : uniform(0, base[d] - 1);
    const int64_t step = whole ? 1 : uniform(1, 3);
    const int64_t available = (base[d] - start + step - 1) / step;
    *storage_offset += start * layout.strides[d];
    layout.sizes[d] = whole ? available : uniform(1, available);
    layout.strides[d] *= step;
  }
  std::vector<int> order(ndim);
  std::iota(order.begin(), order.end(), 0);
  if (uniform(0, 3) != 0) std::shuffle(order.begin(), order.end(), rng);
  const StridedLayout before = layout;
  for (int d = 0; d < ndim; ++d) {
    layout.sizes[d] = before.sizes[order[d]];
    layout.strides[d] = before.strides[order[d]];
  }
  for (int d = 0; d < ndim; ++d) {
    if (broadcast && uniform(0, 3) == 0) {
      layout.strides[d] = 0;
      layout.sizes[d] = uniform(1, 4);
    } else if (layout.sizes[d] == 1) {
      layout.strides[d] = uniform(0, 1000);  // any stride is legal on a size-1 dim
    }
  }
  if (ndim > 0 && uniform(0, 19) == 0) layout.sizes[uniform(0, ndim - 1)] = 0;
  return layout;
}

// Arbitrary small sizes and strides (may overlap itself: gathers only).
inline StridedLayout RandomArbitrary(std::mt19937_64& rng, int elem_size) {
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  StridedLayout layout{};
  layout.ndim = static_cast<int>(uniform(0, kMaxDims));
  layout.elem_size = elem_size;
  for (int d = 0; d < layout.ndim; ++d) {
    layout.sizes[d] = uniform(0, 20) == 0 ? 0 : uniform(1, layout.ndim <= 3 ? 12 : 4);
    layout.strides[d] = uniform(0, 30);
  }
  return layout;
}

}  // namespace actstash::kernels::testing

#endif  // ACTSTASH_TESTS_KERNELS_TEST_LAYOUTS_H_
