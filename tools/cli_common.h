// What the actstash CLI's subcommands share: the global flags, the exit
// codes and the connection. Used from the CLI's main thread only.
#ifndef ACTSTASH_TOOLS_CLI_COMMON_H_
#define ACTSTASH_TOOLS_CLI_COMMON_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "actstash/client.h"

namespace actstash::cli {

// Exit codes: 0 success; 1 the daemon could not be reached or refused the
// request (or, for verify, gave back other bytes than it was given); 2 usage
// error; 3 the daemon answered but is not serving.
constexpr int kExitUnavailable = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNotServing = 3;

// Global flags shared by the subcommands.
struct Common {
  std::string address;
  std::chrono::milliseconds timeout{5000};
  ClientOptions tls;  // only the tls_* fields
};

// Appends the file's bytes to *out; false when it cannot be read.
bool ReadFile(const std::string& path, std::string* out);

// A session of the CLI ("actstash-cli"); quota 0 takes the daemon's default.
absl::StatusOr<std::unique_ptr<Client>> ConnectCli(const Common& common, uint64_t quota,
                                                   bool attach);

}  // namespace actstash::cli

#endif  // ACTSTASH_TOOLS_CLI_COMMON_H_
