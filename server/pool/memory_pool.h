// What the daemon's pools share: their numbers (PoolStats) and the
// Allocation, a move-only handle on a range of pool memory that gives the
// range back when destroyed (memory leaves a pool only as one). Also the
// host pool's object side, ObjectAllocator; the segment side of the pools is
// in segment_leaser.h.
#ifndef ACTSTASH_SERVER_POOL_MEMORY_POOL_H_
#define ACTSTASH_SERVER_POOL_MEMORY_POOL_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "actstash/v1/stash.pb.h"

namespace actstash::server {

// A pool's numbers are the wire message itself: a pool fills what it knows
// (totals, free, segments, locked, pinned, allocations); the daemon's stats
// (server/rpc/stats.h) add what the lease managers know (leases, leased and
// renewing bytes). A new counter is a proto field plus the line that sets it.
using PoolStats = v1::PoolStats;

class Allocation;

class AllocationOwner;

// A live range of pool memory. Move-only; the destructor gives the range back
// to its owner (the pool that made it), which must outlive it. A
// default-constructed or moved-from Allocation owns nothing; an Allocation of
// 0 bytes owns nothing and has a null data(). Not thread-safe itself;
// distinct Allocations may be used and destroyed on any threads concurrently.
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
  friend class AllocationOwner;
  Allocation(AllocationOwner* owner, std::byte* data, uint64_t offset, uint64_t size)
      : owner_(owner), data_(data), offset_(offset), size_(size) {}

  AllocationOwner* owner_ = nullptr;
  std::byte* data_ = nullptr;
  uint64_t offset_ = 0;
  uint64_t size_ = 0;
};

// What a pool derives from (privately) to hand out Allocations: the one
// place their ranges come back to. Not an interface for callers.
class AllocationOwner {
 protected:
  AllocationOwner() = default;
  ~AllocationOwner() = default;
  static Allocation MakeAllocation(AllocationOwner* owner, std::byte* data, uint64_t offset,
                                   uint64_t size) {
    return Allocation(owner, data, offset, size);
  }

 private:
  friend class Allocation;
  // Called once per non-empty Allocation when it is destroyed or reset, on
  // any thread.
  virtual void Free(uint64_t offset) = 0;
};

// Pool memory for stored objects (Put, restores of spilled objects), by the
// byte: the host pool. Thread-safe: every member may be called from any
// thread.
class ObjectAllocator {
 public:
  virtual ~ObjectAllocator() = default;

  // Reserves `nbytes` of pool memory (any value; 0 gives an empty
  // Allocation). A full or too fragmented pool is RESOURCE_EXHAUSTED whose
  // message gives the requested, free and largest free bytes.
  virtual absl::StatusOr<Allocation> Allocate(uint64_t nbytes) = 0;
  // The whole pool's numbers: objects and leased segments alike.
  virtual PoolStats Stats() const = 0;
};

inline Allocation& Allocation::operator=(Allocation&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = other.owner_;
    data_ = other.data_;
    offset_ = other.offset_;
    size_ = other.size_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

inline void Allocation::Reset() {
  if (owner_ != nullptr) owner_->Free(offset_);
  owner_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_MEMORY_POOL_H_
