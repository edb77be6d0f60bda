#include "server/handover/state_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/errno_status.h"
#include "common/tiered_id.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMagic = 0x4c42415453544341;  // "ACTSTABL", little-endian
constexpr size_t kHeaderBytes = 4096;
// A floor is raised this far past the id that reached it: one table write
// per this many ids.
constexpr uint64_t kFloorStep = 1 << 16;
// Floors are not checksummed (single words): one beyond this is damage.
constexpr uint64_t kMaxFloor = uint64_t{1} << 56;
// Per-segment flag bits.
constexpr uint8_t kClean = 1;  // free, and its memfd fresh: no client mapped it
constexpr uint8_t kKept = 2;   // the service manager holds its current memfd

struct TableHeader {
  uint64_t magic = kMagic;
  uint32_t format = kTableFormat;
  uint32_t session_slots = 0;
  uint64_t segment_bytes = 0;
  uint32_t segments = 0;
  uint32_t spill_slots = 0;
  uint64_t checksum = 0;  // XXH3 of the fields above
  // Not checksummed: single words, each stored atomically.
  uint64_t retired = 0;
  uint64_t restarts = 0;
  uint64_t session_id_floor = 1;
  uint64_t lease_id_floor = 0;
  uint64_t object_handle_floor = 1;
  uint64_t spill_id_floor = 1;
};
constexpr size_t kChecksummedBytes = offsetof(TableHeader, checksum);
static_assert(sizeof(TableHeader) <= kHeaderBytes);

struct SlotHeader {
  uint64_t word = 0;  // 0: free; else body bytes << 1 | 1
  uint64_t checksum = 0;
};
constexpr size_t kSessionBodyBytes = kSessionSlotBytes - sizeof(SlotHeader);
constexpr size_t kLeaseBodyBytes = kLeaseSlotBytes - sizeof(SlotHeader);
constexpr size_t kSpillBodyBytes = kSpillSlotBytes - sizeof(SlotHeader);

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t CleanOffset() { return kHeaderBytes; }
size_t SessionsOffset(const TableGeometry& g) { return RoundUp(CleanOffset() + g.segments, 64); }
size_t LeasesOffset(const TableGeometry& g) {
  return SessionsOffset(g) + size_t{g.session_slots} * kSessionSlotBytes;
}
size_t SpillsOffset(const TableGeometry& g) {
  return LeasesOffset(g) + size_t{g.segments} * kLeaseSlotBytes;
}

uint64_t HeaderChecksum(const TableHeader& header) { return Xxh3(&header, kChecksummedBytes); }

uint64_t LoadWord(const std::byte* at) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(at), __ATOMIC_ACQUIRE);
}
void StoreWord(std::byte* at, uint64_t value) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(at), value, __ATOMIC_RELEASE);
}

// Writes `body` into the free-or-overwritten slot at `slot` and publishes it.
// A slot that holds `body` already is left alone (recovery rewrites what it
// read: a crash then must not find it free).
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

// The body of the used slot at `slot`, or "" for a free one; DATA_LOSS for
// a damaged one.
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

TableHeader* HeaderOf(std::byte* base) { return reinterpret_cast<TableHeader*>(base); }

// Maps `fd` (of `bytes`) shared, read-write.
absl::StatusOr<std::byte*> MapTable(int fd, size_t bytes) {
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (at == MAP_FAILED) return ErrnoStatus("mapping the state table", errno);
  return static_cast<std::byte*>(at);
}

}  // namespace

size_t StateTableBytes(const TableGeometry& geometry) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return RoundUp(SpillsOffset(geometry) + size_t{geometry.spill_slots} * kSpillSlotBytes, page);
}

StateTable::StateTable(UniqueFd fd, std::byte* base, size_t bytes, const TableGeometry& geometry)
    : fd_(std::move(fd)), base_(base), bytes_(bytes), geometry_(geometry) {}

StateTable::~StateTable() { munmap(base_, bytes_); }

absl::StatusOr<std::unique_ptr<StateTable>> StateTable::Create(const TableGeometry& geometry) {
  const size_t bytes = StateTableBytes(geometry);
  UniqueFd fd(memfd_create("actstash-state-table", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus("memfd_create for the state table", errno);
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus("sizing the state table", errno);
  }
  // A mapped file that shrinks faults its reader: no one may resize it.
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus("sealing the state table's size", errno);
  }
  absl::StatusOr<std::byte*> base = MapTable(fd.get(), bytes);
  if (!base.ok()) return base.status();
  TableHeader header;
  header.session_slots = geometry.session_slots;
  header.segment_bytes = geometry.segment_bytes;
  header.segments = geometry.segments;
  header.spill_slots = geometry.spill_slots;
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
  return table;
}

absl::StatusOr<std::unique_ptr<StateTable>> StateTable::Recover(UniqueFd fd,
                                                                const TableGeometry& geometry,
                                                                RecoveredState* out) {
  const size_t bytes = StateTableBytes(geometry);
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat of the state table", errno);
  const int seals = fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        "the passed state table is not a sealed memfd (another program's fd of that name?)");
  }
  if (static_cast<uint64_t>(st.st_size) < sizeof(TableHeader)) {
    return absl::DataLossError(absl::StrCat("the state table is ", st.st_size, " bytes"));
  }
  TableHeader header;
  if (pread(fd.get(), &header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header))) {
    return ErrnoStatus("reading the state table's header", errno);
  }
  if (header.magic != kMagic || header.checksum != HeaderChecksum(header)) {
    return absl::DataLossError("the state table's header fails its checksum");
  }
  if (header.format != kTableFormat) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the state table is of format ", header.format, "; this actstashd reads ", kTableFormat));
  }
  if (header.segment_bytes != geometry.segment_bytes || header.segments != geometry.segments ||
      header.session_slots != geometry.session_slots ||
      header.spill_slots != geometry.spill_slots) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the state table is of a pool of ", header.segments, " segments of ", header.segment_bytes,
        " bytes with ", header.session_slots, " sessions and ", header.spill_slots,
        " spill files; this one is configured for ", geometry.segments, " of ",
        geometry.segment_bytes, " with ", geometry.session_slots, " and ", geometry.spill_slots,
        " (the configuration changed)"));
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return absl::DataLossError(
        absl::StrCat("the state table is ", st.st_size, " bytes, not ", bytes));
  }
  if (header.retired != 0) {
    return absl::FailedPreconditionError("the previous actstashd shut down cleanly");
  }
  absl::StatusOr<std::byte*> base = MapTable(fd.get(), bytes);
  if (!base.ok()) return base.status();
  std::unique_ptr<StateTable> table(new StateTable(std::move(fd), *base, bytes, geometry));

  RecoveredState state;
  state.restarts = header.restarts;
  state.next_session_id = header.session_id_floor;
  state.next_lease_id = header.lease_id_floor;
  state.next_object_handle = header.object_handle_floor;
  state.next_spill_id = header.spill_id_floor;
  if (header.session_id_floor > kMaxFloor || header.lease_id_floor > kMaxFloor ||
      header.object_handle_floor > kMaxFloor || header.spill_id_floor > kMaxFloor) {
    return absl::DataLossError("the state table's id floors are damaged");
  }
  const uint8_t* flags = table->CleanFlags();
  for (uint32_t i = 0; i < geometry.segments; ++i) {
    if ((flags[i] & ~(kClean | kKept)) != 0) {
      return absl::DataLossError(absl::StrCat("segment ", i, "'s flags are damaged"));
    }
    state.clean.push_back((flags[i] & kClean) != 0 && (flags[i] & kKept) != 0);
    state.kept.push_back((flags[i] & kKept) != 0);
  }
  absl::flat_hash_set<std::string> tokens;
  SlotIndex sessions;  // the table's, once all is read
  for (uint32_t i = geometry.session_slots; i > 0; --i) {
    const uint32_t slot = i - 1;
    absl::StatusOr<std::string> body =
        ReadSlot(table->SessionSlot(slot), kSessionBodyBytes, "session", slot);
    if (!body.ok()) return body.status();
    if (body->empty()) {
      sessions.free.push_back(slot);
      continue;
    }
    v1::SessionState session;
    if (!session.ParseFromString(*body) || session.id() == 0 || session.id() > kMaxFloor ||
        session.token().empty() || !sessions.slot_of.emplace(session.id(), slot).second ||
        !tokens.insert(session.token()).second) {
      return absl::DataLossError(absl::StrCat("the state table's session slot ", slot,
                                              " holds no session, or one that repeats"));
    }
    state.sessions.push_back(std::move(session));
  }
  absl::flat_hash_set<uint64_t> lease_ids;
  uint32_t covered_to = 0;  // runs are in segment order: each starts at or after it
  for (uint32_t i = 0; i < geometry.segments; ++i) {
    absl::StatusOr<std::string> body = ReadSlot(table->LeaseSlot(i), kLeaseBodyBytes, "lease", i);
    if (!body.ok()) return body.status();
    if (body->empty()) continue;
    v1::LeaseState lease;
    if (!lease.ParseFromString(*body) || lease.first_segment() != i || lease.count() == 0 ||
        uint64_t{i} + lease.count() > geometry.segments || i < covered_to ||
        tiered_id::TierOf(lease.id()) != 0 || tiered_id::IsInline(lease.id()) ||
        tiered_id::SerialOf(lease.id()) == 0 || lease.id() > kMaxFloor ||
        !lease_ids.insert(lease.id()).second) {
      return absl::DataLossError(
          absl::StrCat("the state table's lease slot ", i,
                       " holds no lease, or one that overlaps another or leaves the pool"));
    }
    covered_to = i + lease.count();
    if (!sessions.slot_of.contains(lease.session_id())) {
      // Its session was closing when the daemon died (the session's slot
      // goes first): the lease goes too. Its segments are not clean.
      StoreWord(table->LeaseSlot(i), 0);
      continue;
    }
    state.next_lease_id = std::max(state.next_lease_id, lease.id() + 1);
    state.leases.push_back(std::move(lease));
  }
  SlotIndex spills;
  for (uint32_t i = geometry.spill_slots; i > 0; --i) {
    const uint32_t slot = i - 1;
    absl::StatusOr<std::string> body =
        ReadSlot(table->SpillSlot(slot), kSpillBodyBytes, "spill file", slot);
    if (!body.ok()) return body.status();
    if (body->empty()) {
      spills.free.push_back(slot);
      continue;
    }
    v1::SpillFileState file;
    if (!file.ParseFromString(*body) || file.id() == 0 || file.id() > kMaxFloor ||
        file.bytes() == 0 || !spills.slot_of.emplace(file.id(), slot).second) {
      return absl::DataLossError(absl::StrCat("the state table's spill file slot ", slot,
                                              " holds no file, or one that repeats"));
    }
    state.next_spill_id = std::max(state.next_spill_id, file.id() + 1);
    if (!sessions.slot_of.contains(file.session_id())) {  // its session was closing, as a lease's
      StoreWord(table->SpillSlot(slot), 0);
      spills.Release(file.id());
      continue;
    }
    state.spill_files.push_back(std::move(file));
  }
  for (const v1::SessionState& session : state.sessions) {
    state.next_session_id = std::max(state.next_session_id, session.id() + 1);
  }
  {
    absl::MutexLock lock(&table->mu_);
    table->sessions_ = std::move(sessions);
    table->spills_ = std::move(spills);
  }
  __atomic_store_n(&HeaderOf(table->base_)->restarts, header.restarts + 1, __ATOMIC_RELEASE);
  *out = std::move(state);
  return table;
}

void StateTable::SlotIndex::Reset(uint32_t count) {
  slot_of.clear();
  free.clear();
  for (uint32_t i = count; i > 0; --i) free.push_back(i - 1);
}

std::optional<uint32_t> StateTable::SlotIndex::Assign(uint64_t id) {
  if (auto it = slot_of.find(id); it != slot_of.end()) return it->second;
  if (free.empty()) return std::nullopt;
  const uint32_t slot = free.back();
  free.pop_back();
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

}  // namespace actstash::server
