// CopyShare: the node's copy bandwidth and the caller's share of it.
#include "common/units.h"
#include "server/rpc/stash_service.h"
#include "server/sessions/copy_share.h"

namespace actstash::server {

grpc::ServerUnaryReactor* StashService::CopyShare(grpc::CallbackServerContext* ctx,
                                                  const v1::CopyShareRequest* request,
                                                  v1::CopyShareReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  for (auto [name, value] :
       {std::pair{"probe_store_bytes_per_second", request->probe_store_bytes_per_second()},
        std::pair{"probe_fetch_bytes_per_second", request->probe_fetch_bytes_per_second()}}) {
    if (absl::Status s = CheckBytesPerSecond(name, value); !s.ok()) return FinishUnary(ctx, s);
  }
  (*session)->SetCopyProbe(request->probe_store_bytes_per_second(),
                           request->probe_fetch_bytes_per_second());
  (*session)->MarkCopying();
  const NodeCopyBandwidth::Figure node =
      core_->copy_bandwidth != nullptr ? core_->copy_bandwidth->Get() : NodeCopyBandwidth::Figure{};
  *reply->mutable_node() = CopyStatsOf(node, core_->sessions.List(), SteadyNowMs());
  reply->set_share_bytes_per_second(ShareOf(reply->node()));
  return FinishUnary(ctx, absl::OkStatus());
}

}  // namespace actstash::server
