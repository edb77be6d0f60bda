// WorkQueue: one background thread running posted tasks in order. For work
// that must not run on gRPC or attach I/O threads (scrubbing leased memory).
#ifndef ACTSTASH_SERVER_BASE_WORK_QUEUE_H_
#define ACTSTASH_SERVER_BASE_WORK_QUEUE_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace actstash::server {

// Post() may be called from any thread; Stop() and the destructor from one
// (the owner's). A task posted once Stop() has begun runs on the posting
// thread instead; one posted after destruction began is undefined
// behaviour. So the owner stops the queue while everything its tasks use is
// alive, and the queue object itself may outlive those users.
class WorkQueue {
 public:
  WorkQueue();
  // Stops (see Stop).
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void Post(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs the tasks still queued, then joins the thread. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_BASE_WORK_QUEUE_H_
