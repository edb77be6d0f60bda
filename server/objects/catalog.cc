#include "server/objects/catalog.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace actstash::server {

absl::StatusOr<uint64_t> Catalog::Insert(const Session& session,
                                         std::shared_ptr<StoredObject> object,
                                         bool* stored_before) {
  if (stored_before != nullptr) *stored_before = false;
  absl::MutexLock lock(&mu_);
  // Checked under mu_: SessionManager::Close marks the session closed before
  // RemoveSession takes mu_, so an object is either refused here or removed
  // there, never orphaned.
  if (session.closed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session.id(), " was closed during the Put"));
  }
  const uint64_t put_id = object->meta().put_id;
  if (put_id != 0) {
    auto [it, added] = by_put_.try_emplace({session.id(), put_id}, next_handle_);
    // A Put sent again: `object`, a parameter, is dropped after mu_ is
    // released (parameters outlive the function's locals).
    if (stored_before != nullptr) *stored_before = !added;
    if (!added) return it->second;
  }
  const uint64_t handle = next_handle_++;
  if (journal_ != nullptr) {
    journal_->ObjectHandleIssued(handle);
    object->Record(journal_, handle);
  }
  objects_.emplace(handle, std::move(object));
  by_session_[session.id()].insert(handle);
  return handle;
}

absl::Status Catalog::Export(v1::DaemonState* state) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [handle, object] : objects_) {
    v1::ObjectState out;
    absl::StatusOr<bool> exported = object->ExportState(handle, &out);
    if (!exported.ok()) return exported.status();
    if (*exported) *state->add_objects() = std::move(out);
  }
  return absl::OkStatus();
}

absl::Status Catalog::Adopt(const Session& session, uint64_t handle,
                            std::shared_ptr<StoredObject> object) {
  absl::MutexLock lock(&mu_);
  if (handle == 0 || handle == UINT64_MAX || objects_.contains(handle)) {
    return absl::InvalidArgumentError(
        absl::StrCat("object handle ", handle, " is out of range or repeated in the handed state"));
  }
  const uint64_t put_id = object->meta().put_id;
  if (put_id != 0 && by_put_.contains({session.id(), put_id})) {
    return absl::InvalidArgumentError(absl::StrCat("object ", handle, ": put id ", put_id,
                                                   " repeated in session ", session.id()));
  }
  if (journal_ != nullptr) {
    journal_->ObjectHandleIssued(handle);
    object->Record(journal_, handle);
  }
  next_handle_ = std::max(next_handle_, handle + 1);
  if (put_id != 0) by_put_[{session.id(), put_id}] = handle;
  objects_.emplace(handle, std::move(object));
  by_session_[session.id()].insert(handle);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StoredObject>> Catalog::Lookup(uint64_t session_id,
                                                                    uint64_t handle) const {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(handle);
  if (it == objects_.end() && handle < lost_below_) {
    return absl::DataLossError(absl::StrCat(
        "object ", handle,
        " was stored before actstashd restarted after a crash and did not survive it (its "
        "memory, spill file or record was not kept; see the daemon's log)"));
  }
  if (it == objects_.end() || it->second->session_id() != session_id) {
    return absl::NotFoundError(absl::StrCat("no object with handle ", handle, " in this session"));
  }
  return std::shared_ptr<const StoredObject>(it->second);
}

absl::StatusOr<RemovedTotals> Catalog::Remove(uint64_t session_id,
                                              absl::Span<const uint64_t> handles) {
  std::vector<std::shared_ptr<StoredObject>> removed;
  removed.reserve(handles.size());
  RemovedTotals totals;
  {
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<uint64_t> seen;
    for (uint64_t handle : handles) {
      auto it = objects_.find(handle);
      if (it == objects_.end() && handle < lost_below_) continue;  // gone with a crash
      if (it == objects_.end() || it->second->session_id() != session_id) {
        return absl::NotFoundError(
            absl::StrCat("no object with handle ", handle, " in this session; nothing deleted"));
      }
      if (!seen.insert(handle).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("handle ", handle, " appears twice; nothing deleted"));
      }
    }
    auto& owned = by_session_[session_id];
    for (uint64_t handle : handles) {
      auto it = objects_.find(handle);
      if (it == objects_.end()) continue;  // lost in a crash (checked above)
      totals.bytes += it->second->meta().nbytes;
      it->second->Unrecord();
      ForgetPutLocked(*it->second);
      removed.push_back(std::move(it->second));
      objects_.erase(it);
      owned.erase(handle);
    }
    if (owned.empty()) by_session_.erase(session_id);
  }
  totals.objects = removed.size();
  return totals;  // `removed` gives the memory back here, outside mu_.
}

RemovedTotals Catalog::RemoveSession(uint64_t session_id) {
  std::vector<std::shared_ptr<StoredObject>> removed;
  RemovedTotals totals;
  {
    absl::MutexLock lock(&mu_);
    auto owned = by_session_.extract(session_id);
    if (owned.empty()) return totals;
    for (uint64_t handle : owned.mapped()) {
      auto it = objects_.find(handle);
      totals.bytes += it->second->meta().nbytes;
      it->second->Unrecord();
      ForgetPutLocked(*it->second);
      removed.push_back(std::move(it->second));
      objects_.erase(it);
    }
  }
  totals.objects = removed.size();
  return totals;
}

std::vector<std::shared_ptr<StoredObject>> Catalog::BeginSpill(uint64_t session_id, uint64_t bytes,
                                                               const StoredObject* except) {
  std::vector<std::shared_ptr<StoredObject>> chosen;
  absl::MutexLock lock(&mu_);
  auto owned = by_session_.find(session_id);
  if (owned == by_session_.end()) return chosen;
  std::vector<uint64_t> handles(owned->second.begin(), owned->second.end());
  std::sort(handles.begin(), handles.end());  // handles grow: oldest first
  uint64_t total = 0;
  for (uint64_t handle : handles) {
    if (total >= bytes) break;
    const std::shared_ptr<StoredObject>& object = objects_.at(handle);
    if (object.get() == except || object->meta().nbytes == 0 || !object->TryBeginSpill()) continue;
    total += object->meta().nbytes;
    chosen.push_back(object);
  }
  return chosen;
}

void Catalog::RemoveAll() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<StoredObject>> removed;
  {
    absl::MutexLock lock(&mu_);
    removed.swap(objects_);
    by_session_.clear();
    by_put_.clear();
    for (const auto& [handle, object] : removed) object->Unrecord();
  }
}

std::optional<uint64_t> Catalog::FindPut(uint64_t session_id, uint64_t put_id) const {
  if (put_id == 0) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = by_put_.find({session_id, put_id});
  if (it == by_put_.end()) return std::nullopt;
  return it->second;
}

void Catalog::ForgetPutLocked(const StoredObject& object) {
  if (object.meta().put_id != 0) by_put_.erase({object.session_id(), object.meta().put_id});
}

size_t Catalog::size() const {
  absl::MutexLock lock(&mu_);
  return objects_.size();
}

size_t Catalog::SessionObjectCount(uint64_t session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_session_.find(session_id);
  return it == by_session_.end() ? 0 : it->second.size();
}

uint64_t Catalog::next_handle() const {
  absl::MutexLock lock(&mu_);
  return next_handle_;
}

uint64_t Catalog::lost_below() const {
  absl::MutexLock lock(&mu_);
  return lost_below_;
}

void Catalog::AdvanceNextHandle(uint64_t handle, bool lost) {
  absl::MutexLock lock(&mu_);
  next_handle_ = std::max(next_handle_, handle);
  if (lost) lost_below_ = std::max(lost_below_, handle);
}

}  // namespace actstash::server
