#include "server/pool/range_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace actstash::server {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

TEST(RangeAllocatorTest, BasicAllocFreeAndRounding) {
  RangeAllocator a(1024, 64);
  EXPECT_EQ(a.capacity(), 1024u);
  EXPECT_EQ(a.granule(), 64u);
  ASSERT_EQ(a.Allocate(1), 0u);
  EXPECT_EQ(a.AllocationSize(0), 64u);
  ASSERT_EQ(a.Allocate(64), 64u);
  EXPECT_EQ(a.Allocate(65), 128u);
  EXPECT_EQ(a.AllocationSize(128), 128u);
  EXPECT_EQ(a.AllocationSize(192), std::nullopt);
  EXPECT_EQ(a.used_bytes(), 256u);
  EXPECT_EQ(a.free_bytes(), 768u);
  EXPECT_EQ(a.allocation_count(), 3u);
  EXPECT_TRUE(a.CheckInvariants());

  a.Free(64);
  EXPECT_EQ(a.AllocationSize(64), std::nullopt);
  EXPECT_EQ(a.used_bytes(), 192u);
  EXPECT_EQ(a.free_block_count(), 2u);
  // The 64-byte hole is the best fit for a 64-byte request.
  EXPECT_EQ(a.Allocate(10), 64u);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, ExactFillThenExhaustionThenReuse) {
  RangeAllocator a(1024, 64);
  for (uint64_t i = 0; i < 16; ++i) ASSERT_EQ(a.Allocate(64), i * 64);
  EXPECT_EQ(a.Allocate(1), std::nullopt);
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_EQ(a.largest_free_block(), 0u);
  EXPECT_EQ(a.free_block_count(), 0u);
  EXPECT_TRUE(a.CheckInvariants());

  a.Free(512);
  EXPECT_EQ(a.Allocate(128), std::nullopt);
  EXPECT_EQ(a.Allocate(64), 512u);
  EXPECT_EQ(a.Allocate(1), std::nullopt);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, CoalescesMiddleLeftRight) {
  RangeAllocator a(4096, 64);
  ASSERT_EQ(a.Allocate(1024), 0u);
  ASSERT_EQ(a.Allocate(1024), 1024u);
  ASSERT_EQ(a.Allocate(2048), 2048u);
  EXPECT_EQ(a.free_block_count(), 0u);

  a.Free(1024);  // Middle.
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 1024u);
  a.Free(0);  // Left: merges with the middle hole.
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 2048u);
  a.Free(2048);  // Right: merges into the whole range.
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 4096u);
  EXPECT_EQ(a.free_bytes(), 4096u);
  EXPECT_EQ(a.allocation_count(), 0u);
  EXPECT_TRUE(a.CheckInvariants());

  // Both neighbours free: one Free joins three blocks.
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(a.Allocate(1024), i * 1024);
  a.Free(0);
  a.Free(2048);
  EXPECT_EQ(a.free_block_count(), 2u);
  a.Free(1024);  // Joins [0,1024) and [2048,3072).
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 3072u);
  a.Free(3072);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 4096u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, BestFitPicksSmallestHoleThenLowestOffset) {
  RangeAllocator a(4096, 64);
  // Holes of 256@0, 128@320, 192@512, 128@768, each followed by a spacer.
  const std::vector<std::pair<uint64_t, uint64_t>> layout = {
      {0, 256},  {256, 64},  {320, 128}, {448, 64},        {512, 192},
      {704, 64}, {768, 128}, {896, 64},  {960, 4096 - 960}};
  for (const auto& [offset, size] : layout) ASSERT_EQ(a.Allocate(size), offset);
  for (uint64_t hole : {0, 320, 512, 768}) a.Free(hole);
  EXPECT_EQ(a.free_block_count(), 4u);

  EXPECT_EQ(a.Allocate(100), 320u);  // 128-byte holes tie; lowest offset wins.
  EXPECT_EQ(a.Allocate(128), 768u);
  EXPECT_EQ(a.Allocate(150), 512u);  // 192 beats the lower-addressed 256.
  EXPECT_EQ(a.Allocate(64), 0u);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 192u);
  EXPECT_EQ(a.Allocate(256), std::nullopt);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, AlignmentPaddingStaysFreeAndIsReusable) {
  RangeAllocator a(8192, 64);
  ASSERT_EQ(a.Allocate(64), 0u);
  ASSERT_EQ(a.Allocate(100, 1024), 1024u);
  EXPECT_EQ(a.AllocationSize(1024), 128u);
  // Padding [64,1024) and tail [1152,8192) are both free.
  EXPECT_EQ(a.free_block_count(), 2u);
  EXPECT_EQ(a.free_bytes(), 8192u - 192u);
  EXPECT_TRUE(a.CheckInvariants());
  // The padding is an exact fit for 960 bytes.
  ASSERT_EQ(a.Allocate(900), 64u);
  EXPECT_EQ(a.free_block_count(), 1u);
  // Aligned offset with no padding needed.
  EXPECT_EQ(a.Allocate(64, 128), 1152u);
  // Alignment beyond the capacity: only offset 0 qualifies, and it is taken.
  EXPECT_EQ(a.Allocate(64, 16384), std::nullopt);
  a.Free(0);
  a.Free(64);
  EXPECT_EQ(a.Allocate(64, 16384), 0u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, AlignedBestFitSkipsSmallHoleThatCannotAlign) {
  RangeAllocator a(8192, 64);
  // Hole A: 320 bytes at 64 (needs 192 padding for 256-alignment -> no fit).
  // Hole B: 512 bytes at 1024 (aligned, fits). Tail fully allocated.
  ASSERT_EQ(a.Allocate(64), 0u);
  ASSERT_EQ(a.Allocate(320), 64u);
  ASSERT_EQ(a.Allocate(640), 384u);
  ASSERT_EQ(a.Allocate(512), 1024u);
  ASSERT_EQ(a.Allocate(8192 - 1536), 1536u);
  a.Free(64);
  a.Free(1024);
  EXPECT_EQ(a.Allocate(256, 256), 1024u);
  EXPECT_EQ(a.free_block_count(), 2u);  // Hole A and [1280,1536).
  // The aligned 256-byte hole at 1280 is smaller than hole A: best fit.
  EXPECT_EQ(a.Allocate(64, 256), 1280u);
  // Now [1344,1536) is smallest but cannot host 256-alignment; hole A can.
  EXPECT_EQ(a.Allocate(64, 256), 256u);
  EXPECT_EQ(a.free_block_count(), 3u);  // [64,256), [320,384), [1344,1536).
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, FragmentationBlocksLargeRequest) {
  RangeAllocator a(4096, 64);
  for (uint64_t i = 0; i < 32; ++i) ASSERT_EQ(a.Allocate(128), i * 128);
  for (uint64_t i = 0; i < 32; i += 2) a.Free(i * 128);
  EXPECT_EQ(a.free_bytes(), 2048u);
  EXPECT_EQ(a.free_block_count(), 16u);
  EXPECT_EQ(a.largest_free_block(), 128u);
  EXPECT_EQ(a.Allocate(192), std::nullopt);  // 2048 bytes free, but no run of 192.
  EXPECT_EQ(a.Allocate(128), 0u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(RangeAllocatorTest, HugeSizesDoNotWrap) {
  RangeAllocator a(4096, 64);
  EXPECT_EQ(a.Allocate(kMax), std::nullopt);
  EXPECT_EQ(a.Allocate(kMax - 62), std::nullopt);
  EXPECT_EQ(a.Allocate(4097), std::nullopt);
  EXPECT_EQ(a.Allocate(kMax, uint64_t{1} << 63), std::nullopt);
  EXPECT_EQ(a.allocation_count(), 0u);
  EXPECT_EQ(a.Allocate(4096), 0u);

  // A capacity at the top of the 64-bit range.
  const uint64_t cap = kMax - 4095;
  RangeAllocator big(cap, 4096);
  EXPECT_EQ(big.Allocate(kMax), std::nullopt);
  ASSERT_EQ(big.Allocate(cap - 1), 0u);
  EXPECT_EQ(big.AllocationSize(0), cap);
  big.Free(0);
  EXPECT_EQ(big.Allocate(1, uint64_t{1} << 63), 0u);
  EXPECT_EQ(big.Allocate(1, uint64_t{1} << 63), uint64_t{1} << 63);
  EXPECT_EQ(big.Allocate(1, uint64_t{1} << 63), std::nullopt);
  EXPECT_EQ(big.Allocate(cap - 8192), std::nullopt);
  EXPECT_EQ(big.Allocate((uint64_t{1} << 63) - 4096), 4096u);
  EXPECT_EQ(big.free_bytes(), (uint64_t{1} << 63) - 8192);
  EXPECT_TRUE(big.CheckInvariants());
}

TEST(RangeAllocatorDeathTest, BrokenInvariantsAbort) {
  RangeAllocator a(1024, 64);
  ASSERT_EQ(a.Allocate(256), 0u);
  EXPECT_DEATH(a.Free(512), "CHECK failed.*not the start of a live allocation");
  EXPECT_DEATH(a.Free(64), "CHECK failed");  // Inside an allocation.
  a.Free(0);
  EXPECT_DEATH(a.Free(0), "CHECK failed");  // Double free.
  EXPECT_DEATH(RangeAllocator(1024, 48), "granule");
  EXPECT_DEATH(RangeAllocator(1000, 64), "multiple of granule");
  EXPECT_DEATH(RangeAllocator(0, 64), "capacity");
  EXPECT_DEATH(a.Allocate(0), "size must be > 0");
  EXPECT_DEATH(a.Allocate(64, 32), "alignment");
  EXPECT_DEATH(a.Allocate(64, 96), "alignment");
}

// ---------------------------------------------------------------------------
// Randomized comparison against a reference model: one bool per granule.

enum class FreeOrder { kLifo, kFifo, kRandom };
constexpr const char* kOrderNames[] = {"Lifo", "Fifo", "Random"};

using Run = std::pair<uint64_t, uint64_t>;  // (offset, size)

// Maximal free runs of the bitmap, in offset order.
std::vector<Run> FreeRuns(const std::vector<bool>& used, uint64_t granule) {
  std::vector<Run> runs;
  for (size_t i = 0; i < used.size(); ++i) {
    if (used[i]) continue;
    size_t j = i;
    while (j < used.size() && !used[j]) ++j;
    runs.push_back({i * granule, (j - i) * granule});
    i = j;  // used[j] is set (or j is the end); the loop's ++i skips it.
  }
  return runs;
}

// Best fit by brute force: smallest run that holds the aligned request, lowest
// offset on ties (runs arrive in offset order, so the first one seen wins).
std::optional<uint64_t> ExpectedOffset(const std::vector<Run>& runs, uint64_t rounded,
                                       uint64_t alignment) {
  std::optional<uint64_t> best;
  uint64_t best_size = 0;
  for (const auto& [offset, size] : runs) {
    const uint64_t aligned = (offset + alignment - 1) / alignment * alignment;
    if (aligned - offset + rounded <= size && (!best || size < best_size)) {
      best = aligned;
      best_size = size;
    }
  }
  return best;
}

int FuzzOps() {
  const char* env = std::getenv("ACTSTASH_RA_FUZZ_OPS");
  return env != nullptr ? std::atoi(env) : 20000;
}

void RunFuzz(uint32_t seed, FreeOrder order, uint64_t capacity, uint64_t granule) {
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  // Mostly small sizes, some large, 1% far beyond the capacity.
  auto random_size = [&]() -> uint64_t {
    const uint64_t kind = uniform(0, 99);
    if (kind < 80) return uniform(1, 1024);
    if (kind < 95) return uniform(1, 16384);
    if (kind < 99) return uniform(1, capacity);
    const uint64_t huge[] = {kMax, kMax - 1, kMax - granule + 2, capacity + 1,
                             capacity + uniform(1, 1 << 20)};
    return huge[uniform(0, 4)];
  };
  // Half default, half 64 B..128 KiB (beyond the capacity), rarely 2^63.
  auto random_alignment = [&]() -> uint64_t {
    const uint64_t kind = uniform(0, 99);
    if (kind < 50) return 0;
    return uint64_t{1} << (kind < 99 ? uniform(6, 17) : 63);
  };
  auto round_up = [granule](uint64_t size) { return (size + granule - 1) / granule * granule; };

  RangeAllocator a(capacity, granule);
  std::vector<bool> ref(capacity / granule, false);
  auto mark = [&ref, granule](uint64_t offset, uint64_t size, bool used) {
    for (uint64_t g = offset / granule; g < (offset + size) / granule; ++g) {
      ASSERT_NE(ref[g], used) << "granule " << g;
      ref[g] = used;
    }
  };
  std::vector<std::pair<uint64_t, uint64_t>> live;  // (offset, size), oldest first.
  uint64_t used = 0;
  std::vector<Run> runs = FreeRuns(ref, granule);
  int alloc_percent = 60;

  for (int op = 0, ops = FuzzOps(); op < ops; ++op) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " op " + std::to_string(op));
    if (op % 1000 == 0) alloc_percent = static_cast<int>(uniform(35, 75));
    if (live.empty() || static_cast<int>(uniform(0, 99)) < alloc_percent) {
      const uint64_t size = random_size();
      const uint64_t alignment = random_alignment();
      const uint64_t eff_alignment = alignment == 0 ? granule : alignment;
      // A quarter of the requests keep to a random window (a NUMA node's
      // part), its ends anywhere: the reference clips the free runs to it.
      const bool windowed = uniform(0, 3) == 0;
      const uint64_t begin = windowed ? uniform(0, capacity) : 0;
      const uint64_t end = windowed ? uniform(begin, capacity + granule) : capacity;
      std::vector<Run> clipped;
      uint64_t free_inside = 0;
      for (const auto& [offset, run_size] : runs) {
        const uint64_t from = std::max(offset, begin);
        const uint64_t to = std::min(offset + run_size, end);
        if (to > from) {
          clipped.push_back({from, to - from});
          free_inside += to - from;
        }
      }
      if (windowed) {
        ASSERT_EQ(a.FreeBytesWithin(begin, end), free_inside);
      }
      const std::optional<uint64_t> got =
          windowed ? a.AllocateWithin(size, alignment, begin, end) : a.Allocate(size, alignment);
      const std::optional<uint64_t> want =
          size > capacity ? std::nullopt : ExpectedOffset(clipped, round_up(size), eff_alignment);
      ASSERT_EQ(got, want) << "size " << size << " alignment " << eff_alignment << " window ["
                           << begin << ", " << end << ")";
      if (got) {
        const uint64_t rounded = round_up(size);
        ASSERT_EQ(a.AllocationSize(*got), rounded);
        ASSERT_EQ(*got % eff_alignment, 0u);
        ASSERT_LE(rounded, capacity - *got);
        mark(*got, rounded, true);  // Fails on overlap with a live range.
        live.emplace_back(*got, rounded);
        used += rounded;
      }
    } else {
      size_t index = 0;
      if (order == FreeOrder::kLifo) index = live.size() - 1;
      if (order == FreeOrder::kRandom) index = uniform(0, live.size() - 1);
      const auto [offset, size] = live[index];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
      ASSERT_EQ(a.AllocationSize(offset), size);
      a.Free(offset);
      ASSERT_EQ(a.AllocationSize(offset), std::nullopt);
      mark(offset, size, false);
      used -= size;
    }
    if (::testing::Test::HasFatalFailure()) return;

    runs = FreeRuns(ref, granule);
    uint64_t largest = 0;
    for (const auto& run : runs) largest = std::max(largest, run.second);
    ASSERT_EQ(a.used_bytes(), used);
    ASSERT_EQ(a.free_bytes(), capacity - used);
    ASSERT_EQ(a.largest_free_block(), largest);
    ASSERT_EQ(a.free_block_count(), runs.size());
    ASSERT_EQ(a.allocation_count(), live.size());
    ASSERT_TRUE(a.CheckInvariants());
  }

  for (const auto& [offset, size] : live) a.Free(offset);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), capacity);
  EXPECT_TRUE(a.CheckInvariants());
}

// A NUMA node's part of a pool: the range lies inside the window even when a
// better fit exists outside it, and a window with no room says so.
TEST(RangeAllocatorTest, AllocateWithinKeepsToTheWindow) {
  RangeAllocator a(4096, 64);
  // Windows [0, 2048) and [2048, 4096), as two nodes of a split pool.
  ASSERT_EQ(a.AllocateWithin(1024, 1024, 2048, 4096), 2048u);
  ASSERT_EQ(a.AllocateWithin(64, 0, 2048, 4096), 3072u);
  EXPECT_EQ(a.FreeBytesWithin(0, 2048), 2048u);
  EXPECT_EQ(a.FreeBytesWithin(2048, 4096), 1024u - 64u);
  // The free block [3136, 4096) fits 512 best overall, but not in [0, 2048).
  EXPECT_EQ(a.AllocateWithin(512, 0, 0, 2048), 0u);
  EXPECT_EQ(a.AllocateWithin(2048, 0, 2048, 4096), std::nullopt);
  EXPECT_EQ(a.AllocateWithin(1024, 1024, 2048, 4096), std::nullopt);  // 960 bytes free there
  // A free block that straddles the window's start is used from the start on.
  RangeAllocator b(4096, 64);
  ASSERT_EQ(b.Allocate(64), 0u);
  EXPECT_EQ(b.AllocateWithin(256, 0, 1024, 2048), 1024u);
  EXPECT_EQ(b.FreeBytesWithin(0, 4096), b.free_bytes());
  EXPECT_EQ(b.FreeBytesWithin(1024, 2048), 1024u - 256u);
  // Best fit inside the window: the smaller of two holes that fit.
  RangeAllocator c(4096, 64);
  for (uint64_t i = 0; i < 64; ++i) ASSERT_EQ(c.Allocate(64), i * 64);
  for (uint64_t off : {1024u, 1088u, 1152u, 1280u, 1344u}) c.Free(off);  // holes 192 and 128
  EXPECT_EQ(c.AllocateWithin(100, 0, 1024, 2048), 1280u);
  EXPECT_EQ(c.AllocateWithin(100, 0, 1024, 2048), 1024u);
  EXPECT_EQ(c.AllocateWithin(100, 0, 1024, 2048), std::nullopt);  // 64 left
  // Empty and out-of-range windows fit nothing; no arithmetic wraps.
  EXPECT_EQ(a.AllocateWithin(64, 0, 4096, kMax), std::nullopt);
  EXPECT_EQ(a.AllocateWithin(64, 0, 100, 100), std::nullopt);
  EXPECT_EQ(a.AllocateWithin(kMax, 0, 0, kMax), std::nullopt);
  EXPECT_EQ(a.FreeBytesWithin(4096, kMax), 0u);
  EXPECT_TRUE(a.CheckInvariants());
  EXPECT_TRUE(b.CheckInvariants());
  EXPECT_TRUE(c.CheckInvariants());
}

using FuzzParam = std::tuple<uint32_t, FreeOrder>;
class RangeAllocatorFuzzTest : public ::testing::TestWithParam<FuzzParam> {};

TEST_P(RangeAllocatorFuzzTest, MatchesReferenceModel) {
  RunFuzz(std::get<0>(GetParam()), std::get<1>(GetParam()), 64 * 1024, 64);
}

INSTANTIATE_TEST_SUITE_P(SeedsAndOrders, RangeAllocatorFuzzTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u),
                                            ::testing::Values(FreeOrder::kLifo, FreeOrder::kFifo,
                                                              FreeOrder::kRandom)),
                         [](const ::testing::TestParamInfo<FuzzParam>& param_info) {
                           return "Seed" + std::to_string(std::get<0>(param_info.param)) +
                                  kOrderNames[static_cast<int>(std::get<1>(param_info.param))];
                         });

TEST(RangeAllocatorFuzzOddCapacityTest, MatchesReferenceModel) {
  RunFuzz(7, FreeOrder::kRandom, 963 * 64, 64);  // Not a power of two.
}

}  // namespace
}  // namespace actstash::server
