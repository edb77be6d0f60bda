// LocalStore's spill side: spilling cold blocks to the daemon's disk when no
// lease can be had, and reading them back when (or before) they are read.
#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/local_store.h"
#include "common/clock.h"

namespace actstash::client_internal {
absl::StatusOr<std::vector<std::unique_ptr<LocalStore::Arena>>> LocalStore::LeaseOrSpill(
    uint32_t count, uint32_t segments, bool dedicated) {
  absl::StatusOr<std::vector<std::unique_ptr<Arena>>> arenas =
      LeaseArenas(count, segments, dedicated);
  if (!arenas.ok() && arenas.status().code() == absl::StatusCode::kResourceExhausted &&
      GiveBackRetained() > 0) {
    arenas = LeaseArenas(count, segments, dedicated);  // what retention kept is the pool's again
  }
  if (!arenas.ok() && arenas.status().code() == absl::StatusCode::kResourceExhausted && count > 1) {
    arenas = LeaseArenas(1, segments, dedicated);  // room for one, maybe
  }
  if (arenas.ok() || arenas.status().code() != absl::StatusCode::kResourceExhausted ||
      !backend_.CanSpill() || mapper_->on_device()) {
    return arenas;
  }
  uint64_t return_bytes = 0;
  absl::StatusOr<bool> spilled =
      SpillColdest(std::max<uint32_t>(lease_batch_, segments), &return_bytes);
  if (!spilled.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(arenas.status().message(),
                     "; spilling to the daemon's disk failed too: ", spilled.status().message()));
  }
  if (*spilled) {
    // Another session waits and this one holds more than its share: what
    // spilling emptied goes back to the pool rather than being reused.
    if (return_bytes > 0) GiveBackEmpty([](const Arena&) { return false; }, return_bytes);
    return std::vector<std::unique_ptr<Arena>>{};
  }
  // Nothing of ours can spill. Buffers still being written will be
  // spillable once their writer marks them: let the caller do that first.
  bool unwritten = false;
  {
    absl::MutexLock lock(&mu_);
    for (const std::unique_ptr<Arena>& arena : arenas_) unwritten |= arena->block->unwritten > 0;
  }
  // Otherwise, when other sessions hold the pool, they give memory back as
  // they spill or finish their backward: wait for it.
  const auto deadline =
      std::chrono::steady_clock::now() + (unwritten ? std::chrono::milliseconds(0) : pool_wait_);
  auto pause = std::chrono::milliseconds(5);
  absl::Status last = arenas.status();
  while (absl::StrContains(last.message(), "pool exhausted") &&
         std::chrono::steady_clock::now() + pause < deadline) {
    const uint64_t start = MonotonicNowNs();
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
    arenas = LeaseArenas(1, segments, dedicated);
    {
      absl::MutexLock lock(&mu_);
      usage_.set_spill_wait_ns(usage_.spill_wait_ns() + MonotonicNowNs() -
                               start);  // waiting for the pool
    }
    if (arenas.ok()) return arenas;
    last = arenas.status();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      last.message(),
      "; nothing more of this session can be spilled to the daemon's disk (every buffer in "
      "memory is being written or read)"));
}

absl::StatusOr<bool> LocalStore::SpillColdest(uint32_t max_blocks, uint64_t* return_bytes) {
  if (mapper_->on_device()) return false;  // device bytes do not outlive the daemon
  std::vector<Block*> chosen;
  std::vector<uint64_t> lease_ids;
  {
    absl::MutexLock lock(&mu_);
    std::vector<Block*> candidates;
    for (const std::unique_ptr<Arena>& arena : arenas_) {
      Block* block = arena->block;
      if (block->state == Block::State::kResident && !block->allocator.empty() &&
          block->unwritten == 0 && block->pins == 0) {
        candidates.push_back(block);
      }
    }
    // Activation order: the blocks stored first are read last by backward.
    std::sort(candidates.begin(), candidates.end(),
              [](const Block* a, const Block* b) { return a->last_seq < b->last_seq; });
    if (candidates.size() > max_blocks) candidates.resize(max_blocks);
    for (Block* block : candidates) {
      Move(block, BlockEvent::kSpill);
      chosen.push_back(block);
      lease_ids.push_back(block->arena->lease_id);
    }
  }
  if (chosen.empty()) return false;
  const uint64_t start = MonotonicNowNs();
  uint64_t asked_back = 0;
  absl::StatusOr<std::vector<uint64_t>> ids = backend_.Spill(lease_ids, &asked_back);
  if (return_bytes != nullptr) *return_bytes = asked_back;
  if (ids.ok() && ids->size() != chosen.size()) {
    ids = absl::InternalError(absl::StrCat("the daemon answered ", ids->size(), " spill ids for ",
                                           chosen.size(), " leases"));
  }
  std::vector<uint64_t> drop;
  {
    absl::MutexLock lock(&mu_);
    usage_.set_spill_wait_ns(usage_.spill_wait_ns() + MonotonicNowNs() - start);
    for (size_t i = 0; i < chosen.size(); ++i) {
      Block* block = chosen[i];
      if (!ids.ok()) {
        Move(block, BlockEvent::kSpillFailed);  // its memory was never changed
        continue;
      }
      Arena* arena = block->arena;
      Move(block, BlockEvent::kSpillDone);
      block->spill_id = (*ids)[i];
      block->arena = nullptr;
      FreshBlock(arena);
      if (block->allocator.empty()) {  // released while it was being written
        drop.push_back(block->spill_id);
        DeleteBlock(block);
      }
    }
  }
  if (!drop.empty()) (void)backend_.DropSpilled(drop);
  if (!ids.ok()) return ids.status();
  return true;
}

absl::Status LocalStore::EnsureResident(Block* block) {
  uint64_t start = 0;
  for (;;) {
    switch (block->state) {
      case Block::State::kResident:
        if (start != 0)
          usage_.set_restore_wait_ns(usage_.restore_wait_ns() + MonotonicNowNs() - start);
        return absl::OkStatus();
      case Block::State::kLost:
        return block->error;
      case Block::State::kSpilling:
      case Block::State::kRestoring:
        if (start == 0) start = MonotonicNowNs();
        block_changed_.Wait(&mu_);
        break;
      case Block::State::kSpilled: {
        if (start == 0) start = MonotonicNowNs();
        Move(block, BlockEvent::kRestore);
        mu_.Unlock();
        absl::Status status = RestoreBlock(block, /*may_spill=*/true);
        mu_.Lock();
        // The caller's buffer keeps the block alive (it is not empty).
        if (!status.ok() && block->state == Block::State::kSpilled) {
          usage_.set_restore_wait_ns(usage_.restore_wait_ns() + MonotonicNowNs() - start);
          return status;
        }
        break;
      }
    }
  }
}

absl::Status LocalStore::RestoreBlock(Block* block, bool may_spill) {
  // Back to kSpilled (deleted, and its spill dropped, when nothing in it is
  // needed any more).
  auto give_up = [&](absl::Status status) {
    uint64_t drop = 0;
    {
      absl::MutexLock lock(&mu_);
      Move(block, BlockEvent::kRestoreFailed);
      if (block->allocator.empty()) {
        drop = block->spill_id;
        DeleteBlock(block);
      }
    }
    if (drop != 0) (void)backend_.DropSpilled(absl::MakeConstSpan(&drop, 1));
    return status;
  };
  bool empty = false;
  {
    absl::MutexLock lock(&mu_);
    empty = block->allocator.empty();
  }
  if (empty) return give_up(absl::OkStatus());  // nothing to read back
  if (backend_.Lost()) {
    return give_up(backend_.GoneError(
        "Restore", "a buffer of this session was spilled to the daemon's disk, and it is lost"));
  }
  const uint32_t segments = static_cast<uint32_t>(block->bytes / segment_bytes_);
  Arena* target = nullptr;
  const auto deadline = std::chrono::steady_clock::now() + pool_wait_;
  auto pause = std::chrono::milliseconds(5);
  lease_mu_.Lock();
  while (target == nullptr) {
    {
      absl::MutexLock lock(&mu_);
      for (const std::unique_ptr<Arena>& arena : arenas_) {
        // (Only host stores have spilled blocks: SpillColdest refuses device ones.)
        if (Empty(*arena) && arena->bytes == block->bytes && arena->dedicated == block->dedicated) {
          target = arena.get();
          break;
        }
      }
      if (target != nullptr) {
        DeleteBlock(target->block);
        target->block = block;
        block->arena = target;
        break;
      }
    }
    absl::StatusOr<std::vector<std::unique_ptr<Arena>>> granted =
        LeaseArenas(1, segments, block->dedicated);
    if (granted.ok()) {
      absl::MutexLock lock(&mu_);
      target = granted->front().get();
      Adopt(std::move(granted->front()));
      DeleteBlock(target->block);
      target->block = block;
      block->arena = target;
      break;
    }
    absl::StatusOr<bool> spilled = false;
    if (may_spill && granted.status().code() == absl::StatusCode::kResourceExhausted) {
      // Empty leases that cannot take this block go back first: the pool
      // needs them to grant one that can.
      const uint64_t bytes = block->bytes;
      const bool dedicated = block->dedicated;
      GiveBackEmpty([bytes, dedicated](const Arena& a) {
        return a.bytes == bytes && a.dedicated == dedicated;
      });
      spilled = SpillColdest(1);
      if (spilled.ok() && !*spilled &&
          absl::StrContains(granted.status().message(), "pool exhausted") &&
          std::chrono::steady_clock::now() + pause < deadline) {
        // Other sessions hold the pool: they give memory back as they spill
        // or finish their backward.
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(100));
        continue;
      }
    }
    if (!spilled.ok() || !*spilled) {
      lease_mu_.Unlock();
      return give_up(absl::ResourceExhaustedError(absl::StrCat(
          "reading a spilled buffer back: ", granted.status().message(),
          spilled.ok() ? ""
                       : absl::StrCat("; spilling another failed: ", spilled.status().message()))));
    }
  }
  lease_mu_.Unlock();
  absl::Status status = backend_.Restore(block->spill_id, target->lease_id);
  absl::MutexLock lock(&mu_);
  if (status.ok()) {
    block->spill_id = 0;
    Move(block, BlockEvent::kRestoreDone);
    return absl::OkStatus();
  }
  block->arena = nullptr;
  FreshBlock(target);
  if (status.code() != absl::StatusCode::kDataLoss &&
      status.code() != absl::StatusCode::kNotFound) {
    Move(block, BlockEvent::kRestoreFailed);  // e.g. a timeout: may be tried again
    return status;
  }
  // The daemon dropped the spill: its buffers are gone for good.
  block->error = absl::Status(status.code(),
                              absl::StrCat("a buffer of this session was spilled to the daemon's "
                                           "disk and cannot be read back: ",
                                           status.message()));
  Move(block, BlockEvent::kSpillGone);
  const absl::Status error = block->error;
  if (block->allocator.empty()) DeleteBlock(block);
  return error;
}

void LocalStore::RestoreAhead(uint64_t seq) {
  if (restore_ahead_ == 0) return;
  while (ahead_ < restore_ahead_) {
    Block* next = nullptr;
    for (const auto& [ptr, block] : blocks_) {
      if (block->state == Block::State::kSpilled && block->last_seq < seq &&
          (next == nullptr || block->last_seq > next->last_seq)) {
        next = ptr;
      }
    }
    if (next == nullptr) return;
    Move(next, BlockEvent::kRestore);  // a reader now waits for the read-back
    next->ahead = true;
    ahead_ += 1;
    read_ahead_.Post([this, next] { (void)RestoreBlock(next, /*may_spill=*/false); });
  }
}

absl::StatusOr<LocalStore::Placement> LocalStore::PinForRead(uint64_t ticket, bool locate) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown or released ticket ", ticket));
  }
  Block* block = it->second.block;
  if (block->state != Block::State::kResident) {
    absl::Status status = EnsureResident(block);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("ticket ", ticket, ": ", status.message()));
    }
    it = tickets_.find(ticket);  // the table may have changed meanwhile
    if (it == tickets_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown or released ticket ", ticket));
    }
  }
  Placement& placement = it->second;
  if (block->ahead) {
    block->ahead = false;
    ahead_ -= 1;
  }
  if (!locate || !placement.located) block->pins += 1;
  if (locate) placement.located = true;
  usage_.set_fetches(usage_.fetches() + 1);
  usage_.set_bytes_fetched(usage_.bytes_fetched() + placement.size);
  if (usage_.spilled_leases() > 0) RestoreAhead(placement.seq);
  return placement;
}

}  // namespace actstash::client_internal
