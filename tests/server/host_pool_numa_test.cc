// The host pool on NUMA nodes: segments bound before first touch (the real
// kernel, node 0), and a pool split per node (HostPoolOptions::numa_split)
// over nodes this machine may not have, through a recording binder.
#include <gtest/gtest.h>
#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/pool/host_pool.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

uint64_t PageSize() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

HostPoolOptions Options(uint64_t pool_bytes) {
  HostPoolOptions options;
  options.pool_bytes = pool_bytes;
  options.segment_bytes = kMiB;
  options.mlock = Tristate::kOff;
  return options;
}

std::unique_ptr<HostPool> MakePool(uint64_t pool_bytes) {
  auto pool = CreateHostPool(Options(pool_bytes));
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

// The policy of the page at `at` (get_mempolicy with MPOL_F_ADDR): its mode
// and node mask (nodes < 64), or mode -1 when the kernel has no NUMA.
std::pair<int, unsigned long> PolicyAt(const void* at) {
  int mode = -1;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  if (syscall(SYS_get_mempolicy, &mode, mask, 1024 + 1, at, MPOL_F_ADDR) != 0) return {-1, 0};
  return {mode, mask[0]};
}

TEST(HostPoolTest, SegmentsBoundToANodeStayBoundAcrossRenewals) {
  if (PolicyAt(&kMiB).first < 0) GTEST_SKIP() << "this kernel has no NUMA policies";
  HostPoolOptions options = Options(4 * kMiB);
  options.numa_nodes = {0};  // every machine has node 0
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<SegmentRun> run = (*pool)->AllocateSegments(2);
  ASSERT_TRUE(run.ok()) << run.status();
  std::byte* data = static_cast<std::byte*>(run->memory.data());
  for (uint64_t offset : {uint64_t{0}, kMiB, 2 * kMiB - PageSize()}) {
    EXPECT_EQ(PolicyAt(data + offset), std::make_pair(int{MPOL_BIND}, 1ul)) << offset;
    EXPECT_EQ(data[offset], std::byte{0});  // populated, zeroed
  }
  data[5] = std::byte{7};
  ASSERT_TRUE((*pool)->RenewSegments(*run).ok());
  EXPECT_EQ(data[5], std::byte{0});  // fresh memory, bound again
  EXPECT_EQ(PolicyAt(data + kMiB), std::make_pair(int{MPOL_BIND}, 1ul));
  // Without nodes the kernel's default stays.
  std::unique_ptr<HostPool> plain = MakePool(2 * kMiB);
  absl::StatusOr<SegmentRun> other = plain->AllocateSegments(1);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(PolicyAt(other->memory.data()).first, MPOL_DEFAULT);
}

TEST(HostPoolTest, ABindingTheKernelRefusesFailsCreation) {
  if (PolicyAt(&kMiB).first < 0) GTEST_SKIP() << "this kernel has no NUMA policies";
  HostPoolOptions options = Options(2 * kMiB);
  options.numa_nodes = {1000};  // no machine has it online
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  ASSERT_FALSE(pool.ok());
  EXPECT_NE(pool.status().message().find("binding a pool segment to NUMA node(s) 1000"),
            std::string::npos)
      << pool.status();
}

// Records which nodes each segment (by address) was bound to, last binding
// last; binds nothing, so any node ids work on any machine.
class RecordingBinder {
 public:
  NumaBinder binder() {
    return [this](std::byte* at, uint64_t bytes, const std::vector<int>& nodes) {
      absl::MutexLock lock(&mu_);
      EXPECT_EQ(bytes, kMiB);
      bound_[at].push_back(nodes);
      return absl::OkStatus();
    };
  }
  std::vector<std::vector<int>> BindingsOf(const void* at) {
    absl::MutexLock lock(&mu_);
    return bound_[static_cast<const std::byte*>(at)];
  }

 private:
  absl::Mutex mu_;
  std::map<const std::byte*, std::vector<std::vector<int>>> bound_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<HostPool> SplitPool(uint64_t segments, std::vector<int> nodes,
                                    RecordingBinder* binder) {
  HostPoolOptions options = Options(segments * kMiB);
  options.numa_nodes = std::move(nodes);
  options.numa_split = true;
  options.numa_binder = binder->binder();
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

TEST(HostPoolNumaTest, ASplitPoolBindsEachPartToItsNodeAtCreationAndRenewal) {
  RecordingBinder binder;
  std::unique_ptr<HostPool> pool = SplitPool(5, {2, 7}, &binder);
  ASSERT_NE(pool, nullptr);
  // 5 segments over 2 nodes: 3 on node 2 (the remainder goes first), 2 on node 7.
  absl::StatusOr<SegmentRun> all = pool->AllocateSegments(5);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->numa_node, -1);  // across both parts
  EXPECT_TRUE(all->spans_nodes);
  std::byte* base = static_cast<std::byte*>(all->memory.data());
  for (uint64_t i = 0; i < 5; ++i) {
    const std::vector<int> node = {i < 3 ? 2 : 7};
    EXPECT_EQ(binder.BindingsOf(base + i * kMiB), std::vector<std::vector<int>>({node})) << i;
  }
  const PoolStats stats = pool->Stats();
  ASSERT_EQ(stats.numa_nodes_size(), 2);
  EXPECT_EQ(stats.numa_nodes(0).node(), 2);
  EXPECT_EQ(stats.numa_nodes(0).total_bytes(), 3 * kMiB);
  EXPECT_EQ(stats.numa_nodes(0).free_bytes(), 0u);
  EXPECT_EQ(stats.numa_nodes(0).leased_bytes(), 3 * kMiB);
  EXPECT_EQ(stats.numa_nodes(1).node(), 7);
  EXPECT_EQ(stats.numa_nodes(1).total_bytes(), 2 * kMiB);
  EXPECT_EQ(stats.numa_nodes(1).leased_bytes(), 2 * kMiB);
  // A renewal gives each segment fresh memory bound to its own node again.
  base[4 * kMiB] = std::byte{9};
  ASSERT_TRUE(pool->RenewSegments(*all).ok());
  EXPECT_EQ(base[4 * kMiB], std::byte{0});
  EXPECT_EQ(binder.BindingsOf(base + 4 * kMiB), std::vector<std::vector<int>>({{7}, {7}}));
  EXPECT_EQ(binder.BindingsOf(base), std::vector<std::vector<int>>({{2}, {2}}));
}

TEST(HostPoolNumaTest, LeasesComeFromTheCallersNodeThenTheOthersThenAcross) {
  RecordingBinder binder;
  std::unique_ptr<HostPool> pool = SplitPool(4, {0, 1}, &binder);  // 0-1 on node 0, 2-3 on 1
  ASSERT_NE(pool, nullptr);
  absl::StatusOr<SegmentRun> near = pool->AllocateSegments(1, 1);
  ASSERT_TRUE(near.ok()) << near.status();
  EXPECT_EQ(near->numa_node, 1);
  EXPECT_GE(near->first_segment, 2u);
  // Node 1 has one segment left: a run of two comes from node 0.
  absl::StatusOr<SegmentRun> pair = pool->AllocateSegments(2, 1);
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_EQ(pair->numa_node, 0);
  EXPECT_EQ(pair->first_segment, 0u);
  // A node the pool has no part on, or none: the parts in order.
  absl::StatusOr<SegmentRun> any = pool->AllocateSegments(1, 5);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(any->numa_node, 1);
  EXPECT_EQ(pool->AllocateSegments(1, 0).status().code(), absl::StatusCode::kResourceExhausted);
  const PoolStats stats = pool->Stats();
  ASSERT_EQ(stats.numa_nodes_size(), 2);
  EXPECT_EQ(stats.numa_nodes(0).free_bytes(), 0u);
  EXPECT_EQ(stats.numa_nodes(1).free_bytes(), 0u);
  EXPECT_EQ(stats.numa_nodes(0).leased_bytes(), 2 * kMiB);
  EXPECT_EQ(stats.numa_nodes(1).leased_bytes(), 2 * kMiB);
  near->memory.Reset();
  pair->memory.Reset();
  any->memory.Reset();
  // Free now: segment 1 (node 0) and 2 (node 1), side by side. No part has
  // two, so a run of two spans the parts, on no one node.
  std::vector<SegmentRun> held;
  for (int node : {0, 0, 1, 1}) {
    absl::StatusOr<SegmentRun> one = pool->AllocateSegments(1, node);
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(one->numa_node, node);
    EXPECT_EQ(one->first_segment, held.size());
    held.push_back(*std::move(one));
  }
  held[1].memory.Reset();
  held[2].memory.Reset();
  absl::StatusOr<SegmentRun> across = pool->AllocateSegments(2, 0);
  ASSERT_TRUE(across.ok()) << across.status();
  EXPECT_EQ(across->first_segment, 1u);
  EXPECT_EQ(across->numa_node, -1);
  EXPECT_TRUE(across->spans_nodes);
  EXPECT_FALSE(held[0].spans_nodes);
}

TEST(HostPoolNumaTest, ASplitNeedsASegmentPerNode) {
  RecordingBinder binder;
  HostPoolOptions options = Options(2 * kMiB);
  options.numa_nodes = {0, 1, 2};
  options.numa_split = true;
  options.numa_binder = binder.binder();
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pool.status().message().find("cannot be split over 3 NUMA nodes"), std::string::npos)
      << pool.status();
}

TEST(HostPoolNumaTest, PartsAreReportedForSplitAndSingleNodePoolsOnly) {
  RecordingBinder binder;
  HostPoolOptions bound = Options(2 * kMiB);
  bound.numa_nodes = {3};
  bound.numa_binder = binder.binder();
  absl::StatusOr<std::unique_ptr<HostPool>> one = CreateHostPool(bound);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ((*one)->Stats().numa_nodes_size(), 1);
  EXPECT_EQ((*one)->Stats().numa_nodes(0).node(), 3);
  EXPECT_EQ((*one)->Stats().numa_nodes(0).total_bytes(), 2 * kMiB);
  absl::StatusOr<SegmentRun> run = (*one)->AllocateSegments(1, 0);
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(run->numa_node, 3);  // where it is, whatever the caller asked
  HostPoolOptions interleaved = bound;
  interleaved.numa_nodes = {0, 1};
  absl::StatusOr<std::unique_ptr<HostPool>> spread = CreateHostPool(interleaved);
  ASSERT_TRUE(spread.ok()) << spread.status();
  EXPECT_EQ((*spread)->Stats().numa_nodes_size(), 0);
  absl::StatusOr<SegmentRun> spread_run = (*spread)->AllocateSegments(1, 0);
  ASSERT_TRUE(spread_run.ok());
  EXPECT_EQ(spread_run->numa_node, -1);
  EXPECT_FALSE(spread_run->spans_nodes);  // not split: no parts to span
  EXPECT_EQ(MakePool(2 * kMiB)->Stats().numa_nodes_size(), 0);
}

// The real kernel: a split over node 0 (a one-node machine's split) binds
// every segment there.
TEST(HostPoolNumaTest, ASplitOverNodeZeroIsBoundThereByTheKernel) {
  if (PolicyAt(&kMiB).first < 0) GTEST_SKIP() << "this kernel has no NUMA policies";
  HostPoolOptions options = Options(2 * kMiB);
  options.numa_nodes = {0};
  options.numa_split = true;
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<SegmentRun> run = (*pool)->AllocateSegments(2, 0);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->numa_node, 0);
  EXPECT_EQ(PolicyAt(static_cast<std::byte*>(run->memory.data()) + kMiB),
            std::make_pair(int{MPOL_BIND}, 1ul));
}

}  // namespace
}  // namespace actstash::server
