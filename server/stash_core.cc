#include "server/stash_core.h"

#include "common/protocol.h"

namespace actstash::server {

absl::StatusOr<std::shared_ptr<Session>> AuthenticateCall(
    const StashCore& core, const grpc::CallbackServerContext& ctx) {
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find(kTokenMetadataKey);
  if (it == metadata.end()) return core.sessions.Authenticate("");
  return core.sessions.Authenticate(absl::string_view(it->second.data(), it->second.size()));
}

}  // namespace actstash::server
