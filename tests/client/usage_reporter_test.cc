// UsageReporter: sends a changed usage, stays quiet while nothing changes
// and nothing is leased, sends every tick while leases are held and gives
// what the daemon asks back, and never calls back after Stop.
#include "client/rpc/usage_reporter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace actstash::client_internal {
namespace {

using std::chrono::milliseconds;

// Waits (up to a minute: a loaded machine) for `done` under `mu`.
bool WaitFor(absl::Mutex& mu, const std::function<bool()>& done) {
  absl::MutexLock lock(&mu);
  auto ready = [&] { return done(); };
  return mu.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(60));
}

TEST(UsageReporterTest, SendsWhatChangedAndNothingElse) {
  absl::Mutex mu;
  v1::ClientUsage current;  // what the client holds
  std::vector<v1::ClientUsage> sent;
  std::atomic<int> reads{0};
  UsageReporter reporter(
      milliseconds(1),
      [&] {
        ++reads;
        absl::MutexLock lock(&mu);
        return current;
      },
      [&](const v1::ClientUsage& usage) -> uint64_t {
        absl::MutexLock lock(&mu);
        sent.push_back(usage);
        return 0;
      });
  reporter.Start();
  {
    absl::MutexLock lock(&mu);
    current.set_stores(1);
    current.set_bytes_stored(4096);
    current.set_objects(1);
  }
  ASSERT_TRUE(WaitFor(mu, [&] { return sent.size() == 1; }));
  // Unchanged usage is read again and again but not sent.
  const int before = reads.load();
  while (reads.load() < before + 20) std::this_thread::sleep_for(milliseconds(1));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(sent.size(), 1u);
    EXPECT_EQ(sent[0].bytes_stored(), 4096u);
    current.set_fetches(1);  // a fetch is a change
  }
  ASSERT_TRUE(WaitFor(mu, [&] { return sent.size() == 2; }));
  reporter.Stop();
  const int after_stop = reads.load();
  {
    absl::MutexLock lock(&mu);
    current.set_stores(2);
  }
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(reads.load(), after_stop);  // joined: no callback after Stop
  absl::MutexLock lock(&mu);
  EXPECT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[1].fetches(), 1u);
}

TEST(UsageReporterTest, StopWithoutStartAndStartAfterStopDoNothing) {
  std::atomic<int> reads{0};
  UsageReporter reporter(
      milliseconds(1), [&] { return ++reads, v1::ClientUsage(); },
      [](const v1::ClientUsage&) -> uint64_t { return 0; });
  reporter.Stop();
  reporter.Start();
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(reads.load(), 0);
}

// While it holds leases the client reports at every tick, unchanged or not:
// the daemon's answer is where it asks for memory back for a session that
// waits, and an idle trainer holding the pool must hear it. The ask goes to
// `give` on the reporter's thread.
TEST(UsageReporterTest, ReportsWhileLeasingAndGivesWhatIsAsked) {
  absl::Mutex mu;
  int sends = 0;
  std::vector<uint64_t> given;
  v1::ClientUsage holding;
  holding.set_leases(2);
  holding.set_leased_bytes(8 << 20);
  UsageReporter reporter(
      milliseconds(1), [&] { return holding; },
      [&](const v1::ClientUsage&) -> uint64_t {
        absl::MutexLock lock(&mu);
        return ++sends == 3 ? (4u << 20) : 0;
      },
      [&](uint64_t bytes) {
        absl::MutexLock lock(&mu);
        given.push_back(bytes);
      });
  reporter.Start();
  ASSERT_TRUE(WaitFor(mu, [&] { return sends >= 5; }));  // unchanged, sent again and again
  reporter.Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(given, std::vector<uint64_t>{4u << 20});
}

}  // namespace
}  // namespace actstash::client_internal
