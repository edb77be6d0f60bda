// Where the daemon listens and how clients name it.
#ifndef ACTSTASH_COMMON_ADDRESS_H_
#define ACTSTASH_COMMON_ADDRESS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace actstash {

// The default socket path: /run/actstash/actstash.sock for root, else
// $XDG_RUNTIME_DIR/actstash/actstash.sock, else /tmp/actstash-<uid>/actstash.sock.
std::string DefaultSocketPath();

// Turns what a user wrote into a gRPC target: "unix:///abs/path" and
// "unix:rel" are kept, a string starting with '/' or '.' becomes a unix
// target, anything else ("host:port") is kept as a TCP target.
std::string ToGrpcTarget(absl::string_view address);

// The client's address: `explicit_address` when not empty, else the
// ACTSTASH_ADDRESS environment variable, else the default socket.
std::string ResolveClientAddress(absl::string_view explicit_address);

// The socket path of a unix target ("unix:///a/b" -> "/a/b"); empty for TCP.
std::string UnixSocketPath(absl::string_view grpc_target);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_ADDRESS_H_
