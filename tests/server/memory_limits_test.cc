// Unit tests of ReadMemoryLimits over fake /proc and /sys/fs/cgroup trees:
// cgroup v2, v1, hybrid hosts, containers without a cgroup namespace, and
// limits that do not limit.
#include "server/pool/memory_limits.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace actstash::server {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

class MemoryLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ =
        std::filesystem::temp_directory_path() /
        ("actstash-cgroup-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
         "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // Writes `text` at `path` under the fake root, making its folders.
  void Write(const std::string& path, const std::string& text) {
    const std::filesystem::path file = root_ / path.substr(1);
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }
  MemoryLimits Read() const { return ReadMemoryLimits(root_.string()); }
  std::string File(const std::string& path) const { return (root_ / path.substr(1)).string(); }

  std::filesystem::path root_;
};

TEST_F(MemoryLimitsTest, V2TheSmallestLimitOnTheWayToTheRootWins) {
  Write("/proc/self/cgroup", "0::/job/step\n");
  Write("/sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
  Write("/sys/fs/cgroup/job/memory.max", "2147483648\n");
  Write("/sys/fs/cgroup/job/step/memory.max", "max\n");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.cgroup_bytes, 2 * kGiB);
  EXPECT_EQ(limits.cgroup_file, File("/sys/fs/cgroup/job/memory.max"));
  if (limits.physical_bytes > 2 * kGiB) {
    EXPECT_EQ(limits.usable_bytes(), 2 * kGiB);
    EXPECT_NE(limits.Describe().find("the cgroup limit 2.0 GiB (" + limits.cgroup_file),
              std::string::npos)
        << limits.Describe();
  }
}

TEST_F(MemoryLimitsTest, V2ADeeperLimitBelowItsParentsWins) {
  Write("/proc/self/cgroup", "0::/job/step\n");
  Write("/sys/fs/cgroup/cgroup.controllers", "memory\n");
  Write("/sys/fs/cgroup/job/memory.max", "4294967296\n");
  Write("/sys/fs/cgroup/job/step/memory.max", "1073741824\n");
  EXPECT_EQ(Read().cgroup_bytes, kGiB);
}

// A container without a cgroup namespace: /proc/self/cgroup names the host's
// path, the mount shows the container's cgroup as its root.
TEST_F(MemoryLimitsTest, V1ContainerLimitAtTheMountsRoot) {
  Write("/proc/self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n");
  Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.cgroup_bytes, kGiB);
  EXPECT_EQ(limits.cgroup_file, File("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
}

TEST_F(MemoryLimitsTest, V1UnlimitedIsNoLimit) {
  Write("/proc/self/cgroup", "4:memory:/process_api/x\n");
  Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  Write("/sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes", "9223372036854771712\n");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.cgroup_bytes, 0u);
  EXPECT_EQ(limits.usable_bytes(), limits.physical_bytes);
  EXPECT_NE(limits.Describe().find("no cgroup limit"), std::string::npos) << limits.Describe();
}

// Hybrid hosts: v1 controllers plus the unified hierarchy at .../unified.
TEST_F(MemoryLimitsTest, HybridTakesTheSmallerOfBoth) {
  Write("/proc/self/cgroup", "4:memory:/a\n0::/a\n");
  Write("/sys/fs/cgroup/memory/a/memory.limit_in_bytes", "8589934592\n");
  Write("/sys/fs/cgroup/unified/a/memory.max", "3221225472\n");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.cgroup_bytes, 3 * kGiB);
  EXPECT_EQ(limits.cgroup_file, File("/sys/fs/cgroup/unified/a/memory.max"));
}

TEST_F(MemoryLimitsTest, ALimitAbovePhysicalMemoryDoesNotRaiseIt) {
  Write("/proc/self/cgroup", "0::/\n");
  Write("/sys/fs/cgroup/cgroup.controllers", "memory\n");
  Write("/sys/fs/cgroup/memory.max", std::to_string(uint64_t{1} << 52) + "\n");  // 4 PiB
  const MemoryLimits limits = Read();
  ASSERT_GT(limits.physical_bytes, 0u);
  EXPECT_EQ(limits.cgroup_bytes, uint64_t{1} << 52);
  EXPECT_EQ(limits.usable_bytes(), limits.physical_bytes);
  EXPECT_EQ(limits.Describe().find("the cgroup limit"), std::string::npos) << limits.Describe();
}

TEST_F(MemoryLimitsTest, MissingOrGarbledFilesMeanNoLimit) {
  EXPECT_EQ(Read().cgroup_bytes, 0u);  // no /proc/self/cgroup at all
  Write("/proc/self/cgroup", "garbage\n4:memory\n0::/x\n");
  Write("/sys/fs/cgroup/cgroup.controllers", "memory\n");
  Write("/sys/fs/cgroup/x/memory.max", "lots\n");
  EXPECT_EQ(Read().cgroup_bytes, 0u);
}

TEST_F(MemoryLimitsTest, MemlockIsReported) {
  const MemoryLimits limits = Read();
  EXPECT_NE(limits.Describe().find("RLIMIT_MEMLOCK "), std::string::npos) << limits.Describe();
  EXPECT_GT(limits.memlock_bytes, 0u);
}

}  // namespace
}  // namespace actstash::server
