// One host pool segment's memory: a fresh memfd mapped at a fixed address,
// bound to NUMA nodes before its pages are touched, populated and locked.
// Used by the host pool at creation and at every renewal. Thread-safety: the
// functions touch only the memory they are given, which the caller holds.
#ifndef ACTSTASH_SERVER_POOL_POOL_SEGMENT_H_
#define ACTSTASH_SERVER_POOL_POOL_SEGMENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/errno_status.h"
#include "common/unique_fd.h"

namespace actstash::server {

// Binds the shared memory mapped at [at, at + bytes) to `nodes`: one node
// binds (MPOL_BIND), several interleave (MPOL_INTERLEAVE). For a memfd the
// policy is the file's, so every mapping of it, the clients' included,
// places pages the same way. Tests replace it (HostPoolOptions::numa_binder)
// to fake a machine's nodes.
using NumaBinder =
    std::function<absl::Status(std::byte* at, uint64_t bytes, const std::vector<int>& nodes)>;
absl::Status MbindToNodes(std::byte* at, uint64_t bytes, const std::vector<int>& nodes);

// Creates a zeroed memfd for segment `index` and maps it at `at` (MAP_FIXED
// over whatever was there) with 2 MiB pages where the node allows them
// (common/huge_pages.h), bound to `nodes` with `binder` if any nodes are
// given (else populated by the kernel's default policy), populated, and
// mlocked if `lock` (*locked says whether that worked).
absl::StatusOr<UniqueFd> MapFreshSegment(std::byte* at, uint64_t index, uint64_t bytes, bool lock,
                                         bool* locked, const std::vector<int>& nodes,
                                         const NumaBinder& binder);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_POOL_SEGMENT_H_
