#include "server/stash_core.h"

#include <algorithm>

#include "common/protocol.h"
#include "server/attach_server.h"

namespace actstash::server {

absl::Status CheckNotDraining(const StashCore& core) {
  if (core.draining.load(std::memory_order_acquire)) {
    return absl::UnavailableError("actstashd is shutting down");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> AuthenticateCall(const StashCore& core,
                                                          const grpc::CallbackServerContext& ctx) {
  if (absl::Status s = CheckNotDraining(core); !s.ok()) return s;
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find(kTokenMetadataKey);
  if (it == metadata.end()) return core.sessions.Authenticate("");
  absl::StatusOr<std::shared_ptr<Session>> session =
      core.sessions.Authenticate(absl::string_view(it->second.data(), it->second.size()));
  if (session.ok()) (*session)->Touch();
  return session;
}

PoolStats SessionPoolStats(const StashCore& core) {
  PoolStats stats = core.pool.Stats();
  stats.renewing_bytes = std::min(core.leases.renewing_bytes(), stats.used_bytes);
  stats.used_bytes -= stats.renewing_bytes;
  return stats;
}

std::optional<SessionTotals> CloseSessionAndFree(StashCore& core, uint64_t session_id) {
  if (core.sessions.Close(session_id) == nullptr) return std::nullopt;
  // Its attach connection, if any, must not carry anything any more.
  if (core.attach != nullptr) core.attach->Disconnect(session_id);
  SessionTotals totals;
  totals.objects = core.catalog.RemoveSession(session_id);
  totals.leases = core.leases.ReleaseSession(session_id);
  return totals;
}

}  // namespace actstash::server
