// Self-test of absl_mutex_tsan.cc, run by scripts/sanitize thread before the
// suites. `clean` shares plain data through every absl entry point the shim
// covers and must give no report with the shim (and does without it);
// `race` writes one counter from two threads without a common lock and must
// be reported with the shim too.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

constexpr int kRounds = 1000;

// Reads must not be optimized away: each reaches this sink (atomic: the
// threads' adds to it are not the accesses under test).
std::atomic<long> sink{0};
void Use(long value) { sink.fetch_add(value, std::memory_order_relaxed); }

struct Shared {
  absl::Mutex mu;
  absl::CondVar changed;
  long counter ABSL_GUARDED_BY(mu) = 0;
  bool ready ABSL_GUARDED_BY(mu) = false;
};

// Two writers under Lock/TryLock, then readers under ReaderLock/ReaderTryLock.
void LockAndTryLock(Shared& s) {
  auto writer = [&s] {
    for (int i = 0; i < kRounds; ++i) {
      if (i % 2 == 0) {
        absl::MutexLock lock(&s.mu);
        ++s.counter;
      } else {
        while (!s.mu.TryLock()) {
        }
        ++s.counter;
        s.mu.Unlock();
      }
    }
  };
  std::thread a(writer), b(writer);
  auto reader = [&s] {
    for (int i = 0; i < kRounds; ++i) {
      if (i % 2 == 0) {
        absl::ReaderMutexLock lock(&s.mu);
        Use(s.counter);
      } else if (s.mu.ReaderTryLock()) {
        Use(s.counter);
        s.mu.ReaderUnlock();
      }
    }
  };
  std::thread c(reader), d(reader);
  a.join(), b.join(), c.join(), d.join();
}

// A value handed over through Await, LockWhen, the timed variants and
// CondVar waits (plain data, written by one thread and read by the other).
void Handovers(Shared& s) {
  std::vector<int> payload;
  auto publish = [&] {
    absl::MutexLock lock(&s.mu);
    payload.push_back(static_cast<int>(payload.size()));
    s.ready = true;
    s.changed.Signal();
  };
  auto take = [&s, &payload] {
    Use(payload.back());
    s.ready = false;
  };
  for (int round = 0; round < 7; ++round) {
    std::thread consumer([&s, round, &take] {
      const absl::Condition ready(&s.ready);
      switch (round) {
        case 0:
          s.mu.Lock();
          s.mu.Await(ready);
          break;
        case 1:
          s.mu.LockWhen(ready);
          break;
        case 2:
          s.mu.Lock();
          while (!s.mu.AwaitWithTimeout(ready, absl::Milliseconds(1))) {
          }
          break;
        case 3:
          while (!s.mu.LockWhenWithDeadline(ready, absl::Now() + absl::Milliseconds(1))) {
            s.mu.Unlock();
          }
          break;
        case 4:
          s.mu.Lock();
          while (!s.ready) s.changed.Wait(&s.mu);
          break;
        case 5:
          s.mu.Lock();
          while (!s.ready) s.changed.WaitWithTimeout(&s.mu, absl::Milliseconds(1));
          break;
        default:
          s.mu.ReaderLockWhen(ready);
          Use(s.counter);
          s.mu.ReaderUnlock();
          s.mu.Lock();
          break;
      }
      take();
      s.mu.Unlock();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    publish();
    consumer.join();
  }
}

// A value published with Notify and read after WaitForNotification or once
// HasBeenNotified is true.
void Notifications() {
  for (int round = 0; round < 3; ++round) {
    int value = 0;
    absl::Notification done;
    std::thread consumer([&] {
      if (round == 0) {
        done.WaitForNotification();
      } else if (round == 1) {
        while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
        }
      } else {
        while (!done.HasBeenNotified()) {
        }
      }
      Use(value);
    });
    value = 1;
    done.Notify();
    consumer.join();
  }
}

// A real race: each thread holds a mutex of its own.
void Race() {
  absl::Mutex first, second;
  long counter = 0;
  std::thread a([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&first);
      ++counter;
    }
  });
  std::thread b([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&second);
      ++counter;
    }
  });
  a.join(), b.join();
  Use(counter);
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "clean") == 0) {
    Shared shared;
    LockAndTryLock(shared);
    Handovers(shared);
    Notifications();
  } else if (std::strcmp(mode, "race") == 0) {
    Race();
  } else {
    std::fprintf(stderr, "usage: %s clean|race\n", argv[0]);
    return 2;
  }
  return 0;
}
