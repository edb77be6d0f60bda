// UsageReporter: the thread that tells the daemon what this client placed in
// its leases (ReportUsage), so that the daemon's stats, its fair share under
// pool pressure and its count of copying sessions see the zero-copy side,
// which it never touches. Private to the client library.
#ifndef ACTSTASH_CLIENT_RPC_USAGE_REPORTER_H_
#define ACTSTASH_CLIENT_RPC_USAGE_REPORTER_H_

#include <chrono>
#include <cstdint>
#include <functional>

#include "actstash/v1/stash.pb.h"
#include "client/store/background_worker.h"

namespace actstash::client_internal {

// Every `interval`, reads the usage and sends it when its stores, fetches or
// live objects changed since the last send, or while it holds leases (the
// daemon's answer may ask for some back, for a session that waits: an idle
// trainer that holds nothing sends nothing). `read` and `send` run on the
// reporter's thread; `send` owns its errors (a daemon that went away is the
// next RPC's to report) and returns what the daemon asked back (0: nothing),
// which `give` (on the same thread) gives. Start and Stop are
// called by the owner, from one thread at a time; Stop joins, so the
// callbacks never run after it returns (nor after destruction, which stops).
class UsageReporter {
 public:
  using Read = std::function<v1::ClientUsage()>;
  using Send = std::function<uint64_t(const v1::ClientUsage&)>;
  using Give = std::function<void(uint64_t bytes)>;

  UsageReporter(std::chrono::milliseconds interval, Read read, Send send, Give give = nullptr);
  UsageReporter(const UsageReporter&) = delete;
  UsageReporter& operator=(const UsageReporter&) = delete;

  // Starts the thread (once; later calls do nothing).
  void Start() { worker_.Start(); }
  // Ends and joins the thread. Idempotent; a stopped reporter stays stopped.
  void Stop() { worker_.Stop(); }

 private:
  // One look at the usage; on the worker's thread only.
  void Tick();

  const Read read_;
  const Send send_;
  const Give give_;
  // What the last send said; touched by Tick only.
  uint64_t last_stores_ = 0;
  uint64_t last_fetches_ = 0;
  uint64_t last_objects_ = 0;
  uint64_t last_state_bytes_ = 0;
  PeriodicWorker worker_;  // last: destroyed (stopped, joined) before the rest
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_USAGE_REPORTER_H_
