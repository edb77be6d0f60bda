// Threads of their own for a client's background jobs, each started by its
// first use and stopped (joined) by its owner: SerialWorker runs queued tasks
// one at a time (the store's read-back ahead of need), PeriodicWorker runs a
// tick every period (the store's sweep of retained leases, the client's usage
// reports). The owner's data
// stays the owner's: a task locks what it touches itself.
//
// Thread-safety: every method may be called from any thread, concurrently,
// also while the caller holds its own locks (a worker takes only its own
// mutex there, and runs tasks with it released), except Stop, which waits
// for a running task: never call it from a task, or holding a lock a task
// takes.
#ifndef ACTSTASH_CLIENT_STORE_BACKGROUND_WORKER_H_
#define ACTSTASH_CLIENT_STORE_BACKGROUND_WORKER_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace actstash::client_internal {

class SerialWorker {
 public:
  SerialWorker() = default;
  ~SerialWorker() { Stop(); }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  // Queues `task` to run after those queued before it; the first Post starts
  // the thread. Dropped after Stop.
  void Post(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the queued tasks, waits for the running one and joins the thread.
  // Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

class PeriodicWorker {
 public:
  // `tick` runs `period` after Start, and every `period` after the previous
  // tick ended, until Stop.
  PeriodicWorker(absl::Duration period, std::function<void()> tick)
      : period_(period), tick_(std::move(tick)) {}
  ~PeriodicWorker() { Stop(); }
  PeriodicWorker(const PeriodicWorker&) = delete;
  PeriodicWorker& operator=(const PeriodicWorker&) = delete;

  // Starts the thread; nothing when it runs already, or after Stop.
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes the thread from its wait, waits for a running tick and joins.
  // Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration period_;
  const std::function<void()> tick_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_BACKGROUND_WORKER_H_
