#include "server/rpc/stats.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "common/protocol.h"
#include "server/sessions/copy_share.h"
#include "server/spill/spill_tier.h"

namespace actstash::server {
namespace {

// A pool's own numbers plus what its lease manager knows: returned lease
// memory being renewed (host) or zeroed (device) is neither used by a
// session nor free yet.
void FillPool(v1::PoolStats own, const LeaseManager& leases, v1::PoolStats* out) {
  *out = std::move(own);
  const uint64_t renewing = std::min(leases.renewing_bytes(), out->used_bytes());
  out->set_renewing_bytes(renewing);
  out->set_used_bytes(out->used_bytes() - renewing);
  out->set_leased_bytes(leases.leased_bytes());
  out->set_leases(leases.size());
}

void FillSession(const StashCore& core, const Session& session, v1::SessionStats* out) {
  session.FillStats(out);
  out->set_copying(session.CopiedWithin(SteadyNowMs(), kCopyWindowMs));
  out->set_objects(core.catalog.SessionObjectCount(session.id()));
  if (core.spill != nullptr) *out->mutable_spill() = core.spill->SessionStats(session.id());
}

}  // namespace

void FillStats(const StashCore& core, const Session* self, bool all_sessions, v1::StatsReply* out) {
  FillPool(core.pool.Stats(), core.leases, out->mutable_pool());
  out->set_sessions(core.sessions.size());
  out->set_objects(core.catalog.size());
  out->set_bytes_stored(core.bytes_stored.load(std::memory_order_relaxed));
  out->set_bytes_fetched(core.bytes_fetched.load(std::memory_order_relaxed));
  if (self != nullptr) FillSession(core, *self, out->mutable_self());
  const std::vector<std::shared_ptr<Session>> sessions = core.sessions.List();
  if (all_sessions) {
    for (const std::shared_ptr<Session>& s : sessions)
      FillSession(core, *s, out->add_all_sessions());
  }
  *out->mutable_copy() = CopyStatsOf(
      core.copy_bandwidth != nullptr ? core.copy_bandwidth->Peek() : NodeCopyBandwidth::Figure{},
      sessions, SteadyNowMs());
  out->set_daemon_version(kVersion);
  out->set_uptime_seconds(std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::steady_clock::now() - core.started)
                              .count());
  out->set_daemon_pid(static_cast<uint32_t>(getpid()));
  out->set_leases_granted(core.leases.granted_total());
  out->set_sessions_reclaimed(core.sessions_reclaimed.load(std::memory_order_relaxed));
  for (const DeviceTier& tier : core.device_tiers) {
    v1::DevicePoolStats* device = out->add_device_pools();
    device->set_device(static_cast<uint32_t>(tier.pool->device()));
    FillPool(tier.pool->Stats(), *tier.leases, device->mutable_pool());
  }
  if (core.spill != nullptr) *out->mutable_spill() = core.spill->Stats();
}

}  // namespace actstash::server
