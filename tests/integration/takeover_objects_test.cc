// actstashd --take-over with a spill tier: inline objects (resident and
// spilled) and spilled leases are handed to the successor with their bytes,
// checksums and handles; the spill files travel as fds (they have no name),
// and nothing is left on disk or in the pool once the clients are done.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "tests/integration/takeover_util.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;
constexpr uint64_t kMiB = 1 << 20;

class TakeOverObjectsTest : public ::testing::Test {
 protected:
  void SetUp() override { spill_dir_ = MakeTempDir(); }
  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) std::fprintf(stderr, "%s", daemon_->log().c_str());
    daemon_.reset();
    Retired().clear();
    std::filesystem::remove_all(spill_dir_);
  }
  std::vector<std::string> SpillArgs() const { return {"--spill-dir", spill_dir_}; }
  v1::StatsReply Stats() {
    auto observer = ConnectOrDie(*daemon_, 0, "observer");
    absl::StatusOr<v1::StatsReply> stats = observer->Stats(/*all_sessions=*/true);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : v1::StatsReply();
  }

  std::string spill_dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(TakeOverObjectsTest, InlineObjectsAndSpilledDataSurviveTakeOvers) {
  daemon_ = StartDaemonOrDie(Options("", SpillArgs()));
  ASSERT_NE(daemon_, nullptr);
  // Inline objects through a 48 MiB quota: most of them are spilled.
  std::unique_ptr<Client> inline_client = ConnectOrDie(*daemon_, 48 * kMiB, "inline");
  ASSERT_NE(inline_client, nullptr);
  PutOptions put;
  put.checksum = true;
  std::vector<std::pair<Handle, std::vector<std::byte>>> objects;
  auto put_some = [&](int count, uint64_t seed) {
    for (int i = 0; i < count; ++i) {
      std::vector<std::byte> data = RandomBytes(2 * kMiB + 4096 * i + 100, seed + i);
      absl::StatusOr<Handle> handle = inline_client->Put(data.data(), data.size(), put);
      ASSERT_TRUE(handle.ok()) << handle.status();
      objects.emplace_back(*handle, std::move(data));
    }
  };
  put_some(40, 1000);
  // Zero-copy buffers through a 24 MiB quota: spilled leases.
  ClientOptions attached;
  attached.address = daemon_->address();
  attached.quota_bytes = 24 * kMiB;
  attached.attach = AttachMode::kRequired;
  attached.lease_batch = 2;
  attached.client_name = "zero-copy";
  absl::StatusOr<std::unique_ptr<Client>> zero_copy = Client::Connect(attached);
  ASSERT_TRUE(zero_copy.ok()) << zero_copy.status();
  StoredBuffers buffers;
  for (uint64_t seed = 1; seed <= 48; ++seed) StoreRandom(**zero_copy, seed, &buffers);

  v1::StatsReply before = Stats();
  ASSERT_TRUE(before.has_spill());
  EXPECT_GT(before.spill().files(), 0u);
  EXPECT_GE(before.spill().on_disk_bytes(), 60 * kMiB);
  EXPECT_EQ(before.objects(), 40u);

  for (int round = 1; round <= 3; ++round) {
    SCOPED_TRACE(round);
    const uint64_t files = Stats().spill().files();
    daemon_ = TakeOver(std::move(daemon_), SpillArgs());
    ASSERT_NE(daemon_, nullptr);
    EXPECT_THAT(daemon_->log(), HasSubstr(absl::StrCat(objects.size(), " inline objects and ",
                                                       files, " spill files")));
    // The files are the successor's now (the predecessor has exited).
    EXPECT_EQ(SpillFds(daemon_->pid(), spill_dir_).size(), files);
    v1::StatsReply stats = Stats();
    EXPECT_EQ(stats.objects(), objects.size());
    EXPECT_EQ(stats.spill().files(), files);
    EXPECT_GE(stats.spill().bytes_written(), before.spill().bytes_written());
    // Every byte comes back, spilled or resident, checksums verified.
    for (const auto& [handle, data] : objects) {
      absl::StatusOr<Object> got = inline_client->Get(handle);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->data, data);
    }
    ExpectFetched(**zero_copy, buffers);
    // More of both on the successor (they spill what the reads brought back).
    put_some(8, 1000 * (round + 1));
    for (int i = 0; i < 8; ++i) StoreRandom(**zero_copy, 100 * round + i, &buffers);
  }
  EXPECT_THAT(daemon_->log(), HasSubstr("hand-over 3 of this state"));
  EXPECT_EQ(Stats().spill().checksum_failures(), 0u);
  for (const auto& entry : objects) ASSERT_TRUE(inline_client->Delete(entry.first).ok());
  for (const auto& entry : buffers) ASSERT_TRUE((*zero_copy)->Release(entry.first).ok());
  ASSERT_TRUE(inline_client->Close().ok());
  ASSERT_TRUE((*zero_copy)->Close().ok());
  v1::StatsReply after = Stats();
  EXPECT_EQ(after.objects(), 0u);
  EXPECT_EQ(after.spill().files(), 0u);
  EXPECT_EQ(after.spill().on_disk_bytes(), 0u);
  EXPECT_EQ(SpillFds(daemon_->pid(), spill_dir_).size(), 0u);
  EXPECT_EQ(after.pool().used_bytes(), 0u);
}

TEST_F(TakeOverObjectsTest, SpilledDataIsRefusedToASuccessorWithoutASpillTier) {
  daemon_ = StartDaemonOrDie(Options("", SpillArgs()));
  ASSERT_NE(daemon_, nullptr);
  std::unique_ptr<Client> client = ConnectOrDie(*daemon_, 16 * kMiB, "inline");
  ASSERT_NE(client, nullptr);
  std::vector<std::pair<Handle, std::vector<std::byte>>> objects;
  for (int i = 0; i < 16; ++i) {
    std::vector<std::byte> data = RandomBytes(2 * kMiB, 50 + i);
    absl::StatusOr<Handle> handle = client->Put(data.data(), data.size());
    ASSERT_TRUE(handle.ok()) << handle.status();
    objects.emplace_back(*handle, std::move(data));
  }
  ASSERT_GT(Stats().spill().files(), 0u);
  DaemonProcessOptions options = Options(daemon_->socket_path(), {"--take-over"});
  options.ready_timeout = std::chrono::seconds(10);
  absl::StatusOr<std::unique_ptr<DaemonProcess>> successor = DaemonProcess::Start(options);
  if (successor.ok()) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!LogHas(**successor, "cannot start") && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_THAT((*successor)->log(), HasSubstr("the successor has no spill tier"));
  } else {
    EXPECT_THAT(std::string(successor.status().message()), HasSubstr("no spill tier"));
  }
  EXPECT_THAT(daemon_->log(), HasSubstr("take-over refused"));
  // The serving daemon serves on, with everything.
  for (const auto& [handle, data] : objects) {
    absl::StatusOr<Object> got = client->Get(handle);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->data, data);
  }
}

}  // namespace
}  // namespace actstash::testing
