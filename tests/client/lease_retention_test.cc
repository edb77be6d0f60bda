// Which empty leases a LocalStore keeps (client/store/lease_retention.h): the
// answers of OnEmptied for each rule, decided over a table of arenas without
// any lease behind them. LocalStore's own tests (local_store_test) run the
// same rules end to end against a backend that hands out memfds.
#include "client/store/lease_retention.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "client/store/arena_leases.h"
#include "client/store/block_table.h"
#include "client/store/lease_mapper.h"

namespace actstash::client_internal {
namespace {

using Arena = BlockTable::Arena;
using std::chrono::milliseconds;

constexpr uint64_t kBytes = 1 << 16;

class NoLeases : public LeaseBackend {
 public:
  absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t, uint32_t) override {
    return absl::ResourceExhaustedError("no pool");
  }
  absl::Status Return(absl::Span<const uint64_t>) override { return absl::OkStatus(); }
  bool Lost() const override { return false; }
};

// A table of arenas with nothing mapped, and the retention over it.
class LeaseRetentionTest : public ::testing::Test {
 protected:
  void Make(uint32_t lease_batch, milliseconds retain) {
    retention_ = std::make_unique<LeaseRetention>(&table_, &leases_, lease_batch, retain);
  }
  Arena* Add(bool dedicated, bool pinned) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu()) {
    auto arena = std::make_unique<Arena>();
    arena->lease_id = next_id_++;
    arena->bytes = kBytes;
    arena->dedicated = dedicated;
    arena->pinned = pinned;
    Arena* raw = arena.get();
    table_.Adopt(std::move(arena));
    return raw;
  }

  NoLeases backend_;
  BlockTable table_;
  ArenaLeases leases_{&backend_, &table_, kBytes,
                      std::make_unique<HostLeaseMapper>(kBytes, nullptr, false)};
  std::unique_ptr<LeaseRetention> retention_;
  uint64_t next_id_ = 1;
};

TEST_F(LeaseRetentionTest, EmptySegmentsBeyondTheBatchGoBackTheLastEmptiedFirst) {
  Make(/*lease_batch=*/1, milliseconds(0));
  absl::MutexLock lock(&table_.mu());
  Arena* a = Add(false, false);
  Add(false, false);
  Add(/*dedicated=*/true, false);  // dedicated ones are not counted as segments
  // Two empty segments (a and the one after it), a batch of one: the one
  // just emptied goes.
  EXPECT_EQ(retention_->OnEmptied(table_.arenas(), a), a);
  Make(/*lease_batch=*/2, milliseconds(0));
  EXPECT_EQ(retention_->OnEmptied(table_.arenas(), a), nullptr);
}

TEST_F(LeaseRetentionTest, TheLastEmptiedDedicatedLeaseBecomesTheSpareAndAnOlderOneGoes) {
  Make(1, milliseconds(0));
  absl::MutexLock lock(&table_.mu());
  Arena* older = Add(/*dedicated=*/true, false);
  Arena* newer = Add(/*dedicated=*/true, false);
  EXPECT_EQ(retention_->OnEmptied(table_.arenas(), newer), older);
  table_.Detach(older);
  EXPECT_EQ(retention_->OnEmptied(table_.arenas(), newer), nullptr);  // the only spare
}

TEST_F(LeaseRetentionTest, RegisteredLeasesStayForTheRetentionAndNoLonger) {
  Make(1, milliseconds(60'000));
  {
    absl::MutexLock lock(&table_.mu());
    Arena* a = Add(false, /*pinned=*/true);
    Arena* b = Add(false, /*pinned=*/true);
    Add(true, /*pinned=*/true);  // an older spare: the usual rules would give it back
    Arena* newer_spare = Add(true, /*pinned=*/true);
    EXPECT_EQ(retention_->OnEmptied(table_.arenas(), a), nullptr);
    EXPECT_EQ(retention_->OnEmptied(table_.arenas(), b), nullptr);  // beyond the batch: kept
    EXPECT_EQ(retention_->OnEmptied(table_.arenas(), newer_spare), nullptr);
    const auto now = std::chrono::steady_clock::now();
    EXPECT_TRUE(retention_->Retained(*a, now));
    EXPECT_FALSE(retention_->Retained(*a, now + milliseconds(60'001)));
    Arena* unpinned = Add(false, /*pinned=*/false);
    EXPECT_EQ(retention_->OnEmptied(table_.arenas(), unpinned), unpinned);  // not registered
  }
  retention_->Stop();  // the sweeper started by the first retained lease (a tick takes the lock)
}

TEST(LeaseRetentionSweepTest, TheSweeperLooksFourTimesPerRetentionWithinBounds) {
  EXPECT_EQ(LeaseRetention::SweepPeriod(milliseconds(10'000)), absl::Seconds(1));
  EXPECT_EQ(LeaseRetention::SweepPeriod(milliseconds(2'000)), absl::Milliseconds(500));
  EXPECT_EQ(LeaseRetention::SweepPeriod(milliseconds(1)), absl::Milliseconds(10));
}

}  // namespace
}  // namespace actstash::client_internal
