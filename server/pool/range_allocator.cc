#include "server/pool/range_allocator.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "common/check.h"

namespace actstash::server {
namespace {

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

// Bytes needed to move `offset` up to the next multiple of `alignment` (a power
// of two). Never overflows: the result is < alignment.
uint64_t AlignPadding(uint64_t offset, uint64_t alignment) {
  return (alignment - (offset & (alignment - 1))) & (alignment - 1);
}

}  // namespace

RangeAllocator::RangeAllocator(uint64_t capacity, uint64_t granule)
    : capacity_(capacity), granule_(granule) {
  ACTSTASH_CHECK(IsPowerOfTwo(granule), "granule must be a power of two > 0");
  ACTSTASH_CHECK(capacity > 0, "capacity must be > 0");
  ACTSTASH_CHECK(capacity % granule == 0, "capacity must be a multiple of granule");
  InsertFreeBlock(0, capacity);
}

void RangeAllocator::InsertFreeBlock(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void RangeAllocator::EraseFreeBlock(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

uint64_t RangeAllocator::RoundedSize(uint64_t size, uint64_t* alignment) const {
  ACTSTASH_CHECK(size > 0, "Allocate size must be > 0");
  if (*alignment == 0) *alignment = granule_;
  ACTSTASH_CHECK(IsPowerOfTwo(*alignment) && *alignment >= granule_,
                 "alignment must be a power of two >= granule");
  // size <= capacity_ (checked by the callers) and capacity_ is a multiple of
  // granule_: cannot overflow.
  return (size + granule_ - 1) & ~(granule_ - 1);
}

uint64_t RangeAllocator::Take(uint64_t block_offset, uint64_t offset, uint64_t rounded) {
  auto block = free_by_offset_.find(block_offset);
  ACTSTASH_CHECK(block != free_by_offset_.end(), "Take from a block that is not free");
  const uint64_t block_end = block_offset + block->second;
  ACTSTASH_CHECK(offset >= block_offset && offset + rounded <= block_end,
                 "Take of a range outside its free block");
  EraseFreeBlock(block);
  if (offset > block_offset) InsertFreeBlock(block_offset, offset - block_offset);
  if (offset + rounded < block_end) InsertFreeBlock(offset + rounded, block_end - offset - rounded);
  allocations_.emplace(offset, rounded);
  used_bytes_ += rounded;
  return offset;
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t size, uint64_t alignment) {
  if (size > capacity_) {
    RoundedSize(1, &alignment);  // still checks the alignment
    return std::nullopt;
  }
  const uint64_t rounded = RoundedSize(size, &alignment);
  // Candidates in (size, offset) order: the first block that fits is the best
  // fit, with ties already broken by lowest offset.
  for (auto it = free_by_size_.lower_bound({rounded, 0}); it != free_by_size_.end(); ++it) {
    const uint64_t block_size = it->first;
    const uint64_t pad = AlignPadding(it->second, alignment);
    if (pad <= block_size && rounded <= block_size - pad) {
      return Take(it->second, it->second + pad, rounded);
    }
  }
  return std::nullopt;
}

std::optional<uint64_t> RangeAllocator::AllocateWithin(uint64_t size, uint64_t alignment,
                                                       uint64_t begin, uint64_t end) {
  end = std::min(end, capacity_);
  if (size > capacity_ || begin >= end) {
    RoundedSize(1, &alignment);
    return std::nullopt;
  }
  const uint64_t rounded = RoundedSize(size, &alignment);
  // The free blocks that meet the window: the one holding `begin` (if any)
  // and those starting before `end`. Each is clipped to the window.
  auto it = free_by_offset_.upper_bound(begin);
  if (it != free_by_offset_.begin()) --it;
  std::optional<uint64_t> best_block;
  uint64_t best_offset = 0;
  uint64_t best_size = 0;
  for (; it != free_by_offset_.end() && it->first < end; ++it) {
    const uint64_t from = std::max(it->first, begin);
    const uint64_t to = std::min(it->first + it->second, end);
    if (to <= from) continue;
    const uint64_t clipped = to - from;
    const uint64_t pad = AlignPadding(from, alignment);
    if (pad > clipped || rounded > clipped - pad) continue;
    if (!best_block.has_value() || clipped < best_size) {
      best_block = it->first;
      best_offset = from + pad;
      best_size = clipped;
    }
  }
  if (!best_block.has_value()) return std::nullopt;
  return Take(*best_block, best_offset, rounded);
}

uint64_t RangeAllocator::FreeBytesWithin(uint64_t begin, uint64_t end) const {
  end = std::min(end, capacity_);
  if (begin >= end) return 0;
  auto it = free_by_offset_.upper_bound(begin);
  if (it != free_by_offset_.begin()) --it;
  uint64_t total = 0;
  for (; it != free_by_offset_.end() && it->first < end; ++it) {
    const uint64_t from = std::max(it->first, begin);
    const uint64_t to = std::min(it->first + it->second, end);
    if (to > from) total += to - from;
  }
  return total;
}

void RangeAllocator::Free(uint64_t offset) {
  auto alloc = allocations_.find(offset);
  ACTSTASH_CHECK(alloc != allocations_.end(),
                 "Free of an offset that is not the start of a live allocation");
  const uint64_t end = offset + alloc->second;
  used_bytes_ -= alloc->second;
  allocations_.erase(alloc);

  uint64_t start = offset;
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      EraseFreeBlock(prev);
    }
  }
  uint64_t merged_end = end;
  if (next != free_by_offset_.end() && next->first == end) {
    merged_end = end + next->second;
    EraseFreeBlock(next);
  }
  InsertFreeBlock(start, merged_end - start);
}

std::optional<uint64_t> RangeAllocator::AllocationSize(uint64_t offset) const {
  auto it = allocations_.find(offset);
  if (it == allocations_.end()) return std::nullopt;
  return it->second;
}

uint64_t RangeAllocator::largest_free_block() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

bool RangeAllocator::CheckInvariants() const {
  if (free_by_size_.size() != free_by_offset_.size()) return false;

  auto valid_range = [this](uint64_t offset, uint64_t size) {
    return size > 0 && offset % granule_ == 0 && size % granule_ == 0 && offset < capacity_ &&
           size <= capacity_ - offset;
  };

  // Free blocks: valid, mirrored in the size index, sorted and never adjacent.
  uint64_t free_total = 0;
  bool have_prev = false;
  uint64_t prev_end = 0;
  for (const auto& [offset, size] : free_by_offset_) {
    if (!valid_range(offset, size)) return false;
    if (free_by_size_.count({size, offset}) == 0) return false;
    if (have_prev && offset <= prev_end) return false;  // Overlapping or uncoalesced.
    have_prev = true;
    prev_end = offset + size;
    free_total += size;
  }

  uint64_t used_total = 0;
  for (const auto& [offset, size] : allocations_) {
    if (!valid_range(offset, size)) return false;
    used_total += size;
  }
  if (used_total != used_bytes_ || free_total != capacity_ - used_total) return false;

  // Free blocks and allocations must tile [0, capacity) without overlap.
  std::vector<std::pair<uint64_t, uint64_t>> ranges(free_by_offset_.begin(), free_by_offset_.end());
  ranges.insert(ranges.end(), allocations_.begin(), allocations_.end());
  std::sort(ranges.begin(), ranges.end());
  uint64_t cursor = 0;
  for (const auto& [offset, size] : ranges) {
    if (offset != cursor) return false;
    cursor = offset + size;
  }
  return cursor == capacity_;
}

}  // namespace actstash::server
