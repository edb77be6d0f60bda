// actstashd restarted after a crash by a service manager that keeps its fds
// (testing/fd_store.h speaks systemd's protocols): a client's stored bytes,
// session and leases survive SIGKILLs, the client attaches again and goes
// on leasing; a state table damaged while the daemon was down is not
// trusted and the client is told its state was lost; a clean stop retires
// the table; a recovered session that never attaches again is closed after
// the grace period; inline objects, resident or spilled, survive crashes and
// a take-over after them, and one whose memory the service manager did not
// keep is said lost (DATA_LOSS) by the restarted daemon and by a successor
// that took over from it; an unattached session that calls again within the
// grace is kept; a lease whose segments were scrubbed at its grant comes
// back with the memory its client maps; a Put sent again after a crash or
// a take-over (its put id the same) stores nothing and answers the handle
// of the object it stored before; a grant recorded before a crash whose
// answer never reached the client is taken back once the client names the
// leases it holds (ConfirmLeases), and no longer counts against its quota.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "client/rpc/attach_connection.h"
#include "client/rpc/host_leases.h"
#include "client/rpc/session_rpc.h"
#include "common/attach_wire.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "tests/integration/takeover_util.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;

DaemonProcessOptions Supervised(std::vector<std::string> extra = {}) {
  DaemonProcessOptions options;
  options.pool_size = "128MiB";
  options.segment_size = "4MiB";
  options.supervised = true;
  options.extra_args = std::move(extra);
  return options;
}

ClientOptions Attached(const DaemonProcess& daemon) {
  ClientOptions options;
  options.address = daemon.address();
  options.attach = AttachMode::kRequired;
  options.client_name = "crash_recovery_test";
  options.lease_retain = std::chrono::milliseconds(0);
  options.reattach_timeout = std::chrono::seconds(20);
  return options;
}

// SIGKILL and a restart with the kept fds, as a service manager does.
void Crash(DaemonProcess& daemon) {
  const int ready = daemon.fd_store()->ready_count();
  ASSERT_TRUE(daemon.Stop(SIGKILL).ok());
  ASSERT_TRUE(daemon.Restart().ok()) << daemon.log();
  ASSERT_TRUE(daemon.fd_store()->WaitReady(ready, std::chrono::seconds(30))) << daemon.log();
}

TEST(CrashRecoveryTest, StoredBytesSessionAndLeasesSurviveKills) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Supervised());
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->attached());
  const uint64_t session = (*client)->session_id();
  StoredBuffers stored;
  auto store = [&](uint64_t seed) {
    StoreRandom(**client, seed, &stored);
    ASSERT_FALSE(::testing::Test::HasFatalFailure()) << daemon->log();
  };
  for (uint64_t seed = 1; seed <= 6; ++seed) store(seed);
  for (int round = 1; round <= 3; ++round) {
    SCOPED_TRACE(round);
    Crash(*daemon);
    // New stores lease from the restarted daemon once the client attached
    // again: the calls in the gap wait.
    for (int i = 0; i < 12; ++i) store(100 * round + i);
    ExpectFetched(**client, stored);
    // Some go back (Return after a restart) and are leased again.
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE((*client)->Release(stored.back().first).ok());
      stored.pop_back();
    }
    EXPECT_EQ((*client)->daemon_reattaches(), static_cast<uint64_t>(round));
  }
  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ((*client)->session_id(), session);
  EXPECT_GT(stats->pool().used_bytes(), 0u);
  EXPECT_TRUE(LogHas(*daemon, "restart 3 of this state")) << daemon->log();
  ASSERT_TRUE((*client)->Close().ok());
  // Clean stop: the table is retired, the next start is a fresh one.
  ASSERT_TRUE(daemon->Stop(SIGTERM).ok());
  ASSERT_TRUE(daemon->Restart().ok());
  EXPECT_THAT(daemon->log(), HasSubstr("shut down cleanly"));
}

TEST(CrashRecoveryTest, ADamagedTableIsNotTrustedAndTheClientIsTold) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Supervised());
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::byte> bytes = RandomBytes(1 << 20, 7);
  ASSERT_TRUE((*client)->Store(bytes.data(), bytes.size()).ok());
  const int ready = daemon->fd_store()->ready_count();
  ASSERT_TRUE(daemon->Stop(SIGKILL).ok());
  ASSERT_TRUE(daemon->fd_store()->Corrupt("state", 8, std::string(1, '\x7f')).ok());
  ASSERT_TRUE(daemon->Restart().ok());
  ASSERT_TRUE(daemon->fd_store()->WaitReady(ready, std::chrono::seconds(30)));
  EXPECT_TRUE(LogHas(*daemon, "fails its checksum")) << daemon->log();
  absl::Status status;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  do {
    status = (*client)->Store(bytes.data(), bytes.size()).status();
  } while (status.ok() && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("restarted without this session's state"));
  // The restarted daemon serves new sessions.
  absl::StatusOr<std::unique_ptr<Client>> fresh = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE((*fresh)->Store(bytes.data(), bytes.size()).ok());
}

TEST(CrashRecoveryTest, ASessionThatDoesNotComeBackIsClosedAfterTheGrace) {
  std::unique_ptr<DaemonProcess> daemon =
      StartDaemonOrDie(Supervised({"--reattach-grace-seconds", "1"}));
  ASSERT_NE(daemon, nullptr);
  ClientOptions options = Attached(*daemon);
  options.reattach_timeout = std::chrono::milliseconds(0);  // gives up at once
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::byte> bytes = RandomBytes(1 << 20, 9);
  absl::StatusOr<Ticket> ticket = (*client)->Store(bytes.data(), bytes.size());
  ASSERT_TRUE(ticket.ok());
  Crash(*daemon);
  absl::StatusOr<std::unique_ptr<Client>> check = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(check.ok()) << check.status();
  uint64_t used = 1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (used > 0 && std::chrono::steady_clock::now() < deadline) {
    absl::StatusOr<v1::StatsReply> stats = (*check)->Stats();
    ASSERT_TRUE(stats.ok());
    used = stats->pool().used_bytes();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(used, 0u) << daemon->log();
  EXPECT_TRUE(LogHas(*daemon, "did not attach again within 1 s")) << daemon->log();
  // Its leased memory may be freed: reading it is refused, not garbage.
  std::vector<std::byte> back(bytes.size());
  absl::Status read = (*client)->Fetch(*ticket, back.data(), back.size());
  EXPECT_EQ(read.code(), absl::StatusCode::kUnavailable) << read;
  EXPECT_THAT(std::string(read.message()), HasSubstr("went away"));
}

TEST(CrashRecoveryTest, AnInlineSessionThatCallsWithinTheGraceIsKept) {
  // An unattached client (inline stores: over TCP, or with attaching off)
  // never attaches again; its calls after the restart bring it back. An
  // attached one that gave up is closed as before (the test above).
  std::unique_ptr<DaemonProcess> daemon =
      StartDaemonOrDie(Supervised({"--reattach-grace-seconds", "3"}));
  ASSERT_NE(daemon, nullptr);
  ClientOptions options = Attached(*daemon);
  options.attach = AttachMode::kOff;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const uint64_t session = (*client)->session_id();
  const std::vector<std::byte> bytes = RandomBytes(256 << 10, 10);
  ASSERT_TRUE((*client)->Store(bytes.data(), bytes.size()).ok());
  Crash(*daemon);
  absl::StatusOr<Ticket> after = (*client)->Store(bytes.data(), bytes.size());
  ASSERT_TRUE(after.ok()) << after.status() << daemon->log();
  // The grace counts from before the restarted daemon serves (3 s leave a
  // slow, instrumented start time to serve the call), then a reaper pass.
  std::this_thread::sleep_for(std::chrono::milliseconds(4000));
  std::vector<std::byte> back(bytes.size());
  ASSERT_TRUE((*client)->Fetch(*after, back.data(), back.size()).ok()) << daemon->log();
  EXPECT_EQ(back, bytes);
  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->self().session_id(), session);
  EXPECT_FALSE(LogHas(*daemon, "did not attach again")) << daemon->log();
}

// The spill files' names in the service manager's store.
size_t KeptSpillFiles(DaemonProcess& daemon) {
  size_t n = 0;
  for (const auto& [name, fd] : daemon.fd_store()->Snapshot()) n += name.rfind("spill-", 0) == 0;
  return n;
}

// The same, once it is `expected` (or after 10 s): a read-back is answered
// before its file leaves the store (FDSTOREREMOVE), and the store reads the
// daemon's messages on its own thread.
size_t KeptSpillFilesOnceSettled(DaemonProcess& daemon, size_t expected) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  size_t n = KeptSpillFiles(daemon);
  while (n != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    n = KeptSpillFiles(daemon);
  }
  return n;
}

TEST(CrashRecoveryTest, SpilledLeasesSurviveKills) {
  const std::string spill_dir = MakeTempDir();
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Supervised({"--spill-dir", spill_dir}));
  ASSERT_NE(daemon, nullptr);
  ClientOptions options = Attached(*daemon);
  options.quota_bytes = 16 << 20;  // 4 segments: most of what is stored spills
  options.lease_batch = 1;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  StoredBuffers stored;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    StoreRandom(**client, seed, &stored);
    ASSERT_FALSE(::testing::Test::HasFatalFailure()) << daemon->log();
  }
  const uint64_t spilled = (*client)->zero_copy_usage().spilled_leases();
  ASSERT_GT(spilled, 4u);
  EXPECT_EQ(KeptSpillFilesOnceSettled(*daemon, spilled), spilled);
  for (int round = 1; round <= 2; ++round) {
    SCOPED_TRACE(round);
    Crash(*daemon);
    EXPECT_TRUE(LogHas(*daemon, absl::StrCat("free segments reused, ", spilled, " spill files")))
        << daemon->log();
    EXPECT_EQ(SpillFds(daemon->pid(), spill_dir).size(), spilled) << "the files are open again";
  }
  // Everything comes back, the spilled buffers read back from the files the
  // restarted daemon adopted (their checksums verified).
  ExpectFetched(**client, stored);
  const v1::ClientUsage usage = (*client)->zero_copy_usage();
  EXPECT_GT(usage.restores(), 0u);
  EXPECT_EQ((*client)->daemon_reattaches(), 2u);
  // Read back, the files leave the store; what the client holds spilled now
  // is what the store keeps.
  EXPECT_EQ(KeptSpillFilesOnceSettled(*daemon, usage.spilled_leases()), usage.spilled_leases());
  for (const auto& [ticket, bytes] : stored) ASSERT_TRUE((*client)->Release(ticket).ok());
  ASSERT_TRUE((*client)->Close().ok());
  EXPECT_EQ(KeptSpillFilesOnceSettled(*daemon, 0), 0u);
  EXPECT_TRUE(SpillFds(daemon->pid(), spill_dir).empty());
  ASSERT_TRUE(daemon->Stop(SIGTERM).ok());
  std::filesystem::remove_all(spill_dir);
}

ClientOptions Inline(const DaemonProcess& daemon) {
  ClientOptions options = Attached(daemon);
  options.attach = AttachMode::kOff;  // stores are inline objects (Put)
  return options;
}

v1::SessionStats SelfStats(Client& client) {
  absl::StatusOr<v1::StatsReply> stats = client.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->self() : v1::SessionStats();
}

TEST(CrashRecoveryTest, InlineObjectsResidentAndSpilledSurviveKillsAndATakeOver) {
  const std::string spill_dir = MakeTempDir();
  DaemonProcessOptions options = Supervised({"--spill-dir", spill_dir});
  options.pool_size = kPool;  // as the successor TakeOver starts
  options.segment_size = kSegment;
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  ClientOptions client_options = Inline(*daemon);
  client_options.quota_bytes = 6 << 20;  // older objects spill to make room
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_FALSE((*client)->attached());
  StoredBuffers stored;
  for (uint64_t seed = 1; seed <= 15; ++seed) {
    StoreRandom(**client, seed, &stored);
    ASSERT_FALSE(::testing::Test::HasFatalFailure()) << daemon->log();
  }
  // An empty object has no memory, and comes back wherever the pool's
  // first segment is.
  absl::StatusOr<Ticket> empty = (*client)->Store(nullptr, 0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  stored.emplace_back(*empty, std::vector<std::byte>());
  // The spilled objects' files are kept for a restart, as leases' are.
  const size_t spilled = KeptSpillFiles(*daemon);
  ASSERT_GT(spilled, 4u) << daemon->log();
  ASSERT_GT(SelfStats(**client).spill().on_disk_bytes(), 0u);
  Crash(*daemon);
  EXPECT_TRUE(LogHas(*daemon, absl::StrCat(spilled, " spill files, 16 inline objects")))
      << daemon->log();
  EXPECT_EQ(SelfStats(**client).objects(), 16u);
  ExpectFetched(**client, stored);
  // The spilled ones were read back from the files the restarted daemon
  // adopted.
  EXPECT_GT(SelfStats(**client).spill().restores(), 0u);
  // Deleted objects stay deleted across a crash; the others come back again.
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE((*client)->Release(stored.front().first).ok());
    stored.erase(stored.begin());
  }
  Crash(*daemon);
  EXPECT_TRUE(LogHas(*daemon, "12 inline objects")) << daemon->log();
  ExpectFetched(**client, stored);
  EXPECT_EQ((*client)->daemon_reattaches(), 0u) << "an inline client never attached";
  daemon = TakeOver(std::move(daemon), {"--spill-dir", spill_dir});
  ASSERT_NE(daemon, nullptr);
  ExpectFetched(**client, stored);
  StoreRandom(**client, 99, &stored);
  ExpectFetched(**client, stored);
  ASSERT_TRUE((*client)->Close().ok());
  EXPECT_TRUE(SpillFds(daemon->pid(), spill_dir).empty());
  client->reset();
  daemon.reset();
  Retired().clear();  // the first daemon's folder holds the sockets
  std::filesystem::remove_all(spill_dir);
}

// Whether some kept memfd named seg-<i> holds `bytes` at some offset
// (a multiple of 256, as the client places buffers).
bool KeptSegmentsHold(DaemonProcess& daemon, const std::vector<std::byte>& bytes) {
  for (const auto& [name, fd] : daemon.fd_store()->Snapshot()) {
    if (name.rfind("seg-", 0) != 0) continue;
    std::vector<std::byte> segment(4 << 20);
    if (pread(fd.get(), segment.data(), segment.size(), 0) !=
        static_cast<ssize_t>(segment.size())) {
      continue;
    }
    const size_t probe = std::min<size_t>(bytes.size(), 4096);
    for (size_t at = 0; at + probe <= segment.size(); at += 256) {
      if (std::memcmp(segment.data() + at, bytes.data(), probe) == 0) return true;
    }
  }
  return false;
}

TEST(CrashRecoveryTest, ALeaseScrubbedAtItsGrantIsRecoveredWithTheMemoryItsClientMaps) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Supervised());
  ASSERT_NE(daemon, nullptr);
  // Inline objects over most of the pool, then deleted: their segments
  // are scrubbed (given fresh memfds) when they are next leased.
  {
    ClientOptions options = Attached(*daemon);
    options.attach = AttachMode::kOff;
    absl::StatusOr<std::unique_ptr<Client>> filler = Client::Connect(options);
    ASSERT_TRUE(filler.ok()) << filler.status();
    StoredBuffers objects;
    for (uint64_t seed = 1; seed <= 100; ++seed) StoreRandom(**filler, seed, &objects);
    ASSERT_FALSE(::testing::Test::HasFatalFailure()) << daemon->log();
    ASSERT_TRUE((*filler)->Close().ok());
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Attached(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->attached());
  StoredBuffers stored;
  for (uint64_t seed = 200; seed < 206; ++seed) StoreRandom(**client, seed, &stored);
  ASSERT_FALSE(::testing::Test::HasFatalFailure()) << daemon->log();
  Crash(*daemon);
  // The restarted daemon maps what the service manager kept: for every
  // lease, the memfd its client wrote into, not the one its scrub replaced.
  for (const auto& [ticket, bytes] : stored) EXPECT_TRUE(KeptSegmentsHold(*daemon, bytes));
  ExpectFetched(**client, stored);
  EXPECT_EQ((*client)->daemon_reattaches(), 1u);
}

TEST(CrashRecoveryTest, InlineObjectsLostInACrashAreSaidLostAfterATakeOverToo) {
  DaemonProcessOptions options = Supervised();
  options.pool_size = kPool;
  options.segment_size = kSegment;
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Inline(*daemon));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::byte> bytes = RandomBytes(64 << 10, 9);
  absl::StatusOr<Ticket> ticket = (*client)->Store(bytes.data(), bytes.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  std::vector<std::byte> back(bytes.size());
  auto fetch = [&] { return (*client)->Fetch(*ticket, back.data(), back.size()); };
  ASSERT_TRUE(fetch().ok());
  // A crash after which the service manager passes the state table back
  // but none of the pool's memfds: the object's memory is gone.
  const int ready = daemon->fd_store()->ready_count();
  ASSERT_TRUE(daemon->Stop(SIGKILL).ok());
  ASSERT_GT(daemon->fd_store()->Forget("seg-"), 0u);
  ASSERT_TRUE(daemon->Restart().ok()) << daemon->log();
  ASSERT_TRUE(daemon->fd_store()->WaitReady(ready, std::chrono::seconds(30))) << daemon->log();
  EXPECT_TRUE(LogHas(*daemon, "lost: its memory was not kept")) << daemon->log();
  absl::Status lost = fetch();
  EXPECT_EQ(lost.code(), absl::StatusCode::kDataLoss) << lost;
  EXPECT_THAT(std::string(lost.message()), HasSubstr("restarted after a crash"));
  daemon = TakeOver(std::move(daemon));
  ASSERT_NE(daemon, nullptr);
  lost = fetch();
  EXPECT_EQ(lost.code(), absl::StatusCode::kDataLoss) << lost << "\n" << daemon->log();
  EXPECT_THAT(std::string(lost.message()), HasSubstr("restarted after a crash"));
  // New objects of the session are stored and read as before.
  absl::StatusOr<Ticket> again = (*client)->Store(bytes.data(), bytes.size());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*client)->Fetch(*again, back.data(), back.size()).ok());
  EXPECT_EQ(back, bytes);
  client->reset();
  daemon.reset();
  Retired().clear();
}

// A channel that saw its daemon die backs off: a call right after the
// restart waits for it to connect again instead of failing at once.
void WaitForTheDaemon(grpc::ClientContext& ctx) {
  ctx.set_wait_for_ready(true);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
}

// A raw Put with `put_id`, as a client sends it (again, after a restart
// that lost the answer).
grpc::Status RawPut(v1::Stash::Stub& stub, const std::string& token, uint64_t put_id,
                    const std::string& bytes, v1::PutReply* reply) {
  grpc::ClientContext ctx;
  WaitForTheDaemon(ctx);
  ctx.AddMetadata("x-actstash-token", token);
  std::unique_ptr<grpc::ClientWriter<v1::PutChunk>> writer = stub.Put(&ctx, reply);
  v1::PutChunk chunk;
  chunk.mutable_header()->set_nbytes(bytes.size());
  chunk.mutable_header()->set_put_id(put_id);
  bool writing = writer->Write(chunk);
  chunk.set_data(bytes);
  writing = writing && writer->Write(chunk);
  if (writing) writer->WritesDone();
  return writer->Finish();
}

uint64_t RawObjectCount(v1::Stash::Stub& stub, const std::string& token) {
  grpc::ClientContext ctx;
  WaitForTheDaemon(ctx);
  ctx.AddMetadata("x-actstash-token", token);
  v1::StatsReply reply;
  EXPECT_TRUE(stub.Stats(&ctx, v1::StatsRequest(), &reply).ok());
  return reply.self().objects();
}

TEST(CrashRecoveryTest, APutSentAgainAfterACrashOrATakeOverIsStoredOnce) {
  DaemonProcessOptions options = Supervised();
  options.pool_size = kPool;  // as the successor TakeOver starts
  options.segment_size = kSegment;
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  RawStub raw = OpenRawSession(*daemon);
  ASSERT_FALSE(raw.token.empty());
  v1::Stash::Stub* stub = raw.stub.get();
  const std::string& token = raw.token;
  const std::string bytes(1 << 20, 'p');  // one chunk (kMaxChunkBytes)
  v1::PutReply first, again, other;
  ASSERT_TRUE(RawPut(*stub, token, 7, bytes, &first).ok());
  ASSERT_TRUE(RawPut(*stub, token, 7, bytes, &again).ok());
  EXPECT_EQ(again.handle(), first.handle());
  EXPECT_EQ(again.nbytes(), bytes.size());
  ASSERT_TRUE(RawPut(*stub, token, 8, "eight", &other).ok());
  EXPECT_NE(other.handle(), first.handle());
  EXPECT_EQ(RawObjectCount(*stub, token), 2u);
  // The same id with other bytes is refused, and nothing is stored.
  v1::PutReply refused;
  grpc::Status status = RawPut(*stub, token, 8, "not eight", &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("put id 8"));
  // The ids survive a crash (in the state table) and a take-over.
  Crash(*daemon);
  ASSERT_TRUE(RawPut(*stub, token, 7, bytes, &again).ok()) << daemon->log();
  EXPECT_EQ(again.handle(), first.handle());
  daemon = TakeOver(std::move(daemon), {});
  ASSERT_NE(daemon, nullptr);
  ASSERT_TRUE(RawPut(*stub, token, 8, "eight", &again).ok()) << daemon->log();
  EXPECT_EQ(again.handle(), other.handle());
  EXPECT_EQ(RawObjectCount(*stub, token), 2u);
  // A deleted object's id is free again: a new object under a new handle.
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-actstash-token", token);
    v1::DeleteRequest request;
    request.add_handles(first.handle());
    v1::DeleteReply reply;
    ASSERT_TRUE(stub->Delete(&ctx, request, &reply).ok());
  }
  ASSERT_TRUE(RawPut(*stub, token, 7, bytes, &again).ok());
  EXPECT_NE(again.handle(), first.handle());
  EXPECT_EQ(RawObjectCount(*stub, token), 2u);
  daemon.reset();
  Retired().clear();
}

// The crash between a grant's record and its answer, made on purpose: a
// Lease of the session whose answer its HostLeases never sees (the fds stay
// unread in the attach socket). The restarted daemon carries it over from
// the state table; the client's next Lease names what it holds, and the
// daemon takes the rest back, so the quota that grant filled is free again.
TEST(CrashRecoveryTest, AGrantWhoseAnswerWasLostIsTakenBackAfterARestart) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(Supervised());  // 4 MiB segments
  ASSERT_NE(daemon, nullptr);
  auto stub = v1::Stash::NewStub(
      grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials()));
  std::string token;
  {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest request;
    request.set_quota_bytes(3 * (4u << 20));  // three segments
    v1::OpenSessionReply reply;
    ASSERT_TRUE(stub->OpenSession(&ctx, request, &reply).ok());
    token = reply.token();
  }
  absl::StatusOr<std::unique_ptr<client_internal::AttachConnection>> attach =
      client_internal::AttachConnection::Connect(attach::AttachSocketPath(daemon->socket_path()),
                                                 token, std::chrono::seconds(5),
                                                 std::chrono::seconds(20));
  ASSERT_TRUE(attach.ok()) << attach.status();
  client_internal::SessionRpc rpc(
      daemon->address(), grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials()),
      std::chrono::seconds(10));
  rpc.SetToken(token);
  rpc.SetAttach(attach->get());
  client_internal::HostLeases leases(&rpc, attach->get(), /*numa_node=*/-1, /*can_spill=*/false);

  absl::StatusOr<std::vector<client_internal::GrantedLease>> held = leases.Lease(1, 1);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->size(), 1u);
  v1::LeaseReply lost;  // the answer the crash would have lost
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-actstash-token", token);
    v1::LeaseRequest request;
    request.set_count(2);
    ASSERT_TRUE(stub->Lease(&ctx, request, &lost).ok());
    ASSERT_EQ(lost.leases_size(), 2);
  }
  absl::StatusOr<std::vector<client_internal::GrantedLease>> full = leases.Lease(1, 1);
  ASSERT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();

  Crash(*daemon);
  // Two segments of quota are free again only if the lost grant went back.
  absl::StatusOr<std::vector<client_internal::GrantedLease>> after = leases.Lease(2, 1);
  ASSERT_TRUE(after.ok()) << after.status() << daemon->log();
  EXPECT_EQ(after->size(), 2u);
  EXPECT_TRUE(LogHas(*daemon, "took back 2 carried lease(s)")) << daemon->log();
  // The lease the client held is still its own; the lost ones are gone.
  grpc::ClientContext ctx;
  WaitForTheDaemon(ctx);
  ctx.AddMetadata("x-actstash-token", token);
  v1::ReturnRequest request;
  request.add_lease_ids(lost.leases(0).lease_id());
  v1::ReturnReply reply;
  EXPECT_EQ(stub->Return(&ctx, request, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(leases.Return({(*held)[0].lease_id}).ok());
  // Named once, a carried lease is the client's: a second restart's
  // confirmation takes nothing the client holds.
  Crash(*daemon);
  absl::StatusOr<std::vector<client_internal::GrantedLease>> again = leases.Lease(1, 1);
  ASSERT_TRUE(again.ok()) << again.status() << daemon->log();
  EXPECT_TRUE(
      leases.Return({(*after)[0].lease_id, (*after)[1].lease_id, (*again)[0].lease_id}).ok());
  attach->get()->Shutdown();
}

}  // namespace
}  // namespace actstash::testing
