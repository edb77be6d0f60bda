// RangeAllocator: a best-fit offset allocator with coalescing over [0, capacity).
//
// The host memory pool uses one RangeAllocator to place objects inside a single
// contiguous mapping. The allocator deals only in offsets; it never touches the
// memory it describes and owns nothing but its own bookkeeping.
//
// Thread safety: NOT thread-safe. All calls, including the const accessors,
// must be serialized by the caller (the pool holds its own mutex around it).
//
// Contract violations (bad configuration, size 0, bad alignment, freeing an
// offset that is not the start of a live allocation) are broken invariants of
// the daemon, not client errors: they print file:line and a message to stderr
// and abort the process. Client-controlled values must therefore be validated
// by the caller before they reach Free(); Allocate() is safe for any size > 0.

#ifndef ACTSTASH_SERVER_POOL_RANGE_ALLOCATOR_H_
#define ACTSTASH_SERVER_POOL_RANGE_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace actstash::server {

class RangeAllocator {
 public:
  // Creates an allocator whose whole range [0, capacity) is free.
  // Requires: granule > 0 and a power of two; capacity > 0 and a multiple of
  // granule. Aborts otherwise.
  RangeAllocator(uint64_t capacity, uint64_t granule);

  RangeAllocator(const RangeAllocator&) = delete;
  RangeAllocator& operator=(const RangeAllocator&) = delete;

  // Reserves a range of at least `size` bytes. The size is rounded up to a
  // multiple of granule(); the returned offset is a multiple of `alignment`.
  //
  // Requires: size > 0 (aborts on 0). `alignment` is 0 (meaning granule()) or a
  // power of two >= granule() (aborts otherwise).
  //
  // Placement is best fit: the smallest free block that can hold the rounded
  // size plus the padding needed to align it; ties go to the lowest offset. The
  // padding in front of the placed range stays free as its own block.
  //
  // Returns std::nullopt when no free block can hold the request, including
  // for sizes larger than capacity() (no arithmetic wraps, even for
  // UINT64_MAX). Cost: O(log n) for alignment == granule(); with a larger
  // alignment, candidate blocks are scanned in best-fit order until one fits.
  std::optional<uint64_t> Allocate(uint64_t size, uint64_t alignment = 0);

  // As Allocate, but the whole range lies within the window [begin, end)
  // (a NUMA node's part of a pool): best fit over the free blocks' parts
  // inside the window, ties to the lowest offset. A window outside
  // [0, capacity) is clipped to it. Cost: O(k log n) for the k free blocks
  // that meet the window.
  std::optional<uint64_t> AllocateWithin(uint64_t size, uint64_t alignment, uint64_t begin,
                                         uint64_t end);

  // Returns the range that Allocate() gave at `offset` and coalesces it with
  // free neighbours on both sides. O(log n).
  // Requires: `offset` is the start of a live allocation; aborts otherwise
  // (this includes double frees and offsets inside an allocation).
  void Free(uint64_t offset);

  // Rounded size of the live allocation starting at `offset`, or std::nullopt
  // if no live allocation starts there.
  std::optional<uint64_t> AllocationSize(uint64_t offset) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t granule() const { return granule_; }

  // Sum of the rounded sizes of all live allocations.
  uint64_t used_bytes() const { return used_bytes_; }
  // capacity() - used_bytes(). Alignment padding counts as free.
  uint64_t free_bytes() const { return capacity_ - used_bytes_; }
  // Free bytes inside the window [begin, end). O(k log n), k as above.
  uint64_t FreeBytesWithin(uint64_t begin, uint64_t end) const;
  // Size of the largest maximal free block (0 when full). O(1).
  uint64_t largest_free_block() const;
  // Number of maximal free blocks; free blocks are always fully coalesced.
  size_t free_block_count() const { return free_by_offset_.size(); }
  // Number of live allocations.
  size_t allocation_count() const { return allocations_.size(); }

  // Verifies internal consistency: free blocks and allocations are granule
  // aligned, in bounds, non-empty and non-overlapping; free blocks are never
  // adjacent (fully coalesced); the size index mirrors the offset index; free
  // blocks and allocations together tile [0, capacity) exactly and
  // used_bytes() matches. Returns true when consistent. O(n log n); for tests.
  bool CheckInvariants() const;

 private:
  void InsertFreeBlock(uint64_t offset, uint64_t size);
  void EraseFreeBlock(std::map<uint64_t, uint64_t>::iterator it);
  uint64_t RoundedSize(uint64_t size, uint64_t* alignment) const;
  // Takes [offset, offset + rounded) out of the free block at `block_offset`
  // (which holds it); what is left on either side stays free.
  uint64_t Take(uint64_t block_offset, uint64_t offset, uint64_t rounded);

  const uint64_t capacity_;
  const uint64_t granule_;
  uint64_t used_bytes_ = 0;

  // Free blocks: offset -> size, and the (size, offset) index for best fit.
  std::map<uint64_t, uint64_t> free_by_offset_;
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;
  // Live allocations: offset -> rounded size.
  std::map<uint64_t, uint64_t> allocations_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_RANGE_ALLOCATOR_H_
