// client/device_import: the handle cache and the grant checks of
// DeviceImporter, with a fake IpcOpener (host memory for the regions).
// (Lives with the server tests until client/ builds device_import.cc.)
#include "client/store/device_import.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace actstash::client_internal {
namespace {

constexpr uint64_t kRegion = 1 << 20;

struct OpenerLog {
  absl::Mutex mu;
  std::vector<std::string> opened ABSL_GUARDED_BY(mu);
  std::vector<void*> closed ABSL_GUARDED_BY(mu);
  std::map<void*, std::unique_ptr<std::byte[]>> regions ABSL_GUARDED_BY(mu);
  int fail_next_opens ABSL_GUARDED_BY(mu) = 0;
  int last_device ABSL_GUARDED_BY(mu) = -1;
};

class FakeOpener final : public IpcOpener {
 public:
  explicit FakeOpener(std::shared_ptr<OpenerLog> log) : log_(std::move(log)) {}
  absl::StatusOr<void*> Open(absl::string_view handle, int local_device) override {
    absl::MutexLock lock(&log_->mu);
    log_->last_device = local_device;
    if (log_->fail_next_opens > 0) {
      --log_->fail_next_opens;
      return absl::InternalError("fake cudaIpcOpenMemHandle failed");
    }
    log_->opened.emplace_back(handle);
    auto region = std::make_unique<std::byte[]>(kRegion);
    void* base = region.get();
    log_->regions.emplace(base, std::move(region));
    return base;
  }
  absl::Status Close(void* base, int local_device) override {
    absl::MutexLock lock(&log_->mu);
    log_->closed.push_back(base);
    return log_->regions.erase(base) == 1 ? absl::OkStatus()
                                          : absl::InternalError("fake: not open");
  }

 private:
  std::shared_ptr<OpenerLog> log_;
};

std::string Handle(char fill) { return std::string(kDeviceIpcHandleBytes, fill); }

DeviceGrant Grant(char fill, uint64_t offset, uint64_t bytes, uint64_t region = kRegion) {
  return DeviceGrant{Handle(fill), region, offset, bytes};
}

class DeviceImportTest : public ::testing::Test {
 protected:
  std::shared_ptr<OpenerLog> log_ = std::make_shared<OpenerLog>();
  std::unique_ptr<DeviceImporter> importer_ =
      std::make_unique<DeviceImporter>(std::make_unique<FakeOpener>(log_), 3);

  size_t Opened() {
    absl::MutexLock lock(&log_->mu);
    return log_->opened.size();
  }
};

TEST_F(DeviceImportTest, EachHandleIsOpenedOnceAndPointersAreBasePlusOffset) {
  absl::StatusOr<void*> a0 = importer_->Resolve(Grant('a', 0, 4096));
  absl::StatusOr<void*> a1 = importer_->Resolve(Grant('a', 8192, 4096));
  ASSERT_TRUE(a0.ok() && a1.ok()) << a0.status() << a1.status();
  EXPECT_EQ(static_cast<std::byte*>(*a1) - static_cast<std::byte*>(*a0), 8192);
  EXPECT_EQ(Opened(), 1u);
  absl::StatusOr<void*> b = importer_->Resolve(Grant('b', 0, kRegion));
  ASSERT_TRUE(b.ok());
  EXPECT_NE(*b, *a0);
  EXPECT_EQ(Opened(), 2u);
  EXPECT_EQ(importer_->imported(), 2u);
  absl::MutexLock lock(&log_->mu);
  EXPECT_EQ(log_->last_device, 3);  // opened on the importer's device
}

TEST_F(DeviceImportTest, DestructionClosesEveryHandleOnce) {
  void* a = importer_->Resolve(Grant('a', 0, 1)).value();
  void* b = importer_->Resolve(Grant('b', 16, 1)).value();
  importer_.reset();
  absl::MutexLock lock(&log_->mu);
  ASSERT_EQ(log_->closed.size(), 2u);
  EXPECT_TRUE((log_->closed[0] == a && log_->closed[1] == static_cast<std::byte*>(b) - 16) ||
              (log_->closed[1] == a && log_->closed[0] == static_cast<std::byte*>(b) - 16));
  EXPECT_TRUE(log_->regions.empty());
}

TEST_F(DeviceImportTest, MalformedGrantsAreRefusedBeforeAnythingIsOpened) {
  const std::vector<DeviceGrant> bad = {
      DeviceGrant{std::string(63, 'a'), kRegion, 0, 1},
      DeviceGrant{std::string(65, 'a'), kRegion, 0, 1},
      DeviceGrant{"", kRegion, 0, 1},
      Grant('a', 0, 0),                  // empty range
      Grant('a', kRegion, 1),            // starts at the end
      Grant('a', kRegion - 1, 2),        // one byte over
      Grant('a', 0, kRegion + 1),        // bigger than the region
      Grant('a', UINT64_MAX - 10, 100),  // offset + bytes wraps
      Grant('a', 10, UINT64_MAX),        // bytes wraps
      Grant('a', 0, 1, 0),               // empty region
  };
  for (const DeviceGrant& grant : bad) {
    absl::StatusOr<void*> p = importer_->Resolve(grant);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
        << grant.offset << "+" << grant.bytes << " of " << grant.region_bytes;
  }
  EXPECT_EQ(Opened(), 0u);
  // The last byte of the region is fine.
  EXPECT_TRUE(importer_->Resolve(Grant('a', kRegion - 1, 1)).ok());
}

TEST_F(DeviceImportTest, ARegionSizeThatChangesForAHandleIsRefused) {
  ASSERT_TRUE(importer_->Resolve(Grant('a', 0, 1)).ok());
  absl::StatusOr<void*> p = importer_->Resolve(Grant('a', 0, 1, kRegion / 2));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
  EXPECT_NE(std::string(p.status().message()).find(std::to_string(kRegion)), std::string::npos);
}

TEST_F(DeviceImportTest, AFailedOpenIsNotCached) {
  {
    absl::MutexLock lock(&log_->mu);
    log_->fail_next_opens = 1;
  }
  absl::StatusOr<void*> p = importer_->Resolve(Grant('a', 0, 1));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(importer_->imported(), 0u);
  EXPECT_TRUE(importer_->Resolve(Grant('a', 0, 1)).ok());
  EXPECT_EQ(importer_->imported(), 1u);
}

TEST_F(DeviceImportTest, ConcurrentResolvesOpenAHandleOnce) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 100; ++i) {
        if (!importer_->Resolve(Grant('a' + (i % 2), uint64_t(t) * 4096, 4096)).ok()) ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(Opened(), 2u);
}

TEST(CudaIpcOpenerTest, WithoutADeviceItIsFailedPrecondition) {
  absl::StatusOr<std::unique_ptr<IpcOpener>> opener = CreateCudaIpcOpener();
  if (opener.ok()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(opener.status().code(), absl::StatusCode::kFailedPrecondition) << opener.status();
}

}  // namespace
}  // namespace actstash::client_internal
