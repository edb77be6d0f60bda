#include "common/address.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/protocol.h"

namespace actstash {

std::string DefaultSocketPath() {
  if (geteuid() == 0) return "/run/actstash/actstash.sock";
  const char* runtime_dir = std::getenv("XDG_RUNTIME_DIR");
  if (runtime_dir != nullptr && runtime_dir[0] == '/') {
    return absl::StrCat(runtime_dir, "/actstash/actstash.sock");
  }
  return absl::StrCat("/tmp/actstash-", geteuid(), "/actstash.sock");
}

std::string ToGrpcTarget(absl::string_view address) {
  if (absl::StartsWith(address, "unix:")) return std::string(address);
  if (absl::StartsWith(address, "/")) return absl::StrCat("unix://", address);
  if (absl::StartsWith(address, ".")) return absl::StrCat("unix:", address);
  return std::string(address);
}

std::string ResolveClientAddress(absl::string_view explicit_address) {
  if (!explicit_address.empty()) return ToGrpcTarget(explicit_address);
  const char* from_env = std::getenv(kAddressEnv);
  if (from_env != nullptr && from_env[0] != '\0') return ToGrpcTarget(from_env);
  return ToGrpcTarget(DefaultSocketPath());
}

std::string UnixSocketPath(absl::string_view grpc_target) {
  if (absl::ConsumePrefix(&grpc_target, "unix://")) return std::string(grpc_target);
  if (absl::ConsumePrefix(&grpc_target, "unix:")) return std::string(grpc_target);
  return "";
}

}  // namespace actstash
