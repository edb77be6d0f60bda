// The service manager's two protocols, as systemd defines them (and small
// supervisors implement them too):
//
// - notify: datagrams of "KEY=VALUE\n" lines to the unix socket named by
//   $NOTIFY_SOCKET (a path, or "@name" in the abstract namespace).
//   READY=1 says the service serves; FDSTORE=1 with FDNAME=<name> and fds
//   (SCM_RIGHTS) asks the manager to keep those fds for the service's next
//   start; FDSTOREREMOVE=1 with FDNAME=<name> drops the kept fds of a name;
//   MAINPID=<pid> makes another process of the service its main one (a
//   take-over's successor); BARRIER=1 with one fd: the manager closes it
//   once it has handled what came before.
// - passed fds: at start, $LISTEN_FDS fds from fd 3 on, named by
//   $LISTEN_FDNAMES (colon-separated), meant for the process $LISTEN_PID.
//
// The daemon keeps its pool's memfds and its state table there, so that a
// restart after a crash finds the memory clients still map
// (server/daemon/daemon_recovery.cc).
#ifndef ACTSTASH_SERVER_RESTART_SERVICE_MANAGER_H_
#define ACTSTASH_SERVER_RESTART_SERVICE_MANAGER_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"

namespace actstash::server {

// A connection to $NOTIFY_SOCKET. Thread-safe: each call is one datagram.
class ServiceNotifier {
 public:
  // The notifier of $NOTIFY_SOCKET; null when the variable is unset (no
  // service manager listens). INVALID_ARGUMENT for a malformed value,
  // INTERNAL when no socket can be made.
  static absl::StatusOr<std::unique_ptr<ServiceNotifier>> FromEnvironment();
  // A notifier of the socket at `address` (same syntax as $NOTIFY_SOCKET).
  static absl::StatusOr<std::unique_ptr<ServiceNotifier>> ForAddress(absl::string_view address);

  // Sends `text` (newline-separated assignments) with `fds`. UNAVAILABLE
  // when the manager is gone, refuses, or has not read for 5 s, with the
  // errno text.
  absl::Status Notify(absl::string_view text, absl::Span<const int> fds = {}) const;
  // FDSTORE=1, FDNAME=`name` with `fd` (the manager keeps a duplicate).
  absl::Status StoreFd(absl::string_view name, int fd) const;
  // FDSTOREREMOVE=1, FDNAME=`name`.
  absl::Status RemoveFds(absl::string_view name) const;
  // BARRIER=1 (sd_notify_barrier): returns once the manager has handled
  // every notification sent before, e.g. a MAINPID= that must be in effect
  // before this process exits. DEADLINE_EXCEEDED after `timeout`.
  absl::Status Barrier(std::chrono::milliseconds timeout) const;

  const std::string& address() const { return address_; }

 private:
  ServiceNotifier(std::string address, UniqueFd socket)
      : address_(std::move(address)), socket_(std::move(socket)) {}
  const std::string address_;
  const UniqueFd socket_;
};

// Whether `name` may name stored fds: 1..255 printable ASCII characters
// without ':' (systemd's rule).
bool IsValidFdName(absl::string_view name);

struct PassedFd {
  std::string name;  // "unknown" where LISTEN_FDNAMES names none
  UniqueFd fd;
};

// Takes the fds passed to this process at start ($LISTEN_FDS from fd 3,
// names from $LISTEN_FDNAMES) when $LISTEN_PID is this process's pid, marks
// them close-on-exec and unsets the three variables (so that no child sees
// them). Empty when none were passed; INVALID_ARGUMENT for malformed values.
absl::StatusOr<std::vector<PassedFd>> TakePassedFds();

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RESTART_SERVICE_MANAGER_H_
