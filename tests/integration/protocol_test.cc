// The wire contract of actstash.v1.Stash against a real actstashd, driven
// through raw gRPC stubs: tokens, malformed Put streams, limits, health and
// reflection. Every refused request must leave nothing stored and the daemon
// serving.
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include <thread>

#include "actstash/v1/stash.grpc.pb.h"
#include "common/checksum.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;
namespace pb = ::actstash::v1;

class ProtocolTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    DaemonProcessOptions options;
    options.pool_size = "64MiB";
    options.segment_size = "8MiB";
    options.extra_args = {"--max-session-quota", "32MiB"};
    daemon_ = StartDaemonOrDie(options).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    channel_ = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
    stub_ = pb::Stash::NewStub(channel_);
    pb::OpenSessionRequest request;
    request.set_client_name("raw");
    pb::OpenSessionReply reply;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->OpenSession(&ctx, request, &reply).ok());
    token_ = reply.token();
    EXPECT_EQ(token_.size(), 32u);
    EXPECT_EQ(reply.quota_bytes(), 32u << 20);
    EXPECT_EQ(reply.max_chunk_bytes(), 1u << 20);
  }

  void Authorize(grpc::ClientContext* ctx, const std::string& token) const {
    ctx->AddMetadata("x-actstash-token", token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  }

  // Sends the chunks of one Put stream and returns its status.
  grpc::Status SendPut(const std::vector<pb::PutChunk>& chunks, pb::PutReply* reply,
                       const std::string* token = nullptr) {
    grpc::ClientContext ctx;
    Authorize(&ctx, token ? *token : token_);
    auto writer = stub_->Put(&ctx, reply);
    for (const pb::PutChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  pb::StatsReply Stats() {
    grpc::ClientContext ctx;
    Authorize(&ctx, token_);
    pb::StatsReply reply;
    EXPECT_TRUE(stub_->Stats(&ctx, pb::StatsRequest(), &reply).ok());
    return reply;
  }

  static pb::PutChunk Header(uint64_t nbytes) {
    pb::PutChunk chunk;
    chunk.mutable_header()->set_dtype("uint8");
    chunk.mutable_header()->add_shape(static_cast<int64_t>(nbytes));
    chunk.mutable_header()->set_nbytes(nbytes);
    return chunk;
  }
  static pb::PutChunk Data(size_t n, char fill = 'x') {
    pb::PutChunk chunk;
    chunk.set_data(std::string(n, fill));
    return chunk;
  }

  void ExpectNothingStored() {
    pb::StatsReply stats = Stats();
    EXPECT_EQ(stats.self().used_bytes(), 0u);
    EXPECT_EQ(stats.self().objects(), 0u);
    EXPECT_EQ(stats.pool().used_bytes(), 0u);
  }

  static DaemonProcess* daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Stash::Stub> stub_;
  std::string token_;
};
DaemonProcess* ProtocolTest::daemon_ = nullptr;

TEST_F(ProtocolTest, EveryCallButOpenSessionNeedsAValidToken) {
  for (const std::string& token :
       {std::string(), std::string("0123456789abcdef0123456789abcdef"), token_ + "x"}) {
    SCOPED_TRACE("token '" + token + "'");
    auto prepare = [&](grpc::ClientContext* ctx) {
      ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      if (!token.empty()) ctx->AddMetadata("x-actstash-token", token);
    };
    {
      grpc::ClientContext ctx;
      prepare(&ctx);
      pb::StatsReply reply;
      grpc::Status s = stub_->Stats(&ctx, pb::StatsRequest(), &reply);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
      EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr(token_)));
    }
    {
      grpc::ClientContext ctx;
      prepare(&ctx);
      pb::DeleteRequest request;
      request.add_handles(1);
      pb::DeleteReply reply;
      EXPECT_EQ(stub_->Delete(&ctx, request, &reply).error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext ctx;
      prepare(&ctx);
      pb::GetRequest request;
      request.set_handle(1);
      auto reader = stub_->Get(&ctx, request);
      pb::GetChunk chunk;
      EXPECT_FALSE(reader->Read(&chunk));
      EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext ctx;
      prepare(&ctx);
      pb::PutReply reply;
      auto writer = stub_->Put(&ctx, &reply);
      writer->Write(Header(10));
      writer->Write(Data(10));
      writer->WritesDone();
      EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext ctx;
      prepare(&ctx);
      pb::CloseSessionReply reply;
      EXPECT_EQ(stub_->CloseSession(&ctx, pb::CloseSessionRequest(), &reply).error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
  }
  ExpectNothingStored();
}

TEST_F(ProtocolTest, WellFormedPutWithChecksumIsStored) {
  pb::PutChunk header = Header(3 << 20);
  const std::string payload(3 << 20, 'q');
  header.mutable_header()->mutable_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_XXH3_64);
  header.mutable_header()->mutable_checksum()->set_value(Xxh3(payload.data(), payload.size()));
  pb::PutReply reply;
  grpc::Status s =
      SendPut({header, Data(1 << 20, 'q'), Data(1 << 20, 'q'), Data(1 << 20, 'q')}, &reply);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(reply.handle(), 0u);
  EXPECT_EQ(Stats().self().used_bytes(), 3u << 20);
  grpc::ClientContext ctx;
  Authorize(&ctx, token_);
  pb::DeleteRequest request;
  request.add_handles(reply.handle());
  pb::DeleteReply deleted;
  ASSERT_TRUE(stub_->Delete(&ctx, request, &deleted).ok());
  EXPECT_EQ(deleted.bytes_freed(), 3u << 20);
}

TEST_F(ProtocolTest, MalformedPutStreamsAreInvalidArgumentAndStoreNothing) {
  pb::PutChunk bad_checksum = Header(100);
  bad_checksum.mutable_header()->mutable_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_XXH3_64);
  bad_checksum.mutable_header()->mutable_checksum()->set_value(12345);
  pb::PutChunk unknown_algorithm = Header(1);
  unknown_algorithm.mutable_header()->mutable_checksum()->set_algorithm(
      static_cast<pb::ChecksumAlgorithm>(7));
  pb::PutChunk long_dtype = Header(1);
  long_dtype.mutable_header()->set_dtype(std::string(33, 'd'));
  pb::PutChunk many_dims = Header(1);
  for (int i = 0; i < 16; ++i) many_dims.mutable_header()->add_shape(1);
  pb::PutChunk negative_dim = Header(1);
  negative_dim.mutable_header()->add_shape(-3);

  const struct {
    const char* name;
    std::vector<pb::PutChunk> chunks;
    const char* message;
  } kCases[] = {
      {"empty stream", {}, "without a header"},
      {"data before header", {Data(10), Header(10)}, "first Put chunk"},
      {"two headers", {Header(10), Header(10)}, "only the first"},
      {"short", {Header(100), Data(50)}, "ended after 50 bytes"},
      {"long", {Header(100), Data(60), Data(60)}, "more than the header's nbytes"},
      {"oversized chunk", {Header(2 << 20), Data((1 << 20) + 1)}, "exceeds the limit"},
      {"checksum mismatch", {bad_checksum, Data(100)}, "checksum mismatch"},
      {"unknown checksum algorithm", {unknown_algorithm, Data(1)}, "checksum algorithm"},
      {"long dtype", {long_dtype, Data(1)}, "dtype"},
      {"17 dims", {many_dims, Data(1)}, "dimensions"},
      {"negative dim", {negative_dim, Data(1)}, "negative"},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    pb::PutReply reply;
    grpc::Status s = SendPut(c.chunks, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    ExpectNothingStored();
  }
}

TEST_F(ProtocolTest, OverQuotaPutIsRefusedBeforeAnyData) {
  pb::PutReply reply;
  grpc::Status s = SendPut({Header(33 << 20)}, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("requested 34603008 bytes, available 33554432"));
  ExpectNothingStored();
}

TEST_F(ProtocolTest, CancelledPutStoresNothing) {
  grpc::ClientContext ctx;
  Authorize(&ctx, token_);
  pb::PutReply reply;
  auto writer = stub_->Put(&ctx, &reply);
  ASSERT_TRUE(writer->Write(Header(4 << 20)));
  ASSERT_TRUE(writer->Write(Data(1 << 20)));
  ctx.TryCancel();
  EXPECT_FALSE(writer->Finish().ok());
  // The daemon sees the cancellation asynchronously.
  for (int i = 0; i < 100 && Stats().pool().used_bytes() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ExpectNothingStored();
}

TEST_F(ProtocolTest, LimitsOnOpenSessionAndDelete) {
  {
    grpc::ClientContext ctx;
    pb::OpenSessionRequest request;
    request.set_client_name(std::string(129, 'n'));
    pb::OpenSessionReply reply;
    EXPECT_EQ(stub_->OpenSession(&ctx, request, &reply).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    pb::OpenSessionRequest request;
    request.set_quota_bytes(uint64_t{1} << 62);
    pb::OpenSessionReply reply;
    ASSERT_TRUE(stub_->OpenSession(&ctx, request, &reply).ok());
    EXPECT_EQ(reply.quota_bytes(), 32u << 20) << "a quota above the cap is granted the cap";
  }
  {
    grpc::ClientContext ctx;
    Authorize(&ctx, token_);
    pb::DeleteRequest request;
    for (int i = 0; i < 65537; ++i) request.add_handles(static_cast<uint64_t>(i) + 1);
    pb::DeleteReply reply;
    grpc::Status s = stub_->Delete(&ctx, request, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("65536"));
  }
}

TEST_F(ProtocolTest, HealthServiceReportsServing) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (const char* service : {"", "actstash.v1.Stash"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&ctx, request, &response).ok()) << service;
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
}

TEST_F(ProtocolTest, ReflectionListsTheServicesAndDescribesStash) {
  auto reflection = grpc::reflection::v1alpha::ServerReflection::NewStub(channel_);
  grpc::ClientContext ctx;
  auto stream = reflection->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& s : response.list_services_response().service()) services.push_back(s.name());
  EXPECT_THAT(services, ::testing::IsSupersetOf({"actstash.v1.Stash", "grpc.health.v1.Health"}));

  request.set_file_containing_symbol("actstash.v1.Stash");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_GT(response.file_descriptor_response().file_descriptor_proto_size(), 0);
  EXPECT_THAT(response.file_descriptor_response().file_descriptor_proto(0),
              HasSubstr("actstash/v1/stash.proto"));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace actstash::testing
