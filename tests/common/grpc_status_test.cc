// Unit tests of the absl::Status <-> grpc::Status conversion.
#include "common/grpc_status.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace actstash {
namespace {

constexpr int kFirstCode = 0;  // OK
constexpr int kLastCode = 16;  // UNAUTHENTICATED

TEST(GrpcStatusTest, OkBothWays) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_TRUE(FromGrpcStatus(ToGrpcStatus(absl::OkStatus())).ok());
}

TEST(GrpcStatusTest, EveryCodeRoundTripsFromAbsl) {
  for (int code = kFirstCode + 1; code <= kLastCode; ++code) {
    const auto absl_code = static_cast<absl::StatusCode>(code);
    const absl::Status original(absl_code,
                                absl::StrCat("failure ", absl::StatusCodeToString(absl_code)));
    const grpc::Status converted = ToGrpcStatus(original);
    EXPECT_FALSE(converted.ok()) << code;
    EXPECT_EQ(static_cast<int>(converted.error_code()), code);
    EXPECT_EQ(converted.error_message(), original.message()) << code;
    EXPECT_EQ(FromGrpcStatus(converted), original) << code;
  }
}

TEST(GrpcStatusTest, EveryCodeRoundTripsFromGrpc) {
  for (int code = kFirstCode + 1; code <= kLastCode; ++code) {
    const grpc::Status original(static_cast<grpc::StatusCode>(code),
                                absl::StrCat("grpc failure ", code));
    const absl::Status converted = FromGrpcStatus(original);
    EXPECT_FALSE(converted.ok()) << code;
    EXPECT_EQ(static_cast<int>(converted.code()), code);
    EXPECT_EQ(converted.message(), original.error_message()) << code;
    const grpc::Status back = ToGrpcStatus(converted);
    EXPECT_EQ(back.error_code(), original.error_code()) << code;
    EXPECT_EQ(back.error_message(), original.error_message()) << code;
  }
}

TEST(GrpcStatusTest, NamedCodesMapOneToOne) {
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::UnauthenticatedError("x")).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ToGrpcStatus(absl::FailedPreconditionError("x")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(absl::DataLossError("x")).error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down")).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "late")).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(GrpcStatusTest, MessagesAreKeptVerbatim) {
  const std::string message = "quota: requested 1048576 bytes, available 0 \xE2\x9C\x97 \"q\"\n";
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError(message)).error_message(), message);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::INTERNAL, message)).message(), message);
  const std::string empty;
  EXPECT_EQ(ToGrpcStatus(absl::InternalError(empty)).error_message(), empty);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::ABORTED, "")).code(),
            absl::StatusCode::kAborted);
  const std::string long_message(10000, 'm');
  EXPECT_EQ(FromGrpcStatus(ToGrpcStatus(absl::AbortedError(long_message))).message(), long_message);
}

}  // namespace
}  // namespace actstash
