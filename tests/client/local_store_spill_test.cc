// LocalStore's spilling against a fake backend whose "disk" is a map: which
// blocks spill (written, unlocated, coldest first), that they come back byte
// for byte (ahead of need too), and what a failed spill or restore does.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/store/local_store.h"
#include "common/checksum.h"
#include "common/unique_fd.h"

namespace actstash::client_internal {
namespace {

constexpr uint64_t kSegment = 1 << 20;

// A pool of `segments` memfd segments and a disk of byte vectors. The fake
// keeps its own fd of every segment to read and write the lease's bytes.
class SpillingBackend : public LeaseBackend {
 public:
  explicit SpillingBackend(uint64_t segments) : segments_left_(segments) {}
  absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t count, uint32_t per) override {
    absl::MutexLock lock(&mu_);
    if (uint64_t{count} * per > segments_left_) {
      return absl::ResourceExhaustedError(quota_errors_ ? "fake session quota exceeded"
                                                        : "fake host pool exhausted");
    }
    segments_left_ -= uint64_t{count} * per;
    std::vector<GrantedLease> granted;
    for (uint32_t i = 0; i < count; ++i) {
      GrantedLease lease{next_id_++, per, {}, std::nullopt};
      for (uint32_t s = 0; s < per; ++s) {
        UniqueFd fd(memfd_create("fake-segment", MFD_CLOEXEC));
        EXPECT_EQ(ftruncate(fd.get(), kSegment), 0);
        fds_[lease.lease_id].emplace_back(dup(fd.get()));
        lease.fds.push_back(std::move(fd));
      }
      granted.push_back(std::move(lease));
    }
    return granted;
  }
  absl::Status Return(absl::Span<const uint64_t> ids) override {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : ids) {
      auto it = fds_.find(id);
      if (it == fds_.end()) return absl::NotFoundError("unknown lease");
      segments_left_ += it->second.size();
      fds_.erase(it);
    }
    return absl::OkStatus();
  }
  bool Lost() const override { return false; }
  bool CanSpill() const override { return true; }
  absl::StatusOr<std::vector<SpillFile>> Spill(absl::Span<const uint64_t> ids,
                                               uint64_t* return_bytes) override {
    absl::MutexLock lock(&mu_);
    *return_bytes = 0;
    if (fail_spills_) return absl::ResourceExhaustedError("fake disk full");
    std::vector<SpillFile> out;
    for (uint64_t id : ids) {
      std::vector<std::byte> bytes;
      for (const UniqueFd& fd : fds_.at(id)) {
        const size_t at = bytes.size();
        bytes.resize(at + kSegment);
        EXPECT_EQ(pread(fd.get(), bytes.data() + at, kSegment, 0), static_cast<ssize_t>(kSegment));
      }
      out.push_back(SpillFile{next_spill_, Xxh3(bytes.data(), bytes.size())});
      disk_[next_spill_++] = std::move(bytes);
      ++spills_;
    }
    return out;
  }
  absl::Status Restore(uint64_t spill_id, uint64_t lease_id, bool* resent) override {
    ++restore_calls_;
    std::this_thread::sleep_for(restore_delay_);  // an RPC in flight: nothing locked
    absl::MutexLock lock(&mu_);
    auto it = disk_.find(spill_id);
    if (it == disk_.end()) return absl::NotFoundError("no such spill");
    if (crash_ != Crash::kNone) {
      // The daemon goes down during the call; the call is sent again to its
      // successor, which no longer has the spill.
      const Crash crash = std::exchange(crash_, Crash::kNone);
      if (crash != Crash::kSpillLost) RestoreLocked(it->second, lease_id);
      disk_.erase(it);
      *resent = crash != Crash::kNotResent;
      return absl::NotFoundError("no spilled segment in this session");
    }
    if (corrupt_.count(spill_id) > 0) {
      disk_.erase(it);
      return absl::DataLossError("fake checksum mismatch");
    }
    RestoreLocked(it->second, lease_id);
    disk_.erase(it);
    ++restores_;
    return absl::OkStatus();
  }
  void RestoreLocked(const std::vector<std::byte>& bytes, uint64_t lease_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::vector<UniqueFd>& fds = fds_.at(lease_id);
    EXPECT_EQ(bytes.size(), fds.size() * kSegment);
    for (size_t i = 0; i < fds.size(); ++i) {
      EXPECT_EQ(pwrite(fds[i].get(), bytes.data() + i * kSegment, kSegment, 0),
                static_cast<ssize_t>(kSegment));
    }
  }
  absl::Status DropSpilled(absl::Span<const uint64_t> ids) override {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : ids) disk_.erase(id);
    return absl::OkStatus();
  }

  // Set before the store is used.
  bool quota_errors_ = false;  // a full pool is this session's quota, not others' use
  std::chrono::milliseconds restore_delay_{0};
  std::atomic<int> restore_calls_{0};

  absl::Mutex mu_;
  uint64_t segments_left_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_spill_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::vector<UniqueFd>> fds_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<std::byte>> disk_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> corrupt_ ABSL_GUARDED_BY(mu_);
  // The next Restore meets a daemon crash: after it read the spill back
  // and deleted it (the answer lost), or with the spill lost. kNotResent:
  // read back, yet answered NOT_FOUND on its first try (no restart to
  // explain it: not taken as done).
  enum class Crash { kNone, kAfterReadBack, kSpillLost, kNotResent };
  Crash crash_ ABSL_GUARDED_BY(mu_) = Crash::kNone;
  bool fail_spills_ ABSL_GUARDED_BY(mu_) = false;
  int spills_ ABSL_GUARDED_BY(mu_) = 0;
  int restores_ ABSL_GUARDED_BY(mu_) = 0;
};

std::vector<std::byte> Bytes(size_t n, uint64_t seed) {
  std::vector<std::byte> out(n);
  std::mt19937_64 random(seed);
  for (auto& b : out) b = static_cast<std::byte>(random());
  return out;
}

struct Held {
  uint64_t ticket;
  std::vector<std::byte> data;
};

std::vector<Held> StoreMany(LocalStore& store, int n, size_t size, uint64_t seed) {
  std::vector<Held> held;
  for (int i = 0; i < n; ++i) {
    Held h{0, Bytes(size, seed + i)};
    absl::StatusOr<uint64_t> ticket = store.Store(h.data.data(), h.data.size());
    EXPECT_TRUE(ticket.ok()) << i << ": " << ticket.status();
    if (!ticket.ok()) break;
    h.ticket = *ticket;
    held.push_back(std::move(h));
  }
  return held;
}

void ExpectBack(LocalStore& store, const Held& h) {
  std::vector<std::byte> back(h.data.size());
  ASSERT_TRUE(store.Fetch(h.ticket, back.data(), back.size()).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), h.data.data(), back.size()));
}

TEST(LocalStoreSpillTest, ThreeTimesThePoolComesBackInBackwardOrder) {
  SpillingBackend backend(8);
  LocalStore store(&backend, kSegment, /*lease_batch=*/2, nullptr, false, /*restore_ahead=*/2);
  std::vector<Held> held = StoreMany(store, 96, 256 << 10, 1);  // 24 MiB through 8 MiB
  ASSERT_EQ(held.size(), 96u);
  EXPECT_GE(store.usage().spilled_bytes(), 14 * kSegment);
  EXPECT_LE(store.usage().leased_bytes(), 8 * kSegment);
  for (size_t i = held.size(); i-- > 0;) {
    ExpectBack(store, held[i]);
    ASSERT_TRUE(store.Release(held[i].ticket).ok());
  }
  const v1::ClientUsage usage = store.usage();
  EXPECT_EQ(usage.spilled_leases(), 0u);
  EXPECT_GT(usage.restores(), 0u);
  // Counted per lease read back before it was needed, not just flagged.
  EXPECT_GT(usage.restores_ahead(), 1u);
  EXPECT_LE(usage.restores_ahead(), usage.restores());
  absl::MutexLock lock(&backend.mu_);
  EXPECT_TRUE(backend.disk_.empty());
}

TEST(LocalStoreSpillTest, ColdestBlocksSpillFirst) {
  SpillingBackend backend(4);
  LocalStore store(&backend, kSegment, 1, nullptr, false, /*restore_ahead=*/0);
  std::vector<Held> held = StoreMany(store, 20, 512 << 10, 2);  // 10 segments' worth
  ASSERT_EQ(held.size(), 20u);
  // The first buffers are on disk, the last ones in memory: fetching the last
  // reads nothing back.
  ExpectBack(store, held.back());
  EXPECT_EQ(store.usage().restores(), 0u);
  ExpectBack(store, held.front());
  EXPECT_EQ(store.usage().restores(), 1u);
}

TEST(LocalStoreSpillTest, UnwrittenReservationsNeverSpill) {
  SpillingBackend backend(4);
  LocalStore store(&backend, kSegment, 1, nullptr, false, 0);
  std::vector<uint64_t> tickets;
  absl::Status status;
  for (int i = 0; i < 16 && status.ok(); ++i) {
    absl::StatusOr<Placed> placed = store.Reserve(kSegment / 2);
    status = placed.status();
    if (placed.ok()) tickets.push_back(placed->ticket);
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(std::string(status.message()).find("nothing more"), std::string::npos) << status;
  EXPECT_EQ(store.usage().spills(), 0u);
  for (uint64_t ticket : tickets) ASSERT_TRUE(store.MarkWritten(ticket).ok());
  EXPECT_TRUE(store.Reserve(kSegment / 2).ok());
  EXPECT_GT(store.usage().spills(), 0u);
}

TEST(LocalStoreSpillTest, LocatedBuffersStayWhereTheyWere) {
  SpillingBackend backend(4);
  LocalStore store(&backend, kSegment, 1, nullptr, false, 0);
  std::vector<Held> first = StoreMany(store, 1, 512 << 10, 3);
  absl::StatusOr<Located> located = store.Locate(first[0].ticket);
  ASSERT_TRUE(located.ok());
  std::vector<Held> more = StoreMany(store, 30, 512 << 10, 4);
  ASSERT_EQ(more.size(), 30u);
  EXPECT_GT(store.usage().spills(), 0u);
  // The located buffer's block never left memory: the pointer still holds it.
  EXPECT_EQ(0, std::memcmp(located->data, first[0].data.data(), first[0].data.size()));
  for (const Held& h : more) ExpectBack(store, h);
}

// An optimizer's states: reserved, written in place, parked between steps.
// Parked ones spill for others; located again, they come back with what was
// written last, and a located one stays put until parked again.
TEST(LocalStoreSpillTest, ParkedReservationsSpillAndComeBackWithTheirLastWrite) {
  SpillingBackend backend(4);
  LocalStore store(&backend, kSegment, 1, nullptr, false, 0);
  std::vector<uint64_t> states;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<Placed> placed = store.Reserve(kSegment / 2);
    ASSERT_TRUE(placed.ok()) << placed.status();
    std::memset(placed->data, 0x10 + i, kSegment / 2);
    states.push_back(placed->ticket);
  }
  // A step: each located (not counted as a fetch), updated in place, parked.
  const std::byte* last = nullptr;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(store.Park(states[i]).ok());
    absl::StatusOr<Located> located = store.Locate(states[i], ReadKind::kState);
    ASSERT_TRUE(located.ok()) << located.status();
    EXPECT_EQ(static_cast<uint8_t>(located->data[0]), 0x10 + i);
    std::memset(const_cast<std::byte*>(located->data), 0x20 + i, kSegment / 2);
    last = located->data;
    if (i != 3) {  // the last one stays located
      ASSERT_TRUE(store.Park(states[i]).ok());
    }
  }
  EXPECT_EQ(store.usage().fetches(), 0u);
  // Other buffers need the pool: the parked blocks spill, the located one not.
  std::vector<Held> others = StoreMany(store, 6, kSegment / 2, 7);
  ASSERT_EQ(others.size(), 6u);
  EXPECT_GT(store.usage().spills(), 0u);
  const uint64_t restores_before = store.usage().restores();
  absl::StatusOr<Located> kept = store.Locate(states[3], ReadKind::kState);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->data, last);  // never moved: nothing was read back for it
  EXPECT_EQ(store.usage().restores(), restores_before);
  EXPECT_EQ(static_cast<uint8_t>(kept->data[kSegment / 2 - 1]), 0x23);
  for (const Held& h : others) ASSERT_TRUE(store.Release(h.ticket).ok());
  const uint64_t restores = store.usage().restores();
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Located> back = store.Locate(states[i], ReadKind::kState);
    ASSERT_TRUE(back.ok()) << back.status();
    for (size_t at : {size_t{0}, size_t{kSegment / 2 - 1}}) {
      EXPECT_EQ(static_cast<uint8_t>(back->data[at]), 0x20 + i) << i;
    }
  }
  EXPECT_GT(store.usage().restores(), restores);
  EXPECT_EQ(store.Park(12345).code(), absl::StatusCode::kNotFound);
  for (uint64_t ticket : states) ASSERT_TRUE(store.Release(ticket).ok());
}

// A step reads its states in the order they were reserved: locating one reads
// the spilled ones reserved just after it back ahead (activations read ahead
// the other way), so the next locates find them in memory.
TEST(LocalStoreSpillTest, StatesReadAheadInReservationOrder) {
  SpillingBackend backend(8);
  LocalStore store(&backend, kSegment, 1, nullptr, false, /*restore_ahead=*/2);
  std::vector<uint64_t> states;
  for (int i = 0; i < 6; ++i) {  // a segment each
    absl::StatusOr<Placed> placed = store.Reserve(kSegment);
    ASSERT_TRUE(placed.ok()) << placed.status();
    std::memset(placed->data, 0x40 + i, kSegment);
    states.push_back(placed->ticket);
    ASSERT_TRUE(store.Park(placed->ticket).ok());
  }
  std::vector<Held> others = StoreMany(store, 8, kSegment, 9);  // all six go to disk
  ASSERT_EQ(others.size(), 8u);
  ASSERT_EQ(store.usage().spilled_leases(), 6u);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(store.Release(others[i].ticket).ok());
  absl::StatusOr<Located> first = store.Locate(states[0], ReadKind::kState);
  ASSERT_TRUE(first.ok()) << first.status();
  // The two after it come back in the background; locating them waits for
  // those read-backs, not for new ones.
  for (int i = 1; i < 3; ++i) {
    absl::StatusOr<Located> next = store.Locate(states[i], ReadKind::kState);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(static_cast<uint8_t>(next->data[kSegment - 1]), 0x40 + i);
  }
  EXPECT_GE(store.usage().restores_ahead(), 2u);
  EXPECT_EQ(store.usage().fetches(), 0u);
  absl::StatusOr<Located> last = store.Locate(states[5]);  // an activation's read
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(store.usage().fetches(), 1u);
}

TEST(LocalStoreSpillTest, FailedSpillKeepsEverythingAndSaysWhy) {
  SpillingBackend backend(4);
  LocalStore store(&backend, kSegment, 1, nullptr, false, 0);
  std::vector<Held> held = StoreMany(store, 8, 512 << 10, 5);  // the pool is full
  {
    absl::MutexLock lock(&backend.mu_);
    backend.fail_spills_ = true;
  }
  std::vector<std::byte> one(512 << 10);
  absl::StatusOr<uint64_t> refused = store.Store(one.data(), one.size());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(refused.status().message()).find("fake disk full"), std::string::npos);
  for (const Held& h : held) ExpectBack(store, h);
}

TEST(LocalStoreSpillTest, LostSpillIsDataLossForItsBuffersOnly) {
  SpillingBackend backend(4);
  LocalStore store(&backend, kSegment, 1, nullptr, false, 0);
  std::vector<Held> held = StoreMany(store, 16, 512 << 10, 6);
  {
    absl::MutexLock lock(&backend.mu_);
    ASSERT_FALSE(backend.disk_.empty());
    backend.corrupt_.insert(backend.disk_.begin()->first);
  }
  int lost = 0;
  for (const Held& h : held) {
    std::vector<std::byte> back(h.data.size());
    absl::Status status = store.Fetch(h.ticket, back.data(), back.size());
    if (status.code() == absl::StatusCode::kDataLoss) {
      ++lost;
      continue;
    }
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(0, std::memcmp(back.data(), h.data.data(), back.size()));
  }
  EXPECT_EQ(lost, 2);  // the two buffers of that segment
  for (const Held& h : held) EXPECT_TRUE(store.Release(h.ticket).ok());
}

TEST(LocalStoreSpillTest, ThreadsStoringAndReadingBackThroughSpillsKeepEveryByte) {
  // Four trainers' worth of buffers through one store at once: the threads
  // store together (leasing turns and spills interleave), wait for each
  // other, then each reads its own back in backward order and releases them
  // (read-backs by readers and ahead of them interleave with releases).
  // Every byte comes back, and everything spilled is read back or dropped.
  // Small buffers only, so that at most one block per thread is being
  // written or read and the rest can always spill.
  SpillingBackend backend(16);
  LocalStore store(&backend, kSegment, /*lease_batch=*/2, nullptr, false, /*restore_ahead=*/2);
  constexpr int kThreads = 4;
  constexpr int kBuffers = 48;  // 4 x 48 x 136 KiB on average: 25 MiB through 16
  absl::Mutex mu;
  int stored = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(100 + t);
      std::vector<Held> held;
      for (int i = 0; i < kBuffers; ++i) {
        const size_t size = (16 << 10) * (1 + random() % 16);  // 16 to 256 KiB
        Held h{0, Bytes(size, 1000 * t + i)};
        absl::StatusOr<uint64_t> ticket = store.Store(h.data.data(), h.data.size());
        EXPECT_TRUE(ticket.ok()) << "thread " << t << ", buffer " << i << ": " << ticket.status();
        if (!ticket.ok()) break;
        h.ticket = *ticket;
        held.push_back(std::move(h));
      }
      {
        absl::MutexLock lock(&mu);
        stored += 1;
        mu.Await(absl::Condition(
            +[](int* n) { return *n == kThreads; }, &stored));
      }
      for (size_t i = held.size(); i-- > 0;) {
        ExpectBack(store, held[i]);
        EXPECT_TRUE(store.Release(held[i].ticket).ok());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const v1::ClientUsage usage = store.usage();
  EXPECT_GT(usage.spills(), 0u);
  EXPECT_GT(usage.restores(), 0u);
  EXPECT_EQ(usage.objects(), 0u);
  EXPECT_EQ(usage.bytes(), 0u);
  EXPECT_EQ(usage.spilled_leases(), 0u);
  EXPECT_EQ(usage.spilled_bytes(), 0u);
  EXPECT_LE(usage.leased_bytes(), 16 * kSegment);
  absl::MutexLock lock(&backend.mu_);
  EXPECT_TRUE(backend.disk_.empty());
}

// Waits (up to a minute) until `usage().restores_ahead()` reaches `n`.
bool RestoresAheadReach(LocalStore& store, uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (store.usage().restores_ahead() < n) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(LocalStoreSpillTest, ABlockReadAheadAndSpilledAgainUnreadIsReadAheadAgain) {
  // Two segments, one read-ahead; each buffer fills most of a segment, so a
  // buffer is a block. A, B spill for C, D; D goes unread; reading C reads B
  // back ahead into D's lease. Then E spills B again (the coldest) before
  // anyone read it. Once E goes, reading C must read B ahead again: before,
  // B kept its place in the read-ahead from the first time, and nothing more
  // was ever read ahead.
  SpillingBackend backend(2);
  LocalStore store(&backend, kSegment, /*lease_batch=*/1, nullptr, false, /*restore_ahead=*/1);
  std::vector<Held> held = StoreMany(store, 4, 768 << 10, 40);  // A, B, C, D
  ASSERT_EQ(held.size(), 4u);
  ASSERT_EQ(store.usage().spilled_leases(), 2u);
  ASSERT_TRUE(store.Release(held[3].ticket).ok());  // D, unread
  ExpectBack(store, held[2]);                       // C: B is read ahead
  ASSERT_TRUE(RestoresAheadReach(store, 1));
  std::vector<Held> e = StoreMany(store, 1, 768 << 10, 50);  // spills B, unread
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(store.usage().spilled_leases(), 2u);  // A and B
  ASSERT_TRUE(store.Release(e[0].ticket).ok());
  ExpectBack(store, held[2]);  // C again: B is read ahead again
  EXPECT_TRUE(RestoresAheadReach(store, 2)) << "restores ahead: " << store.usage().restores_ahead();
  for (int i = 2; i >= 0; --i) {
    ExpectBack(store, held[i]);
    ASSERT_TRUE(store.Release(held[i].ticket).ok());
  }
  const v1::ClientUsage usage = store.usage();
  EXPECT_EQ(usage.spilled_leases(), 0u);
  EXPECT_EQ(usage.spilled_bytes(), 0u);
  EXPECT_LE(usage.restores_ahead(), usage.restores());
  absl::MutexLock lock(&backend.mu_);
  EXPECT_TRUE(backend.disk_.empty());
}

TEST(LocalStoreSpillTest, ARestoreWhoseAnswerWasLostInACrashFindsItsBytesInTheLease) {
  // The daemon reads a spill back into the lease, deletes the spill, and
  // crashes before it answers; its successor answers the resent Restore
  // NOT_FOUND. The lease holds the bytes (its memory outlived the daemon):
  // the read goes on. Where the spill was lost instead, the lease's bytes
  // are not the spill's, and the read fails with NOT_FOUND; so it does when
  // the call was not sent again (nothing explains a NOT_FOUND then).
  for (const auto crash :
       {SpillingBackend::Crash::kAfterReadBack, SpillingBackend::Crash::kSpillLost,
        SpillingBackend::Crash::kNotResent}) {
    SCOPED_TRACE(static_cast<int>(crash));
    SpillingBackend backend(2);
    LocalStore store(&backend, kSegment, 1, nullptr, false, /*restore_ahead=*/0);
    std::vector<Held> held = StoreMany(store, 6, 768 << 10, 70);
    ASSERT_EQ(held.size(), 6u);
    ASSERT_GE(store.usage().spilled_leases(), 1u);
    {
      absl::MutexLock lock(&backend.mu_);
      backend.crash_ = crash;
    }
    std::vector<std::byte> back(held[0].data.size());
    const absl::Status status = store.Fetch(held[0].ticket, back.data(), back.size());
    {
      absl::MutexLock lock(&backend.mu_);
      ASSERT_EQ(backend.crash_, SpillingBackend::Crash::kNone) << "no Restore was sent";
    }
    if (crash == SpillingBackend::Crash::kAfterReadBack) {
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(0, std::memcmp(back.data(), held[0].data.data(), back.size()));
      for (size_t i = 1; i < held.size(); ++i) ExpectBack(store, held[i]);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
      EXPECT_NE(std::string(status.message()).find("cannot be read back"), std::string::npos);
    }
    for (const Held& h : held) EXPECT_TRUE(store.Release(h.ticket).ok());
  }
}

TEST(LocalStoreSpillTest, AReadWaitsForAReadAheadThatHoldsTheLastOfTheQuota) {
  // A quota of two blocks. A, B spill for C, D; D is released and C located
  // (pinned), so reading C reads B back ahead into D's lease, slowly. A read
  // of A meanwhile finds the quota full and nothing spillable: it must wait
  // for B to land and spill it, not fail (a quota error is not another
  // session's memory, which was the only thing worth waiting for before).
  SpillingBackend backend(2);
  backend.quota_errors_ = true;
  backend.restore_delay_ = std::chrono::milliseconds(300);
  LocalStore store(&backend, kSegment, /*lease_batch=*/1, nullptr, false, /*restore_ahead=*/1);
  std::vector<Held> held = StoreMany(store, 4, 768 << 10, 60);  // A, B, C, D
  ASSERT_EQ(held.size(), 4u);
  ASSERT_EQ(store.usage().spilled_leases(), 2u);
  ASSERT_TRUE(store.Release(held[3].ticket).ok());
  absl::StatusOr<Located> c = store.Locate(held[2].ticket);
  ASSERT_TRUE(c.ok()) << c.status();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (backend.restore_calls_ < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(backend.restore_calls_, 1) << "B was not read back ahead";
  const uint64_t spills_before = store.usage().spills();
  ExpectBack(store, held[0]);                            // A, while B is on its way
  EXPECT_EQ(store.usage().spills(), spills_before + 1);  // B went again, unread
  EXPECT_EQ(0, std::memcmp(c->data, held[2].data.data(), held[2].data.size()));
  ASSERT_TRUE(store.Release(held[0].ticket).ok());
  ASSERT_TRUE(store.Release(held[2].ticket).ok());
  ExpectBack(store, held[1]);
  ASSERT_TRUE(store.Release(held[1].ticket).ok());
  EXPECT_GE(store.usage().restores_ahead(), 1u);
  absl::MutexLock lock(&backend.mu_);
  EXPECT_TRUE(backend.disk_.empty());
}

}  // namespace
}  // namespace actstash::client_internal
