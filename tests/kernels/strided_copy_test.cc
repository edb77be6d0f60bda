// CPU strided gather/scatter and layout checks, against a naive reference.
#include "kernels/strided_copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/strided_index.cuh"
#include "kernels/strided_layout.h"
#include "tests/kernels/test_layouts.h"

namespace actstash::kernels {
namespace {

using ::actstash::kernels::testing::Describe;
using ::actstash::kernels::testing::NaiveExtent;
using ::actstash::kernels::testing::NaiveOffset;
using ::actstash::kernels::testing::Numel;
using ::actstash::kernels::testing::RandomArbitrary;
using ::actstash::kernels::testing::RandomView;

constexpr int kElemSizes[] = {1, 2, 4, 8};

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t size) {
  std::vector<uint8_t> bytes(size);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// The naive gather: element i of dst from NaiveOffset(i) of src.
std::vector<uint8_t> NaiveGather(const uint8_t* src, const StridedLayout& layout) {
  const int64_t numel = Numel(layout);
  const int e = layout.elem_size;
  std::vector<uint8_t> out(static_cast<size_t>(numel * e));
  for (int64_t i = 0; i < numel; ++i) {
    std::memcpy(&out[i * e], src + NaiveOffset(layout, i) * e, e);
  }
  return out;
}

StridedLayout Layout(std::vector<int64_t> sizes, std::vector<int64_t> strides, int elem = 4) {
  StridedLayout layout{};
  layout.ndim = static_cast<int>(sizes.size());
  layout.elem_size = elem;
  for (size_t d = 0; d < sizes.size() && d < kMaxDims; ++d) {
    layout.sizes[d] = sizes[d];
    layout.strides[d] = strides[d];
  }
  return layout;
}

TEST(StridedCopyTest, GatherMatchesNaiveOnRandomViewsAndArbitraryLayouts) {
  std::mt19937_64 rng(1);
  for (int iter = 0; iter < 3000; ++iter) {
    const int elem = kElemSizes[iter % 4];
    int64_t offset = 0;
    int64_t base_numel = 0;
    StridedLayout layout = iter % 3 == 2
                               ? RandomArbitrary(rng, elem)
                               : RandomView(rng, elem, iter % 3 == 1, &offset, &base_numel);
    if (iter % 3 == 2) base_numel = NaiveExtent(layout);
    ASSERT_TRUE(ValidateLayout(layout).ok()) << Describe(layout);
    const std::vector<uint8_t> src = RandomBytes(rng, static_cast<size_t>(base_numel * elem) + 1);
    const uint8_t* base = src.data() + 1 + offset * elem;  // odd address: no alignment needed
    const std::vector<uint8_t> expected = NaiveGather(base, layout);
    const size_t slack = iter % 5;
    std::vector<uint8_t> dst(expected.size() + slack, 0xAB);
    ASSERT_TRUE(GatherCpu(base, layout, dst.data(), dst.size()).ok()) << Describe(layout);
    ASSERT_TRUE(std::equal(expected.begin(), expected.end(), dst.begin())) << Describe(layout);
    for (size_t i = expected.size(); i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xAB);
  }
}

TEST(StridedCopyTest, ScatterMatchesNaiveAndLeavesGapsAlone) {
  std::mt19937_64 rng(2);
  for (int iter = 0; iter < 3000; ++iter) {
    const int elem = kElemSizes[iter % 4];
    int64_t offset = 0;
    int64_t base_numel = 0;
    const StridedLayout layout = RandomView(rng, elem, false, &offset, &base_numel);
    ASSERT_TRUE(CheckNoInternalOverlap(layout).ok()) << Describe(layout);
    const int64_t numel = Numel(layout);
    const std::vector<uint8_t> src = RandomBytes(rng, static_cast<size_t>(numel * elem));
    std::vector<uint8_t> dst = RandomBytes(rng, static_cast<size_t>(base_numel * elem));
    std::vector<uint8_t> expected = dst;
    for (int64_t i = 0; i < numel; ++i) {
      std::memcpy(&expected[(offset + NaiveOffset(layout, i)) * elem], &src[i * elem], elem);
    }
    ASSERT_TRUE(ScatterCpu(src.data(), src.size(), dst.data() + offset * elem, layout).ok())
        << Describe(layout);
    ASSERT_EQ(dst, expected) << Describe(layout);
  }
}

TEST(StridedCopyTest, ScatterThenGatherRoundTrips) {
  std::mt19937_64 rng(3);
  for (int iter = 0; iter < 1000; ++iter) {
    const int elem = kElemSizes[iter % 4];
    int64_t offset = 0;
    int64_t base_numel = 0;
    const StridedLayout layout = RandomView(rng, elem, false, &offset, &base_numel);
    const std::vector<uint8_t> src = RandomBytes(rng, static_cast<size_t>(Numel(layout) * elem));
    std::vector<uint8_t> tensor(static_cast<size_t>(base_numel * elem));
    std::vector<uint8_t> back(src.size());
    ASSERT_TRUE(ScatterCpu(src.data(), src.size(), tensor.data() + offset * elem, layout).ok());
    ASSERT_TRUE(GatherCpu(tensor.data() + offset * elem, layout, back.data(), back.size()).ok());
    ASSERT_EQ(back, src) << Describe(layout);
  }
}

// Gather and scatter of `layout` at an odd address inside a buffer with
// `offset` elements before element (0,...,0), against the naive walk; the
// scatter only when the layout may be written.
void ExpectCopiesMatchNaive(std::mt19937_64& rng, const StridedLayout& layout, int64_t offset) {
  const int e = layout.elem_size;
  const int64_t numel = Numel(layout);
  const size_t bytes = static_cast<size_t>((offset + NaiveExtent(layout)) * e) + 1;
  const std::vector<uint8_t> tensor = RandomBytes(rng, bytes);
  const uint8_t* base = tensor.data() + 1 + offset * e;  // odd address
  const std::vector<uint8_t> expected = NaiveGather(base, layout);
  std::vector<uint8_t> dense(expected.size() + 3, 0xAB);
  ASSERT_TRUE(GatherCpu(base, layout, dense.data(), dense.size()).ok()) << Describe(layout);
  ASSERT_TRUE(std::equal(expected.begin(), expected.end(), dense.begin())) << Describe(layout);
  for (size_t i = expected.size(); i < dense.size(); ++i) ASSERT_EQ(dense[i], 0xAB);
  if (!CheckNoInternalOverlap(layout).ok()) return;
  const std::vector<uint8_t> src = RandomBytes(rng, static_cast<size_t>(numel * e) + 1);
  std::vector<uint8_t> scattered = tensor;
  std::vector<uint8_t> want = tensor;
  for (int64_t i = 0; i < numel; ++i) {
    std::memcpy(&want[1 + (offset + NaiveOffset(layout, i)) * e], &src[1 + i * e], e);
  }
  ASSERT_TRUE(
      ScatterCpu(src.data() + 1, src.size() - 1, scattered.data() + 1 + offset * e, layout).ok())
      << Describe(layout);
  ASSERT_EQ(scattered, want) << Describe(layout);  // gaps and the bytes around kept
}

// Transposed planes (the register-tile path of the CPU copy: 16-byte tiles in
// 128-byte cache blocks) at and around the tile and block edges, for every
// element size, with gaps between the strided rows, with the paired dim not
// next to the innermost one, with outer broadcasts, and with a row step of 2
// elements (blocks without tiles).
TEST(StridedCopyTest, TransposedPlanesAtTileAndBlockEdges) {
  std::mt19937_64 rng(5);
  for (int elem : kElemSizes) {
    const int64_t tile = 16 / elem;
    const int64_t block = 128 / elem;
    const std::vector<int64_t> edges = {
        1, 2, tile - 1, tile, tile + 1, 2 * tile + 3, block - 1, block, block + 1, 2 * block + 5};
    for (int64_t rows : edges) {
      for (int64_t cols : edges) {
        for (int64_t gap : {0, 3}) {
          // Element (i, j) at i + j * (rows + gap): the transpose of a
          // [cols, rows] tensor whose rows are `gap` elements apart; then the
          // same with every other element along i.
          ExpectCopiesMatchNaive(rng, Layout({rows, cols}, {1, rows + gap}, elem), 0);
          ExpectCopiesMatchNaive(rng, Layout({rows, cols}, {2, 2 * rows + gap}, elem), 0);
        }
      }
    }
    // The paired dim is dim 0 of three; the middle one is walked around it.
    const int64_t plane = 7 * (tile + 3) * (block + 2);
    ExpectCopiesMatchNaive(
        rng, Layout({tile + 3, 5, block + 2}, {1, plane + 5, 7 * (tile + 3)}, elem), 0);
    // Outer dims: a broadcast (gather only) and a plain one, around a plane.
    ExpectCopiesMatchNaive(rng, Layout({3, 2 * tile + 1, 2, tile + 2}, {0, 1, 4000, 50}, elem), 0);
    ExpectCopiesMatchNaive(rng, Layout({3, 2 * tile + 1, tile + 2}, {2000, 1, 50}, elem), 0);
    // Innermost broadcast and innermost stride with no better dim (gathers).
    ExpectCopiesMatchNaive(rng, Layout({2 * tile + 1, block + 1}, {1, 0}, elem), 0);
    ExpectCopiesMatchNaive(rng, Layout({9, block + 1}, {500, 3}, elem), 0);
    // A permuted 4-D view with dense innermost rows.
    ExpectCopiesMatchNaive(rng, Layout({2, 5, 3, 7}, {105, 7, 35, 1}, elem), 11);
  }
}

TEST(StridedCopyTest, CoalesceAndLinearToOffsetKeepEveryOffset) {
  std::mt19937_64 rng(4);
  for (int iter = 0; iter < 2000; ++iter) {
    int64_t offset = 0;
    int64_t base_numel = 0;
    const StridedLayout layout = iter % 2 ? RandomArbitrary(rng, 2)
                                          : RandomView(rng, 2, iter % 4 == 0, &offset, &base_numel);
    const StridedLayout coalesced = CoalesceLayout(layout);
    ASSERT_EQ(Numel(coalesced), Numel(layout)) << Describe(layout);
    ASSERT_LE(coalesced.ndim, std::max(layout.ndim, 1));
    IndexLayout<uint64_t> wide{};
    IndexLayout<uint32_t> narrow{};
    wide.ndim = narrow.ndim = layout.ndim;
    for (int d = 0; d < layout.ndim; ++d) {
      wide.sizes[d] = static_cast<uint64_t>(layout.sizes[d]);
      wide.strides[d] = static_cast<uint64_t>(layout.strides[d]);
      narrow.sizes[d] = static_cast<uint32_t>(layout.sizes[d]);
      narrow.strides[d] = static_cast<uint32_t>(layout.strides[d]);
    }
    for (int64_t i = 0; i < Numel(layout); ++i) {
      const int64_t expected = NaiveOffset(layout, i);
      ASSERT_EQ(NaiveOffset(coalesced, i), expected)
          << Describe(layout) << " -> " << Describe(coalesced);
      ASSERT_EQ(LinearToOffset<uint64_t>(static_cast<uint64_t>(i), wide),
                static_cast<uint64_t>(expected));
      ASSERT_EQ(LinearToOffset<uint32_t>(static_cast<uint32_t>(i), narrow),
                static_cast<uint32_t>(expected));
    }
  }
  // Dense in any order collapses to one dim; a transpose stays two.
  EXPECT_EQ(CoalesceLayout(Layout({2, 3, 4}, {12, 4, 1})).ndim, 1);
  EXPECT_EQ(CoalesceLayout(Layout({3, 4}, {1, 3})).ndim, 2);
  EXPECT_EQ(CoalesceLayout(Layout({1, 1}, {5, 7})).ndim, 0);
  EXPECT_EQ(CoalesceLayout(Layout({0, 3}, {1, 1})).sizes[0], 0);
}

TEST(StridedCopyTest, ScalarAndEmptyTensors) {
  const uint64_t value = 0x0102030405060708ull;
  uint64_t out = 0;
  const StridedLayout scalar = Layout({}, {}, 8);
  ASSERT_TRUE(GatherCpu(&value, scalar, &out, sizeof(out)).ok());
  EXPECT_EQ(out, value);
  const StridedLayout empty =
      Layout({3, 0, 5}, {0, 0, 0}, 2);  // overlapping strides: nothing written
  EXPECT_TRUE(GatherCpu(nullptr, empty, nullptr, 0).ok());
  EXPECT_TRUE(ScatterCpu(nullptr, 0, nullptr, empty).ok());
}

TEST(StridedLayoutTest, InspectReportsSizes) {
  const absl::StatusOr<LayoutInfo> info = InspectLayout(Layout({3, 4}, {1, 6}, 8));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->numel, 12);
  EXPECT_EQ(info->contiguous_bytes, 96);
  EXPECT_EQ(info->extent_bytes, (2 * 1 + 3 * 6 + 1) * 8);
  const absl::StatusOr<LayoutInfo> empty = InspectLayout(Layout({int64_t{1} << 62, 0}, {1, 1}));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->numel, 0);
  EXPECT_EQ(empty->extent_bytes, 0);
}

TEST(StridedLayoutTest, RejectsInvalidLayouts) {
  auto invalid = [](const StridedLayout& layout) {
    return InspectLayout(layout).status().code() == absl::StatusCode::kInvalidArgument;
  };
  StridedLayout nine = Layout({1, 1, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1, 1});
  nine.ndim = 9;
  EXPECT_TRUE(invalid(nine));
  StridedLayout negative_ndim = Layout({}, {});
  negative_ndim.ndim = -1;
  EXPECT_TRUE(invalid(negative_ndim));
  for (int elem : {0, 3, 5, 16, -4}) EXPECT_TRUE(invalid(Layout({2}, {1}, elem))) << elem;
  EXPECT_TRUE(invalid(Layout({2, -1}, {1, 1})));
  EXPECT_TRUE(invalid(Layout({2, 2}, {-1, 1})));
  const int64_t big = int64_t{1} << 40;
  EXPECT_TRUE(invalid(Layout({big, big}, {1, big})));                               // numel
  EXPECT_TRUE(invalid(Layout({2}, {std::numeric_limits<int64_t>::max() / 2}, 8)));  // extent
  EXPECT_TRUE(invalid(Layout({int64_t{1} << 61}, {1}, 8)));                         // bytes
  EXPECT_TRUE(invalid(Layout({3, 3}, {std::numeric_limits<int64_t>::max() / 2, 1}, 1)));
  EXPECT_TRUE(ValidateLayout(Layout({int64_t{1} << 30, 4}, {4, 1}, 8)).ok());
  std::vector<uint8_t> dst(64);
  const uint8_t src[64] = {};
  EXPECT_EQ(GatherCpu(src, nine, dst.data(), dst.size()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StridedLayoutTest, OverlapCheck) {
  auto ok = [](std::vector<int64_t> sizes, std::vector<int64_t> strides) {
    return CheckNoInternalOverlap(Layout(sizes, strides)).ok();
  };
  EXPECT_TRUE(ok({4, 5}, {5, 1}));
  EXPECT_TRUE(ok({5, 4}, {1, 5}));   // transpose
  EXPECT_TRUE(ok({2, 3}, {20, 3}));  // sliced with steps
  EXPECT_TRUE(ok({1, 3}, {0, 1}));   // stride 0 on a size-1 dim
  EXPECT_TRUE(ok({0, 3}, {0, 0}));   // empty
  EXPECT_TRUE(ok({}, {}));           // scalar
  EXPECT_FALSE(ok({4, 3}, {0, 1}));  // broadcast
  EXPECT_FALSE(ok({2, 2}, {1, 1}));  // offsets 0,1,1,2
  EXPECT_FALSE(ok({3, 4}, {3, 1}));  // rows overlap by one element
  EXPECT_FALSE(ok({3, 3}, {2, 3}));  // does not overlap, but not provably: refused
}

TEST(StridedCopyTest, BadCallsFailAndWriteNothing) {
  const StridedLayout layout = Layout({4, 4}, {8, 1}, 4);
  std::vector<uint8_t> tensor(32 * 4, 0x11);
  std::vector<uint8_t> dense(16 * 4, 0x22);
  EXPECT_EQ(GatherCpu(tensor.data(), layout, dense.data(), dense.size() - 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GatherCpu(nullptr, layout, dense.data(), dense.size()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ScatterCpu(dense.data(), dense.size() - 4, tensor.data(), layout).code(),
            absl::StatusCode::kInvalidArgument);
  // The dense buffer inside the tensor's extent (the gaps would fit it).
  EXPECT_EQ(GatherCpu(tensor.data(), layout, tensor.data() + 16, 64).code(),
            absl::StatusCode::kInvalidArgument);
  const StridedLayout broadcast = Layout({4, 4}, {0, 1}, 4);
  EXPECT_TRUE(GatherCpu(tensor.data(), broadcast, dense.data(), dense.size()).ok());
  std::fill(dense.begin(), dense.end(), 0x22);
  EXPECT_EQ(ScatterCpu(dense.data(), dense.size(), tensor.data(), broadcast).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ScatterCpu(dense.data(), dense.size(), tensor.data(), Layout({4, 4}, {1, 1}, 4)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tensor, std::vector<uint8_t>(32 * 4, 0x11));
  EXPECT_EQ(dense, std::vector<uint8_t>(16 * 4, 0x22));
}

}  // namespace
}  // namespace actstash::kernels
