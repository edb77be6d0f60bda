#include "tools/cli_common.h"

#include <cstdio>

namespace actstash::cli {

bool ReadFile(const std::string& path, std::string* out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) out->append(buffer, n);
  std::fclose(f);
  return true;
}

absl::StatusOr<std::unique_ptr<Client>> ConnectCli(const Common& common, uint64_t quota,
                                                   bool attach) {
  ClientOptions options = common.tls;
  options.attach = attach ? AttachMode::kAuto : AttachMode::kOff;
  options.address = common.address;
  options.client_name = "actstash-cli";
  options.connect_timeout = common.timeout;
  options.rpc_timeout = common.timeout;
  options.quota_bytes = quota;
  return Client::Connect(options);
}

}  // namespace actstash::cli
