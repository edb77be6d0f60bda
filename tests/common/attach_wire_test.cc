// The attach channel's framing over a real socketpair: fds travel, malformed
// frames are refused, timeouts and end of stream are reported.
#include "common/attach_wire.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "common/unique_fd.h"

namespace actstash::attach {
namespace {

class AttachWireTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    close(fds_[0]);
    if (fds_[1] >= 0) close(fds_[1]);
  }
  int fds_[2] = {-1, -1};
};

TEST_F(AttachWireTest, MessageWithFdsArrivesIntact) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  SegmentsPayload payload;
  payload.lease_id = 42;
  payload.count = 2;
  ASSERT_TRUE(
      SendMessage(fds_[0], MessageType::kSegments,
                  absl::string_view(reinterpret_cast<const char*>(&payload), sizeof(payload)),
                  {pipe_fds[0], pipe_fds[1]})
          .ok());
  absl::StatusOr<Message> message = ReceiveMessage(fds_[1], std::chrono::seconds(1));
  ASSERT_TRUE(message.ok()) << message.status();
  EXPECT_EQ(message->type, MessageType::kSegments);
  ASSERT_EQ(message->payload.size(), sizeof(payload));
  SegmentsPayload back;
  std::memcpy(&back, message->payload.data(), sizeof(back));
  EXPECT_EQ(back.lease_id, 42u);
  ASSERT_EQ(message->fds.size(), 2u);
  struct stat a {
  }, b{};
  ASSERT_EQ(fstat(message->fds[0].get(), &a), 0);
  ASSERT_EQ(fstat(pipe_fds[0], &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "the received fd is the same pipe";
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

TEST_F(AttachWireTest, MalformedHeadersAreInvalidArgument) {
  for (MessageHeader header :
       {MessageHeader{0xdeadbeef, kVersion, 1, 0}, MessageHeader{kMagic, 99, 1, 0},
        MessageHeader{kMagic, kVersion, 77, 0}, MessageHeader{kMagic, kVersion, 1, 1u << 30}}) {
    ASSERT_EQ(write(fds_[0], &header, sizeof(header)), static_cast<ssize_t>(sizeof(header)));
    absl::StatusOr<Message> message = ReceiveMessage(fds_[1], std::chrono::seconds(1));
    EXPECT_EQ(message.status().code(), absl::StatusCode::kInvalidArgument) << message.status();
  }
}

TEST(AttachFramingTest, EncodedMessagesReadBackAndHeadersAreChecked) {
  // The daemon's non-blocking server writes frames with EncodeMessage and
  // PayloadOf; the client reads them with ReceiveMessage: one format.
  WelcomePayload welcome;
  welcome.session_id = 7;
  const std::string bytes =
      EncodeMessage(MessageType::kWelcome, PayloadOf(welcome, absl::string_view("why")));
  ASSERT_EQ(bytes.size(), sizeof(MessageHeader) + sizeof(welcome) + 3);
  MessageHeader header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  EXPECT_TRUE(CheckHeader(header).ok());
  EXPECT_EQ(header.payload_bytes, sizeof(welcome) + 3);
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd writer(pair[0]), reader(pair[1]);
  ASSERT_EQ(write(writer.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  absl::StatusOr<Message> message = ReceiveMessage(reader.get(), std::chrono::seconds(1));
  ASSERT_TRUE(message.ok()) << message.status();
  EXPECT_EQ(message->type, MessageType::kWelcome);
  WelcomePayload back;
  std::memcpy(&back, message->payload.data(), sizeof(back));
  EXPECT_EQ(back.session_id, 7u);
  EXPECT_EQ(message->payload.substr(sizeof(back)), "why");

  header.magic = 0;
  EXPECT_EQ(CheckHeader(header).code(), absl::StatusCode::kInvalidArgument);
  header.magic = kMagic;
  header.payload_bytes = kMaxPayloadBytes + 1;
  EXPECT_EQ(CheckHeader(header).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AttachWireTest, TimeoutAndEndOfStream) {
  absl::StatusOr<Message> nothing = ReceiveMessage(fds_[1], std::chrono::milliseconds(20));
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kDeadlineExceeded);
  MessageHeader header;
  header.type = static_cast<uint16_t>(MessageType::kHello);
  header.payload_bytes = 10;
  ASSERT_EQ(write(fds_[0], &header, sizeof(header)), static_cast<ssize_t>(sizeof(header)));
  ASSERT_EQ(write(fds_[0], "abc", 3), 3);
  shutdown(fds_[0], SHUT_WR);  // the payload never completes
  absl::StatusOr<Message> cut = ReceiveMessage(fds_[1], std::chrono::seconds(1));
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kUnavailable) << cut.status();
}

TEST(AttachSocketPathTest, SitsBesideTheGrpcSocket) {
  EXPECT_EQ(AttachSocketPath("/run/actstash/actstash.sock"), "/run/actstash/actstash.attach.sock");
  EXPECT_EQ(AttachSocketPath("/tmp/x/daemon"), "/tmp/x/daemon.attach");
}

}  // namespace
}  // namespace actstash::attach
