#include "server/sessions/lease_manager.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/base/work_queue.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

Lease::Lease(uint64_t id, std::shared_ptr<Session> session, SegmentRun run,
             QuotaReservation reservation, LeaseManager* manager)
    : id_(id),
      session_(std::move(session)),
      run_(std::move(run)),
      reservation_(std::move(reservation)),
      manager_(manager) {
  session_->AddLeases(1, static_cast<int64_t>(bytes()));
}

Lease::~Lease() {
  session_->AddLeases(-1, -static_cast<int64_t>(bytes()));
  manager_->Recycle(std::move(run_));
}

absl::Status LeaseManager::Scrub(const Lease& lease) {
  SegmentRun view;
  view.first_segment = lease.first_segment();
  view.count = lease.segments();
  if (absl::Status renewed = pool_.RenewSegments(view); !renewed.ok()) return renewed;
  if (journal_ != nullptr) journal_->LeasedSegmentsRenewed(view.first_segment, view.count);
  // Recorded now that the journal keeps its fresh memory (Grant left it out),
  // unless it was given back meanwhile (TakeLocked journals that under mu_).
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease.id());
  if (it != leases_.end() && it->second.get() == &lease) Record(lease);
  return absl::OkStatus();
}

void LeaseManager::Recycle(SegmentRun run) {
  if (!renew_.load()) return;  // shutting down: `run` frees the memory as it is
  const uint64_t bytes = run.memory.size();
  renewals_pending_.fetch_add(1);
  renewing_bytes_.fetch_add(bytes);
  auto renew = [this, bytes, run = std::make_shared<SegmentRun>(std::move(run))] {
    struct Done {
      LeaseManager* manager;
      uint64_t bytes;
      ~Done() {  // after `run` is freed below
        manager->renewing_bytes_.fetch_sub(bytes);
        manager->renewals_pending_.fetch_sub(1);
      }
    };
    Done done{this, bytes};
    if (absl::Status s = pool_.RenewSegments(*run); !s.ok()) {
      // The run stays allocated (never handed out again) rather than going
      // back to the pool with memory a client can still reach.
      spdlog::error("renewing returned segments {}..{} failed: {}; keeping them out of use",
                    run->first_segment, run->first_segment + run->count - 1, s.ToString());
      absl::MutexLock lock(&mu_);
      quarantine_.push_back(std::move(*run));
    } else if (journal_ != nullptr) {
      journal_->SegmentsRenewed(run->first_segment, run->count);
    }
    run->memory.Reset();  // free now, before `done` says so
  };
  if (work_ != nullptr) {
    work_->Post(std::move(renew));
  } else {
    renew();
  }
}

absl::StatusOr<std::vector<std::shared_ptr<Lease>>> LeaseManager::Grant(
    const std::shared_ptr<Session>& session, uint32_t count, uint32_t segments_per_lease,
    int numa_node) {
  const uint64_t lease_bytes = uint64_t{segments_per_lease} * pool_.segment_bytes();
  // One reservation for the whole batch first, so a batch over the quota
  // fails with the batch's numbers and takes no pool memory.
  absl::StatusOr<QuotaReservation> batch = session->Reserve(lease_bytes * count);
  if (!batch.ok()) return batch.status();
  batch->Reset();
  std::vector<std::shared_ptr<Lease>> granted;
  std::vector<std::pair<SegmentRun, QuotaReservation>> parts;
  for (uint32_t i = 0; i < count; ++i) {
    absl::StatusOr<QuotaReservation> reservation = session->Reserve(lease_bytes);
    if (!reservation.ok()) return reservation.status();  // raced with another grant
    absl::StatusOr<SegmentRun> run = pool_.AllocateSegments(segments_per_lease, numa_node);
    if (!run.ok()) {
      return absl::Status(run.status().code(), absl::StrCat("lease ", i + 1, " of ", count, ": ",
                                                            run.status().message()));
    }
    parts.emplace_back(*std::move(run), *std::move(reservation));
  }
  absl::MutexLock lock(&mu_);
  // Checked under mu_ like Catalog::Insert: a session closed meanwhile
  // either sees these leases in ReleaseSession or they are never added.
  if (session->closed()) {
    return absl::FailedPreconditionError(absl::StrCat("session ", session->id(), " is closed"));
  }
  if (numa_node >= 0) session->SetNumaNode(numa_node);
  for (auto& [run, reservation] : parts) {
    if (numa_node >= 0 && (run.spans_nodes || (run.numa_node >= 0 && run.numa_node != numa_node))) {
      session->CountLeaseOffNode();
    }
    auto lease =
        std::make_shared<Lease>(next_id_++, session, std::move(run), std::move(reservation), this);
    leases_.emplace(lease->id(), lease);
    leased_bytes_ += lease->bytes();
    // One that needs scrubbing is recorded by Scrub, once the journal keeps
    // its fresh memfds: recorded before, a crash between the two would leave
    // the table a lease whose segments' kept memfds are gone or stale.
    if (!lease->needs_scrub()) Record(*lease);
    granted.push_back(std::move(lease));
  }
  granted_total_ += granted.size();
  return granted;
}

RemovedTotals LeaseManager::TakeLocked(uint64_t session_id, absl::Span<const uint64_t> ids,
                                       std::vector<std::shared_ptr<Lease>>* removed) {
  RemovedTotals totals;
  for (uint64_t id : ids) {
    auto it = leases_.find(id);
    if (it == leases_.end() || it->second->session_id() != session_id) continue;
    totals.bytes += it->second->bytes();
    leased_bytes_ -= it->second->bytes();
    if (journal_ != nullptr) journal_->LeaseReleased(id, it->second->first_segment());
    removed->push_back(std::move(it->second));
    leases_.erase(it);
    carried_.erase(id);
    ++totals.objects;
  }
  return totals;
}

absl::Status LeaseManager::CheckReturnLocked(uint64_t session_id,
                                             absl::Span<const uint64_t> ids) const {
  absl::flat_hash_set<uint64_t> seen;
  for (uint64_t id : ids) {
    auto it = leases_.find(id);
    if (it == leases_.end() || it->second->session_id() != session_id) {
      return absl::NotFoundError(
          absl::StrCat("no lease ", id, " in this session; nothing returned"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease ", id, " appears twice; nothing returned"));
    }
  }
  return absl::OkStatus();
}

absl::Status LeaseManager::CheckReturn(uint64_t session_id, absl::Span<const uint64_t> ids) const {
  absl::MutexLock lock(&mu_);
  return CheckReturnLocked(session_id, ids);
}

absl::StatusOr<RemovedTotals> LeaseManager::Return(uint64_t session_id,
                                                   absl::Span<const uint64_t> ids) {
  std::vector<std::shared_ptr<Lease>> removed;  // freed outside mu_
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckReturnLocked(session_id, ids); !s.ok()) return s;
  return TakeLocked(session_id, ids, &removed);
}

RemovedTotals LeaseManager::ReturnAny(uint64_t session_id, absl::Span<const uint64_t> ids) {
  std::vector<std::shared_ptr<Lease>> removed;  // freed outside mu_
  absl::MutexLock lock(&mu_);
  return TakeLocked(session_id, ids, &removed);
}

RemovedTotals LeaseManager::ReleaseSession(uint64_t session_id) {
  std::vector<std::shared_ptr<Lease>> removed;  // freed outside mu_
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> ids;
  for (const auto& [id, lease] : leases_) {
    if (lease->session_id() == session_id) ids.push_back(id);
  }
  return TakeLocked(session_id, ids, &removed);
}

RemovedTotals LeaseManager::ReleaseUnclaimed(uint64_t session_id, absl::Span<const uint64_t> held) {
  std::vector<std::shared_ptr<Lease>> removed;  // freed outside mu_
  absl::MutexLock lock(&mu_);
  const absl::flat_hash_set<uint64_t> named(held.begin(), held.end());
  std::vector<uint64_t> unclaimed;
  for (auto it = carried_.begin(); it != carried_.end();) {
    const auto lease = leases_.find(*it);
    if (lease == leases_.end() || lease->second->session_id() != session_id) {
      ++it;
      continue;
    }
    if (!named.contains(*it)) unclaimed.push_back(*it);
    carried_.erase(it++);
  }
  return TakeLocked(session_id, unclaimed, &removed);
}

absl::StatusOr<std::shared_ptr<Lease>> LeaseManager::Find(uint64_t session_id, uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second->session_id() != session_id) {
    return absl::NotFoundError(absl::StrCat("no lease ", id, " in this session"));
  }
  return it->second;
}

uint64_t LeaseManager::leased_bytes() const {
  absl::MutexLock lock(&mu_);
  return leased_bytes_;
}

size_t LeaseManager::size() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

uint64_t LeaseManager::sessions_holding(uint64_t also) const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<uint64_t> sessions;
  if (also != 0) sessions.insert(also);
  for (const auto& [id, lease] : leases_) sessions.insert(lease->session_id());
  return sessions.size();
}

uint64_t LeaseManager::granted_total() const {
  absl::MutexLock lock(&mu_);
  return granted_total_;
}

namespace {

// A lease as the take-over and the state table record it.
v1::LeaseState StateOf(const Lease& lease) {
  v1::LeaseState state;
  state.set_id(lease.id());
  state.set_session_id(lease.session_id());
  state.set_first_segment(lease.first_segment());
  state.set_count(lease.segments());
  return state;
}

}  // namespace

void LeaseManager::Record(const Lease& lease) {
  if (journal_ != nullptr) journal_->LeaseGranted(StateOf(lease));
}

std::vector<v1::LeaseState> LeaseManager::Export() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::LeaseState> out;
  for (const auto& [id, lease] : leases_) out.push_back(StateOf(*lease));
  return out;
}

absl::Status LeaseManager::Adopt(const std::shared_ptr<Session>& session,
                                 const v1::LeaseState& state, SegmentRun* run) {
  if (tiered_id::TierOf(state.id()) != tier_ || tiered_id::IsInline(state.id()) ||
      tiered_id::SerialOf(state.id()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("handed lease ", state.id(), " is not of tier ", tier_));
  }
  absl::StatusOr<QuotaReservation> reservation = session->Reserve(run->memory.size());
  if (!reservation.ok()) return reservation.status();
  absl::MutexLock lock(&mu_);
  if (leases_.contains(state.id())) {
    return absl::InvalidArgumentError(absl::StrCat("handed lease ", state.id(), " repeats"));
  }
  auto lease =
      std::make_shared<Lease>(state.id(), session, std::move(*run), *std::move(reservation), this);
  leased_bytes_ += lease->bytes();
  Record(*lease);
  leases_.emplace(state.id(), std::move(lease));
  carried_.insert(state.id());
  next_id_ = std::max(next_id_, state.id() + 1);
  return absl::OkStatus();
}

uint64_t LeaseManager::next_id() const {
  absl::MutexLock lock(&mu_);
  return next_id_;
}

void LeaseManager::Restore(uint64_t next_id, uint64_t granted_total) {
  absl::MutexLock lock(&mu_);
  if (tiered_id::TierOf(next_id) == tier_) next_id_ = std::max(next_id_, next_id);
  granted_total_ = std::max(granted_total_, granted_total);
}

}  // namespace actstash::server
