// LocalStore: the zero-copy data plane of a client. Leases whole segments
// of the daemon's pool (their memfds arrive over the attach channel), maps
// them, and places buffers in them itself: no RPC and no syscall per buffer
// on the hot path. Buffers bigger than a segment get a dedicated lease of
// contiguous segments; the last one released is kept for the next buffer of
// its size, older ones go back.
//
// The store itself is placement (where a buffer goes, when a ticket ends).
// What it holds is a BlockTable (client/store/block_table.h); how leases come and
// go, which empty ones stay, and the spill tier are rooms of their own
// (arena_leases.h, lease_retention.h, block_spiller.h), all over that table
// and its one lock.
#ifndef ACTSTASH_CLIENT_STORE_LOCAL_STORE_H_
#define ACTSTASH_CLIENT_STORE_LOCAL_STORE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "actstash/v1/stash.pb.h"
#include "client/store/arena_leases.h"
#include "client/store/block_spiller.h"
#include "client/store/block_table.h"
#include "client/store/device_import.h"
#include "client/store/lease_backend.h"
#include "client/store/lease_retention.h"
#include "common/pinned_registrar.h"

namespace actstash::client_internal {

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
  absl::StatusOr<uint64_t> Store(const void* src, size_t nbytes) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Places `nbytes` like Store but copies nothing: the caller fills the
  // returned bytes (e.g. with an asynchronous device copy) and must not
  // Fetch or Locate the ticket before they are written. Same errors.
  absl::StatusOr<Placed> Reserve(size_t nbytes) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Where the ticket's bytes are, valid until its Release or Park (read
  // back first when spilled); `kind` decides what is read back ahead and
  // whether it counts as a fetch (BlockSpiller::ReadKind). NOT_FOUND for an
  // unknown or released ticket.
  absl::StatusOr<Located> Locate(uint64_t ticket, ReadKind kind = ReadKind::kActivation)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // Copies the ticket's bytes to `dst`. NOT_FOUND for an unknown or released
  // ticket, OUT_OF_RANGE when `capacity` is too small. Works after the daemon
  // went away: the memory is still mapped here.
  absl::Status Fetch(uint64_t ticket, void* dst, size_t capacity) ABSL_LOCKS_EXCLUDED(table_.mu());
  // The ticket's size, or NOT_FOUND.
  absl::StatusOr<uint64_t> Size(uint64_t ticket) const ABSL_LOCKS_EXCLUDED(table_.mu());
  // Marks a Reserve'd ticket's bytes as written: from now on it may be
  // spilled (Store's are written at once). Never-marked tickets never spill.
  absl::Status MarkWritten(uint64_t ticket) ABSL_LOCKS_EXCLUDED(table_.mu());
  // The caller keeps no pointer into the ticket's bytes any more (a
  // Reserve's or a Locate's): they count as written, and the block may
  // spill; Locate finds them again. For long-lived buffers used now and
  // then (an optimizer's states between steps). NOT_FOUND as Locate.
  absl::Status Park(uint64_t ticket) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Frees the ticket's place; empty segments beyond the batch, and emptied
  // dedicated leases but the last, go back to the daemon.
  absl::Status Release(uint64_t ticket) ABSL_LOCKS_EXCLUDED(table_.mu());
  // The daemon asked for `bytes` of this store's leases for a session that
  // waits (ReportUsageReply.reclaim_bytes): gives back retained leases, then
  // spills the coldest blocks and gives back the leases that emptied. Waits
  // for a storing thread's turn; called from the usage reporter's thread,
  // never the trainer's. Returns the bytes given back.
  absl::StatusOr<uint64_t> GiveForOthers(uint64_t bytes) ABSL_LOCKS_EXCLUDED(table_.mu());
  // This store's counts (the wire message the client reports).
  v1::ClientUsage usage() const ABSL_LOCKS_EXCLUDED(table_.mu());
  // OK, or the first registration failure (leases then run unpinned).
  absl::Status pin_status() const ABSL_LOCKS_EXCLUDED(table_.mu());

 private:
  using Arena = BlockTable::Arena;
  using Block = BlockTable::Block;
  using Placement = BlockTable::Placement;
  // A buffer just placed: its ticket and where its bytes are.
  struct Spot {
    uint64_t ticket = 0;
    Arena* arena = nullptr;
    uint64_t offset = 0;
  };

  // OK unless the backend is lost and the ticket's memory is the daemon's
  // to reuse: a device pool's (zeroed and granted again in place), or a
  // host lease of a daemon that frees the leases of sessions that do not
  // attach again (MemoryReclaimedWhenLost). `what` names the call.
  absl::Status CheckNotReclaimed(uint64_t ticket, absl::string_view what) const;

  // A buffer of at most a segment, in a shared lease: where there is room,
  // else (one thread at a time) in leases leased, or emptied by spilling.
  absl::StatusOr<Spot> PlaceShared(size_t nbytes) ABSL_LOCKS_EXCLUDED(table_.mu());
  // A buffer bigger than a segment, in a dedicated lease of contiguous
  // segments: the spare one of its size if any, else a new one. The last one
  // released is kept as a spare for the next big buffer of the same size (a
  // layer's activations come back every step).
  absl::StatusOr<Spot> PlaceDedicated(size_t nbytes) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Gives `placement` a ticket; its bytes count as unwritten until
  // MarkWritten (they cannot spill meanwhile).
  Spot AddTicket(const Placement& placement) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu());
  // An empty dedicated arena of `bytes` kept for reuse, if any.
  Arena* SpareDedicated(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu());

  // The rooms, each with one job, over one table (declared in the order
  // they are built; each uses only those before it):
  BlockTable table_;          // what is held where, and its counters
  ArenaLeases leases_;        // leasing, mapping, registering, giving back
  LeaseRetention retention_;  // which empty leases stay, and the sweeper
  BlockSpiller spiller_;      // spilling, reading back (ahead of need too)
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_LOCAL_STORE_H_
