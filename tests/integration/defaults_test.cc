// `actstashd` with no arguments: the default socket, a pool of 25% of RAM
// (capped), working store/fetch, and a clean stop. Labelled slow: it commits
// and pins that much memory.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include "common/address.h"
#include "server/config.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;

TEST(DefaultsTest, NoArgumentsGivesAWorkingDaemonOnTheDefaultSocket) {
  const std::string socket = DefaultSocketPath();
  absl::StatusOr<PingResult> existing = Ping(socket, std::chrono::milliseconds(500));
  if (existing.ok()) GTEST_SKIP() << "a daemon already listens on " << socket;

  DaemonProcessOptions options;
  options.bare = true;
  options.socket_path = socket;
  options.ready_timeout = std::chrono::seconds(120);  // a quarter of RAM, pinned
  auto daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  ClientOptions client_options;  // default address, as a user would
  client_options.address = "";
  unsetenv("ACTSTASH_ADDRESS");
  auto client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->address(), "unix://" + socket);

  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const uint64_t expected = server::DefaultPoolBytes() / (64u << 20) * (64u << 20);
  EXPECT_EQ(stats->pool().total_bytes(), expected);
  EXPECT_EQ(stats->pool().segment_bytes(), 64u << 20);
  EXPECT_LE(stats->pool().total_bytes(), 32ull << 30);
  EXPECT_EQ((*client)->quota_bytes(), stats->pool().total_bytes());

  const std::vector<std::byte> data = RandomBytes(5 << 20, 9);
  absl::StatusOr<Handle> handle = (*client)->Put(data.data(), data.size());
  ASSERT_TRUE(handle.ok()) << handle.status();
  absl::StatusOr<Object> back = (*client)->Get(*handle);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->data == data);

  const std::string log = daemon->log();
  EXPECT_THAT(log, HasSubstr("listening on unix://" + socket));
  EXPECT_THAT(log, HasSubstr("host pool: "));
  client->reset();
  // Giving back many GiB of pinned memory takes the kernel a few seconds.
  absl::StatusOr<int> code = daemon->Stop(SIGTERM, std::chrono::seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  struct stat st {};
  EXPECT_NE(lstat(socket.c_str(), &st), 0) << "the default socket must be removed on exit";
}

}  // namespace
}  // namespace actstash::testing
