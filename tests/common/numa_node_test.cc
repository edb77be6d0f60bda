#include "common/numa_node.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace actstash {
namespace {

namespace fs = std::filesystem;

class PciNumaNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("actstash-pci-" + std::to_string(getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const std::string& bus_id, const std::string& text) {
    const fs::path dir = root_ / "bus/pci/devices" / bus_id;
    fs::create_directories(dir);
    std::ofstream(dir / "numa_node") << text;
  }
  fs::path root_;
};

TEST_F(PciNumaNodeTest, ReadsTheDevicesNode) {
  Write("0000:17:00.0", "1\n");
  Write("0000:65:00.0", "-1\n");  // the firmware does not say
  EXPECT_EQ(*ReadPciNumaNode(root_.string(), "0000:17:00.0"), 1);
  EXPECT_EQ(*ReadPciNumaNode(root_.string(), "0000:65:00.0"), -1);
  EXPECT_EQ(*ReadPciNumaNode(root_.string(), "0000:99:00.0"), -1);  // no such device
}

TEST_F(PciNumaNodeTest, MalformedFilesAndBusIdsAreErrors) {
  Write("0000:17:00.0", "north\n");
  absl::StatusOr<int> bad = ReadPciNumaNode(root_.string(), "0000:17:00.0");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("0000:17:00.0/numa_node: 'north' is not a node number"),
            std::string::npos)
      << bad.status();
  Write("0000:18:00.0", "-2");
  EXPECT_FALSE(ReadPciNumaNode(root_.string(), "0000:18:00.0").ok());
  for (const char* id : {"", "..", "../../etc", "a/b"}) {
    EXPECT_EQ(ReadPciNumaNode(root_.string(), id).status().code(),
              absl::StatusCode::kInvalidArgument)
        << id;
  }
}

TEST(LeaseNumaNodeTest, ACudaThreadsNodeIsRememberedForThreadsWithout) {
  LeaseNumaNode node(-1);
  EXPECT_EQ(node.Choose(-1, 0), 0);   // a CPU thread first: its CPU's node, remembered
  EXPECT_EQ(node.Choose(-1, 1), 0);   // a thread on another socket names the same
  EXPECT_EQ(node.Choose(3, 1), 3);    // a CUDA thread: its device's node...
  EXPECT_EQ(node.Choose(-1, 1), 3);   // ...which threads without CUDA then name
  EXPECT_EQ(node.Choose(-1, -1), 3);  // (the store's background threads)
  LeaseNumaNode unknown(-1);
  EXPECT_EQ(unknown.Choose(-1, -1), -1);
  EXPECT_EQ(unknown.Choose(-1, 1), 1);
  LeaseNumaNode configured(2);  // ClientOptions::numa_node
  EXPECT_EQ(configured.Choose(3, 1), 2);
  EXPECT_EQ(configured.Choose(-1, -1), 2);
}

TEST(LeaseNumaNodeTest, ThisThreadNamesTheNodeOfACpuOfThisMachine) {
  const int cpu_node = CurrentCpuNumaNode();
  if (!fs::exists("/sys/devices/system/node/online")) GTEST_SKIP() << "no NUMA nodes in sysfs";
  ASSERT_GE(cpu_node, 0);
  EXPECT_TRUE(fs::exists("/sys/devices/system/node/node" + std::to_string(cpu_node)));
  EXPECT_EQ(CudaThreadNumaNode(), -1);  // no CUDA context on this thread
  // Compared on a one-node machine only: elsewhere the thread may move
  // between the two calls.
  LeaseNumaNode node(-1);
  if (!fs::exists("/sys/devices/system/node/node1")) {
    EXPECT_EQ(node.Get(), cpu_node);
  }
}

}  // namespace
}  // namespace actstash
