// LeaseManager: whole pool segments leased to sessions for the zero-copy
// data plane.
#ifndef ACTSTASH_SERVER_SESSIONS_LEASE_MANAGER_H_
#define ACTSTASH_SERVER_SESSIONS_LEASE_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/tiered_id.h"
#include "server/base/removed_totals.h"
#include "server/base/state_journal.h"
#include "server/pool/segment_leaser.h"
#include "server/sessions/session.h"

namespace actstash::server {

class LeaseManager;

// One lease: a run of segments and the quota it holds. The quota goes back
// when the last reference drops (the table's, or that of a grant still being
// renewed and sent); the memory goes back through LeaseManager::Recycle,
// which renews it first. Immutable; any thread.
class Lease {
 public:
  Lease(uint64_t id, std::shared_ptr<Session> session, SegmentRun run, QuotaReservation reservation,
        LeaseManager* manager);
  ~Lease();
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  uint64_t id() const { return id_; }
  uint64_t session_id() const { return session_->id(); }
  uint32_t first_segment() const { return run_.first_segment; }
  uint32_t segments() const { return run_.count; }
  uint64_t bytes() const { return run_.memory.size(); }
  bool needs_scrub() const { return run_.needs_scrub; }
  int numa_node() const { return run_.numa_node; }  // -1: not bound to one node
  std::byte* data() const { return run_.memory.data(); }

 private:
  const uint64_t id_;
  const std::shared_ptr<Session> session_;
  SegmentRun run_;
  QuotaReservation reservation_;
  LeaseManager* const manager_;
};

class WorkQueue;

// Lease ids of the manager of index `tier` (0: the host pool, 1 + i: device
// pool i) are tiered_id::Make(tier, n), n >= 1 (common/tiered_id.h): unique
// across managers, so that a lease id alone names its manager.

// Thread-safe. Lease ids are never 0 and never reused in a daemon's life.
// The pool may be a host pool or a device pool (whose renewal zeroes).
class LeaseManager {
 public:
  // Leases segments of `pool`. Released leases are renewed on `work`, off
  // the releasing thread; null `work` (tests): in the releasing thread.
  // Neither is owned. `pool` must outlive the manager and every Lease it
  // granted; `work` must keep running tasks until StopRenewing() was called
  // (and what it had queued has run).
  // `journal` (not owned; null: none) records every grant, release and
  // renewal, and must outlive the manager.
  LeaseManager(SegmentLeaser* pool, WorkQueue* work, uint32_t tier = 0,
               StateJournal* journal = nullptr)
      : pool_(*pool),
        work_(work),
        tier_(tier),
        journal_(journal),
        next_id_(tiered_id::Make(tier, 1)) {}
  // From now on, released memory is freed as it is, unrenewed (daemon
  // shutdown, once nothing leases any more): nothing is posted to `work`.
  void StopRenewing() { renew_.store(false); }
  // A released lease's memory: renewed, then freed. Called by ~Lease.
  void Recycle(SegmentRun run);
  LeaseManager(const LeaseManager&) = delete;
  LeaseManager& operator=(const LeaseManager&) = delete;

  // Grants `count` leases of `segments_per_lease` contiguous segments each,
  // all or none: RESOURCE_EXHAUSTED (quota or pool, with the numbers),
  // FAILED_PRECONDITION when the session is closed. The grants still need
  // scrubbing (needs_scrub) before their fds leave the daemon; the journal
  // records each grant here, or for one that needs scrubbing, in Scrub.
  // `numa_node`
  // (-1: none) is the node the session copies from: a pool split per node
  // grants from that node's part first; a grant bound to another node is
  // counted in the session's leases_off_node.
  absl::StatusOr<std::vector<std::shared_ptr<Lease>>> Grant(const std::shared_ptr<Session>& session,
                                                            uint32_t count,
                                                            uint32_t segments_per_lease,
                                                            int numa_node = -1);
  // Gives a granted lease that needs_scrub fresh memory (RenewSegments of
  // its run) before its fds leave the daemon, and records the new memfds,
  // then the lease (if still granted), in the journal. The pool's error when
  // the renewal fails (the lease is then not recorded).
  absl::Status Scrub(const Lease& lease) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes leases back, all or none: NOT_FOUND for one that is not the
  // session's, INVALID_ARGUMENT for a repeat.
  absl::StatusOr<RemovedTotals> Return(uint64_t session_id, absl::Span<const uint64_t> ids);
  // What Return would answer, without taking anything back.
  absl::Status CheckReturn(uint64_t session_id, absl::Span<const uint64_t> ids) const;
  // Takes back those of `ids` that are the session's; ignores the others.
  RemovedTotals ReturnAny(uint64_t session_id, absl::Span<const uint64_t> ids);
  // The session's lease `id` (host or device tier of this manager), or
  // NOT_FOUND as Return.
  absl::StatusOr<std::shared_ptr<Lease>> Find(uint64_t session_id, uint64_t id) const;
  // Takes back every lease of the session.
  RemovedTotals ReleaseSession(uint64_t session_id);
  // The client's answer to a restart (ConfirmLeases): takes back the
  // session's carried leases (adopted, see Adopt) that are not in `held`,
  // and makes the rest ordinary leases. Leases granted by this manager are
  // never taken here.
  RemovedTotals ReleaseUnclaimed(uint64_t session_id, absl::Span<const uint64_t> held);

  // Take-over (server/handover). Export: every lease, for a successor; call
  // it once nothing grants or returns any more (the daemon stopped serving).
  // Adopt: lease `state` of `session` on `run` (the pool's AdoptRun), with
  // its id, before anything is served: its quota is reserved again. It is
  // carried until its client claims it (ReleaseUnclaimed): the grant may
  // have been recorded by a daemon that died before its answer left.
  // INVALID_ARGUMENT for an id of another tier or one already held,
  // RESOURCE_EXHAUSTED when the session's quota cannot hold it.
  std::vector<v1::LeaseState> Export() const;
  // `run` is taken only when the lease is adopted; on an error the caller
  // still holds it (to renew it: a client may map that memory).
  absl::Status Adopt(const std::shared_ptr<Session>& session, const v1::LeaseState& state,
                     SegmentRun* run);
  // The id the next grant gets, and the grants counted so far.
  uint64_t next_id() const;
  // Restores both from a predecessor (ids never repeat).
  void Restore(uint64_t next_id, uint64_t granted_total);

  // Released leases whose memory is still being renewed (counted as used).
  int64_t renewals_pending() const { return renewals_pending_.load(); }
  uint64_t renewing_bytes() const { return renewing_bytes_.load(); }
  uint64_t leased_bytes() const;
  size_t size() const;
  uint64_t granted_total() const;
  // Sessions holding at least one lease, `also` counted whether or not it
  // holds one (0: none).
  uint64_t sessions_holding(uint64_t also = 0) const;

 private:
  // Removes those of `ids` that are the session's into `removed` (whose
  // owner destroys them after releasing mu_).
  RemovedTotals TakeLocked(uint64_t session_id, absl::Span<const uint64_t> ids,
                           std::vector<std::shared_ptr<Lease>>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckReturnLocked(uint64_t session_id, absl::Span<const uint64_t> ids) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the journal of a grant (or adoption), under mu_: before the grant
  // leaves the manager.
  void Record(const Lease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SegmentLeaser& pool_;
  WorkQueue* const work_;
  const uint32_t tier_;
  StateJournal* const journal_;
  std::atomic<bool> renew_{true};
  std::atomic<int64_t> renewals_pending_{0};
  std::atomic<uint64_t> renewing_bytes_{0};
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_);
  uint64_t granted_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t leased_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Lease>> leases_ ABSL_GUARDED_BY(mu_);
  // Adopted leases (ids) no client has claimed yet; a subset of leases_.
  absl::flat_hash_set<uint64_t> carried_ ABSL_GUARDED_BY(mu_);
  // Runs whose renewal failed: never handed out again (freed with the manager).
  std::vector<SegmentRun> quarantine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SESSIONS_LEASE_MANAGER_H_
