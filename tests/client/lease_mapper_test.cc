// The two lease mappers (client/store/lease_mapper.h): host leases are real memfd
// segments mapped back to back and registered through a fake registrar;
// device leases resolve through a DeviceImporter over a fake opener. Each
// refuses a lease of the other tier or of another size, and consumes its fds
// whatever the outcome.
#include "client/store/lease_mapper.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace actstash::client_internal {
namespace {

constexpr uint64_t kSegment = 64 << 10;

GrantedLease HostLease(uint64_t id, uint32_t segments) {
  GrantedLease lease{id, segments, {}, std::nullopt};
  for (uint32_t i = 0; i < segments; ++i) {
    UniqueFd fd(memfd_create("mapper-test", MFD_CLOEXEC));
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(ftruncate(fd.get(), kSegment), 0);
    lease.fds.push_back(std::move(fd));
  }
  return lease;
}

class FakeRegistrar final : public PinnedRegistrar {
 public:
  absl::Status Register(void* ptr, size_t bytes) override {
    if (fail) return absl::InternalError("fake.cc:1: cudaHostRegister failed");
    live.insert(ptr);
    return absl::OkStatus();
  }
  absl::Status Unregister(void* ptr) override {
    EXPECT_EQ(live.erase(ptr), 1u) << "unregistering a range never registered";
    return absl::OkStatus();
  }
  bool Ready() const override { return ready; }
  bool fail = false;
  bool ready = true;
  std::set<void*> live;
};

TEST(HostLeaseMapperTest, MapsSegmentsBackToBackOverTheLeasesMemory) {
  HostLeaseMapper mapper(kSegment, nullptr, false);
  GrantedLease lease = HostLease(1, 3);
  const int second = dup(lease.fds[1].get());  // to read the segment back past the mapping
  absl::StatusOr<MappedLease> mapped = mapper.Map(&lease, 3 * kSegment);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_TRUE(lease.fds.empty());
  EXPECT_FALSE(mapped->pinned);
  EXPECT_FALSE(mapped->pin_tried);
  EXPECT_FALSE(mapper.registers());
  std::memcpy(mapped->base + kSegment + 5, "segment", 7);  // the second segment's bytes
  char back[8] = {};
  ASSERT_EQ(pread(second, back, 7, 5), 7);
  EXPECT_STREQ(back, "segment");
  close(second);
  mapper.Unmap(mapped->base, 3 * kSegment, false);
}

TEST(HostLeaseMapperTest, RefusesLeasesOfAnotherTierOrSizeAndClosesTheirFds) {
  HostLeaseMapper mapper(kSegment, nullptr, false);
  GrantedLease wrong_size = HostLease(2, 2);
  EXPECT_EQ(mapper.Map(&wrong_size, 3 * kSegment).status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(wrong_size.fds.empty());
  GrantedLease missing_fd = HostLease(3, 2);
  missing_fd.fds.pop_back();
  EXPECT_EQ(mapper.Map(&missing_fd, 2 * kSegment).status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(missing_fd.fds.empty());
  GrantedLease device = HostLease(4, 1);
  device.device = DeviceGrant{std::string(kDeviceIpcHandleBytes, 'h'), kSegment, 0, kSegment};
  absl::Status status = mapper.Map(&device, kSegment).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("lease 4"), std::string::npos) << status;
  EXPECT_TRUE(device.fds.empty());
}

TEST(HostLeaseMapperTest, RegistersOnceWhenReadyAndUnregistersOnUnmap) {
  FakeRegistrar registrar;
  HostLeaseMapper mapper(kSegment, &registrar, false);
  EXPECT_TRUE(mapper.registers());
  GrantedLease lease = HostLease(5, 1);
  absl::StatusOr<MappedLease> mapped = mapper.Map(&lease, kSegment);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_TRUE(mapped->pinned && mapped->pin_tried);
  EXPECT_EQ(registrar.live.count(mapped->base), 1u);
  mapper.Unmap(mapped->base, kSegment, true);
  EXPECT_TRUE(registrar.live.empty());
}

TEST(HostLeaseMapperTest, AThreadWithoutCudaWorkMapsUnpinnedAndPinsLater) {
  FakeRegistrar registrar;
  registrar.ready = false;
  HostLeaseMapper mapper(kSegment, &registrar, true);
  GrantedLease lease = HostLease(6, 1);
  absl::StatusOr<MappedLease> mapped = mapper.Map(&lease, kSegment);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_FALSE(mapped->pinned || mapped->pin_tried);  // not tried: a later thread may
  EXPECT_FALSE(mapper.CanPinNow());
  registrar.ready = true;
  EXPECT_TRUE(mapper.CanPinNow());
  ASSERT_TRUE(mapper.Pin(mapped->base, kSegment).ok());
  mapper.Unmap(mapped->base, kSegment, true);
  EXPECT_TRUE(registrar.live.empty());
}

TEST(HostLeaseMapperTest, AFailedRegistrationIsReportedOrFailsTheMapWhenRequired) {
  FakeRegistrar registrar;
  registrar.fail = true;
  HostLeaseMapper lenient(kSegment, &registrar, false);
  GrantedLease lease = HostLease(7, 1);
  absl::StatusOr<MappedLease> mapped = lenient.Map(&lease, kSegment);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_TRUE(mapped->pin_tried);
  EXPECT_FALSE(mapped->pinned);
  EXPECT_NE(mapped->pin_error.message().find("cudaHostRegister"), std::string::npos);
  mapped->base[0] = std::byte{1};  // mapped all the same
  lenient.Unmap(mapped->base, kSegment, false);

  HostLeaseMapper strict(kSegment, &registrar, true);
  GrantedLease required = HostLease(8, 1);
  absl::Status status = strict.Map(&required, kSegment).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("pinning is required"), std::string::npos) << status;
  EXPECT_TRUE(required.fds.empty());
}

class OneRegionOpener final : public IpcOpener {
 public:
  absl::StatusOr<void*> Open(absl::string_view handle, int local_device) override {
    return region_.data();
  }
  absl::Status Close(void* base, int local_device) override { return absl::OkStatus(); }

 private:
  std::vector<std::byte> region_ = std::vector<std::byte>(4 * kSegment);
};

TEST(DeviceLeaseMapperTest, ResolvesTheGrantsRangeAndRefusesHostLeases) {
  DeviceImporter importer(std::make_unique<OneRegionOpener>(), 0);
  DeviceLeaseMapper mapper(&importer);
  EXPECT_TRUE(mapper.on_device());
  EXPECT_FALSE(mapper.registers());
  GrantedLease lease{
      9,
      1,
      {},
      DeviceGrant{std::string(kDeviceIpcHandleBytes, 'h'), 4 * kSegment, 2 * kSegment, kSegment}};
  absl::StatusOr<MappedLease> a = mapper.Map(&lease, kSegment);
  ASSERT_TRUE(a.ok()) << a.status();
  lease.device->offset = 0;
  absl::StatusOr<MappedLease> b = mapper.Map(&lease, kSegment);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->base - b->base, static_cast<std::ptrdiff_t>(2 * kSegment));
  EXPECT_FALSE(a->pinned || a->pin_tried);
  EXPECT_EQ(mapper.Map(&lease, 2 * kSegment).status().code(), absl::StatusCode::kInternal);
  GrantedLease host = HostLease(10, 1);
  EXPECT_EQ(mapper.Map(&host, kSegment).status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(host.fds.empty());
  mapper.Unmap(a->base, kSegment, false);  // the importer keeps the region: nothing to do
}

}  // namespace
}  // namespace actstash::client_internal
