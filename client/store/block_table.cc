#include "client/store/block_table.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace actstash::client_internal {
namespace {

absl::Status UnknownTicket(uint64_t ticket) {
  return absl::NotFoundError(absl::StrCat("unknown or released ticket ", ticket));
}

}  // namespace

bool BlockTable::Empty(const Arena& arena) {
  const Block& block = *arena.block;
  return block.state == Residence::kResident && block.allocator.empty() && block.pins == 0;
}

void BlockTable::Adopt(std::unique_ptr<Arena> arena) {
  usage_.set_leases(usage_.leases() + 1);
  usage_.set_leased_bytes(usage_.leased_bytes() + arena->bytes);
  if (arena->pinned) usage_.set_pinned_bytes(usage_.pinned_bytes() + arena->bytes);
  FreshBlock(arena.get());
  arenas_.push_back(std::move(arena));
}

std::unique_ptr<BlockTable::Arena> BlockTable::Detach(Arena* arena) {
  ACTSTASH_CHECK(Empty(*arena), "detaching an arena whose block is not empty");
  auto it = std::find_if(arenas_.begin(), arenas_.end(),
                         [arena](const std::unique_ptr<Arena>& a) { return a.get() == arena; });
  ACTSTASH_CHECK(it != arenas_.end(), "detaching an arena that is not in the table");
  std::unique_ptr<Arena> detached = std::move(*it);
  arenas_.erase(it);
  hint_ = 0;
  Block* block = detached->block;
  block->arena = nullptr;
  DeleteBlock(block);
  detached->block = nullptr;
  usage_.set_leases(usage_.leases() - 1);
  usage_.set_leased_bytes(usage_.leased_bytes() - detached->bytes);
  if (detached->pinned) usage_.set_pinned_bytes(usage_.pinned_bytes() - detached->bytes);
  return detached;
}

bool BlockTable::TryPlace(uint64_t nbytes, Placement* out) {
  const size_t n = arenas_.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (hint_ + k) % n;
    Arena* arena = arenas_[i].get();
    Block* block = arena->block;
    if (arena->dedicated || block->state != Residence::kResident) continue;
    if (std::optional<uint64_t> offset = block->allocator.Allocate(nbytes)) {
      hint_ = i;
      *out = Placement{block, *offset, nbytes};
      return true;
    }
  }
  return false;
}

BlockTable::Placement BlockTable::PlaceIn(Arena* arena, uint64_t nbytes) {
  const std::optional<uint64_t> offset = arena->block->allocator.Allocate(nbytes);
  ACTSTASH_CHECK(offset.has_value(), "a dedicated arena cannot place the buffer it was sized for");
  return Placement{arena->block, *offset, nbytes};
}

uint64_t BlockTable::AddTicket(const Placement& placement) {
  const uint64_t ticket = next_ticket_++;
  Placement placed = placement;
  placed.seq = next_seq_++;
  placed.block->last_seq = placed.seq;
  if (!placed.written) placed.block->unwritten += 1;
  tickets_.emplace(ticket, placed);
  usage_.set_objects(usage_.objects() + 1);
  usage_.set_bytes(usage_.bytes() + placed.size);
  usage_.set_stores(usage_.stores() + 1);
  usage_.set_bytes_stored(usage_.bytes_stored() + placed.size);
  return ticket;
}

absl::StatusOr<BlockTable::Placement*> BlockTable::Find(uint64_t ticket) {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return UnknownTicket(ticket);
  return &it->second;
}

absl::StatusOr<const BlockTable::Placement*> BlockTable::Find(uint64_t ticket) const {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return UnknownTicket(ticket);
  return &it->second;
}

absl::Status BlockTable::MarkWritten(uint64_t ticket) {
  absl::StatusOr<Placement*> placement = Find(ticket);
  if (!placement.ok()) return placement.status();
  if (!(*placement)->written) {
    (*placement)->written = true;
    (*placement)->block->unwritten -= 1;
  }
  return absl::OkStatus();
}

absl::Status BlockTable::Park(uint64_t ticket) {
  absl::StatusOr<Placement*> placement = Find(ticket);
  if (!placement.ok()) return placement.status();
  if (absl::Status s = MarkWritten(ticket); !s.ok()) return s;
  if ((*placement)->located) {
    (*placement)->located = false;
    (*placement)->block->pins -= 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockTable::Placement> BlockTable::Remove(uint64_t ticket) {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return UnknownTicket(ticket);
  const Placement placement = it->second;
  tickets_.erase(it);
  Block* block = placement.block;
  block->allocator.Free(placement.offset);
  if (!placement.written) block->unwritten -= 1;
  if (placement.located) block->pins -= 1;
  usage_.set_objects(usage_.objects() - 1);
  usage_.set_bytes(usage_.bytes() - placement.size);
  return placement;
}

void BlockTable::FreshBlock(Arena* arena) {
  auto block = std::make_unique<Block>(arena->bytes, arena->dedicated);
  block->arena = arena;
  arena->block = block.get();
  blocks_.emplace(block.get(), std::move(block));
}

void BlockTable::Evict(Block* block) {
  Arena* arena = block->arena;
  ACTSTASH_CHECK(arena != nullptr, "evicting a block that is in no arena");
  block->arena = nullptr;
  FreshBlock(arena);
}

void BlockTable::Install(Block* block, Arena* target) {
  ACTSTASH_CHECK(block->arena == nullptr && Empty(*target),
                 "installing a block that has an arena, or into one not empty");
  Block* empty = target->block;
  empty->arena = nullptr;
  DeleteBlock(empty);
  target->block = block;
  block->arena = target;
}

void BlockTable::CountOnDisk(const Block& block, bool on_disk) {
  if (on_disk) {
    usage_.set_spilled_leases(usage_.spilled_leases() + 1);
    usage_.set_spilled_bytes(usage_.spilled_bytes() + block.bytes);
  } else {
    usage_.set_spilled_leases(usage_.spilled_leases() - 1);
    usage_.set_spilled_bytes(usage_.spilled_bytes() - block.bytes);
  }
}

void BlockTable::DeleteBlock(Block* block) {
  ACTSTASH_CHECK(
      !InFlight(block->state),
      absl::StrCat("deleting a block while it is ", ResidenceName(block->state)).c_str());
  ACTSTASH_CHECK(block->arena == nullptr, "deleting a block that an arena still holds");
  if (OnDisk(block->state)) CountOnDisk(*block, false);
  if (block->ahead) ahead_ -= 1;
  blocks_.erase(block);
}

void BlockTable::Move(Block* block, ResidenceEvent event) {
  const Residence from = block->state;
  const std::optional<Residence> to = NextResidence(from, event);
  ACTSTASH_CHECK(to.has_value(), absl::StrCat("a ", ResidenceName(from), " block cannot take '",
                                              ResidenceEventName(event), "'")
                                     .c_str());
  block->state = *to;
  if (OnDisk(*to) && !OnDisk(from)) CountOnDisk(*block, true);
  if (OnDisk(from) && !OnDisk(*to)) CountOnDisk(*block, false);
  if (event == ResidenceEvent::kSpillDone) usage_.set_spills(usage_.spills() + 1);
  if (event == ResidenceEvent::kRestoreDone) {
    usage_.set_restores(usage_.restores() + 1);
    usage_.set_restores_ahead(usage_.restores_ahead() + (block->ahead ? 1 : 0));
  }
  // A block read ahead stays marked until a reader reads it or it leaves
  // memory unread: its read-back failed or is lost, or it spilled again (it
  // was the coldest before anyone read it). Left marked, it would hold a
  // place of the read-ahead forever and be counted again when read ahead
  // once more.
  if (*to == Residence::kSpilled || *to == Residence::kLost) ClearAhead(block);
  if (InFlight(from)) block_changed_.SignalAll();
}

BlockTable::Block* BlockTable::NewestSpilledBefore(uint64_t seq) const {
  Block* next = nullptr;
  for (const auto& [ptr, block] : blocks_) {
    if (block->state == Residence::kSpilled && block->last_seq < seq &&
        (next == nullptr || block->last_seq > next->last_seq)) {
      next = ptr;
    }
  }
  return next;
}

BlockTable::Block* BlockTable::OldestSpilledAfter(uint64_t seq) const {
  Block* next = nullptr;
  for (const auto& [ptr, block] : blocks_) {
    if (block->state == Residence::kSpilled && block->last_seq > seq &&
        (next == nullptr || block->last_seq < next->last_seq)) {
      next = ptr;
    }
  }
  return next;
}

void BlockTable::MarkAhead(Block* block) {
  if (block->ahead) return;
  block->ahead = true;
  ahead_ += 1;
}

void BlockTable::ClearAhead(Block* block) {
  if (!block->ahead) return;
  block->ahead = false;
  ahead_ -= 1;
}

}  // namespace actstash::client_internal
