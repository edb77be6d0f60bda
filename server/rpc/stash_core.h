// StashCore: the state every Stash RPC handler works on, and the token check.
#ifndef ACTSTASH_SERVER_RPC_STASH_CORE_H_
#define ACTSTASH_SERVER_RPC_STASH_CORE_H_

#include <grpcpp/server_context.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/objects/catalog.h"
#include "server/pool/device_pool.h"
#include "server/pool/memory_pool.h"
#include "server/pool/segment_leaser.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session_manager.h"

namespace actstash::server {

class AttachChannel;
class NodeCopyBandwidth;
class SpillTier;
class WorkQueue;

// A device pool (--device-pool) and the manager of its leases (whose lease
// tier is 1 + its index in StashCore::device_tiers). Both owned by the Daemon.
struct DeviceTier {
  DevicePool* pool = nullptr;
  LeaseManager* leases = nullptr;
};

// What a StashCore is made of. None is owned: each must outlive the core
// (the Daemon owns them all, and the core).
struct StashParts {
  ObjectAllocator* pool = nullptr;    // the host pool: inline objects
  SegmentLeaser* segments = nullptr;  // the host pool again: its segments
  SessionManager* sessions = nullptr;
  Catalog* catalog = nullptr;
  LeaseManager* leases = nullptr;  // the host pool's (tier 0)
  std::vector<DeviceTier> device_tiers;
  // Where Lease calls renew segments and Puts wait behind renewals. May be
  // null only when `attach` is (tests: no Lease calls).
  WorkQueue* work = nullptr;
  SpillTier* spill = nullptr;       // null without --spill-dir
  AttachChannel* attach = nullptr;  // null: Lease calls are refused (tests)
  std::string attach_socket_name;
  NodeCopyBandwidth* copy_bandwidth = nullptr;  // null: unknown (as --copy-bandwidth off)
};

// The state every Stash handler works on; made whole in its constructor and
// owned by the Daemon, which keeps it alive until the gRPC server has shut
// down. The parts it names are fixed for its life and thread-safe
// themselves; the counters are atomics. Handlers use it from gRPC's
// callback threads, the attach server's disconnect callback and the idle
// reaper from theirs.
struct StashCore {
  explicit StashCore(StashParts parts)
      : pool(*parts.pool),
        segments(*parts.segments),
        sessions(*parts.sessions),
        catalog(*parts.catalog),
        leases(*parts.leases),
        device_tiers(std::move(parts.device_tiers)),
        work(parts.work),
        spill(parts.spill),
        attach(parts.attach),
        attach_socket_name(std::move(parts.attach_socket_name)),
        copy_bandwidth(parts.copy_bandwidth) {}
  StashCore(const StashCore&) = delete;
  StashCore& operator=(const StashCore&) = delete;

  ObjectAllocator& pool;
  SegmentLeaser& segments;
  SessionManager& sessions;
  Catalog& catalog;
  LeaseManager& leases;
  const std::vector<DeviceTier> device_tiers;
  WorkQueue* const work;
  SpillTier* const spill;
  AttachChannel* const attach;
  const std::string attach_socket_name;
  NodeCopyBandwidth* const copy_bandwidth;
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_stored{0};   // cumulative, all sessions
  std::atomic<uint64_t> bytes_fetched{0};  // cumulative, all sessions
  // Set when shutdown begins: new calls are refused with UNAVAILABLE.
  std::atomic<bool> draining{false};
  // Streaming calls (Put, Get) between their start and OnDone; shutdown
  // waits for this to reach zero (or its grace period to end).
  std::atomic<int64_t> streams_in_flight{0};
  // Every call between its start and its end (CountCallsInFlight): a
  // take-over stops serving once they are done.
  std::atomic<int64_t> calls_in_flight{0};
  std::atomic<uint64_t> sessions_reclaimed{0};
  // Pool pressure (with a spill tier): a host Lease failed for want of pool
  // memory; until `pressure_until_ms` (steady clock), sessions above their
  // fair share of the pool may not grow and are asked to give memory back.
  std::atomic<int64_t> pressure_until_ms{0};
  std::atomic<uint64_t> pressure_session{0};
};

// How far `session_id` is above its fair share of the host pool while
// another session waits for pool memory (0: not above, or no pressure).
uint64_t BytesAboveFairShare(const StashCore& core, uint64_t session_id, uint64_t leased_bytes);
// Records that `session_id` waits for pool memory.
void NotePoolPressure(StashCore& core, uint64_t session_id);
// What `session` is asked to give back (ReportUsageReply.reclaim_bytes) while
// another session waits for pool memory, and counted on it: its bytes above
// its fair share; or, when it has not copied for kReclaimIdleMs and no session
// is above its share (the waiting one included: it spills its own first),
// all it leases. Nothing without a spill tier, or for the waiting session.
uint64_t ReclaimAsk(const StashCore& core, Session& session);
inline constexpr int64_t kReclaimIdleMs = 2000;

struct SessionTotals {
  RemovedTotals objects;
  RemovedTotals leases;
  RemovedTotals spilled;  // spill files deleted
};

// The device tier of the daemon's GPU `device`, or its only one when
// `device` is unset. FAILED_PRECONDITION without device pools (or none on
// that GPU); INVALID_ARGUMENT when unset and there are several.
absl::StatusOr<const DeviceTier*> FindDeviceTier(const StashCore& core,
                                                 std::optional<uint32_t> device);

// LeaseManager::Return over every tier (a lease id names its tier), all or
// nothing: NOT_FOUND / INVALID_ARGUMENT as Return. Any thread.
absl::StatusOr<RemovedTotals> ReturnLeases(StashCore& core, uint64_t session_id,
                                           absl::Span<const uint64_t> ids);

// Closes a session and frees everything it holds (objects, leases). Returns
// nullopt when it was not open. Any thread.
std::optional<SessionTotals> CloseSessionAndFree(StashCore& core, uint64_t session_id);

// UNAVAILABLE once the daemon is shutting down.
absl::Status CheckNotDraining(const StashCore& core);

// The session named by the call's token metadata, or UNAUTHENTICATED (or
// UNAVAILABLE while draining).
absl::StatusOr<std::shared_ptr<Session>> AuthenticateCall(const StashCore& core,
                                                          const grpc::CallbackServerContext& ctx);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_STASH_CORE_H_
