// LocalStore: the zero-copy data plane of a client. Leases whole segments
// of the daemon's pool (their memfds arrive over the attach channel), maps
// them, and places buffers in them itself: no RPC and no syscall per buffer
// on the hot path. Buffers bigger than a segment get a dedicated lease of
// contiguous segments; the last one released is kept for the next buffer of
// its size, older ones go back.
#ifndef ACTSTASH_CLIENT_LOCAL_STORE_H_
#define ACTSTASH_CLIENT_LOCAL_STORE_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "actstash/v1/stash.pb.h"
#include "client/arena_allocator.h"
#include "client/background_worker.h"
#include "client/block_state.h"
#include "client/device_import.h"
#include "client/lease_mapper.h"
#include "common/pinned_registrar.h"

namespace actstash::client_internal {

// Where leases come from: the daemon (Lease/Return RPCs plus the attach
// channel), or a fake in unit tests. Called with no LocalStore lock held,
// by one thread at a time for Lease.
class LeaseBackend {
 public:
  virtual ~LeaseBackend() = default;
  virtual absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t count,
                                                          uint32_t segments_per_lease) = 0;
  virtual absl::Status Return(absl::Span<const uint64_t> lease_ids) = 0;
  // True once the daemon is gone: nothing more can be leased or returned.
  virtual bool Lost() const = 0;
  // The one error for "the daemon went away" (UNAVAILABLE): `what` failed,
  // `consequence` says what is lost and what still works. The real backend
  // names the daemon's address and how to start it again.
  virtual absl::Status GoneError(absl::string_view what, absl::string_view consequence) const;
  // Spill tier (the daemon's disk). Without one (the default) nothing
  // spills. Spill writes whole leases and answers one spill id per lease,
  // all or nothing; the leases stay this client's. Restore reads a spill
  // back into a lease of the same size and deletes it; DropSpilled deletes
  // spills no longer needed. Any thread, concurrently.
  virtual bool CanSpill() const { return false; }
  // `return_bytes`: how much memory the daemon asks back (another session
  // waits for the pool and this one holds more than its share).
  virtual absl::StatusOr<std::vector<uint64_t>> Spill(absl::Span<const uint64_t> lease_ids,
                                                      uint64_t* return_bytes) {
    return absl::UnimplementedError("no spill tier");
  }
  virtual absl::Status Restore(uint64_t spill_id, uint64_t lease_id) {
    return absl::UnimplementedError("no spill tier");
  }
  virtual absl::Status DropSpilled(absl::Span<const uint64_t> spill_ids) {
    return absl::UnimplementedError("no spill tier");
  }
};

// Adds every counter of `from` to `to` (the usage of several stores, e.g.
// the host and device tiers, as one). Goes by the message's fields, so a new
// ClientUsage counter is summed without a change here.
void AddUsage(const v1::ClientUsage& from, v1::ClientUsage* to);

// Where a reserved buffer lies: the caller writes it.
struct Placed {
  uint64_t ticket = 0;
  std::byte* data = nullptr;
  bool pinned = false;     // registered for CUDA
  bool on_device = false;  // device memory (device tier): only CUDA copies
};

// Where a stored buffer lies: the caller reads it.
struct Located {
  const std::byte* data = nullptr;
  uint64_t size = 0;
  bool pinned = false;
  bool on_device = false;
};

// Thread-safe: Store, Fetch and Release may run concurrently on any threads;
// copies run outside the lock. Fetch or Release of a ticket concurrently
// with its own Release is undefined (as for any freed buffer).
//
// Spilling (when the backend CanSpill): when no lease can be had, the
// coldest blocks (a lease's buffers; the ones stored longest ago, which
// backward reads last) whose buffers are all written and not located are
// written to the daemon's disk, and their leases hold new buffers. A Fetch
// or Locate of a spilled buffer reads its block back first (waiting for it);
// reading a buffer also reads back, on a background thread, the spilled
// blocks stored just before it (`restore_ahead` of them), so that backward
// finds them in memory.
class LocalStore {
 public:
  // `backend` (and `registrar`, when not null) must outlive the store.
  // `lease_batch` segments are leased at a time; up to that many empty
  // segments are kept for reuse. With a registrar, every lease is registered
  // once when mapped and unregistered before it is unmapped; a failed
  // registration fails the Store when `require_pinned`, else the lease is
  // used unpinned and the first error is kept (pin_status).
  // `pool_wait`: how long a Store may wait for pool memory that other
  // sessions hold when this one has nothing left to spill (spill tier only).
  // `retain`: an emptied lease that is registered stays (mapped, registered)
  // this long beyond the usual (`lease_batch` empty segments and one spare
  // dedicated lease), for the next buffers: the next training step needs
  // the same leases, and registering them again would run on its storing
  // thread. A sweeper thread (started when the first lease is retained)
  // gives back what stayed empty longer; when no lease can be had, retained
  // ones go back before anything spills or waits. 0: no retention.
  LocalStore(LeaseBackend* backend, uint64_t segment_bytes, uint32_t lease_batch,
             PinnedRegistrar* registrar = nullptr, bool require_pinned = false,
             uint32_t restore_ahead = 2,
             std::chrono::milliseconds pool_wait = std::chrono::seconds(30),
             std::chrono::milliseconds retain = std::chrono::seconds(10));
  // A store of the device tier: leases are ranges of a daemon device pool,
  // made addressable by `importer` (which must outlive the store). Its
  // buffers are device memory: Store and Fetch (host memcpy) are
  // FAILED_PRECONDITION; Reserve/Locate hand out device pointers.
  LocalStore(LeaseBackend* backend, uint64_t segment_bytes, uint32_t lease_batch,
             DeviceImporter* importer);
  // Unmaps everything; does not return leases (closing the session does).
  ~LocalStore();
  LocalStore(const LocalStore&) = delete;
  LocalStore& operator=(const LocalStore&) = delete;

  // Copies `nbytes` from `src` into leased memory; returns the ticket id.
  // RESOURCE_EXHAUSTED when no lease can be had (quota, pool); UNAVAILABLE
  // once the daemon is gone.
  absl::StatusOr<uint64_t> Store(const void* src, size_t nbytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Places `nbytes` like Store but copies nothing: the caller fills the
  // returned bytes (e.g. with an asynchronous device copy) and must not
  // Fetch or Locate the ticket before they are written. Same errors.
  absl::StatusOr<Placed> Reserve(size_t nbytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Where the ticket's bytes are, valid until its Release; counts as a
  // fetch. NOT_FOUND for an unknown or released ticket.
  absl::StatusOr<Located> Locate(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies the ticket's bytes to `dst`. NOT_FOUND for an unknown or released
  // ticket, OUT_OF_RANGE when `capacity` is too small. Works after the daemon
  // went away: the memory is still mapped here.
  absl::Status Fetch(uint64_t ticket, void* dst, size_t capacity) ABSL_LOCKS_EXCLUDED(mu_);
  // The ticket's size, or NOT_FOUND.
  absl::StatusOr<uint64_t> Size(uint64_t ticket) const ABSL_LOCKS_EXCLUDED(mu_);
  // Marks a Reserve'd ticket's bytes as written: from now on it may be
  // spilled (Store's are written at once). Never-marked tickets never spill.
  absl::Status MarkWritten(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // Frees the ticket's place; empty segments beyond the batch, and emptied
  // dedicated leases but the last, go back to the daemon.
  absl::Status Release(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // This store's counts (the wire message the client reports).
  v1::ClientUsage usage() const ABSL_LOCKS_EXCLUDED(mu_);
  // OK, or the first registration failure (leases then run unpinned).
  absl::Status pin_status() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Block;
  // One mapped lease. `block` is what it holds now (never null while in
  // arenas_); a spilled block leaves its arena, which gets an empty one.
  struct Arena {
    uint64_t lease_id = 0;
    std::byte* base = nullptr;
    uint64_t bytes = 0;
    bool dedicated = false;
    // Registered for CUDA. Registration is tried once (pin_tried, under mu_):
    // when mapped, or, when the mapping thread ran no CUDA work (kAuto), by
    // the first Reserve that lands here from a thread that does.
    std::atomic<bool> pinned{false};
    bool pin_tried = false;
    Block* block = nullptr;
    // When its block last became empty (under mu_): retention counts from it.
    std::chrono::steady_clock::time_point emptied{};
  };
  // The buffers placed in one lease's bytes, wherever those bytes are
  // (client/block_state.h). Its state changes only through Move.
  struct Block {
    using State = BlockState;
    explicit Block(uint64_t bytes, bool dedicated)
        : allocator(bytes), bytes(bytes), dedicated(dedicated) {}
    ArenaAllocator allocator;
    uint64_t bytes;
    bool dedicated;
    State state = State::kResident;
    Arena* arena = nullptr;  // null while spilled (or lost)
    uint64_t spill_id = 0;   // while spilled
    uint64_t last_seq = 0;   // the newest buffer placed in it
    uint32_t unwritten = 0;  // Reserve'd buffers not marked written
    uint32_t pins = 0;       // located buffers and copies in progress
    bool ahead = false;      // read back ahead and not read since
    absl::Status error;      // kLost: why its bytes are gone
  };
  struct Placement {
    Block* block = nullptr;
    uint64_t offset = 0;
    uint64_t size = 0;
    uint64_t seq = 0;
    bool written = false;
    bool located = false;
  };

  // Places `nbytes` in a mapped shared arena; false when none has room.
  bool TryPlace(uint64_t nbytes, Placement* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserve without the argument checks.
  absl::StatusOr<Placed> Place(size_t nbytes, bool written) ABSL_LOCKS_EXCLUDED(mu_);
  // Maps (and registers) one granted lease through the mapper; closes its
  // fds either way (lease->fds is left empty).
  absl::StatusOr<std::unique_ptr<Arena>> MapArena(GrantedLease* lease, bool dedicated)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters and unmaps.
  void UnmapArena(const Arena& arena);
  // Registers an arena mapped by a thread without CUDA work, if the calling
  // thread has some (kAuto); once per arena.
  void MaybePinLate(Arena* arena) ABSL_LOCKS_EXCLUDED(mu_);
  // Records a failed registration (usage, pin_status).
  void NotePinFailure(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Leases and maps `count` leases of `segments` segments each.
  absl::StatusOr<std::vector<std::unique_ptr<Arena>>> LeaseArenas(uint32_t count, uint32_t segments,
                                                                  bool dedicated);
  // LeaseArenas; when the pool or quota is full and the backend can spill,
  // spills cold blocks instead and returns no arena: their leases now hold
  // empty blocks, and the caller places again (or gives back what does not
  // fit its buffer and calls again). RESOURCE_EXHAUSTED when nothing is left
  // to spill. Called with lease_mu_ held.
  absl::StatusOr<std::vector<std::unique_ptr<Arena>>> LeaseOrSpill(uint32_t count,
                                                                   uint32_t segments,
                                                                   bool dedicated)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Spills up to `max_blocks` of the coldest spillable blocks (at least
  // one); false when none can be spilled. Called with lease_mu_ held.
  // `return_bytes` (if set): what the daemon asked back.
  absl::StatusOr<bool> SpillColdest(uint32_t max_blocks, uint64_t* return_bytes = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back empty leases that `keep` rejects (memory spilling freed that
  // the next lease needs in the daemon's pool).
  void GiveBackEmpty(const std::function<bool(const Arena&)>& keep, uint64_t limit = UINT64_MAX)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until `block` is resident, reading it back itself when it is
  // spilled; the block's error when it is lost. Drops mu_ meanwhile.
  absl::Status EnsureResident(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads a block whose state the caller set to kRestoring back into an
  // empty lease of its size (leasing one, and when `may_spill`, spilling
  // others to get it). Sets its state (kResident, kSpilled again, or
  // kLost) before returning. No lock held.
  absl::Status RestoreBlock(Block* block, bool may_spill) ABSL_LOCKS_EXCLUDED(mu_, lease_mu_);
  // Queues read-backs of the spilled blocks stored just before `seq` on
  // read_ahead_ (no spilling for a read ahead: it uses memory that is free).
  void RestoreAhead(uint64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A ticket's placement once its block is resident, pinned (pins + 1) for
  // the caller, who unpins it after copying. Counts as a fetch.
  absl::StatusOr<Placement> PinForRead(uint64_t ticket, bool locate) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t NewTicket(const Placement& placement, uint64_t nbytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An empty dedicated arena of `bytes` kept for reuse, if any.
  Arena* SpareDedicated(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retention (local_store_retain.cc). Whether an empty arena is kept by
  // retention at `now`: registered, and emptied less than retain_ ago. Call
  // with mu_ held (reads the arena's fields).
  bool Retained(const Arena& arena, std::chrono::steady_clock::time_point now) const;
  // Detaches the empty arenas that neither the usual rules nor retention
  // keep (`expire_all`: as if every retention had expired); the caller gives
  // them back with no lock held.
  std::vector<std::unique_ptr<Arena>> DetachUnkept(bool expire_all)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back every empty arena that only retention keeps; its bytes.
  uint64_t GiveBackRetained() ABSL_LOCKS_EXCLUDED(mu_);
  // The sweeper's tick: gives back what stayed empty longer than retain_.
  void Sweep() ABSL_LOCKS_EXCLUDED(mu_);
  // How often the sweeper looks: a lease goes back at most a quarter of
  // `retain` (10 ms to 1 s) late.
  static absl::Duration SweepPeriod(std::chrono::milliseconds retain);
  // Adds a mapped arena (with a fresh empty block) to the table.
  void Adopt(std::unique_ptr<Arena> arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives an arena a fresh empty block (its old one is spilled or deleted).
  void FreshBlock(Arena* arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a block that no RPC is working on (never kSpilling or
  // kRestoring); one on disk stops counting as spilled.
  void DeleteBlock(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one place a block changes state: the move `event` makes (a broken
  // invariant when block_state.h's table has none), with what follows from
  // it: the spill counters of usage_, the read-ahead count, and waking the
  // readers that wait for a block to leave kSpilling or kRestoring.
  void Move(Block* block, BlockEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes an arena (holding an empty block) from the table; the caller
  // unmaps and returns it.
  std::unique_ptr<Arena> Detach(Arena* arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void GiveBack(std::unique_ptr<Arena> arena);
  // An arena holding an empty, unused resident block.
  static bool Empty(const Arena& arena);

  LeaseBackend& backend_;
  const uint64_t segment_bytes_;
  const uint32_t lease_batch_;
  // What the leases' bytes are (host or device memory) and how they are
  // mapped and registered. Set once; thread-safe (lease_mapper.h).
  const std::unique_ptr<LeaseMapper> mapper_;
  absl::Mutex lease_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one lease RPC at a time
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Arena>> arenas_ ABSL_GUARDED_BY(mu_);
  size_t hint_ ABSL_GUARDED_BY(mu_) = 0;  // arena that placed last
  absl::flat_hash_map<uint64_t, Placement> tickets_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Block*, std::unique_ptr<Block>> blocks_ ABSL_GUARDED_BY(mu_);
  absl::CondVar block_changed_;  // a block left kSpilling or kRestoring
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  v1::ClientUsage usage_ ABSL_GUARDED_BY(mu_);
  absl::Status pin_status_ ABSL_GUARDED_BY(mu_);
  // Read-back ahead of need: how many blocks it may hold, and how many were
  // read ahead and not read since.
  const uint32_t restore_ahead_;
  const std::chrono::milliseconds pool_wait_;
  uint32_t ahead_ ABSL_GUARDED_BY(mu_) = 0;
  const std::chrono::milliseconds retain_;
  // The background threads, each started at its first use and stopped by
  // the destructor before anything is unmapped: read-backs ahead of need
  // (one at a time, in the order queued), and the sweep of retained leases.
  // Their tasks take mu_ themselves; they are posted and started under it.
  SerialWorker read_ahead_;
  PeriodicWorker sweeper_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_LOCAL_STORE_H_
