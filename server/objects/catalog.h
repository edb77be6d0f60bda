// Catalog: the stored objects of all sessions, by handle.
#ifndef ACTSTASH_SERVER_OBJECTS_CATALOG_H_
#define ACTSTASH_SERVER_OBJECTS_CATALOG_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "actstash/v1/handover.pb.h"
#include "common/residence.h"
#include "server/base/removed_totals.h"
#include "server/base/state_journal.h"
#include "server/pool/memory_pool.h"
#include "server/sessions/session.h"

namespace actstash::server {

struct ObjectMeta {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  int checksum_algorithm = 0;  // actstash.v1.ChecksumAlgorithm value
  uint64_t checksum = 0;
  uint64_t put_id = 0;  // v1::ObjectHeader.put_id (0: none)
};

class SpillTier;

// An object's header as a client sent it (Put), or as a predecessor handed
// it: INVALID_ARGUMENT for a dtype or shape over the limits, a negative
// dimension, an unknown checksum algorithm.
absl::Status ValidateObjectHeader(const v1::ObjectHeader& header);

// One stored object. Its metadata and bytes never change once built; where
// the bytes live may (the spill tier): in its pool allocation, or in a spill
// file while nobody reads it. It owns its pool memory and its quota
// reservation while resident, so both are given back when the last
// reference goes (the catalog's, or that of a Get still streaming it) or
// when it is spilled. Thread-safe.
class StoredObject {
 public:
  StoredObject(uint64_t session_id, ObjectMeta meta, Allocation memory,
               QuotaReservation reservation)
      : session_id_(session_id),
        meta_(std::move(meta)),
        memory_(std::move(memory)),
        reservation_(std::move(reservation)) {}
  // Drops its spill file, if it has one.
  ~StoredObject();
  StoredObject(const StoredObject&) = delete;
  StoredObject& operator=(const StoredObject&) = delete;

  uint64_t session_id() const { return session_id_; }
  const ObjectMeta& meta() const { return meta_; }
  // The bytes, between BeginRead (kReady, or its callback with OK) and
  // EndRead; or for whoever built it, before it is in the catalog.
  const std::byte* data() const ABSL_LOCKS_EXCLUDED(mu_);

  // Reading. kReady: read now. kMustRestore: the caller reads it back
  // (RestoreInto, then FinishRestore) and is told through `waiter` like the
  // others. kWait: `waiter` runs when the read-back in flight ends (OK: read
  // now). A failed read-back ends the read for every waiter (no EndRead).
  enum class ReadStart { kReady, kMustRestore, kWait };
  absl::StatusOr<ReadStart> BeginRead(std::function<void(absl::Status)> waiter) const
      ABSL_LOCKS_EXCLUDED(mu_);
  void EndRead() const ABSL_LOCKS_EXCLUDED(mu_);
  // The spill file's id (kMustRestore).
  uint64_t spill_id() const ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a read-back: resident again with `memory` and `reservation`, or
  // spilled still (an I/O error), or lost (DATA_LOSS, NOT_FOUND). Runs the
  // waiters.
  void FinishRestore(const absl::Status& status, Allocation memory,
                     QuotaReservation reservation) const ABSL_LOCKS_EXCLUDED(mu_);

  // Spilling: true when it was resident and unread (it is now being spilled;
  // readers may still come and read it meanwhile).
  bool TryBeginSpill() const ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a spill. With a spill id and no reader: the memory and quota go
  // back and the file holds the bytes. With readers (or an error): stays
  // resident; returns the spill id to drop (0: none).
  uint64_t FinishSpill(const absl::StatusOr<uint64_t>& spill_id, SpillTier* tier) const
      ABSL_LOCKS_EXCLUDED(mu_);
  bool resident() const ABSL_LOCKS_EXCLUDED(mu_);

  // Take-over (server/handover). ExportState fills `out` (its residence:
  // the pool offset, or the spill id) and says true; false for a lost
  // object (its successor will not know the handle); UNAVAILABLE while it
  // is read, spilled or read back (the daemon stopped serving: retry).
  absl::StatusOr<bool> ExportState(uint64_t handle, v1::ObjectState* out) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Recording for a restart after a crash: Record writes the object's state
  // (StateJournal::ObjectStored under `handle`) now and again whenever its
  // residence changes, until Unrecord (it left the catalog), which records
  // it gone. The catalog calls both, under its lock.
  void Record(StateJournal* journal, uint64_t handle) const ABSL_LOCKS_EXCLUDED(mu_);
  void Unrecord() const ABSL_LOCKS_EXCLUDED(mu_);
  // An object whose bytes are in spill file `spill_id` of `tier` (adopted
  // from a predecessor).
  static std::shared_ptr<StoredObject> Spilled(uint64_t session_id, ObjectMeta meta,
                                               uint64_t spill_id, SpillTier* tier);

 private:
  // The residence's one move (common/residence.h's table); an edge the
  // table lacks is a broken invariant.
  void MoveLocked(ResidenceEvent event) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The state of a resident or spilled object, as a journal or a successor
  // keeps it.
  void FillState(uint64_t handle, v1::ObjectState* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the journal, if any, of the object's state now.
  void RecordLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const uint64_t session_id_;
  const ObjectMeta meta_;
  mutable absl::Mutex mu_;
  // Where the bytes are: mutable, the object's content is not.
  mutable Residence residence_ ABSL_GUARDED_BY(mu_) = Residence::kResident;
  mutable Allocation memory_ ABSL_GUARDED_BY(mu_);
  mutable QuotaReservation reservation_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t spill_id_ ABSL_GUARDED_BY(mu_) = 0;
  mutable SpillTier* spill_ ABSL_GUARDED_BY(mu_) = nullptr;
  mutable uint32_t readers_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::vector<std::function<void(absl::Status)>> waiters_ ABSL_GUARDED_BY(mu_);
  mutable absl::Status lost_ ABSL_GUARDED_BY(mu_);
  mutable StateJournal* journal_ ABSL_GUARDED_BY(mu_) = nullptr;
  mutable uint64_t handle_ ABSL_GUARDED_BY(mu_) = 0;
};

// Thread-safe. Handles are never 0 and never reused within a daemon's life.
// Objects are destroyed outside the catalog's lock.
class Catalog {
 public:
  // `journal` (not owned; null: none) learns every handle issued and every
  // object's state as it changes (StoredObject::Record), and must outlive
  // the catalog.
  explicit Catalog(StateJournal* journal = nullptr) : journal_(journal) {}
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  // Adds an object of `session` and returns its new handle; FAILED_PRECONDITION
  // when the session was closed meanwhile (the object is then dropped). An
  // object whose put id the session's objects already hold is dropped too,
  // and the handle of that one returned (a Put sent twice: see FindPut);
  // `stored_before` (if set) says which.
  absl::StatusOr<uint64_t> Insert(const Session& session, std::shared_ptr<StoredObject> object,
                                  bool* stored_before = nullptr);
  // The handle of the session's object stored by the Put with `put_id`
  // (v1::ObjectHeader.put_id; 0 never matches), if it still holds it.
  std::optional<uint64_t> FindPut(uint64_t session_id, uint64_t put_id) const;
  // The object if it exists and belongs to `session_id`; else NOT_FOUND
  // (the same answer for both, so handles of others reveal nothing), or
  // DATA_LOSS for a handle a crashed predecessor issued whose object did
  // not survive (see AdvanceNextHandle).
  absl::StatusOr<std::shared_ptr<const StoredObject>> Lookup(uint64_t session_id,
                                                             uint64_t handle) const;
  // All-or-nothing removal: NOT_FOUND naming the first handle that is not
  // the session's, INVALID_ARGUMENT for a repeated handle; then nothing is
  // removed.
  absl::StatusOr<RemovedTotals> Remove(uint64_t session_id, absl::Span<const uint64_t> handles);
  // Removes every object of the session.
  RemovedTotals RemoveSession(uint64_t session_id);

  size_t size() const;
  size_t SessionObjectCount(uint64_t session_id) const;
  // Resident, unread objects of the session, oldest first, now being
  // spilled (TryBeginSpill), until they hold at least `bytes`; never `except`.
  std::vector<std::shared_ptr<StoredObject>> BeginSpill(uint64_t session_id, uint64_t bytes,
                                                        const StoredObject* except);
  // Removes every object (daemon shutdown, before the spill tier goes).
  void RemoveAll();
  // Take-over: the handle the next Insert gives, and raising it to at least
  // `handle` in a successor (handles never repeat across a hand-over).
  // With `lost`, the handles below `handle` were issued by a daemon that
  // crashed: looking up one whose object did not survive (it is not in the
  // catalog) says so.
  uint64_t next_handle() const;
  void AdvanceNextHandle(uint64_t handle, bool lost = false);
  // The handle below which every one was lost that way (0: none).
  uint64_t lost_below() const;
  // Take-over: every object's state appended to `state` (UNAVAILABLE while
  // one is in transit, as StoredObject::ExportState); and an object of a
  // predecessor under its own handle, before anything is served
  // (INVALID_ARGUMENT for handle 0 or one already held).
  absl::Status Export(v1::DaemonState* state) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Adopt(const Session& session, uint64_t handle, std::shared_ptr<StoredObject> object)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  StateJournal* const journal_;
  mutable absl::Mutex mu_;
  uint64_t lost_below_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<StoredObject>> objects_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, absl::flat_hash_set<uint64_t>> by_session_ ABSL_GUARDED_BY(mu_);
  // (session, put id) -> handle, for the objects with a put id.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, uint64_t> by_put_ ABSL_GUARDED_BY(mu_);
  void ForgetPutLocked(const StoredObject& object) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_OBJECTS_CATALOG_H_
