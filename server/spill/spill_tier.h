// SpillTier: the daemon's disk tier below the host pool. A session's leased
// segments are written to files in --spill-dir (the lease stays the
// session's, so the memory is reused at once) and read back into a lease of
// the same size when the session asks, checksum verified.
//
// Files are created unlinked (O_TMPFILE, else created and unlinked at once):
// the daemon's open fd is the only name a spill file has, so a daemon killed
// with SIGKILL leaves nothing on disk, and closing the fd frees the space.
// With a StateJournal (a service manager keeps fds for a restart after a
// crash), a spilled lease's file is given to it once written, before its id
// is answered, and taken back when it leaves the tier: a restarted daemon
// adopts the files its table and the service manager both still hold.
#ifndef ACTSTASH_SERVER_SPILL_SPILL_TIER_H_
#define ACTSTASH_SERVER_SPILL_SPILL_TIER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "actstash/v1/handover.pb.h"
#include "actstash/v1/stash.pb.h"
#include "common/unique_fd.h"
#include "server/base/removed_totals.h"
#include "server/base/state_journal.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session.h"

namespace actstash::server {

struct SpillOptions {
  std::string dir;
  uint64_t size_bytes = 0;  // 0: bounded by the file system's free space only
  uint32_t workers = 2;     // segments written or read at once
  uint32_t depth = 8;       // I/O requests in flight per worker
  uint64_t chunk_bytes = 4ull << 20;
};

// Thread-safe. Spill and Restore return at once; their `done` runs later on
// a spill worker thread (it must not block). The destructor waits for the
// operations in flight, runs their `done`, and closes every file.
class SpillTier {
 public:
  // Checks that `options.dir` is a writable directory where unlinked files
  // can be made; FAILED_PRECONDITION naming the problem otherwise.
  static absl::StatusOr<std::unique_ptr<SpillTier>> Open(const SpillOptions& options);
  ~SpillTier();
  SpillTier(const SpillTier&) = delete;
  SpillTier& operator=(const SpillTier&) = delete;

  // Where spilled leases' files are kept for a restart (not owned; outlives
  // the tier). Set before anything is spilled or adopted. Every file that
  // leaves the tier is reported to it (SpillFileGone).
  void SetJournal(StateJournal* journal) { journal_ = journal; }

  // A file written: its spill id and the XXH3 of the bytes it holds.
  struct Written {
    uint64_t id = 0;
    uint64_t checksum = 0;
  };
  // Writes all of `lease`'s memory to a new file of the session; `done` gets
  // its spill id and checksum. RESOURCE_EXHAUSTED (with the numbers) when
  // --spill-size or the disk is full: nothing stays on disk, the memory is
  // untouched. The caller must not let the lease's memory change until
  // `done` runs.
  using SpillDone = std::function<void(absl::StatusOr<Written>)>;
  void Spill(std::shared_ptr<Session> session, std::shared_ptr<Lease> lease, SpillDone done) {
    std::byte* data = lease->data();
    const uint64_t bytes = lease->bytes();
    SpillBytes(std::move(session), data, bytes, std::move(lease), std::move(done));
  }
  // Spill of any daemon memory of the session (an inline object): `data`
  // stays valid (`keepalive` holds it) and unchanged until `done` runs.
  // Every file written is given to the journal (if any) before `done` runs,
  // so that it survives a crash: a lease's, whose client keeps the id, and
  // an inline object's, which the journal records with the object.
  void SpillBytes(std::shared_ptr<Session> session, const std::byte* data, uint64_t bytes,
                  std::shared_ptr<const void> keepalive, SpillDone done);
  // Reads spill `spill_id` of the session into `lease` (of the same size),
  // verifies its checksum, then deletes the file. NOT_FOUND for another
  // session's or an unknown id, FAILED_PRECONDITION while it is still being
  // written or read, INVALID_ARGUMENT for a size mismatch, DATA_LOSS when the
  // bytes read are not the bytes written (the file is then dropped).
  void Restore(std::shared_ptr<Session> session, uint64_t spill_id, std::shared_ptr<Lease> lease,
               std::function<void(absl::Status)> done) {
    std::byte* data = lease->data();
    const uint64_t bytes = lease->bytes();
    RestoreBytes(std::move(session), spill_id, data, bytes, std::move(lease), std::move(done));
  }
  // Restore into any daemon memory of `bytes` (kept alive by `keepalive`).
  void RestoreBytes(std::shared_ptr<Session> session, uint64_t spill_id, std::byte* data,
                    uint64_t bytes, std::shared_ptr<const void> keepalive,
                    std::function<void(absl::Status)> done);
  // Deletes spill files of the session, all or none (NOT_FOUND, as Return).
  absl::StatusOr<RemovedTotals> Drop(uint64_t session_id, absl::Span<const uint64_t> ids);
  // Deletes every spill file of the session (closed, reclaimed). A write or
  // read in flight finishes first; its file is dropped when it does.
  RemovedTotals ReleaseSession(uint64_t session_id);

  // The tier's numbers (the wire message: a new counter is a field and the
  // line that keeps it) and one session's part of them.
  v1::SpillStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  v1::SessionSpillStats SessionStats(uint64_t session_id) const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& dir() const { return options_.dir; }

  // Take-over (server/handover). Export appends every file to `state`
  // (spill_files, with a duplicate of its fd appended to `fds`;
  // next_spill_id; spill_totals); UNAVAILABLE while a write or read is in
  // flight (the daemon has stopped serving: they end; retry). Adopt takes
  // a predecessor's files, before anything is served: INVALID_ARGUMENT for
  // a fd index out of range, an id out of range or repeated, a file shorter
  // than its bytes, one of a session the state does not hold;
  // then nothing is adopted. Session numbers come from state.sessions' spill.
  absl::Status Export(v1::DaemonState* state, std::vector<UniqueFd>* fds) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Adopt(const v1::DaemonState& state, std::vector<UniqueFd>* fds)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether file `id` is the session's and holds `bytes`.
  bool Holds(uint64_t session_id, uint64_t id, uint64_t bytes) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct File;
  struct PerSession {
    v1::SessionSpillStats stats;
  };
  explicit SpillTier(const SpillOptions& options, UniqueFd dir_fd, bool tmpfile);
  // Creates an unlinked file of `bytes` (fallocated); RESOURCE_EXHAUSTED when
  // the file system is full.
  absl::StatusOr<UniqueFd> CreateFile(uint64_t bytes);
  void Post(std::function<void(class SpillFileIo&)> job) ABSL_LOCKS_EXCLUDED(mu_);
  void RunWorker();
  // Tells the journal (if any) that the files `ids` left the tier; it
  // forgets those it holds (kept when written, or adopted by a restart)
  // and ignores the others.
  void JournalGone(absl::Span<const uint64_t> ids) const;

  const SpillOptions options_;
  const UniqueFd dir_fd_;
  const bool tmpfile_;               // O_TMPFILE works in dir_
  StateJournal* journal_ = nullptr;  // set before use (SetJournal)
  std::string io_mode_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // files, written or being written
  absl::flat_hash_map<uint64_t, std::shared_ptr<File>> files_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PerSession> sessions_ ABSL_GUARDED_BY(mu_);
  // Cumulative and in-flight counts; Stats adds what it derives.
  v1::SpillStats totals_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void(SpillFileIo&)>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> name_counter_{0};
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SPILL_SPILL_TIER_H_
