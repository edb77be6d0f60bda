#include "server/rpc/stash_service.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/protocol.h"
#include "server/rpc/stash_reactors.h"
#include "server/rpc/stats.h"
#include "server/spill/spill_tier.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* StashService::OpenSession(grpc::CallbackServerContext* ctx,
                                                    const v1::OpenSessionRequest* request,
                                                    v1::OpenSessionReply* reply) {
  if (absl::Status s = CheckNotDraining(*core_); !s.ok()) return FinishUnary(ctx, s);
  absl::StatusOr<std::shared_ptr<Session>> session =
      core_->sessions.Open(request->client_name(), request->quota_bytes(), request->client_pid());
  if (!session.ok()) return FinishUnary(ctx, session.status());
  const Session& s = **session;
  reply->set_session_id(s.id());
  reply->set_token(s.token());
  reply->set_quota_bytes(s.quota_bytes());
  reply->set_max_chunk_bytes(kMaxChunkBytes);
  reply->set_daemon_version(kVersion);
  reply->set_attach_socket_name(core_->attach_socket_name);
  reply->set_segment_bytes(core_->segments.segment_bytes());
  reply->set_spill_enabled(core_->spill != nullptr);
  for (const DeviceTier& tier : core_->device_tiers) {
    v1::DevicePoolInfo* info = reply->add_device_pools();
    info->set_device(static_cast<uint32_t>(tier.pool->device()));
    info->set_total_bytes(tier.pool->region_bytes());
    info->set_segment_bytes(tier.pool->segment_bytes());
  }
  spdlog::info("session {} opened: client '{}' pid {} peer {} quota {} bytes", s.id(), s.name(),
               request->client_pid(), ctx->peer(), s.quota_bytes());
  return FinishUnary(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* StashService::CloseSession(grpc::CallbackServerContext* ctx,
                                                     const v1::CloseSessionRequest* request,
                                                     v1::CloseSessionReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  const uint64_t id = (*session)->id();
  std::optional<SessionTotals> freed = CloseSessionAndFree(*core_, id);
  if (!freed.has_value()) {
    return FinishUnary(ctx, absl::UnauthenticatedError("the session is already closed"));
  }
  reply->set_objects_freed(freed->objects.objects);
  reply->set_bytes_freed(freed->objects.bytes + freed->leases.bytes);
  spdlog::info("session {} closed: freed {} objects ({} bytes) and {} leases ({} bytes)", id,
               freed->objects.objects, freed->objects.bytes, freed->leases.objects,
               freed->leases.bytes);
  return FinishUnary(ctx, absl::OkStatus());
}

grpc::ServerReadReactor<v1::PutChunk>* StashService::Put(grpc::CallbackServerContext* ctx,
                                                         v1::PutReply* reply) {
  return StartPut(core_, ctx, reply);
}

grpc::ServerWriteReactor<v1::GetChunk>* StashService::Get(grpc::CallbackServerContext* ctx,
                                                          const v1::GetRequest* request) {
  return StartGet(core_, ctx, request);
}

grpc::ServerUnaryReactor* StashService::Delete(grpc::CallbackServerContext* ctx,
                                               const v1::DeleteRequest* request,
                                               v1::DeleteReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  if (request->handles_size() > kMaxDeleteHandles) {
    return FinishUnary(ctx, absl::InvalidArgumentError(absl::StrCat(
                                "Delete of ", request->handles_size(), " handles; at most ",
                                kMaxDeleteHandles, " per call")));
  }
  absl::StatusOr<RemovedTotals> removed = core_->catalog.Remove(
      (*session)->id(), absl::MakeConstSpan(request->handles().data(), request->handles_size()));
  if (!removed.ok()) return FinishUnary(ctx, removed.status());
  reply->set_deleted(removed->objects);
  reply->set_bytes_freed(removed->bytes);
  return FinishUnary(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* StashService::Stats(grpc::CallbackServerContext* ctx,
                                              const v1::StatsRequest* request,
                                              v1::StatsReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  FillStats(*core_, session->get(), request->per_session(), reply);
  return FinishUnary(ctx, absl::OkStatus());
}

}  // namespace actstash::server
