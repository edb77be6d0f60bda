// The zero-copy data plane against a real actstashd: attach, leases,
// client-side placement, isolation between sessions, and cleanup after dead
// clients.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "actstash/v1/stash.grpc.pb.h"
#include "client/rpc/attach_connection.h"
#include "common/attach_wire.h"
#include "common/unique_fd.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;
namespace pb = ::actstash::v1;
constexpr uint64_t kSegment = 16 << 20;

struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;  // its stdout
};

// Starts the worker binary with `args`; its stdout comes back through a pipe.
Child SpawnWorker(const std::vector<std::string>& args) {
  int pipe_fds[2];
  EXPECT_EQ(pipe(pipe_fds), 0);
  std::vector<std::string> argv_strings = {
      testing::BuiltBinary("ACTSTASH_WORKER_BINARY", ACTSTASH_WORKER_RELPATH)};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  Child child;
  child.pid = fork();
  if (child.pid == 0) {
    dup2(pipe_fds[1], STDOUT_FILENO);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  child.out = fdopen(pipe_fds[0], "r");
  return child;
}

std::string ReadLine(FILE* in) {
  char line[1024];
  return fgets(line, sizeof(line), in) != nullptr ? std::string(line) : std::string();
}

int Wait(Child& child) {
  int status = 0;
  waitpid(child.pid, &status, 0);
  fclose(child.out);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class ZeroCopyTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> extra = {}, const std::string& pool = "768MiB",
                   const std::string& segment = "16MiB") {
    DaemonProcessOptions options;
    options.pool_size = pool;
    options.segment_size = segment;
    options.extra_args = std::move(extra);
    daemon_ = StartDaemonOrDie(options);
    ASSERT_NE(daemon_, nullptr);
  }
  std::unique_ptr<Client> Attached(uint64_t quota = 0, uint32_t batch = 2) {
    ClientOptions options;
    options.address = daemon_->address();
    options.quota_bytes = quota;
    options.attach = AttachMode::kRequired;
    options.lease_batch = batch;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }
  v1::StatsReply Stats() {
    auto observer = ConnectOrDie(*daemon_, 1, "observer");
    absl::StatusOr<v1::StatsReply> stats = observer->Stats(/*all_sessions=*/true);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : v1::StatsReply();
  }

  // Stats once `settled` holds (returned leases are renewed in the
  // background before their memory counts as free), or after 5 s.
  template <typename Predicate>
  v1::StatsReply SettledStats(Predicate settled) {
    v1::StatsReply stats;
    for (int i = 0; i < 500; ++i) {
      stats = Stats();
      if (settled(stats)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return stats;
  }

  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(ZeroCopyTest, StoreFetchOneByteTo256MiBBytesIdentical) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->attached()) << client->attach_status();
  for (size_t size : {size_t{0}, size_t{1}, size_t{100}, size_t{4096}, size_t{1} << 20, kSegment,
                      kSegment + 1, size_t{64} << 20, size_t{256} << 20}) {
    SCOPED_TRACE(size);
    const std::vector<std::byte> data = RandomBytes(size, size + 3);
    absl::StatusOr<Ticket> ticket = client->Store(data.data(), data.size());
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    EXPECT_EQ(ticket->nbytes, size);
    std::vector<std::byte> back(size + 1, std::byte{0x11});
    ASSERT_TRUE(client->Fetch(*ticket, back.data(), back.size()).ok());
    EXPECT_EQ(0, size == 0 ? 0 : std::memcmp(back.data(), data.data(), size));
    EXPECT_EQ(back[size], std::byte{0x11}) << "Fetch wrote past the buffer's bytes";
    EXPECT_EQ(client->Fetch(*ticket, back.data(), size == 0 ? 0 : size - 1).code(),
              size == 0 ? absl::StatusCode::kOk : absl::StatusCode::kOutOfRange);
    ASSERT_TRUE(client->Release(*ticket).ok());
    EXPECT_EQ(client->Fetch(*ticket, back.data(), back.size()).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(client->Release(*ticket).code(), absl::StatusCode::kNotFound);
  }
  // Dedicated leases went back on Release but the last (kept as a spare for
  // the next buffer of its size); of the shared segments, at most the batch.
  v1::StatsReply stats = SettledStats(
      [](const v1::StatsReply& s) { return s.pool().used_bytes() == s.pool().leased_bytes(); });
  EXPECT_LE(stats.pool().leased_bytes(), 2 * kSegment + (size_t{256} << 20));
  EXPECT_EQ(stats.pool().used_bytes(), stats.pool().leased_bytes());
}

TEST_F(ZeroCopyTest, ThousandsOfMixedBuffersAndStatsSeeThem) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::mt19937_64 rng(7);
  std::vector<std::pair<Ticket, std::vector<std::byte>>> live;
  for (int op = 0; op < 6000; ++op) {
    if (live.empty() || rng() % 5 < 3) {
      std::vector<std::byte> data = RandomBytes(rng() % 200000, rng());
      absl::StatusOr<Ticket> ticket = client->Store(data.data(), data.size());
      ASSERT_TRUE(ticket.ok()) << ticket.status();
      live.emplace_back(*ticket, std::move(data));
    } else {
      // Mostly LIFO, like activations in backward; sometimes any order.
      const size_t k = rng() % 4 == 0 ? rng() % live.size() : live.size() - 1;
      std::vector<std::byte> back(live[k].second.size());
      ASSERT_TRUE(client->Fetch(live[k].first, back.data(), back.size()).ok());
      ASSERT_TRUE(back == live[k].second) << "op " << op;
      ASSERT_TRUE(client->Release(live[k].first).ok());
      live.erase(live.begin() + static_cast<ptrdiff_t>(k));
    }
  }
  uint64_t live_bytes = 0;
  for (const auto& entry : live) live_bytes += entry.second.size();
  absl::StatusOr<v1::StatsReply> stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(stats->self().attached());
  EXPECT_EQ(stats->self().client().objects(), live.size());
  EXPECT_EQ(stats->self().client().bytes(), live_bytes);
  EXPECT_GE(stats->self().leased_bytes(), live_bytes);
  EXPECT_EQ(stats->self().peer_pid(), static_cast<uint32_t>(getpid()));
  EXPECT_EQ(stats->self().objects(), 0u) << "nothing went through the inline path";
}

TEST_F(ZeroCopyTest, FourClientProcessesAtOnce) {
  StartDaemon();
  std::vector<Child> children;
  for (int i = 0; i < 4; ++i) {
    children.push_back(SpawnWorker({"--address", daemon_->address(), "--iterations", "1500",
                                    "--seed", std::to_string(i + 1), "--max-bytes", "2000000"}));
  }
  for (Child& child : children) {
    const std::string line = ReadLine(child.out);
    EXPECT_THAT(line, HasSubstr("ok: 0 errors, attached=1"));
    EXPECT_EQ(Wait(child), 0);
  }
  v1::StatsReply stats =
      SettledStats([](const v1::StatsReply& s) { return s.pool().used_bytes() == 0; });
  EXPECT_EQ(stats.pool().used_bytes(), 0u) << "the workers' sessions were closed";
  EXPECT_EQ(stats.sessions(), 1u);
}

TEST_F(ZeroCopyTest, LeaseQuotaAndPoolExhaustionAreResourceExhausted) {
  StartDaemon({}, "128MiB");
  auto small = Attached(/*quota=*/3 * kSegment, /*batch=*/2);
  ASSERT_NE(small, nullptr);
  const std::vector<std::byte> chunk = RandomBytes(kSegment / 2 + 1, 1);
  std::vector<Ticket> held;
  absl::Status status;
  while (status.ok() && held.size() < 100) {
    absl::StatusOr<Ticket> ticket = small->Store(chunk.data(), chunk.size());
    status = ticket.status();
    if (ticket.ok()) held.push_back(*ticket);
  }
  EXPECT_EQ(held.size(), 3u) << "one half-segment buffer per segment, three segments of quota";
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("requested 16777216 bytes"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("available 0 bytes"));
  for (const Ticket& t : held) {
    std::vector<std::byte> back(chunk.size());
    ASSERT_TRUE(small->Fetch(t, back.data(), back.size()).ok());
    EXPECT_TRUE(back == chunk);
  }
  // The pool (8 segments) runs out for a second client before its quota does.
  auto big = Attached(0, 1);
  ASSERT_NE(big, nullptr);
  const std::vector<std::byte> huge = RandomBytes(6 * kSegment, 2);
  absl::StatusOr<Ticket> refused = big->Store(huge.data(), huge.size());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("host pool exhausted"));
  ASSERT_TRUE(small->Release(held[0]).ok());
  ASSERT_TRUE(small->Close().ok());
  absl::StatusOr<Ticket> fits = big->Store(huge.data(), huge.size());
  EXPECT_TRUE(fits.ok()) << fits.status();
}

// Raw access for isolation checks: a session with its attach channel.
struct RawSession {
  std::unique_ptr<pb::Stash::Stub> stub;
  std::string token;
  std::unique_ptr<client_internal::AttachConnection> attach;

  grpc::Status Lease(uint32_t count, pb::LeaseReply* reply) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-actstash-token", token);
    pb::LeaseRequest request;
    request.set_count(count);
    return stub->Lease(&ctx, request, reply);
  }
  grpc::Status Return(uint64_t id) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-actstash-token", token);
    pb::ReturnRequest request;
    request.add_lease_ids(id);
    pb::ReturnReply reply;
    return stub->Return(&ctx, request, &reply);
  }
};

RawSession OpenRaw(const DaemonProcess& daemon, bool attach) {
  RawStub opened = OpenRawSession(daemon);
  RawSession raw;
  raw.stub = std::move(opened.stub);
  raw.token = opened.token;
  if (attach) {
    auto channel = client_internal::AttachConnection::Connect(
        attach::AttachSocketPath(daemon.socket_path()), raw.token, std::chrono::seconds(5));
    EXPECT_TRUE(channel.ok()) << channel.status();
    if (channel.ok()) raw.attach = *std::move(channel);
  }
  return raw;
}

TEST_F(ZeroCopyTest, SegmentsAreIsolatedBetweenSessions) {
  StartDaemon({}, "16MiB");  // one segment: B must get what A had
  RawSession a = OpenRaw(*daemon_, true);
  RawSession b = OpenRaw(*daemon_, true);
  ASSERT_NE(a.attach, nullptr);
  ASSERT_NE(b.attach, nullptr);

  std::vector<uint64_t> stale;
  pb::LeaseReply lease_a;
  ASSERT_TRUE(a.Lease(1, &lease_a).ok());
  absl::StatusOr<std::vector<UniqueFd>> fds_a =
      a.attach->ReceiveLease(lease_a.leases(0).lease_id(), 1, std::chrono::seconds(5), &stale);
  ASSERT_TRUE(fds_a.ok()) << fds_a.status();
  auto* mem_a = static_cast<char*>(
      mmap(nullptr, kSegment, PROT_READ | PROT_WRITE, MAP_SHARED, (*fds_a)[0].get(), 0));
  ASSERT_NE(mem_a, MAP_FAILED);
  std::memset(mem_a, 'A', kSegment);

  // B cannot take or return A's lease, nor attach as A.
  pb::LeaseReply lease_b;
  grpc::Status refused = b.Lease(1, &lease_b);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(b.Return(lease_a.leases(0).lease_id()).error_code(), grpc::StatusCode::NOT_FOUND);
  auto as_a = client_internal::AttachConnection::Connect(
      attach::AttachSocketPath(daemon_->socket_path()), a.token, std::chrono::seconds(5));
  EXPECT_EQ(as_a.status().code(), absl::StatusCode::kFailedPrecondition) << as_a.status();

  // A returns the lease but (misbehaving) keeps its fd and mapping.
  ASSERT_TRUE(a.Return(lease_a.leases(0).lease_id()).ok());
  ASSERT_TRUE(b.Lease(1, &lease_b).ok());
  absl::StatusOr<std::vector<UniqueFd>> fds_b =
      b.attach->ReceiveLease(lease_b.leases(0).lease_id(), 1, std::chrono::seconds(5), &stale);
  ASSERT_TRUE(fds_b.ok()) << fds_b.status();
  struct stat st_a {
  }, st_b{};
  ASSERT_EQ(fstat((*fds_a)[0].get(), &st_a), 0);
  ASSERT_EQ(fstat((*fds_b)[0].get(), &st_b), 0);
  EXPECT_NE(st_a.st_ino, st_b.st_ino) << "B got the memfd A still holds";
  auto* mem_b = static_cast<char*>(
      mmap(nullptr, kSegment, PROT_READ | PROT_WRITE, MAP_SHARED, (*fds_b)[0].get(), 0));
  ASSERT_NE(mem_b, MAP_FAILED);
  size_t nonzero = 0;
  for (size_t i = 0; i < kSegment; i += 4096) nonzero += mem_b[i] != 0;
  EXPECT_EQ(nonzero, 0u) << "B sees A's data";
  std::memset(mem_b, 'B', kSegment);
  EXPECT_EQ(mem_a[12345], 0) << "A's stale mapping must be emptied, and never see B's data";
  EXPECT_TRUE(stale.empty());
  munmap(mem_a, kSegment);
  munmap(mem_b, kSegment);
}

// A returned lease's memory must not serve other sessions' inline objects
// while the old tenant can still reach it.
TEST_F(ZeroCopyTest, ReturnedLeaseMemoryIsUnreachableForInlineObjects) {
  StartDaemon({}, "16MiB");
  RawSession a = OpenRaw(*daemon_, true);
  ASSERT_NE(a.attach, nullptr);
  std::vector<uint64_t> stale;
  pb::LeaseReply lease;
  ASSERT_TRUE(a.Lease(1, &lease).ok());
  absl::StatusOr<std::vector<UniqueFd>> fds =
      a.attach->ReceiveLease(lease.leases(0).lease_id(), 1, std::chrono::seconds(5), &stale);
  ASSERT_TRUE(fds.ok());
  auto* mem = static_cast<char*>(
      mmap(nullptr, kSegment, PROT_READ | PROT_WRITE, MAP_SHARED, (*fds)[0].get(), 0));
  ASSERT_NE(mem, MAP_FAILED);
  ASSERT_TRUE(a.Return(lease.leases(0).lease_id()).ok());

  auto b = ConnectOrDie(*daemon_, 0, "inline");
  const std::vector<std::byte> secret = RandomBytes(1 << 20, 11);
  absl::StatusOr<Handle> handle;
  for (int i = 0; i < 200; ++i) {  // the renewal runs in the background
    handle = b->Put(secret.data(), secret.size());
    if (handle.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(handle.ok()) << handle.status();
  size_t seen = 0;
  for (size_t i = 0; i < kSegment; ++i) seen += mem[i] != 0;
  EXPECT_EQ(seen, 0u) << "the old tenant sees the inline object's bytes";
  std::memset(mem, 'X', kSegment);
  absl::StatusOr<Object> back = b->Get(*handle);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->data == secret) << "the old tenant changed another session's object";
  munmap(mem, kSegment);
}

// Memory of a closed session is renewed in the background; a Put or a Lease
// that needs it meanwhile waits for it instead of failing.
TEST_F(ZeroCopyTest, CallsWaitForMemoryThatIsBeingRenewed) {
  // Big segments: renewing four takes the daemon tens of milliseconds.
  StartDaemon({}, "256MiB", "64MiB");
  const std::vector<std::byte> chunk = RandomBytes(33 << 20, 12);
  const std::vector<std::byte> big = RandomBytes(160 << 20, 13);
  for (int round = 0; round < 3; ++round) {
    {
      auto holder = Attached(0, /*batch=*/4);
      ASSERT_NE(holder, nullptr);
      for (int i = 0; i < 4; ++i) ASSERT_TRUE(holder->Store(chunk.data(), chunk.size()).ok());
    }  // closed: all four segments go to renewal at once
    auto inline_client = ConnectOrDie(*daemon_, 0, "inline");
    absl::StatusOr<Handle> handle = inline_client->Put(big.data(), big.size());
    ASSERT_TRUE(handle.ok()) << "round " << round << ": " << handle.status();
    ASSERT_TRUE(inline_client->Delete(*handle).ok());
    inline_client.reset();
    auto leaser = Attached(0, 1);
    ASSERT_NE(leaser, nullptr);
    absl::StatusOr<Ticket> ticket = leaser->Store(big.data(), big.size());  // 3 segments
    leaser.reset();  // and these three go to renewal for the next round
    ASSERT_TRUE(ticket.ok()) << "round " << round << ": " << ticket.status();
  }
}

TEST_F(ZeroCopyTest, ShutdownIsPromptWithAClientThatStoppedReading) {
  StartDaemon({"--shutdown-grace-seconds", "1"});
  RawSession a = OpenRaw(*daemon_, true);  // never reads its attach socket
  ASSERT_NE(a.attach, nullptr);
  pb::LeaseReply reply;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(a.Lease(8, &reply).ok());
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<int> code = daemon_->Stop(SIGTERM);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// Opens a connection to the attach socket (nothing sent yet); empty on
// failure.
UniqueFd SilentConnection(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return UniqueFd();
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return UniqueFd();
  return fd;
}

TEST_F(ZeroCopyTest, LeaseWithoutAttachAndBadHellosAreRefused) {
  StartDaemon();
  RawSession detached = OpenRaw(*daemon_, false);
  pb::LeaseReply reply;
  grpc::Status status = detached.Lease(1, &reply);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("attach"));
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-actstash-token", detached.token);
    pb::LeaseRequest request;
    request.set_count(5000);
    EXPECT_EQ(detached.stub->Lease(&ctx, request, &reply).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto wrong = client_internal::AttachConnection::Connect(
      attach::AttachSocketPath(daemon_->socket_path()), "not-a-token", std::chrono::seconds(5));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();
  // Garbage on the attach socket: the daemon drops the connection and goes on.
  const std::string path = attach::AttachSocketPath(daemon_->socket_path());
  UniqueFd fd = SilentConnection(path);
  ASSERT_TRUE(fd.valid()) << std::strerror(errno);
  const char garbage[64] = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_EQ(write(fd.get(), garbage, sizeof(garbage)), static_cast<ssize_t>(sizeof(garbage)));
  char buffer[256];
  ssize_t n = 0;
  while ((n = read(fd.get(), buffer, sizeof(buffer))) > 0) {
  }
  // Closed with our bytes unread, the socket may report a reset instead of EOF.
  EXPECT_TRUE(n == 0 || errno == ECONNRESET) << "the daemon closes a connection that does not "
                                                "say hello: read returned "
                                             << n << " (" << std::strerror(errno) << ")";
  fd.Reset();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->attached());
}

TEST_F(ZeroCopyTest, KilledClientHolding500MiBIsReclaimedWithinOneSecond) {
  StartDaemon();
  Child child = SpawnWorker({"--address", daemon_->address(), "--hold-bytes", "524288000"});
  ASSERT_THAT(ReadLine(child.out), HasSubstr("holding"));
  auto observer = ConnectOrDie(*daemon_, 1, "observer");
  absl::StatusOr<v1::StatsReply> before = observer->Stats(true);
  ASSERT_TRUE(before.ok());
  EXPECT_GE(before->pool().leased_bytes(), 500u << 20);
  bool listed = false;
  for (const v1::SessionStats& s : before->all_sessions()) {
    if (s.peer_pid() == static_cast<uint32_t>(child.pid))
      listed = s.attached() && s.leased_bytes() >= (500u << 20);
  }
  EXPECT_TRUE(listed) << "the worker's session shows its pid and leases";

  kill(child.pid, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  Wait(child);
  uint64_t used = 1;
#if defined(__SANITIZE_THREAD__)
  // Under ThreadSanitizer the daemon runs several times slower (its memset of
  // the 500 MiB is checked too): the order is tested there, not the time.
  const auto deadline = std::chrono::seconds(5);
#else
  const auto deadline = std::chrono::seconds(1);
#endif
  while (std::chrono::steady_clock::now() - killed < deadline) {
    absl::StatusOr<v1::StatsReply> stats = observer->Stats();
    ASSERT_TRUE(stats.ok());
    used = stats->pool().used_bytes();
    if (used == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(used, 0u) << "not reclaimed within " << deadline.count() << " s of SIGKILL";
  // Then renewed in the background and free again.
  v1::StatsReply settled =
      SettledStats([](const v1::StatsReply& s) { return s.pool().renewing_bytes() == 0; });
  EXPECT_EQ(settled.pool().free_bytes(), settled.pool().total_bytes());
  absl::StatusOr<v1::StatsReply> after = observer->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->sessions(), 1u);
  EXPECT_EQ(after->sessions_reclaimed(), 1u);
  EXPECT_THAT(daemon_->log(), HasSubstr("attach connection closed"));
}

TEST_F(ZeroCopyTest, DaemonRestartUnderAnAttachedClient) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  const std::vector<std::byte> data = RandomBytes(1 << 20, 5);
  absl::StatusOr<Ticket> kept = client->Store(data.data(), data.size());
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(daemon_->Stop(SIGKILL).ok());
  ASSERT_TRUE(daemon_->Restart().ok());

  absl::Status status;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  do {
    status = client->Store(data.data(), data.size()).status();
  } while (status.ok() && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("actstashd at " + daemon_->address() + " went away"));
  std::vector<std::byte> back(data.size());
  EXPECT_TRUE(client->Fetch(*kept, back.data(), back.size()).ok());
  EXPECT_TRUE(back == data) << "stored buffers stay readable after the daemon went away";

  auto fresh = Attached();
  ASSERT_NE(fresh, nullptr);
  absl::StatusOr<Ticket> ticket = fresh->Store(data.data(), data.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_TRUE(fresh->Fetch(*ticket, back.data(), back.size()).ok());
}

TEST_F(ZeroCopyTest, UnattachedClientsFallBackAndIdleSessionsExpire) {
  StartDaemon({"--session-idle-ttl-seconds", "1"});
  ClientOptions options;
  options.address = daemon_->address();
  options.attach = AttachMode::kOff;
  auto inline_client = Client::Connect(options);
  ASSERT_TRUE(inline_client.ok());
  EXPECT_FALSE((*inline_client)->attached());
  const std::vector<std::byte> data = RandomBytes(3 << 20, 6);
  absl::StatusOr<Ticket> ticket = (*inline_client)->Store(data.data(), data.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE((*inline_client)->Fetch(*ticket, back.data(), back.size()).ok());
  EXPECT_TRUE(back == data);
  auto attached = Attached();  // never calls again, but is attached: it stays
  ASSERT_NE(attached, nullptr);
  const uint64_t attached_id = attached->session_id();

  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  v1::StatsReply stats = Stats();
  EXPECT_EQ(stats.objects(), 0u) << "the idle inline session's objects were freed";
  bool attached_alive = false;
  for (const v1::SessionStats& s : stats.all_sessions()) {
    EXPECT_NE(s.session_id(), (*inline_client)->session_id());
    attached_alive |= s.session_id() == attached_id;
  }
  EXPECT_TRUE(attached_alive);
  EXPECT_EQ((*inline_client)->Fetch(*ticket, back.data(), back.size()).code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(daemon_->log(), HasSubstr("without an attach connection: closed"));
}

TEST_F(ZeroCopyTest, AttachIsLimitedToAllowedUids) {
  StartDaemon({"--allow-uid", "4242", "--socket-mode", "0666"});
  const std::string dir = daemon_->socket_path().substr(0, daemon_->socket_path().rfind('/'));
  ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  Child nobody = SpawnWorker({"--address", daemon_->address(), "--setuid", "65534"});
  const std::string line = ReadLine(nobody.out);
  EXPECT_THAT(line, HasSubstr("attach refused"));
  EXPECT_THAT(line, HasSubstr("uid 65534"));
  EXPECT_EQ(Wait(nobody), 3);
  auto self = Attached();  // the daemon's own uid is always allowed
  ASSERT_NE(self, nullptr);
  EXPECT_TRUE(self->attached());
}

// Any local user who can open the attach socket can open connections and stay
// silent. Hundreds of them must neither lock legitimate clients out nor cost an
// attached client its connection (and with it its session).
TEST_F(ZeroCopyTest, SilentConnectionFloodLocksNoClientOutAndDropsNoAttachedOne) {
  StartDaemon();
  auto before = Attached();
  ASSERT_NE(before, nullptr);
  const std::vector<std::byte> data = RandomBytes(1 << 20, 11);
  absl::StatusOr<Ticket> ticket = before->Store(data.data(), data.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();

  const std::string path = attach::AttachSocketPath(daemon_->socket_path());
  std::vector<UniqueFd> silent;
  for (int i = 0; i < 400; ++i) {
    UniqueFd fd = SilentConnection(path);
    ASSERT_TRUE(fd.valid()) << "connection " << i << ": " << std::strerror(errno);
    silent.push_back(std::move(fd));
  }
  // Clients that attach while the flood holds its connections open (and goes on
  // opening more between them) get in, at once.
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    auto client = Attached();
    ASSERT_NE(client, nullptr) << "round " << round;
    EXPECT_TRUE(client->attached());
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
    for (int i = 0; i < 100; ++i) {
      UniqueFd fd = SilentConnection(path);
      if (fd.valid()) silent.push_back(std::move(fd));
    }
  }
  // The client that attached before the flood still has its session and data.
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(before->Fetch(*ticket, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_TRUE(before->attached());
  EXPECT_TRUE(before->Stats().ok());
}

}  // namespace
}  // namespace actstash::testing
