// The host pool's CUDA registration (HostPoolOptions::cuda_registrar), with a
// fake registrar that records every call and the first byte of the range at
// that moment (so renewal's order shows: unregistered while the old pages are
// still mapped, registered again once the fresh ones are).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/pinned_registrar.h"
#include "server/pool/host_pool.h"
#include "server/pool/memory_pool.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

struct Event {
  bool registered = false;  // Register, else Unregister
  std::byte* ptr = nullptr;
  uint64_t bytes = 0;
  std::byte first_byte{};
};

// Thread-safe. Fails the Register calls whose 0-based index is in
// `fail_calls`, or every one with `fail_all`.
class FakeRegistrar final : public PinnedRegistrar {
 public:
  absl::Status Register(void* ptr, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    const uint64_t call = register_calls_++;
    auto* p = static_cast<std::byte*>(ptr);
    events_.push_back({true, p, bytes, *p});
    if (fail_all_ || fail_calls_.count(call) > 0) {
      return absl::ResourceExhaustedError(absl::StrCat("fake cudaHostRegister failed #", call));
    }
    if (!live_.insert(p).second) return absl::InternalError("fake: registered twice");
    return absl::OkStatus();
  }
  absl::Status Unregister(void* ptr) override {
    absl::MutexLock lock(&mu_);
    auto* p = static_cast<std::byte*>(ptr);
    events_.push_back({false, p, 0, *p});
    if (live_.erase(p) == 0) return absl::InternalError("fake: not registered");
    return absl::OkStatus();
  }

  void FailAll(bool fail) {
    absl::MutexLock lock(&mu_);
    fail_all_ = fail;
  }
  void FailCall(uint64_t call) {
    absl::MutexLock lock(&mu_);
    fail_calls_.insert(call);
  }
  std::vector<Event> TakeEvents() {
    absl::MutexLock lock(&mu_);
    return std::move(events_);
  }
  size_t live() const {
    absl::MutexLock lock(&mu_);
    return live_.size();
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t register_calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool fail_all_ ABSL_GUARDED_BY(mu_) = false;
  std::set<uint64_t> fail_calls_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  std::set<std::byte*> live_ ABSL_GUARDED_BY(mu_);
};

HostPoolOptions Options(FakeRegistrar* registrar, bool require, uint64_t segments = 4) {
  HostPoolOptions options;
  options.pool_bytes = segments * kMiB;
  options.segment_bytes = kMiB;
  options.mlock = Tristate::kOff;
  options.cuda_registrar = registrar;
  options.require_cuda_pinned = require;
  return options;
}

// The pool's base address: all segments as one run (the pool is empty).
std::byte* PoolBase(SegmentLeaser& pool) {
  absl::StatusOr<SegmentRun> all = pool.AllocateSegments(pool.segment_count());
  EXPECT_TRUE(all.ok()) << all.status();
  return all.ok() ? all->memory.data() : nullptr;
}

TEST(HostPoolRegistrationTest, EverySegmentRegisteredOnceAtCreation) {
  FakeRegistrar registrar;
  auto pool = CreateHostPool(Options(&registrar, /*require=*/false));
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::byte* base = PoolBase(**pool);
  const std::vector<Event> events = registrar.TakeEvents();
  ASSERT_EQ(events.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(events[i].registered);
    EXPECT_EQ(events[i].ptr, base + i * kMiB) << i;
    EXPECT_EQ(events[i].bytes, kMiB);
  }
  EXPECT_EQ(registrar.live(), 4u);
  EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 4 * kMiB);
}

TEST(HostPoolRegistrationTest, NoRegistrarMeansNothingRegistered) {
  auto pool = CreateHostPool(Options(nullptr, /*require=*/false));
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 0u);
}

TEST(HostPoolRegistrationTest, RenewalUnregistersBeforeTheRemapAndRegistersAfter) {
  FakeRegistrar registrar;
  auto pool = CreateHostPool(Options(&registrar, /*require=*/false));
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<SegmentRun> first = (*pool)->AllocateSegments(1);
  absl::StatusOr<SegmentRun> run = (*pool)->AllocateSegments(2);
  ASSERT_TRUE(first.ok() && run.ok());
  std::byte* at = run->memory.data();
  std::memset(at, 0xab, 2 * kMiB);
  registrar.TakeEvents();

  ASSERT_TRUE((*pool)->RenewSegments(*run).ok());
  // Per segment: unregistered while the old pages (0xab) are mapped, then
  // registered on the fresh (zeroed) ones. Nothing else touched.
  const std::vector<Event> events = registrar.TakeEvents();
  ASSERT_EQ(events.size(), 4u);
  for (uint64_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(i);
    const Event& unreg = events[2 * i];
    const Event& reg = events[2 * i + 1];
    EXPECT_FALSE(unreg.registered);
    EXPECT_EQ(unreg.ptr, at + i * kMiB);
    EXPECT_EQ(unreg.first_byte, std::byte{0xab});
    EXPECT_TRUE(reg.registered);
    EXPECT_EQ(reg.ptr, at + i * kMiB);
    EXPECT_EQ(reg.bytes, kMiB);
    EXPECT_EQ(reg.first_byte, std::byte{0});
  }
  EXPECT_EQ(registrar.live(), 4u);
  EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 4 * kMiB);
}

TEST(HostPoolRegistrationTest, DestructionUnregistersEverySegmentWhileMapped) {
  FakeRegistrar registrar;
  std::set<std::byte*> segments;
  {
    auto pool = CreateHostPool(Options(&registrar, /*require=*/false));
    ASSERT_TRUE(pool.ok()) << pool.status();
    {
      absl::StatusOr<SegmentRun> all = (*pool)->AllocateSegments(4);
      ASSERT_TRUE(all.ok());
      std::memset(all->memory.data(), 0x5a, 4 * kMiB);
    }
    for (const Event& e : registrar.TakeEvents()) segments.insert(e.ptr);
  }
  const std::vector<Event> events = registrar.TakeEvents();
  ASSERT_EQ(events.size(), 4u);
  std::set<std::byte*> unregistered;
  for (const Event& e : events) {
    EXPECT_FALSE(e.registered);
    EXPECT_EQ(e.first_byte, std::byte{0x5a});  // read through the still-live mapping
    unregistered.insert(e.ptr);
  }
  EXPECT_EQ(unregistered, segments);
  EXPECT_EQ(registrar.live(), 0u);
}

TEST(HostPoolRegistrationTest, FailureWithoutRequireKeepsThePoolUsable) {
  FakeRegistrar registrar;
  registrar.FailAll(true);
  {
    auto pool = CreateHostPool(Options(&registrar, /*require=*/false));
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 0u);
    absl::StatusOr<Allocation> a = (*pool)->Allocate(3 * kMiB);
    ASSERT_TRUE(a.ok()) << a.status();
    std::memset(a->data(), 0x11, a->size());
    a->Reset();
    // Renewal tries again (and fails again): still fine, still 0 pinned.
    absl::StatusOr<SegmentRun> run = (*pool)->AllocateSegments(1);
    ASSERT_TRUE(run.ok());
    EXPECT_TRUE((*pool)->RenewSegments(*run).ok());
    EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 0u);
    registrar.TakeEvents();
  }
  // Nothing was registered, so nothing is unregistered.
  EXPECT_TRUE(registrar.TakeEvents().empty());
}

TEST(HostPoolRegistrationTest, PartialFailureCountsOnlyRegisteredSegments) {
  FakeRegistrar registrar;
  registrar.FailCall(1);
  {
    auto pool = CreateHostPool(Options(&registrar, /*require=*/false));
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 3 * kMiB);
    registrar.TakeEvents();
  }
  EXPECT_EQ(registrar.TakeEvents().size(), 3u);  // the three that were registered
  EXPECT_EQ(registrar.live(), 0u);
}

TEST(HostPoolRegistrationTest, FailureWithRequireFailsCreationWithTheError) {
  FakeRegistrar registrar;
  registrar.FailCall(2);
  auto pool = CreateHostPool(Options(&registrar, /*require=*/true));
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kResourceExhausted) << pool.status();
  const std::string message(pool.status().message());
  EXPECT_NE(message.find("fake cudaHostRegister failed #2"), std::string::npos) << message;
  EXPECT_NE(message.find("segment 2 of 4"), std::string::npos) << message;
  // The two registered before the failure were given back.
  EXPECT_EQ(registrar.live(), 0u);
}

TEST(HostPoolRegistrationTest, RenewalThatCannotRegisterAgainFailsOnlyWithRequire) {
  for (bool require : {false, true}) {
    SCOPED_TRACE(require ? "require" : "auto");
    FakeRegistrar registrar;
    auto pool = CreateHostPool(Options(&registrar, require));
    ASSERT_TRUE(pool.ok()) << pool.status();
    absl::StatusOr<SegmentRun> run = (*pool)->AllocateSegments(1);
    ASSERT_TRUE(run.ok());
    registrar.FailAll(true);
    const absl::Status renewed = (*pool)->RenewSegments(*run);
    EXPECT_EQ(renewed.ok(), !require) << renewed;
    EXPECT_EQ((*pool)->Stats().cuda_pinned_bytes(), 3 * kMiB);
    EXPECT_EQ(registrar.live(), 3u);
    // The renewed segment is zeroed and usable either way.
    EXPECT_EQ(run->memory.data()[0], std::byte{0});
  }
}

// Not registration, but pool options: a lease is placed by segment
// alignment, which the allocator only takes as a power of two (a 3-page
// segment used to abort the daemon on the first Lease).
TEST(HostPoolRegistrationTest, SegmentSizeMustBeAPowerOfTwo) {
  HostPoolOptions options = Options(nullptr, false);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  options.segment_bytes = 3 * page;
  options.pool_bytes = 12 * page;
  auto pool = CreateHostPool(options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(pool.status().message()).find("power of two"), std::string::npos);
}

}  // namespace
}  // namespace actstash::server
