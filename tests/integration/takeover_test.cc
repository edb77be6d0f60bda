// actstashd --take-over against real daemons: a successor started beside the
// serving daemon takes its pool, sessions, leases and attach connections;
// clients keep their tickets and mapped memory, and see at most a pause.
// Refusals (another protocol, another pool, a take-over already running, a
// foreign uid) leave the serving daemon serving; a successor that does not
// trust what it received serves nothing.
#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "actstash/v1/handover.pb.h"
#include "common/attach_wire.h"
#include "common/unix_socket.h"
#include "server/restart/state_image.h"
#include "server/restart/take_over.h"
#include "tests/integration/takeover_util.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using attach::MessageType;
using ::testing::HasSubstr;

class TakeOverTest : public ::testing::Test {
 protected:
  // After the test's own daemons are gone: the retired ones' folders.
  void TearDown() override { Retired().clear(); }
};

ClientOptions Attached(const DaemonProcess& daemon) {
  ClientOptions options;
  options.address = daemon.address();
  options.attach = AttachMode::kRequired;
  options.client_name = "takeover_test";
  return options;
}

// Connects to the take-over socket of `daemon` as a successor would.
UniqueFd ConnectHandover(const DaemonProcess& daemon) {
  absl::StatusOr<UniqueFd> fd = ConnectUnixSocket(attach::HandoverSocketPath(daemon.socket_path()));
  EXPECT_TRUE(fd.ok()) << fd.status();
  return fd.ok() ? *std::move(fd) : UniqueFd();
}

std::string Hello(uint32_t protocol, uint64_t pool = 256ull << 20) {
  v1::TakeOverHello hello;
  hello.set_protocol(protocol);
  hello.set_daemon_version("test");
  hello.set_pool_bytes(pool);
  hello.set_segment_bytes(kSegmentBytes);
  hello.set_pid(static_cast<uint32_t>(getpid()));
  return hello.SerializeAsString();
}

TEST_F(TakeOverTest, SessionsLeasesAndBytesSurviveRepeatedTakeOvers) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Options());
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->attached());
  const uint64_t session = (*client)->session_id();
  StoredBuffers stored;
  auto store = [&](uint64_t seed) { StoreRandom(**client, seed, &stored); };
  for (uint64_t seed = 1; seed <= 8; ++seed) store(seed);
  absl::StatusOr<v1::StatsReply> first_stats = (*client)->Stats();
  ASSERT_TRUE(first_stats.ok());
  const bool pinned = first_stats->pool().locked_bytes() == first_stats->pool().total_bytes();
  for (int round = 1; round <= 5; ++round) {
    SCOPED_TRACE(round);
    daemon = TakeOver(std::move(daemon));
    ASSERT_NE(daemon, nullptr);
    // Stored bytes are where they were: the same memfds, still mapped.
    ExpectFetched(**client, stored);
    // New stores lease from the successor (the Lease RPC and its fds).
    for (int i = 0; i < 24; ++i) store(100 * round + i);
    absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->daemon_pid(), static_cast<uint32_t>(daemon->pid()));
    EXPECT_EQ(stats->self().session_id(), session);
    EXPECT_TRUE(stats->self().attached());
    EXPECT_GT(stats->self().leases(), 0u);
    EXPECT_EQ(stats->sessions(), 1u);
    // A successor locks the pool after it started serving, as its predecessor had.
    const auto lock_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (pinned && stats->pool().locked_bytes() != stats->pool().total_bytes() &&
           std::chrono::steady_clock::now() < lock_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      stats = (*client)->Stats();
      ASSERT_TRUE(stats.ok());
    }
    if (pinned) {
      EXPECT_EQ(stats->pool().locked_bytes(), stats->pool().total_bytes());
    }
    // This round's tickets go back (their leases' space is reused); the
    // first eight stay through every hand-over.
    while (stored.size() > 8) {
      ASSERT_TRUE((*client)->Release(stored.back().first).ok());
      stored.pop_back();
    }
  }
  EXPECT_THAT(daemon->log(), HasSubstr("hand-over 5 of this state"));
  // Closing the session frees its leases in the last successor.
  ASSERT_TRUE((*client)->Close().ok());
  client->reset();
  std::unique_ptr<Client> other = ConnectOrDie(*daemon);
  absl::StatusOr<v1::StatsReply> stats = other->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions(), 1u);
  EXPECT_GT(other->session_id(), session);  // ids never repeat across hand-overs
}

TEST_F(TakeOverTest, CallsDuringATakeOverPauseAndSucceed) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Options());
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::atomic<int> calls{0};
  std::string first_error;
  std::thread caller([&] {
    while (!stop.load()) {
      absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
      calls.fetch_add(1);
      if (!stats.ok() && failures.fetch_add(1) == 0) first_error = stats.status().ToString();
    }
  });
  // Waits on the caller's progress, not for a time: on a loaded machine a call
  // can take longer than a take-over.
  auto wait_for_calls = [&](int at_least) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (calls.load() < at_least && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  for (int round = 0; round < 3; ++round) {
    wait_for_calls(calls.load() + 2);  // the caller is calling as the take-over starts
    daemon = TakeOver(std::move(daemon));
    ASSERT_NE(daemon, nullptr);
  }
  wait_for_calls(11);  // and goes on calling the last successor
  stop.store(true);
  caller.join();
  EXPECT_EQ(failures.load(), 0) << first_error;
  EXPECT_GT(calls.load(), 10);
  EXPECT_GE((*client)->daemon_pauses(), 1u);
}

// Kubernetes' way (deploy/k8s): take_over = auto starts afresh when nobody
// serves, and takes over when somebody does; after_take_over = wait leaves the
// old process holding nothing until it is stopped, so that the kubelet does
// not restart it.
TEST_F(TakeOverTest, AutoStartsAfreshOrTakesOverAndTheOldProcessWaitsHoldingNothing) {
  DaemonProcessOptions options = Options();
  options.extra_args = {"--take-over", "auto", "--after-take-over", "wait"};
  std::unique_ptr<DaemonProcess> first = StartDaemonOrDie(options);
  ASSERT_NE(first, nullptr);
  EXPECT_THAT(first->log(), HasSubstr("starting afresh"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*first));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::byte> bytes = RandomBytes(2 << 20, 9);
  absl::StatusOr<Ticket> ticket = (*client)->Store(bytes.data(), bytes.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();

  options.socket_path = first->socket_path();
  absl::StatusOr<std::unique_ptr<DaemonProcess>> second = DaemonProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!LogHas(*first, "handed over to a successor") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(LogHas(**second, "took over")) << (*second)->log();
  ASSERT_TRUE(LogHas(*first, "handed over to a successor")) << first->log();
  // The old process runs on, with nothing but its standard streams open.
  EXPECT_EQ(kill(first->pid(), 0), 0);
  int open_fds = 0;
  const std::string fd_dir = absl::StrCat("/proc/", first->pid(), "/fd");
  if (DIR* dir = opendir(fd_dir.c_str())) {
    while (dirent* entry = readdir(dir)) open_fds += entry->d_name[0] != '.';
    closedir(dir);
  }
  EXPECT_LE(open_fds, 3);
  std::vector<std::byte> back(bytes.size());
  ASSERT_TRUE((*client)->Fetch(*ticket, back.data(), back.size()).ok());
  EXPECT_TRUE(back == bytes);
  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->daemon_pid(), static_cast<uint32_t>((*second)->pid()));
  absl::StatusOr<int> code = first->Stop(SIGTERM);
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE((*client)->Stats().ok());   // stopping it touched nothing of the successor's
  Retired().push_back(std::move(first));  // its folder holds the sockets
}

TEST_F(TakeOverTest, AnotherProtocolIsRefusedAndTheDaemonServesOn) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Options());
  ASSERT_NE(daemon, nullptr);
  std::unique_ptr<Client> client = ConnectOrDie(*daemon);
  UniqueFd fd = ConnectHandover(*daemon);
  ASSERT_TRUE(attach::SendMessage(fd.get(), MessageType::kTakeOverHello, Hello(999)).ok());
  absl::StatusOr<attach::Message> answer =
      attach::ReceiveMessage(fd.get(), std::chrono::seconds(10));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->type, MessageType::kTakeOverRefused);
  EXPECT_THAT(answer->payload, HasSubstr("protocol 999"));
  EXPECT_TRUE(client->Stats().ok());
  // A successor configured with another pool is refused too; it says why and exits.
  DaemonProcessOptions options = Options(daemon->socket_path());
  options.pool_size = "128MiB";
  options.extra_args = {"--take-over"};
  options.ready_timeout = std::chrono::seconds(10);
  absl::StatusOr<std::unique_ptr<DaemonProcess>> successor = DaemonProcess::Start(options);
  if (successor.ok()) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*successor)->log().find("cannot start") == std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_THAT((*successor)->log(), HasSubstr("same pool_size"));
  } else {
    EXPECT_THAT(std::string(successor.status().message()), HasSubstr("same pool_size"));
  }
  absl::StatusOr<v1::StatsReply> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->daemon_pid(), static_cast<uint32_t>(daemon->pid()));
  EXPECT_THAT(daemon->log(), HasSubstr("take-over refused"));
}

TEST_F(TakeOverTest, ASecondSuccessorIsRefusedAndAnAbandonedTakeOverResumes) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Options());
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::byte> bytes = RandomBytes(3 << 20, 5);
  absl::StatusOr<Ticket> ticket = (*client)->Store(bytes.data(), bytes.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();

  UniqueFd first = ConnectHandover(*daemon);
  ASSERT_TRUE(attach::SendMessage(first.get(), MessageType::kTakeOverHello,
                                  Hello(server::kTakeOverProtocol))
                  .ok());
  std::vector<UniqueFd> fds;
  uint32_t total = 0;
  do {
    absl::StatusOr<attach::Message> m =
        attach::ReceiveMessage(first.get(), std::chrono::seconds(10));
    ASSERT_TRUE(m.ok()) << m.status() << daemon->log();
    ASSERT_EQ(m->type, MessageType::kTakeOverState) << m->payload;
    attach::TakeOverStatePayload payload;
    std::memcpy(&payload, m->payload.data(), sizeof(payload));
    total = payload.total;
    for (UniqueFd& fd : m->fds) fds.push_back(std::move(fd));
  } while (fds.size() < total);
  absl::StatusOr<v1::DaemonState> state = server::ReadStateImage(fds[0].get());
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_EQ(state->sessions_size(), 1);
  EXPECT_GE(state->sessions(0).attach_fd(), 0);
  EXPECT_GE(state->leases_size(), 1);
  EXPECT_EQ(state->segments(), 64u);

  UniqueFd second = ConnectHandover(*daemon);
  // The refusal may come before the hello is written (then the write fails).
  attach::SendMessage(second.get(), MessageType::kTakeOverHello, Hello(server::kTakeOverProtocol))
      .IgnoreError();
  absl::StatusOr<attach::Message> refused =
      attach::ReceiveMessage(second.get(), std::chrono::seconds(10));
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->type, MessageType::kTakeOverRefused);
  EXPECT_THAT(refused->payload, HasSubstr("in progress"));

  // The first successor leaves without confirming: the daemon serves again,
  // with the same session, its lease and its bytes.
  first.Reset();
  fds.clear();
  std::vector<std::byte> back(bytes.size());
  ASSERT_TRUE((*client)->Fetch(*ticket, back.data(), back.size()).ok());
  EXPECT_TRUE(back == bytes);
  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status() << daemon->log();
  EXPECT_TRUE(stats->self().attached());
  EXPECT_EQ(stats->daemon_pid(), static_cast<uint32_t>(daemon->pid()));
  std::vector<std::byte> more = RandomBytes(5 << 20, 6);
  EXPECT_TRUE((*client)->Store(more.data(), more.size()).ok());
  EXPECT_THAT(daemon->log(), HasSubstr("serving again"));
}

TEST_F(TakeOverTest, AForgedStateIsNotTrustedAndNothingIsServed) {
  // A fake serving daemon: answers the hello with a state image whose body
  // was changed after its checksum.
  char dir_template[] = "/tmp/actstash-takeover-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string socket_path = std::string(dir_template) + "/s.sock";
  const std::string handover_path = attach::HandoverSocketPath(socket_path);
  UniqueFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, handover_path.c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener.get(), 4), 0);
  std::thread fake([&] {
    UniqueFd connection(accept(listener.get(), nullptr, nullptr));
    absl::StatusOr<attach::Message> hello =
        attach::ReceiveMessage(connection.get(), std::chrono::seconds(10));
    if (!hello.ok()) return;
    v1::DaemonState state;
    state.set_segments(1);
    absl::StatusOr<UniqueFd> image = server::WriteStateImage(state);
    ASSERT_TRUE(image.ok());
    // A copy with one body byte changed (the image itself is sealed).
    UniqueFd forged(memfd_create("forged", MFD_CLOEXEC));
    char buffer[4096];
    const ssize_t n = pread(image->get(), buffer, sizeof(buffer), 0);
    ASSERT_GT(n, 32);
    buffer[n - 1] ^= 0x40;
    ASSERT_EQ(pwrite(forged.get(), buffer, n, 0), n);
    attach::TakeOverStatePayload payload{1, 0, 1, 0};
    const int numbers[] = {forged.get()};
    attach::SendMessage(connection.get(), MessageType::kTakeOverState, attach::PayloadOf(payload),
                        numbers)
        .IgnoreError();
    char byte;
    (void)!read(connection.get(), &byte, 1);  // until the successor hangs up
  });
  DaemonProcessOptions options = Options(socket_path);
  options.extra_args = {"--take-over"};
  options.ready_timeout = std::chrono::seconds(10);
  absl::StatusOr<std::unique_ptr<DaemonProcess>> successor = DaemonProcess::Start(options);
  fake.join();
  ASSERT_FALSE(successor.ok());
  EXPECT_THAT(std::string(successor.status().message()), HasSubstr("checksum"));
  EXPECT_FALSE(std::ifstream(socket_path).good());  // it never served
  unlink(handover_path.c_str());
  rmdir(dir_template);
}

TEST_F(TakeOverTest, OnlyTheDaemonsUserMayConnect) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to try as another uid";
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Options());
  ASSERT_NE(daemon, nullptr);
  const std::string path = attach::HandoverSocketPath(daemon->socket_path());
  const pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    absl::StatusOr<UniqueFd> fd = ConnectUnixSocket(path);
    _exit(fd.ok() ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "uid 65534 could connect to the take-over socket";
  std::unique_ptr<Client> client = ConnectOrDie(*daemon);
  EXPECT_TRUE(client->Stats().ok());
}

}  // namespace
}  // namespace actstash::testing
