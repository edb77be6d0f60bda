#include "client/store/local_store.h"

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace actstash::client_internal {
namespace {

absl::Status DeviceTierError(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what,
                   ": buffers of the device tier are device memory; copy them with a CUDA "
                   "engine (Reserve/Locate)"));
}

// Host leases stay mapped (the daemon renews its pages, this mapping keeps
// the old ones) unless the daemon frees them for a session that did not
// attach again; device segments are zeroed and granted again in place.
absl::Status Lost(const LeaseBackend& backend, bool device_tier) {
  return backend.GoneError(
      "Store", device_tier ? "this session and its leases are gone, and so are its buffers in "
                             "the daemon's device pool (the daemon reclaims that memory)"
               : backend.MemoryReclaimedWhenLost()
                   ? "this session and its leases are gone; new buffers cannot be stored, and "
                     "those stored before are the restarted daemon's to free"
                   : "this session and its leases are gone; buffers stored before can "
                     "still be fetched, new ones cannot be stored");
}

}  // namespace

LocalStore::LocalStore(LeaseBackend* backend, uint64_t segment_bytes, uint32_t lease_batch,
                       PinnedRegistrar* registrar, bool require_pinned, uint32_t restore_ahead,
                       std::chrono::milliseconds pool_wait, std::chrono::milliseconds retain)
    : leases_(backend, &table_, segment_bytes,
              std::make_unique<HostLeaseMapper>(segment_bytes, registrar, require_pinned)),
      retention_(&table_, &leases_, lease_batch,
                 registrar != nullptr ? retain : std::chrono::milliseconds(0)),
      spiller_(&table_, &leases_, &retention_, restore_ahead, pool_wait) {}

LocalStore::LocalStore(LeaseBackend* backend, uint64_t segment_bytes, uint32_t lease_batch,
                       DeviceImporter* importer)
    : leases_(backend, &table_, segment_bytes, std::make_unique<DeviceLeaseMapper>(importer)),
      retention_(&table_, &leases_, lease_batch, std::chrono::milliseconds(0)),
      spiller_(&table_, &leases_, &retention_, /*restore_ahead=*/0, std::chrono::milliseconds(0)) {}

LocalStore::~LocalStore() {
  spiller_.Stop();  // their threads use the arenas
  retention_.Stop();
  leases_.UnmapAll();
}

absl::StatusOr<uint64_t> LocalStore::GiveForOthers(uint64_t bytes) {
  if (leases_.mapper().on_device()) return 0;
  ArenaLeases::Turn turn(&leases_);
  const uint64_t retained = retention_.GiveBackRetained();
  uint64_t given = retained;
  absl::Status status;
  if (retained < bytes) {
    absl::StatusOr<uint64_t> spilled = spiller_.SpillForOthers(bytes - retained, turn);
    if (spilled.ok()) given += *spilled;
    status = spilled.status();
  }
  absl::MutexLock lock(&table_.mu());
  v1::ClientUsage& usage = table_.usage();
  usage.set_reclaims_answered(usage.reclaims_answered() + 1);
  usage.set_reclaim_bytes_given(usage.reclaim_bytes_given() + given);
  if (!status.ok()) return status;
  return given;
}

absl::StatusOr<uint64_t> LocalStore::Store(const void* src, size_t nbytes) {
  if (nbytes > 0 && src == nullptr) {
    return absl::InvalidArgumentError("Store: null source with a non-zero size");
  }
  if (leases_.mapper().on_device()) return DeviceTierError("Store");
  absl::StatusOr<Placed> placed = Reserve(nbytes);
  if (!placed.ok()) return placed.status();
  if (nbytes > 0) std::memcpy(placed->data, src, nbytes);
  (void)MarkWritten(placed->ticket);
  return placed->ticket;
}

absl::Status LocalStore::MarkWritten(uint64_t ticket) {
  absl::MutexLock lock(&table_.mu());
  return table_.MarkWritten(ticket);
}

absl::Status LocalStore::CheckNotReclaimed(uint64_t ticket, absl::string_view what) const {
  const LeaseBackend& backend = leases_.backend();
  if (!backend.Lost()) return absl::OkStatus();
  if (leases_.mapper().on_device()) {
    // Unlike host leases (renewal gives the daemon fresh pages; the old ones
    // stay with this mapping), device segments are zeroed and granted again
    // in place: the bytes are gone, and the range may be another session's.
    return backend.GoneError(
        absl::StrCat(what, " ticket ", ticket),
        "the ticket was in the daemon's device pool, which has reclaimed that memory");
  }
  if (backend.MemoryReclaimedWhenLost()) {
    // The daemon restarted (or will) with its state and frees the leases of
    // a session that does not attach again: this mapping's pages may be gone.
    return backend.GoneError(
        absl::StrCat(what, " ticket ", ticket),
        "the ticket's leased memory is the restarted daemon's to free, since this session did "
        "not attach again");
  }
  return absl::OkStatus();
}

absl::Status LocalStore::Park(uint64_t ticket) {
  absl::MutexLock lock(&table_.mu());
  return table_.Park(ticket);
}

absl::StatusOr<Located> LocalStore::Locate(uint64_t ticket, ReadKind kind) {
  const bool on_device = leases_.mapper().on_device();
  if (absl::Status s = CheckNotReclaimed(ticket, "Locate"); !s.ok()) return s;
  absl::StatusOr<Placement> placement = spiller_.PinForRead(ticket, /*locate=*/true, kind);
  if (!placement.ok()) return placement.status();
  absl::MutexLock lock(&table_.mu());
  const Arena& arena = *placement->block->arena;  // pinned: stays until Release
  return Located{arena.base + placement->offset, placement->size, arena.pinned, on_device};
}

LocalStore::Spot LocalStore::AddTicket(const Placement& placement) {
  const uint64_t ticket = table_.AddTicket(placement);
  return Spot{ticket, placement.block->arena, placement.offset};  // unwritten: cannot spill
}

absl::StatusOr<Placed> LocalStore::Reserve(size_t nbytes) {
  LeaseBackend& backend = leases_.backend();
  if (backend.Lost()) return Lost(backend, leases_.mapper().on_device());
  absl::StatusOr<Spot> spot =
      nbytes > leases_.segment_bytes() ? PlaceDedicated(nbytes) : PlaceShared(nbytes);
  if (!spot.ok()) return spot.status();
  Arena* arena = spot->arena;
  if (!arena->pinned && leases_.mapper().registers()) leases_.MaybePinLate(arena);
  return Placed{spot->ticket, arena->base + spot->offset, arena->pinned,
                leases_.mapper().on_device()};
}

absl::StatusOr<LocalStore::Spot> LocalStore::PlaceShared(size_t nbytes) {
  Placement placement;
  {
    absl::MutexLock lock(&table_.mu());
    if (table_.TryPlace(nbytes, &placement)) return AddTicket(placement);
  }
  // Slow path: lease more segments. One thread leases; the others wait for
  // its turn to end and then find room in what it mapped.
  ArenaLeases::Turn turn(&leases_);
  std::vector<std::unique_ptr<Arena>> fresh;
  bool leased = false;
  bool spilled = false;  // the last round spilled instead of leasing
  for (;;) {
    {
      absl::MutexLock lock(&table_.mu());
      for (std::unique_ptr<Arena>& arena : fresh) table_.Adopt(std::move(arena));
      fresh.clear();
      if (table_.TryPlace(nbytes, &placement)) return AddTicket(placement);
      if (leased && !spilled) {  // only if a segment cannot hold nbytes after alignment
        return absl::InternalError("Store: a fresh segment could not place the buffer");
      }
    }
    if (spilled) leases_.GiveBackEmpty([](const Arena& a) { return !a.dedicated; });
    absl::StatusOr<std::vector<std::unique_ptr<Arena>>> arenas =
        spiller_.LeaseOrSpill(retention_.lease_batch(), 1, /*dedicated=*/false, turn);
    if (!arenas.ok()) return arenas.status();
    fresh = *std::move(arenas);
    leased = true;
    spilled = fresh.empty();
  }
}

absl::StatusOr<LocalStore::Spot> LocalStore::PlaceDedicated(size_t nbytes) {
  const uint64_t segment_bytes = leases_.segment_bytes();
  const uint64_t segments = (nbytes + segment_bytes - 1) / segment_bytes;
  if (segments > UINT32_MAX) return absl::ResourceExhaustedError("Store: buffer too large");
  const uint64_t want = segments * segment_bytes;
  ArenaLeases::Turn turn(&leases_);
  const auto now = std::chrono::steady_clock::now();
  leases_.GiveBackEmpty([this, want, now](const Arena& a) {
    return !a.dedicated || a.bytes == want || retention_.Retained(a, now);
  });
  for (;;) {
    {
      absl::MutexLock lock(&table_.mu());
      if (Arena* spare = SpareDedicated(want)) {
        return AddTicket(table_.PlaceIn(spare, nbytes));
      }
    }
    absl::StatusOr<std::vector<std::unique_ptr<Arena>>> arenas =
        spiller_.LeaseOrSpill(1, static_cast<uint32_t>(segments), /*dedicated=*/true, turn);
    if (!arenas.ok()) return arenas.status();
    if (arenas->empty()) {
      // Spilling freed memory: leases that cannot hold this buffer go back,
      // so that the daemon can grant one that does.
      leases_.GiveBackEmpty([want](const Arena& a) { return a.dedicated && a.bytes == want; });
      continue;
    }
    absl::MutexLock lock(&table_.mu());
    Arena* arena = arenas->front().get();
    table_.Adopt(std::move(arenas->front()));
    return AddTicket(table_.PlaceIn(arena, nbytes));
  }
}

absl::Status LocalStore::Fetch(uint64_t ticket, void* dst, size_t capacity) {
  if (leases_.mapper().on_device()) return DeviceTierError("Fetch");
  if (absl::Status s = CheckNotReclaimed(ticket, "Fetch"); !s.ok()) return s;
  {
    absl::MutexLock lock(&table_.mu());
    absl::StatusOr<Placement*> placement = table_.Find(ticket);
    if (placement.ok() && (*placement)->size > capacity) {
      return absl::OutOfRangeError(absl::StrCat("ticket ", ticket, " holds ", (*placement)->size,
                                                " bytes; the buffer holds ", capacity));
    }
  }
  absl::StatusOr<Placement> placement = spiller_.PinForRead(ticket, /*locate=*/false);
  if (!placement.ok()) return placement.status();
  const std::byte* data = nullptr;
  {
    absl::MutexLock lock(&table_.mu());
    data = placement->block->arena->base + placement->offset;
  }
  if (placement->size > 0) std::memcpy(dst, data, placement->size);
  absl::MutexLock lock(&table_.mu());
  placement->block->pins -= 1;  // the ticket keeps the block alive
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> LocalStore::Size(uint64_t ticket) const {
  absl::MutexLock lock(&table_.mu());
  absl::StatusOr<const Placement*> placement = table_.Find(ticket);
  if (!placement.ok()) return placement.status();
  return (*placement)->size;
}

LocalStore::Arena* LocalStore::SpareDedicated(uint64_t bytes) {
  for (const std::unique_ptr<Arena>& arena : table_.arenas()) {
    if (arena->dedicated && arena->bytes == bytes && BlockTable::Empty(*arena)) return arena.get();
  }
  return nullptr;
}

absl::Status LocalStore::Release(uint64_t ticket) {
  std::unique_ptr<Arena> give_back;
  uint64_t drop_spill = 0;
  {
    absl::MutexLock lock(&table_.mu());
    absl::StatusOr<Placement> placement = table_.Remove(ticket);
    if (!placement.ok()) return placement.status();
    Block* block = placement->block;
    if (!block->allocator.empty()) return absl::OkStatus();
    switch (block->state) {
      case Residence::kSpilled:  // nothing of it is needed any more
        drop_spill = block->spill_id;
        table_.DeleteBlock(block);
        break;
      case Residence::kLost:
        table_.DeleteBlock(block);
        break;
      case Residence::kSpilling:
      case Residence::kRestoring:
        break;  // the spill or read-back in flight sees it empty when done
      case Residence::kResident:
        if (block->pins > 0) break;  // a copy in progress; the lease stays
        if (Arena* back = retention_.OnEmptied(table_.arenas(), block->arena)) {
          give_back = table_.Detach(back);
        }
        break;
    }
  }
  if (give_back != nullptr) leases_.GiveBack(std::move(give_back));
  if (drop_spill != 0) (void)leases_.backend().DropSpilled(absl::MakeConstSpan(&drop_spill, 1));
  return absl::OkStatus();
}

void AddUsage(const v1::ClientUsage& from, v1::ClientUsage* to) {
  const google::protobuf::Descriptor* descriptor = v1::ClientUsage::descriptor();
  const google::protobuf::Reflection* reflection = v1::ClientUsage::GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    ACTSTASH_CHECK(field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT64 &&
                       !field->is_repeated(),
                   "ClientUsage holds only uint64 counters");
    reflection->SetUInt64(to, field,
                          reflection->GetUInt64(*to, field) + reflection->GetUInt64(from, field));
  }
}

v1::ClientUsage LocalStore::usage() const {
  absl::MutexLock lock(&table_.mu());
  return table_.usage();
}

absl::Status LocalStore::pin_status() const { return leases_.pin_status(); }

}  // namespace actstash::client_internal
