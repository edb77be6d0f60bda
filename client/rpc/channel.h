// The client's gRPC channel and the wording of its RPC errors. Private.
#ifndef ACTSTASH_CLIENT_RPC_CHANNEL_H_
#define ACTSTASH_CLIENT_RPC_CHANNEL_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "actstash/client.h"

namespace actstash::client_internal {

// A channel to `target` with the project's message limits, quick reconnect
// backoff, and TLS when `options.tls_root_certs` is set. Thread-safe.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const ClientOptions& options);

// The Status of a failed call `what`, with what a user needs to act on it:
// where the daemon was expected and how to start it (UNAVAILABLE), or which
// deadline passed (DEADLINE_EXCEEDED).
absl::Status AnnotateRpcError(const grpc::Status& status, const std::string& target,
                              const char* what, std::chrono::milliseconds deadline);

// The one error an attached client gives once the daemon at `target` went
// away (its attach connection closed: it exited, was killed or restarted),
// however the client noticed (the watcher, or an RPC that failed first):
// UNAVAILABLE, "<what>: actstashd at <target> went away ...: <consequence>",
// and how to start it again. `detail`, when known, says how (e.g. it
// restarted and lost its state).
absl::Status DaemonWentAway(const std::string& target, absl::string_view what,
                            absl::string_view consequence, absl::string_view detail = "");

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_CHANNEL_H_
