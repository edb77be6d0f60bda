#include "server/range_allocator.h"

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

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t size, uint64_t alignment) {
  ACTSTASH_CHECK(size > 0, "Allocate size must be > 0");
  if (alignment == 0) alignment = granule_;
  ACTSTASH_CHECK(IsPowerOfTwo(alignment) && alignment >= granule_,
                 "alignment must be a power of two >= granule");
  if (size > capacity_) return std::nullopt;
  // size <= capacity_ and capacity_ is a multiple of granule_: cannot overflow.
  const uint64_t rounded = (size + granule_ - 1) & ~(granule_ - 1);

  // Candidates in (size, offset) order: the first block that fits is the best
  // fit, with ties already broken by lowest offset.
  auto best = free_by_size_.end();
  uint64_t padding = 0;
  for (auto it = free_by_size_.lower_bound({rounded, 0}); it != free_by_size_.end(); ++it) {
    const uint64_t block_size = it->first;
    const uint64_t pad = AlignPadding(it->second, alignment);
    if (pad <= block_size && rounded <= block_size - pad) {
      best = it;
      padding = pad;
      break;
    }
  }
  if (best == free_by_size_.end()) return std::nullopt;

  const uint64_t block_offset = best->second;
  const uint64_t block_size = best->first;
  EraseFreeBlock(free_by_offset_.find(block_offset));

  const uint64_t offset = block_offset + padding;
  if (padding > 0) InsertFreeBlock(block_offset, padding);
  const uint64_t tail = block_size - padding - rounded;
  if (tail > 0) InsertFreeBlock(offset + rounded, tail);

  allocations_.emplace(offset, rounded);
  used_bytes_ += rounded;
  return offset;
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
