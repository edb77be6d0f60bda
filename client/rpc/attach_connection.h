// AttachConnection: the client's end of the attach socket (see
// common/attach_wire.h). Presents the session token, then receives the
// memfds of the session's leases. Its closing is how the daemon learns the
// client is gone, and how the client learns the daemon is.
#ifndef ACTSTASH_CLIENT_RPC_ATTACH_CONNECTION_H_
#define ACTSTASH_CLIENT_RPC_ATTACH_CONNECTION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace actstash::client_internal {

// ReceiveLease is called by one thread at a time (the caller serializes
// leasing); lost() from any thread. A watcher thread notices the daemon
// closing the connection without reading from it.
class AttachConnection {
 public:
  // Connects to `socket_path` and attaches the session of `token`.
  // UNAVAILABLE when nothing listens there; the daemon's refusal (wrong
  // token, uid not allowed, already attached) with its code and message.
  static absl::StatusOr<std::unique_ptr<AttachConnection>> Connect(
      const std::string& socket_path, const std::string& token, std::chrono::milliseconds timeout);
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
                                                     std::vector<uint64_t>* stale);
  // Hangs up (the daemon then reclaims the session); lost() turns true.
  // The object stays usable for lost() and destruction.
  void Shutdown();

  // True once the watcher saw the daemon close the connection (it exited or
  // restarted). Cheap (an atomic load), for hot paths; it may lag the
  // daemon's exit by a scheduling delay.
  bool lost() const { return lost_.load(std::memory_order_acquire); }
  // Looks at the connection itself, waiting up to `wait` for a hang-up: true
  // if the daemon has closed it (lost() then stays true). For error paths: a
  // failed RPC calls it to tell a daemon that went away (the kernel closed
  // both of its sockets) from one that is slow or briefly unreachable, with
  // no race against the watcher thread. Any thread.
  bool ConfirmLost(std::chrono::milliseconds wait);
  uint64_t session_id() const { return session_id_; }

 private:
  AttachConnection(UniqueFd fd, uint64_t session_id, UniqueFd wake_fd);
  void Watch();

  const UniqueFd fd_;
  const uint64_t session_id_;
  const UniqueFd wake_fd_;  // eventfd that stops the watcher
  std::atomic<bool> lost_{false};
  std::thread watcher_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_ATTACH_CONNECTION_H_
