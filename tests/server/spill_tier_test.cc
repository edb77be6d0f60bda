// SpillTier's write and read-back: a spill answers its id with the XXH3 of
// the bytes it wrote (what the Spill reply hands the client, so that a
// client whose Restore answer a crash lost can tell a read-back that
// happened from a spill that was lost), and the bytes come back.
#include "server/spill/spill_tier.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "server/sessions/session.h"

namespace actstash::server {
namespace {

TEST(SpillTierTest, ASpillAnswersTheChecksumOfTheBytesItWrote) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / "actstash-spill-tier-XXXXXX").string();
  ASSERT_NE(mkdtemp(pattern.data()), nullptr);
  SpillOptions options;
  options.dir = pattern;
  absl::StatusOr<std::unique_ptr<SpillTier>> tier = SpillTier::Open(options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto session = std::make_shared<Session>(7, "token", "test", 1, uint64_t{1} << 30, 0);
  std::vector<std::byte> data(3 * 4096 + 17);
  std::mt19937_64 random(3);
  for (std::byte& b : data) b = static_cast<std::byte>(random());

  std::promise<absl::StatusOr<SpillTier::Written>> spilled;
  (*tier)->SpillBytes(session, data.data(), data.size(), nullptr,
                      [&](absl::StatusOr<SpillTier::Written> w) { spilled.set_value(w); });
  absl::StatusOr<SpillTier::Written> written = spilled.get_future().get();
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_NE(written->id, 0u);
  EXPECT_EQ(written->checksum, Xxh3(data.data(), data.size()));

  std::vector<std::byte> back(data.size());
  std::promise<absl::Status> restored;
  (*tier)->RestoreBytes(session, written->id, back.data(), back.size(), nullptr,
                        [&](absl::Status s) { restored.set_value(s); });
  ASSERT_TRUE(restored.get_future().get().ok());
  EXPECT_EQ(back, data);
  tier->reset();
  std::filesystem::remove_all(pattern);
}

}  // namespace
}  // namespace actstash::server
