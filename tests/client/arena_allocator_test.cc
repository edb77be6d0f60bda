// Unit tests of ArenaAllocator: placement policy, hole handling, bad frees, and
// a randomized comparison against a bitmap reference model.
//
// Environment: ACTSTASH_ARENA_TEST_OPS (ops per randomized run, default 20000)
// and ACTSTASH_ARENA_BENCH_ITERS (default 1000000) shrink the run, e.g. under
// valgrind.
#include "client/store/arena_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// Counts heap allocations, to check that the LIFO path does not allocate.
// (noinline: GCC's -Wmismatched-new-delete would see malloc/free through them.)
namespace {
std::atomic<uint64_t> g_new_calls{0};
}  // namespace

__attribute__((noinline)) void* operator new(std::size_t n) {
  g_new_calls.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace actstash::client_internal {
namespace {

constexpr uint64_t kKiB = 1024;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::strtoull(value, nullptr, 10) : fallback;
}

// Everything observable about an allocator, to check "state unchanged".
struct Snapshot {
  uint64_t used, top, largest_free, hole_bytes;
  size_t live, holes;
  bool empty;
  bool operator==(const Snapshot& o) const {
    return std::tie(used, top, largest_free, hole_bytes, live, holes, empty) ==
           std::tie(o.used, o.top, o.largest_free, o.hole_bytes, o.live, o.holes, o.empty);
  }
};

Snapshot Snap(const ArenaAllocator& a) {
  return {a.used_bytes(),  a.top(),        a.largest_free(), a.hole_bytes(),
          a.live_blocks(), a.hole_count(), a.empty()};
}

// Allocates blocks of the given sizes; every allocation must succeed.
std::vector<uint64_t> AllocAll(ArenaAllocator& a, const std::vector<uint64_t>& sizes) {
  std::vector<uint64_t> offsets;
  for (uint64_t size : sizes) {
    std::optional<uint64_t> offset = a.Allocate(size);
    EXPECT_TRUE(offset.has_value()) << "size " << size;
    offsets.push_back(offset.value_or(~uint64_t{0}));
  }
  return offsets;
}

TEST(ArenaAllocatorTest, FreshArena) {
  ArenaAllocator a(64 * kKiB);
  EXPECT_EQ(a.capacity(), 64 * kKiB);
  EXPECT_EQ(a.alignment(), 64u);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.top(), 0u);
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.hole_count(), 0u);
  EXPECT_EQ(a.largest_free(), 64 * kKiB);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, LifoReturnsTopStepByStepAndNeverMakesHoles) {
  ArenaAllocator a(4096 * kKiB);
  std::vector<uint64_t> offsets, tops;
  for (uint64_t i = 0; i < 200; ++i) {
    std::optional<uint64_t> offset = a.Allocate(1 + i * 37);
    ASSERT_TRUE(offset.has_value());
    EXPECT_EQ(*offset, a.top() - ((1 + i * 37 + 63) / 64) * 64);  // bump placement
    offsets.push_back(*offset);
    tops.push_back(a.top());
    EXPECT_EQ(a.hole_count(), 0u);
  }
  for (size_t i = offsets.size(); i-- > 0;) {
    EXPECT_EQ(a.top(), tops[i]);
    ASSERT_TRUE(a.Free(offsets[i]));
    EXPECT_EQ(a.top(), offsets[i]);  // exactly where that block started
    EXPECT_EQ(a.used_bytes(), a.top());
    EXPECT_EQ(a.hole_count(), 0u);
    EXPECT_EQ(a.live_blocks(), i);
    ASSERT_TRUE(a.CheckInvariants());
  }
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.top(), 0u);
}

TEST(ArenaAllocatorTest, NonLifoFreeMakesHoleThatTopFreeCollapses) {
  ArenaAllocator a(64 * kKiB);
  std::vector<uint64_t> o = AllocAll(a, {64, 64, 64});
  ASSERT_TRUE(a.Free(o[1]));
  EXPECT_EQ(a.hole_count(), 1u);
  EXPECT_EQ(a.hole_bytes(), 64u);
  EXPECT_EQ(a.top(), 192u);
  EXPECT_EQ(a.used_bytes(), 128u);
  EXPECT_TRUE(a.CheckInvariants());
  ASSERT_TRUE(a.Free(o[2]));  // the top goes, and the hole below it with it
  EXPECT_EQ(a.top(), 64u);
  EXPECT_EQ(a.hole_count(), 0u);
  EXPECT_EQ(a.used_bytes(), 64u);
  EXPECT_TRUE(a.CheckInvariants());
  ASSERT_TRUE(a.Free(o[0]));
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.top(), 0u);
}

TEST(ArenaAllocatorTest, TopFreeCollapsesThroughBurstOfNonLifoFrees) {
  ArenaAllocator a(64 * kKiB);
  std::vector<uint64_t> o = AllocAll(a, {64, 128, 64, 256, 64, 64});
  for (int i : {1, 3, 4}) ASSERT_TRUE(a.Free(o[i]));  // holes [64,192) and [256,576)
  EXPECT_EQ(a.hole_count(), 2u);
  EXPECT_EQ(a.top(), 640u);
  ASSERT_TRUE(a.Free(o[5]));  // collapses to the end of o[2]
  EXPECT_EQ(a.top(), 256u);
  EXPECT_EQ(a.hole_count(), 1u);
  ASSERT_TRUE(a.Free(o[2]));  // then through [64,192) to the end of o[0]
  EXPECT_EQ(a.top(), 64u);
  EXPECT_EQ(a.hole_count(), 0u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, AdjacentHolesCoalesce) {
  struct Case {
    const char* name;
    std::vector<int> frees;  // indices into blocks A..F (F stays on top)
    uint64_t hole_offset, hole_size;
  };
  for (const Case& c :
       {Case{"merge left", {1, 2}, 64, 128}, Case{"merge right", {2, 1}, 64, 128},
        Case{"merge both", {1, 3, 2}, 64, 192}, Case{"merge both, wide", {1, 2, 4, 3}, 64, 256}}) {
    SCOPED_TRACE(c.name);
    ArenaAllocator a(64 * kKiB);
    std::vector<uint64_t> o = AllocAll(a, {64, 64, 64, 64, 64, 64});
    for (int i : c.frees) {
      ASSERT_TRUE(a.Free(o[i]));
      ASSERT_TRUE(a.CheckInvariants());
    }
    EXPECT_EQ(a.hole_count(), 1u);
    EXPECT_EQ(a.hole_bytes(), c.hole_size);
    // The merged hole is reused as one range: a request of its full size lands
    // at its start once the top region is exhausted.
    ASSERT_EQ(a.Allocate(a.capacity() - a.top()), 384u);
    EXPECT_EQ(a.Allocate(c.hole_size), c.hole_offset);
    EXPECT_EQ(a.hole_count(), 0u);
    EXPECT_EQ(a.used_bytes(), a.capacity());
  }
}

TEST(ArenaAllocatorTest, TopRegionIsPreferredOverHoles) {
  ArenaAllocator a(1 * kKiB);
  std::vector<uint64_t> o = AllocAll(a, {64, 64, 64});
  ASSERT_TRUE(a.Free(o[0]));                // hole [0,64)
  EXPECT_EQ(a.Allocate(64), 192u);          // top fits: top wins
  EXPECT_EQ(a.Allocate(1024 - 256), 256u);  // fill the top region exactly
  EXPECT_EQ(a.largest_free(), 64u);
  EXPECT_EQ(a.Allocate(64), 0u);  // now the hole is used
  EXPECT_EQ(a.Allocate(1), std::nullopt);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, HolesAreSearchedFirstFitLowestAddressFirst) {
  ArenaAllocator a(1 * kKiB);
  // A[0,128) B[128,192) C[192,448) D[448,512) E[512,576) F[576,1024)
  std::vector<uint64_t> o = AllocAll(a, {128, 64, 256, 64, 64, 448});
  for (int i : {0, 2, 4}) ASSERT_TRUE(a.Free(o[i]));
  ASSERT_EQ(a.hole_count(), 3u);
  EXPECT_EQ(a.largest_free(), 256u);
  EXPECT_EQ(a.Allocate(64), 0u);     // lowest hole, though E is an exact fit
  EXPECT_EQ(a.Allocate(128), 192u);  // [64,128) too small: next hole
  EXPECT_EQ(a.Allocate(512), std::nullopt);
  EXPECT_EQ(a.Allocate(64), 64u);  // rest of the first hole, now consumed
  EXPECT_EQ(a.hole_count(), 2u);
  EXPECT_EQ(a.Allocate(128), 320u);  // [320,448) exactly
  EXPECT_EQ(a.Allocate(64), 512u);
  EXPECT_EQ(a.hole_count(), 0u);
  EXPECT_EQ(a.used_bytes(), 1024u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, ExhaustionAndHugeSizesReturnNullopt) {
  ArenaAllocator a(1 * kKiB);
  const Snapshot fresh = Snap(a);
  for (uint64_t size :
       {UINT64_MAX, UINT64_MAX - 63, UINT64_MAX / 2 + 1, uint64_t{1025}, uint64_t{1024} + 64}) {
    EXPECT_EQ(a.Allocate(size), std::nullopt) << size;
    EXPECT_EQ(Snap(a), fresh);
  }
  EXPECT_EQ(a.Allocate(1024), 0u);  // the whole arena
  EXPECT_EQ(a.Allocate(0), std::nullopt);
  ASSERT_TRUE(a.Free(0));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(a.Allocate(64), uint64_t(i) * 64);
  EXPECT_EQ(a.Allocate(1), std::nullopt);
  EXPECT_EQ(a.largest_free(), 0u);
  ASSERT_TRUE(a.Free(15 * 64));
  EXPECT_EQ(a.Allocate(33), 15u * 64);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, SizesAreRoundedAndOffsetsAligned) {
  ArenaAllocator a(64 * kKiB);
  EXPECT_EQ(a.Allocate(1), 0u);
  EXPECT_EQ(a.used_bytes(), 64u);
  EXPECT_EQ(a.Allocate(64), 64u);
  EXPECT_EQ(a.Allocate(65), 128u);
  EXPECT_EQ(a.used_bytes(), 256u);
  EXPECT_EQ(a.Allocate(0), 256u);  // one alignment unit, a real block
  EXPECT_EQ(a.used_bytes(), 320u);
  EXPECT_EQ(a.live_blocks(), 4u);
  EXPECT_TRUE(a.Free(256));
  EXPECT_EQ(a.top(), 256u);

  ArenaAllocator page(1024 * kKiB, 4096);
  for (uint64_t size : {1, 4095, 4096, 4097, 0, 10000}) {
    std::optional<uint64_t> offset = page.Allocate(size);
    ASSERT_TRUE(offset.has_value());
    EXPECT_EQ(*offset % 4096, 0u);
  }
  EXPECT_EQ(page.used_bytes(), 4096u * (1 + 1 + 1 + 2 + 1 + 3));

  ArenaAllocator bytes(100, 1);
  EXPECT_EQ(bytes.Allocate(3), 0u);
  EXPECT_EQ(bytes.Allocate(0), 3u);
  EXPECT_EQ(bytes.Allocate(96), 4u);
  EXPECT_EQ(bytes.Allocate(1), std::nullopt);
  EXPECT_TRUE(bytes.CheckInvariants());
}

TEST(ArenaAllocatorTest, BadFreesReturnFalseAndChangeNothing) {
  ArenaAllocator a(64 * kKiB);
  EXPECT_FALSE(a.Free(0));  // empty arena
  std::vector<uint64_t> o = AllocAll(a, {64, 64, 64, 64, 192, 128});
  ASSERT_TRUE(a.Free(o[1]));  // hole [64,128): a tombstone record
  const Snapshot before = Snap(a);
  for (uint64_t bad : {o[1],                 // double free of a non-top block
                       o[4] + 64, o[4] + 1,  // interior of a block, aligned or not
                       a.top(), a.top() + 64, a.capacity(), UINT64_MAX,  // beyond top
                       uint64_t{1}, o[5] + 127}) {
    EXPECT_FALSE(a.Free(bad)) << bad;
    EXPECT_EQ(Snap(a), before) << bad;
    EXPECT_TRUE(a.CheckInvariants());
  }
  ASSERT_TRUE(a.Free(o[5]));
  const Snapshot after_top = Snap(a);
  EXPECT_FALSE(a.Free(o[5]));  // double free of the (former) top block
  EXPECT_EQ(Snap(a), after_top);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, ReusedHoleRecordsDoNotConfuseFree) {
  ArenaAllocator a(1 * kKiB);
  std::vector<uint64_t> o = AllocAll(a, {64, 64, 64, 64, 1024 - 256});
  for (int i : {0, 1, 2}) ASSERT_TRUE(a.Free(o[i]));  // hole [0,192), three records
  EXPECT_EQ(a.Allocate(192), 0u);                     // one block over all three
  const Snapshot before = Snap(a);
  EXPECT_FALSE(a.Free(64));  // old starts, now inside the new block
  EXPECT_FALSE(a.Free(128));
  EXPECT_EQ(Snap(a), before);
  ASSERT_TRUE(a.Free(o[4]));  // collapse down to the end of o[3]
  EXPECT_EQ(a.top(), 256u);
  EXPECT_TRUE(a.Free(0));
  EXPECT_EQ(a.Allocate(64), 256u);  // top fits again
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, LongFifoRunStaysConsistent) {
  ArenaAllocator a(1024 * kKiB);
  std::vector<uint64_t> offsets;
  for (int i = 0; i < 2000; ++i) offsets.push_back(*a.Allocate(64 + (i % 5) * 64));
  for (int i = 0; i + 1 < 2000; ++i) {
    ASSERT_TRUE(a.Free(offsets[i]));  // oldest first: one growing hole
    ASSERT_EQ(a.hole_count(), 1u);
    if (i % 97 == 0) {
      ASSERT_TRUE(a.CheckInvariants());
    }
  }
  EXPECT_TRUE(a.CheckInvariants());
  EXPECT_FALSE(a.Free(offsets[0]));
  EXPECT_FALSE(a.Free(offsets[1000]));
  EXPECT_EQ(a.live_blocks(), 1u);
  ASSERT_TRUE(a.Free(offsets.back()));
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.hole_count(), 0u);
  EXPECT_TRUE(a.CheckInvariants());
}

TEST(ArenaAllocatorTest, ResetAndMove) {
  ArenaAllocator a(1 * kKiB);
  std::vector<uint64_t> o = AllocAll(a, {64, 64, 64});
  ASSERT_TRUE(a.Free(o[1]));
  std::vector<ArenaAllocator> arenas;
  arenas.push_back(std::move(a));
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a.top(), 0u);
  EXPECT_EQ(a.hole_count(), 0u);
  arenas.emplace_back(2 * kKiB);  // reallocation moves the first one again
  ArenaAllocator& moved = arenas[0];
  EXPECT_EQ(moved.capacity(), 1 * kKiB);
  EXPECT_EQ(moved.top(), 192u);
  EXPECT_EQ(moved.hole_count(), 1u);
  EXPECT_TRUE(moved.CheckInvariants());
  ArenaAllocator other(4 * kKiB);
  other = std::move(moved);
  EXPECT_TRUE(moved.empty());  // NOLINT(bugprone-use-after-move): left empty, usable
  EXPECT_TRUE(moved.CheckInvariants());
  EXPECT_EQ(moved.Allocate(1 * kKiB), 0u);
  EXPECT_EQ(other.capacity(), 1 * kKiB);
  EXPECT_TRUE(other.Free(o[2]));
  EXPECT_EQ(other.top(), 64u);
  other.Reset();
  EXPECT_TRUE(other.empty());
  EXPECT_EQ(other.top(), 0u);
  EXPECT_EQ(other.hole_count(), 0u);
  EXPECT_FALSE(other.Free(o[0]));
  EXPECT_EQ(other.Allocate(1 * kKiB), 0u);
  EXPECT_TRUE(other.CheckInvariants());
}

TEST(ArenaAllocatorDeathTest, ConstructorChecksArguments) {
  EXPECT_DEATH(ArenaAllocator(1024, 48), "CHECK failed.*power of two");
  EXPECT_DEATH(ArenaAllocator(1024, 0), "CHECK failed.*power of two");
  EXPECT_DEATH(ArenaAllocator(0, 64), "CHECK failed.*positive");
  EXPECT_DEATH(ArenaAllocator(1000, 64), "CHECK failed.*multiple");
}

TEST(ArenaAllocatorTest, LifoSteadyStateDoesNotAllocate) {
  const uint64_t before_probe = g_new_calls.load();
  static void* volatile probe;
  probe = ::operator new(16);  // a call, not a new-expression: not elided
  ::operator delete(probe);
  if (g_new_calls.load() == before_probe) GTEST_SKIP() << "operator new not counted here";
  ArenaAllocator a(64 * 1024 * kKiB);
  std::vector<uint64_t> stack;
  stack.reserve(512);
  auto round = [&](int depth) {
    for (int i = 0; i < depth; ++i) stack.push_back(*a.Allocate(4096 + 64 * (i % 7)));
    while (!stack.empty()) {
      a.Free(stack.back());
      stack.pop_back();
    }
  };
  round(512);  // warm-up: the records grow to the peak depth
  const uint64_t start = g_new_calls.load();
  for (int r = 0; r < 200; ++r) round(1 + r % 512);
  EXPECT_EQ(g_new_calls.load() - start, 0u);
  EXPECT_TRUE(a.empty());
}

TEST(ArenaAllocatorTest, PrintLifoAllocateFreeCost) {
  const uint64_t iters = std::max<uint64_t>(1, EnvOr("ACTSTASH_ARENA_BENCH_ITERS", 1000000));
  ArenaAllocator a(256 * 1024 * kKiB);
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(a.Allocate(64 * kKiB).has_value());
  uint64_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < iters; ++i) {
    const uint64_t offset = *a.Allocate(4096 + (i & 7) * 64);
    sink += offset;
    a.Free(offset);
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ bench    ] LIFO Allocate+Free: %.1f ns/pair over %llu pairs (sink %llu)\n",
              ns / iters, static_cast<unsigned long long>(iters),
              static_cast<unsigned long long>(sink % 7));
  EXPECT_EQ(a.live_blocks(), 16u);
  EXPECT_TRUE(a.CheckInvariants());
}

// ---------------------------------------------------------------------------
// Randomized comparison with a reference model: a bitmap of alignment units
// plus a map of live blocks, from which top, holes and the expected placement
// (top region first, else the lowest maximal free run that fits) are derived.

class Model {
 public:
  Model(uint64_t capacity, uint64_t alignment)
      : capacity_(capacity), alignment_(alignment), unit_used_(capacity / alignment) {}

  uint64_t Top() const {
    return live_.empty() ? 0 : live_.rbegin()->first + live_.rbegin()->second;
  }
  uint64_t Used() const { return used_; }
  size_t Live() const { return live_.size(); }

  // Maximal free runs below Top(), lowest first: {offset, size}.
  std::vector<std::pair<uint64_t, uint64_t>> Holes() const {
    std::vector<std::pair<uint64_t, uint64_t>> holes;
    const uint64_t top_units = Top() / alignment_;
    for (uint64_t u = 0; u < top_units;) {
      if (unit_used_[u]) {
        ++u;
        continue;
      }
      uint64_t v = u;
      while (v < top_units && !unit_used_[v]) ++v;
      holes.emplace_back(u * alignment_, (v - u) * alignment_);
      u = v;
    }
    return holes;
  }

  uint64_t LargestFree() const {
    uint64_t largest = capacity_ - Top();
    for (const auto& hole : Holes()) largest = std::max(largest, hole.second);
    return largest;
  }

  std::optional<uint64_t> Predict(uint64_t size) const {
    if (size > capacity_) return std::nullopt;
    const uint64_t rounded = Round(size);
    if (capacity_ - Top() >= rounded) return Top();
    for (const auto& hole : Holes()) {
      if (hole.second >= rounded) return hole.first;
    }
    return std::nullopt;
  }

  uint64_t Round(uint64_t size) const {
    return size == 0 ? alignment_ : (size + alignment_ - 1) / alignment_ * alignment_;
  }

  // False when [offset, offset+size) overlaps a live block or leaves the arena.
  bool Take(uint64_t offset, uint64_t size) {
    if (offset % alignment_ != 0 || offset > capacity_ || size > capacity_ - offset) return false;
    for (uint64_t u = offset / alignment_; u < (offset + size) / alignment_; ++u) {
      if (unit_used_[u]) return false;
      unit_used_[u] = true;
    }
    live_[offset] = size;
    used_ += size;
    return true;
  }

  bool IsLive(uint64_t offset) const { return live_.count(offset) != 0; }

  bool Release(uint64_t offset) {
    auto it = live_.find(offset);
    if (it == live_.end()) return false;
    for (uint64_t u = offset / alignment_; u < (offset + it->second) / alignment_; ++u) {
      unit_used_[u] = false;
    }
    used_ -= it->second;
    live_.erase(it);
    return true;
  }

 private:
  uint64_t capacity_, alignment_, used_ = 0;
  std::vector<bool> unit_used_;
  std::map<uint64_t, uint64_t> live_;
};

enum class FreeOrder { kLifoBiased, kFifo, kRandom };

class ArenaAllocatorModelTest : public ::testing::TestWithParam<std::tuple<uint32_t, FreeOrder>> {};

TEST_P(ArenaAllocatorModelTest, MatchesReferenceModel) {
  const auto [seed, order] = GetParam();
  constexpr uint64_t kCapacity = 64 * kKiB, kAlign = 64;
  constexpr uint64_t kHuge[] = {UINT64_MAX, kCapacity + 1, UINT64_MAX - 63};
  const uint64_t ops = EnvOr("ACTSTASH_ARENA_TEST_OPS", 20000);
  std::mt19937_64 rng(seed);
  auto uniform = [&](uint64_t lo, uint64_t hi) {  // inclusive
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  ArenaAllocator arena(kCapacity, kAlign);
  Model model(kCapacity, kAlign);
  std::vector<uint64_t> live;  // offsets in creation order
  std::vector<uint64_t> freed_recently;
  uint64_t into_holes = 0, failed = 0, bad_frees = 0, collapses = 0;

  for (uint64_t op = 0; op < ops; ++op) {
    const bool filling = (op / 600) % 2 == 0;  // alternate fill and drain phases
    const uint64_t roll = uniform(0, 99);
    if (roll < 3) {  // a bad free: double free, interior or random offset
      uint64_t bad = uniform(0, kCapacity + 256);
      if (roll == 0 && !freed_recently.empty()) {
        bad = freed_recently[uniform(0, freed_recently.size() - 1)];
      }
      if (roll == 1 && !live.empty()) bad = live[uniform(0, live.size() - 1)] + uniform(1, 63);
      if (!model.IsLive(bad)) {
        const Snapshot before = Snap(arena);
        ASSERT_FALSE(arena.Free(bad)) << "op " << op << " offset " << bad;
        ASSERT_EQ(Snap(arena), before);
        ++bad_frees;
      }
    } else if (live.empty() || roll < (filling ? 65u : 38u)) {
      const uint64_t kind = uniform(0, 99);  // 4% size 0, 3% huge, else up to 2K/8K/24K
      const uint64_t size = kind < 4    ? 0
                            : kind < 7  ? kHuge[kind - 4]
                            : kind < 70 ? uniform(1, 2048)
                            : kind < 95 ? uniform(1, 8192)
                                        : uniform(1, 24 * kKiB);
      const std::optional<uint64_t> expected = model.Predict(size);
      const std::optional<uint64_t> got = arena.Allocate(size);
      ASSERT_EQ(got, expected) << "op " << op << " size " << size;
      if (got) {
        ASSERT_EQ(*got % kAlign, 0u);
        if (*got < model.Top()) ++into_holes;
        ASSERT_TRUE(model.Take(*got, model.Round(size))) << "overlap/out of bounds at op " << op;
        live.push_back(*got);
      } else {
        ++failed;
      }
    } else {
      size_t index = 0;
      switch (order) {
        case FreeOrder::kLifoBiased:
          index = uniform(0, 99) < 80 ? live.size() - 1 : uniform(0, live.size() - 1);
          break;
        case FreeOrder::kFifo:
          index = 0;
          break;
        case FreeOrder::kRandom:
          index = uniform(0, live.size() - 1);
          break;
      }
      const uint64_t offset = live[index];
      live.erase(live.begin() + index);
      const uint64_t top_before = arena.top();
      ASSERT_TRUE(model.Release(offset));
      ASSERT_TRUE(arena.Free(offset)) << "op " << op;
      if (arena.top() < top_before && arena.top() < offset) ++collapses;
      freed_recently.push_back(offset);
      if (freed_recently.size() > 8) freed_recently.erase(freed_recently.begin());
    }
    ASSERT_TRUE(arena.CheckInvariants()) << "op " << op;
    ASSERT_EQ(arena.used_bytes(), model.Used()) << "op " << op;
    ASSERT_EQ(arena.top(), model.Top()) << "op " << op;
    ASSERT_EQ(arena.live_blocks(), model.Live()) << "op " << op;
    uint64_t hole_bytes = 0;
    const auto holes = model.Holes();
    for (const auto& hole : holes) hole_bytes += hole.second;
    ASSERT_EQ(arena.hole_count(), holes.size()) << "op " << op;
    ASSERT_EQ(arena.hole_bytes(), hole_bytes) << "op " << op;
    ASSERT_EQ(arena.largest_free(), model.LargestFree()) << "op " << op;
    ASSERT_EQ(arena.empty(), live.empty()) << "op " << op;
  }
  std::printf(
      "[ model    ] %llu ops: %llu into holes, %llu failed, %llu bad frees, %llu "
      "collapses over holes\n",
      static_cast<unsigned long long>(ops), static_cast<unsigned long long>(into_holes),
      static_cast<unsigned long long>(failed), static_cast<unsigned long long>(bad_frees),
      static_cast<unsigned long long>(collapses));
  if (ops >= 5000) {  // the run must have exercised every path
    EXPECT_GT(into_holes, 0u);
    EXPECT_GT(failed, 0u);
    EXPECT_GT(bad_frees, 0u);
    if (order != FreeOrder::kFifo) {
      EXPECT_GT(collapses, 0u);
    }
  }
}

std::string OrderName(FreeOrder order) {
  switch (order) {
    case FreeOrder::kLifoBiased:
      return "LifoBiased";
    case FreeOrder::kFifo:
      return "Fifo";
    case FreeOrder::kRandom:
      return "Random";
  }
  return "?";
}

INSTANTIATE_TEST_SUITE_P(
    SeedsAndOrders, ArenaAllocatorModelTest,
    ::testing::Combine(::testing::Values(1u, 7u, 20240611u),
                       ::testing::Values(FreeOrder::kLifoBiased, FreeOrder::kFifo,
                                         FreeOrder::kRandom)),
    [](const ::testing::TestParamInfo<ArenaAllocatorModelTest::ParamType>& info) {
      return OrderName(std::get<1>(info.param)) + "_seed" + std::to_string(std::get<0>(info.param));
    });

}  // namespace
}  // namespace actstash::client_internal
