// Restart after a crash: what a daemon keeps in its service manager's fd
// store (server/restart/service_manager.h) and how the next start finds it.
//
// Stored, under these names: "state" (the state table, server/restart/
// state_table.h), "seg-<i>" (host pool segment i's memfd; replaced after
// each renewal), "attach" (the attach socket's listener, so that clients
// that reconnect while the daemon is down wait in its backlog) and
// "spill-<id>" (a spilled lease's or inline object's unlinked file, while
// it is on disk). A start with those fds passed ($LISTEN_FDS) maps the same
// segments, takes the sessions, leases, spill files and inline objects from
// the table, and gives the sessions a grace period to come back
// (Daemon::AdoptRecovered, daemon_recovery.cc).
#ifndef ACTSTASH_SERVER_RESTART_CRASH_RECOVERY_H_
#define ACTSTASH_SERVER_RESTART_CRASH_RECOVERY_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "server/base/state_journal.h"
#include "server/pool/host_pool.h"
#include "server/restart/service_manager.h"
#include "server/restart/state_table.h"

namespace actstash::server {

inline constexpr char kStateFdName[] = "state";
inline constexpr char kAttachFdName[] = "attach";
std::string SegmentFdName(uint32_t segment);
std::string SpillFdName(uint64_t spill_id);
// Spill files a table records: one per segment-sized file the spill tier can
// hold (its size over the segment size), within the bounds below (a slot is 64
// bytes of a memfd whose pages are only backed once used). The service
// manager must keep them too: FileDescriptorStoreMax counts them.
inline constexpr uint32_t kMinKeptSpillFiles = 4096;
inline constexpr uint32_t kMaxKeptSpillFiles = 1 << 20;
// Inline objects a table records at most: one per this many bytes of the
// pool, within the bounds below (a slot is 128 bytes of a memfd whose pages
// are only backed once used).
inline constexpr uint64_t kPoolBytesPerKeptObject = 64 << 10;
inline constexpr uint32_t kMinKeptObjects = 4096;
inline constexpr uint32_t kMaxKeptObjects = 1 << 20;

// The table's geometry for a pool of `pool_bytes` in segments of
// `segment_bytes`, `max_sessions` sessions, and a spill tier that can hold
// `spill_tier_bytes` (0: no spill tier).
TableGeometry TableGeometryFor(uint64_t pool_bytes, uint64_t segment_bytes, size_t max_sessions,
                               uint64_t spill_tier_bytes);

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
  // Free segments mapped again: they hold the recovered inline objects, and
  // may hold a lost one's bytes (scrubbed before they are leased).
  std::vector<uint32_t> reused_free;
  // The recovered spill files' fds, in the order of state.spill_files (each
  // recorded file whose fd was not passed back is dropped from both).
  std::vector<UniqueFd> spill_fds;
  UniqueFd attach_listener;  // invalid: none passed
  // Names of kept fds this start does not use again (to drop from the store:
  // segments outside the pool, a second table).
  std::vector<std::string> dropped_names;
};

// Sorts the passed fds and reads the state table of `geometry` (the
// configured one: a table of another is not trusted). Never fails: a state
// that cannot be trusted is reported in why_lost, unknown fds are closed.
// Nothing is recovered when `device_pools` are configured.
Recovery CollectRecovery(const TableGeometry& geometry, bool device_pools,
                         std::vector<PassedFd> passed);

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
  void LeasedSegmentsRenewed(uint32_t first, uint32_t count) override;
  void ObjectHandleIssued(uint64_t handle) override { table_->ObjectHandleIssued(handle); }
  void ObjectStored(const v1::ObjectState& object) override { table_->ObjectStored(object); }
  void ObjectGone(uint64_t handle) override { table_->ObjectGone(handle); }
  // The fd goes to the service manager's store first, then the table
  // records the file (neither when the store has no room left for it).
  void SpillFileKept(const v1::SpillFileState& file, int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  void SpillFileGone(uint64_t spill_id) override ABSL_LOCKS_EXCLUDED(mu_);
  // Files a restart adopted: the store and the table hold them already.
  void SpillFilesRecovered(const std::vector<v1::SpillFileState>& files) ABSL_LOCKS_EXCLUDED(mu_);

  // Replaces the kept fd of `segment` by its current memfd.
  absl::Status StoreSegment(uint32_t segment) const;
  // At start, before anything is served: drops the kept fds of
  // `dropped_names`, stores every segment not in `reused_segments` (marking
  // each kept once stored), then the table when `store_table`. The first
  // failure is returned (GiveUp then).
  absl::Status KeepForRestart(const std::vector<bool>& reused_segments, bool store_table,
                              const std::vector<std::string>& dropped_names);
  // Replaces the kept table by this one (a take-over's successor, once its
  // predecessor is gone: until then the store keeps the predecessor's).
  absl::Status StoreTable() const;
  // Recovery cannot be promised: the table is retired and dropped from the
  // store (the next start is a fresh one).
  void GiveUp();

 private:
  const std::unique_ptr<StateTable> table_;
  const ServiceNotifier& notifier_;
  const FdSegmentLeaser* pool_ = nullptr;
  absl::Mutex mu_;
  absl::flat_hash_set<uint64_t> kept_spills_ ABSL_GUARDED_BY(mu_);
  // How many spill fds the store takes beside the pool's ($FDSTORE).
  uint64_t spill_room_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<uint64_t>::max();
  bool spill_room_logged_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RESTART_CRASH_RECOVERY_H_
