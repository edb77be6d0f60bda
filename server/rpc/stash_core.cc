#include "server/rpc/stash_core.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "common/tiered_id.h"
#include "server/rpc/attach_channel.h"
#include "server/spill/spill_tier.h"

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

absl::StatusOr<const DeviceTier*> FindDeviceTier(const StashCore& core,
                                                 std::optional<uint32_t> device) {
  if (core.device_tiers.empty()) {
    return absl::FailedPreconditionError(
        "this actstashd has no device pool (start it with --device-pool GPU:SIZE)");
  }
  if (!device.has_value()) {
    if (core.device_tiers.size() == 1) return &core.device_tiers[0];
    return absl::InvalidArgumentError(absl::StrCat("this actstashd has ", core.device_tiers.size(),
                                                   " device pools: name the GPU (device)"));
  }
  for (const DeviceTier& tier : core.device_tiers) {
    if (static_cast<uint32_t>(tier.pool->device()) == *device) return &tier;
  }
  std::string have;
  for (const DeviceTier& tier : core.device_tiers) {
    absl::StrAppend(&have, have.empty() ? "" : ", ", tier.pool->device());
  }
  return absl::FailedPreconditionError(
      absl::StrCat("no device pool on GPU ", *device, "; device pools are on GPU ", have));
}

absl::StatusOr<RemovedTotals> ReturnLeases(StashCore& core, uint64_t session_id,
                                           absl::Span<const uint64_t> ids) {
  std::vector<LeaseManager*> managers = {&core.leases};
  for (const DeviceTier& tier : core.device_tiers) managers.push_back(tier.leases);
  std::vector<std::vector<uint64_t>> parts(managers.size());
  for (uint64_t id : ids) {
    const uint32_t tier = tiered_id::TierOf(id);
    if (tiered_id::IsInline(id) || tier >= parts.size()) {
      return absl::NotFoundError(
          absl::StrCat("no lease ", id, " in this session; nothing returned"));
    }
    parts[tier].push_back(id);
  }
  const size_t used = static_cast<size_t>(
      std::count_if(parts.begin(), parts.end(), [](const auto& p) { return !p.empty(); }));
  if (used <= 1) {
    for (size_t i = 0; i < parts.size(); ++i) {
      if (!parts[i].empty()) return managers[i]->Return(session_id, parts[i]);
    }
    return RemovedTotals{};
  }
  // Several tiers: all are checked before any is taken. (Only a concurrent
  // Return of the same leases by the same session can slip in between; it
  // takes them back just the same.)
  for (size_t i = 0; i < parts.size(); ++i) {
    if (absl::Status s = managers[i]->CheckReturn(session_id, parts[i]); !s.ok()) return s;
  }
  RemovedTotals totals;
  for (size_t i = 0; i < parts.size(); ++i) {
    const RemovedTotals taken = managers[i]->ReturnAny(session_id, parts[i]);
    totals.objects += taken.objects;
    totals.bytes += taken.bytes;
  }
  return totals;
}

constexpr int64_t kPressureMs = 1000;

void NotePoolPressure(StashCore& core, uint64_t session_id) {
  core.pressure_session.store(session_id, std::memory_order_relaxed);
  core.pressure_until_ms.store(SteadyNowMs() + kPressureMs, std::memory_order_release);
}

uint64_t BytesAboveFairShare(const StashCore& core, uint64_t session_id, uint64_t leased_bytes) {
  const uint64_t waiting = core.pressure_session.load();
  if (core.spill == nullptr || SteadyNowMs() > core.pressure_until_ms.load() ||
      waiting == session_id) {
    return 0;
  }
  // The waiting session counts even when it holds nothing yet.
  const uint64_t holders = std::max<uint64_t>(1, core.leases.sessions_holding(waiting));
  const uint64_t share = core.pool.Stats().total_bytes() / holders;
  return leased_bytes > share ? leased_bytes - share : 0;
}

uint64_t ReclaimAsk(const StashCore& core, Session& session) {
  const uint64_t waiting = core.pressure_session.load();
  const int64_t now = SteadyNowMs();
  if (core.spill == nullptr || now > core.pressure_until_ms.load() || waiting == session.id()) {
    return 0;
  }
  const uint64_t leased = session.leased_bytes();
  if (leased == 0) return 0;
  const uint64_t holders = std::max<uint64_t>(1, core.leases.sessions_holding(waiting));
  const uint64_t share = core.pool.Stats().total_bytes() / holders;
  uint64_t ask = leased > share ? leased - share : 0;
  if (ask == 0 && !session.CopiedWithin(now, kReclaimIdleMs)) {
    // Idle and within its share: asked only when nobody is above theirs (the
    // waiting one included, which spills its own then).
    bool someone_above = false;
    for (const std::shared_ptr<Session>& other : core.sessions.List()) {
      someone_above |= other->id() != session.id() && other->leased_bytes() > share;
    }
    if (!someone_above) ask = leased;
  }
  if (ask > 0) session.CountReclaimAsk(ask);
  return ask;
}

std::optional<SessionTotals> CloseSessionAndFree(StashCore& core, uint64_t session_id) {
  if (core.sessions.Close(session_id) == nullptr) return std::nullopt;
  // Its attach connection, if any, must not carry anything any more.
  if (core.attach != nullptr) core.attach->Disconnect(session_id);
  SessionTotals totals;
  totals.objects = core.catalog.RemoveSession(session_id);
  totals.leases = core.leases.ReleaseSession(session_id);
  for (const DeviceTier& tier : core.device_tiers) {
    const RemovedTotals device = tier.leases->ReleaseSession(session_id);
    totals.leases.objects += device.objects;
    totals.leases.bytes += device.bytes;
  }
  if (core.spill != nullptr) totals.spilled = core.spill->ReleaseSession(session_id);
  return totals;
}

}  // namespace actstash::server
