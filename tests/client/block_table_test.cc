// LocalStore's table (client/store/block_table.h): the counters follow what it
// holds through every change, a block moves only along the table of
// block_state.h, and the invariants that tie arenas and blocks hold (a
// broken one is a crash, not a silent miscount).
#include "client/store/block_table.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace actstash::client_internal {
namespace {

using Arena = BlockTable::Arena;
using Block = BlockTable::Block;
using Placement = BlockTable::Placement;

constexpr uint64_t kBytes = 1 << 16;

std::unique_ptr<Arena> NewArena(uint64_t lease_id, bool dedicated = false, bool pinned = false,
                                uint64_t bytes = kBytes) {
  auto arena = std::make_unique<Arena>();
  arena->lease_id = lease_id;
  arena->bytes = bytes;
  arena->dedicated = dedicated;
  arena->pinned = pinned;
  return arena;
}

// Adopts an arena and answers it (the table owns it).
Arena* Add(BlockTable& table, std::unique_ptr<Arena> arena)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(table.mu()) {
  Arena* raw = arena.get();
  table.Adopt(std::move(arena));
  return raw;
}

// Moves a resident block through a spill that the daemon answered: on disk,
// out of its arena (which gets a fresh empty block).
void Spill(BlockTable& table, Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table.mu()) {
  table.Move(block, ResidenceEvent::kSpill);
  table.Move(block, ResidenceEvent::kSpillDone);
  table.Evict(block);
}

TEST(BlockTableTest, AdoptAndDetachKeepTheLeaseCounters) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Arena* a = Add(table, NewArena(1));
  Add(table, NewArena(2, /*dedicated=*/true, /*pinned=*/true, 2 * kBytes));
  EXPECT_EQ(table.usage().leases(), 2u);
  EXPECT_EQ(table.usage().leased_bytes(), 3 * kBytes);
  EXPECT_EQ(table.usage().pinned_bytes(), 2 * kBytes);
  ASSERT_NE(a->block, nullptr);
  EXPECT_EQ(a->block->arena, a);
  EXPECT_TRUE(BlockTable::Empty(*a));

  std::unique_ptr<Arena> back = table.Detach(table.arenas().back().get());
  EXPECT_EQ(back->lease_id, 2u);
  EXPECT_EQ(back->block, nullptr);
  EXPECT_EQ(table.arenas().size(), 1u);
  EXPECT_EQ(table.usage().leases(), 1u);
  EXPECT_EQ(table.usage().leased_bytes(), kBytes);
  EXPECT_EQ(table.usage().pinned_bytes(), 0u);
}

TEST(BlockTableTest, TicketsCountWhatIsStoredUntilRemoved) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Arena* a = Add(table, NewArena(1));
  Placement placement;
  ASSERT_TRUE(table.TryPlace(1000, &placement));
  EXPECT_EQ(placement.block, a->block);
  const uint64_t first = table.AddTicket(placement);
  ASSERT_TRUE(table.TryPlace(24, &placement));
  const uint64_t second = table.AddTicket(placement);
  EXPECT_EQ(table.usage().objects(), 2u);
  EXPECT_EQ(table.usage().bytes(), 1024u);
  EXPECT_EQ(table.usage().stores(), 2u);
  EXPECT_EQ(a->block->unwritten, 2u);
  EXPECT_LT((*table.Find(first))->seq, (*table.Find(second))->seq);
  EXPECT_EQ(a->block->last_seq, (*table.Find(second))->seq);

  ASSERT_TRUE(table.MarkWritten(first).ok());
  ASSERT_TRUE(table.MarkWritten(first).ok());  // once counts once
  EXPECT_EQ(a->block->unwritten, 1u);

  absl::StatusOr<Placement> removed = table.Remove(second);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->size, 24u);
  EXPECT_EQ(a->block->unwritten, 0u);  // an unwritten one removed stops counting
  ASSERT_TRUE(table.Remove(first).ok());
  EXPECT_TRUE(BlockTable::Empty(*a));
  EXPECT_EQ(table.usage().objects(), 0u);
  EXPECT_EQ(table.usage().bytes(), 0u);
  EXPECT_EQ(table.usage().stores(), 2u);  // a running total

  for (uint64_t ticket : {first, uint64_t{999}}) {
    EXPECT_EQ(table.Find(ticket).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(table.Remove(ticket).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(table.MarkWritten(ticket).code(), absl::StatusCode::kNotFound);
  }
}

TEST(BlockTableTest, SharedPlacementSkipsDedicatedArenasAndBlocksNotInMemory) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Add(table, NewArena(1, /*dedicated=*/true));
  Arena* shared = Add(table, NewArena(2));
  Placement placement;
  ASSERT_TRUE(table.TryPlace(64, &placement));
  EXPECT_EQ(placement.block, shared->block);
  table.AddTicket(placement);
  table.Move(shared->block, ResidenceEvent::kSpill);
  EXPECT_FALSE(table.TryPlace(64, &placement));  // only a spilling shared block has room
}

TEST(BlockTableTest, ASpillAndItsReadBackKeepTheCountersAndTheArenas) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Arena* a = Add(table, NewArena(1));
  Placement placement;
  ASSERT_TRUE(table.TryPlace(100, &placement));
  const uint64_t ticket = table.AddTicket(placement);
  Block* block = a->block;

  table.Move(block, ResidenceEvent::kSpill);
  EXPECT_EQ(table.usage().spilled_leases(), 0u);  // not on disk until the daemon says so
  table.Move(block, ResidenceEvent::kSpillDone);
  block->spill_id = 7;
  table.Evict(block);
  EXPECT_EQ(table.usage().spills(), 1u);
  EXPECT_EQ(table.usage().spilled_leases(), 1u);
  EXPECT_EQ(table.usage().spilled_bytes(), kBytes);
  EXPECT_EQ(block->arena, nullptr);
  ASSERT_NE(a->block, block);
  EXPECT_TRUE(BlockTable::Empty(*a));  // the lease holds a fresh block
  EXPECT_EQ((*table.Find(ticket))->block, block);

  table.Move(block, ResidenceEvent::kRestore);
  EXPECT_EQ(table.usage().spilled_leases(), 1u);  // still on disk while read back
  table.Install(block, a);
  EXPECT_EQ(a->block, block);
  EXPECT_EQ(block->arena, a);
  table.Move(block, ResidenceEvent::kRestoreDone);
  EXPECT_EQ(table.usage().restores(), 1u);
  EXPECT_EQ(table.usage().restores_ahead(), 0u);
  EXPECT_EQ(table.usage().spilled_leases(), 0u);
  EXPECT_EQ(table.usage().spilled_bytes(), 0u);
}

TEST(BlockTableTest, DeletingASpilledBlockStopsCountingIt) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Arena* a = Add(table, NewArena(1));
  Block* block = a->block;
  Spill(table, block);
  ASSERT_EQ(table.usage().spilled_leases(), 1u);
  table.DeleteBlock(block);
  EXPECT_EQ(table.usage().spilled_leases(), 0u);
  EXPECT_EQ(table.usage().spilled_bytes(), 0u);
}

TEST(BlockTableTest, AReadAheadMarkLastsUntilReadOrUntilTheBlockLeavesMemoryUnread) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Arena* a = Add(table, NewArena(1));
  Block* block = a->block;
  Spill(table, block);
  table.Move(block, ResidenceEvent::kRestore);
  table.MarkAhead(block);
  table.MarkAhead(block);  // marked once
  EXPECT_EQ(table.ahead(), 1u);
  table.Install(block, a);
  table.Move(block, ResidenceEvent::kRestoreDone);
  EXPECT_EQ(table.usage().restores_ahead(), 1u);
  EXPECT_EQ(table.ahead(), 1u);  // read back, not read yet
  // Spilled again unread: the mark goes, or it would hold a read-ahead place
  // forever.
  table.Move(block, ResidenceEvent::kSpill);
  table.Move(block, ResidenceEvent::kSpillDone);
  EXPECT_EQ(table.ahead(), 0u);
  EXPECT_FALSE(block->ahead);
}

TEST(BlockTableTest, NewestSpilledBeforeIsTheOneBackwardReadsNext) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Block* blocks[3];
  uint64_t seqs[3];
  for (int i = 0; i < 3; ++i) {
    Arena* a = Add(table, NewArena(i + 1, /*dedicated=*/true));
    seqs[i] = (*table.Find(table.AddTicket(table.PlaceIn(a, 100))))->seq;
    blocks[i] = a->block;
  }
  EXPECT_EQ(table.NewestSpilledBefore(seqs[2] + 1), nullptr);  // none spilled
  Spill(table, blocks[0]);
  Spill(table, blocks[1]);
  EXPECT_EQ(table.NewestSpilledBefore(seqs[2]), blocks[1]);
  EXPECT_EQ(table.NewestSpilledBefore(seqs[1]), blocks[0]);
  EXPECT_EQ(table.NewestSpilledBefore(seqs[0]), nullptr);
}

TEST(BlockTableTest, AReaderWaitingForABlockWakesWhenItsSpillEnds) {
  BlockTable table;
  Block* block = nullptr;
  {
    absl::MutexLock lock(&table.mu());
    block = Add(table, NewArena(1))->block;
    table.Move(block, ResidenceEvent::kSpill);
  }
  std::thread spiller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    absl::MutexLock lock(&table.mu());
    table.Move(block, ResidenceEvent::kSpillFailed);
  });
  {
    absl::MutexLock lock(&table.mu());
    while (block->state != Residence::kResident) table.WaitForMove();
  }
  spiller.join();
}

TEST(BlockTableDeathTest, BrokenInvariantsCrashInsteadOfMiscounting) {
  BlockTable table;
  absl::MutexLock lock(&table.mu());
  Arena* a = Add(table, NewArena(1));
  Placement placement;
  ASSERT_TRUE(table.TryPlace(100, &placement));
  table.AddTicket(placement);
  Block* block = a->block;
  EXPECT_DEATH(table.Detach(a), "CHECK failed.*not empty");
  EXPECT_DEATH(table.Move(block, ResidenceEvent::kSpillDone), "CHECK failed.*resident.*spill done");
  EXPECT_DEATH(table.DeleteBlock(block), "CHECK failed.*arena still holds");
  table.Move(block, ResidenceEvent::kSpill);
  EXPECT_DEATH(table.Evict(block); table.DeleteBlock(block), "CHECK failed.*spilling");
  Arena* other = Add(table, NewArena(2));
  EXPECT_DEATH(table.Install(block, other), "CHECK failed.*has an arena");
}

}  // namespace
}  // namespace actstash::client_internal
