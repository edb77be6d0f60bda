// Spill, Restore and DropSpilled: the RPC side of the spill tier. The disk
// work runs on the spill tier's workers; the handlers only check the call
// and finish it from the workers' callbacks.
#include <memory>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/tiered_id.h"
#include "server/rpc/stash_service.h"
#include "server/spill/spill_tier.h"

namespace actstash::server {
namespace {

constexpr int kMaxLeasesPerSpill = 256;

absl::Status NoSpillTier() {
  return absl::FailedPreconditionError(
      "this actstashd has no spill tier (start it with --spill-dir DIR)");
}

// A host lease of the session (the spill tier holds host memory only).
absl::StatusOr<std::shared_ptr<Lease>> HostLease(const StashCore& core, uint64_t session_id,
                                                 uint64_t lease_id) {
  if (tiered_id::TierOf(lease_id) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease ", lease_id, " is a device-pool lease; only host leases spill"));
  }
  return core.leases.Find(session_id, lease_id);
}

// One Spill call: its leases are written in parallel; the call finishes
// when the last one is done, all or nothing.
struct SpillCall {
  StashCore* core;
  grpc::ServerUnaryReactor* reactor;
  v1::SpillReply* reply;
  uint64_t session_id;
  std::shared_ptr<Session> session;
  absl::Mutex mu;
  size_t pending ABSL_GUARDED_BY(mu) = 0;
  absl::Status status ABSL_GUARDED_BY(mu);
  std::vector<SpillTier::Written> written ABSL_GUARDED_BY(mu);  // id 0: not (yet) written
  std::vector<uint64_t> lease_ids;
  std::vector<uint64_t> bytes;

  void Done(size_t index, absl::StatusOr<SpillTier::Written> file) {
    bool last = false;
    {
      absl::MutexLock lock(&mu);
      if (file.ok()) {
        written[index] = *file;
      } else if (status.ok()) {
        status = file.status();
      }
      last = --pending == 0;
    }
    if (!last) return;
    absl::Status result;
    std::vector<SpillTier::Written> files;
    {
      absl::MutexLock lock(&mu);
      result = status;
      files = written;
    }
    if (!result.ok()) {
      std::vector<uint64_t> drop;
      for (const SpillTier::Written& file : files) {
        if (file.id != 0) drop.push_back(file.id);
      }
      (void)core->spill->Drop(session_id, drop);  // all or nothing
    } else {
      for (size_t i = 0; i < files.size(); ++i) {
        v1::SpilledLease* spilled = reply->add_spilled();
        spilled->set_lease_id(lease_ids[i]);
        spilled->set_spill_id(files[i].id);
        spilled->set_bytes(bytes[i]);
        spilled->set_checksum(files[i].checksum);
      }
      reply->set_return_bytes(BytesAboveFairShare(*core, session_id, session->leased_bytes()));
    }
    reactor->Finish(ToGrpcStatus(result));
    core->streams_in_flight.fetch_sub(1, std::memory_order_acq_rel);
  }
};

}  // namespace

grpc::ServerUnaryReactor* StashService::Spill(grpc::CallbackServerContext* ctx,
                                              const v1::SpillRequest* request,
                                              v1::SpillReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  if (core_->spill == nullptr) return FinishUnary(ctx, NoSpillTier());
  const int n = request->lease_ids_size();
  if (n == 0 || n > kMaxLeasesPerSpill) {
    return FinishUnary(ctx, absl::InvalidArgumentError(absl::StrCat(
                                "Spill names ", n, " leases; 1 to ", kMaxLeasesPerSpill)));
  }
  std::vector<std::shared_ptr<server::Lease>> leases;
  absl::flat_hash_set<uint64_t> seen;
  for (uint64_t id : request->lease_ids()) {
    if (!seen.insert(id).second) {
      return FinishUnary(ctx, absl::InvalidArgumentError(
                                  absl::StrCat("lease ", id, " named twice; nothing spilled")));
    }
    absl::StatusOr<std::shared_ptr<server::Lease>> lease = HostLease(*core_, (*session)->id(), id);
    if (!lease.ok()) {
      return FinishUnary(ctx,
                         absl::Status(lease.status().code(),
                                      absl::StrCat(lease.status().message(), "; nothing spilled")));
    }
    leases.push_back(*std::move(lease));
  }
  core_->streams_in_flight.fetch_add(1, std::memory_order_acq_rel);
  auto call = std::make_shared<SpillCall>();
  call->core = core_;
  call->reactor = ctx->DefaultReactor();
  call->reply = reply;
  call->session_id = (*session)->id();
  call->session = *session;
  {
    absl::MutexLock lock(&call->mu);
    call->pending = leases.size();
    call->written.assign(leases.size(), SpillTier::Written{});
  }
  for (const auto& lease : leases) {
    call->lease_ids.push_back(lease->id());
    call->bytes.push_back(lease->bytes());
  }
  grpc::ServerUnaryReactor* reactor = call->reactor;
  for (size_t i = 0; i < leases.size(); ++i) {
    core_->spill->Spill(*session, leases[i], [call, i](absl::StatusOr<SpillTier::Written> file) {
      call->Done(i, std::move(file));
    });
  }
  return reactor;
}

grpc::ServerUnaryReactor* StashService::Restore(grpc::CallbackServerContext* ctx,
                                                const v1::RestoreRequest* request,
                                                v1::RestoreReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  if (core_->spill == nullptr) return FinishUnary(ctx, NoSpillTier());
  absl::StatusOr<std::shared_ptr<server::Lease>> lease =
      HostLease(*core_, (*session)->id(), request->lease_id());
  if (!lease.ok()) return FinishUnary(ctx, lease.status());
  core_->streams_in_flight.fetch_add(1, std::memory_order_acq_rel);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const uint64_t bytes = (*lease)->bytes();
  StashCore* core = core_;
  core_->spill->Restore(*session, request->spill_id(), *lease,
                        [core, reactor, reply, bytes](const absl::Status& status) {
                          if (status.ok()) reply->set_bytes(bytes);
                          reactor->Finish(ToGrpcStatus(status));
                          core->streams_in_flight.fetch_sub(1, std::memory_order_acq_rel);
                        });
  return reactor;
}

grpc::ServerUnaryReactor* StashService::DropSpilled(grpc::CallbackServerContext* ctx,
                                                    const v1::DropSpilledRequest* request,
                                                    v1::DropSpilledReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  if (core_->spill == nullptr) return FinishUnary(ctx, NoSpillTier());
  if (request->spill_ids_size() > kMaxLeasesPerSpill * 64) {
    return FinishUnary(ctx, absl::InvalidArgumentError("too many spill ids in one DropSpilled"));
  }
  absl::StatusOr<RemovedTotals> dropped = core_->spill->Drop(
      (*session)->id(),
      absl::MakeConstSpan(request->spill_ids().data(), request->spill_ids_size()));
  if (!dropped.ok()) return FinishUnary(ctx, dropped.status());
  reply->set_dropped(dropped->objects);
  reply->set_bytes(dropped->bytes);
  return FinishUnary(ctx, absl::OkStatus());
}

}  // namespace actstash::server
