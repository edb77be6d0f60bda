#include "client/store/block_spiller.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/clock.h"

namespace actstash::client_internal {

BlockSpiller::BlockSpiller(BlockTable* table, ArenaLeases* leases, LeaseRetention* retention,
                           uint32_t restore_ahead, std::chrono::milliseconds pool_wait)
    : table_(*table),
      leases_(*leases),
      retention_(*retention),
      backend_(leases->backend()),
      restore_ahead_(restore_ahead),
      pool_wait_(pool_wait) {}

absl::StatusOr<std::vector<std::unique_ptr<BlockSpiller::Arena>>> BlockSpiller::LeaseOrSpill(
    uint32_t count, uint32_t segments, bool dedicated, const ArenaLeases::Turn& turn) {
  auto exhausted = [](const auto& result) {
    return !result.ok() && result.status().code() == absl::StatusCode::kResourceExhausted;
  };
  absl::StatusOr<std::vector<std::unique_ptr<Arena>>> arenas =
      leases_.Lease(count, segments, dedicated, turn);
  if (exhausted(arenas) && retention_.GiveBackRetained() > 0) {
    arenas = leases_.Lease(count, segments, dedicated, turn);  // the pool's again
  }
  if (exhausted(arenas) && count > 1) {
    arenas = leases_.Lease(1, segments, dedicated, turn);  // room for one, maybe
  }
  if (!exhausted(arenas) || !backend_.CanSpill() || leases_.mapper().on_device()) return arenas;
  // Whether it spilled (the caller then places again, given no arena).
  auto spill = [&]() -> absl::StatusOr<bool> {
    uint64_t return_bytes = 0;
    absl::StatusOr<bool> spilled =
        SpillColdest(std::max<uint32_t>(retention_.lease_batch(), segments), &return_bytes, turn);
    // Another session waits and this one holds more than its share: what
    // spilling emptied goes back to the pool rather than being reused.
    if (spilled.ok() && *spilled && return_bytes > 0) {
      leases_.GiveBackEmpty([](const Arena&) { return false; }, return_bytes);
    }
    return spilled;
  };
  absl::StatusOr<bool> spilled = spill();
  if (!spilled.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(arenas.status().message(),
                     "; spilling to the daemon's disk failed too: ", spilled.status().message()));
  }
  if (*spilled) return std::vector<std::unique_ptr<Arena>>{};
  // Nothing of ours can spill. Buffers still being written will be
  // spillable once their writer marks them: let the caller do that first.
  bool unwritten = false;
  {
    absl::MutexLock lock(&table_.mu());
    for (const std::unique_ptr<Arena>& arena : table_.arenas()) {
      unwritten |= arena->block->unwritten > 0;
    }
  }
  // Otherwise wait while that may help (MayWaitFor).
  const auto deadline =
      std::chrono::steady_clock::now() + (unwritten ? std::chrono::milliseconds(0) : pool_wait_);
  auto pause = std::chrono::milliseconds(5);
  absl::Status last = arenas.status();
  while (MayWaitFor(last, nullptr) && std::chrono::steady_clock::now() + pause < deadline) {
    const uint64_t start = MonotonicNowNs();
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
    arenas = leases_.Lease(1, segments, dedicated, turn);
    {
      absl::MutexLock lock(&table_.mu());
      v1::ClientUsage& usage = table_.usage();
      usage.set_spill_wait_ns(usage.spill_wait_ns() + MonotonicNowNs() - start);  // pool wait
    }
    if (arenas.ok()) return arenas;
    last = arenas.status();
    spilled = spill();
    if (spilled.ok() && *spilled) return std::vector<std::unique_ptr<Arena>>{};
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      last.message(),
      "; nothing more of this session can be spilled to the daemon's disk (every buffer in "
      "memory is being written or read)"));
}

absl::StatusOr<uint64_t> BlockSpiller::SpillForOthers(uint64_t bytes,
                                                      const ArenaLeases::Turn& turn) {
  if (!backend_.CanSpill() || leases_.mapper().on_device() || bytes == 0) return 0;
  auto leased = [this] {
    absl::MutexLock lock(&table_.mu());
    return table_.usage().leased_bytes();
  };
  const uint64_t segment = leases_.segment_bytes();
  const uint64_t before = leased();
  const uint64_t blocks = std::min<uint64_t>((bytes + segment - 1) / segment, UINT32_MAX);
  uint64_t return_bytes = 0;
  absl::StatusOr<bool> spilled = SpillColdest(static_cast<uint32_t>(blocks), &return_bytes, turn);
  if (!spilled.ok()) return spilled.status();
  leases_.GiveBackEmpty([](const Arena&) { return false; }, bytes);
  const uint64_t after = leased();
  return before > after ? before - after : 0;
}

absl::StatusOr<bool> BlockSpiller::SpillColdest(uint32_t max_blocks, uint64_t* return_bytes,
                                                const ArenaLeases::Turn& turn) {
  if (leases_.mapper().on_device()) return false;  // device bytes do not outlive the daemon
  std::vector<Block*> chosen;
  std::vector<uint64_t> lease_ids;
  {
    absl::MutexLock lock(&table_.mu());
    std::vector<Block*> candidates;
    for (const std::unique_ptr<Arena>& arena : table_.arenas()) {
      Block* block = arena->block;
      if (block->state == Residence::kResident && !block->allocator.empty() &&
          block->unwritten == 0 && block->pins == 0) {
        candidates.push_back(block);
      }
    }
    // Activation order: the blocks stored first are read last by backward.
    std::sort(candidates.begin(), candidates.end(),
              [](const Block* a, const Block* b) { return a->last_seq < b->last_seq; });
    if (candidates.size() > max_blocks) candidates.resize(max_blocks);
    for (Block* block : candidates) {
      table_.Move(block, ResidenceEvent::kSpill);
      chosen.push_back(block);
      lease_ids.push_back(block->arena->lease_id);
    }
  }
  if (chosen.empty()) return false;
  const uint64_t start = MonotonicNowNs();
  uint64_t asked_back = 0;
  absl::StatusOr<std::vector<SpillFile>> ids = backend_.Spill(lease_ids, &asked_back);
  if (return_bytes != nullptr) *return_bytes = asked_back;
  if (ids.ok() && ids->size() != chosen.size()) {
    ids = absl::InternalError(absl::StrCat("the daemon answered ", ids->size(), " spill ids for ",
                                           chosen.size(), " leases"));
  }
  std::vector<uint64_t> drop;
  {
    absl::MutexLock lock(&table_.mu());
    v1::ClientUsage& usage = table_.usage();
    usage.set_spill_wait_ns(usage.spill_wait_ns() + MonotonicNowNs() - start);
    for (size_t i = 0; i < chosen.size(); ++i) {
      Block* block = chosen[i];
      if (!ids.ok()) {
        table_.Move(block, ResidenceEvent::kSpillFailed);  // its memory was never changed
        continue;
      }
      table_.Move(block, ResidenceEvent::kSpillDone);
      block->spill_id = (*ids)[i].id;
      block->spill_checksum = (*ids)[i].checksum;
      table_.Evict(block);
      if (block->allocator.empty()) {  // released while it was being written
        drop.push_back(block->spill_id);
        table_.DeleteBlock(block);
      }
    }
  }
  if (!drop.empty()) (void)backend_.DropSpilled(drop);
  if (!ids.ok()) return ids.status();
  return true;
}

absl::Status BlockSpiller::EnsureResident(Block* block) {
  uint64_t start = 0;  // when this reader began to wait
  for (;;) {
    switch (block->state) {
      case Residence::kResident:
        if (start != 0) CountRestoreWait(start);
        return absl::OkStatus();
      case Residence::kLost:
        return block->error;
      case Residence::kSpilling:
      case Residence::kRestoring:
        if (start == 0) start = MonotonicNowNs();
        table_.WaitForMove();
        break;
      case Residence::kSpilled: {
        if (start == 0) start = MonotonicNowNs();
        table_.Move(block, ResidenceEvent::kRestore);
        table_.mu().Unlock();
        absl::Status status = RestoreBlock(block, /*may_spill=*/true);
        table_.mu().Lock();
        // The caller's buffer keeps the block alive (it is not empty).
        if (!status.ok() && block->state == Residence::kSpilled) {
          CountRestoreWait(start);
          return status;
        }
        break;
      }
    }
  }
}

bool BlockSpiller::MayWaitFor(const absl::Status& refused, const Block* block) {
  // Other sessions hold the pool: they give memory back as they spill or
  // finish their backward. Or this session's quota is full while one of its
  // blocks is being read back ahead (or spilled): once resident and unread,
  // it can spill for this one (a quota error is otherwise final: the quota
  // is ours alone).
  return absl::StrContains(refused.message(), "pool exhausted") || AnotherBlockMoving(block);
}

bool BlockSpiller::AnotherBlockMoving(const Block* block) {
  absl::MutexLock lock(&table_.mu());
  for (const std::unique_ptr<Arena>& arena : table_.arenas()) {
    const Residence state = arena->block->state;
    if (arena->block != block &&
        (state == Residence::kRestoring || state == Residence::kSpilling)) {
      return true;
    }
  }
  return false;
}

void BlockSpiller::CountRestoreWait(uint64_t start) {
  v1::ClientUsage& usage = table_.usage();
  usage.set_restore_wait_ns(usage.restore_wait_ns() + MonotonicNowNs() - start);
}

absl::StatusOr<BlockSpiller::Arena*> BlockSpiller::ArenaToRestoreInto(
    Block* block, bool may_spill, const ArenaLeases::Turn& turn) {
  const uint32_t segments = static_cast<uint32_t>(block->bytes / leases_.segment_bytes());
  const auto deadline = std::chrono::steady_clock::now() + pool_wait_;
  auto pause = std::chrono::milliseconds(5);
  for (;;) {
    {
      absl::MutexLock lock(&table_.mu());
      for (const std::unique_ptr<Arena>& arena : table_.arenas()) {
        // (Only host stores have spilled blocks: SpillColdest refuses device ones.)
        if (BlockTable::Empty(*arena) && arena->bytes == block->bytes &&
            arena->dedicated == block->dedicated) {
          table_.Install(block, arena.get());
          return arena.get();
        }
      }
    }
    absl::StatusOr<std::vector<std::unique_ptr<Arena>>> granted =
        leases_.Lease(1, segments, block->dedicated, turn);
    if (granted.ok()) {
      absl::MutexLock lock(&table_.mu());
      Arena* target = granted->front().get();
      table_.Adopt(std::move(granted->front()));
      table_.Install(block, target);
      return target;
    }
    absl::StatusOr<bool> spilled = false;
    if (may_spill && granted.status().code() == absl::StatusCode::kResourceExhausted) {
      // Empty leases that cannot take this block go back first: the pool
      // needs them to grant one that can.
      const uint64_t bytes = block->bytes;
      const bool dedicated = block->dedicated;
      leases_.GiveBackEmpty([bytes, dedicated](const Arena& a) {
        return a.bytes == bytes && a.dedicated == dedicated;
      });
      spilled = SpillColdest(1, nullptr, turn);
      if (spilled.ok() && !*spilled && std::chrono::steady_clock::now() + pause < deadline &&
          MayWaitFor(granted.status(), block)) {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(100));
        continue;
      }
    }
    if (!spilled.ok() || !*spilled) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "reading a spilled buffer back: ", granted.status().message(),
          spilled.ok() ? ""
                       : absl::StrCat("; spilling another failed: ", spilled.status().message())));
    }
  }
}

absl::Status BlockSpiller::RestoreBlock(Block* block, bool may_spill) {
  // Back to kSpilled (deleted, and its spill dropped, when nothing in it is
  // needed any more).
  auto give_up = [&](absl::Status status) {
    uint64_t drop = 0;
    {
      absl::MutexLock lock(&table_.mu());
      table_.Move(block, ResidenceEvent::kRestoreFailed);
      if (block->allocator.empty()) {
        drop = block->spill_id;
        table_.DeleteBlock(block);
      }
    }
    if (drop != 0) (void)backend_.DropSpilled(absl::MakeConstSpan(&drop, 1));
    return status;
  };
  bool empty = false;
  {
    absl::MutexLock lock(&table_.mu());
    empty = block->allocator.empty();
  }
  if (empty) return give_up(absl::OkStatus());  // nothing to read back
  if (backend_.Lost()) {
    return give_up(backend_.GoneError(
        "Restore", "a buffer of this session was spilled to the daemon's disk, and it is lost"));
  }
  absl::StatusOr<Arena*> target;
  {
    ArenaLeases::Turn turn(&leases_);
    target = ArenaToRestoreInto(block, may_spill, turn);
  }
  if (!target.ok()) return give_up(target.status());
  bool resent = false;
  absl::Status status = backend_.Restore(block->spill_id, (*target)->lease_id, &resent);
  if (absl::IsNotFound(status) && resent && ReadBackBeforeRestart(*block, **target)) {
    status = absl::OkStatus();
    // Best effort: were the NOT_FOUND the lease's (the spill still on disk),
    // the spill goes now rather than with the session.
    const uint64_t spill_id = block->spill_id;
    (void)backend_.DropSpilled(absl::MakeConstSpan(&spill_id, 1));
  }
  absl::MutexLock lock(&table_.mu());
  if (status.ok()) {
    block->spill_id = 0;
    block->spill_checksum = 0;
    table_.Move(block, ResidenceEvent::kRestoreDone);
    return absl::OkStatus();
  }
  table_.Evict(block);
  if (status.code() != absl::StatusCode::kDataLoss &&
      status.code() != absl::StatusCode::kNotFound) {
    table_.Move(block, ResidenceEvent::kRestoreFailed);  // e.g. a timeout: may be tried again
    return status;
  }
  // The daemon dropped the spill: its buffers are gone for good.
  block->error = absl::Status(status.code(),
                              absl::StrCat("a buffer of this session was spilled to the daemon's "
                                           "disk and cannot be read back: ",
                                           status.message()));
  table_.Move(block, ResidenceEvent::kSpillGone);
  const absl::Status error = block->error;
  if (block->allocator.empty()) table_.DeleteBlock(block);
  return error;
}

bool BlockSpiller::ReadBackBeforeRestart(const Block& block, const Arena& arena) {
  // The daemon deletes a spill once it has read it back, then answers; one
  // that crashed between the two restarts without the spill while its
  // bytes are in the lease (the lease's memory outlives it). Their XXH3
  // tells that apart from a spill lost with the daemon.
  return block.spill_checksum != 0 && arena.bytes == block.bytes &&
         Xxh3(arena.base, arena.bytes) == block.spill_checksum;
}

void BlockSpiller::RestoreAhead(uint64_t seq, ReadKind kind) {
  if (restore_ahead_ == 0) return;
  while (table_.ahead() < restore_ahead_) {
    Block* next =
        kind == ReadKind::kState ? table_.OldestSpilledAfter(seq) : table_.NewestSpilledBefore(seq);
    if (next == nullptr) return;
    table_.Move(next, ResidenceEvent::kRestore);  // a reader now waits for the read-back
    table_.MarkAhead(next);
    read_ahead_.Post([this, next] { (void)RestoreBlock(next, /*may_spill=*/false); });
  }
}

absl::StatusOr<BlockSpiller::Placement> BlockSpiller::PinForRead(uint64_t ticket, bool locate,
                                                                 ReadKind kind) {
  absl::MutexLock lock(&table_.mu());
  absl::StatusOr<Placement*> found = table_.Find(ticket);
  if (!found.ok()) return found.status();
  Block* block = (*found)->block;
  if (block->state != Residence::kResident) {
    absl::Status status = EnsureResident(block);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("ticket ", ticket, ": ", status.message()));
    }
    found = table_.Find(ticket);  // the table may have changed meanwhile
    if (!found.ok()) return found.status();
  }
  Placement& placement = **found;
  table_.ClearAhead(block);
  if (!locate || !placement.located) block->pins += 1;
  if (locate) placement.located = true;
  v1::ClientUsage& usage = table_.usage();
  if (kind == ReadKind::kActivation) {
    usage.set_fetches(usage.fetches() + 1);
    usage.set_bytes_fetched(usage.bytes_fetched() + placement.size);
  }
  if (usage.spilled_leases() > 0) RestoreAhead(placement.seq, kind);
  return placement;
}

}  // namespace actstash::client_internal
