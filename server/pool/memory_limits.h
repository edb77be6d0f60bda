// What the daemon may really use of the machine's memory, for sizing its pool:
// physical memory, bounded by the memory limit of the cgroup it runs in (a
// container's limit), and what it may pin (RLIMIT_MEMLOCK). A pool sized
// against the machine in a smaller container gets the daemon killed by the
// OOM killer the first time it is filled.
//
// Thread-safety: free functions; the struct is a value.
#ifndef ACTSTASH_SERVER_POOL_MEMORY_LIMITS_H_
#define ACTSTASH_SERVER_POOL_MEMORY_LIMITS_H_

#include <cstdint>
#include <string>

namespace actstash::server {

struct MemoryLimits {
  uint64_t physical_bytes = 0;  // sysconf; 0 when unknown
  // The smallest memory limit on the way from the daemon's cgroup to the
  // root of the hierarchy it sees (cgroup v2 memory.max, v1
  // memory.limit_in_bytes); 0: none set.
  uint64_t cgroup_bytes = 0;
  std::string cgroup_file;  // the file that holds cgroup_bytes
  // RLIMIT_MEMLOCK's soft limit; UINT64_MAX: unlimited.
  uint64_t memlock_bytes = UINT64_MAX;

  // What percentages and the default pool are taken of: the cgroup limit
  // when one is set below physical memory, else physical memory.
  uint64_t usable_bytes() const;
  // For the start-up log: which limit applied and what can be pinned, e.g.
  // "the cgroup limit 2.0 GiB (/sys/fs/cgroup/memory/job/memory.limit_in_bytes;
  // physical memory 23.4 GiB); RLIMIT_MEMLOCK unlimited".
  std::string Describe() const;
};

// Reads the limits of the calling process. `root` is prefixed to
// /proc/self/cgroup and /sys/fs/cgroup (tests pass a fake tree; "" in
// production). Both hierarchies are read (v2's unified one at /sys/fs/cgroup
// or, on hybrid hosts, /sys/fs/cgroup/unified; v1's memory controller at
// /sys/fs/cgroup/memory) and the smallest limit wins. Missing or unreadable
// files, "max" and v1's "unlimited" (>= 2^62) mean no limit.
MemoryLimits ReadMemoryLimits(const std::string& root = "");

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_MEMORY_LIMITS_H_
