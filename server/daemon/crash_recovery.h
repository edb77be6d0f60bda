// Restart after a crash: what a daemon keeps in its service manager's fd
// store (server/base/service_manager.h) and how the next start finds it.
//
// Stored, under these names: "state" (the state table, server/handover/
// state_table.h), "seg-<i>" (host pool segment i's memfd; replaced after
// each renewal) and "attach" (the attach socket's listener, so that clients
// that reconnect while the daemon is down wait in its backlog). A start with
// those fds passed ($LISTEN_FDS) maps the same segments, takes the sessions
// and leases from the table, and gives the sessions a grace period to
// attach again (Daemon::AdoptRecovered, daemon_recovery.cc).
#ifndef ACTSTASH_SERVER_DAEMON_CRASH_RECOVERY_H_
#define ACTSTASH_SERVER_DAEMON_CRASH_RECOVERY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "server/base/service_manager.h"
#include "server/daemon/config.h"
#include "server/handover/state_table.h"
#include "server/pool/host_pool.h"
#include "server/sessions/state_journal.h"

namespace actstash::server {

inline constexpr char kStateFdName[] = "state";
inline constexpr char kAttachFdName[] = "attach";
std::string SegmentFdName(uint32_t segment);

// The table's geometry for `config`.
TableGeometry GeometryOf(const DaemonConfig& config);

// What the service manager passed back at start.
struct Recovery {
  // Null when nothing can be recovered; why_lost says why when a state was
  // passed (and is then logged, and its segments are not reused).
  std::unique_ptr<StateTable> table;
  RecoveredState state;
  std::string why_lost;
  // Per configured segment: the memfd to map again, or invalid for a fresh
  // one (none kept, or free memory a client that returned it may still map).
  std::vector<UniqueFd> segments;
  // Free segments mapped again: they may hold a lost inline object's bytes
  // (scrubbed before they are leased).
  std::vector<uint32_t> reused_free;
  UniqueFd attach_listener;  // invalid: none passed
  // Names of kept fds this start does not use again (to drop from the store:
  // segments outside the pool, a second table).
  std::vector<std::string> dropped_names;
};

// Sorts the passed fds and reads the state table. Never fails: a state
// that cannot be trusted is reported in why_lost, unknown fds are closed.
Recovery CollectRecovery(const DaemonConfig& config, std::vector<PassedFd> passed);

// The daemon's StateJournal: the state table, and after each renewal the
// renewed segments' new memfds in the service manager's store (before the
// table calls them clean). Thread-safe, as StateJournal asks.
class DaemonJournal final : public StateJournal {
 public:
  // `notifier` is not owned and must outlive the journal; so must the pool
  // (SetPool, before anything is renewed).
  DaemonJournal(std::unique_ptr<StateTable> table, const ServiceNotifier* notifier)
      : table_(std::move(table)), notifier_(*notifier) {}
  void SetPool(const FdSegmentLeaser* pool) { pool_ = pool; }

  StateTable& table() { return *table_; }
  const ServiceNotifier& notifier() const { return notifier_; }

  void SessionOpened(const v1::SessionState& session) override { table_->SessionOpened(session); }
  void SessionClosed(uint64_t session_id) override { table_->SessionClosed(session_id); }
  void LeaseGranted(const v1::LeaseState& lease) override { table_->LeaseGranted(lease); }
  void LeaseReleased(uint64_t lease_id, uint32_t first_segment) override {
    table_->LeaseReleased(lease_id, first_segment);
  }
  void SegmentsRenewed(uint32_t first, uint32_t count) override;
  void ObjectHandleIssued(uint64_t handle) override { table_->ObjectHandleIssued(handle); }

  // Replaces the kept fd of `segment` by its current memfd.
  absl::Status StoreSegment(uint32_t segment) const;
  // At start, before anything is served: drops the kept fds of
  // `dropped_names`, stores every segment not in `reused_segments` (marking
  // each kept once stored), then the table unless `table_reused`. The first
  // failure is returned (GiveUp then).
  absl::Status KeepForRestart(const std::vector<bool>& reused_segments, bool table_reused,
                              const std::vector<std::string>& dropped_names);
  // Recovery cannot be promised: the table is retired and dropped from the
  // store (the next start is a fresh one).
  void GiveUp();

 private:
  const std::unique_ptr<StateTable> table_;
  const ServiceNotifier& notifier_;
  const FdSegmentLeaser* pool_ = nullptr;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_DAEMON_CRASH_RECOVERY_H_
