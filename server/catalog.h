// Catalog: the stored objects of all sessions, by handle.
#ifndef ACTSTASH_SERVER_CATALOG_H_
#define ACTSTASH_SERVER_CATALOG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/memory_pool.h"
#include "server/session.h"

namespace actstash::server {

struct ObjectMeta {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  int checksum_algorithm = 0;  // actstash.v1.ChecksumAlgorithm value
  uint64_t checksum = 0;
};

// One stored object: immutable once built. It owns its pool memory and its
// quota reservation, so both are given back when the last reference goes
// (the catalog's, or that of a Get still streaming it).
class StoredObject {
 public:
  StoredObject(uint64_t session_id, ObjectMeta meta, Allocation memory,
               QuotaReservation reservation)
      : session_id_(session_id),
        meta_(std::move(meta)),
        memory_(std::move(memory)),
        reservation_(std::move(reservation)) {}
  StoredObject(const StoredObject&) = delete;
  StoredObject& operator=(const StoredObject&) = delete;

  uint64_t session_id() const { return session_id_; }
  const ObjectMeta& meta() const { return meta_; }
  const std::byte* data() const { return memory_.data(); }

 private:
  const uint64_t session_id_;
  const ObjectMeta meta_;
  Allocation memory_;
  QuotaReservation reservation_;
};

struct RemovedTotals {
  uint64_t objects = 0;
  uint64_t bytes = 0;
};

// Thread-safe. Handles are never 0 and never reused within a daemon's life.
// Objects are destroyed outside the catalog's lock.
class Catalog {
 public:
  Catalog() = default;
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  // Adds an object of `session` and returns its new handle; FAILED_PRECONDITION
  // when the session was closed meanwhile (the object is then dropped).
  absl::StatusOr<uint64_t> Insert(const Session& session, std::shared_ptr<StoredObject> object);
  // The object if it exists and belongs to `session_id`; else NOT_FOUND
  // (the same answer for both, so handles of others reveal nothing).
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

 private:
  mutable absl::Mutex mu_;
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<StoredObject>> objects_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, absl::flat_hash_set<uint64_t>> by_session_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_CATALOG_H_
