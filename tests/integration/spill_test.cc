// The spill tier against a real actstashd with a real spill directory:
// buffers beyond the pool go to disk and come back byte for byte, corrupt
// files are DATA_LOSS, nothing is left on disk after kills, and a full spill
// space is RESOURCE_EXHAUSTED with nothing lost.
#include <dirent.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "actstash/v1/stash.grpc.pb.h"
#include "common/protocol.h"
#include "common/unique_fd.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;
namespace pb = ::actstash::v1;
constexpr uint64_t kMiB = 1 << 20;

// Names in `dir` (the spill files have none: they are created unlinked).
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  return names;
}

struct Stored {
  Ticket ticket;
  std::vector<std::byte> data;
};

class SpillTest : public ::testing::Test {
 protected:
  void SetUp() override { spill_dir_ = MakeTempDir(); }
  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) std::fprintf(stderr, "%s", daemon_->log().c_str());
    daemon_.reset();
    std::filesystem::remove_all(spill_dir_);
  }
  void StartDaemon(const std::string& pool = "64MiB", std::vector<std::string> extra = {}) {
    DaemonProcessOptions options;
    options.pool_size = pool;
    options.segment_size = "4MiB";
    options.extra_args = {"--spill-dir", spill_dir_};
    options.extra_args.insert(options.extra_args.end(), extra.begin(), extra.end());
    daemon_ = StartDaemonOrDie(options);
    ASSERT_NE(daemon_, nullptr);
  }
  std::unique_ptr<Client> Attached(uint64_t quota = 0) {
    ClientOptions options;
    options.address = daemon_->address();
    options.quota_bytes = quota;
    options.attach = AttachMode::kRequired;
    options.lease_batch = 2;
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
  // Stores buffers of 64 KiB to 3 MiB (and one of 6 MiB, a dedicated lease
  // every 16) until `total` bytes are stored.
  std::vector<Stored> StoreMany(Client& client, uint64_t total, uint64_t seed) {
    std::vector<Stored> stored;
    uint64_t bytes = 0;
    std::mt19937_64 random(seed);
    while (bytes < total) {
      const size_t size = stored.size() % 16 == 15 ? 6 * kMiB : 64 * 1024 + random() % (3 * kMiB);
      Stored s;
      s.data = RandomBytes(size, seed * 1000 + stored.size());
      absl::StatusOr<Ticket> ticket = client.Store(s.data.data(), s.data.size());
      EXPECT_TRUE(ticket.ok()) << ticket.status() << " after " << bytes << " bytes";
      if (!ticket.ok()) break;
      s.ticket = *ticket;
      bytes += size;
      stored.push_back(std::move(s));
    }
    return stored;
  }
  // Fetches in reverse order (as backward does), checks, releases.
  void FetchAllBack(Client& client, std::vector<Stored>& stored) {
    for (size_t i = stored.size(); i-- > 0;) {
      std::vector<std::byte> back(stored[i].data.size());
      absl::Status status = client.Fetch(stored[i].ticket, back.data(), back.size());
      ASSERT_TRUE(status.ok()) << "buffer " << i << ": " << status;
      ASSERT_EQ(0, std::memcmp(back.data(), stored[i].data.data(), back.size())) << "buffer " << i;
      ASSERT_TRUE(client.Release(stored[i].ticket).ok());
    }
  }

  std::string spill_dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(SpillTest, ThreeTimesThePoolComesBackByteForByte) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored = StoreMany(*client, 192 * kMiB, 1);
  const v1::ClientUsage after_store = client->zero_copy_usage();
  EXPECT_GT(after_store.spills(), 0u);
  EXPECT_GE(after_store.spilled_bytes(), 120 * kMiB) << "most of 192 MiB must be on disk";
  EXPECT_LE(after_store.leased_bytes(), 64 * kMiB);
  EXPECT_TRUE(Entries(spill_dir_).empty()) << "spill files have no name";
  EXPECT_FALSE(SpillFds(daemon_->pid(), spill_dir_).empty());
  v1::StatsReply stats = Stats();
  ASSERT_TRUE(stats.has_spill());
  EXPECT_EQ(stats.spill().on_disk_bytes(), after_store.spilled_bytes());
  EXPECT_GE(stats.spill().bytes_written(), after_store.spilled_bytes());
  FetchAllBack(*client, stored);
  const v1::ClientUsage after_fetch = client->zero_copy_usage();
  EXPECT_EQ(after_fetch.spilled_leases(), 0u);
  EXPECT_GT(after_fetch.restores(), 0u);
  EXPECT_GT(after_fetch.restores_ahead(), 0u) << "backward should find blocks read back ahead";
  ASSERT_TRUE(client->Stats().ok());  // reports this client's waits
  stats = Stats();
  EXPECT_EQ(stats.spill().on_disk_bytes(), 0u);
  EXPECT_EQ(stats.spill().files(), 0u);
  EXPECT_GE(stats.spill().bytes_read(), 64 * kMiB);
  EXPECT_EQ(stats.spill().checksum_failures(), 0u);
  // The session's numbers, and the waits the client reported.
  bool found = false;
  for (const v1::SessionStats& s : stats.all_sessions()) {
    if (s.session_id() != client->session_id()) continue;
    found = true;
    EXPECT_EQ(s.spill().spilled_bytes(), stats.spill().bytes_written());
    EXPECT_EQ(s.spill().restored_bytes(), stats.spill().bytes_read());
    EXPECT_GT(s.client().spill_wait_ns(), 0u);
  }
  EXPECT_TRUE(found);
  EXPECT_TRUE(SpillFds(daemon_->pid(), spill_dir_).empty());
}

TEST_F(SpillTest, ReleasedSpilledBuffersDropTheirFilesWithoutReadingThem) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored = StoreMany(*client, 160 * kMiB, 2);
  ASSERT_GT(client->zero_copy_usage().spilled_leases(), 0u);
  for (Stored& s : stored) ASSERT_TRUE(client->Release(s.ticket).ok());
  EXPECT_EQ(client->zero_copy_usage().restores(), 0u);
  const v1::StatsReply stats = Stats();
  EXPECT_EQ(stats.spill().on_disk_bytes(), 0u);
  EXPECT_EQ(stats.spill().bytes_read(), 0u);
}

TEST_F(SpillTest, TwoSessionsSharingASmallPoolBothSpill) {
  StartDaemon();
  auto a = Attached();
  auto b = Attached();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::thread other([&] {
    for (int round = 0; round < 2; ++round) {
      std::vector<Stored> stored = StoreMany(*b, 96 * kMiB, 20 + round);
      FetchAllBack(*b, stored);
    }
  });
  for (int round = 0; round < 2; ++round) {
    std::vector<Stored> stored = StoreMany(*a, 96 * kMiB, 10 + round);
    FetchAllBack(*a, stored);
  }
  other.join();
  EXPECT_GT(a->zero_copy_usage().spills(), 0u);
  EXPECT_GT(b->zero_copy_usage().spills(), 0u);
  EXPECT_EQ(Stats().spill().on_disk_bytes(), 0u);
}

// A session holds most of the pool and goes idle (it makes no call but its
// usage report); another then needs memory and has nothing of its own to
// spill. The daemon asks the idle holder, in the answer to its report, for
// what it holds above its fair share; the holder spills its coldest blocks
// and gives the leases back on its reporter's thread, and the waiter goes on
// well before its pool_wait. Nothing is lost: the holder reads everything
// back, byte for byte.
TEST_F(SpillTest, AnIdleSessionHoldingThePoolGivesToOneThatWaits) {
  StartDaemon();  // 64 MiB in 4 MiB segments
  auto holder = Attached();
  ASSERT_NE(holder, nullptr);
  std::vector<Stored> held = StoreMany(*holder, 52 * kMiB, 41);
  ASSERT_EQ(holder->zero_copy_usage().spills(), 0u);
  ClientOptions options;
  options.address = daemon_->address();
  options.attach = AttachMode::kRequired;
  options.lease_batch = 2;
  options.pool_wait = std::chrono::milliseconds(20000);
  absl::StatusOr<std::unique_ptr<Client>> waiter = Client::Connect(options);
  ASSERT_TRUE(waiter.ok()) << waiter.status();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Stored> stored = StoreMany(**waiter, 24 * kMiB, 42);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 10.0);  // asked at the holder's next report (1 s), not pool_wait (20 s)
  FetchAllBack(**waiter, stored);
  const v1::ClientUsage given = holder->zero_copy_usage();
  EXPECT_GT(given.spills(), 0u);  // the holder spilled while making no call of its own
  EXPECT_GT(given.reclaims_answered(), 0u);
  EXPECT_GT(given.reclaim_bytes_given(), 0u);
  bool seen = false;
  const v1::StatsReply stats = Stats();
  for (const v1::SessionStats& session : stats.all_sessions()) {
    if (session.session_id() != holder->session_id()) continue;
    seen = true;
    EXPECT_GT(session.reclaims_asked(), 0u);
    EXPECT_GT(session.reclaim_bytes_asked(), 0u);
  }
  EXPECT_TRUE(seen);
  FetchAllBack(*holder, held);
  EXPECT_EQ(Stats().spill().on_disk_bytes(), 0u);
}

// What the daemon asked each session back (its SessionStats).
uint64_t AskedOf(const v1::StatsReply& stats, uint64_t session_id) {
  for (const v1::SessionStats& session : stats.all_sessions()) {
    if (session.session_id() == session_id) return session.reclaim_bytes_asked();
  }
  ADD_FAILURE() << "no session " << session_id;
  return 0;
}

// Three sessions: one active within its fair share (it keeps copying), one
// idle holding more than its share, and one that waits. Only the idle one
// above its share is asked; the active one within its share never is.
TEST_F(SpillTest, TheIdleSessionAboveItsShareIsAskedAndTheActiveOneWithinItIsNot) {
  StartDaemon();  // 64 MiB: a share is 21.3 MiB with three holders
  auto active = Attached();
  auto idle = Attached();
  ASSERT_NE(active, nullptr);
  ASSERT_NE(idle, nullptr);
  std::vector<Stored> held = StoreMany(*idle, 36 * kMiB, 51);
  std::vector<Stored> mine = StoreMany(*active, 12 * kMiB, 52);
  std::atomic<bool> stop{false};
  std::thread copying([&] {  // stays active: a fetch of its own data every 100 ms
    std::vector<std::byte> back(mine.front().data.size());
    while (!stop.load()) {
      EXPECT_TRUE(active->Fetch(mine.front().ticket, back.data(), back.size()).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  auto waiter = Attached();
  ASSERT_NE(waiter, nullptr);
  std::vector<Stored> stored = StoreMany(*waiter, 20 * kMiB, 53);
  FetchAllBack(*waiter, stored);
  stop = true;
  copying.join();
  const v1::StatsReply stats = Stats();
  EXPECT_GT(AskedOf(stats, idle->session_id()), 0u);
  EXPECT_EQ(AskedOf(stats, active->session_id()), 0u);
  EXPECT_GT(idle->zero_copy_usage().spills(), 0u);
  FetchAllBack(*idle, held);
  FetchAllBack(*active, mine);
}

// A session that waits while it holds more than its share spills its own: an
// idle session within its share is not asked for it.
TEST_F(SpillTest, AnIdleSessionWithinItsShareIsNotAskedForOneAboveIts) {
  StartDaemon();  // 64 MiB: a share is 32 MiB with two holders
  auto idle = Attached();
  ASSERT_NE(idle, nullptr);
  std::vector<Stored> held = StoreMany(*idle, 16 * kMiB, 61);
  auto big = Attached();
  ASSERT_NE(big, nullptr);
  std::vector<Stored> stored = StoreMany(*big, 96 * kMiB, 62);   // over its share: spills
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // a report of the idle one
  EXPECT_GT(big->zero_copy_usage().spills(), 0u);
  EXPECT_EQ(AskedOf(Stats(), idle->session_id()), 0u);
  EXPECT_EQ(idle->zero_copy_usage().spills(), 0u);
  FetchAllBack(*big, stored);
  FetchAllBack(*idle, held);
}

TEST_F(SpillTest, CorruptSpillFileIsDataLossAndTheDaemonGoesOn) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored = StoreMany(*client, 160 * kMiB, 3);
  const std::vector<std::string> fds = SpillFds(daemon_->pid(), spill_dir_);
  ASSERT_FALSE(fds.empty());
  for (const std::string& fd : fds) {
    const UniqueFd file(open(fd.c_str(), O_WRONLY));
    ASSERT_TRUE(file.valid()) << fd << ": " << std::strerror(errno);
    const char garbage[] = "not what was written";
    ASSERT_EQ(pwrite(file.get(), garbage, sizeof(garbage), 4096),
              static_cast<ssize_t>(sizeof(garbage)));
    fsync(file.get());
  }
  int data_loss = 0;
  for (size_t i = stored.size(); i-- > 0;) {
    std::vector<std::byte> back(stored[i].data.size());
    absl::Status status = client->Fetch(stored[i].ticket, back.data(), back.size());
    if (status.code() == absl::StatusCode::kDataLoss) {
      ++data_loss;
      EXPECT_THAT(std::string(status.message()), HasSubstr("checksum"));
      EXPECT_THAT(std::string(status.message()),
                  HasSubstr("session " + std::to_string(client->session_id())));
    } else {
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(0, std::memcmp(back.data(), stored[i].data.data(), back.size()))
          << "buffer " << i << " came back wrong without an error";
    }
    ASSERT_TRUE(client->Release(stored[i].ticket).ok());
  }
  EXPECT_GT(data_loss, 0);
  const v1::StatsReply stats = Stats();
  EXPECT_GE(stats.spill().checksum_failures(), 1u);
  EXPECT_EQ(stats.spill().on_disk_bytes(), 0u);
  // Still serving, spilling included.
  std::vector<Stored> again = StoreMany(*client, 128 * kMiB, 4);
  FetchAllBack(*client, again);
}

TEST_F(SpillTest, KilledDaemonLeavesNoFiles) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored = StoreMany(*client, 160 * kMiB, 5);
  ASSERT_FALSE(SpillFds(daemon_->pid(), spill_dir_).empty());
  absl::StatusOr<int> code = daemon_->Stop(SIGKILL, std::chrono::seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_TRUE(Entries(spill_dir_).empty());
  // A spilled buffer is gone with the daemon: a clear error, not bad bytes.
  // The same error whether the client's watcher saw the attach socket close
  // first or the Restore RPC failed first: it says the daemon went away,
  // where, and how to start it again.
  std::vector<std::byte> back(stored[0].data.size());
  const absl::Status status = client->Fetch(stored[0].ticket, back.data(), back.size());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("actstashd at " + daemon_->address() + " went away"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("spilled"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("`actstashd --socket "));
}

TEST_F(SpillTest, KilledClientsSpillSpaceIsFreedWithinASecond) {
  StartDaemon();
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const std::string address = daemon_->address();
  const std::string worker =
      testing::BuiltBinary("ACTSTASH_WORKER_BINARY", ACTSTASH_WORKER_RELPATH);
  const pid_t child = fork();
  if (child == 0) {
    dup2(pipe_fds[1], STDOUT_FILENO);
    close(pipe_fds[0]);
    execl(worker.c_str(), worker.c_str(), "--address", address.c_str(), "--hold-bytes", "201326592",
          nullptr);
    _exit(127);
  }
  close(pipe_fds[1]);
  FILE* out = fdopen(pipe_fds[0], "r");
  char line[256] = {};
  ASSERT_NE(fgets(line, sizeof(line), out), nullptr);
  ASSERT_STREQ(line, "holding\n");
  v1::StatsReply stats = Stats();
  ASSERT_GE(stats.spill().on_disk_bytes(), 100 * kMiB);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  fclose(out);
  const auto killed = std::chrono::steady_clock::now();
  while (Stats().spill().on_disk_bytes() != 0 &&
         std::chrono::steady_clock::now() - killed < std::chrono::seconds(1)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stats = Stats();
  EXPECT_EQ(stats.spill().on_disk_bytes(), 0u);
  EXPECT_EQ(stats.spill().files(), 0u);
  EXPECT_TRUE(SpillFds(daemon_->pid(), spill_dir_).empty());
}

TEST_F(SpillTest, FullSpillSpaceIsResourceExhaustedAndLosesNothing) {
  StartDaemon("64MiB", {"--spill-size", "32MiB"});
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored;
  absl::Status status;
  for (int i = 0; i < 200 && status.ok(); ++i) {
    Stored s;
    s.data = RandomBytes(1 * kMiB + 4096 * i, 600 + i);
    absl::StatusOr<Ticket> ticket = client->Store(s.data.data(), s.data.size());
    status = ticket.status();
    if (ticket.ok()) {
      s.ticket = *ticket;
      stored.push_back(std::move(s));
    }
  }
  ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("spill space is full"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("32.0 MiB"));
  const v1::StatsReply stats = Stats();
  EXPECT_LE(stats.spill().on_disk_bytes(), 32 * kMiB);
  EXPECT_GE(stats.spill().failures(), 1u);
  FetchAllBack(*client, stored);  // everything stored before is intact
}

// A really full file system (a 24 MiB tmpfs, which also has no O_DIRECT):
// RESOURCE_EXHAUSTED with the free space, nothing half-written, nothing lost.
TEST_F(SpillTest, FullDiskIsResourceExhaustedAndLosesNothing) {
  const std::string mount_point = spill_dir_ + "/small";
  ASSERT_EQ(mkdir(mount_point.c_str(), 0700), 0);
  const std::string mount =
      "mount -t tmpfs -o size=24m,mode=0700 tmpfs '" + mount_point + "' 2>/dev/null";
  if (std::system(mount.c_str()) != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root); the full-disk path is "
                    "covered where it can";
  }
  // Unmounted however the test ends (before TearDown removes the directory).
  struct Unmount {
    std::string path;
    std::string* spill_dir;
    std::string real_dir;
    std::unique_ptr<DaemonProcess>* daemon;
    ~Unmount() {
      daemon->reset();
      EXPECT_EQ(std::system(("umount '" + path + "'").c_str()), 0);
      *spill_dir = real_dir;
    }
  } unmount{mount_point, &spill_dir_, spill_dir_, &daemon_};
  spill_dir_ = mount_point;
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored;
  absl::Status status;
  for (int i = 0; i < 200 && status.ok(); ++i) {
    Stored s;
    s.data = RandomBytes(1 * kMiB, 800 + i);
    absl::StatusOr<Ticket> ticket = client->Store(s.data.data(), s.data.size());
    status = ticket.status();
    if (ticket.ok()) {
      s.ticket = *ticket;
      stored.push_back(std::move(s));
    }
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("No space left on device"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("free of"));
  const v1::StatsReply stats = Stats();
  EXPECT_LE(stats.spill().on_disk_bytes(), 24 * kMiB);
  EXPECT_GE(stats.spill().failures(), 1u);
  FetchAllBack(*client, stored);
  client.reset();
}

TEST_F(SpillTest, InlineObjectsSpillAndComeBack) {
  StartDaemon();
  auto client = ConnectOrDie(*daemon_, 0, "inline");
  ASSERT_NE(client, nullptr);
  std::vector<std::pair<Handle, std::vector<std::byte>>> objects;
  PutOptions options;
  options.checksum = true;
  for (int i = 0; i < 40; ++i) {  // 160 MiB through a 64 MiB pool and quota
    // Sizes not a multiple of 4 KiB, which O_DIRECT files refuse.
    std::vector<std::byte> data = RandomBytes(4 * kMiB - 4196 * i, 900 + i);
    absl::StatusOr<Handle> handle = client->Put(data.data(), data.size(), options);
    ASSERT_TRUE(handle.ok()) << i << ": " << handle.status();
    objects.emplace_back(*handle, std::move(data));
  }
  v1::StatsReply stats = Stats();
  ASSERT_TRUE(stats.has_spill());
  EXPECT_GE(stats.spill().on_disk_bytes(), 90 * kMiB);
  EXPECT_EQ(stats.objects(), 40u);
  // Two readers of the same spilled object at once, then everything, oldest
  // (spilled) first.
  std::thread other([&] {
    absl::StatusOr<Object> got = client->Get(objects[0].first);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->data, objects[0].second);
  });
  for (const auto& [handle, data] : objects) {
    absl::StatusOr<Object> got = client->Get(handle);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->data, data);
    EXPECT_TRUE(got->info.checksum_xxh3.has_value());
  }
  other.join();
  stats = Stats();
  EXPECT_GE(stats.spill().bytes_read(), 90 * kMiB);
  EXPECT_EQ(stats.spill().checksum_failures(), 0u);
  for (const auto& entry : objects) ASSERT_TRUE(client->Delete(entry.first).ok());
  stats = Stats();
  EXPECT_EQ(stats.spill().on_disk_bytes(), 0u);
  EXPECT_EQ(stats.spill().files(), 0u);
  EXPECT_TRUE(SpillFds(daemon_->pid(), spill_dir_).empty());
}

TEST_F(SpillTest, CorruptInlineObjectIsDataLoss) {
  StartDaemon();
  auto client = ConnectOrDie(*daemon_, 0, "inline");
  ASSERT_NE(client, nullptr);
  std::vector<std::pair<Handle, std::vector<std::byte>>> objects;
  for (int i = 0; i < 24; ++i) {
    std::vector<std::byte> data = RandomBytes(4 * kMiB, 700 + i);
    absl::StatusOr<Handle> handle = client->Put(data.data(), data.size());
    ASSERT_TRUE(handle.ok()) << handle.status();
    objects.emplace_back(*handle, std::move(data));
  }
  for (const std::string& fd : SpillFds(daemon_->pid(), spill_dir_)) {
    const UniqueFd file(open(fd.c_str(), O_WRONLY));
    ASSERT_TRUE(file.valid());
    ASSERT_EQ(pwrite(file.get(), "x", 1, 12345), 1);
    fsync(file.get());
  }
  int lost = 0;
  for (const auto& [handle, data] : objects) {
    absl::StatusOr<Object> got = client->Get(handle);
    if (got.status().code() == absl::StatusCode::kDataLoss) {
      ++lost;
      EXPECT_THAT(std::string(got.status().message()), HasSubstr("checksum"));
      // Still DATA_LOSS the second time, and Delete works.
      EXPECT_EQ(client->Get(handle).status().code(), absl::StatusCode::kDataLoss);
      continue;
    }
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->data, data);
  }
  EXPECT_GT(lost, 0);
  for (const auto& entry : objects) ASSERT_TRUE(client->Delete(entry.first).ok());
  EXPECT_EQ(Stats().spill().on_disk_bytes(), 0u);
}

// Raw RPCs: what a buggy or hostile client could send.
class RawSession {
 public:
  explicit RawSession(const std::string& address)
      : stub_(
            pb::Stash::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    grpc::ClientContext ctx;
    pb::OpenSessionRequest request;
    pb::OpenSessionReply reply;
    EXPECT_TRUE(stub_->OpenSession(&ctx, request, &reply).ok());
    token_ = reply.token();
  }
  template <typename Request, typename Reply, typename Method>
  grpc::StatusCode Call(Method method, const Request& request, Reply* reply) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kTokenMetadataKey, token_);
    return ((*stub_).*method)(&ctx, request, reply).error_code();
  }

 private:
  std::unique_ptr<pb::Stash::Stub> stub_;
  std::string token_;
};

TEST_F(SpillTest, SpillRpcsCheckEveryIdTheClientSends) {
  StartDaemon();
  auto client = Attached();
  ASSERT_NE(client, nullptr);
  std::vector<Stored> stored = StoreMany(*client, 128 * kMiB, 8);
  ASSERT_GT(client->zero_copy_usage().spilled_leases(), 0u);
  RawSession raw(daemon_->address());
  pb::SpillReply spill_reply;
  pb::SpillRequest spill;
  EXPECT_EQ(raw.Call(&pb::Stash::Stub::Spill, spill, &spill_reply),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Lease ids are small sequential numbers: another session's are NOT_FOUND.
  for (uint64_t id = 1; id < 64; ++id) spill.add_lease_ids(id);
  EXPECT_EQ(raw.Call(&pb::Stash::Stub::Spill, spill, &spill_reply), grpc::StatusCode::NOT_FOUND);
  pb::RestoreRequest restore;
  pb::RestoreReply restore_reply;
  for (uint64_t id = 1; id < 64; ++id) {
    restore.set_spill_id(id);
    restore.set_lease_id(id);
    EXPECT_EQ(raw.Call(&pb::Stash::Stub::Restore, restore, &restore_reply),
              grpc::StatusCode::NOT_FOUND);
  }
  pb::DropSpilledRequest drop;
  pb::DropSpilledReply drop_reply;
  for (uint64_t id = 1; id < 64; ++id) drop.add_spill_ids(id);
  EXPECT_EQ(raw.Call(&pb::Stash::Stub::DropSpilled, drop, &drop_reply),
            grpc::StatusCode::NOT_FOUND);
  // The owner's buffers are untouched by all of that.
  FetchAllBack(*client, stored);

  DaemonProcessOptions plain;
  plain.pool_size = "64MiB";
  plain.segment_size = "4MiB";
  auto no_spill = StartDaemonOrDie(plain);
  ASSERT_NE(no_spill, nullptr);
  RawSession without(no_spill->address());
  spill.Clear();
  spill.add_lease_ids(1);
  EXPECT_EQ(without.Call(&pb::Stash::Stub::Spill, spill, &spill_reply),
            grpc::StatusCode::FAILED_PRECONDITION);
  auto other = ConnectOrDie(*no_spill, 0, "no-spill");
  std::vector<std::byte> big(96 * kMiB);
  absl::StatusOr<Ticket> too_big = other->Store(big.data(), big.size());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace actstash::testing
