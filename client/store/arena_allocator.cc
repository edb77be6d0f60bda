#include "client/store/arena_allocator.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "common/check.h"

namespace actstash::client_internal {
namespace {

// Initial record capacity; the vectors grow (amortized) past it as needed.
constexpr size_t kInitialBlocks = 64;
constexpr size_t kInitialHoles = 8;
// Tombstones are compacted away once they outnumber live records by this much,
// so that a Free pays O(1) amortized for the compaction.
constexpr size_t kCompactSlack = 32;

}  // namespace

ArenaAllocator::ArenaAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity), alignment_(alignment) {
  ACTSTASH_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0,
                 "ArenaAllocator: alignment must be a power of two");
  ACTSTASH_CHECK(capacity > 0, "ArenaAllocator: capacity must be positive");
  ACTSTASH_CHECK(capacity % alignment == 0,
                 "ArenaAllocator: capacity must be a multiple of the alignment");
  blocks_.reserve(kInitialBlocks);
  holes_.reserve(kInitialHoles);
}

ArenaAllocator::ArenaAllocator(ArenaAllocator&& other) noexcept
    : capacity_(other.capacity_),
      alignment_(other.alignment_),
      top_(other.top_),
      used_(other.used_),
      live_count_(other.live_count_),
      dead_count_(other.dead_count_),
      blocks_(std::move(other.blocks_)),
      holes_(std::move(other.holes_)) {
  other.Reset();
}

ArenaAllocator& ArenaAllocator::operator=(ArenaAllocator&& other) noexcept {
  if (this != &other) {
    capacity_ = other.capacity_;
    alignment_ = other.alignment_;
    top_ = other.top_;
    used_ = other.used_;
    live_count_ = other.live_count_;
    dead_count_ = other.dead_count_;
    blocks_ = std::move(other.blocks_);
    holes_ = std::move(other.holes_);
    other.Reset();
  }
  return *this;
}

ArenaAllocator::~ArenaAllocator() = default;

std::optional<uint64_t> ArenaAllocator::Allocate(uint64_t size) {
  if (size > capacity_) return std::nullopt;
  // size <= capacity_, a multiple of alignment_: rounding up cannot overflow.
  size = size == 0 ? alignment_ : (size + alignment_ - 1) & ~(alignment_ - 1);
  if (capacity_ - top_ >= size) {
    const uint64_t offset = top_;
    blocks_.push_back(Block{offset, size});
    top_ += size;
    used_ += size;
    ++live_count_;
    return offset;
  }
  for (auto it = holes_.begin(); it != holes_.end(); ++it) {
    if (it->size < size) continue;
    const uint64_t offset = it->offset;
    if (it->size == size) {
      holes_.erase(it);
    } else {
      it->offset += size;
      it->size -= size;
    }
    InsertLive(offset, size);
    used_ += size;
    ++live_count_;
    return offset;
  }
  return std::nullopt;
}

bool ArenaAllocator::Free(uint64_t offset) {
  if (blocks_.empty()) return false;
  const uint64_t top_block = blocks_.back().offset;
  if (offset == top_block) {
    FreeTop();
    return true;
  }
  if (offset > top_block || (offset & (alignment_ - 1)) != 0) return false;
  auto it = std::lower_bound(blocks_.begin(), blocks_.end(), offset,
                             [](const Block& b, uint64_t o) { return b.offset < o; });
  if (it == blocks_.end() || it->offset != offset || it->size == 0) return false;
  const uint64_t size = it->size;
  it->size = 0;
  ++dead_count_;
  --live_count_;
  used_ -= size;
  AddHole(offset, size);
  if (dead_count_ > live_count_ + kCompactSlack) Compact();
  return true;
}

void ArenaAllocator::FreeTop() {
  const Block freed = blocks_.back();
  blocks_.pop_back();
  --live_count_;
  used_ -= freed.size;
  while (!blocks_.empty() && blocks_.back().size == 0) {
    blocks_.pop_back();
    --dead_count_;
  }
  top_ = blocks_.empty() ? 0 : blocks_.back().offset + blocks_.back().size;
  // Everything in [top_, freed.offset) is free, hence one coalesced hole.
  if (!holes_.empty() && holes_.back().offset >= top_) holes_.pop_back();
}

void ArenaAllocator::AddHole(uint64_t offset, uint64_t size) {
  const uint64_t end = offset + size;
  auto next = std::lower_bound(holes_.begin(), holes_.end(), offset,
                               [](const Hole& h, uint64_t o) { return h.offset < o; });
  const bool merge_next = next != holes_.end() && next->offset == end;
  const bool merge_prev = next != holes_.begin() && std::prev(next)->end() == offset;
  if (merge_prev && merge_next) {
    std::prev(next)->size += size + next->size;
    holes_.erase(next);
  } else if (merge_prev) {
    std::prev(next)->size += size;
  } else if (merge_next) {
    next->offset = offset;
    next->size += size;
  } else {
    holes_.insert(next, Hole{offset, size});
  }
}

void ArenaAllocator::InsertLive(uint64_t offset, uint64_t size) {
  // `offset` lies in a former hole below the top block, so `it` is not end().
  // Records stay strictly sorted when a tombstone right at the insertion point
  // (the record at or just before it) is overwritten instead.
  auto it = std::lower_bound(blocks_.begin(), blocks_.end(), offset,
                             [](const Block& b, uint64_t o) { return b.offset < o; });
  if (it != blocks_.end() && it->size == 0) {
    *it = Block{offset, size};
    --dead_count_;
  } else if (it != blocks_.begin() && std::prev(it)->size == 0) {
    *std::prev(it) = Block{offset, size};
    --dead_count_;
  } else {
    blocks_.insert(it, Block{offset, size});
  }
}

void ArenaAllocator::Compact() {
  blocks_.erase(
      std::remove_if(blocks_.begin(), blocks_.end(), [](const Block& b) { return b.size == 0; }),
      blocks_.end());
  dead_count_ = 0;
}

uint64_t ArenaAllocator::largest_free() const {
  uint64_t largest = capacity_ - top_;
  for (const Hole& hole : holes_) largest = std::max(largest, hole.size);
  return largest;
}

void ArenaAllocator::Reset() {
  blocks_.clear();
  holes_.clear();
  top_ = 0;
  used_ = 0;
  live_count_ = 0;
  dead_count_ = 0;
}

bool ArenaAllocator::CheckInvariants() const {
  const uint64_t mask = alignment_ - 1;
  if (alignment_ == 0 || (alignment_ & mask) != 0) return false;
  if (capacity_ == 0 || (capacity_ & mask) != 0) return false;
  if (top_ > capacity_ || (top_ & mask) != 0 || used_ > top_) return false;

  // Records: strictly sorted, aligned, in bounds; the last one is live.
  size_t live = 0, dead = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    if ((b.offset & mask) != 0 || (b.size & mask) != 0 || b.offset >= top_) return false;
    if (b.size > top_ - b.offset) return false;
    if (i > 0 && blocks_[i - 1].offset >= b.offset) return false;
    ++(b.size == 0 ? dead : live);
  }
  if (live != live_count_ || dead != dead_count_) return false;
  if (!blocks_.empty() && blocks_.back().size == 0) return false;
  const uint64_t expected_top = blocks_.empty() ? 0 : blocks_.back().offset + blocks_.back().size;
  if (top_ != expected_top) return false;

  // Holes: non-empty, aligned, sorted, not touching each other nor top.
  for (size_t i = 0; i < holes_.size(); ++i) {
    const Hole& h = holes_[i];
    if (h.size == 0 || (h.offset & mask) != 0 || (h.size & mask) != 0) return false;
    if (h.offset >= top_ || h.size >= top_ - h.offset) return false;  // end < top
    if (i > 0 && holes_[i - 1].end() >= h.offset) return false;
  }

  // Live blocks and holes tile [0, top) exactly, in address order.
  uint64_t pos = 0, live_bytes = 0;
  size_t bi = 0, hi = 0;
  while (true) {
    while (bi < blocks_.size() && blocks_[bi].size == 0) ++bi;
    if (bi < blocks_.size() && blocks_[bi].offset == pos) {
      pos += blocks_[bi].size;
      live_bytes += blocks_[bi].size;
      ++bi;
    } else if (hi < holes_.size() && holes_[hi].offset == pos) {
      pos += holes_[hi].size;
      ++hi;
    } else {
      break;
    }
  }
  return pos == top_ && bi == blocks_.size() && hi == holes_.size() && live_bytes == used_;
}

}  // namespace actstash::client_internal
