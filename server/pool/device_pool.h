// DevicePool: the segments of one GPU memory region (--device-pool GPU:SIZE),
// leased to sessions like host segments (LeaseManager over this
// SegmentLeaser) and reached by clients through the region's CUDA IPC
// handle plus offsets.
//
// Trust: a process that opened the IPC handle keeps its mapping of the whole
// region (CUDA cannot revoke it, nor map only part of it). Returned segments
// are zeroed before the next tenant gets them, but a client that keeps its
// mapping can read and write every segment of the pool at any time. The
// device pool is therefore for trusted, same-uid trainers only (use
// --allow-uid); the host pool's isolation (one memfd, one tenant) does not
// hold here.
#ifndef ACTSTASH_SERVER_POOL_DEVICE_POOL_H_
#define ACTSTASH_SERVER_POOL_DEVICE_POOL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/pool/device_memory.h"
#include "server/pool/memory_pool.h"
#include "server/pool/range_allocator.h"
#include "server/pool/segment_leaser.h"

namespace actstash::server {

struct DevicePoolOptions {
  int device = 0;
  uint64_t pool_bytes = 0;  // rounded down to whole segments; >= 1 segment
  uint64_t segment_bytes = 64ull << 20;
};

// A SegmentLeaser only: no inline objects, and no fds (its segments reach
// clients as the region's IPC handle plus offsets). Thread-safe. The region
// is allocated, zeroed and exported once at creation and freed only in the
// destructor (which requires that no run is alive: leases hold theirs).
// `RenewSegments` zeroes the run in place: the "fresh memory" of a device
// segment.
class DevicePool final : public SegmentLeaser, private AllocationOwner {
 public:
  // FAILED_PRECONDITION when `options.device` is not one of memory's
  // devices, INVALID_ARGUMENT for sizes that make no pool, the device's
  // error when it cannot allocate, zero or export. `memory` must outlive the
  // pool.
  static absl::StatusOr<std::unique_ptr<DevicePool>> Create(DeviceMemory* memory,
                                                            const DevicePoolOptions& options);
  ~DevicePool() override;

  // RESOURCE_EXHAUSTED with the numbers when there is no room. needs_scrub
  // is always false: segments are zeroed when they come back.
  using SegmentLeaser::AllocateSegments;
  absl::StatusOr<SegmentRun> AllocateSegments(uint32_t count, int numa_node) override;
  // Zeroes the run's segments (the caller holds the run).
  absl::Status RenewSegments(const SegmentRun& run) override;
  uint64_t segment_bytes() const override { return segment_bytes_; }
  uint32_t segment_count() const override { return static_cast<uint32_t>(segments_); }
  PoolStats Stats() const;

  int device() const { return region_.device; }
  uint64_t region_bytes() const { return region_.bytes; }
  // The region's IPC handle (kIpcHandleBytes bytes), the same for every grant.
  const std::string& ipc_handle() const { return ipc_handle_; }

 private:
  DevicePool(DeviceMemory* memory, DeviceRegion region, std::string ipc_handle,
             uint64_t segment_bytes);
  void Free(uint64_t offset) override;

  DeviceMemory& memory_;
  const DeviceRegion region_;
  const std::string ipc_handle_;
  const uint64_t segment_bytes_;
  const uint64_t segments_;
  mutable absl::Mutex mu_;
  RangeAllocator allocator_ ABSL_GUARDED_BY(mu_);  // in segments, not bytes
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_DEVICE_POOL_H_
