// StashCore: the state every Stash RPC handler works on, and the token check.
#ifndef ACTSTASH_SERVER_STASH_CORE_H_
#define ACTSTASH_SERVER_STASH_CORE_H_

#include <grpcpp/server_context.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/catalog.h"
#include "server/memory_pool.h"
#include "server/session_manager.h"

namespace actstash::server {

// Owned by the Daemon, which keeps it alive until the gRPC server has shut
// down. The members are thread-safe themselves; handlers use them from
// gRPC's callback threads.
struct StashCore {
  StashCore(MemoryPool* pool, SessionManager* sessions, Catalog* catalog)
      : pool(*pool), sessions(*sessions), catalog(*catalog) {}

  MemoryPool& pool;
  SessionManager& sessions;
  Catalog& catalog;
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_stored{0};   // cumulative, all sessions
  std::atomic<uint64_t> bytes_fetched{0};  // cumulative, all sessions
  // Set when shutdown begins: new calls are refused with UNAVAILABLE.
  std::atomic<bool> draining{false};
  // Streaming calls (Put, Get) between their start and OnDone; shutdown
  // waits for this to reach zero (or its grace period to end).
  std::atomic<int64_t> streams_in_flight{0};
};

// UNAVAILABLE once the daemon is shutting down.
absl::Status CheckNotDraining(const StashCore& core);

// The session named by the call's token metadata, or UNAUTHENTICATED (or
// UNAVAILABLE while draining).
absl::StatusOr<std::shared_ptr<Session>> AuthenticateCall(const StashCore& core,
                                                          const grpc::CallbackServerContext& ctx);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_STASH_CORE_H_
