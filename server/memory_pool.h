// MemoryPool: where the daemon keeps stored bytes. Memory leaves a pool only
// as an Allocation, a move-only handle that gives the range back when
// destroyed.
#ifndef ACTSTASH_SERVER_MEMORY_POOL_H_
#define ACTSTASH_SERVER_MEMORY_POOL_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "actstash/v1/stash.pb.h"
#include "common/unique_fd.h"

namespace actstash::server {

// A pool's numbers are the wire message itself: a pool fills what it knows
// (totals, free, segments, locked, pinned, allocations); the daemon's stats
// (stash_core.h) add what the lease managers know (leases, leased and
// renewing bytes). A new counter is a proto field plus the line that sets it.
using PoolStats = v1::PoolStats;

class Allocation;

class MemoryPool;

// A live range of pool memory. Move-only; the destructor returns the range to
// its pool, which must outlive it. A default-constructed or moved-from
// Allocation owns nothing; an Allocation of 0 bytes owns nothing and has a
// null data().  Not thread-safe itself; distinct Allocations may be used and
// destroyed on any threads concurrently.
class Allocation {
 public:
  Allocation() = default;
  ~Allocation() { Reset(); }
  Allocation(Allocation&& other) noexcept { *this = std::move(other); }
  Allocation& operator=(Allocation&& other) noexcept;
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  uint64_t offset() const { return offset_; }
  // Gives the range back now.
  void Reset();

 private:
  friend class MemoryPool;
  Allocation(MemoryPool* pool, std::byte* data, uint64_t offset, uint64_t size)
      : pool_(pool), data_(data), offset_(offset), size_(size) {}

  MemoryPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  uint64_t offset_ = 0;
  uint64_t size_ = 0;
};

// A run of whole, contiguous pool segments (a lease's memory).
struct SegmentRun;

// Thread-safe: every member may be called from any thread.
class MemoryPool {
 public:
  virtual ~MemoryPool() = default;

  // Reserves `nbytes` of pool memory (any value; 0 gives an empty
  // Allocation). A full or too fragmented pool is RESOURCE_EXHAUSTED whose
  // message gives the requested, free and largest free bytes.
  virtual absl::StatusOr<Allocation> Allocate(uint64_t nbytes) = 0;
  virtual PoolStats Stats() const = 0;

  // Reserves `count` (>= 1) contiguous whole segments. RESOURCE_EXHAUSTED as
  // Allocate. The run's needs_scrub says whether any of its segments held
  // inline objects since it was last renewed: the caller must then
  // RenewSegments before the segments' fds leave the daemon. The caller must
  // also RenewSegments before letting go of a run whose fds did leave (so
  // that free pool memory is never memory a client can reach).
  virtual absl::StatusOr<SegmentRun> AllocateSegments(uint32_t count) = 0;
  // Gives the run's segments fresh, zeroed memfds (mapped, populated and
  // locked like the rest of the pool) and empties and drops the old ones
  // (their pages are punched out: a client that kept an old fd or mapping
  // sees zeros and can reach nothing the daemon or another session uses,
  // and whatever it writes there is its own memory). The caller holds the
  // run exclusively. Runs on a work thread: it costs ~20 ms per 64 MiB.
  virtual absl::Status RenewSegments(const SegmentRun& run) = 0;
  // A duplicate of the memfd of segment `index` (< Stats().segments), owned
  // by the caller, or INTERNAL. Call it while holding the segment's run, so
  // the fd is that run's (renewal replaces the pool's fds).
  virtual absl::StatusOr<UniqueFd> DupSegmentFd(uint32_t index) const = 0;
  virtual uint64_t segment_bytes() const = 0;

 protected:
  static Allocation MakeAllocation(MemoryPool* pool, std::byte* data, uint64_t offset,
                                   uint64_t size) {
    return Allocation(pool, data, offset, size);
  }

 private:
  friend class Allocation;
  // Called once per non-empty Allocation when it is destroyed or reset.
  virtual void Free(uint64_t offset) = 0;
};

struct SegmentRun {
  Allocation memory;
  uint32_t first_segment = 0;
  uint32_t count = 0;
  bool needs_scrub = false;
};

inline Allocation& Allocation::operator=(Allocation&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = other.pool_;
    data_ = other.data_;
    offset_ = other.offset_;
    size_ = other.size_;
    other.pool_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

inline void Allocation::Reset() {
  if (pool_ != nullptr) pool_->Free(offset_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_MEMORY_POOL_H_
