// ArenaAllocator: places blocks inside one arena (a leased shared-memory
// segment) of a fixed capacity. See docs/ARCHITECTURE.md, "Client placement".
//
// Tuned for activations, which are freed roughly in reverse order of creation:
// a stack (bump pointer `top`) plus first-fit reuse of holes below it.
//
//   ArenaAllocator arena(segment_bytes);
//   std::optional<uint64_t> offset = arena.Allocate(nbytes);  // nullopt: full
//   ...
//   arena.Free(*offset);
//
// Placement policy (deterministic):
//   1. If [top, capacity) can hold the request, the block is placed at `top`
//      (even when a hole could hold it too: that keeps the LIFO path O(1) and
//      lets holes disappear when the stack collapses over them).
//   2. Otherwise the holes are searched lowest address first and the block is
//      placed at the start of the first hole large enough (first fit).
//   3. Otherwise nullopt.
// Freeing the topmost live block lowers `top` to the end of the next live block
// below (over any hole in between), so `top` is always the end of the highest
// live block, or 0. Freeing any other block leaves a hole; adjacent holes are
// merged, so no two holes touch and no hole touches `top`.
//
// Sizes: every request is rounded up to a multiple of `alignment`; a size of 0
// counts as one alignment unit (it yields a distinct, valid offset that must be
// freed like any other). Every returned offset is a multiple of `alignment`.
//
// Complexity (n: block records, i.e. live blocks plus not yet compacted freed
// ones, which a non-top Free compacts once they outnumber the live blocks by
// 32; h: holes, expected to be few):
//   Allocate at top:          O(1) amortized, no heap allocation in steady state.
//   Allocate into a hole:     O(h + log n), plus an O(n) memmove of 16-byte
//                             records when no freed record can be reused.
//   Free of the top block:    O(1) amortized (each freed record is popped once).
//   Free of any other block:  O(log n + h); occasionally an O(n) compaction of
//                             freed records, amortized O(1) per Free.
//   largest_free():           O(h). Other accessors: O(1).
// The internal vectors keep their capacity, so once they have grown to the
// peak number of blocks/holes no operation allocates (Reset() included).
//
// Thread-safety: none. The owner serializes every call (including const ones)
// on one allocator, e.g. under the lock that guards its arena list.
//
// The allocator only does bookkeeping on offsets; it never touches the arena's
// memory and owns nothing but its own records.
#ifndef ACTSTASH_CLIENT_STORE_ARENA_ALLOCATOR_H_
#define ACTSTASH_CLIENT_STORE_ARENA_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace actstash::client_internal {

class ArenaAllocator {
 public:
  // Aborts (ACTSTASH_CHECK) unless `alignment` is a power of two and
  // `capacity` is a positive multiple of `alignment`.
  explicit ArenaAllocator(uint64_t capacity, uint64_t alignment = 64);

  ArenaAllocator(const ArenaAllocator&) = delete;
  ArenaAllocator& operator=(const ArenaAllocator&) = delete;
  // The moved-from allocator is left empty, with the same capacity/alignment.
  ArenaAllocator(ArenaAllocator&&) noexcept;
  ArenaAllocator& operator=(ArenaAllocator&&) noexcept;
  ~ArenaAllocator();

  // Offset of a new block of at least `size` bytes (rounded as described
  // above), placed by the policy above; nullopt when no free range can hold it
  // (including any size > capacity(), e.g. UINT64_MAX). Never overflows.
  std::optional<uint64_t> Allocate(uint64_t size);

  // Frees the live block that starts at `offset`. Returns false and changes
  // nothing when `offset` is not the start of a live block (never allocated,
  // inside a block, or already freed); the caller treats that as its own bug.
  bool Free(uint64_t offset);

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  // Sum of the (rounded) sizes of the live blocks.
  uint64_t used_bytes() const { return used_; }
  // End of the highest live block; 0 when empty. [top, capacity) is free.
  uint64_t top() const { return top_; }
  size_t live_blocks() const { return live_count_; }
  // Free ranges below top(); each is maximal (holes never touch each other).
  size_t hole_count() const { return holes_.size(); }
  // Bytes free below top(): top() - used_bytes().
  uint64_t hole_bytes() const { return top_ - used_; }
  // The largest request Allocate can currently satisfy:
  // max(capacity() - top(), largest hole).
  uint64_t largest_free() const;
  // No live blocks; then top() == 0 and there are no holes.
  bool empty() const { return live_count_ == 0; }

  // Forgets every block (the arena was returned). Keeps reserved capacity.
  void Reset();

  // For tests: verifies every internal invariant (records sorted, holes sorted,
  // non-empty, aligned, not touching each other or top, disjoint from live
  // blocks, and live + holes tiling [0, top) exactly; counters consistent).
  bool CheckInvariants() const;

 private:
  // A block record; size == 0 marks a freed record that has not been removed
  // yet (a tombstone). Records are kept strictly sorted by offset.
  struct Block {
    uint64_t offset;
    uint64_t size;
  };
  struct Hole {
    uint64_t offset;
    uint64_t size;
    uint64_t end() const { return offset + size; }
  };

  void FreeTop();
  void AddHole(uint64_t offset, uint64_t size);
  void InsertLive(uint64_t offset, uint64_t size);
  void Compact();

  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t top_ = 0;
  uint64_t used_ = 0;
  size_t live_count_ = 0;
  size_t dead_count_ = 0;      // tombstones in blocks_
  std::vector<Block> blocks_;  // live blocks and tombstones; back() is live
  std::vector<Hole> holes_;    // sorted by offset, coalesced, all below top_
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_ARENA_ALLOCATOR_H_
