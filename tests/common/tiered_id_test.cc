#include "common/tiered_id.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace actstash::tiered_id {
namespace {

TEST(TieredIdTest, TierAndSerialRoundTrip) {
  for (uint32_t tier : {0u, 1u, 2u, kMaxTier}) {
    for (uint64_t serial : {uint64_t{1}, uint64_t{12345}, kSerialMask}) {
      const uint64_t id = Make(tier, serial);
      EXPECT_EQ(TierOf(id), tier);
      EXPECT_EQ(SerialOf(id), serial);
      EXPECT_FALSE(IsInline(id));
    }
  }
}

TEST(TieredIdTest, HostTierIdsAreTheSerialItself) {
  // The host store's tickets and the host pool's lease ids are plain numbers.
  EXPECT_EQ(Make(0, 7), 7u);
  EXPECT_EQ(Make(1, 7), (uint64_t{1} << 56) | 7);
}

TEST(TieredIdTest, InlineIdsKeepTheHandleAndNeverLookTiered) {
  const uint64_t handle = (uint64_t{1} << 62) + 99;  // any handle below 2^63
  const uint64_t id = MakeInline(handle);
  EXPECT_TRUE(IsInline(id));
  EXPECT_EQ(HandleOf(id), handle);
  EXPECT_FALSE(IsInline(handle));
}

TEST(TieredIdTest, ASerialTooLargeCannotChangeTheTier) {
  EXPECT_EQ(TierOf(Make(3, ~uint64_t{0})), 3u);
  EXPECT_FALSE(IsInline(Make(kMaxTier, ~uint64_t{0})));
}

TEST(TieredIdTest, TheInlineBitIsNotPartOfTheTier) {
  // An id a client forged with bit 63 decodes to a tier in range; whoever
  // decodes a lease id rejects inline ids (server/rpc/stash_core.cc).
  EXPECT_EQ(TierOf(kInlineBit | Make(2, 5)), 2u);
  EXPECT_EQ(SerialOf(kInlineBit | Make(2, 5)), 5u);
}

}  // namespace
}  // namespace actstash::tiered_id
