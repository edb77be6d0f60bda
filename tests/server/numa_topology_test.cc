// NUMA topology from sysfs: a fake two-socket machine with GPUs on both
// nodes, malformed files, a kernel without NUMA, and this machine's own.
#include "server/pool/numa_topology.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace actstash::server {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("actstash-sysfs-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const std::string& relative, const std::string& text) {
    const fs::path path = root_ / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }
  void Gpu(const std::string& bus_id, const std::string& vendor, const std::string& pci_class,
           const std::string& node) {
    Write("bus/pci/devices/" + bus_id + "/vendor", vendor + "\n");
    Write("bus/pci/devices/" + bus_id + "/class", pci_class + "\n");
    Write("bus/pci/devices/" + bus_id + "/numa_node", node + "\n");
  }
  fs::path root_;
};

TEST_F(FakeSysfs, TwoSocketsWithGpusOnBoth) {
  Write("devices/system/node/online", "0-1\n");
  Write("devices/system/node/node0/cpulist", "0-3,8-11\n");
  Write("devices/system/node/node0/meminfo",
        "Node 0 MemTotal:       1048576 kB\nNode 0 MemFree: 1 kB\n");
  Write("devices/system/node/node1/cpulist", "4-7,12-15\n");
  Gpu("0000:b3:00.0", "0x10de", "0x030200", "1");
  Gpu("0000:17:00.0", "0x10de", "0x030000", "0");
  Gpu("0000:00:02.0", "0x8086", "0x030000", "0");  // not NVIDIA
  Gpu("0000:18:00.0", "0x10de", "0x040300", "0");  // NVIDIA audio, not a GPU
  absl::StatusOr<NumaTopology> topology = ReadNumaTopology(root_.string());
  ASSERT_TRUE(topology.ok()) << topology.status();
  ASSERT_EQ(topology->nodes.size(), 2u);
  EXPECT_EQ(topology->nodes[0].id, 0);
  EXPECT_THAT(topology->nodes[0].cpus, ElementsAre(0, 1, 2, 3, 8, 9, 10, 11));
  EXPECT_EQ(topology->nodes[0].memory_bytes, uint64_t{1} << 30);
  EXPECT_EQ(topology->nodes[1].memory_bytes, 0u);  // no meminfo
  EXPECT_EQ(topology->NodeOfCpu(9), 0);
  EXPECT_EQ(topology->NodeOfCpu(12), 1);
  EXPECT_EQ(topology->NodeOfCpu(99), -1);
  ASSERT_EQ(topology->gpus.size(), 2u);
  EXPECT_EQ(topology->gpus[0].bus_id, "0000:17:00.0");
  EXPECT_EQ(topology->gpus[0].node, 0);
  EXPECT_EQ(topology->gpus[1].node, 1);
  EXPECT_EQ(topology->Describe(),
            "2 NUMA nodes (0: cpus 0-3,8-11, 1.0 GiB; 1: cpus 4-7,12-15); GPUs 0000:17:00.0 on "
            "node 0, 0000:b3:00.0 on node 1");
}

TEST_F(FakeSysfs, MalformedFilesAreNamed) {
  Write("devices/system/node/online", "0-x\n");
  absl::StatusOr<NumaTopology> topology = ReadNumaTopology(root_.string());
  ASSERT_FALSE(topology.ok());
  EXPECT_THAT(topology.status().message(), HasSubstr("devices/system/node/online"));
  Write("devices/system/node/online", "0\n");
  Write("devices/system/node/node0/cpulist", "3-1\n");
  topology = ReadNumaTopology(root_.string());
  ASSERT_FALSE(topology.ok());
  EXPECT_THAT(topology.status().message(), HasSubstr("node0/cpulist"));
  Write("devices/system/node/node0/cpulist", "0-1\n");
  Gpu("0000:17:00.0", "0x10de", "0x030200", "near");
  topology = ReadNumaTopology(root_.string());
  ASSERT_FALSE(topology.ok());
  EXPECT_THAT(topology.status().message(), HasSubstr("0000:17:00.0/numa_node"));
}

TEST_F(FakeSysfs, AKernelWithoutNumaHasNoNodes) {
  Gpu("0000:17:00.0", "0x10de", "0x030200", "-1");
  absl::StatusOr<NumaTopology> topology = ReadNumaTopology(root_.string());
  ASSERT_TRUE(topology.ok()) << topology.status();
  EXPECT_TRUE(topology->nodes.empty());
  EXPECT_EQ(topology->Describe(), "no NUMA nodes in sysfs");
  ASSERT_EQ(topology->gpus.size(), 1u);
  EXPECT_EQ(topology->gpus[0].node, -1);
}

TEST(IdListTest, ParsesAndFormatsTheKernelsLists) {
  EXPECT_THAT(*ParseIdList("0-2,5,7-8\n"), ElementsAre(0, 1, 2, 5, 7, 8));
  EXPECT_TRUE(ParseIdList("")->empty());
  EXPECT_THAT(*ParseIdList("3,1,1"), ElementsAre(1, 3));
  for (const char* bad : {"a", "-1", "1-", "2-1", "0-99999999", "1,,2"}) {
    EXPECT_FALSE(ParseIdList(bad).ok()) << bad;
  }
  EXPECT_EQ(FormatIdList({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(FormatIdList({}), "");
}

NumaTopology Machine(std::vector<int> node_ids, std::vector<int> gpu_nodes) {
  NumaTopology topology;
  for (int id : node_ids) topology.nodes.push_back({id, {id}, 0});
  for (size_t i = 0; i < gpu_nodes.size(); ++i) {
    topology.gpus.push_back({"0000:1" + std::to_string(i) + ":00.0", gpu_nodes[i]});
  }
  return topology;
}

std::vector<int> Nodes(const NumaSetting& setting, const NumaTopology& topology) {
  absl::StatusOr<PoolPlacement> placement = ChoosePoolPlacement(setting, topology);
  EXPECT_TRUE(placement.ok()) << placement.status();
  return placement.ok() ? placement->nodes : std::vector<int>{-99};
}

bool Split(const NumaSetting& setting, const NumaTopology& topology) {
  absl::StatusOr<PoolPlacement> placement = ChoosePoolPlacement(setting, topology);
  return placement.ok() && placement->split;
}

TEST(PoolPlacementTest, AutoBindsToTheGpusNodeAndSplitsOverSeveral) {
  const NumaSetting autos = *ParseNumaSetting("auto");
  EXPECT_THAT(Nodes(autos, Machine({0, 1}, {1, 1, 1, 1})), ElementsAre(1));
  EXPECT_FALSE(Split(autos, Machine({0, 1}, {1, 1, 1, 1})));
  EXPECT_THAT(Nodes(autos, Machine({0, 1, 2, 3}, {0, 0, 2, 2, -1})), ElementsAre(0, 2));
  EXPECT_TRUE(Split(autos, Machine({0, 1, 2, 3}, {0, 0, 2, 2, -1})));
  EXPECT_THAT(ChoosePoolPlacement(autos, Machine({0, 1}, {0, 1}))->why,
              HasSubstr("split over nodes 0-1, the GPUs' nodes"));
  EXPECT_TRUE(Nodes(autos, Machine({0}, {0, 0})).empty());       // one node: nothing to choose
  EXPECT_TRUE(Nodes(autos, Machine({0, 1}, {})).empty());        // no GPU
  EXPECT_TRUE(Nodes(autos, Machine({0, 1}, {-1, -1})).empty());  // firmware does not say
  EXPECT_THAT(ChoosePoolPlacement(autos, Machine({0, 1}, {1}))->why,
              HasSubstr("bound to node 1, the node of every GPU"));
}

TEST(PoolPlacementTest, ExplicitSettings) {
  const NumaTopology two = Machine({0, 1}, {1});
  EXPECT_TRUE(Nodes(*ParseNumaSetting("off"), two).empty());
  EXPECT_THAT(Nodes(*ParseNumaSetting("interleave"), two), ElementsAre(0, 1));
  EXPECT_FALSE(Split(*ParseNumaSetting("interleave"), two));
  EXPECT_THAT(Nodes(*ParseNumaSetting("split"), two), ElementsAre(0, 1));
  EXPECT_TRUE(Split(*ParseNumaSetting("SPLIT"), two));
  EXPECT_THAT(Nodes(*ParseNumaSetting("split"), Machine({0}, {})), ElementsAre(0));
  EXPECT_EQ(ChoosePoolPlacement(*ParseNumaSetting("split"), Machine({}, {})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Nodes(*ParseNumaSetting("0"), two), ElementsAre(0));
  EXPECT_THAT(Nodes(*ParseNumaSetting("0"), Machine({0}, {})), ElementsAre(0));  // one node too
  absl::StatusOr<PoolPlacement> missing = ChoosePoolPlacement(*ParseNumaSetting("3"), two);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(),
              HasSubstr("NUMA node 3 is not one of this machine's (0-1)"));
  for (const char* bad : {"", "near", "-1", "1024", "0.5"}) {
    EXPECT_FALSE(ParseNumaSetting(bad).ok()) << bad;
  }
}

TEST(NumaTopologyTest, ThisMachinesNodesHaveItsCpus) {
  if (!fs::exists("/sys/devices/system/node/online")) {
    GTEST_SKIP() << "this kernel shows no NUMA nodes in sysfs";
  }
  absl::StatusOr<NumaTopology> topology = ReadNumaTopology();
  ASSERT_TRUE(topology.ok()) << topology.status();
  ASSERT_FALSE(topology->nodes.empty());
  size_t cpus = 0;
  for (const NumaNode& node : topology->nodes) cpus += node.cpus.size();
  EXPECT_GE(cpus, 1u);
  EXPECT_GE(topology->NodeOfCpu(sched_getcpu()), 0);
}

}  // namespace
}  // namespace actstash::server
