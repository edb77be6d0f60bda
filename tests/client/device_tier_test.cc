// Client::ReserveOnDevice end to end: an in-process daemon whose device pool
// is host memory (FakeDeviceMemory) and a client whose IPC opener decodes the
// fake's handles. Checks placement in the pool's region, Locate/Release
// routing of device tickets, the quota, the errors, and that the pool gets
// its segments back.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "actstash/client.h"
#include "client/store/device_import.h"
#include "server/daemon/daemon.h"
#include "testing/park.h"
#include "tests/server/fake_device_memory.h"

namespace actstash {
namespace {

using server::testing::FakeDeviceMemory;
constexpr uint64_t kMiB = 1ull << 20;

// Opens the fake's handles: the first 8 bytes are the host address.
class FakeOpener final : public client_internal::IpcOpener {
 public:
  explicit FakeOpener(int* opens) : opens_(opens) {}
  absl::StatusOr<void*> Open(absl::string_view handle, int local_device) override {
    if (handle.size() != client_internal::kDeviceIpcHandleBytes || handle.back() != 'F') {
      return absl::InvalidArgumentError("not a fake handle");
    }
    uint64_t address = 0;
    std::memcpy(&address, handle.data(), sizeof(address));
    ++*opens_;
    return reinterpret_cast<void*>(address);
  }
  absl::Status Close(void*, int) override { return absl::OkStatus(); }

 private:
  int* opens_;
};

class DeviceTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/actstash-device-tier-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    state_ = std::make_shared<FakeDeviceMemory::State>();
    client_internal::SetIpcOpenerFactoryForTesting(
        [this]() -> absl::StatusOr<std::unique_ptr<client_internal::IpcOpener>> {
          return std::make_unique<FakeOpener>(&opens_);
        });
  }
  void TearDown() override {
    client_internal::SetIpcOpenerFactoryForTesting(nullptr);
    if (daemon_ != nullptr) {
      daemon_->Shutdown(std::chrono::milliseconds(0));
      testing::ParkUntilExit(std::move(daemon_));  // ~Server may block on our own channels
    }
    unlink((dir_ + "/s.sock").c_str());
    rmdir(dir_.c_str());
  }
  void Start(bool device_pool, uint64_t quota = 8 * kMiB) {
    server::DaemonConfig config;
    config.socket_path = dir_ + "/s.sock";
    config.pool_bytes = 4 * kMiB;
    config.segment_bytes = kMiB;
    config.max_session_quota = quota;
    config.default_session_quota = quota;
    config.mlock = Tristate::kOff;
    config.cuda_pin = Tristate::kOff;
    config.session_idle_ttl_seconds = 0;
    if (device_pool) config.device_pools.push_back({0, 4 * kMiB});
    auto daemon = server::Daemon::Start(config, std::make_unique<FakeDeviceMemory>(state_));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
  }
  std::unique_ptr<Client> Connect(AttachMode attach = AttachMode::kRequired) {
    ClientOptions options;
    options.address = dir_ + "/s.sock";
    options.attach = attach;
    options.lease_batch = 1;
    options.pin_leases = PinPolicy::kOff;
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::string dir_;
  std::shared_ptr<FakeDeviceMemory::State> state_;
  std::unique_ptr<server::Daemon> daemon_;
  int opens_ = 0;
};

TEST_F(DeviceTierTest, ReservationsLandInThePoolAndComeBackThroughLocate) {
  Start(/*device_pool=*/true);
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(client->device_pools().size(), 1u);
  EXPECT_EQ(client->device_pools()[0].total_bytes, 4 * kMiB);
  std::vector<Reservation> reserved;
  for (int i = 0; i < 8; ++i) {  // 8 x 256 KiB: two 1 MiB segments
    absl::StatusOr<Reservation> r = client->ReserveOnDevice(256 << 10, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->on_device);
    std::memset(r->data, i + 1, 256 << 10);  // "the D2D copy" (the fake is host memory)
    reserved.push_back(*r);
  }
  state_->Handover();  // before the daemon scrubs these segments
  EXPECT_EQ(opens_, 1) << "the pool's handle is imported once";
  absl::StatusOr<v1::StatsReply> stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats->device_pools_size(), 1u);
  EXPECT_EQ(stats->device_pools(0).pool().used_bytes(), 2 * kMiB);
  EXPECT_EQ(stats->device_pools(0).pool().leases(), 2u);
  EXPECT_EQ(stats->self().client().objects(), 8u) << "device-tier buffers are reported as usage";
  EXPECT_EQ(stats->self().client().bytes(), 8u * (256 << 10));
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<StoredBytes> where = client->Locate(reserved[i].ticket);
    ASSERT_TRUE(where.ok()) << where.status();
    EXPECT_EQ(where->data, reserved[i].data);
    EXPECT_TRUE(where->on_device);
    EXPECT_EQ(static_cast<const unsigned char*>(where->data)[1000], i + 1);
    std::vector<char> host(16);
    EXPECT_EQ(client->Fetch(reserved[i].ticket, host.data(), host.size()).code(),
              absl::StatusCode::kFailedPrecondition)
        << "device memory is not memcpy'd";
  }
  // A host reservation beside them keeps its own tickets.
  absl::StatusOr<Reservation> host = client->Reserve(4096);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_FALSE(host->on_device);
  for (const Reservation& r : reserved) ASSERT_TRUE(client->Release(r.ticket).ok());
  EXPECT_EQ(client->Locate(reserved[0].ticket).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(client->Release(host->ticket).ok());
  client.reset();  // closing the session returns the leases its store kept
  std::unique_ptr<Client> other = Connect();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  uint64_t used = 1;
  while (used != 0 && std::chrono::steady_clock::now() < deadline) {
    stats = other->Stats();
    ASSERT_TRUE(stats.ok());
    used =
        stats->device_pools(0).pool().used_bytes() + stats->device_pools(0).pool().renewing_bytes();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(used, 0u) << "the closed session's device leases went back (and were scrubbed)";
}

TEST_F(DeviceTierTest, DeviceTicketsDieWithTheSession) {
  Start(/*device_pool=*/true);
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<Reservation> device = client->ReserveOnDevice(4096, 0);
  ASSERT_TRUE(device.ok()) << device.status();
  absl::StatusOr<Reservation> host = client->Reserve(4096);
  ASSERT_TRUE(host.ok()) << host.status();
  std::memset(host->data, 7, 4096);
  // The daemon goes (and with it the session: its device segments would be
  // zeroed and granted again in place).
  daemon_->Shutdown(std::chrono::milliseconds(0));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  absl::Status located = absl::OkStatus();
  while (located.ok() && std::chrono::steady_clock::now() < deadline) {
    located = client->Locate(device->ticket).status();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(located.code(), absl::StatusCode::kUnavailable) << located;
  EXPECT_TRUE(absl::StrContains(located.message(), "reclaimed")) << located;
  // Host tickets stay readable: the old mapping keeps its pages.
  absl::StatusOr<StoredBytes> kept = client->Locate(host->ticket);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(static_cast<const char*>(kept->data)[100], 7);
}

TEST_F(DeviceTierTest, QuotaAndPoolLimitsAndBadDevicesAreClearErrors) {
  Start(/*device_pool=*/true, /*quota=*/2 * kMiB);
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<Reservation> big = client->ReserveOnDevice(3 * kMiB, 0);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  absl::StatusOr<Reservation> wrong = client->ReserveOnDevice(4096, 3);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "no device pool on GPU 3"))
      << wrong.status();
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "pools on GPU 0")) << wrong.status();
  EXPECT_TRUE(client->ReserveOnDevice(kMiB, 0).ok());
}

TEST_F(DeviceTierTest, WithoutAPoolOrWithoutAttachingItSaysWhy) {
  Start(/*device_pool=*/false);
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->device_pools().empty());
  absl::StatusOr<Reservation> r = client->ReserveOnDevice(4096, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "--device-pool")) << r.status();
  std::unique_ptr<Client> inline_client = Connect(AttachMode::kOff);
  r = inline_client->ReserveOnDevice(4096, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "zero-copy")) << r.status();
}

}  // namespace
}  // namespace actstash
