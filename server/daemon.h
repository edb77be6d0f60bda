// Daemon: the running actstashd: pool, sessions, catalog, gRPC server.
#ifndef ACTSTASH_SERVER_DAEMON_H_
#define ACTSTASH_SERVER_DAEMON_H_

#include <grpcpp/server.h>
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/pinned_registrar.h"
#include "server/attach_server.h"
#include "server/catalog.h"
#include "server/config.h"
#include "server/device_memory.h"
#include "server/device_pool.h"
#include "server/lease_manager.h"
#include "server/memory_pool.h"
#include "server/metrics.h"
#include "server/session_manager.h"
#include "server/spill_tier.h"
#include "server/stash_core.h"
#include "server/stash_service.h"
#include "server/work_queue.h"

namespace actstash::server {

// Start() and Shutdown() are called from one thread (main); the gRPC server
// serves from its own threads in between.
class Daemon {
 public:
  // Creates the pool, claims the socket path (refusing when another daemon
  // answers there; removing a stale socket file otherwise) and starts
  // serving. FAILED_PRECONDITION / RESOURCE_EXHAUSTED / INTERNAL with the
  // reason otherwise. The device pools (config.device_pools) use
  // `device_memory` when given (tests: a fake), else the CUDA runtime.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory = nullptr);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Stops accepting calls, lets in-flight calls finish for up to `grace`,
  // cancels the rest, and removes the socket file. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  // Memory made before the Daemon object (and owned by it afterwards).
  struct Memory {
    std::unique_ptr<PinnedRegistrar> registrar;  // null: segments not CUDA-registered
    std::unique_ptr<MemoryPool> pool;
    std::unique_ptr<DeviceMemory> device_memory;  // null without device pools
    std::vector<std::unique_ptr<DevicePool>> device_pools;
  };
  static absl::StatusOr<Memory> CreateMemory(const DaemonConfig& config,
                                             std::unique_ptr<DeviceMemory> device_memory);
  Daemon(const DaemonConfig& config, Memory memory);
  // Closes sessions without an attach connection that idled past the TTL.
  void ReapIdleSessions();

  const DaemonConfig config_;
  // Declaration order is destruction order in reverse: the server goes
  // first, then the objects (catalog) and leases, then the pools they point
  // into, then what the pools use (registrar, device memory).
  std::unique_ptr<PinnedRegistrar> registrar_;
  std::unique_ptr<MemoryPool> pool_;
  std::unique_ptr<DeviceMemory> device_memory_;
  std::vector<std::unique_ptr<DevicePool>> device_pools_;
  SessionManager sessions_;
  Catalog catalog_;
  LeaseManager leases_;
  std::vector<std::unique_ptr<LeaseManager>> device_leases_;  // one per device pool
  StashCore core_;
  StashService service_;
  std::unique_ptr<WorkQueue> work_;
  // Destroyed before work_ and the lease managers: its last operations
  // release the leases they hold.
  std::unique_ptr<SpillTier> spill_;  // null without --spill-dir
  std::unique_ptr<AttachServer> attach_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<grpc::Server> server_;
  ino_t socket_inode_ = 0;
  bool stopped_ = false;
  absl::Mutex reaper_mu_;
  bool reaper_stop_ ABSL_GUARDED_BY(reaper_mu_) = false;
  std::thread reaper_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_DAEMON_H_
