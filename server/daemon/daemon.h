// Daemon: the running actstashd: pool, sessions, catalog, gRPC server.
#ifndef ACTSTASH_SERVER_DAEMON_DAEMON_H_
#define ACTSTASH_SERVER_DAEMON_DAEMON_H_

#include <grpcpp/server.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/pinned_registrar.h"
#include "server/base/work_queue.h"
#include "server/daemon/config.h"
#include "server/daemon/metrics.h"
#include "server/objects/catalog.h"
#include "server/pool/device_memory.h"
#include "server/pool/device_pool.h"
#include "server/pool/host_pool.h"
#include "server/restart/crash_recovery.h"
#include "server/restart/service_manager.h"
#include "server/restart/take_over.h"
#include "server/rpc/attach_server.h"
#include "server/rpc/stash_core.h"
#include "server/rpc/stash_service.h"
#include "server/sessions/copy_share.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session_manager.h"
#include "server/spill/spill_tier.h"

namespace actstash::server {

// Start() and Shutdown() are called from one thread (main); the gRPC server
// serves from its own threads in between.
class Daemon {
 public:
  // Creates the pools, claims the socket paths (refusing when another
  // daemon answers there; removing a stale socket file otherwise) and
  // starts serving. Under a service manager ($NOTIFY_SOCKET) it keeps its
  // pool and a state table in the manager's fd store and, started again
  // with them after a crash, recovers the sessions and their leases
  // (crash_recovery.h). With config.take_over: takes the pool, the sessions,
  // their leases and attach connections, and the sockets over from the
  // daemon serving there instead (daemon_handover.cc), which then exits;
  // any error leaves that daemon serving. FAILED_PRECONDITION / RESOURCE_EXHAUSTED / INTERNAL
  // with the reason otherwise. The device pools (config.device_pools) use
  // `device_memory` when given (tests: a fake), else the CUDA runtime.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory = nullptr);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Stops accepting calls, lets in-flight calls finish for up to `grace`,
  // cancels the rest, and removes the socket file. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

  // `pid` is a successor this daemon started (server/restart/successor.h):
  // when it takes over, the service manager is told that it is the
  // service's main process now (MAINPID=), and this one exits. Any thread.
  void ExpectSuccessor(pid_t pid) { expected_successor_.store(pid); }

 private:
  // What can fail, made before the Daemon object (and owned by it afterwards).
  struct Parts {
    std::unique_ptr<PinnedRegistrar> registrar;  // null: segments not CUDA-registered
    std::unique_ptr<HostPool> pool;
    std::unique_ptr<DeviceMemory> device_memory;  // null without device pools
    std::vector<std::unique_ptr<DevicePool>> device_pools;
    std::unique_ptr<SpillTier> spill;  // null without --spill-dir
    std::optional<AttachSocket> attach_socket;
    std::unique_ptr<ServiceNotifier> notifier;  // null: no service manager
    std::unique_ptr<DaemonJournal> journal;     // null: no service manager
  };
  // Segments a new pool maps instead of making them (take-over, recovery).
  struct AdoptedSegments {
    std::vector<UniqueFd> fds;          // per segment; invalid: a fresh one
    std::vector<uint32_t> held_inline;  // scrubbed before they are leased
  };
  // The state table's geometry for `config`.
  static TableGeometry GeometryOf(const DaemonConfig& config);
  static absl::Status CreateMemory(const DaemonConfig& config,
                                   std::unique_ptr<DeviceMemory> device_memory, Parts* parts,
                                   AdoptedSegments* adopt = nullptr);
  // The start modes (daemon_start.cc), chosen by Start. Afresh: a new pool
  // and, under a service manager (`notifier`), a new state table.
  static absl::StatusOr<std::unique_ptr<Daemon>> StartFresh(
      const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory,
      std::unique_ptr<ServiceNotifier> notifier);
  // After a crash, from the fds the service manager kept (`passed`, not
  // empty; `notifier` not null). A state that cannot be trusted is logged,
  // and the start is a fresh one that still serves the kept attach listener.
  static absl::StatusOr<std::unique_ptr<Daemon>> StartAfterCrash(
      const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory,
      std::unique_ptr<ServiceNotifier> notifier, std::vector<PassedFd> passed);
  // Beside the daemon serving there, with what it handed over (`taken`).
  static absl::StatusOr<std::unique_ptr<Daemon>> StartTakingOver(
      const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory,
      std::unique_ptr<ServiceNotifier> notifier, TakenOver taken);
  // The steps they share. Under a service manager: the journal into
  // `table` (null: a fresh one), with every segment not in
  // `reused_segments` kept in the store (the table too with `store_table`).
  // false when the store refused (logged; the daemon goes on without a
  // journal, GiveUp first with `give_up_on_failure`); an error when no
  // table could be made.
  static absl::StatusOr<bool> KeepStateForRestart(const DaemonConfig& config,
                                                  std::unique_ptr<StateTable> table,
                                                  std::vector<bool> reused_segments,
                                                  bool store_table,
                                                  const std::vector<std::string>& dropped_names,
                                                  bool give_up_on_failure, Parts* parts);
  // The spill tier of --spill-dir, if configured.
  static absl::Status OpenSpillTier(const DaemonConfig& config, Parts* parts);
  // Where the attach listener comes from: made anew; kept by the service
  // manager (`listener`, when valid; a new one if it is unusable); handed by
  // the predecessor (it must be usable). A listener that is not the kept
  // one goes to the service manager's store when there is a journal.
  enum class AttachFrom { kNew, kServiceManager, kPredecessor };
  static absl::Status OpenAttachSocket(const DaemonConfig& config, UniqueFd listener,
                                       AttachFrom from, Parts* parts);
  // The last step of every mode: serves, and tells the service manager.
  absl::Status FinishStart(UniqueFd handed_listener, bool recovered);
  // Wires the parts together; serves nothing yet (Serve does).
  Daemon(const DaemonConfig& config, Parts parts);
  // Starts the metrics endpoint (if configured) and the gRPC server.
  absl::Status Serve();
  // The gRPC server, the reaper and the take-over listener (`handed`: the
  // predecessor's), once the parts are ready.
  absl::Status StartServing(UniqueFd handed_listener = UniqueFd());
  // Stops the reaper and the gRPC server: streams in flight (every call with
  // `wait_for_calls`) get up to `grace`, then the rest is cancelled. The
  // attach server keeps running unless `stop_attach` (shutdown), when it
  // stops just before gRPC does.
  void StopServing(std::chrono::milliseconds grace, bool wait_for_calls, bool stop_attach);

  // Take-over (daemon_handover.cc). On the serving daemon, from the
  // take-over listener's thread: PrepareHandover stops serving and exports
  // the state (or refuses, serving as before); FinishHandover exits (adopted)
  // or serves again.
  absl::StatusOr<HandoverPackage> PrepareHandover(const v1::TakeOverHello& hello);
  void FinishHandover(bool adopted);
  // Why a take-over cannot happen now, or OK.
  absl::Status CheckHandover(const v1::TakeOverHello& hello) const;
  // On the successor, before anything is made: asks the serving daemon and
  // checks what it handed against `config`.
  static absl::StatusOr<TakenOver> ReceiveTakeOver(const DaemonConfig& config);
  // On the successor: the received sessions, leases and attach connections
  // into the parts, before anything is served.
  absl::Status AdoptState(TakenOver* taken);
  // On a successor under a service manager, before the adoption: a copy of
  // the predecessor's state table (`out`: what it holds), or null when none
  // was handed or it does not fit `config` (logged; a fresh one is kept).
  static std::unique_ptr<StateTable> CopyHandedTable(const DaemonConfig& config,
                                                     const TakenOver& taken,
                                                     std::optional<RecoveredState>* out);
  // Duplicates of the handed spill files' fds, with their records.
  static absl::StatusOr<std::vector<std::pair<v1::SpillFileState, UniqueFd>>> DupSpillFiles(
      const TakenOver& taken);
  // After the adoption, into the journal: what the table does not hold yet
  // (the spill files of a fresh table, with `spills` from DupSpillFiles).
  void RecordTakenOver(const TakenOver& taken, const std::optional<RecoveredState>& handed_table,
                       std::vector<std::pair<v1::SpillFileState, UniqueFd>> spills);
  // One inline object of the handed state: its range of the pool (quota
  // reserved again) or its adopted spill file.
  // `spill_ids`: the spill files objects adopted so far hold.
  absl::Status AdoptObject(const v1::ObjectState& state,
                           const absl::flat_hash_map<uint64_t, std::shared_ptr<Session>>& sessions,
                           absl::flat_hash_set<uint64_t>* spill_ids);

  // Crash recovery (daemon_recovery.cc), on the main thread before serving:
  // the recovered sessions and leases into the parts; the sessions have
  // reattach_grace_seconds to attach again.
  absl::Status AdoptRecovered(Recovery* recovery);
  // The recovered spill files of `sessions` into the spill tier; the others
  // (and all, when the tier refuses them) leave the journal. How many went in.
  size_t AdoptRecoveredSpills(
      Recovery* recovery, const absl::flat_hash_map<uint64_t, std::shared_ptr<Session>>& sessions);
  // The recovered inline objects of `sessions` into the catalog (their
  // ranges of the pool, or their adopted spill files); one that cannot be
  // adopted leaves the journal, its file the tier. How many went in.
  size_t AdoptRecoveredObjects(
      const std::vector<v1::ObjectState>& objects,
      const absl::flat_hash_map<uint64_t, std::shared_ptr<Session>>& sessions);
  // Closes the recovered sessions that did not attach again in time (the
  // reaper's thread).
  void ReapUnreattached();

  // The attach connection of `session_id` ended (attach server's I/O thread).
  void ReclaimDisconnected(uint64_t session_id);
  // Closes sessions without an attach connection that idled past the TTL.
  void ReapIdleSessions();

  const DaemonConfig config_;
  // Each part is given, in its constructor, the parts it uses: all declared
  // before it. Destruction runs in reverse, after Shutdown (which ~Daemon
  // calls first) has stopped every thread that calls into the parts: the
  // reaper, the gRPC server, the attach server, then the work queue.
  std::unique_ptr<PinnedRegistrar> registrar_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<DeviceMemory> device_memory_;
  std::vector<std::unique_ptr<DevicePool>> device_pools_;
  // Both null without a service manager. The journal records into the state
  // table from the managers below it.
  std::unique_ptr<ServiceNotifier> notifier_;
  std::unique_ptr<DaemonJournal> journal_;
  SessionManager sessions_;
  Catalog catalog_;
  // Runs lease renewals and Lease/Put retries. Outlives the lease managers
  // (which post to it) as an object; Shutdown stops it while everything its
  // tasks use is alive.
  WorkQueue work_;
  NodeCopyBandwidth copy_bandwidth_;  // measures on work_ (auto)
  LeaseManager leases_;
  std::vector<std::unique_ptr<LeaseManager>> device_leases_;  // one per device pool
  // Reset first in ~Daemon (its last operations' callbacks use the core),
  // and in any case before the lease managers: those operations release the
  // leases they hold.
  std::unique_ptr<SpillTier> spill_;  // null without --spill-dir
  // Its disconnect callback is ReclaimDisconnected: the Daemon's, so that
  // the attach server and the core do not hold each other. It serves from
  // its constructor, before core_ exists, but the callback runs only for an
  // attached session, and sessions open only once Serve() starts gRPC.
  AttachServer attach_;
  StashCore core_;
  StashService service_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::unique_ptr<grpc::Server>> stopped_servers_;  // see StopServing
  // The take-over channel; its thread calls PrepareHandover/FinishHandover.
  // Reset first in Shutdown.
  std::unique_ptr<HandoverListener> handover_;
  // Between PrepareHandover and FinishHandover (take-over listener's thread).
  std::optional<AttachServer::Handed> frozen_;
  uint32_t handovers_ = 0;     // take-overs this daemon's state went through
  pid_t taking_over_pid_ = 0;  // the successor being handed to (take-over thread)
  std::atomic<pid_t> expected_successor_{0};
  // Start completed: a Shutdown from now on is a clean stop, which retires
  // the state table (a failed start leaves a recovered state for the next).
  bool started_ = false;
  ino_t socket_inode_ = 0;
  bool stopped_ = false;
  // Serializes StopServing/StartServing (main thread, take-over thread).
  absl::Mutex serving_mu_;
  absl::Mutex recovery_mu_;
  // Recovered sessions that have not come back yet, and until when they
  // may. true: it held leases or spill files (it was attached), so it comes
  // back by attaching again; false: by any call (an inline client's).
  absl::flat_hash_map<uint64_t, bool> awaiting_reattach_ ABSL_GUARDED_BY(recovery_mu_);
  int64_t reattach_deadline_ms_ ABSL_GUARDED_BY(recovery_mu_) = 0;
  int64_t recovered_at_ms_ ABSL_GUARDED_BY(recovery_mu_) = 0;  // SteadyNowMs
  absl::Mutex reaper_mu_;
  bool reaper_stop_ ABSL_GUARDED_BY(reaper_mu_) = false;
  std::thread reaper_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_DAEMON_DAEMON_H_
