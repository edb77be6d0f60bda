#include "client/store/arena_leases.h"

#include "absl/strings/str_cat.h"

namespace actstash::client_internal {

ArenaLeases::ArenaLeases(LeaseBackend* backend, BlockTable* table, uint64_t segment_bytes,
                         std::unique_ptr<LeaseMapper> mapper)
    : backend_(*backend),
      table_(*table),
      segment_bytes_(segment_bytes),
      mapper_(std::move(mapper)) {}

absl::StatusOr<std::unique_ptr<ArenaLeases::Arena>> ArenaLeases::Map(GrantedLease* lease,
                                                                     bool dedicated) {
  const uint64_t bytes = uint64_t{lease->segments} * segment_bytes_;
  absl::StatusOr<MappedLease> mapped = mapper_->Map(lease, bytes);  // closes the fds
  if (!mapped.ok()) return mapped.status();
  auto arena = std::unique_ptr<Arena>(new Arena{lease->lease_id, mapped->base, bytes, dedicated});
  arena->pinned = mapped->pinned;
  arena->pin_tried = mapped->pin_tried;  // not shared yet
  if (!mapped->pin_error.ok()) NotePinFailure(mapped->pin_error);
  return arena;
}

void ArenaLeases::NotePinFailure(const absl::Status& status) {
  {
    absl::MutexLock lock(&table_.mu());
    v1::ClientUsage& usage = table_.usage();
    usage.set_unpinned_leases(usage.unpinned_leases() + 1);
  }
  absl::MutexLock lock(&pin_mu_);
  if (pin_status_.ok()) {
    pin_status_ =
        absl::Status(status.code(), absl::StrCat("leased memory is not pinned for CUDA (copies are "
                                                 "staged by the driver and slower): ",
                                                 status.message()));
  }
}

absl::Status ArenaLeases::pin_status() const {
  absl::MutexLock lock(&pin_mu_);
  return pin_status_;
}

void ArenaLeases::MaybePinLate(Arena* arena) {
  {
    absl::MutexLock lock(&table_.mu());
    if (arena->pin_tried || !mapper_->CanPinNow()) return;
    arena->pin_tried = true;
  }
  absl::Status status = mapper_->Pin(arena->base, arena->bytes);
  if (!status.ok()) {
    NotePinFailure(status);
    return;
  }
  absl::MutexLock lock(&table_.mu());
  arena->pinned = true;
  v1::ClientUsage& usage = table_.usage();
  usage.set_pinned_bytes(usage.pinned_bytes() + arena->bytes);
}

absl::StatusOr<std::vector<std::unique_ptr<ArenaLeases::Arena>>> ArenaLeases::Lease(
    uint32_t count, uint32_t segments, bool dedicated, const Turn& turn) {
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
    absl::StatusOr<std::unique_ptr<Arena>> arena = Map(&lease, dedicated);
    if (!arena.ok()) {
      status = arena.status();
      unmapped.push_back(lease.lease_id);
      continue;
    }
    arenas.push_back(*std::move(arena));
  }
  if (!status.ok()) {
    for (const std::unique_ptr<Arena>& arena : arenas) {
      mapper_->Unmap(arena->base, arena->bytes, arena->pinned);
      unmapped.push_back(arena->lease_id);
    }
    (void)backend_.Return(unmapped);
    return status;
  }
  return arenas;
}

void ArenaLeases::GiveBack(std::unique_ptr<Arena> arena) {
  mapper_->Unmap(arena->base, arena->bytes, arena->pinned);
  // A failed Return (daemon gone) loses nothing: closing the session, or the
  // daemon's exit, frees the lease anyway.
  if (!backend_.Lost()) (void)backend_.Return(absl::MakeConstSpan(&arena->lease_id, 1));
}

void ArenaLeases::GiveBackEmpty(const std::function<bool(const Arena&)>& keep, uint64_t limit) {
  std::vector<std::unique_ptr<Arena>> back;
  {
    absl::MutexLock lock(&table_.mu());
    const std::vector<std::unique_ptr<Arena>>& arenas = table_.arenas();
    uint64_t given = 0;
    for (size_t i = arenas.size(); i-- > 0 && given < limit;) {
      Arena* arena = arenas[i].get();
      if (BlockTable::Empty(*arena) && !keep(*arena)) {
        given += arena->bytes;
        back.push_back(table_.Detach(arena));
      }
    }
  }
  for (std::unique_ptr<Arena>& arena : back) GiveBack(std::move(arena));
}

void ArenaLeases::UnmapAll() {
  absl::MutexLock lock(&table_.mu());
  for (const std::unique_ptr<Arena>& arena : table_.arenas()) {
    mapper_->Unmap(arena->base, arena->bytes, arena->pinned);
  }
}

}  // namespace actstash::client_internal
