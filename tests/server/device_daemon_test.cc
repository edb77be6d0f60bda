// The device tier end to end through an in-process Daemon (real gRPC
// service, attach server, lease managers) whose device memory is a fake
// (host memory): Lease/Return of device segments, their IPC grant fields,
// scrubbing, reclaim when the attach connection goes, quota and request
// errors, Stats. Runs on any machine.
#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "client/rpc/attach_connection.h"
#include "common/attach_wire.h"
#include "common/protocol.h"
#include "common/unique_fd.h"
#include "server/daemon/daemon.h"
#include "testing/park.h"
#include "tests/server/fake_device_memory.h"

namespace actstash::server {
namespace {

namespace pb = ::actstash::v1;
using testing::FakeDeviceMemory;
constexpr uint64_t kMiB = 1ull << 20;

class DeviceDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/actstash-device-daemon-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    state_ = std::make_shared<FakeDeviceMemory::State>();
  }
  void TearDown() override {
    attach_.reset();
    stub_.reset();
    // gRPC's ~Server may block on connections of this process: the daemon
    // is stopped but not destroyed (the test process exits soon anyway).
    if (daemon_ != nullptr) {
      daemon_->Shutdown(std::chrono::milliseconds(0));
      actstash::testing::ParkUntilExit(std::move(daemon_));
    }
    unlink((dir_ + "/s.sock").c_str());
    rmdir(dir_.c_str());
  }

  DaemonConfig Config(bool device_pool, uint64_t quota = 6 * kMiB) {
    DaemonConfig config;
    config.socket_path = dir_ + "/s.sock";
    config.pool_bytes = 4 * kMiB;
    config.segment_bytes = kMiB;
    config.max_session_quota = quota;
    config.default_session_quota = quota;
    config.mlock = Tristate::kOff;
    config.cuda_pin = Tristate::kOff;
    config.session_idle_ttl_seconds = 0;
    if (device_pool) config.device_pools.push_back({0, 4 * kMiB});
    return config;
  }
  void Start(bool device_pool, uint64_t quota = 6 * kMiB, std::string metrics_address = "") {
    DaemonConfig config = Config(device_pool, quota);
    config.metrics_address = std::move(metrics_address);
    absl::StatusOr<std::unique_ptr<Daemon>> daemon =
        Daemon::Start(config, std::make_unique<FakeDeviceMemory>(state_));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    stub_ = pb::Stash::NewStub(
        grpc::CreateChannel("unix://" + config.socket_path, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->OpenSession(&ctx, pb::OpenSessionRequest(), &open_).ok());
  }
  void Attach() {
    auto channel = client_internal::AttachConnection::Connect(
        attach::AttachSocketPath(dir_ + "/s.sock"), open_.token(), std::chrono::seconds(5));
    ASSERT_TRUE(channel.ok()) << channel.status();
    attach_ = *std::move(channel);
  }
  void Prepare(grpc::ClientContext* ctx) {
    ctx->AddMetadata(kTokenMetadataKey, open_.token());
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }
  grpc::Status Lease(const pb::LeaseRequest& request, pb::LeaseReply* reply) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return stub_->Lease(&ctx, request, reply);
  }
  pb::LeaseRequest DeviceRequest(uint32_t count, uint32_t per_lease = 1) {
    pb::LeaseRequest request;
    request.set_count(count);
    request.set_segments_per_lease(per_lease);
    request.set_tier(pb::LEASE_TIER_DEVICE);
    return request;
  }
  grpc::Status Return(std::initializer_list<uint64_t> ids) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    pb::ReturnRequest request;
    for (uint64_t id : ids) request.add_lease_ids(id);
    pb::ReturnReply reply;
    return stub_->Return(&ctx, request, &reply);
  }
  pb::StatsReply Stats() {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    pb::StatsReply reply;
    EXPECT_TRUE(stub_->Stats(&ctx, pb::StatsRequest(), &reply).ok());
    return reply;
  }
  // The fake's host bytes behind a device grant (its handle holds the address).
  static std::byte* Bytes(const pb::LeaseGrant& grant) {
    uint64_t address = 0;
    std::memcpy(&address, grant.ipc_handle().data(), sizeof(address));
    return FakeDeviceMemory::Host(address) + grant.offset();
  }

  std::string dir_;
  std::shared_ptr<FakeDeviceMemory::State> state_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<pb::Stash::Stub> stub_;
  pb::OpenSessionReply open_;
  std::unique_ptr<client_internal::AttachConnection> attach_;
};

void ExpectCode(const grpc::Status& status, grpc::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(text), std::string::npos) << status.error_message();
}

TEST_F(DeviceDaemonTest, DeviceTierWithoutDevicePoolIsFailedPrecondition) {
  Start(/*device_pool=*/false);
  Attach();
  EXPECT_EQ(open_.device_pools_size(), 0);
  pb::LeaseReply reply;
  ExpectCode(Lease(DeviceRequest(1), &reply), grpc::StatusCode::FAILED_PRECONDITION,
             "no device pool (start it with --device-pool GPU:SIZE)");
  EXPECT_EQ(Stats().device_pools_size(), 0);
  EXPECT_EQ(Stats().pool().cuda_pinned_bytes(), 0u);
}

TEST_F(DeviceDaemonTest, LeaseAndReturnDeviceSegments) {
  Start(/*device_pool=*/true);
  ASSERT_EQ(open_.device_pools_size(), 1);
  EXPECT_EQ(open_.device_pools(0).device(), 0u);
  EXPECT_EQ(open_.device_pools(0).total_bytes(), 4 * kMiB);
  EXPECT_EQ(open_.device_pools(0).segment_bytes(), kMiB);

  pb::LeaseReply reply;
  ExpectCode(Lease(DeviceRequest(1), &reply), grpc::StatusCode::FAILED_PRECONDITION,
             "attach connection");
  Attach();
  ASSERT_TRUE(Lease(DeviceRequest(2), &reply).ok());
  ASSERT_EQ(reply.leases_size(), 2);
  for (const pb::LeaseGrant& grant : reply.leases()) {
    EXPECT_EQ(grant.tier(), pb::LEASE_TIER_DEVICE);
    EXPECT_EQ(grant.device(), 0u);
    EXPECT_EQ(grant.ipc_handle().size(), kIpcHandleBytes);
    EXPECT_EQ(grant.ipc_handle(), reply.leases(0).ipc_handle());  // one handle per pool
    EXPECT_EQ(grant.region_bytes(), 4 * kMiB);
    EXPECT_EQ(grant.bytes(), kMiB);
    EXPECT_EQ(grant.segments(), 1u);
    EXPECT_EQ(grant.offset() % kMiB, 0u);
    EXPECT_LE(grant.offset() + grant.bytes(), grant.region_bytes());
  }
  EXPECT_NE(reply.leases(0).offset(), reply.leases(1).offset());
  EXPECT_NE(reply.leases(0).lease_id(), reply.leases(1).lease_id());

  // A host lease in the same session: a different tier, a different id space.
  pb::LeaseRequest host;
  host.set_count(1);
  pb::LeaseReply host_reply;
  ASSERT_TRUE(Lease(host, &host_reply).ok());
  EXPECT_EQ(host_reply.leases(0).tier(), pb::LEASE_TIER_HOST);
  EXPECT_TRUE(host_reply.leases(0).ipc_handle().empty());

  pb::StatsReply stats = Stats();
  ASSERT_EQ(stats.device_pools_size(), 1);
  EXPECT_EQ(stats.device_pools(0).pool().used_bytes(), 2 * kMiB);
  EXPECT_EQ(stats.device_pools(0).pool().free_bytes(), 2 * kMiB);
  EXPECT_EQ(stats.device_pools(0).pool().leases(), 2u);
  EXPECT_EQ(stats.self().leases(), 3u);
  EXPECT_EQ(stats.self().used_bytes(), 3 * kMiB);

  std::byte* bytes = Bytes(reply.leases(0));
  std::memset(bytes, 0x5a, kMiB);
  state_->Handover();
  ASSERT_TRUE(Return({reply.leases(0).lease_id(), host_reply.leases(0).lease_id()}).ok());
  // Scrubbed on the daemon's work queue, then free.
  for (int i = 0; i < 500 && Stats().device_pools(0).pool().free_bytes() != 3 * kMiB; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stats = Stats();
  EXPECT_EQ(stats.device_pools(0).pool().used_bytes(), kMiB);
  EXPECT_EQ(stats.device_pools(0).pool().renewing_bytes(), 0u);
  EXPECT_EQ(stats.device_pools(0).pool().free_bytes(), 3 * kMiB);
  state_->Handover();
  for (uint64_t i = 0; i < kMiB; ++i) ASSERT_EQ(bytes[i], std::byte{0}) << i;
  ExpectCode(Return({reply.leases(0).lease_id()}), grpc::StatusCode::NOT_FOUND, "no lease");
}

TEST_F(DeviceDaemonTest, BadDeviceRequests) {
  Start(/*device_pool=*/true, /*quota=*/3 * kMiB);
  Attach();
  pb::LeaseReply reply;
  ExpectCode(Lease(DeviceRequest(0), &reply), grpc::StatusCode::INVALID_ARGUMENT,
             "Lease count 0 is not in [1, 256]");
  ExpectCode(Lease(DeviceRequest(257), &reply), grpc::StatusCode::INVALID_ARGUMENT,
             "Lease count 257");
  ExpectCode(Lease(DeviceRequest(1, 5), &reply), grpc::StatusCode::RESOURCE_EXHAUSTED,
             "requested a lease of 5 segments; the device pool on GPU 0 has 4");
  pb::LeaseRequest other_gpu = DeviceRequest(1);
  other_gpu.set_device(3);
  ExpectCode(Lease(other_gpu, &reply), grpc::StatusCode::FAILED_PRECONDITION,
             "no device pool on GPU 3");
  pb::LeaseRequest bad_tier = DeviceRequest(1);
  bad_tier.set_tier(static_cast<pb::LeaseTier>(7));
  ExpectCode(Lease(bad_tier, &reply), grpc::StatusCode::INVALID_ARGUMENT, "unknown lease tier 7");
  // Over the session quota (3 MiB): the numbers, and nothing taken.
  ExpectCode(Lease(DeviceRequest(2, 2), &reply), grpc::StatusCode::RESOURCE_EXHAUSTED,
             std::to_string(4 * kMiB));
  EXPECT_EQ(Stats().device_pools(0).pool().used_bytes(), 0u);
  pb::LeaseRequest gpu0 = DeviceRequest(3);
  gpu0.set_device(0);
  ASSERT_TRUE(Lease(gpu0, &reply).ok());
  ExpectCode(Lease(DeviceRequest(1), &reply), grpc::StatusCode::RESOURCE_EXHAUSTED, "quota");
}

TEST_F(DeviceDaemonTest, HangingUpReclaimsAndScrubsDeviceLeases) {
  Start(/*device_pool=*/true);
  Attach();
  pb::LeaseReply reply;
  ASSERT_TRUE(Lease(DeviceRequest(1, 4), &reply).ok());
  std::byte* bytes = Bytes(reply.leases(0));
  std::memset(bytes, 0x33, 4 * kMiB);
  state_->Handover();
  const std::string token = open_.token();
  attach_->Shutdown();  // the client "dies"

  // An observer session watches the pool come back.
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->OpenSession(&ctx, pb::OpenSessionRequest(), &open_).ok());
  uint64_t used = 1;
  for (int i = 0; i < 500 && used != 0; ++i) {
    used = Stats().device_pools(0).pool().used_bytes() +
           Stats().device_pools(0).pool().renewing_bytes();
    if (used != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(used, 0u);
  EXPECT_EQ(Stats().sessions_reclaimed(), 1u);
  state_->Handover();
  for (uint64_t i = 0; i < 4 * kMiB; i += 4096) ASSERT_EQ(bytes[i], std::byte{0}) << i;
  EXPECT_EQ(state_->Count("free"), 0u);  // the region lives as long as the daemon
}

// A port nothing listens on now (the metrics server binds it right after).
int FreePort() {
  const UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return 0;
  }
  return ntohs(addr.sin_port);
}

std::string HttpGet(int port, const std::string& path) {
  const UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd.get(), request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n = 0;
      while ((n = read(fd.get(), buffer, sizeof(buffer))) > 0) response.append(buffer, n);
    }
  }
  return response;
}

TEST_F(DeviceDaemonTest, MetricsShowDevicePoolsAndCudaPinnedBytes) {
  const int port = FreePort();
  ASSERT_NE(port, 0);
  Start(/*device_pool=*/true, 6 * kMiB, "127.0.0.1:" + std::to_string(port));
  Attach();
  pb::LeaseReply reply;
  ASSERT_TRUE(Lease(DeviceRequest(1, 3), &reply).ok());
  const std::string metrics = HttpGet(port, "/metrics");
  for (const std::string& line :
       {std::string("actstash_pool_bytes{state=\"cuda_pinned\"} 0"),
        "actstash_device_pool_bytes{device=\"0\",state=\"total\"} " + std::to_string(4 * kMiB),
        "actstash_device_pool_bytes{device=\"0\",state=\"used\"} " + std::to_string(3 * kMiB),
        "actstash_device_pool_bytes{device=\"0\",state=\"free\"} " + std::to_string(kMiB),
        std::string("actstash_device_pool_bytes{device=\"0\",state=\"scrubbing\"} 0"),
        std::string("actstash_device_leases{device=\"0\"} 1")}) {
    EXPECT_NE(metrics.find(line), std::string::npos) << line << "\n" << metrics;
  }
}

// Without a device (this machine, CI): --cuda-pin=on and --device-pool
// refuse to start, saying why. With one, both work.
TEST_F(DeviceDaemonTest, CudaSettingsWithoutADeviceRefuseToStart) {
  DaemonConfig pin_on = Config(/*device_pool=*/false);
  pin_on.cuda_pin = Tristate::kOn;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(pin_on);
  if (daemon.ok()) {
    (*daemon)->Shutdown(std::chrono::milliseconds(0));
    actstash::testing::ParkUntilExit(*std::move(daemon));  // see TearDown
    GTEST_SKIP() << "a CUDA device is present";
  }
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition) << daemon.status();
  EXPECT_NE(daemon.status().message().find("cuda_pin is on: cannot pin memory for CUDA"),
            absl::string_view::npos)
      << daemon.status();

  // The real DeviceMemory (no fake given).
  unlink((dir_ + "/s.sock").c_str());
  daemon = Daemon::Start(Config(/*device_pool=*/true));
  ASSERT_FALSE(daemon.ok());
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition) << daemon.status();
  EXPECT_TRUE(absl::StartsWith(daemon.status().message(), "device_pool: ")) << daemon.status();
}

}  // namespace
}  // namespace actstash::server
