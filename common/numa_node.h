// The NUMA node a process copies from: its GPU's (the PCI device's node in
// sysfs) or, for CPU work, the node of the CPU it runs on. The daemon reads
// its GPUs' nodes for the pool's placement (server/pool/numa_topology.h); a
// client names its own node when it leases (LeaseRequest.numa_node).
// Thread-safety: every function may be called from any thread.
#ifndef ACTSTASH_COMMON_NUMA_NODE_H_
#define ACTSTASH_COMMON_NUMA_NODE_H_

#include <atomic>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace actstash {

// The node of PCI device `bus_id` ("0000:17:00.0"), from
// <sysfs_root>/bus/pci/devices/<bus_id>/numa_node: -1 when the file is
// missing or says -1 (single-node machines); INVALID_ARGUMENT naming the
// file when it holds anything but a number >= -1, and for a bus id that
// is not a plain file name. `sysfs_root` is a parameter for tests.
absl::StatusOr<int> ReadPciNumaNode(const std::string& sysfs_root, absl::string_view bus_id);

// The node of the CPU the calling thread runs on now (getcpu), or -1.
int CurrentCpuNumaNode();

// In a CUDA build, on a thread with a current CUDA context: the node of
// its device (looked up once per device). Else, or when sysfs does not say,
// -1. Creates no CUDA context.
int CudaThreadNumaNode();

// The node a client names in its leases (LeaseRequest.numa_node). A thread
// with a CUDA context names its device's node, which the client then
// remembers; a thread without one (a CPU trainer, or the store's background
// threads: read-ahead, retention) names the remembered node or, before there
// is one, the node of the CPU it runs on, which is then remembered (so that
// a thread that migrates, or a background thread on another socket, does
// not move the client's leases). `configured` >= 0
// (ClientOptions::numa_node) overrides all of it. Thread-safe.
class LeaseNumaNode {
 public:
  explicit LeaseNumaNode(int configured) : configured_(configured) {}
  LeaseNumaNode(const LeaseNumaNode&) = delete;
  LeaseNumaNode& operator=(const LeaseNumaNode&) = delete;

  // For the calling thread; -1 when nothing is known.
  int Get() { return Choose(CudaThreadNumaNode(), CurrentCpuNumaNode()); }
  // The rule, given the calling thread's CUDA device node and CPU node
  // (-1: unknown).
  int Choose(int cuda_node, int cpu_node);

 private:
  const int configured_;
  std::atomic<int> remembered_{-1};
};

}  // namespace actstash

#endif  // ACTSTASH_COMMON_NUMA_NODE_H_
