#include "server/stash_core.h"

#include "common/protocol.h"

namespace actstash::server {

absl::Status CheckNotDraining(const StashCore& core) {
  if (core.draining.load(std::memory_order_acquire)) {
    return absl::UnavailableError("actstashd is shutting down");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> AuthenticateCall(
    const StashCore& core, const grpc::CallbackServerContext& ctx) {
  if (absl::Status s = CheckNotDraining(core); !s.ok()) return s;
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find(kTokenMetadataKey);
  if (it == metadata.end()) return core.sessions.Authenticate("");
  return core.sessions.Authenticate(absl::string_view(it->second.data(), it->second.size()));
}

}  // namespace actstash::server
