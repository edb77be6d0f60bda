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
};

// The session named by the call's token metadata, or UNAUTHENTICATED.
absl::StatusOr<std::shared_ptr<Session>> AuthenticateCall(const StashCore& core,
                                                          const grpc::CallbackServerContext& ctx);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_STASH_CORE_H_
