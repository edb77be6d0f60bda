// StateTable::Recover: reading back the table a daemon that crashed left,
// and checking that its slots agree with one another.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/tiered_id.h"
#include "server/restart/state_table.h"
#include "server/restart/state_table_layout.h"

namespace actstash::server {

using table_layout::HeaderChecksum;
using table_layout::HeaderOf;
using table_layout::kClean;
using table_layout::kKept;
using table_layout::kLeaseBodyBytes;
using table_layout::kMagic;
using table_layout::kMaxFloor;
using table_layout::kObjectBodyBytes;
using table_layout::kSessionBodyBytes;
using table_layout::kSpillBodyBytes;
using table_layout::MapTable;
using table_layout::ReadSlot;
using table_layout::StoreWord;
using table_layout::TableHeader;

namespace {

// A used slot's record, its id and where it is.
template <typename Record>
struct Slotted {
  Record record;
  uint64_t id = 0;
  uint32_t slot = 0;
};

// Reads the first `used` slots of a region, last first: `free` gets the free
// ones (the lowest last, as StateTable::SlotIndex hands them out), the
// result the used ones' records. `id_of` gives a record's id when it is well
// formed, else 0. DATA_LOSS for a damaged slot, a record that does not parse
// or check out, or an id that repeats.
template <typename Record>
absl::StatusOr<std::vector<Slotted<Record>>> ReadRegion(
    uint32_t used, absl::FunctionRef<const std::byte*(uint32_t)> slot_at, size_t capacity,
    const char* what, absl::FunctionRef<uint64_t(const Record&)> id_of,
    std::vector<uint32_t>* free) {
  std::vector<Slotted<Record>> records;
  absl::flat_hash_set<uint64_t> ids;
  for (uint32_t i = used; i > 0; --i) {
    const uint32_t slot = i - 1;
    absl::StatusOr<std::string> body = ReadSlot(slot_at(slot), capacity, what, slot);
    if (!body.ok()) return body.status();
    if (body->empty()) {
      free->push_back(slot);
      continue;
    }
    Slotted<Record> read;
    read.slot = slot;
    if (!read.record.ParseFromString(*body) || (read.id = id_of(read.record)) == 0 ||
        !ids.insert(read.id).second) {
      return absl::DataLossError(absl::StrCat("the state table's ", what, " slot ", slot,
                                              " holds no ", what, ", or one that repeats"));
    }
    records.push_back(std::move(read));
  }
  return records;
}

// Of the records read, keeps those whose session came back (in
// `live_sessions`): `slot_of` gets their slots by id and `kept` the records.
// The others' sessions were closing when the daemon died (a session's slot
// goes first): their slots are cleared and go to `free`, as a lease's do.
// Every id read raises `*next_id` past it.
template <typename Record>
void KeepThoseOfLiveSessions(std::vector<Slotted<Record>> read,
                             const absl::flat_hash_map<uint64_t, uint32_t>& live_sessions,
                             absl::FunctionRef<std::byte*(uint32_t)> slot_at,
                             absl::flat_hash_map<uint64_t, uint32_t>* slot_of,
                             std::vector<uint32_t>* free, std::vector<Record>* kept,
                             uint64_t* next_id) {
  for (Slotted<Record>& one : read) {
    *next_id = std::max(*next_id, one.id + 1);
    if (!live_sessions.contains(one.record.session_id())) {
      StoreWord(slot_at(one.slot), 0);
      free->push_back(one.slot);
      continue;
    }
    (*slot_of)[one.id] = one.slot;
    kept->push_back(std::move(one.record));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateTable>> StateTable::Recover(UniqueFd fd,
                                                                const TableGeometry& geometry,
                                                                RecoveredState* out,
                                                                bool count_restart) {
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
      header.spill_slots != geometry.spill_slots || header.object_slots != geometry.object_slots) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the state table is of a pool of ", header.segments, " segments of ", header.segment_bytes,
        " bytes with ", header.session_slots, " sessions, ", header.spill_slots,
        " spill files and ", header.object_slots, " objects; this one is configured for ",
        geometry.segments, " of ", geometry.segment_bytes, " with ", geometry.session_slots, ", ",
        geometry.spill_slots, " and ", geometry.object_slots, " (the configuration changed)"));
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
      header.object_handle_floor > kMaxFloor || header.spill_id_floor > kMaxFloor ||
      header.object_slots_used > geometry.object_slots) {
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
  sessions.fresh = sessions.count = geometry.session_slots;
  absl::StatusOr<std::vector<Slotted<v1::SessionState>>> sessions_read =
      ReadRegion<v1::SessionState>(
          geometry.session_slots, [&](uint32_t slot) { return table->SessionSlot(slot); },
          kSessionBodyBytes, "session",
          [&](const v1::SessionState& session) -> uint64_t {
            return session.id() <= kMaxFloor && !session.token().empty() &&
                           tokens.insert(session.token()).second
                       ? session.id()
                       : 0;
          },
          &sessions.free);
  if (!sessions_read.ok()) return sessions_read.status();
  for (Slotted<v1::SessionState>& read : *sessions_read) {
    sessions.slot_of[read.id] = read.slot;
    state.sessions.push_back(std::move(read.record));
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
  spills.fresh = spills.count = geometry.spill_slots;
  absl::StatusOr<std::vector<Slotted<v1::SpillFileState>>> spills_read =
      ReadRegion<v1::SpillFileState>(
          geometry.spill_slots, [&](uint32_t slot) { return table->SpillSlot(slot); },
          kSpillBodyBytes, "spill file",
          [](const v1::SpillFileState& file) -> uint64_t {
            return file.id() <= kMaxFloor && file.bytes() > 0 ? file.id() : 0;
          },
          &spills.free);
  if (!spills_read.ok()) return spills_read.status();
  KeepThoseOfLiveSessions(
      *std::move(spills_read), sessions.slot_of,
      [&](uint32_t slot) { return table->SpillSlot(slot); }, &spills.slot_of, &spills.free,
      &state.spill_files, &state.next_spill_id);
  // Objects: only the slots ever used (the rest of the region was never
  // touched, and reading it would make the kernel back it with pages).
  SlotIndex objects;
  objects.count = geometry.object_slots;
  objects.fresh = static_cast<uint32_t>(header.object_slots_used);
  absl::StatusOr<std::vector<Slotted<v1::ObjectState>>> objects_read = ReadRegion<v1::ObjectState>(
      objects.fresh, [&](uint32_t slot) { return table->ObjectSlot(slot); }, kObjectBodyBytes,
      "object",
      [](const v1::ObjectState& object) -> uint64_t {
        return object.handle() <= kMaxFloor &&
                       object.residence_case() != v1::ObjectState::RESIDENCE_NOT_SET
                   ? object.handle()
                   : 0;
      },
      &objects.free);
  if (!objects_read.ok()) return objects_read.status();
  KeepThoseOfLiveSessions(
      *std::move(objects_read), sessions.slot_of,
      [&](uint32_t slot) { return table->ObjectSlot(slot); }, &objects.slot_of, &objects.free,
      &state.objects, &state.next_object_handle);
  for (const v1::SessionState& session : state.sessions) {
    state.next_session_id = std::max(state.next_session_id, session.id() + 1);
  }
  {
    absl::MutexLock lock(&table->mu_);
    table->sessions_ = std::move(sessions);
    table->spills_ = std::move(spills);
    table->objects_ = std::move(objects);
  }
  if (count_restart) {
    __atomic_store_n(&HeaderOf(table->base_)->restarts, header.restarts + 1, __ATOMIC_RELEASE);
  }
  *out = std::move(state);
  return table;
}

absl::StatusOr<std::unique_ptr<StateTable>> StateTable::Copy(int fd, const TableGeometry& geometry,
                                                             RecoveredState* out) {
  const size_t bytes = StateTableBytes(geometry);
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoStatus("fstat of the handed state table", errno);
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return absl::FailedPreconditionError(absl::StrCat("the handed state table is ", st.st_size,
                                                      " bytes; one of this daemon's is ", bytes,
                                                      " (the configuration changed)"));
  }
  absl::StatusOr<UniqueFd> copy = NewTableFd(bytes);
  if (!copy.ok()) return copy.status();
  // Only the ranges with data: most of a table is holes, never written.
  std::vector<char> buffer(1 << 20);
  off_t at = 0;
  while (static_cast<size_t>(at) < bytes) {
    const off_t data = lseek(fd, at, SEEK_DATA);
    if (data < 0 && errno == ENXIO) break;  // nothing but holes from here
    if (data < 0) return ErrnoStatus("seeking the handed state table's data", errno);
    off_t hole = lseek(fd, data, SEEK_HOLE);
    if (hole < 0) return ErrnoStatus("seeking the handed state table's holes", errno);
    hole = std::min<off_t>(hole, static_cast<off_t>(bytes));
    for (at = data; at < hole;) {
      const size_t chunk = std::min<size_t>(buffer.size(), static_cast<size_t>(hole - at));
      const ssize_t n = pread(fd, buffer.data(), chunk, at);
      if (n <= 0) return ErrnoStatus("reading the handed state table", n < 0 ? errno : EIO);
      if (pwrite(copy->get(), buffer.data(), static_cast<size_t>(n), at) != n) {
        return ErrnoStatus("copying the handed state table", errno);
      }
      at += n;
    }
  }
  return Recover(*std::move(copy), geometry, out, /*count_restart=*/false);
}

}  // namespace actstash::server
