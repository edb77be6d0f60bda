// The machine's NUMA nodes and the nodes its GPUs sit on, read from sysfs,
// and where the host pool's pages go (--numa). Pinned memory on the far
// socket copies ~30% slower; the pool is placed near the GPUs that copy into
// it; with GPUs on several nodes the pool is split, one part bound to each
// node, and a session leases from the part on its own node.
#ifndef ACTSTASH_SERVER_POOL_NUMA_TOPOLOGY_H_
#define ACTSTASH_SERVER_POOL_NUMA_TOPOLOGY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace actstash::server {

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;      // ascending
  uint64_t memory_bytes = 0;  // MemTotal of the node; 0 when sysfs does not say
};

// A GPU (an NVIDIA display or 3D controller on the PCI bus).
struct GpuPlacement {
  std::string bus_id;  // "0000:17:00.0"
  int node = -1;       // -1: the firmware does not say (single-node machines)
};

// Plain data; any thread.
struct NumaTopology {
  std::vector<NumaNode> nodes;     // ascending ids; empty on a kernel without NUMA
  std::vector<GpuPlacement> gpus;  // by bus id
  // The node of `cpu`, or -1.
  int NodeOfCpu(int cpu) const;
  // One line for the start-up log: "2 NUMA nodes (0: cpus 0-31, 256.0 GiB;
  // 1: ...); GPUs 0000:17:00.0 on node 0, ...".
  std::string Describe() const;
};

// Reads <sysfs_root>/devices/system/node (the nodes in `online`, their
// `cpulist` and `meminfo`) and <sysfs_root>/bus/pci/devices (vendor 0x10de,
// class 0x0300xx or 0x0302xx: their `numa_node`). A missing node directory
// gives no nodes; a file that is there but malformed is INVALID_ARGUMENT
// naming it. `sysfs_root` is a parameter so that tests build a fake machine.
absl::StatusOr<NumaTopology> ReadNumaTopology(const std::string& sysfs_root = "/sys");

// --numa: auto (the GPUs' node, or split over the GPUs' nodes), off,
// split (one part per node), interleave (over every node), or a node number.
struct NumaSetting {
  enum class Mode { kAuto, kOff, kSplit, kInterleave, kNode };
  Mode mode = Mode::kAuto;
  int node = -1;  // kNode
};
absl::StatusOr<NumaSetting> ParseNumaSetting(absl::string_view text);

// Where the pool's pages go: HostPoolOptions::numa_nodes and numa_split
// (no nodes: the kernel's default) and why, for the start-up log.
struct PoolPlacement {
  std::vector<int> nodes;
  bool split = false;  // one part of the pool per node, each bound to it
  std::string why;
};
// auto: with one node (or none), nothing; else bound to the node of every
// GPU when they share one, split over the GPUs' nodes when they do not, and
// nothing when no GPU's node is known. A node number must be one of the
// topology's nodes (INVALID_ARGUMENT naming them otherwise); split and
// interleave take them all (split: FAILED_PRECONDITION without nodes).
absl::StatusOr<PoolPlacement> ChoosePoolPlacement(const NumaSetting& setting,
                                                  const NumaTopology& topology);

// Parses a kernel CPU or node list ("0-3,8,10-11", "0", "" for none) into
// ascending ids. INVALID_ARGUMENT on anything else.
absl::StatusOr<std::vector<int>> ParseIdList(absl::string_view text);

// The list back in the kernel's form ("0-3,8").
std::string FormatIdList(const std::vector<int>& ids);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_NUMA_TOPOLOGY_H_
