#include "server/restart/crash_recovery.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

constexpr char kSegmentPrefix[] = "seg-";
constexpr char kSpillPrefix[] = "spill-";

}  // namespace

std::string SegmentFdName(uint32_t segment) { return absl::StrCat(kSegmentPrefix, segment); }
std::string SpillFdName(uint64_t spill_id) { return absl::StrCat(kSpillPrefix, spill_id); }

TableGeometry TableGeometryFor(uint64_t pool_bytes, uint64_t segment_bytes, size_t max_sessions,
                               uint64_t spill_tier_bytes) {
  TableGeometry geometry;
  geometry.segment_bytes = segment_bytes;
  geometry.segments = segment_bytes == 0 ? 0 : static_cast<uint32_t>(pool_bytes / segment_bytes);
  geometry.session_slots = static_cast<uint32_t>(max_sessions);
  geometry.spill_slots =
      spill_tier_bytes == 0 || segment_bytes == 0
          ? 0
          : static_cast<uint32_t>(std::clamp<uint64_t>(spill_tier_bytes / segment_bytes,
                                                       kMinKeptSpillFiles, kMaxKeptSpillFiles));
  geometry.object_slots = static_cast<uint32_t>(
      std::clamp<uint64_t>(pool_bytes / kPoolBytesPerKeptObject, kMinKeptObjects, kMaxKeptObjects));
  return geometry;
}

Recovery CollectRecovery(const TableGeometry& geometry, bool device_pools,
                         std::vector<PassedFd> passed) {
  Recovery recovery;
  recovery.segments.resize(geometry.segments);
  UniqueFd state;
  size_t segments_passed = 0;
  int tables = 0;
  // A name kept twice (a removal the manager did not see): which fd is the
  // current one is unknown, so neither is used.
  std::vector<bool> repeated(geometry.segments, false);
  absl::flat_hash_map<uint64_t, UniqueFd> spill_fds;
  absl::flat_hash_set<uint64_t> spill_repeated;
  for (PassedFd& fd : passed) {
    uint32_t index = 0;
    uint64_t spill_id = 0;
    const bool segment = absl::StartsWith(fd.name, kSegmentPrefix) &&
                         absl::SimpleAtoi(fd.name.substr(sizeof(kSegmentPrefix) - 1), &index);
    if (absl::StartsWith(fd.name, kSpillPrefix) &&
        absl::SimpleAtoi(fd.name.substr(sizeof(kSpillPrefix) - 1), &spill_id)) {
      // Matched with the table's files below; a name kept twice is neither.
      if (!spill_fds.emplace(spill_id, std::move(fd.fd)).second) spill_repeated.insert(spill_id);
      continue;
    }
    if (fd.name == kStateFdName) {
      ++tables;
      state = std::move(fd.fd);
    } else if (fd.name == kAttachFdName && !recovery.attach_listener.valid()) {
      recovery.attach_listener = std::move(fd.fd);
    } else if (segment && index < geometry.segments) {
      repeated[index] = repeated[index] || recovery.segments[index].valid();
      recovery.segments[index] = std::move(fd.fd);
      ++segments_passed;
    } else {
      spdlog::warn("recovery: ignoring the passed fd '{}' (unknown, repeated or outside the pool)",
                   fd.name);
      if (segment) recovery.dropped_names.push_back(fd.name);
    }
  }
  for (uint32_t i = 0; i < geometry.segments; ++i) {
    if (repeated[i]) recovery.segments[i].Reset();
  }
  // Every passed spill fd not matched with a file of the table leaves the
  // store (all of them when nothing is recovered).
  auto drop_spill_fds = [&]() {
    for (auto& [id, fd] : spill_fds) recovery.dropped_names.push_back(SpillFdName(id));
    spill_fds.clear();
  };
  auto lose = [&](std::string why) {
    drop_spill_fds();
    recovery.why_lost = std::move(why);
    recovery.table.reset();
    for (UniqueFd& fd : recovery.segments) fd.Reset();
    recovery.reused_free.clear();
    return std::move(recovery);
  };
  if (!state.valid()) {
    if (segments_passed == 0) {  // nothing of a state passed
      drop_spill_fds();
      return recovery;
    }
    return lose("no state table was passed back with the pool's segments");
  }
  if (tables > 1) {
    // A table stored while an earlier one's removal did not reach the
    // manager: which is current is unknown.
    return lose(absl::StrCat(tables, " state tables were passed back"));
  }
  if (device_pools) {
    return lose(
        "device pools do not survive a crash (their CUDA IPC memory died with the process), so "
        "nothing is recovered when they are configured");
  }
  RecoveredState state_read;
  absl::StatusOr<std::unique_ptr<StateTable>> table =
      StateTable::Recover(std::move(state), geometry, &state_read);
  if (!table.ok()) return lose(table.status().ToString());
  recovery.table = *std::move(table);
  recovery.state = std::move(state_read);

  std::vector<bool> leased(geometry.segments, false);
  std::vector<v1::LeaseState> kept;
  for (v1::LeaseState& lease : recovery.state.leases) {
    bool have = true;
    for (uint32_t i = 0; i < lease.count(); ++i) {
      have = have && recovery.segments[lease.first_segment() + i].valid() &&
             recovery.state.kept[lease.first_segment() + i];
    }
    if (!have) {
      // Its segments' current memfds were not kept (a store failed or did
      // not reach the manager): the memory the client maps is not this
      // pool's any more. The client keeps its mapping; the segments get
      // fresh memfds.
      spdlog::warn("recovery: lease {} of session {} lost: its segments' memfds were not kept",
                   lease.id(), lease.session_id());
      recovery.table->LeaseReleased(lease.id(), lease.first_segment());
      continue;
    }
    for (uint32_t i = 0; i < lease.count(); ++i) leased[lease.first_segment() + i] = true;
    kept.push_back(std::move(lease));
  }
  recovery.state.leases = std::move(kept);
  std::vector<v1::SpillFileState> files;
  for (v1::SpillFileState& file : recovery.state.spill_files) {
    auto fd = spill_fds.find(file.id());
    if (fd == spill_fds.end() || spill_repeated.contains(file.id())) {
      spdlog::warn("recovery: spill file {} of session {} lost: its fd was not kept", file.id(),
                   file.session_id());
      recovery.table->SpillFileGone(file.id());
      continue;
    }
    recovery.spill_fds.push_back(std::move(fd->second));
    spill_fds.erase(fd);
    files.push_back(std::move(file));
  }
  recovery.state.spill_files = std::move(files);
  drop_spill_fds();  // those the table does not record
  for (uint32_t i = 0; i < geometry.segments; ++i) {
    if (leased[i]) continue;
    if (recovery.segments[i].valid() && recovery.state.clean[i]) {
      recovery.reused_free.push_back(i);
    } else {
      recovery.segments[i].Reset();  // a fresh memfd replaces it
    }
  }
  // An object survives when its bytes do: in segments mapped again, or in a
  // spill file that came back.
  absl::flat_hash_set<uint64_t> files_back;
  for (const v1::SpillFileState& file : recovery.state.spill_files) files_back.insert(file.id());
  std::vector<v1::ObjectState> objects;
  for (v1::ObjectState& object : recovery.state.objects) {
    bool back = false;
    if (object.residence_case() == v1::ObjectState::kSpillId) {
      back = files_back.contains(object.spill_id());
    } else if (object.nbytes() == 0) {
      back = true;  // no memory to come back
    } else if (geometry.segment_bytes > 0) {
      const uint64_t first = object.pool_offset() / geometry.segment_bytes;
      const uint64_t end = (object.pool_offset() + object.nbytes() + geometry.segment_bytes - 1) /
                           geometry.segment_bytes;
      back = end <= geometry.segments;
      for (uint64_t i = first; back && i < end; ++i) {
        back = !leased[i] && recovery.segments[i].valid();
      }
    }
    if (!back) {
      spdlog::warn("recovery: inline object {} of session {} lost: its {} was not kept",
                   object.handle(), object.session_id(),
                   object.residence_case() == v1::ObjectState::kSpillId ? "spill file" : "memory");
      recovery.table->ObjectGone(object.handle());
      continue;
    }
    objects.push_back(std::move(object));
  }
  recovery.state.objects = std::move(objects);
  return recovery;
}

absl::Status DaemonJournal::StoreSegment(uint32_t segment) const {
  if (pool_ == nullptr) return absl::FailedPreconditionError("no pool to store segments of");
  absl::StatusOr<UniqueFd> fd = pool_->DupSegmentFd(segment);
  if (!fd.ok()) return fd.status();
  const std::string name = SegmentFdName(segment);
  if (absl::Status s = notifier_.RemoveFds(name); !s.ok()) return s;
  return notifier_.StoreFd(name, fd->get());
}

void DaemonJournal::SegmentsRenewed(uint32_t first, uint32_t count) {
  for (uint32_t i = first; i - first < count; ++i) {
    // Neither clean nor kept unless the service manager holds the new
    // memfd: a restart would otherwise map the old one, which the client
    // that returned the lease may still map.
    if (absl::Status s = StoreSegment(i); !s.ok()) {
      spdlog::warn("keeping segment {}'s renewed memfd for a restart failed: {}", i, s.ToString());
      table_->SegmentsNotKept(i, 1);
      continue;
    }
    table_->SegmentsRenewed(i, 1);
  }
}

void DaemonJournal::LeasedSegmentsRenewed(uint32_t first, uint32_t count) {
  for (uint32_t i = first; i - first < count; ++i) {
    // Not kept unless the service manager holds the new memfd: a restart
    // would otherwise map the replaced one, which the lease's client never
    // sees (the lease is then said lost instead).
    if (absl::Status s = StoreSegment(i); !s.ok()) {
      spdlog::warn("keeping leased segment {}'s renewed memfd for a restart failed: {}", i,
                   s.ToString());
      table_->SegmentsNotKept(i, 1);
      continue;
    }
    table_->LeasedSegmentsRenewed(i, 1);
  }
}

absl::Status DaemonJournal::KeepForRestart(const std::vector<bool>& reused_segments,
                                           bool store_table,
                                           const std::vector<std::string>& dropped_names) {
  // systemd 254+ says how many fds it keeps ($FDSTORE, FileDescriptorStoreMax):
  // one dropped silently would leave a stale memfd under its name.
  const uint64_t needed = uint64_t{pool_->segment_count()} + 2;
  uint64_t max = 0;
  if (const char* room = std::getenv("FDSTORE"); room != nullptr && absl::SimpleAtoi(room, &max)) {
    if (max < needed) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the service manager keeps at most ", max, " fds (FileDescriptorStoreMax); ",
                       needed, " are needed (a segment each, the table, the attach listener)"));
    }
    absl::MutexLock lock(&mu_);
    spill_room_ = max - needed;
  }
  for (const std::string& name : dropped_names) {
    if (absl::Status s = notifier_.RemoveFds(name); !s.ok()) return s;
  }
  // The segments first, each marked kept once stored; the table last, so
  // that a table in the store never vouches for a segment it does not hold.
  uint32_t stored = 0;
  for (uint32_t i = 0; i < pool_->segment_count(); ++i) {
    if (i < reused_segments.size() && reused_segments[i]) continue;
    if (absl::Status s = StoreSegment(i); !s.ok()) {
      table_->SegmentsNotKept(i, 1);
      return s;
    }
    table_->SegmentsRenewed(i, 1);
    ++stored;
  }
  if (store_table) {
    if (absl::Status s = StoreTable(); !s.ok()) return s;
  }
  spdlog::info(
      "service manager ({}): keeps the state table and the pool's segments ({} stored now) for "
      "a restart after a crash",
      notifier_.address(), stored);
  return absl::OkStatus();
}

absl::Status DaemonJournal::StoreTable() const {
  if (absl::Status s = notifier_.RemoveFds(kStateFdName); !s.ok()) return s;
  return notifier_.StoreFd(kStateFdName, table_->fd());
}

void DaemonJournal::GiveUp() {
  table_->Retire();
  (void)notifier_.RemoveFds(kStateFdName);
}

void DaemonJournal::SpillFileKept(const v1::SpillFileState& file, int fd) {
  {
    absl::MutexLock lock(&mu_);
    if (kept_spills_.size() >= spill_room_) {
      if (!spill_room_logged_) {
        spdlog::warn(
            "the service manager keeps no more fds (FileDescriptorStoreMax): spill file {} (and "
            "others until some are read back) will not survive a crash",
            file.id());
        spill_room_logged_ = true;
      }
      return;
    }
    if (!kept_spills_.insert(file.id()).second) return;  // kept already
  }
  if (absl::Status s = notifier_.StoreFd(SpillFdName(file.id()), fd); !s.ok()) {
    spdlog::warn("keeping spill file {} for a restart failed: {}", file.id(), s.ToString());
    absl::MutexLock lock(&mu_);
    kept_spills_.erase(file.id());
    return;
  }
  table_->SpillFileKept(file, fd);
}

void DaemonJournal::SpillFileGone(uint64_t spill_id) {
  {
    absl::MutexLock lock(&mu_);
    if (kept_spills_.erase(spill_id) == 0) return;
  }
  // The table forgets it first: a table never names a file the store lost.
  table_->SpillFileGone(spill_id);
  (void)notifier_.RemoveFds(SpillFdName(spill_id));
}

void DaemonJournal::SpillFilesRecovered(const std::vector<v1::SpillFileState>& files) {
  absl::MutexLock lock(&mu_);
  for (const v1::SpillFileState& file : files) kept_spills_.insert(file.id());
}

}  // namespace actstash::server
