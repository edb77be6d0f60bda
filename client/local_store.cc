#include "client/local_store.h"

#include <algorithm>
#include <cstring>

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
// the old ones); device segments are zeroed and granted again in place.
absl::Status Lost(const LeaseBackend& backend, bool device_tier) {
  return backend.GoneError(
      "Store", device_tier ? "this session and its leases are gone, and so are its buffers in "
                             "the daemon's device pool (the daemon reclaims that memory)"
                           : "this session and its leases are gone; buffers stored before can "
                             "still be fetched, new ones cannot be stored");
}

}  // namespace

absl::Status LeaseBackend::GoneError(absl::string_view what, absl::string_view consequence) const {
  return absl::UnavailableError(
      absl::StrCat(what, ": actstashd went away (its attach connection closed): ", consequence));
}

LocalStore::LocalStore(LeaseBackend* backend, uint64_t segment_bytes, uint32_t lease_batch,
                       PinnedRegistrar* registrar, bool require_pinned, uint32_t restore_ahead,
                       std::chrono::milliseconds pool_wait, std::chrono::milliseconds retain)
    : backend_(*backend),
      segment_bytes_(segment_bytes),
      lease_batch_(std::max<uint32_t>(1, lease_batch)),
      mapper_(std::make_unique<HostLeaseMapper>(segment_bytes, registrar, require_pinned)),
      restore_ahead_(restore_ahead),
      pool_wait_(pool_wait),
      retain_(registrar != nullptr ? retain : std::chrono::milliseconds(0)),
      sweeper_(SweepPeriod(retain_), [this] { Sweep(); }) {}

LocalStore::LocalStore(LeaseBackend* backend, uint64_t segment_bytes, uint32_t lease_batch,
                       DeviceImporter* importer)
    : backend_(*backend),
      segment_bytes_(segment_bytes),
      lease_batch_(std::max<uint32_t>(1, lease_batch)),
      mapper_(std::make_unique<DeviceLeaseMapper>(importer)),
      restore_ahead_(0),
      pool_wait_(0),
      retain_(0),
      sweeper_(SweepPeriod(retain_), [this] { Sweep(); }) {}

LocalStore::~LocalStore() {
  read_ahead_.Stop();  // their tasks use the arenas
  sweeper_.Stop();
  absl::MutexLock lock(&mu_);
  for (const std::unique_ptr<Arena>& arena : arenas_) UnmapArena(*arena);
}

absl::StatusOr<std::unique_ptr<LocalStore::Arena>> LocalStore::MapArena(GrantedLease* lease,
                                                                        bool dedicated) {
  const uint64_t bytes = uint64_t{lease->segments} * segment_bytes_;
  absl::StatusOr<MappedLease> mapped = mapper_->Map(lease, bytes);  // closes the fds
  if (!mapped.ok()) return mapped.status();
  auto arena = std::unique_ptr<Arena>(new Arena{lease->lease_id, mapped->base, bytes, dedicated});
  arena->pinned = mapped->pinned;
  arena->pin_tried = mapped->pin_tried;  // not shared yet
  if (!mapped->pin_error.ok()) {
    absl::MutexLock lock(&mu_);
    NotePinFailure(mapped->pin_error);
  }
  return arena;
}

void LocalStore::NotePinFailure(const absl::Status& status) {
  usage_.set_unpinned_leases(usage_.unpinned_leases() + 1);
  if (pin_status_.ok()) {
    pin_status_ =
        absl::Status(status.code(), absl::StrCat("leased memory is not pinned for CUDA (copies are "
                                                 "staged by the driver and slower): ",
                                                 status.message()));
  }
}

void LocalStore::MaybePinLate(Arena* arena) {
  {
    absl::MutexLock lock(&mu_);
    if (arena->pin_tried || !mapper_->CanPinNow()) return;
    arena->pin_tried = true;
  }
  // The caller's buffer in it keeps the arena mapped meanwhile.
  absl::Status status = mapper_->Pin(arena->base, arena->bytes);
  absl::MutexLock lock(&mu_);
  if (status.ok()) {
    arena->pinned = true;
    usage_.set_pinned_bytes(usage_.pinned_bytes() + arena->bytes);
  } else {
    NotePinFailure(status);
  }
}

void LocalStore::UnmapArena(const Arena& arena) {
  mapper_->Unmap(arena.base, arena.bytes, arena.pinned);
}

bool LocalStore::TryPlace(uint64_t nbytes, Placement* out) {
  const size_t n = arenas_.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (hint_ + k) % n;
    Arena* arena = arenas_[i].get();
    Block* block = arena->block;
    if (arena->dedicated || block->state != Block::State::kResident) continue;
    if (std::optional<uint64_t> offset = block->allocator.Allocate(nbytes)) {
      hint_ = i;
      *out = Placement{block, *offset, nbytes};
      return true;
    }
  }
  return false;
}

uint64_t LocalStore::NewTicket(const Placement& placement, uint64_t nbytes) {
  const uint64_t ticket = next_ticket_++;
  Placement placed = placement;
  placed.seq = next_seq_++;
  placed.block->last_seq = placed.seq;
  if (!placed.written) placed.block->unwritten += 1;
  tickets_.emplace(ticket, placed);
  usage_.set_objects(usage_.objects() + 1);
  usage_.set_bytes(usage_.bytes() + nbytes);
  usage_.set_stores(usage_.stores() + 1);
  usage_.set_bytes_stored(usage_.bytes_stored() + nbytes);
  return ticket;
}

absl::StatusOr<std::vector<std::unique_ptr<LocalStore::Arena>>> LocalStore::LeaseArenas(
    uint32_t count, uint32_t segments, bool dedicated) {
  absl::StatusOr<std::vector<GrantedLease>> granted = backend_.Lease(count, segments);
  if (!granted.ok()) return granted.status();
  std::vector<std::unique_ptr<Arena>> arenas;
  absl::Status status;
  std::vector<uint64_t> unmapped;
  for (GrantedLease& lease : *granted) {
    if (!status.ok()) {
      lease.fds.clear();
      unmapped.push_back(lease.lease_id);
      continue;
    }
    absl::StatusOr<std::unique_ptr<Arena>> arena = MapArena(&lease, dedicated);
    if (!arena.ok()) {
      status = arena.status();
      unmapped.push_back(lease.lease_id);
      continue;
    }
    arenas.push_back(*std::move(arena));
  }
  if (!status.ok()) {
    for (const std::unique_ptr<Arena>& arena : arenas) {
      UnmapArena(*arena);
      unmapped.push_back(arena->lease_id);
    }
    (void)backend_.Return(unmapped);
    return status;
  }
  return arenas;
}

absl::StatusOr<uint64_t> LocalStore::Store(const void* src, size_t nbytes) {
  if (nbytes > 0 && src == nullptr) {
    return absl::InvalidArgumentError("Store: null source with a non-zero size");
  }
  if (mapper_->on_device()) return DeviceTierError("Store");
  absl::StatusOr<Placed> placed = Place(nbytes, /*written=*/false);
  if (!placed.ok()) return placed.status();
  if (nbytes > 0) std::memcpy(placed->data, src, nbytes);
  (void)MarkWritten(placed->ticket);
  return placed->ticket;
}

absl::StatusOr<Placed> LocalStore::Reserve(size_t nbytes) {
  return Place(nbytes, /*written=*/false);
}

absl::Status LocalStore::MarkWritten(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown or released ticket ", ticket));
  }
  if (!it->second.written) {
    it->second.written = true;
    it->second.block->unwritten -= 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<Located> LocalStore::Locate(uint64_t ticket) {
  if (mapper_->on_device() && backend_.Lost()) {
    // Unlike host leases (renewal gives the daemon fresh pages; the old ones
    // stay with this mapping), device segments are zeroed and granted again
    // in place: the bytes are gone, and the range may be another session's.
    return backend_.GoneError(
        absl::StrCat("Locate ticket ", ticket),
        "the ticket was in the daemon's device pool, which has reclaimed that memory");
  }
  absl::StatusOr<Placement> placement = PinForRead(ticket, /*locate=*/true);
  if (!placement.ok()) return placement.status();
  absl::MutexLock lock(&mu_);
  const Arena& arena = *placement->block->arena;  // pinned: stays until Release
  return Located{arena.base + placement->offset, placement->size, arena.pinned,
                 mapper_->on_device()};
}

absl::StatusOr<Placed> LocalStore::Place(size_t nbytes, bool written) {
  if (backend_.Lost()) return Lost(backend_, mapper_->on_device());
  Placement placement;
  placement.written = written;
  uint64_t ticket = 0;
  if (nbytes > segment_bytes_) {
    // A dedicated lease of contiguous segments. The last one released is
    // kept as a spare for the next big buffer of the same size (a layer's
    // activations come back every step); others go back on Release.
    const uint64_t segments = (nbytes + segment_bytes_ - 1) / segment_bytes_;
    if (segments > UINT32_MAX) return absl::ResourceExhaustedError("Store: buffer too large");
    const uint64_t want = segments * segment_bytes_;
    absl::MutexLock lease_lock(&lease_mu_);
    const auto now = std::chrono::steady_clock::now();
    GiveBackEmpty([this, want, now](const Arena& a) {
      return !a.dedicated || a.bytes == want || Retained(a, now);
    });
    while (ticket == 0) {
      Arena* arena = nullptr;
      std::vector<std::unique_ptr<Arena>> granted;
      {
        absl::MutexLock lock(&mu_);
        arena = SpareDedicated(want);
      }
      if (arena == nullptr) {
        absl::StatusOr<std::vector<std::unique_ptr<Arena>>> arenas =
            LeaseOrSpill(1, static_cast<uint32_t>(segments), /*dedicated=*/true);
        if (!arenas.ok()) return arenas.status();
        granted = *std::move(arenas);
        if (granted.empty()) {
          // Spilling freed memory: leases that cannot hold this buffer go
          // back, so that the daemon can grant one that does.
          GiveBackEmpty([want](const Arena& a) { return a.dedicated && a.bytes == want; });
          continue;
        }
      }
      absl::MutexLock lock(&mu_);
      if (!granted.empty()) {
        arena = granted.front().get();
        Adopt(std::move(granted.front()));
      }
      const std::optional<uint64_t> offset = arena->block->allocator.Allocate(nbytes);
      placement.block = arena->block;
      placement.offset = offset.value_or(0);
      placement.size = nbytes;
      ticket = NewTicket(placement, nbytes);
    }
  } else {
    mu_.Lock();
    bool placed = TryPlace(nbytes, &placement);
    if (!placed) {
      // Slow path: lease more segments. One thread leases; the others wait
      // for it and then find room in what it mapped.
      mu_.Unlock();
      absl::MutexLock lease_lock(&lease_mu_);
      mu_.Lock();
      placed = TryPlace(nbytes, &placement);
      bool spilled = false;
      while (!placed) {
        mu_.Unlock();
        if (spilled) {
          GiveBackEmpty([](const Arena& a) { return !a.dedicated; });
        }
        absl::StatusOr<std::vector<std::unique_ptr<Arena>>> arenas =
            LeaseOrSpill(lease_batch_, 1, /*dedicated=*/false);
        if (!arenas.ok()) return arenas.status();
        spilled = arenas->empty();
        mu_.Lock();
        for (std::unique_ptr<Arena>& arena : *arenas) Adopt(std::move(arena));
        placed = TryPlace(nbytes, &placement);
        if (!placed && !spilled) {  // only if a segment cannot hold nbytes after alignment
          mu_.Unlock();
          return absl::InternalError("Store: a fresh segment could not place the buffer");
        }
      }
    }
    placement.written = written;
    ticket = NewTicket(placement, nbytes);
    mu_.Unlock();
  }
  Arena* arena = nullptr;
  {
    absl::MutexLock lock(&mu_);
    arena = placement.block->arena;  // unwritten: cannot spill
  }
  if (!arena->pinned && mapper_->registers()) MaybePinLate(arena);
  return Placed{ticket, arena->base + placement.offset, arena->pinned, mapper_->on_device()};
}

absl::Status LocalStore::Fetch(uint64_t ticket, void* dst, size_t capacity) {
  if (mapper_->on_device()) return DeviceTierError("Fetch");
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    if (it != tickets_.end() && it->second.size > capacity) {
      return absl::OutOfRangeError(absl::StrCat("ticket ", ticket, " holds ", it->second.size,
                                                " bytes; the buffer holds ", capacity));
    }
  }
  absl::StatusOr<Placement> placement = PinForRead(ticket, /*locate=*/false);
  if (!placement.ok()) return placement.status();
  const std::byte* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    data = placement->block->arena->base + placement->offset;
  }
  if (placement->size > 0) std::memcpy(dst, data, placement->size);
  absl::MutexLock lock(&mu_);
  placement->block->pins -= 1;  // the ticket keeps the block alive
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> LocalStore::Size(uint64_t ticket) const {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown or released ticket ", ticket));
  }
  return it->second.size;
}

bool LocalStore::Empty(const Arena& arena) {
  const Block& block = *arena.block;
  return block.state == Block::State::kResident && block.allocator.empty() && block.pins == 0;
}

LocalStore::Arena* LocalStore::SpareDedicated(uint64_t bytes) {
  for (const std::unique_ptr<Arena>& arena : arenas_) {
    if (arena->dedicated && arena->bytes == bytes && Empty(*arena)) return arena.get();
  }
  return nullptr;
}

void LocalStore::FreshBlock(Arena* arena) {
  auto block = std::make_unique<Block>(arena->bytes, arena->dedicated);
  block->arena = arena;
  arena->block = block.get();
  blocks_.emplace(block.get(), std::move(block));
}

void LocalStore::DeleteBlock(Block* block) {
  ACTSTASH_CHECK(
      !InFlight(block->state),
      absl::StrCat("deleting a block while it is ", BlockStateName(block->state)).c_str());
  if (OnDisk(block->state)) {
    usage_.set_spilled_leases(usage_.spilled_leases() - 1);
    usage_.set_spilled_bytes(usage_.spilled_bytes() - block->bytes);
  }
  if (block->ahead) ahead_ -= 1;
  blocks_.erase(block);
}

void LocalStore::Move(Block* block, BlockEvent event) {
  const BlockState from = block->state;
  const std::optional<BlockState> to = NextBlockState(from, event);
  ACTSTASH_CHECK(to.has_value(), absl::StrCat("a ", BlockStateName(from), " block cannot take '",
                                              BlockEventName(event), "'")
                                     .c_str());
  block->state = *to;
  if (OnDisk(*to) && !OnDisk(from)) {
    usage_.set_spilled_leases(usage_.spilled_leases() + 1);
    usage_.set_spilled_bytes(usage_.spilled_bytes() + block->bytes);
  } else if (OnDisk(from) && !OnDisk(*to)) {
    usage_.set_spilled_leases(usage_.spilled_leases() - 1);
    usage_.set_spilled_bytes(usage_.spilled_bytes() - block->bytes);
  }
  if (event == BlockEvent::kSpillDone) usage_.set_spills(usage_.spills() + 1);
  if (event == BlockEvent::kRestoreDone) {
    usage_.set_restores(usage_.restores() + 1);
    usage_.set_restores_ahead(usage_.restores_ahead() + (block->ahead ? 1 : 0));
  }
  // A block read ahead stays marked until a reader reads it (PinForRead) or
  // it leaves memory unread: its read-back failed or is lost, or it spilled
  // again (it was the coldest before anyone read it). Left marked, it would
  // hold a place of the read-ahead forever and be counted again when read
  // ahead once more.
  if (block->ahead && (*to == BlockState::kSpilled || *to == BlockState::kLost)) {
    block->ahead = false;
    ahead_ -= 1;
  }
  if (InFlight(from)) block_changed_.SignalAll();
}

std::unique_ptr<LocalStore::Arena> LocalStore::Detach(Arena* arena) {
  auto it = std::find_if(arenas_.begin(), arenas_.end(),
                         [arena](const std::unique_ptr<Arena>& a) { return a.get() == arena; });
  std::unique_ptr<Arena> detached = std::move(*it);
  arenas_.erase(it);
  hint_ = 0;
  DeleteBlock(detached->block);
  detached->block = nullptr;
  usage_.set_leases(usage_.leases() - 1);
  usage_.set_leased_bytes(usage_.leased_bytes() - detached->bytes);
  if (detached->pinned) usage_.set_pinned_bytes(usage_.pinned_bytes() - detached->bytes);
  return detached;
}

void LocalStore::Adopt(std::unique_ptr<Arena> arena) {
  usage_.set_leases(usage_.leases() + 1);
  usage_.set_leased_bytes(usage_.leased_bytes() + arena->bytes);
  if (arena->pinned) usage_.set_pinned_bytes(usage_.pinned_bytes() + arena->bytes);
  FreshBlock(arena.get());
  arenas_.push_back(std::move(arena));
}

void LocalStore::GiveBack(std::unique_ptr<Arena> arena) {
  UnmapArena(*arena);
  // A failed Return (daemon gone) loses nothing: closing the session, or the
  // daemon's exit, frees the lease anyway.
  if (!backend_.Lost()) (void)backend_.Return(absl::MakeConstSpan(&arena->lease_id, 1));
}

void LocalStore::GiveBackEmpty(const std::function<bool(const Arena&)>& keep, uint64_t limit) {
  std::vector<std::unique_ptr<Arena>> back;
  {
    absl::MutexLock lock(&mu_);
    uint64_t given = 0;
    for (size_t i = arenas_.size(); i-- > 0 && given < limit;) {
      Arena* arena = arenas_[i].get();
      if (Empty(*arena) && !keep(*arena)) {
        given += arena->bytes;
        back.push_back(Detach(arena));
      }
    }
  }
  for (std::unique_ptr<Arena>& arena : back) GiveBack(std::move(arena));
}

absl::Status LocalStore::Release(uint64_t ticket) {
  std::unique_ptr<Arena> give_back;
  uint64_t drop_spill = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown or released ticket ", ticket));
    }
    const Placement placement = it->second;
    tickets_.erase(it);
    Block* block = placement.block;
    block->allocator.Free(placement.offset);
    if (!placement.written) block->unwritten -= 1;
    if (placement.located) block->pins -= 1;
    usage_.set_objects(usage_.objects() - 1);
    usage_.set_bytes(usage_.bytes() - placement.size);
    if (!block->allocator.empty()) return absl::OkStatus();
    switch (block->state) {
      case Block::State::kSpilled:  // nothing of it is needed any more
        drop_spill = block->spill_id;
        DeleteBlock(block);
        break;
      case Block::State::kLost:
        DeleteBlock(block);
        break;
      case Block::State::kSpilling:
      case Block::State::kRestoring:
        break;  // the spill or read-back in flight sees it empty when done
      case Block::State::kResident: {
        if (block->pins > 0) break;
        const auto now = std::chrono::steady_clock::now();
        block->arena->emptied = now;
        if (Retained(*block->arena, now)) {
          sweeper_.Start();  // kept for the next step; the sweeper gives it back later
        } else if (block->dedicated) {
          // This one becomes the spare; an older spare goes back (unless
          // retention keeps it).
          for (const std::unique_ptr<Arena>& arena : arenas_) {
            if (arena.get() != block->arena && arena->dedicated && Empty(*arena) &&
                !Retained(*arena, now)) {
              give_back = Detach(arena.get());
              break;
            }
          }
        } else {
          size_t empty_shared = 0;
          for (const std::unique_ptr<Arena>& arena : arenas_) {
            empty_shared += !arena->dedicated && Empty(*arena);
          }
          if (empty_shared > lease_batch_) give_back = Detach(block->arena);
        }
        break;
      }
    }
  }
  if (give_back != nullptr) GiveBack(std::move(give_back));
  if (drop_spill != 0) (void)backend_.DropSpilled(absl::MakeConstSpan(&drop_spill, 1));
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
  absl::MutexLock lock(&mu_);
  return usage_;
}

absl::Status LocalStore::pin_status() const {
  absl::MutexLock lock(&mu_);
  return pin_status_;
}

}  // namespace actstash::client_internal
