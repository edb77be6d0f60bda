// AttachConnection against a stand-in daemon end on a real Unix socket: when the
// daemon's end closes, ConfirmLost says so at once, whatever the watcher
// thread has or has not seen yet; a lease message waiting to be read is not a
// hang-up.
#include "client/rpc/attach_connection.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>

#include "common/attach_wire.h"
#include "common/unique_fd.h"

namespace actstash::client_internal {
namespace {

using namespace std::chrono_literals;

class AttachChannelTest : public testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/actstash-attach-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/attach.sock";
    listener_ = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(listener_.valid());
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    ASSERT_EQ(bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(listen(listener_.get(), 1), 0);
  }
  void TearDown() override {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }

  // The daemon's side of an attach: takes the hello, answers a welcome to
  // session 42. The connection stays open until `daemon_end_` closes. The
  // client blocks in connect until the welcome, so it runs first: the
  // listen backlog holds the connection until accept.
  std::unique_ptr<AttachConnection> Attach() {
    auto connecting = std::async(std::launch::async,
                                 [this] { return AttachConnection::Connect(path_, "token", 5s); });
    daemon_end_ = UniqueFd(accept(listener_.get(), nullptr, nullptr));
    EXPECT_TRUE(daemon_end_.valid());
    absl::StatusOr<attach::Message> hello = attach::ReceiveMessage(daemon_end_.get(), 5s);
    EXPECT_TRUE(hello.ok()) << hello.status();
    attach::WelcomePayload welcome;
    welcome.session_id = 42;
    EXPECT_TRUE(attach::SendMessage(daemon_end_.get(), attach::MessageType::kWelcome,
                                    attach::PayloadOf(welcome))
                    .ok());
    absl::StatusOr<std::unique_ptr<AttachConnection>> channel = connecting.get();
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  std::string dir_;
  std::string path_;
  UniqueFd listener_;
  UniqueFd daemon_end_;
};

TEST_F(AttachChannelTest, OpenConnectionIsNotLost) {
  std::unique_ptr<AttachConnection> channel = Attach();
  ASSERT_NE(channel, nullptr);
  EXPECT_EQ(channel->session_id(), 42u);
  EXPECT_FALSE(channel->ConfirmLost(20ms));
  EXPECT_FALSE(channel->lost());
}

TEST_F(AttachChannelTest, UnreadLeaseMessageIsNotAHangUp) {
  std::unique_ptr<AttachConnection> channel = Attach();
  ASSERT_NE(channel, nullptr);
  attach::SegmentsPayload payload;
  payload.lease_id = 7;
  ASSERT_TRUE(attach::SendMessage(daemon_end_.get(), attach::MessageType::kSegments,
                                  attach::PayloadOf(payload))
                  .ok());
  EXPECT_FALSE(channel->ConfirmLost(20ms));
  EXPECT_FALSE(channel->lost());
}

// The race a killed daemon left to chance: its attach socket is closed, but
// the watcher thread may not have run yet. ConfirmLost looks at the socket
// itself, with no wait.
TEST_F(AttachChannelTest, ClosedDaemonEndIsLostAtOnce) {
  std::unique_ptr<AttachConnection> channel = Attach();
  ASSERT_NE(channel, nullptr);
  daemon_end_.Reset();
  EXPECT_TRUE(channel->ConfirmLost(0ms));
  EXPECT_TRUE(channel->lost());
}

// A connection the client hung up on itself is lost too.
TEST_F(AttachChannelTest, ShutdownIsLost) {
  std::unique_ptr<AttachConnection> channel = Attach();
  ASSERT_NE(channel, nullptr);
  channel->Shutdown();
  EXPECT_TRUE(channel->ConfirmLost(1s));
}

}  // namespace
}  // namespace actstash::client_internal
