// The device pool (DevicePool over a fake DeviceMemory) leased through the
// real LeaseManager and StashCore paths: scrubbing, reclaim, quota, errors.
#include "server/pool/device_pool.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/tiered_id.h"
#include "server/objects/catalog.h"
#include "server/pool/host_pool.h"
#include "server/rpc/stash_core.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session_manager.h"
#include "tests/server/fake_device_memory.h"

namespace actstash::server {
namespace {

using testing::FakeDeviceMemory;
constexpr uint64_t kMiB = 1ull << 20;

bool AllBytesAre(const std::byte* p, uint64_t n, std::byte value) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != value) return false;
  }
  return true;
}

bool Contains(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

class DevicePoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_ = std::make_shared<FakeDeviceMemory::State>();
    state_->devices = 2;
    memory_ = std::make_unique<FakeDeviceMemory>(state_);
  }
  std::unique_ptr<DevicePool> MakePool(uint64_t bytes = 4 * kMiB, int device = 1) {
    DevicePoolOptions options;
    options.device = device;
    options.pool_bytes = bytes;
    options.segment_bytes = kMiB;
    absl::StatusOr<std::unique_ptr<DevicePool>> pool = DevicePool::Create(memory_.get(), options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *std::move(pool) : nullptr;
  }
  absl::Status CreateError(int device, uint64_t bytes) {
    DevicePoolOptions options;
    options.device = device;
    options.pool_bytes = bytes;
    options.segment_bytes = kMiB;
    absl::StatusOr<std::unique_ptr<DevicePool>> pool = DevicePool::Create(memory_.get(), options);
    return pool.ok() ? absl::OkStatus() : pool.status();
  }

  std::shared_ptr<FakeDeviceMemory::State> state_;
  std::unique_ptr<FakeDeviceMemory> memory_;
};

TEST_F(DevicePoolTest, CreationAllocatesZeroesAndExportsOneRegion) {
  auto pool = MakePool(4 * kMiB + kMiB / 2);
  ASSERT_NE(pool, nullptr);
  const std::vector<FakeDeviceMemory::Call> calls = state_->Calls();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[0].op, "allocate");
  EXPECT_EQ(calls[0].device, 1);
  EXPECT_EQ(calls[0].bytes, 4 * kMiB);  // whole segments
  EXPECT_EQ(calls[1].op, "zero");       // the previous owner's bytes never reach a client
  EXPECT_EQ(calls[1].offset, 0u);
  EXPECT_EQ(calls[1].bytes, 4 * kMiB);
  EXPECT_EQ(calls[2].op, "export");
  EXPECT_EQ(pool->device(), 1);
  EXPECT_EQ(pool->region_bytes(), 4 * kMiB);
  EXPECT_EQ(pool->ipc_handle().size(), kIpcHandleBytes);
  const PoolStats stats = pool->Stats();
  EXPECT_EQ(stats.total_bytes(), 4 * kMiB);
  EXPECT_EQ(stats.free_bytes(), 4 * kMiB);
  EXPECT_EQ(stats.used_bytes(), 0u);
  EXPECT_EQ(stats.segments(), 4u);
  EXPECT_EQ(stats.segment_bytes(), kMiB);
  EXPECT_EQ(stats.cuda_pinned_bytes(), 0u);
}

TEST_F(DevicePoolTest, CreationErrors) {
  absl::Status s = CreateError(2, 4 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s, "no CUDA device 2 (2 visible)")) << s;
  s = CreateError(-1, 4 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  s = CreateError(0, kMiB - 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "smaller than one segment")) << s;
  EXPECT_EQ(state_->Count("allocate"), 0u);

  {
    absl::MutexLock lock(&state_->mu);
    state_->fail_allocate = absl::ResourceExhaustedError("fake out of memory");
  }
  s = CreateError(0, 4 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "on GPU 0: fake out of memory")) << s;
  {
    absl::MutexLock lock(&state_->mu);
    state_->fail_allocate = absl::OkStatus();
    state_->fail_export = absl::InternalError("fake export failed");
  }
  s = CreateError(0, 4 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s, "exporting the device pool on GPU 0: fake export failed")) << s;
  EXPECT_EQ(state_->LiveRegions(), 0u);  // freed again
}

// Leases only: no inline objects and no fds, by type.
static_assert(!std::is_base_of_v<ObjectAllocator, DevicePool>);
static_assert(!std::is_base_of_v<FdSegmentLeaser, DevicePool>);

TEST_F(DevicePoolTest, SegmentCounts) {
  auto pool = MakePool();
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->segment_count(), 4u);
  EXPECT_EQ(pool->AllocateSegments(0).status().code(), absl::StatusCode::kResourceExhausted);
  absl::Status too_many = pool->AllocateSegments(5).status();
  EXPECT_EQ(too_many.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(too_many, "requested 5 segments; the device pool on GPU 1 has 4"));
}

TEST_F(DevicePoolTest, RegionIsFreedOnceAtDestructionOnly) {
  auto pool = MakePool();
  ASSERT_NE(pool, nullptr);
  {
    absl::StatusOr<SegmentRun> run = pool->AllocateSegments(2);
    ASSERT_TRUE(run.ok());
  }
  EXPECT_EQ(state_->Count("free"), 0u);
  pool.reset();
  EXPECT_EQ(state_->Count("free"), 1u);
  EXPECT_EQ(state_->LiveRegions(), 0u);
}

TEST_F(DevicePoolTest, DestroyingWhileASegmentIsLeasedIsABrokenInvariant) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto pool = MakePool();
        absl::StatusOr<SegmentRun> run = pool->AllocateSegments(1);
        pool.reset();
      },
      "DevicePool destroyed while segments are leased");
}

// A StashCore with a 4-segment host pool and a 4-segment device pool, leases
// renewed inline (no work queue).
class DeviceTierTest : public DevicePoolTest {
 protected:
  void SetUp() override {
    DevicePoolTest::SetUp();
    HostPoolOptions host;
    host.pool_bytes = 4 * kMiB;
    host.segment_bytes = kMiB;
    host.mlock = Tristate::kOff;
    host_pool_ = CreateHostPool(host).value();
    device_pool_ = MakePool();
    ASSERT_NE(device_pool_, nullptr);
    host_leases_ = std::make_unique<LeaseManager>(host_pool_.get(), nullptr);
    device_leases_ = std::make_unique<LeaseManager>(device_pool_.get(), nullptr, 1);
    core_ = MakeCore({{device_pool_.get(), device_leases_.get()}});
  }
  // A core over this fixture's pools and managers, with `tiers` as its
  // device tiers; no work queue, spill tier or attach channel.
  std::unique_ptr<StashCore> MakeCore(std::vector<DeviceTier> tiers) {
    StashParts parts;
    parts.pool = host_pool_.get();
    parts.segments = host_pool_.get();
    parts.sessions = &sessions_;
    parts.catalog = &catalog_;
    parts.leases = host_leases_.get();
    parts.device_tiers = std::move(tiers);
    return std::make_unique<StashCore>(std::move(parts));
  }
  void TearDown() override {
    for (const auto& session : sessions_.List()) CloseSessionAndFree(*core_, session->id());
  }
  std::shared_ptr<Session> Open(uint64_t quota = 0) {
    return sessions_.Open("test", quota, 1).value();
  }
  std::byte* Host(const Lease& lease) {
    return FakeDeviceMemory::Host(reinterpret_cast<uint64_t>(lease.data()));
  }

  SessionManager sessions_{SessionManagerOptions{8 * kMiB, 8 * kMiB, 16}};
  Catalog catalog_;
  std::unique_ptr<HostPool> host_pool_;
  std::unique_ptr<DevicePool> device_pool_;
  std::unique_ptr<LeaseManager> host_leases_;
  std::unique_ptr<LeaseManager> device_leases_;
  std::unique_ptr<StashCore> core_;
};

// A grant still referenced (by a Lease call being answered) is scrubbed
// and freed only when that reference drops.
TEST_F(DeviceTierTest, ScrubWaitsForTheLastReference) {
  auto a = Open();
  auto granted = device_leases_->Grant(a, 1, 2);
  ASSERT_TRUE(granted.ok()) << granted.status();
  std::shared_ptr<Lease> lease = (*granted)[0];
  granted->clear();
  EXPECT_EQ(tiered_id::TierOf(lease->id()), 1u);
  EXPECT_EQ(lease->bytes(), 2 * kMiB);
  std::byte* bytes = Host(*lease);
  EXPECT_TRUE(AllBytesAre(bytes, 2 * kMiB, std::byte{0}));  // zeroed at creation
  std::memset(bytes, 0x77, 2 * kMiB);
  const size_t zeroes = state_->Count("zero");

  ASSERT_TRUE(ReturnLeases(*core_, a->id(), {lease->id()}).ok());
  EXPECT_EQ(state_->Count("zero"), zeroes);
  EXPECT_EQ(device_pool_->Stats().used_bytes(), 2 * kMiB);
  lease.reset();
  EXPECT_EQ(state_->Count("zero"), zeroes + 1);
  EXPECT_TRUE(AllBytesAre(bytes, 2 * kMiB, std::byte{0}));
  EXPECT_EQ(device_pool_->Stats().used_bytes(), 0u);
}

TEST_F(DeviceTierTest, ScrubHappensWhenTheLastReferenceDrops) {
  auto a = Open();
  uint64_t offset = 0, id = 0;
  std::byte* bytes = nullptr;
  {
    auto granted = device_leases_->Grant(a, 1, 2);
    ASSERT_TRUE(granted.ok()) << granted.status();
    id = (*granted)[0]->id();
    offset = uint64_t{(*granted)[0]->first_segment()} * kMiB;
    bytes = Host(*(*granted)[0]);
    std::memset(bytes, 0x77, 2 * kMiB);
  }
  EXPECT_EQ(a->used_bytes(), 2 * kMiB);  // device bytes count against the session quota
  ASSERT_TRUE(ReturnLeases(*core_, a->id(), {id}).ok());
  const std::vector<FakeDeviceMemory::Call> calls = state_->Calls();
  ASSERT_FALSE(calls.empty());
  EXPECT_EQ(calls.back().op, "zero");
  EXPECT_EQ(calls.back().offset, offset);
  EXPECT_EQ(calls.back().bytes, 2 * kMiB);
  EXPECT_TRUE(AllBytesAre(bytes, 2 * kMiB, std::byte{0}));
  EXPECT_EQ(device_pool_->Stats().used_bytes(), 0u);
  EXPECT_EQ(a->used_bytes(), 0u);

  // The next tenant gets the same (zeroed) memory.
  auto b = Open();
  auto again = device_leases_->Grant(b, 1, 2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Host(*(*again)[0]), bytes);
  EXPECT_TRUE(AllBytesAre(bytes, 2 * kMiB, std::byte{0}));
}

TEST_F(DeviceTierTest, ClosingASessionReclaimsAndScrubsOnlyItsDeviceLeases) {
  auto a = Open();
  auto b = Open();
  std::byte *a_bytes = nullptr, *b_bytes = nullptr;
  {
    auto la = device_leases_->Grant(a, 2, 1);
    auto lb = device_leases_->Grant(b, 1, 1);
    auto host = host_leases_->Grant(a, 1, 1);
    ASSERT_TRUE(la.ok() && lb.ok() && host.ok());
    a_bytes = Host(*(*la)[0]);
    std::memset(Host(*(*la)[0]), 0x11, kMiB);
    std::memset(Host(*(*la)[1]), 0x11, kMiB);
    b_bytes = Host(*(*lb)[0]);
    std::memset(b_bytes, 0x22, kMiB);
  }
  EXPECT_EQ(a->used_bytes(), 3 * kMiB);
  std::optional<SessionTotals> freed = CloseSessionAndFree(*core_, a->id());
  ASSERT_TRUE(freed.has_value());
  EXPECT_EQ(freed->leases.objects, 3u);  // 2 device + 1 host
  EXPECT_EQ(freed->leases.bytes, 3 * kMiB);
  EXPECT_TRUE(AllBytesAre(a_bytes, kMiB, std::byte{0}));
  EXPECT_TRUE(AllBytesAre(b_bytes, kMiB, std::byte{0x22}));  // b's untouched
  EXPECT_EQ(device_leases_->size(), 1u);
  EXPECT_EQ(device_pool_->Stats().used_bytes(), kMiB);
  EXPECT_EQ(a->used_bytes(), 0u);
}

TEST_F(DeviceTierTest, DeviceBytesCountAgainstTheSessionQuota) {
  auto s = Open(3 * kMiB);
  ASSERT_TRUE(host_leases_->Grant(s, 1, 1).ok());
  auto device = device_leases_->Grant(s, 1, 2);
  ASSERT_TRUE(device.ok()) << device.status();
  auto over = device_leases_->Grant(s, 1, 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_TRUE(Contains(over.status(), std::to_string(3 * kMiB))) << over.status();  // the quota
  EXPECT_EQ(device_pool_->Stats().used_bytes(), 2 * kMiB);  // nothing taken by the refusal
}

TEST_F(DeviceTierTest, PoolExhaustionIsResourceExhaustedWithNumbers) {
  auto s = Open();
  auto held = device_leases_->Grant(s, 3, 1);
  ASSERT_TRUE(held.ok());
  auto more = device_leases_->Grant(s, 1, 2);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(more.status(),
                       "device pool on GPU 1 exhausted: requested 2 contiguous "
                       "segments (2097152 bytes), available 1048576 bytes free"))
      << more.status();
  EXPECT_EQ(s->used_bytes(), 3 * kMiB);  // the failed batch gave its quota back
}

TEST_F(DeviceTierTest, SegmentsThatCannotBeScrubbedAreNeverReused) {
  auto s = Open();
  uint64_t id = 0;
  {
    auto granted = device_leases_->Grant(s, 1, 4);
    ASSERT_TRUE(granted.ok());
    id = (*granted)[0]->id();
  }
  {
    absl::MutexLock lock(&state_->mu);
    state_->fail_zero = absl::InternalError("fake memset failed");
  }
  ASSERT_TRUE(ReturnLeases(*core_, s->id(), {id}).ok());
  EXPECT_EQ(device_pool_->Stats().used_bytes(), 4 * kMiB);  // quarantined
  EXPECT_EQ(s->used_bytes(), 0u);                           // but the quota is back
  EXPECT_EQ(device_leases_->Grant(s, 1, 1).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(DeviceTierTest, ReturnAcrossTiersIsAllOrNothing) {
  auto s = Open();
  auto other = Open();
  auto host = host_leases_->Grant(s, 1, 1);
  auto device = device_leases_->Grant(s, 1, 1);
  auto foreign = device_leases_->Grant(other, 1, 1);
  ASSERT_TRUE(host.ok() && device.ok() && foreign.ok());
  const uint64_t h = (*host)[0]->id(), d = (*device)[0]->id(), f = (*foreign)[0]->id();
  EXPECT_NE(h, d);
  EXPECT_EQ(tiered_id::TierOf(h), 0u);
  EXPECT_EQ(tiered_id::TierOf(d), 1u);

  absl::StatusOr<RemovedTotals> bad = ReturnLeases(*core_, s->id(), {h, d, f});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  bad = ReturnLeases(*core_, s->id(), {h, d, d});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  const uint64_t unknown_tier = tiered_id::Make(7, 1);
  const uint64_t inline_bit = tiered_id::MakeInline(h);  // a ticket's bit: never a lease
  bad = ReturnLeases(*core_, s->id(), {inline_bit});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  bad = ReturnLeases(*core_, s->id(), {h, unknown_tier});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(host_leases_->size(), 1u);  // nothing was returned
  EXPECT_EQ(device_leases_->size(), 2u);

  absl::StatusOr<RemovedTotals> good = ReturnLeases(*core_, s->id(), {d, h});
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->objects, 2u);
  EXPECT_EQ(good->bytes, 2 * kMiB);
  EXPECT_EQ(host_leases_->size(), 0u);
  EXPECT_EQ(device_leases_->size(), 1u);  // the other session's
}

TEST_F(DeviceTierTest, FindDeviceTier) {
  absl::StatusOr<const DeviceTier*> only = FindDeviceTier(*core_, std::nullopt);
  ASSERT_TRUE(only.ok());
  EXPECT_EQ((*only)->pool, device_pool_.get());
  EXPECT_TRUE(FindDeviceTier(*core_, 1u).ok());
  absl::Status wrong = FindDeviceTier(*core_, 0u).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(wrong, "no device pool on GPU 0; device pools are on GPU 1")) << wrong;

  const DeviceTier tier{device_pool_.get(), device_leases_.get()};
  absl::Status ambiguous = FindDeviceTier(*MakeCore({tier, tier}), std::nullopt).status();
  EXPECT_EQ(ambiguous.code(), absl::StatusCode::kInvalidArgument);
  absl::Status none = FindDeviceTier(*MakeCore({}), std::nullopt).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(none, "--device-pool")) << none;
}

}  // namespace
}  // namespace actstash::server
