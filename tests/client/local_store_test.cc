// LocalStore against a fake LeaseBackend that hands out real memfds: arena
// placement, dedicated leases, giving segments back, failures, concurrency.
#include "client/store/local_store.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"

namespace actstash::client_internal {
namespace {

constexpr uint64_t kSegment = 1 << 20;

class FakeBackend : public LeaseBackend {
 public:
  absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t count,
                                                  uint32_t segments_per_lease) override {
    absl::MutexLock lock(&mu_);
    ++lease_calls_;
    if (uint64_t{count} * segments_per_lease > segments_left_) {
      return absl::ResourceExhaustedError("fake pool exhausted");
    }
    segments_left_ -= uint64_t{count} * segments_per_lease;
    std::vector<GrantedLease> granted;
    for (uint32_t i = 0; i < count; ++i) {
      GrantedLease lease{next_id_++, segments_per_lease, {}, std::nullopt};
      for (uint32_t s = 0; s < segments_per_lease; ++s) {
        UniqueFd fd(memfd_create("fake-segment", MFD_CLOEXEC));
        EXPECT_EQ(ftruncate(fd.get(), kSegment), 0);
        lease.fds.push_back(std::move(fd));
      }
      segments_by_lease_[lease.lease_id] = segments_per_lease;
      granted.push_back(std::move(lease));
    }
    return granted;
  }
  absl::Status Return(absl::Span<const uint64_t> ids) override {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : ids) {
      auto it = segments_by_lease_.find(id);
      if (it == segments_by_lease_.end()) return absl::NotFoundError("unknown lease");
      segments_left_ += it->second;
      segments_by_lease_.erase(it);
      ++returned_;
    }
    return absl::OkStatus();
  }
  bool Lost() const override { return lost_.load(); }

  void SetSegments(uint64_t n) {
    absl::MutexLock lock(&mu_);
    segments_left_ = n;
  }
  size_t leased() {
    absl::MutexLock lock(&mu_);
    return segments_by_lease_.size();
  }
  int lease_calls() {
    absl::MutexLock lock(&mu_);
    return lease_calls_;
  }
  std::atomic<bool> lost_{false};

 private:
  absl::Mutex mu_;
  uint64_t segments_left_ ABSL_GUARDED_BY(mu_) = 1000;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, uint32_t> segments_by_lease_ ABSL_GUARDED_BY(mu_);
  int lease_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int returned_ ABSL_GUARDED_BY(mu_) = 0;
};

std::vector<char> Pattern(size_t n, char seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(seed + i * 7);
  return v;
}

TEST(LocalStoreTest, SmallBuffersShareLeasedSegmentsAndLeaseInBatches) {
  FakeBackend backend;
  LocalStore store(&backend, kSegment, /*lease_batch=*/2);
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 64; ++i) {  // 64 × 32 KiB = 2 segments
    const std::vector<char> data = Pattern(32 << 10, static_cast<char>(i));
    absl::StatusOr<uint64_t> t = store.Store(data.data(), data.size());
    ASSERT_TRUE(t.ok()) << t.status();
    tickets.push_back(*t);
  }
  EXPECT_EQ(backend.lease_calls(), 1) << "one batch of two segments holds all";
  EXPECT_EQ(store.usage().leases(), 2u);
  EXPECT_EQ(store.usage().objects(), 64u);
  for (int i = 0; i < 64; ++i) {
    std::vector<char> back(32 << 10);
    ASSERT_TRUE(store.Fetch(tickets[i], back.data(), back.size()).ok());
    ASSERT_EQ(back, Pattern(32 << 10, static_cast<char>(i)));
  }
  for (uint64_t t : tickets) ASSERT_TRUE(store.Release(t).ok());
  EXPECT_EQ(store.usage().objects(), 0u);
  EXPECT_EQ(store.usage().leases(), 2u) << "empty segments up to the batch stay leased";
  EXPECT_EQ(store.Release(tickets[0]).code(), absl::StatusCode::kNotFound);
}

TEST(LocalStoreTest, LargeBuffersGetDedicatedLeasesReturnedOnRelease) {
  FakeBackend backend;
  LocalStore store(&backend, kSegment, 1);
  const std::vector<char> big = Pattern(3 * kSegment + 5, 3);
  absl::StatusOr<uint64_t> t = store.Store(big.data(), big.size());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(store.usage().leased_bytes(), 4 * kSegment);
  std::vector<char> back(big.size());
  ASSERT_TRUE(store.Fetch(*t, back.data(), back.size()).ok());
  EXPECT_EQ(back, big);
  EXPECT_EQ(store.Fetch(*t, back.data(), back.size() - 1).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(store.Release(*t).ok());
  EXPECT_EQ(store.usage().leases(), 1u) << "the last dedicated lease is kept as a spare";
  const int calls = backend.lease_calls();
  absl::StatusOr<uint64_t> again = store.Store(big.data(), big.size());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(backend.lease_calls(), calls) << "a buffer of the same size reuses the spare";
  ASSERT_TRUE(store.Fetch(*again, back.data(), back.size()).ok());
  EXPECT_EQ(back, big);
  ASSERT_TRUE(store.Release(*again).ok());
  const std::vector<char> bigger = Pattern(5 * kSegment, 4);
  absl::StatusOr<uint64_t> other = store.Store(bigger.data(), bigger.size());
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(backend.leased(), 1u) << "the spare that did not fit went back";
  ASSERT_TRUE(store.Release(*other).ok());
  EXPECT_EQ(backend.leased(), 1u);
}

TEST(LocalStoreTest, EmptySegmentsBeyondTheBatchGoBack) {
  FakeBackend backend;
  LocalStore store(&backend, kSegment, 1);
  std::vector<uint64_t> tickets;
  const std::vector<char> data = Pattern(kSegment * 3 / 4, 1);
  for (int i = 0; i < 4; ++i) tickets.push_back(*store.Store(data.data(), data.size()));
  EXPECT_EQ(backend.leased(), 4u);
  for (uint64_t t : tickets) ASSERT_TRUE(store.Release(t).ok());
  EXPECT_EQ(backend.leased(), 1u) << "one empty segment (the batch) is kept";
}

TEST(LocalStoreTest, ExhaustionIsReportedAndNothingIsHalfStored) {
  FakeBackend backend;
  backend.SetSegments(1);
  LocalStore store(&backend, kSegment, 4);  // a batch of 4 cannot be had; 1 can
  const std::vector<char> data = Pattern(kSegment / 2 + 1, 2);
  absl::StatusOr<uint64_t> first = store.Store(data.data(), data.size());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<uint64_t> second = store.Store(data.data(), data.size());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.usage().objects(), 1u);
  std::vector<char> back(data.size());
  ASSERT_TRUE(store.Fetch(*first, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
}

TEST(LocalStoreTest, AfterTheDaemonIsLostStoredBuffersStayReadable) {
  FakeBackend backend;
  LocalStore store(&backend, kSegment, 1);
  const std::vector<char> data = Pattern(1000, 9);
  absl::StatusOr<uint64_t> t = store.Store(data.data(), data.size());
  ASSERT_TRUE(t.ok());
  backend.lost_ = true;
  EXPECT_EQ(store.Store(data.data(), data.size()).status().code(), absl::StatusCode::kUnavailable);
  std::vector<char> back(1000);
  ASSERT_TRUE(store.Fetch(*t, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_TRUE(store.Release(*t).ok());
}

TEST(LocalStoreTest, ConcurrentThreadsNeverSeeEachOthersBytes) {
  FakeBackend backend;
  LocalStore store(&backend, kSegment, 2);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<uint64_t, std::vector<char>>> live;
      for (int op = 0; op < 3000; ++op) {
        if (live.empty() || rng() % 2 == 0) {
          std::vector<char> data = Pattern(rng() % 50000, static_cast<char>(rng()));
          absl::StatusOr<uint64_t> ticket = store.Store(data.data(), data.size());
          if (!ticket.ok()) {
            ++errors;
            continue;
          }
          live.emplace_back(*ticket, std::move(data));
        } else {
          const size_t k = rng() % 3 == 0 ? rng() % live.size() : live.size() - 1;
          std::vector<char> back(live[k].second.size());
          if (!store.Fetch(live[k].first, back.data(), back.size()).ok() ||
              back != live[k].second || !store.Release(live[k].first).ok()) {
            ++errors;
          }
          live.erase(live.begin() + static_cast<long>(k));
        }
      }
      for (auto& [ticket, data] : live) {
        if (!store.Release(ticket).ok()) ++errors;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(store.usage().objects(), 0u);
  EXPECT_EQ(store.usage().bytes(), 0u);
}

// Records registrations like CUDA would (a range must be registered once and
// unregistered, by its start, before it is unmapped); can be told to fail.
class FakeRegistrar : public PinnedRegistrar {
 public:
  absl::Status Register(void* ptr, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    if (fail_) return absl::ResourceExhaustedError("fake.cc:1: cudaHostRegister failed");
    EXPECT_TRUE(live_.emplace(ptr, bytes).second) << "registered twice";
    ++registrations_;
    return absl::OkStatus();
  }
  absl::Status Unregister(void* ptr) override {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(live_.erase(ptr), 1u) << "unregistering a range never registered";
    return absl::OkStatus();
  }
  void set_fail(bool fail) {
    absl::MutexLock lock(&mu_);
    fail_ = fail;
  }
  // Stands in for "the calling thread runs CUDA work".
  bool Ready() const override { return ready_.load(); }
  std::atomic<bool> ready_{true};
  size_t live() {
    absl::MutexLock lock(&mu_);
    return live_.size();
  }
  int registrations() {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }

 private:
  absl::Mutex mu_;
  bool fail_ ABSL_GUARDED_BY(mu_) = false;
  std::map<void*, size_t> live_ ABSL_GUARDED_BY(mu_);
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(LocalStorePinningTest, EachLeaseIsRegisteredOnceWhileMapped) {
  FakeBackend backend;
  FakeRegistrar registrar;
  {
    LocalStore store(&backend, kSegment, /*lease_batch=*/2, &registrar, false, 2,
                     std::chrono::seconds(30), /*retain=*/std::chrono::milliseconds(0));
    std::vector<uint64_t> tickets;
    for (int i = 0; i < 100; ++i) {  // 100 × 32 KiB: two batches of two segments
      const std::vector<char> data = Pattern(32 << 10, static_cast<char>(i));
      absl::StatusOr<uint64_t> t = store.Store(data.data(), data.size());
      ASSERT_TRUE(t.ok()) << t.status();
      tickets.push_back(*t);
    }
    EXPECT_EQ(registrar.registrations(), 4) << "once per lease, not per buffer";
    EXPECT_EQ(store.usage().pinned_bytes(), 4 * kSegment);
    const std::vector<char> big = Pattern(2 * kSegment, 9);  // a dedicated lease
    absl::StatusOr<uint64_t> t = store.Store(big.data(), big.size());
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(registrar.live(), 5u);
    for (uint64_t ticket : tickets) ASSERT_TRUE(store.Release(ticket).ok());
    EXPECT_EQ(registrar.live(), 3u) << "segments given back were unregistered first";
    EXPECT_EQ(store.usage().pinned_bytes(), store.usage().leased_bytes());
    EXPECT_TRUE(store.pin_status().ok());
  }
  EXPECT_EQ(registrar.live(), 0u) << "the store unregisters everything it unmaps";
}

TEST(LocalStorePinningTest, AFailedRegistrationFallsBackToUnpinnedAndSaysWhy) {
  FakeBackend backend;
  FakeRegistrar registrar;
  registrar.set_fail(true);
  LocalStore store(&backend, kSegment, 1, &registrar);
  const std::vector<char> data = Pattern(4096, 1);
  absl::StatusOr<uint64_t> t = store.Store(data.data(), data.size());
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<char> back(data.size());
  ASSERT_TRUE(store.Fetch(*t, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ(store.usage().unpinned_leases(), 1u);
  EXPECT_EQ(store.usage().pinned_bytes(), 0u);
  EXPECT_EQ(store.pin_status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(store.pin_status().message().find("cudaHostRegister failed"), std::string::npos)
      << store.pin_status();
  absl::StatusOr<Located> where = store.Locate(*t);
  ASSERT_TRUE(where.ok());
  EXPECT_FALSE(where->pinned);
}

TEST(LocalStorePinningTest, RequiredPinningFailsTheStoreAndReturnsTheLease) {
  FakeBackend backend;
  FakeRegistrar registrar;
  registrar.set_fail(true);
  LocalStore store(&backend, kSegment, 1, &registrar, /*require_pinned=*/true);
  const std::vector<char> data = Pattern(4096, 1);
  absl::StatusOr<uint64_t> t = store.Store(data.data(), data.size());
  ASSERT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("required"), std::string::npos) << t.status();
  EXPECT_EQ(backend.leased(), 0u) << "the unusable lease went back";
  EXPECT_EQ(store.usage().objects(), 0u);
  registrar.set_fail(false);
  EXPECT_TRUE(store.Store(data.data(), data.size()).ok());
}

TEST(LocalStorePinningTest, ALeaseMappedWithoutCudaWorkIsPinnedByTheFirstReserveWithIt) {
  FakeBackend backend;
  FakeRegistrar registrar;
  registrar.ready_ = false;  // e.g. a CPU tensor offloaded first, on a thread without CUDA
  LocalStore store(&backend, kSegment, 1, &registrar);
  const std::vector<char> data = Pattern(4096, 1);
  ASSERT_TRUE(store.Store(data.data(), data.size()).ok());
  EXPECT_EQ(registrar.registrations(), 0);
  EXPECT_EQ(store.usage().pinned_bytes(), 0u);
  registrar.ready_ = true;  // now a thread with CUDA work reserves in the same lease
  absl::StatusOr<Placed> placed = store.Reserve(4096);
  ASSERT_TRUE(placed.ok());
  EXPECT_TRUE(placed->pinned);
  EXPECT_EQ(registrar.registrations(), 1);
  EXPECT_EQ(store.usage().pinned_bytes(), kSegment);
  ASSERT_TRUE(store.Reserve(4096).ok());
  EXPECT_EQ(registrar.registrations(), 1) << "once per lease";
  EXPECT_TRUE(store.pin_status().ok());
}

// One training step's worth of buffers: four that take a segment each and
// one that takes a dedicated lease of two; all released, as backward does.
void StoreAndReleaseAStep(LocalStore& store) {
  std::vector<uint64_t> tickets;
  const std::vector<char> small = Pattern(kSegment * 3 / 4, 1);
  const std::vector<char> big = Pattern(2 * kSegment, 2);
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<uint64_t> t = store.Store(small.data(), small.size());
    ASSERT_TRUE(t.ok()) << t.status();
    tickets.push_back(*t);
  }
  absl::StatusOr<uint64_t> t = store.Store(big.data(), big.size());
  ASSERT_TRUE(t.ok()) << t.status();
  tickets.push_back(*t);
  for (uint64_t ticket : tickets) ASSERT_TRUE(store.Release(ticket).ok());
}

TEST(LocalStoreRetentionTest, RegisteredLeasesStayForTheNextStepAndAreNotRegisteredAgain) {
  FakeBackend backend;
  FakeRegistrar registrar;
  LocalStore store(&backend, kSegment, /*lease_batch=*/1, &registrar, false, 2,
                   std::chrono::seconds(30), std::chrono::seconds(60));
  StoreAndReleaseAStep(store);
  EXPECT_EQ(registrar.registrations(), 5);
  EXPECT_EQ(backend.leased(), 5u) << "emptied registered leases are retained";
  EXPECT_EQ(store.usage().pinned_bytes(), 6 * kSegment);
  const int lease_calls = backend.lease_calls();
  for (int step = 0; step < 3; ++step) StoreAndReleaseAStep(store);
  EXPECT_EQ(registrar.registrations(), 5) << "later steps reuse the registered leases";
  EXPECT_EQ(backend.lease_calls(), lease_calls) << "and lease nothing";
}

TEST(LocalStoreRetentionTest, LeasesEmptyLongerThanTheRetentionGoBack) {
  FakeBackend backend;
  FakeRegistrar registrar;
  LocalStore store(&backend, kSegment, /*lease_batch=*/1, &registrar, false, 2,
                   std::chrono::seconds(30), std::chrono::milliseconds(50));
  StoreAndReleaseAStep(store);
  // The sweeper gives back all but the usual: one empty segment (the batch)
  // and one spare dedicated lease.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (backend.leased() > 2u && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(backend.leased(), 2u);
  EXPECT_EQ(registrar.live(), 2u) << "unregistered before they went back";
  EXPECT_EQ(store.usage().leased_bytes(), 3 * kSegment);
  EXPECT_EQ(store.usage().pinned_bytes(), 3 * kSegment);
}

TEST(LocalStoreRetentionTest, AFullPoolTakesRetainedLeasesBackBeforeRefusing) {
  FakeBackend backend;
  backend.SetSegments(6);  // one step's worth: 4 segments and a lease of 2
  FakeRegistrar registrar;
  LocalStore store(&backend, kSegment, /*lease_batch=*/1, &registrar, false, 2,
                   std::chrono::seconds(30), std::chrono::seconds(60));
  StoreAndReleaseAStep(store);
  ASSERT_EQ(backend.leased(), 5u);  // all retained: the pool has nothing left
  // A buffer of another size needs a lease of 3 segments: retention gives way.
  const std::vector<char> other = Pattern(3 * kSegment, 3);
  absl::StatusOr<uint64_t> t = store.Store(other.data(), other.size());
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<char> back(other.size());
  ASSERT_TRUE(store.Fetch(*t, back.data(), back.size()).ok());
  EXPECT_EQ(back, other);
  EXPECT_TRUE(store.Release(*t).ok());
}

TEST(LocalStoreRetentionTest, UnregisteredLeasesAreNotRetained) {
  FakeBackend backend;
  FakeRegistrar registrar;
  registrar.set_fail(true);
  LocalStore store(&backend, kSegment, /*lease_batch=*/1, &registrar, false, 2,
                   std::chrono::seconds(30), std::chrono::seconds(60));
  StoreAndReleaseAStep(store);
  EXPECT_EQ(backend.leased(), 2u) << "the batch and the spare, as without retention";
}

TEST(LocalStoreReserveTest, ReservedBytesAreWrittenByTheCallerAndLocatedForReading) {
  FakeBackend backend;
  LocalStore store(&backend, kSegment, 1);
  std::vector<std::pair<uint64_t, std::vector<char>>> stored;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{kSegment}, 2 * kSegment + 3}) {
    absl::StatusOr<Placed> placed = store.Reserve(n);
    ASSERT_TRUE(placed.ok()) << placed.status();
    const std::vector<char> data = Pattern(n, static_cast<char>(n));
    if (n > 0) std::memcpy(placed->data, data.data(), n);  // "the device copy"
    stored.emplace_back(placed->ticket, data);
  }
  const uint64_t fetches = store.usage().fetches();
  for (const auto& [ticket, data] : stored) {
    absl::StatusOr<Located> where = store.Locate(ticket);
    ASSERT_TRUE(where.ok()) << where.status();
    ASSERT_EQ(where->size, data.size());
    // memcmp's pointers must be valid even for 0 bytes (a 0-byte object has none).
    if (!data.empty()) {
      EXPECT_EQ(std::memcmp(where->data, data.data(), data.size()), 0);
    }
    std::vector<char> back(data.size());  // Fetch reads the same bytes
    ASSERT_TRUE(store.Fetch(ticket, back.data(), back.size()).ok());
    EXPECT_EQ(back, data);
  }
  EXPECT_EQ(store.usage().fetches(), fetches + 2 * stored.size());
  for (const auto& entry : stored) ASSERT_TRUE(store.Release(entry.first).ok());
  EXPECT_EQ(store.Locate(stored[0].first).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.usage().objects(), 0u);
}

// The host and device stores' usage is reported as one: every counter of
// the message is summed, including ones added to the proto later.
TEST(AddUsageTest, SumsEveryCounterOfTheMessage) {
  const google::protobuf::Descriptor* d = v1::ClientUsage::descriptor();
  const google::protobuf::Reflection* r = v1::ClientUsage::GetReflection();
  ASSERT_GE(d->field_count(), 17);
  v1::ClientUsage from, to;
  for (int i = 0; i < d->field_count(); ++i) {
    r->SetUInt64(&from, d->field(i), i + 1);
    r->SetUInt64(&to, d->field(i), 100 * (i + 1));
  }
  AddUsage(from, &to);
  for (int i = 0; i < d->field_count(); ++i) {
    EXPECT_EQ(r->GetUInt64(to, d->field(i)), 101u * (i + 1)) << d->field(i)->name();
  }
  EXPECT_EQ(r->GetUInt64(from, d->field(0)), 1u) << "the source is left as it was";
}

}  // namespace
}  // namespace actstash::client_internal
