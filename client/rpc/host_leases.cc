#include "client/rpc/host_leases.h"

#include <optional>
#include <utility>

namespace actstash::client_internal {

absl::StatusOr<std::vector<GrantedLease>> HostLeases::Lease(uint32_t count,
                                                            uint32_t segments_per_lease) {
  for (int attempt = 0;; ++attempt) {
    ConfirmAfterRestart();
    absl::StatusOr<std::vector<GrantedLease>> granted = LeaseOnce(count, segments_per_lease);
    // The grant was made but its fds were lost with the attach connection
    // of a daemon that crashed: once attached again, lease anew (what was
    // granted went back, or goes with the session).
    if (granted.ok() || attempt >= 2 || !absl::IsUnavailable(granted.status()) ||
        attach_.ConfirmLost(rpc_.rpc_timeout())) {
      return granted;
    }
  }
}

absl::StatusOr<std::vector<GrantedLease>> HostLeases::LeaseOnce(uint32_t count,
                                                                uint32_t segments_per_lease) {
  v1::LeaseRequest request;
  request.set_count(count);
  request.set_segments_per_lease(segments_per_lease);
  const int numa_node = numa_node_.Get();
  if (numa_node >= 0) request.set_numa_node(numa_node);
  v1::LeaseReply reply;
  if (absl::Status s = rpc_.Call(&v1::Stash::Stub::Lease, request, &reply, "Lease"); !s.ok()) {
    return s;
  }
  {
    absl::MutexLock lock(&held_mu_);
    for (const v1::LeaseGrant& grant : reply.leases()) held_.insert(grant.lease_id());
  }
  std::vector<GrantedLease> granted;
  std::vector<uint64_t> stale;  // leases of earlier calls that timed out here
  absl::Status error;
  for (const v1::LeaseGrant& grant : reply.leases()) {
    GrantedLease lease{grant.lease_id(), grant.segments(), {}, std::nullopt};
    if (error.ok()) {
      absl::StatusOr<std::vector<UniqueFd>> fds =
          attach_.ReceiveLease(grant.lease_id(), grant.segments(), rpc_.rpc_timeout(), &stale);
      if (fds.ok()) {
        lease.fds = *std::move(fds);
      } else {
        error = fds.status();
      }
    }
    granted.push_back(std::move(lease));
  }
  if (!error.ok()) {
    for (GrantedLease& lease : granted) {
      lease.fds.clear();
      stale.push_back(lease.lease_id);
    }
  }
  // Best effort: the daemon frees what it still has of these; the rest
  // goes when the session closes.
  if (!stale.empty()) (void)Return(stale);
  if (!error.ok()) return error;
  return granted;
}

void HostLeases::ConfirmAfterRestart() {
  const uint64_t reattaches = attach_.reattaches();
  if (reattaches == confirmed_reattaches_.load(std::memory_order_acquire)) return;
  v1::ConfirmLeasesRequest request;
  {
    absl::MutexLock lock(&held_mu_);
    for (uint64_t id : held_) request.add_held_lease_ids(id);
  }
  v1::ConfirmLeasesReply reply;
  const absl::Status status =
      rpc_.Call(&v1::Stash::Stub::ConfirmLeases, request, &reply, "ConfirmLeases");
  // An older daemon (UNIMPLEMENTED) keeps such leases with the session.
  if (status.ok() || absl::IsUnimplemented(status)) {
    confirmed_reattaches_.store(reattaches, std::memory_order_release);
  }
}

absl::Status HostLeases::Return(absl::Span<const uint64_t> lease_ids) {
  {
    absl::MutexLock lock(&held_mu_);
    for (uint64_t id : lease_ids) held_.erase(id);
  }
  const uint64_t reattaches = attach_.reattaches();
  absl::Status status = ReturnLeases(rpc_, lease_ids);
  if (!absl::IsNotFound(status) || attach_.reattaches() == reattaches) return status;
  // The daemon restarted meanwhile: it may have done this Return before it
  // went down (recorded, then no reply), or lost a lease of the batch.
  // Return being all or nothing, each lease goes back on its own; one the
  // daemon no longer has is gone already.
  for (uint64_t id : lease_ids) {
    absl::Status one = ReturnLeases(rpc_, absl::MakeConstSpan(&id, 1));
    if (!one.ok() && !absl::IsNotFound(one)) return one;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SpillFile>> HostLeases::Spill(absl::Span<const uint64_t> lease_ids,
                                                         uint64_t* return_bytes) {
  v1::SpillRequest request;
  for (uint64_t id : lease_ids) request.add_lease_ids(id);
  v1::SpillReply reply;
  if (absl::Status s = rpc_.Call(&v1::Stash::Stub::Spill, request, &reply, "Spill"); !s.ok()) {
    return s;
  }
  std::vector<SpillFile> files;
  for (const v1::SpilledLease& spilled : reply.spilled()) {
    files.push_back(SpillFile{spilled.spill_id(), spilled.checksum()});
  }
  *return_bytes = reply.return_bytes();
  return files;
}

absl::Status HostLeases::Restore(uint64_t spill_id, uint64_t lease_id, bool* resent) {
  v1::RestoreRequest request;
  request.set_spill_id(spill_id);
  request.set_lease_id(lease_id);
  v1::RestoreReply reply;
  return rpc_.Call(&v1::Stash::Stub::Restore, request, &reply, "Restore", resent);
}

absl::Status HostLeases::DropSpilled(absl::Span<const uint64_t> spill_ids) {
  v1::DropSpilledRequest request;
  for (uint64_t id : spill_ids) request.add_spill_ids(id);
  v1::DropSpilledReply reply;
  return rpc_.Call(&v1::Stash::Stub::DropSpilled, request, &reply, "DropSpilled");
}

}  // namespace actstash::client_internal
