// ArenaLeases: how a LocalStore's leases become arenas of its table and go
// back: leasing from the backend, mapping (and registering for CUDA) through
// the tier's LeaseMapper, registering late from a thread with CUDA work,
// and unmapping and returning. Private to LocalStore.
//
// Leasing is one thread at a time: whoever leases holds a Turn for the whole
// round (place, lease, spill, place again), so that the threads that wait
// for it find room in what it mapped instead of leasing too.
//
// Thread-safety: any thread, with no table lock held (methods lock the table
// themselves and make syscalls and CUDA calls without it). The backend and
// table must outlive the object.
#ifndef ACTSTASH_CLIENT_STORE_ARENA_LEASES_H_
#define ACTSTASH_CLIENT_STORE_ARENA_LEASES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/store/block_table.h"
#include "client/store/lease_backend.h"
#include "client/store/lease_mapper.h"

namespace actstash::client_internal {

class ArenaLeases {
 public:
  using Arena = BlockTable::Arena;

  // The right to lease: held by one thread at a time (see above).
  class ABSL_SCOPED_LOCKABLE Turn {
   public:
    explicit Turn(ArenaLeases* leases) ABSL_EXCLUSIVE_LOCK_FUNCTION(leases->turn_mu_)
        : lock_(&leases->turn_mu_) {}
    ~Turn() ABSL_UNLOCK_FUNCTION() = default;
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

   private:
    absl::MutexLock lock_;
  };

  ArenaLeases(LeaseBackend* backend, BlockTable* table, uint64_t segment_bytes,
              std::unique_ptr<LeaseMapper> mapper);

  LeaseBackend& backend() const { return backend_; }
  const LeaseMapper& mapper() const { return *mapper_; }
  uint64_t segment_bytes() const { return segment_bytes_; }

  // Leases `count` leases of `segments` segments each and maps them (not yet
  // in the table: the caller adopts them). All or nothing: on a failed
  // mapping, what was mapped is unmapped and everything granted goes back.
  absl::StatusOr<std::vector<std::unique_ptr<Arena>>> Lease(uint32_t count, uint32_t segments,
                                                            bool dedicated, const Turn& turn)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // Unmaps a detached arena and returns its lease.
  void GiveBack(std::unique_ptr<Arena> arena);
  // Detaches the empty arenas that `keep` rejects, newest first, until
  // `limit` bytes went, and gives them back (memory a spill freed that the
  // next lease needs in the daemon's pool). `keep` runs under the table lock.
  void GiveBackEmpty(const std::function<bool(const Arena&)>& keep, uint64_t limit = UINT64_MAX)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // Registers an arena mapped by a thread without CUDA work, if the calling
  // thread has some; tried once per arena. The caller's buffer in it keeps
  // the arena mapped meanwhile.
  void MaybePinLate(Arena* arena) ABSL_LOCKS_EXCLUDED(table_.mu());
  // Unmaps every arena of the table (the store's end: nothing is returned,
  // closing the session does that).
  void UnmapAll() ABSL_LOCKS_EXCLUDED(table_.mu());
  // OK, or the first registration failure (leases then run unpinned).
  absl::Status pin_status() const ABSL_LOCKS_EXCLUDED(pin_mu_);

 private:
  // Maps (and registers) one granted lease; closes its fds either way.
  absl::StatusOr<std::unique_ptr<Arena>> Map(GrantedLease* lease, bool dedicated)
      ABSL_LOCKS_EXCLUDED(table_.mu());
  // Records a failed registration (usage, pin_status).
  void NotePinFailure(const absl::Status& status) ABSL_LOCKS_EXCLUDED(table_.mu(), pin_mu_);

  LeaseBackend& backend_;
  BlockTable& table_;
  const uint64_t segment_bytes_;
  // What the leases' bytes are (host or device memory) and how they are
  // mapped and registered. Thread-safe (lease_mapper.h).
  const std::unique_ptr<LeaseMapper> mapper_;
  absl::Mutex turn_mu_ ABSL_ACQUIRED_BEFORE(table_.mu());
  mutable absl::Mutex pin_mu_;
  absl::Status pin_status_ ABSL_GUARDED_BY(pin_mu_);
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_ARENA_LEASES_H_
