// Daemon's side of a restart after a crash (crash_recovery.h): adopting
// what the state table recorded, keeping what a later restart needs in the
// service manager's fd store, and closing the sessions that do not come
// back within the grace period.
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/daemon/daemon.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

absl::Status Daemon::AdoptRecovered(Recovery* recovery) {
  const RecoveredState& state = recovery->state;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> by_id;
  for (const v1::SessionState& s : state.sessions) {
    absl::StatusOr<std::shared_ptr<Session>> session = sessions_.Adopt(s);
    if (!session.ok()) {
      // Not expected (the table was checked): this session is lost, the
      // others are not.
      spdlog::error("recovery: session {} not recovered: {}", s.id(), session.status().ToString());
      if (journal_ != nullptr) journal_->SessionClosed(s.id());
      continue;
    }
    by_id[s.id()] = *session;
  }
  size_t leases = 0;
  // Sessions with memory of their own (leases, spill files) were attached
  // before, except those with inline objects: a spill file of theirs may
  // be an object's whose record a crash cut short, and such a client may
  // have no attach connection to come back by.
  absl::flat_hash_set<uint64_t> inline_sessions;
  for (const v1::ObjectState& object : state.objects) inline_sessions.insert(object.session_id());
  absl::flat_hash_set<uint64_t> attached_before;
  for (const v1::SpillFileState& file : state.spill_files) {
    if (!inline_sessions.contains(file.session_id())) attached_before.insert(file.session_id());
  }
  for (const v1::LeaseState& lease : state.leases) {
    absl::StatusOr<SegmentRun> run = pool_->AdoptRun(lease.first_segment(), lease.count());
    if (!run.ok()) {  // not expected: the table's runs do not overlap
      spdlog::error("recovery: lease {} not recovered: {}", lease.id(), run.status().ToString());
      continue;
    }
    auto it = by_id.find(lease.session_id());
    absl::Status adopted = it == by_id.end() ? absl::NotFoundError("its session was not recovered")
                                             : leases_.Adopt(it->second, lease, &*run);
    if (!adopted.ok()) {
      // Its client may still map this memory: renewed before it is free.
      spdlog::error("recovery: lease {} of session {} not recovered: {}", lease.id(),
                    lease.session_id(), adopted.ToString());
      if (journal_ != nullptr) journal_->LeaseReleased(lease.id(), lease.first_segment());
      leases_.Recycle(*std::move(run));
      continue;
    }
    attached_before.insert(lease.session_id());
    ++leases;
  }
  const size_t spill_files = AdoptRecoveredSpills(recovery, by_id);
  const size_t objects = AdoptRecoveredObjects(state.objects, by_id);
  leases_.Restore(state.next_lease_id, 0);
  sessions_.AdvanceNextId(state.next_session_id);
  // Handles of objects that did not come back say they were lost; new ones
  // never repeat any.
  catalog_.AdvanceNextHandle(state.next_object_handle, /*lost=*/true);
  {
    absl::MutexLock lock(&recovery_mu_);
    for (const auto& [id, session] : by_id) awaiting_reattach_[id] = attached_before.contains(id);
    recovered_at_ms_ = SteadyNowMs();
    reattach_deadline_ms_ =
        recovered_at_ms_ + static_cast<int64_t>(config_.reattach_grace_seconds * 1000);
  }
  spdlog::info(
      "recovery: the state of the daemon that crashed is back (restart {} of this state): {} "
      "sessions, {} leases over {} segments kept, {} free segments reused, {} spill files, {} "
      "inline objects; the sessions have {} s to come back",
      state.restarts + 1, by_id.size(), leases, pool_->segment_count(),
      recovery->reused_free.size(), spill_files, objects, config_.reattach_grace_seconds);
  return absl::OkStatus();
}

size_t Daemon::AdoptRecoveredSpills(
    Recovery* recovery, const absl::flat_hash_map<uint64_t, std::shared_ptr<Session>>& sessions) {
  const RecoveredState& state = recovery->state;
  // The store and the table hold them: from here on they leave both when
  // they leave the tier (or now, when they cannot be adopted).
  if (journal_ != nullptr) journal_->SpillFilesRecovered(state.spill_files);
  // Even with no file back, new ids start above the floor: a client may
  // hold the id of a file that was lost, which must stay NOT_FOUND.
  v1::DaemonState adopt;
  adopt.set_next_spill_id(state.next_spill_id);
  for (const auto& [id, session] : sessions) adopt.add_sessions()->set_id(id);
  std::vector<uint64_t> lost;
  for (size_t i = 0; i < state.spill_files.size(); ++i) {
    const v1::SpillFileState& file = state.spill_files[i];
    if (spill_ == nullptr || !sessions.contains(file.session_id())) {
      lost.push_back(file.id());
      continue;
    }
    v1::SpillFileState* in = adopt.add_spill_files();
    *in = file;
    in->set_fd(static_cast<int32_t>(i));
  }
  if (spill_ != nullptr) {
    if (absl::Status s = spill_->Adopt(adopt, &recovery->spill_fds); !s.ok()) {
      spdlog::error("recovery: the spill files are not recovered: {}", s.ToString());
      for (const v1::SpillFileState& file : adopt.spill_files()) lost.push_back(file.id());
      adopt.clear_spill_files();
    }
  }
  for (uint64_t id : lost) {
    if (journal_ != nullptr) journal_->SpillFileGone(id);
  }
  return static_cast<size_t>(adopt.spill_files_size());
}

size_t Daemon::AdoptRecoveredObjects(
    const std::vector<v1::ObjectState>& objects,
    const absl::flat_hash_map<uint64_t, std::shared_ptr<Session>>& sessions) {
  absl::flat_hash_set<uint64_t> spill_ids;
  size_t adopted = 0;
  for (const v1::ObjectState& object : objects) {
    absl::Status s = sessions.contains(object.session_id())
                         ? AdoptObject(object, sessions, &spill_ids)
                         : absl::NotFoundError("its session was not recovered");
    if (s.ok()) {
      ++adopted;
      continue;
    }
    // Not expected (CollectRecovery kept only objects whose bytes came
    // back): this object is lost, the others are not.
    spdlog::error("recovery: inline object {} of session {} not recovered: {}", object.handle(),
                  object.session_id(), s.ToString());
    if (journal_ != nullptr) journal_->ObjectGone(object.handle());
    if (object.residence_case() == v1::ObjectState::kSpillId && spill_ != nullptr &&
        !spill_ids.contains(object.spill_id())) {
      const uint64_t id = object.spill_id();
      (void)spill_->Drop(object.session_id(), absl::MakeConstSpan(&id, 1));
    }
  }
  return adopted;
}

void Daemon::ReapUnreattached() {
  std::vector<uint64_t> expired;
  {
    absl::MutexLock lock(&recovery_mu_);
    if (awaiting_reattach_.empty()) return;
    const bool past = SteadyNowMs() >= reattach_deadline_ms_;
    struct Open {
      bool attached;
      bool called;  // an authenticated call since the recovery
    };
    absl::flat_hash_map<uint64_t, Open> open_sessions;
    for (const std::shared_ptr<Session>& session : sessions_.List()) {
      open_sessions[session->id()] = {session->attached(),
                                      session->last_active_ms() > recovered_at_ms_};
    }
    for (auto it = awaiting_reattach_.begin(); it != awaiting_reattach_.end();) {
      const auto& [id, needs_attach] = *it;
      auto open = open_sessions.find(id);
      const bool back = open != open_sessions.end() &&
                        (open->second.attached || (!needs_attach && open->second.called));
      if (open == open_sessions.end() || back || past) {
        if (!back && open != open_sessions.end()) expired.push_back(id);
        awaiting_reattach_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (uint64_t id : expired) {
    if (std::optional<SessionTotals> freed = CloseSessionAndFree(core_, id)) {
      core_.sessions_reclaimed.fetch_add(1, std::memory_order_relaxed);
      spdlog::info(
          "recovery: session {} did not attach again within {} s: closed, {} leases ({} bytes) "
          "freed",
          id, config_.reattach_grace_seconds, freed->leases.objects, freed->leases.bytes);
    }
  }
}

}  // namespace actstash::server
