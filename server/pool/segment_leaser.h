// SegmentLeaser: the segment side of a pool, whole segments leased to
// sessions for the zero-copy data plane (LeaseManager). The host pool's
// segments are memfds that reach a client as fds (FdSegmentLeaser); a device
// pool's are offsets into one CUDA IPC region.
#ifndef ACTSTASH_SERVER_POOL_SEGMENT_LEASER_H_
#define ACTSTASH_SERVER_POOL_SEGMENT_LEASER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "server/pool/memory_pool.h"

namespace actstash::server {

// A run of whole, contiguous pool segments (a lease's memory).
struct SegmentRun {
  Allocation memory;
  uint32_t first_segment = 0;
  uint32_t count = 0;
  bool needs_scrub = false;
  int numa_node = -1;        // the node all of its memory is bound to; -1: none or several
  bool spans_nodes = false;  // it lies across the parts of a pool split per node
};

// Thread-safe: every member may be called from any thread.
class SegmentLeaser {
 public:
  virtual ~SegmentLeaser() = default;

  // Reserves `count` (>= 1) contiguous whole segments. A full or too
  // fragmented pool is RESOURCE_EXHAUSTED whose message gives the requested,
  // free and largest free bytes. The run's needs_scrub says whether any of
  // its segments held other data since it was last renewed: the caller must
  // then RenewSegments before the segments leave the daemon. The caller must
  // also RenewSegments before letting go of a run that did leave (so that
  // free pool memory is never memory a client can reach).
  // A pool split per NUMA node takes the run from node `numa_node`'s part
  // first, then from the others (-1 or a node it has no part on: no
  // preference); other pools ignore the node.
  virtual absl::StatusOr<SegmentRun> AllocateSegments(uint32_t count, int numa_node) = 0;
  absl::StatusOr<SegmentRun> AllocateSegments(uint32_t count) {
    return AllocateSegments(count, -1);
  }
  // Gives the run's segments fresh, zeroed memory (what that means is the
  // pool's). The caller holds the run exclusively. May be slow (~20 ms per
  // 64 MiB on the host): call it on a work thread.
  virtual absl::Status RenewSegments(const SegmentRun& run) = 0;
  virtual uint64_t segment_bytes() const = 0;
  virtual uint32_t segment_count() const = 0;
};

// A SegmentLeaser whose segments are memfds (the host pool): a lease reaches
// its client as the segments' fds (AttachServer).
class FdSegmentLeaser : public SegmentLeaser {
 public:
  // A duplicate of the memfd of segment `index` (< segment_count()), owned by
  // the caller, or INTERNAL. Call it while holding the segment's run, so
  // the fd is that run's (renewal replaces the pool's fds).
  virtual absl::StatusOr<UniqueFd> DupSegmentFd(uint32_t index) const = 0;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_SEGMENT_LEASER_H_
