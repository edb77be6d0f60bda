// UsageReporter: sends a changed usage, stays quiet while nothing changes,
// and never calls back after Stop.
#include "client/rpc/usage_reporter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

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
      [&](const v1::ClientUsage& usage) {
        absl::MutexLock lock(&mu);
        sent.push_back(usage);
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
      milliseconds(1), [&] { return ++reads, v1::ClientUsage(); }, [](const v1::ClientUsage&) {});
  reporter.Stop();
  reporter.Start();
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(reads.load(), 0);
}

}  // namespace
}  // namespace actstash::client_internal
