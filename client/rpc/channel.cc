#include "client/rpc/channel.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "common/address.h"
#include "common/grpc_status.h"
#include "common/protocol.h"

namespace actstash::client_internal {
namespace {

std::shared_ptr<grpc::ChannelCredentials> Credentials(const ClientOptions& options) {
  if (options.tls_root_certs.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls_root_certs;
  ssl.pem_cert_chain = options.tls_cert_chain;
  ssl.pem_private_key = options.tls_private_key;
  return grpc::SslCredentials(ssl);
}

// How to get a daemon at `target` running, for error messages.
std::string HowToStart(const std::string& target) {
  const std::string path = UnixSocketPath(target);
  return path.empty() ? "Is it running and listening there?"
                      : absl::StrCat("Is it running? Start it with `actstashd --socket ", path,
                                     "`, or set ", kAddressEnv, " to its socket.");
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect quickly after a daemon restart instead of gRPC's default
  // backoff of up to two minutes. GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is left
  // at its default: gRPC uses it as the minimum time one connection attempt
  // may take (SETTINGS frame included), and a short one made a busy or
  // briefly stopped daemon look unreachable long before the caller's
  // deadline. A daemon that is not there at all still fails at once (the
  // socket refuses), and every call is bounded by its own deadline.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(target, Credentials(options), args);
}

absl::Status DaemonWentAway(const std::string& target, absl::string_view what,
                            absl::string_view consequence, absl::string_view detail) {
  const std::string path = UnixSocketPath(target);
  return absl::UnavailableError(absl::StrCat(
      what, ": actstashd at ", target, " went away (",
      detail.empty() ? "its attach connection closed: it exited, was killed or restarted" : detail,
      "): ", consequence, ". Connect a new client once it runs again",
      path.empty() ? "." : absl::StrCat(" (`actstashd --socket ", path, "`).")));
}

// Adds what a user needs to act on an error: where the daemon was expected
// and how to start it, or which deadline passed.
absl::Status AnnotateRpcError(const grpc::Status& status, const std::string& target,
                              const char* what, std::chrono::milliseconds deadline) {
  absl::Status s = FromGrpcStatus(status);
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return s;
    case absl::StatusCode::kUnavailable:
      return absl::UnavailableError(absl::StrCat(what, ": actstashd is not reachable at ", target,
                                                 " (", s.message(), "). ", HowToStart(target)));
    case absl::StatusCode::kDeadlineExceeded:
      return absl::DeadlineExceededError(absl::StrCat(what, ": no answer from actstashd at ",
                                                      target, " within ", deadline.count(), " ms (",
                                                      s.message(), ")"));
    default:
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }
}

}  // namespace actstash::client_internal
