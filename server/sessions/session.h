// A client session: identity, token, quota accounting and counters.
#ifndef ACTSTASH_SERVER_SESSIONS_SESSION_H_
#define ACTSTASH_SERVER_SESSIONS_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "actstash/v1/handover.pb.h"
#include "actstash/v1/stash.pb.h"

namespace actstash::server {

class Session;

// Bytes of a session's quota held by one object (or one in-flight Put).
// Move-only; gives the bytes back when destroyed. Keeps its Session alive.
class QuotaReservation {
 public:
  QuotaReservation() = default;
  ~QuotaReservation() { Reset(); }
  QuotaReservation(QuotaReservation&& other) noexcept { *this = std::move(other); }
  QuotaReservation& operator=(QuotaReservation&& other) noexcept;
  QuotaReservation(const QuotaReservation&) = delete;
  QuotaReservation& operator=(const QuotaReservation&) = delete;

  uint64_t bytes() const { return bytes_; }
  void Reset();

 private:
  friend class Session;
  QuotaReservation(std::shared_ptr<Session> session, uint64_t bytes)
      : session_(std::move(session)), bytes_(bytes) {}
  std::shared_ptr<Session> session_;
  uint64_t bytes_ = 0;
};

// Identity of the process on the other end of the attach connection.
// The steady clock in milliseconds: the time base of idle tracking.
int64_t SteadyNowMs();

struct PeerCredentials {
  uint32_t uid = 0;
  uint32_t gid = 0;
  uint32_t pid = 0;
};

// Thread-safe. Created and closed only by SessionManager; shared with
// in-flight RPCs and with the reservations of its objects, so it may outlive
// its closing.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(uint64_t id, std::string token, std::string name, uint32_t pid, uint64_t quota_bytes,
          int64_t opened_unix_ms);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }
  const std::string& name() const { return name_; }
  uint64_t quota_bytes() const { return quota_bytes_; }

  // Reserves `bytes` of the quota. RESOURCE_EXHAUSTED (with requested, quota,
  // used and available bytes) when it does not fit; FAILED_PRECONDITION once
  // the session is closed.
  absl::StatusOr<QuotaReservation> Reserve(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t used_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  void RecordStore(uint64_t bytes);
  void RecordFetch(uint64_t bytes);
  // Keeps the client's latest report of its zero-copy side, as sent.
  void RecordClientUsage(const v1::ClientUsage& usage) ABSL_LOCKS_EXCLUDED(mu_);
  // Lease bookkeeping (by LeaseManager): count and bytes held now.
  void AddLeases(int64_t count, int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Attach state (by AttachServer). Attached sessions never idle out.
  void SetAttached(const PeerCredentials& peer) ABSL_LOCKS_EXCLUDED(mu_);
  void SetDetached() ABSL_LOCKS_EXCLUDED(mu_);
  bool attached() const ABSL_LOCKS_EXCLUDED(mu_);
  // Marks activity now (every authenticated call), for the idle TTL.
  void Touch();
  // Milliseconds of the steady clock (SteadyNowMs) at the last Touch or at
  // creation: immune to wall-clock steps.
  int64_t last_active_ms() const { return last_active_ms_.load(std::memory_order_relaxed); }
  uint64_t leased_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Copy activity, for the node's copy share (server/sessions/copy_share.h): a store,
  // a fetch, a reported zero-copy byte count that grew, or a CopyShare call
  // marks the session as copying now.
  void MarkCopying() { last_copy_ms_.store(SteadyNowMs(), std::memory_order_relaxed); }
  // Copied within the `window_ms` before `now_ms` (SteadyNowMs).
  bool CopiedWithin(int64_t now_ms, int64_t window_ms) const {
    return now_ms - last_copy_ms_.load(std::memory_order_relaxed) <= window_ms;
  }
  // What the session's copies reached alone (its CopyShare request), shown
  // in its stats.
  void SetCopyProbe(double store_bytes_per_second, double fetch_bytes_per_second)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The NUMA node its last host Lease said it copies from (-1: none said),
  // and a host lease granted on memory bound to another node (by
  // LeaseManager), both shown in its stats.
  void SetNumaNode(int node) { numa_node_.store(node, std::memory_order_relaxed); }
  int numa_node() const { return numa_node_.load(std::memory_order_relaxed); }
  void CountLeaseOffNode() { leases_off_node_.fetch_add(1, std::memory_order_relaxed); }
  // The daemon asked it for `bytes` of its leases, for a session that waits.
  void CountReclaimAsk(uint64_t bytes) {
    reclaims_asked_.fetch_add(1, std::memory_order_relaxed);
    reclaim_bytes_asked_.fetch_add(bytes, std::memory_order_relaxed);
  }
  // What the session itself counts, filled into the wire message (the one
  // place these fields are set): everything but `objects` (the catalog's)
  // `spill` (the spill tier's) and `copying` (the daemon's copy window).
  void FillStats(v1::SessionStats* out) const ABSL_LOCKS_EXCLUDED(mu_);
  // Take-over: what a successor needs of this session (all but its attach
  // connection, which the attach server hands over), and the counters a
  // successor's copy takes back from it.
  void ExportState(v1::SessionState* out) const ABSL_LOCKS_EXCLUDED(mu_);
  void RestoreCounters(const v1::SessionState& state) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class SessionManager;
  friend class QuotaReservation;
  void MarkClosed() { closed_.store(true, std::memory_order_release); }
  void Release(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t id_;
  const std::string token_;
  const std::string name_;
  const uint32_t pid_;
  const uint64_t quota_bytes_;
  const int64_t opened_unix_ms_;
  std::atomic<bool> closed_{false};
  mutable absl::Mutex mu_;
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool attached_ ABSL_GUARDED_BY(mu_) = false;
  PeerCredentials peer_ ABSL_GUARDED_BY(mu_);
  uint64_t leases_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t leased_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  v1::ClientUsage client_usage_ ABSL_GUARDED_BY(mu_);
  double probe_store_bps_ ABSL_GUARDED_BY(mu_) = 0;
  double probe_fetch_bps_ ABSL_GUARDED_BY(mu_) = 0;
  // Never copied: far enough in the past for any window.
  std::atomic<int64_t> last_copy_ms_{INT64_MIN / 2};
  std::atomic<int64_t> last_active_ms_{0};
  std::atomic<int> numa_node_{-1};
  std::atomic<uint64_t> leases_off_node_{0};
  std::atomic<uint64_t> reclaims_asked_{0};
  std::atomic<uint64_t> reclaim_bytes_asked_{0};
  std::atomic<uint64_t> bytes_stored_{0};
  std::atomic<uint64_t> bytes_fetched_{0};
  std::atomic<uint64_t> puts_{0};
  std::atomic<uint64_t> gets_{0};
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SESSIONS_SESSION_H_
