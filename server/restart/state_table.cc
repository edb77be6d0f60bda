#include "server/restart/state_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/errno_status.h"
#include "server/restart/state_table_layout.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace table_layout {

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t CleanOffset() { return kHeaderBytes; }
size_t SessionsOffset(const TableGeometry& g) { return RoundUp(CleanOffset() + g.segments, 64); }
size_t LeasesOffset(const TableGeometry& g) {
  return SessionsOffset(g) + size_t{g.session_slots} * kSessionSlotBytes;
}
size_t SpillsOffset(const TableGeometry& g) {
  return LeasesOffset(g) + size_t{g.segments} * kLeaseSlotBytes;
}
size_t ObjectsOffset(const TableGeometry& g) {
  return SpillsOffset(g) + size_t{g.spill_slots} * kSpillSlotBytes;
}

uint64_t HeaderChecksum(const TableHeader& header) { return Xxh3(&header, kChecksummedBytes); }

uint64_t LoadWord(const std::byte* at) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(at), __ATOMIC_ACQUIRE);
}
void StoreWord(std::byte* at, uint64_t value) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(at), value, __ATOMIC_RELEASE);
}

void WriteSlot(std::byte* slot, const std::string& body) {
  const uint64_t word = (uint64_t{body.size()} << 1) | 1;
  if (LoadWord(slot) == word &&
      std::memcmp(slot + sizeof(SlotHeader), body.data(), body.size()) == 0) {
    return;
  }
  StoreWord(slot, 0);
  const uint64_t checksum = Xxh3(body.data(), body.size());
  std::memcpy(slot + sizeof(SlotHeader), body.data(), body.size());
  std::memcpy(slot + offsetof(SlotHeader, checksum), &checksum, sizeof(checksum));
  StoreWord(slot, word);
}

absl::StatusOr<std::string> ReadSlot(const std::byte* slot, size_t capacity, const char* what,
                                     uint32_t index) {
  const uint64_t word = LoadWord(slot);
  if (word == 0) return std::string();
  const uint64_t length = word >> 1;
  uint64_t checksum = 0;
  std::memcpy(&checksum, slot + offsetof(SlotHeader, checksum), sizeof(checksum));
  if ((word & 1) == 0 || length == 0 || length > capacity ||
      Xxh3(slot + sizeof(SlotHeader), length) != checksum) {
    return absl::DataLossError(
        absl::StrCat("the state table's ", what, " slot ", index, " fails its checksum"));
  }
  return std::string(reinterpret_cast<const char*>(slot + sizeof(SlotHeader)), length);
}

absl::StatusOr<std::byte*> MapTable(int fd, size_t bytes) {
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (at == MAP_FAILED) return ErrnoStatus("mapping the state table", errno);
  return static_cast<std::byte*>(at);
}

}  // namespace table_layout

using table_layout::CleanOffset;
using table_layout::HeaderChecksum;
using table_layout::HeaderOf;
using table_layout::kClean;
using table_layout::kFloorStep;
using table_layout::kKept;
using table_layout::kObjectBodyBytes;
using table_layout::kSessionBodyBytes;
using table_layout::kSpillBodyBytes;
using table_layout::LeasesOffset;
using table_layout::MapTable;
using table_layout::ObjectsOffset;
using table_layout::RoundUp;
using table_layout::SessionsOffset;
using table_layout::SpillsOffset;
using table_layout::StoreWord;
using table_layout::TableHeader;
using table_layout::WriteSlot;

size_t StateTableBytes(const TableGeometry& geometry) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return RoundUp(ObjectsOffset(geometry) + size_t{geometry.object_slots} * kObjectSlotBytes, page);
}

StateTable::StateTable(UniqueFd fd, std::byte* base, size_t bytes, const TableGeometry& geometry)
    : fd_(std::move(fd)), base_(base), bytes_(bytes), geometry_(geometry) {}

StateTable::~StateTable() { munmap(base_, bytes_); }

absl::StatusOr<UniqueFd> StateTable::NewTableFd(size_t bytes) {
  UniqueFd fd(memfd_create("actstash-state-table", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus("memfd_create for the state table", errno);
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus("sizing the state table", errno);
  }
  // A mapped file that shrinks faults its reader: no one may resize it.
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus("sealing the state table's size", errno);
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<StateTable>> StateTable::Create(const TableGeometry& geometry) {
  const size_t bytes = StateTableBytes(geometry);
  absl::StatusOr<UniqueFd> made = NewTableFd(bytes);
  if (!made.ok()) return made.status();
  UniqueFd fd = *std::move(made);
  absl::StatusOr<std::byte*> base = MapTable(fd.get(), bytes);
  if (!base.ok()) return base.status();
  TableHeader header;
  header.session_slots = geometry.session_slots;
  header.segment_bytes = geometry.segment_bytes;
  header.segments = geometry.segments;
  header.spill_slots = geometry.spill_slots;
  header.object_slots = geometry.object_slots;
  header.checksum = HeaderChecksum(header);
  std::memcpy(*base, &header, sizeof(header));
  // Nothing is clean or kept until the service manager holds its memfd
  // (SegmentsRenewed), so that a table stored before its segments never
  // vouches for memfds of an earlier daemon.
  std::memset(*base + CleanOffset(), 0, geometry.segments);
  std::unique_ptr<StateTable> table(new StateTable(std::move(fd), *base, bytes, geometry));
  absl::MutexLock lock(&table->mu_);
  table->sessions_.Reset(geometry.session_slots);
  table->spills_.Reset(geometry.spill_slots);
  table->objects_.Reset(geometry.object_slots);
  return table;
}

void StateTable::SlotIndex::Reset(uint32_t slots) {
  slot_of.clear();
  free.clear();
  fresh = 0;
  count = slots;
}

std::optional<uint32_t> StateTable::SlotIndex::Assign(uint64_t id) {
  if (auto it = slot_of.find(id); it != slot_of.end()) return it->second;
  uint32_t slot = 0;
  if (!free.empty()) {
    slot = free.back();
    free.pop_back();
  } else if (fresh < count) {
    slot = fresh++;
  } else {
    return std::nullopt;
  }
  slot_of[id] = slot;
  return slot;
}

std::optional<uint32_t> StateTable::SlotIndex::Release(uint64_t id) {
  auto it = slot_of.find(id);
  if (it == slot_of.end()) return std::nullopt;
  const uint32_t slot = it->second;
  free.push_back(slot);
  slot_of.erase(it);
  return slot;
}

std::byte* StateTable::SessionSlot(uint32_t index) const {
  return base_ + SessionsOffset(geometry_) + size_t{index} * kSessionSlotBytes;
}

std::byte* StateTable::LeaseSlot(uint32_t index) const {
  return base_ + LeasesOffset(geometry_) + size_t{index} * kLeaseSlotBytes;
}

std::byte* StateTable::SpillSlot(uint32_t index) const {
  return base_ + SpillsOffset(geometry_) + size_t{index} * kSpillSlotBytes;
}

std::byte* StateTable::ObjectSlot(uint32_t index) const {
  return base_ + ObjectsOffset(geometry_) + size_t{index} * kObjectSlotBytes;
}

uint8_t* StateTable::CleanFlags() const {
  return reinterpret_cast<uint8_t*>(base_ + CleanOffset());
}

void StateTable::Retire() { __atomic_store_n(&HeaderOf(base_)->retired, 1, __ATOMIC_RELEASE); }

void StateTable::RaiseFloor(size_t word_offset, uint64_t id) {
  auto* floor = reinterpret_cast<uint64_t*>(base_ + word_offset);
  uint64_t now = __atomic_load_n(floor, __ATOMIC_ACQUIRE);
  while (id >= now && !__atomic_compare_exchange_n(floor, &now, id + kFloorStep, false,
                                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
  }
}

void StateTable::SessionOpened(const v1::SessionState& session) {
  v1::SessionState kept;
  kept.set_id(session.id());
  kept.set_token(session.token());
  kept.set_name(session.name());
  kept.set_pid(session.pid());
  kept.set_quota_bytes(session.quota_bytes());
  kept.set_opened_unix_ms(session.opened_unix_ms());
  kept.set_attach_fd(-1);
  kept.set_peer_uid(session.peer_uid());
  kept.set_peer_gid(session.peer_gid());
  kept.set_peer_pid(session.peer_pid());
  kept.set_numa_node(session.numa_node());
  std::string body = kept.SerializeAsString();
  if (body.size() > kSessionBodyBytes) {  // a token or name beyond the protocol's bounds
    kept.clear_name();
    body = kept.SerializeAsString();
  }
  RaiseFloor(offsetof(TableHeader, session_id_floor), session.id());
  absl::MutexLock lock(&mu_);
  const std::optional<uint32_t> slot =
      body.size() <= kSessionBodyBytes ? sessions_.Assign(session.id()) : std::nullopt;
  if (!slot.has_value()) {
    spdlog::error("state table: no slot for session {}; it will not survive a crash", session.id());
    return;
  }
  WriteSlot(SessionSlot(*slot), body);
}

void StateTable::SessionClosed(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  if (const std::optional<uint32_t> slot = sessions_.Release(session_id)) {
    StoreWord(SessionSlot(*slot), 0);
  }
}

void StateTable::LeaseGranted(const v1::LeaseState& lease) {
  if (lease.first_segment() >= geometry_.segments ||
      lease.count() > geometry_.segments - lease.first_segment()) {
    return;  // not a run of this pool (the manager hands out only its own)
  }
  RaiseFloor(offsetof(TableHeader, lease_id_floor), lease.id());
  uint8_t* flags = CleanFlags();
  for (uint32_t i = 0; i < lease.count(); ++i) {
    __atomic_fetch_and(&flags[lease.first_segment() + i], static_cast<uint8_t>(~kClean),
                       __ATOMIC_ACQ_REL);
  }
  WriteSlot(LeaseSlot(lease.first_segment()), lease.SerializeAsString());
}

void StateTable::LeaseReleased(uint64_t /*lease_id*/, uint32_t first_segment) {
  if (first_segment >= geometry_.segments) return;
  StoreWord(LeaseSlot(first_segment), 0);
}

void StateTable::SegmentsRenewed(uint32_t first, uint32_t count) {
  uint8_t* flags = CleanFlags();
  for (uint32_t i = first; i < geometry_.segments && i - first < count; ++i) {
    __atomic_store_n(&flags[i], static_cast<uint8_t>(kClean | kKept), __ATOMIC_RELEASE);
  }
}

void StateTable::LeasedSegmentsRenewed(uint32_t first, uint32_t count) {
  uint8_t* flags = CleanFlags();
  for (uint32_t i = first; i < geometry_.segments && i - first < count; ++i) {
    __atomic_store_n(&flags[i], kKept, __ATOMIC_RELEASE);
  }
}

void StateTable::SegmentsNotKept(uint32_t first, uint32_t count) {
  uint8_t* flags = CleanFlags();
  for (uint32_t i = first; i < geometry_.segments && i - first < count; ++i) {
    __atomic_store_n(&flags[i], uint8_t{0}, __ATOMIC_RELEASE);
  }
}

void StateTable::ObjectHandleIssued(uint64_t handle) {
  RaiseFloor(offsetof(TableHeader, object_handle_floor), handle);
}

void StateTable::SpillFileKept(const v1::SpillFileState& file, int /*fd*/) {
  const std::string body = file.SerializeAsString();  // fd unset (StateJournal)
  RaiseFloor(offsetof(TableHeader, spill_id_floor), file.id());
  absl::MutexLock lock(&mu_);
  const std::optional<uint32_t> slot =
      body.size() <= kSpillBodyBytes ? spills_.Assign(file.id()) : std::nullopt;
  if (!slot.has_value()) {
    if (!spill_slots_full_logged_ && geometry_.spill_slots > 0) {
      spdlog::warn(
          "state table: all {} spill file slots are in use; spill file {} (and others until "
          "slots free up) will not survive a crash",
          geometry_.spill_slots, file.id());
      spill_slots_full_logged_ = true;
    }
    return;
  }
  WriteSlot(SpillSlot(*slot), body);
}

void StateTable::SpillFileGone(uint64_t spill_id) {
  absl::MutexLock lock(&mu_);
  if (const std::optional<uint32_t> slot = spills_.Release(spill_id)) {
    StoreWord(SpillSlot(*slot), 0);
  }
}

void StateTable::ObjectStored(const v1::ObjectState& object) {
  const std::string body = object.SerializeAsString();
  absl::MutexLock lock(&mu_);
  const std::optional<uint32_t> slot =
      body.size() <= kObjectBodyBytes ? objects_.Assign(object.handle()) : std::nullopt;
  if (!slot.has_value()) {
    // A moved object whose new record does not fit (a longer spill id or
    // offset): its old record would name what it left, so it goes.
    if (const std::optional<uint32_t> old = objects_.Release(object.handle())) {
      StoreWord(ObjectSlot(*old), 0);
    }
    if (!object_slots_full_logged_) {
      spdlog::warn(
          "state table: no slot for inline object {} ({} of {} slots in use, or a shape of {} "
          "dimensions); it (and others until slots free up) will not survive a crash",
          object.handle(), objects_.slot_of.size(), geometry_.object_slots, object.shape_size());
      object_slots_full_logged_ = true;
    }
    return;
  }
  // The high-water mark first: a recovery reads the slots below it.
  auto* used = &HeaderOf(base_)->object_slots_used;
  if (__atomic_load_n(used, __ATOMIC_ACQUIRE) < objects_.fresh) {
    __atomic_store_n(used, uint64_t{objects_.fresh}, __ATOMIC_RELEASE);
  }
  WriteSlot(ObjectSlot(*slot), body);
}

void StateTable::ObjectGone(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  if (const std::optional<uint32_t> slot = objects_.Release(handle)) {
    StoreWord(ObjectSlot(*slot), 0);
  }
}

}  // namespace actstash::server
