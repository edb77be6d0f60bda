// `actstashd` with no arguments: the default socket, a pool of 25% of RAM
// (capped), working store/fetch, and a clean stop; and inside a memory
// cgroup, a pool of 25% of the cgroup's limit. Labelled slow: it commits and
// pins that much memory.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/address.h"
#include "server/daemon/config.h"
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

// A memory cgroup of its own, limited to `bytes`, made where this machine lets
// a root process make one (cgroup v1's memory controller, or v2 with the
// memory controller enabled at the root); removed when destroyed. `why_not`
// says what was missing otherwise.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(uint64_t bytes) {
    const std::string name = "actstash-test-" + std::to_string(getpid());
    if (std::filesystem::exists("/sys/fs/cgroup/memory/cgroup.procs")) {
      Make("/sys/fs/cgroup/memory/" + name, "memory.limit_in_bytes", bytes);
    } else if (std::filesystem::exists("/sys/fs/cgroup/cgroup.controllers")) {
      Make("/sys/fs/cgroup/" + name, "memory.max", bytes);
    } else {
      why_not_ = "no cgroup v1 memory controller or cgroup v2 hierarchy at /sys/fs/cgroup";
    }
  }
  ~MemoryCgroup() {
    if (!dir_.empty()) std::filesystem::remove(dir_);  // empty once the daemon is gone
  }
  bool ok() const { return why_not_.empty(); }
  const std::string& why_not() const { return why_not_; }
  std::string procs() const { return dir_ + "/cgroup.procs"; }

 private:
  void Make(const std::string& dir, const std::string& limit_file, uint64_t bytes) {
    std::error_code error;
    if (!std::filesystem::create_directory(dir, error)) {
      why_not_ = "cannot create " + dir + ": " + error.message();
      return;
    }
    dir_ = dir;
    std::ofstream limit(dir + "/" + limit_file);
    limit << bytes;
    limit.close();
    std::ifstream back(dir + "/" + limit_file);
    uint64_t read = 0;
    back >> read;
    if (!limit || read != bytes) why_not_ = "cannot set " + dir + "/" + limit_file;
  }

  std::string dir_;
  std::string why_not_;
};

TEST(DefaultsTest, InsideAMemoryCgroupThePoolIsAQuarterOfItsLimit) {
  constexpr uint64_t kLimit = 2ull << 30;
  MemoryCgroup cgroup(kLimit);
  if (!cgroup.ok()) GTEST_SKIP() << "cannot make a memory cgroup here: " << cgroup.why_not();
  const std::string dir = ::testing::TempDir() + "actstash-cgroup-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  DaemonProcessOptions options;
  options.bare = true;  // no --pool-size: the default
  options.socket_path = dir + "/actstash.sock";
  options.extra_args = {"--socket", options.socket_path};
  options.cgroup_procs = cgroup.procs();
  auto daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  ClientOptions client_options;
  client_options.address = daemon->address();
  auto client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  // A quarter of 2 GiB in whole 64 MiB segments, whatever the machine has.
  EXPECT_EQ(stats->pool().total_bytes(), kLimit / 4);
  EXPECT_THAT(daemon->log(), HasSubstr("memory: the cgroup limit 2.0 GiB ("));
  client->reset();
  absl::StatusOr<int> code = daemon->Stop(SIGTERM, std::chrono::seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace actstash::testing
