#include "server/stash_service.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/protocol.h"
#include "server/spill_tier.h"
#include "server/stash_reactors.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

namespace {

void FillSessionStats(const StashCore& core, const SessionSnapshot& s, uint64_t objects,
                      v1::SessionStats* out) {
  out->set_session_id(s.id);
  out->set_client_name(s.name);
  out->set_client_pid(s.pid);
  out->set_quota_bytes(s.quota_bytes);
  out->set_used_bytes(s.used_bytes);
  out->set_objects(objects);
  out->set_bytes_stored(s.bytes_stored);
  out->set_bytes_fetched(s.bytes_fetched);
  out->set_puts(s.puts);
  out->set_gets(s.gets);
  out->set_opened_unix_ms(s.opened_unix_ms);
  out->set_attached(s.attached);
  out->set_peer_uid(s.peer.uid);
  out->set_peer_gid(s.peer.gid);
  out->set_peer_pid(s.peer.pid);
  out->set_leases(s.leases);
  out->set_leased_bytes(s.leased_bytes);
  out->set_local_objects(s.local.objects);
  out->set_local_bytes(s.local.bytes);
  out->set_local_bytes_stored(s.local.bytes_stored);
  out->set_local_bytes_fetched(s.local.bytes_fetched);
  out->set_spill_wait_ns(s.local.spill_wait_ns);
  out->set_restore_wait_ns(s.local.restore_wait_ns);
  if (core.spill != nullptr) {
    const SessionSpillStats spill = core.spill->SessionStats(s.id);
    out->set_spill_on_disk_bytes(spill.on_disk_bytes);
    out->set_spilled_bytes(spill.spilled_bytes);
    out->set_restored_bytes(spill.restored_bytes);
    out->set_spills(spill.spills);
    out->set_restores(spill.restores);
  }
}

}  // namespace

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
  const PoolStats pool = SessionPoolStats(*core_);
  v1::PoolStats* out = reply->mutable_pool();
  out->set_total_bytes(pool.total_bytes);
  out->set_used_bytes(pool.used_bytes);
  out->set_renewing_bytes(pool.renewing_bytes);
  out->set_free_bytes(pool.free_bytes);
  out->set_largest_free_bytes(pool.largest_free_bytes);
  out->set_segment_bytes(pool.segment_bytes);
  out->set_segments(pool.segments);
  out->set_locked_bytes(pool.locked_bytes);
  out->set_cuda_pinned_bytes(pool.cuda_pinned_bytes);
  out->set_leased_bytes(core_->leases.leased_bytes());
  out->set_leases(core_->leases.size());
  reply->set_sessions(core_->sessions.size());
  reply->set_objects(core_->catalog.size());
  reply->set_bytes_stored(core_->bytes_stored.load(std::memory_order_relaxed));
  reply->set_bytes_fetched(core_->bytes_fetched.load(std::memory_order_relaxed));
  const Session& self = **session;
  FillSessionStats(*core_, self.Snapshot(), core_->catalog.SessionObjectCount(self.id()),
                   reply->mutable_self());
  if (request->per_session()) {
    for (const std::shared_ptr<Session>& s : core_->sessions.List()) {
      FillSessionStats(*core_, s->Snapshot(), core_->catalog.SessionObjectCount(s->id()),
                       reply->add_sessions_detail());
    }
  }
  reply->set_daemon_version(kVersion);
  reply->set_uptime_seconds(std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::steady_clock::now() - core_->started)
                                .count());
  reply->set_daemon_pid(static_cast<uint32_t>(getpid()));
  reply->set_leases_granted(core_->leases.granted_total());
  reply->set_sessions_reclaimed(core_->sessions_reclaimed.load(std::memory_order_relaxed));
  for (const DeviceTier& tier : core_->device_tiers) {
    const PoolStats stats = DeviceTierStats(tier);
    v1::DevicePoolStats* device = reply->add_device_pools();
    device->set_device(static_cast<uint32_t>(tier.pool->device()));
    device->set_total_bytes(stats.total_bytes);
    device->set_used_bytes(stats.used_bytes);
    device->set_free_bytes(stats.free_bytes);
    device->set_scrubbing_bytes(stats.renewing_bytes);
    device->set_segment_bytes(stats.segment_bytes);
    device->set_segments(stats.segments);
    device->set_leases(tier.leases->size());
  }
  if (core_->spill != nullptr) {
    const SpillTierStats stats = core_->spill->Stats();
    v1::SpillStats* spill = reply->mutable_spill();
    spill->set_dir(core_->spill->dir());
    spill->set_capacity_bytes(stats.capacity_bytes);
    spill->set_on_disk_bytes(stats.on_disk_bytes);
    spill->set_files(stats.files);
    spill->set_writing_bytes(stats.writing_bytes);
    spill->set_reading_bytes(stats.reading_bytes);
    spill->set_bytes_written(stats.bytes_written);
    spill->set_bytes_read(stats.bytes_read);
    spill->set_spills(stats.spills);
    spill->set_restores(stats.restores);
    spill->set_write_seconds(static_cast<double>(stats.write_ns) * 1e-9);
    spill->set_read_seconds(static_cast<double>(stats.read_ns) * 1e-9);
    spill->set_failures(stats.failures);
    spill->set_checksum_failures(stats.checksum_failures);
    spill->set_io_mode(stats.io_mode);
  }
  return FinishUnary(ctx, absl::OkStatus());
}

}  // namespace actstash::server
