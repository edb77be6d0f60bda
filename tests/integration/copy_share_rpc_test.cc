// CopyShare against a real actstashd over raw gRPC: the node's copy
// bandwidth (--copy-bandwidth configured, off, auto) divided among the
// sessions copying at once, what makes a session count (a CopyShare call, a
// Put), and the refusal of bad rates.
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "actstash/v1/stash.grpc.pb.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;
namespace pb = ::actstash::v1;

// One raw session on a daemon.
class RawSession {
 public:
  explicit RawSession(const DaemonProcess& daemon)
      : stub_(pb::Stash::NewStub(
            grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()))) {
    grpc::ClientContext ctx;
    pb::OpenSessionReply reply;
    pb::OpenSessionRequest request;
    request.set_client_name("share");
    status_ = stub_->OpenSession(&ctx, request, &reply);
    token_ = reply.token();
  }
  const grpc::Status& opened() const { return status_; }

  grpc::Status Share(double store, double fetch, pb::CopyShareReply* reply) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    pb::CopyShareRequest request;
    request.set_probe_store_bytes_per_second(store);
    request.set_probe_fetch_bytes_per_second(fetch);
    return stub_->CopyShare(&ctx, request, reply);
  }
  pb::CopyShareReply Share(double store = 0, double fetch = 0) {
    pb::CopyShareReply reply;
    grpc::Status status = Share(store, fetch, &reply);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return reply;
  }
  pb::StatsReply Stats() {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    pb::StatsRequest request;
    request.set_per_session(true);
    pb::StatsReply reply;
    grpc::Status status = stub_->Stats(&ctx, request, &reply);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return reply;
  }
  // Stores `n` bytes through Put.
  grpc::Status Put(size_t n) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    pb::PutReply reply;
    auto writer = stub_->Put(&ctx, &reply);
    pb::PutChunk header;
    header.mutable_header()->set_dtype("uint8");
    header.mutable_header()->add_shape(static_cast<int64_t>(n));
    header.mutable_header()->set_nbytes(n);
    writer->Write(header);
    pb::PutChunk data;
    data.set_data(std::string(n, 'x'));
    writer->Write(data);
    writer->WritesDone();
    return writer->Finish();
  }

 private:
  void Prepare(grpc::ClientContext* ctx) const {
    ctx->AddMetadata("x-actstash-token", token_);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }
  std::unique_ptr<pb::Stash::Stub> stub_;
  grpc::Status status_;
  std::string token_;
};

std::unique_ptr<DaemonProcess> Daemon(const std::string& copy_bandwidth) {
  DaemonProcessOptions options;
  options.pool_size = "64MiB";
  options.segment_size = "8MiB";
  if (!copy_bandwidth.empty()) options.extra_args = {"--copy-bandwidth", copy_bandwidth};
  return StartDaemonOrDie(options);
}

TEST(CopyShareRpcTest, TheConfiguredBandwidthIsDividedAmongTheCopyingSessions) {
  std::unique_ptr<DaemonProcess> daemon = Daemon("12GB/s");
  RawSession a(*daemon), b(*daemon), c(*daemon);
  ASSERT_TRUE(a.opened().ok() && b.opened().ok() && c.opened().ok());
  pb::CopyShareReply alone = a.Share(3e9, 4e9);
  EXPECT_EQ(alone.node().node_bytes_per_second(), 12e9);
  EXPECT_EQ(alone.node().node_source(), "configured");
  EXPECT_EQ(alone.node().copying_sessions(), 1u);  // the asker; b and c never copied
  EXPECT_EQ(alone.share_bytes_per_second(), 12e9);
  EXPECT_EQ(b.Share().share_bytes_per_second(), 6e9);
  // A Put is a copy too: c counts without asking.
  ASSERT_TRUE(c.Put(4096).ok());
  pb::CopyShareReply three = a.Share(3e9, 4e9);
  EXPECT_EQ(three.node().copying_sessions(), 3u);
  EXPECT_EQ(three.share_bytes_per_second(), 4e9);
  EXPECT_EQ(three.node().window_seconds(), 30u);
  pb::StatsReply stats = c.Stats();
  EXPECT_EQ(stats.copy().copying_sessions(), 3u);
  EXPECT_EQ(stats.copy().node_bytes_per_second(), 12e9);
  ASSERT_EQ(stats.all_sessions_size(), 3);
  int with_probe = 0;
  for (const pb::SessionStats& s : stats.all_sessions()) {
    EXPECT_TRUE(s.copying()) << s.session_id();
    if (s.probe_store_bytes_per_second() == 3e9) {
      EXPECT_EQ(s.probe_fetch_bytes_per_second(), 4e9);
      ++with_probe;
    }
  }
  EXPECT_EQ(with_probe, 1);
}

TEST(CopyShareRpcTest, BadRatesAreRefusedAndChangeNothing) {
  std::unique_ptr<DaemonProcess> daemon = Daemon("12GB/s");
  RawSession a(*daemon), b(*daemon);
  ASSERT_TRUE(a.opened().ok() && b.opened().ok());
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(bad);
    pb::CopyShareReply reply;
    grpc::Status status = a.Share(bad, 1e9, &reply);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("probe_store_bytes_per_second"));
    status = a.Share(1e9, bad, &reply);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("probe_fetch_bytes_per_second"));
  }
  // A refused request did not count a as copying.
  EXPECT_EQ(b.Share().node().copying_sessions(), 1u);
  EXPECT_EQ(b.Stats().copy().copying_sessions(), 1u);
}

TEST(CopyShareRpcTest, OffLeavesTheShareUnknown) {
  std::unique_ptr<DaemonProcess> daemon = Daemon("off");
  RawSession a(*daemon);
  ASSERT_TRUE(a.opened().ok());
  pb::CopyShareReply reply = a.Share(1e9, 1e9);
  EXPECT_EQ(reply.node().node_bytes_per_second(), 0);
  EXPECT_EQ(reply.node().node_source(), "");
  EXPECT_EQ(reply.node().copying_sessions(), 1u);
  EXPECT_EQ(reply.share_bytes_per_second(), 0);
}

TEST(CopyShareRpcTest, AutoMeasuresTheNodeAfterTheFirstRequest) {
  std::unique_ptr<DaemonProcess> daemon = Daemon("");  // the default: auto
  RawSession a(*daemon);
  ASSERT_TRUE(a.opened().ok());
  EXPECT_EQ(a.Stats().copy().node_bytes_per_second(), 0);  // nobody asked: not measured
  a.Share();
  // Measured on the daemon's work queue (hundreds of ms; more on a loaded host).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  pb::CopyStats copy;
  while (std::chrono::steady_clock::now() < deadline) {
    copy = a.Stats().copy();
    if (copy.node_bytes_per_second() > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(copy.node_source(), "measured");
  EXPECT_GT(copy.node_bytes_per_second(), 1e8);  // any host copies 100 MB/s
  EXPECT_EQ(a.Share().share_bytes_per_second(), copy.node_bytes_per_second());
  EXPECT_THAT(daemon->log(), HasSubstr("node copy bandwidth measured"));
}

}  // namespace
}  // namespace actstash::testing
