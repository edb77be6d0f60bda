// Connecting to a Unix stream socket by path: the daemon's stale-socket probe
// and the client's attach channel share it.
//
// Thread-safety: a free function; the fd it returns is the caller's.
#ifndef ACTSTASH_COMMON_UNIX_SOCKET_H_
#define ACTSTASH_COMMON_UNIX_SOCKET_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace actstash {

// A connected SOCK_STREAM|SOCK_CLOEXEC socket to `path`. INVALID_ARGUMENT when
// the path does not fit a sockaddr_un, INTERNAL when no socket can be made,
// UNAVAILABLE (with the path and strerror) when nothing accepts at `path`.
// With `wait_for_room` false the connect does not wait while the listener's
// backlog is full (a daemon that is down but whose listening socket a
// service manager keeps): UNAVAILABLE then. The socket returned blocks
// either way.
absl::StatusOr<UniqueFd> ConnectUnixSocket(const std::string& path, bool wait_for_room = true);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_UNIX_SOCKET_H_
