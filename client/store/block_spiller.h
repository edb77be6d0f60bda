// BlockSpiller: a LocalStore's spill tier and the read path through it.
// When no lease can be had, the coldest blocks (those stored longest ago,
// which backward reads last) whose buffers are all written and none located
// are written to the daemon's disk, and their leases hold new buffers. A
// read of a spilled buffer reads its block back first (waiting for it), and
// also queues read-backs of the spilled blocks stored just before it
// (`restore_ahead` of them) on a background thread, so that backward finds
// them in memory. Only host stores spill: device bytes do not outlive the
// daemon. Private to LocalStore.
//
// Thread-safety: every public method may run on any thread, concurrently,
// with no table lock held (Spill and Restore RPCs run without it). The
// table, leases and retention must outlive the object; Stop before the
// arenas are unmapped.
#ifndef ACTSTASH_CLIENT_STORE_BLOCK_SPILLER_H_
#define ACTSTASH_CLIENT_STORE_BLOCK_SPILLER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/store/arena_leases.h"
#include "client/store/background_worker.h"
#include "client/store/block_table.h"
#include "client/store/lease_retention.h"

namespace actstash::client_internal {

// Who reads a buffer, which decides what is read back ahead of it and what
// is counted.
enum class ReadKind {
  // Backward reading activations: a fetch; the spilled blocks stored just
  // before it are read ahead (backward reads them next).
  kActivation,
  // An optimizer's step reading its long-lived states: no fetch; the blocks
  // stored just after it are read ahead (the step goes in store order).
  kState,
};

class BlockSpiller {
 public:
  using Arena = BlockTable::Arena;
  using Block = BlockTable::Block;
  using Placement = BlockTable::Placement;

  // `pool_wait`: how long a store or a read-back may wait for pool memory
  // that other sessions hold when this one has nothing left to spill.
  BlockSpiller(BlockTable* table, ArenaLeases* leases, LeaseRetention* retention,
               uint32_t restore_ahead, std::chrono::milliseconds pool_wait);
  ~BlockSpiller() { Stop(); }
  BlockSpiller(const BlockSpiller&) = delete;
  BlockSpiller& operator=(const BlockSpiller&) = delete;

  // Leases `count` leases of `segments` segments each; when the pool or
  // quota is full, first gives back what only retention keeps, then tries
  // one lease, then (when the backend can spill) spills cold blocks and
  // returns no arena: their leases now hold empty blocks, and the caller
  // places again (or gives back what does not fit its buffer and calls
  // again). RESOURCE_EXHAUSTED when nothing is left to spill and the pool
  // stayed full for `pool_wait`.
  absl::StatusOr<std::vector<std::unique_ptr<Arena>>> LeaseOrSpill(uint32_t count,
                                                                   uint32_t segments,
                                                                   bool dedicated,
                                                                   const ArenaLeases::Turn& turn)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // A ticket's placement once its block is resident (read back first when
  // spilled), pinned (pins + 1; once for a located ticket) for the caller,
  // who unpins it after copying; reads ahead and counts as `kind` says.
  // NOT_FOUND for an unknown or released ticket; the read-back's error.
  absl::StatusOr<Placement> PinForRead(uint64_t ticket, bool locate,
                                       ReadKind kind = ReadKind::kActivation)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // For another session that waits for the pool (the daemon asked): spills
  // the coldest blocks covering up to `bytes` and gives back the leases that
  // emptied, at most `bytes` of them. Returns the bytes given back. Any thread
  // but the holder of `turn` is the caller's.
  absl::StatusOr<uint64_t> SpillForOthers(uint64_t bytes, const ArenaLeases::Turn& turn)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // Stops the read-ahead thread (drops what is queued, joins). Idempotent.
  void Stop() { read_ahead_.Stop(); }

 private:
  // Spills up to `max_blocks` of the coldest spillable blocks; false when
  // none can be spilled. `return_bytes` (if set): what the daemon asked back.
  absl::StatusOr<bool> SpillColdest(uint32_t max_blocks, uint64_t* return_bytes,
                                    const ArenaLeases::Turn& turn) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Waits until `block` is resident, reading it back itself when it is
  // spilled; the block's error when it is lost. Drops the lock meanwhile.
  absl::Status EnsureResident(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu());
  // Whether a lease refused with `refused` (RESOURCE_EXHAUSTED, nothing
  // spillable) may be granted after a wait, for `block` (null: a new one):
  // the one rule of LeaseOrSpill's and ArenaToRestoreInto's waits.
  bool MayWaitFor(const absl::Status& refused, const Block* block) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Whether an arena other than `block`'s holds a block being read back or
  // spilled (its lease is in use, but only until the RPC ends).
  bool AnotherBlockMoving(const Block* block) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Counts a reader's wait for a read-back that began at `start`.
  void CountRestoreWait(uint64_t start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu());
  // Reads a block whose state the caller moved to kRestoring back into an
  // empty lease of its size (leasing one, and when `may_spill`, spilling
  // others to get it). Moves it on (kResident, kSpilled again, or kLost)
  // before returning.
  absl::Status RestoreBlock(Block* block, bool may_spill) ABSL_LOCKS_EXCLUDED(table_.mu());
  // An empty arena for `block` to be read back into, with the block
  // installed in it: one of the table's, a new lease, or (`may_spill`) one
  // that spilling others frees.
  absl::StatusOr<Arena*> ArenaToRestoreInto(Block* block, bool may_spill,
                                            const ArenaLeases::Turn& turn)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // Whether `arena`, into which a Restore of `block`'s spill was sent more
  // than once and answered NOT_FOUND, holds the spill's bytes: the daemon
  // read it back before it restarted. Reads the arena's bytes (the block is
  // kRestoring: nothing writes them).
  static bool ReadBackBeforeRestart(const Block& block, const Arena& arena);
  // Queues read-backs of the spilled blocks stored just before `seq` (just
  // after it for kState), no spilling for a read ahead: it uses memory
  // that is free.
  void RestoreAhead(uint64_t seq, ReadKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu());

  BlockTable& table_;
  ArenaLeases& leases_;
  LeaseRetention& retention_;
  LeaseBackend& backend_;
  // How many blocks the read-ahead may hold (read ahead and not read since).
  const uint32_t restore_ahead_;
  const std::chrono::milliseconds pool_wait_;
  // Read-backs ahead of need, one at a time, in the order queued; started
  // at the first. Its tasks take the table lock themselves.
  SerialWorker read_ahead_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_BLOCK_SPILLER_H_
