// The NUMA node a process copies from: its GPU's (the PCI device's node in
// sysfs) or, for CPU work, the node of the CPU it runs on. The daemon reads
// its GPUs' nodes for the pool's placement (server/numa_topology.h); a
// client names its own node when it leases (LeaseRequest.numa_node).
// Thread-safety: every function may be called from any thread.
#ifndef ACTSTASH_COMMON_NUMA_NODE_H_
#define ACTSTASH_COMMON_NUMA_NODE_H_

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

// The node the calling thread copies from: in a CUDA build, on a thread
// with a current CUDA context, its device's node (looked up once per
// device); else its CPU's. -1 when neither is known. Creates no CUDA
// context.
int CallerNumaNode();

}  // namespace actstash

#endif  // ACTSTASH_COMMON_NUMA_NODE_H_
