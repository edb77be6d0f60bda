// The host memory pool: pinned (mlock'ed) shared memory in memfd segments,
// which holds both the stored objects and the host leases.
#ifndef ACTSTASH_SERVER_POOL_HOST_POOL_H_
#define ACTSTASH_SERVER_POOL_HOST_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/pinned_registrar.h"
#include "common/tristate.h"
#include "common/unique_fd.h"
#include "server/pool/memory_pool.h"
#include "server/pool/pool_segment.h"
#include "server/pool/segment_leaser.h"

namespace actstash::server {

struct HostPoolOptions {
  uint64_t pool_bytes = 0;               // rounded down to whole segments; >= 1 segment
  uint64_t segment_bytes = 64ull << 20;  // a power of two, a multiple of the page size
  // mlock of the segments: kAuto tries and, on failure, logs a warning and
  // keeps the memory unlocked; kOn fails pool creation; kOff never locks.
  Tristate mlock = Tristate::kAuto;
  uint64_t alignment = 256;  // every allocation starts at a multiple (power of two)
  // Registers every segment with CUDA (cudaHostRegister) when set; not
  // owned, must outlive the pool. Null: no registration.
  PinnedRegistrar* cuda_registrar = nullptr;
  // A segment that cannot be registered fails pool creation (and a renewal
  // that cannot register it again fails that renewal, so the segment is
  // never handed out unregistered). Otherwise: one warning, and the segment
  // stays unregistered (PoolStats::cuda_pinned_bytes says how much is).
  bool require_cuda_pinned = false;
  // NUMA nodes the segments' pages are bound to (mbind before they are
  // touched, at creation and at every renewal): one node binds them there,
  // several interleave them over those. Empty: the kernel's default policy
  // (the node of the CPU that touches a page first). A binding the kernel
  // refuses fails pool creation.
  std::vector<int> numa_nodes;
  // With numa_split, the segments are instead divided into one part per
  // entry of numa_nodes, in that order (as even as whole segments allow;
  // INVALID_ARGUMENT with fewer segments than nodes), each part bound to its
  // node alone. AllocateSegments takes a run from the caller's node's part
  // first; PoolStats::numa_nodes reports each part.
  bool numa_split = false;
  // How a segment is bound; null: mbind (MbindToNodes). Tests fake nodes
  // this machine does not have.
  NumaBinder numa_binder;
};

// The host pool is both an ObjectAllocator (inline objects, by the byte)
// and an FdSegmentLeaser (whole memfd segments for leases), over one range:
// callers take the side they use. Thread-safe. A run's needs_scrub says
// whether any of its segments held inline objects since it was last
// renewed. RenewSegments gives the run's segments fresh, zeroed memfds
// (mapped, populated and locked like the rest of the pool) and empties and
// drops the old ones (their pages are punched out: a client that kept an
// old fd or mapping sees zeros and can reach nothing the daemon or another
// session uses, and whatever it writes there is its own memory).
class HostPool : public ObjectAllocator, public FdSegmentLeaser {
 public:
  // Take-over (server/handover): what a successor needs to serve this pool's
  // memory, and how it takes the runs of live leases back.
  //
  // Duplicates of every segment's memfd, in segment order. Call it while no
  // renewal runs (renewal replaces fds): the daemon has stopped serving.
  virtual absl::StatusOr<std::vector<UniqueFd>> DupSegmentFds() const = 0;
  // The segments that held inline objects since their last renewal.
  virtual std::vector<uint32_t> HeldInlineSegments() const = 0;
  // The run [first, first + count) as a live lease's, allocated exactly
  // there (a pool made by AdoptHostPool, before it serves anything).
  // INVALID_ARGUMENT when it is out of range or meets a run already taken.
  virtual absl::StatusOr<SegmentRun> AdoptRun(uint32_t first, uint32_t count) = 0;
  // An inline object's `nbytes` at `offset`, allocated exactly there (as
  // AdoptRun). INVALID_ARGUMENT when misaligned, out of range or meeting a
  // range already taken.
  virtual absl::StatusOr<Allocation> AdoptAllocation(uint64_t offset, uint64_t nbytes) = 0;
  // Starts the work the pool runs on its own thread (an adopted pool's
  // mlock): once the daemon serves. FinishBackgroundWork waits for it to
  // end: before the process exits. Both from the owner's thread.
  virtual void StartBackgroundWork() {}
  virtual void FinishBackgroundWork() {}
};

// Creates the pool: one memfd per segment, mapped MAP_SHARED|MAP_POPULATE
// back to back into one reserved address range (so one allocation may span
// segments), then mlock()ed according to options.mlock. All memory is
// committed up front. Each segment is then registered on its own with
// options.cuda_registrar (renewal remaps one segment in place, so it is
// unregistered before and registered again after; everything is
// unregistered before the range is unmapped). Errors: INVALID_ARGUMENT for
// inconsistent options, RESOURCE_EXHAUSTED / INTERNAL (with errno text) when
// the kernel refuses, the registrar's error when require_cuda_pinned.
// The pool must outlive every Allocation it hands out.
absl::StatusOr<std::unique_ptr<HostPool>> CreateHostPool(const HostPoolOptions& options);

// A pool over another daemon's segments (take-over): `segments` are its
// memfds in order, mapped (not renewed: they hold clients' data, and not
// populated) where CreateHostPool would map fresh ones, registered as it
// does, and mlocked per options.mlock on a thread of its own once
// StartBackgroundWork is called (so that the successor serves sooner; a
// failure is logged, not returned). A segment
// whose fd is not valid (crash recovery: none was kept, or its memory may
// still be mapped by a client that returned it) gets a fresh memfd, as
// CreateHostPool makes them. NUMA placement travels with the
// memfds (their policy is the file's), so options.numa_* only say how renewals bind. `held_inline`:
// segments to scrub before they are leased. INVALID_ARGUMENT when the
// options' pool has another number of segments, or a memfd another size.
absl::StatusOr<std::unique_ptr<HostPool>> AdoptHostPool(const HostPoolOptions& options,
                                                        std::vector<UniqueFd> segments,
                                                        const std::vector<uint32_t>& held_inline);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_HOST_POOL_H_
