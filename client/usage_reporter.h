// UsageReporter: the thread that tells the daemon what this client placed in
// its leases (ReportUsage), so that the daemon's stats, its fair share under
// pool pressure and its count of copying sessions see the zero-copy side,
// which it never touches. Private to the client library.
#ifndef ACTSTASH_CLIENT_USAGE_REPORTER_H_
#define ACTSTASH_CLIENT_USAGE_REPORTER_H_

#include <chrono>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "actstash/v1/stash.pb.h"

namespace actstash::client_internal {

// Every `interval`, reads the usage and sends it when its stores, fetches or
// live objects changed since the last send (an idle trainer sends nothing).
// `read` and `send` run on the reporter's thread; `send` owns its errors (a
// daemon that went away is the next RPC's to report). Start and Stop are
// called by the owner, from one thread at a time; Stop joins, so the
// callbacks never run after it returns (nor after destruction, which stops).
class UsageReporter {
 public:
  using Read = std::function<v1::ClientUsage()>;
  using Send = std::function<void(const v1::ClientUsage&)>;

  UsageReporter(std::chrono::milliseconds interval, Read read, Send send);
  ~UsageReporter();
  UsageReporter(const UsageReporter&) = delete;
  UsageReporter& operator=(const UsageReporter&) = delete;

  // Starts the thread (once; later calls do nothing).
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends and joins the thread. Idempotent; a stopped reporter stays stopped.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const std::chrono::milliseconds interval_;
  const Read read_;
  const Send send_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started and joined by the owner's thread only
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_USAGE_REPORTER_H_
