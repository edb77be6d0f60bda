// BlockTable: what a LocalStore holds, under one mutex: its mapped leases
// (arenas), the blocks of buffers placed in them, the tickets of those
// buffers, and the usage counters that follow from them. The policies over
// it lock mu() and change it only through these methods, which keep its
// invariants in one place:
//  - an arena in the table always holds a block, whose arena it is; a block
//    whose bytes left memory (spilled, lost) has no arena;
//  - a block changes state only through Move (common/residence.h), which
//    keeps the spill counters and wakes the readers waiting for a block;
//  - the usage counters of leases, objects and spills are kept by the
//    methods that change what they count.
// The policies: placement (LocalStore), leasing, mapping and registering
// (ArenaLeases), which empty leases stay (LeaseRetention), spilling and
// reading back (BlockSpiller). Private to LocalStore.
//
// Thread-safety: every method but mu() requires mu() held. Arena and Block
// fields are read and written under it too, except an arena's lease_id,
// base, bytes and dedicated (fixed once mapped) and pinned (atomic).
#ifndef ACTSTASH_CLIENT_STORE_BLOCK_TABLE_H_
#define ACTSTASH_CLIENT_STORE_BLOCK_TABLE_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "actstash/v1/stash.pb.h"
#include "client/store/arena_allocator.h"
#include "common/residence.h"

namespace actstash::client_internal {

class BlockTable {
 public:
  struct Block;
  // One mapped lease. Its block is what it holds now.
  struct Arena {
    uint64_t lease_id = 0;
    std::byte* base = nullptr;
    uint64_t bytes = 0;
    bool dedicated = false;  // holds one buffer bigger than a segment
    // Registered for CUDA. Registration is tried once (pin_tried): when
    // mapped, or, when the mapping thread ran no CUDA work, by the first
    // Reserve that lands here from a thread that does (ArenaLeases).
    std::atomic<bool> pinned{false};
    bool pin_tried = false;
    Block* block = nullptr;
    // When its block last became empty: retention counts from it.
    std::chrono::steady_clock::time_point emptied{};
  };
  // The buffers placed in one lease's bytes, wherever those bytes are.
  struct Block {
    explicit Block(uint64_t bytes, bool dedicated)
        : allocator(bytes), bytes(bytes), dedicated(dedicated) {}
    ArenaAllocator allocator;
    uint64_t bytes;
    bool dedicated;
    Residence state = Residence::kResident;  // changed only by Move
    Arena* arena = nullptr;                  // null while spilled (or lost)
    uint64_t spill_id = 0;                   // while on the daemon's disk
    uint64_t spill_checksum = 0;             // its bytes' XXH3 then (0: unknown)
    uint64_t last_seq = 0;                   // the newest buffer placed in it
    uint32_t unwritten = 0;                  // Reserve'd buffers not marked written
    uint32_t pins = 0;                       // located buffers and copies in progress
    bool ahead = false;  // read back ahead and not read since (MarkAhead/ClearAhead)
    absl::Status error;  // kLost: why its bytes are gone
  };
  // Where one ticket's buffer is in its block.
  struct Placement {
    Block* block = nullptr;
    uint64_t offset = 0;
    uint64_t size = 0;
    uint64_t seq = 0;  // store order: later stores are read first by backward
    bool written = false;
    bool located = false;  // Locate'd: its block stays pinned until Release
  };

  BlockTable() = default;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // Mapped leases, oldest first.
  const std::vector<std::unique_ptr<Arena>>& arenas() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return arenas_;
  }
  // Adds a mapped arena with a fresh empty block; counts its lease.
  void Adopt(std::unique_ptr<Arena> arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes an arena holding an empty block (deleted with it); the caller
  // unmaps and returns it.
  std::unique_ptr<Arena> Detach(Arena* arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An arena holding an empty, unused resident block.
  static bool Empty(const Arena& arena);

  // Places `nbytes` in a shared resident arena, trying first the one that
  // placed last; false when none has room.
  bool TryPlace(uint64_t nbytes, Placement* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places `nbytes` in `arena`'s (empty, dedicated) block.
  Placement PlaceIn(Arena* arena, uint64_t nbytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives a placement a ticket (and the next store order); counts the store.
  uint64_t AddTicket(const Placement& placement) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ticket's placement, valid until the next change of the table;
  // NOT_FOUND for an unknown or released ticket.
  absl::StatusOr<Placement*> Find(uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const Placement*> Find(uint64_t ticket) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the ticket's bytes written (its block may spill once all are).
  absl::Status MarkWritten(uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the ticket written and drops its Locate pin, if any: its holder
  // keeps no pointer into it, so its block may spill. NOT_FOUND as Find.
  absl::Status Park(uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the ticket and frees its place (unpinning its block if it was
  // located); returns where it was. The block stays, maybe empty: what
  // happens to it is the caller's policy. NOT_FOUND as Find.
  absl::StatusOr<Placement> Remove(uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The one place a block changes state: the move `event` makes (a broken
  // invariant when block_state.h's table has none), with what follows from
  // it: the spill counters, the read-ahead count, and waking WaitForMove.
  void Move(Block* block, ResidenceEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (releasing mu_) until some block leaves kSpilling or kRestoring.
  void WaitForMove() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { block_changed_.Wait(&mu_); }
  // The block's bytes left its arena (spilled, or a read-back failed): the
  // arena gets a fresh empty block and the block none.
  void Evict(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block without an arena takes `target`'s place (target holds an empty
  // block, deleted here): its bytes are read back into it.
  void Install(Block* block, Arena* target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a block that no RPC is working on (never kSpilling or
  // kRestoring) and that no arena holds; one on disk stops counting as
  // spilled.
  void DeleteBlock(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The spilled block stored last before `seq` (backward reads it next), or
  // null.
  Block* NewestSpilledBefore(uint64_t seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The spilled block stored first after `seq` (a reader in store order, an
  // optimizer's step, reads it next), or null.
  Block* OldestSpilledAfter(uint64_t seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Blocks read back ahead of need and not read since. A mark is cleared by
  // a reader (ClearAhead), or when the block leaves memory unread (Move,
  // DeleteBlock).
  uint32_t ahead() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ahead_; }
  void MarkAhead(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClearAhead(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The counters (the wire message the client reports). The table keeps
  // those of what it holds; the policies add theirs (fetches, waits, pins).
  v1::ClientUsage& usage() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return usage_; }
  const v1::ClientUsage& usage() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return usage_; }

 private:
  // Gives an arena a fresh empty block.
  void FreshBlock(Arena* arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a block's bytes as on the daemon's disk, or no longer.
  void CountOnDisk(const Block& block, bool on_disk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Arena>> arenas_ ABSL_GUARDED_BY(mu_);
  size_t hint_ ABSL_GUARDED_BY(mu_) = 0;  // arena that placed last
  absl::flat_hash_map<uint64_t, Placement> tickets_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Block*, std::unique_ptr<Block>> blocks_ ABSL_GUARDED_BY(mu_);
  absl::CondVar block_changed_;  // a block left kSpilling or kRestoring
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint32_t ahead_ ABSL_GUARDED_BY(mu_) = 0;
  v1::ClientUsage usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_BLOCK_TABLE_H_
