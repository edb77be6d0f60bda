// The client's background workers (client/store/background_worker.h): a
// SerialWorker runs its tasks one at a time, in order, on one thread of its
// own, and Stop drops what is queued after the running task ends; a
// PeriodicWorker ticks until Stop, which does not wait out the period.
#include "client/store/background_worker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace actstash::client_internal {
namespace {

TEST(SerialWorkerTest, RunsTasksInOrderOneAtATimeOnAThreadOfItsOwn) {
  SerialWorker worker;
  absl::Mutex mu;
  std::vector<int> order;
  std::set<std::thread::id> threads;
  std::atomic<int> running{0};
  std::atomic<bool> overlapped{false};
  absl::Notification done;
  for (int i = 0; i < 50; ++i) {
    worker.Post([&, i] {
      if (running.fetch_add(1) != 0) overlapped = true;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      {
        absl::MutexLock lock(&mu);
        order.push_back(i);
        threads.insert(std::this_thread::get_id());
      }
      running.fetch_sub(1);
      if (i == 49) done.Notify();
    });
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  worker.Stop();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
  EXPECT_EQ(threads.size(), 1u);
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
  EXPECT_FALSE(overlapped.load());
}

TEST(SerialWorkerTest, StopWaitsForTheRunningTaskAndDropsTheQueued) {
  SerialWorker worker;
  absl::Notification started, release;
  std::atomic<bool> first_done{false}, second_ran{false};
  worker.Post([&] {
    started.Notify();
    release.WaitForNotification();
    first_done = true;
  });
  worker.Post([&] { second_ran = true; });
  started.WaitForNotification();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release.Notify();
  });
  worker.Stop();  // returns only once the running task ended
  EXPECT_TRUE(first_done.load());
  releaser.join();
  EXPECT_FALSE(second_ran.load());
  worker.Post([&] { second_ran = true; });  // after Stop: dropped
  worker.Stop();                            // idempotent
  EXPECT_FALSE(second_ran.load());
}

TEST(PeriodicWorkerTest, TicksUntilStopped) {
  std::atomic<int> ticks{0};
  PeriodicWorker worker(absl::Milliseconds(1), [&] { ticks.fetch_add(1); });
  EXPECT_EQ(ticks.load(), 0);  // nothing before Start
  worker.Start();
  worker.Start();  // idempotent
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (ticks.load() < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(ticks.load(), 3);
  worker.Stop();
  const int after_stop = ticks.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ticks.load(), after_stop);
  worker.Start();  // not after Stop
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ticks.load(), after_stop);
}

TEST(PeriodicWorkerTest, StopDoesNotWaitOutThePeriod) {
  std::atomic<int> ticks{0};
  PeriodicWorker worker(absl::Hours(1), [&] { ticks.fetch_add(1); });
  worker.Start();
  const auto start = std::chrono::steady_clock::now();
  worker.Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(ticks.load(), 0);
}

}  // namespace
}  // namespace actstash::client_internal
