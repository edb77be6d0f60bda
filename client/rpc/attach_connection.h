// AttachConnection: the client's end of the attach socket (see
// common/attach_wire.h). Presents the session token, then receives the
// memfds of the session's leases. Its closing is how the daemon learns the
// client is gone, and how the client learns the daemon is.
//
// A daemon that keeps its state across a crash (it says so when it welcomes
// the client: kWelcomeRecoverable) is attached again when the connection
// ends, with the same token, for up to `reattach_timeout`: the restarted
// daemon serves the session again with its leases (their memory, mapped
// here, never went away). Meanwhile the connection counts as alive but
// reattaching; it is lost when the socket file is gone (a clean stop), the
// restarted daemon does not know the session (its state was lost), or the
// time runs out.
#ifndef ACTSTASH_CLIENT_RPC_ATTACH_CONNECTION_H_
#define ACTSTASH_CLIENT_RPC_ATTACH_CONNECTION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"

namespace actstash::client_internal {

// ReceiveLease is called by one thread at a time (the caller serializes
// leasing); the rest from any thread. A watcher thread notices the daemon
// closing the connection without reading from it, and attaches again.
class AttachConnection {
 public:
  // Connects to `socket_path` and attaches the session of `token`.
  // UNAVAILABLE when nothing listens there; the daemon's refusal (wrong
  // token, uid not allowed, already attached) with its code and message.
  static absl::StatusOr<std::unique_ptr<AttachConnection>> Connect(
      const std::string& socket_path, const std::string& token, std::chrono::milliseconds timeout,
      std::chrono::milliseconds reattach_timeout = std::chrono::milliseconds(0));
  ~AttachConnection();
  AttachConnection(const AttachConnection&) = delete;
  AttachConnection& operator=(const AttachConnection&) = delete;

  // Receives the fds of lease `lease_id` (`segments` of them, in order; the
  // caller owns them). Messages of other leases (late ones of a Lease call
  // that timed out) are skipped, their fds closed and their ids appended to
  // `stale` (the caller returns them). INTERNAL if the daemon sends
  // something malformed.
  absl::StatusOr<std::vector<UniqueFd>> ReceiveLease(uint64_t lease_id, uint32_t segments,
                                                     std::chrono::milliseconds timeout,
                                                     std::vector<uint64_t>* stale)
      ABSL_LOCKS_EXCLUDED(fd_mu_);
  // Hangs up for good (the daemon then reclaims the session), an attach in
  // progress included; lost() turns true. The object stays usable for
  // lost() and destruction.
  void Shutdown() ABSL_LOCKS_EXCLUDED(swap_mu_);

  // True once the daemon is gone for good (see above). Cheap (an atomic
  // load), for hot paths; it may lag by a scheduling delay.
  bool lost() const { return lost_.load(std::memory_order_acquire); }
  // Whether the daemon is gone for good, waiting up to `wait` for a verdict:
  // for error paths, which must tell a daemon that went away (the kernel
  // closed both of its sockets) from one that is slow, briefly unreachable,
  // or restarting (false while attaching again). Any thread.
  bool ConfirmLost(std::chrono::milliseconds wait) ABSL_LOCKS_EXCLUDED(state_mu_, swap_mu_);
  // Why the session is gone once lost(), when known (e.g. the restarted
  // daemon lost its state); empty otherwise.
  std::string lost_detail() const ABSL_LOCKS_EXCLUDED(state_mu_);
  // Times the connection was made again after a restart.
  uint64_t reattaches() const { return reattaches_.load(std::memory_order_relaxed); }
  uint64_t session_id() const { return session_id_; }
  // The daemon keeps its state across a crash (it said so when attaching).
  bool recoverable() const { return recoverable_; }
  // Whether, once lost(), the daemon may free the memory of this session's
  // leases (it restarts with its state, and closes a session that does not
  // attach again). False when it stopped cleanly (its socket went away).
  bool daemon_may_reclaim() const {
    return recoverable_ && !stopped_cleanly_.load(std::memory_order_acquire);
  }

 private:
  enum class State { kAttached, kReattaching, kLost };

  AttachConnection(UniqueFd fd, uint64_t session_id, UniqueFd wake_fd, std::string socket_path,
                   std::string token, bool recoverable, std::chrono::milliseconds reattach_timeout);
  void Watch();
  // Attaches again until it works (true: the new fd is in place) or cannot
  // (false: lost, detail set).
  bool Reattach();
  void SetState(State state, std::string detail = "") ABSL_LOCKS_EXCLUDED(state_mu_);
  // Waits up to `wait` on the wake eventfd: false when woken (destruction).
  bool Sleep(std::chrono::milliseconds wait);

  mutable absl::Mutex fd_mu_;  // ReceiveLease's reads against the watcher's swap
  UniqueFd fd_ ABSL_GUARDED_BY(fd_mu_);
  // Held (briefly) to use the fd's number outside fd_mu_ (ConfirmLost's
  // duplicate, Shutdown), and by the watcher's swap, which closes the old fd.
  mutable absl::Mutex swap_mu_ ABSL_ACQUIRED_AFTER(fd_mu_);
  // The fd's number; the watcher, which alone replaces it, reads it freely.
  std::atomic<int> fd_number_;
  const uint64_t session_id_;
  const UniqueFd wake_fd_;  // eventfd that stops the watcher
  const std::string socket_path_;
  const std::string token_;
  const bool recoverable_;
  const std::chrono::milliseconds reattach_timeout_;
  std::atomic<bool> shutting_down_{false};
  std::atomic<bool> stopped_cleanly_{false};
  std::atomic<bool> lost_{false};
  std::atomic<uint64_t> reattaches_{0};
  mutable absl::Mutex state_mu_;
  State state_ ABSL_GUARDED_BY(state_mu_) = State::kAttached;
  std::string lost_detail_ ABSL_GUARDED_BY(state_mu_);
  std::thread watcher_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_ATTACH_CONNECTION_H_
