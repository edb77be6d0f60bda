// Lease, Return, ConfirmLeases and ReportUsage: the control side of the zero-copy data
// plane. A Lease is granted here, renewed (fresh memfds) on the work queue
// when its segments were used before, and its fds are sent over the attach
// channel before the call completes. A device-tier Lease is granted from a
// device pool's LeaseManager and answered with the pool's IPC handle and
// offsets (its segments were zeroed when they came back).
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/base/work_queue.h"
#include "server/rpc/attach_channel.h"
#include "server/rpc/stash_service.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

constexpr uint32_t kMaxLeasesPerCall = 256;
constexpr int kMaxNumaNodes = 1024;  // the kernel's MAX_NUMNODES at most

std::vector<uint64_t> Ids(const std::vector<std::shared_ptr<Lease>>& leases) {
  std::vector<uint64_t> ids;
  for (const auto& lease : leases) ids.push_back(lease->id());
  return ids;
}

// One Lease call between its handler and its Finish; kept alive by the
// callbacks that still have to run.
struct LeaseCall : std::enable_shared_from_this<LeaseCall> {
  LeaseCall(StashCore* core, grpc::ServerUnaryReactor* reactor, grpc::CallbackServerContext* ctx,
            v1::LeaseReply* reply, std::shared_ptr<Session> session, uint32_t count,
            uint32_t per_lease, const DeviceTier* device, int numa_node)
      : core(core),
        reactor(reactor),
        ctx(ctx),
        reply(reply),
        session(std::move(session)),
        count(count),
        per_lease(per_lease),
        device(device),
        numa_node(numa_node),
        leases(device != nullptr ? *device->leases : core->leases) {}

  StashCore* core;
  grpc::ServerUnaryReactor* reactor;
  grpc::CallbackServerContext* ctx;
  v1::LeaseReply* reply;
  std::shared_ptr<Session> session;
  uint32_t count;
  uint32_t per_lease;
  const DeviceTier* device;  // null: the host pool
  int numa_node;             // -1: no preference
  LeaseManager& leases;

  absl::StatusOr<std::vector<std::shared_ptr<server::Lease>>> Grant() {
    return leases.Grant(session, count, per_lease, numa_node);
  }

  // On failure, or when the caller gave up (deadline, cancel), the grants go
  // back: the client will never map them (it skips their fds).
  void Finish(const absl::Status& status, const std::vector<uint64_t>& ids) {
    if (!status.ok() || ctx->IsCancelled()) leases.ReturnAny(session->id(), ids);
    reactor->Finish(ToGrpcStatus(status));
    core->streams_in_flight.fetch_sub(1, std::memory_order_acq_rel);
  }

  // Device grants: the pool's handle and the segments' offsets; nothing to
  // renew (zeroed on return) and nothing to send.
  void FinishDevice(const std::vector<std::shared_ptr<server::Lease>>& granted) {
    const DevicePool& pool = *device->pool;
    for (const auto& lease : granted) {
      v1::LeaseGrant* grant = reply->add_leases();
      grant->set_lease_id(lease->id());
      grant->set_bytes(lease->bytes());
      grant->set_segments(lease->segments());
      grant->set_tier(v1::LEASE_TIER_DEVICE);
      grant->set_device(static_cast<uint32_t>(pool.device()));
      grant->set_ipc_handle(pool.ipc_handle());
      grant->set_offset(uint64_t{lease->first_segment()} * pool.segment_bytes());
      grant->set_region_bytes(pool.region_bytes());
    }
    Finish(absl::OkStatus(), Ids(granted));
  }

  // Renews what needs it (on the work queue, never on this thread), then has
  // the attach server queue the fds.
  void Continue(absl::StatusOr<std::vector<std::shared_ptr<server::Lease>>> granted) {
    if (!granted.ok()) return Finish(granted.status(), {});
    if (device != nullptr) return FinishDevice(*granted);
    const std::vector<uint64_t> ids = Ids(*granted);
    bool renew = false;
    for (const auto& lease : *granted) {
      v1::LeaseGrant* grant = reply->add_leases();
      grant->set_lease_id(lease->id());
      grant->set_bytes(lease->bytes());
      grant->set_segments(lease->segments());
      grant->set_numa_node(lease->numa_node());
      renew = renew || lease->needs_scrub();
    }
    std::shared_ptr<LeaseCall> self = shared_from_this();
    auto send = [self, ids](std::vector<std::shared_ptr<server::Lease>> leases) {
      self->core->attach->SendLeases(
          self->session->id(), std::move(leases),
          [self, ids](const absl::Status& sent) { self->Finish(sent, ids); });
    };
    if (!renew) return send(*std::move(granted));
    core->work->Post([self, ids, send, leases = *std::move(granted)]() mutable {
      for (const auto& lease : leases) {
        if (!lease->needs_scrub()) continue;
        if (absl::Status renewed = self->core->leases.Scrub(*lease); !renewed.ok()) {
          return self->Finish(renewed, ids);
        }
      }
      send(std::move(leases));
    });
  }
};

}  // namespace

grpc::ServerUnaryReactor* StashService::Lease(grpc::CallbackServerContext* ctx,
                                              const v1::LeaseRequest* request,
                                              v1::LeaseReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  const uint32_t per_lease = std::max<uint32_t>(1, request->segments_per_lease());
  uint64_t segments = core_->segments.segment_count();
  const DeviceTier* device = nullptr;
  std::string pool_name = "the pool";
  if (request->tier() == v1::LEASE_TIER_DEVICE) {
    absl::StatusOr<const DeviceTier*> tier = FindDeviceTier(
        *core_, request->has_device() ? std::optional<uint32_t>(request->device()) : std::nullopt);
    if (!tier.ok()) return FinishUnary(ctx, tier.status());
    device = *tier;
    segments = device->pool->segment_count();
    pool_name = absl::StrCat("the device pool on GPU ", device->pool->device());
  } else if (request->tier() != v1::LEASE_TIER_HOST) {
    return FinishUnary(
        ctx, absl::InvalidArgumentError(absl::StrCat("unknown lease tier ", request->tier())));
  }
  int numa_node = -1;
  if (request->has_numa_node()) {
    if (request->numa_node() < 0 || request->numa_node() >= kMaxNumaNodes) {
      return FinishUnary(
          ctx, absl::InvalidArgumentError(absl::StrCat("NUMA node ", request->numa_node(),
                                                       " is not in [0, ", kMaxNumaNodes, ")")));
    }
    if (device == nullptr) numa_node = request->numa_node();
  }
  if (request->count() == 0 || request->count() > kMaxLeasesPerCall) {
    return FinishUnary(
        ctx, absl::InvalidArgumentError(absl::StrCat("Lease count ", request->count(),
                                                     " is not in [1, ", kMaxLeasesPerCall, "]")));
  }
  if (per_lease > segments) {
    return FinishUnary(
        ctx, absl::ResourceExhaustedError(absl::StrCat(
                 "requested a lease of ", per_lease, " segments; ", pool_name, " has ", segments)));
  }
  if (core_->attach == nullptr || !(*session)->attached()) {
    return FinishUnary(ctx, absl::FailedPreconditionError(
                                "Lease needs the session's attach connection; attach to the "
                                "daemon's attach socket first"));
  }
  if (device == nullptr) {
    // Fair share under pressure: while another session waits for pool memory,
    // one above its share does not grow (it spills its own instead).
    const uint64_t want = uint64_t{request->count()} * per_lease * core_->segments.segment_bytes();
    const uint64_t leased = (*session)->leased_bytes();
    if (BytesAboveFairShare(*core_, (*session)->id(), leased + want) > 0) {
      return FinishUnary(ctx, absl::ResourceExhaustedError(absl::StrCat(
                                  "host pool exhausted: another session waits for pool memory "
                                  "and this one holds ",
                                  leased, " bytes, its fair share or more")));
    }
  }
  // Counted like a stream: shutdown waits for it, and the work queue and the
  // attach server outlive every such call.
  core_->streams_in_flight.fetch_add(1, std::memory_order_acq_rel);
  auto call =
      std::make_shared<LeaseCall>(core_, ctx->DefaultReactor(), ctx, reply, *std::move(session),
                                  request->count(), per_lease, device, numa_node);
  absl::StatusOr<std::vector<std::shared_ptr<server::Lease>>> granted = call->Grant();
  if (!granted.ok() && device == nullptr &&
      granted.status().code() == absl::StatusCode::kResourceExhausted &&
      absl::StrContains(granted.status().message(), "pool exhausted")) {
    NotePoolPressure(*core_, call->session->id());
  }
  if (!granted.ok() && granted.status().code() == absl::StatusCode::kResourceExhausted &&
      call->leases.renewals_pending() > 0) {
    // Memory being renewed counts as used: try again behind those renewals
    // (the work queue runs in order) rather than fail.
    core_->work->Post([call] { call->Continue(call->Grant()); });
  } else {
    call->Continue(std::move(granted));
  }
  return call->reactor;
}

grpc::ServerUnaryReactor* StashService::Return(grpc::CallbackServerContext* ctx,
                                               const v1::ReturnRequest* request,
                                               v1::ReturnReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  if (request->lease_ids_size() > static_cast<int>(kMaxLeasesPerCall) * 64) {
    return FinishUnary(ctx, absl::InvalidArgumentError("too many lease ids in one Return"));
  }
  absl::StatusOr<RemovedTotals> returned =
      ReturnLeases(*core_, (*session)->id(),
                   absl::MakeConstSpan(request->lease_ids().data(), request->lease_ids_size()));
  if (!returned.ok()) return FinishUnary(ctx, returned.status());
  reply->set_returned(returned->objects);
  reply->set_bytes(returned->bytes);
  return FinishUnary(ctx, absl::OkStatus());
}

// Host leases only: device pools are not carried over a restart.
grpc::ServerUnaryReactor* StashService::ConfirmLeases(grpc::CallbackServerContext* ctx,
                                                      const v1::ConfirmLeasesRequest* request,
                                                      v1::ConfirmLeasesReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  const uint64_t segments = core_->segments.segment_count();
  if (static_cast<uint64_t>(request->held_lease_ids_size()) > segments) {
    return FinishUnary(ctx, absl::InvalidArgumentError(absl::StrCat(
                                request->held_lease_ids_size(), " held leases named; the pool has ",
                                segments, " segments")));
  }
  const RemovedTotals released = core_->leases.ReleaseUnclaimed(
      (*session)->id(),
      absl::MakeConstSpan(request->held_lease_ids().data(), request->held_lease_ids_size()));
  if (released.objects > 0) {
    spdlog::warn(
        "session {}: took back {} carried lease(s), {} bytes, its client does not hold (granted "
        "before the restart, answer lost)",
        (*session)->id(), released.objects, released.bytes);
  }
  reply->set_released(released.objects);
  reply->set_bytes(released.bytes);
  return FinishUnary(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* StashService::ReportUsage(grpc::CallbackServerContext* ctx,
                                                    const v1::ClientUsage* request,
                                                    v1::ReportUsageReply* reply) {
  absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(*core_, *ctx);
  if (!session.ok()) return FinishUnary(ctx, session.status());
  (*session)->RecordClientUsage(*request);
  reply->set_reclaim_bytes(ReclaimAsk(*core_, **session));
  return FinishUnary(ctx, absl::OkStatus());
}

}  // namespace actstash::server
