// Helpers shared by the integration tests.
#ifndef ACTSTASH_TESTS_INTEGRATION_TEST_UTIL_H_
#define ACTSTASH_TESTS_INTEGRATION_TEST_UTIL_H_

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "actstash/client.h"
#include "actstash/v1/stash.pb.h"
#include "testing/built_binary.h"
#include "testing/daemon_process.h"

namespace actstash::testing {

#ifdef ACTSTASH_CLI_RELPATH
// The actstash CLI built with the tests ($ACTSTASH_CLI_BINARY overrides).
inline std::string Cli() { return BuiltBinary("ACTSTASH_CLI_BINARY", ACTSTASH_CLI_RELPATH); }
#endif

inline std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::vector<std::byte> bytes(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < n; ++i) bytes[i] = static_cast<std::byte>(rng());
  return bytes;
}

inline std::unique_ptr<DaemonProcess> StartDaemonOrDie(DaemonProcessOptions options = {}) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> daemon = DaemonProcess::Start(options);
  EXPECT_TRUE(daemon.ok()) << daemon.status();
  return daemon.ok() ? *std::move(daemon) : nullptr;
}

inline std::unique_ptr<Client> ConnectOrDie(const DaemonProcess& daemon, uint64_t quota_bytes = 0,
                                            const std::string& name = "test") {
  ClientOptions options;
  options.address = daemon.address();
  options.quota_bytes = quota_bytes;
  options.client_name = name;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// The CLI's `stats --json` output read back with protobuf's JSON parser
// (which refuses anything that is not the message's JSON). `sessions --json`
// prints an array of SessionStats: pass `session_array` to read it as the
// reply's all_sessions.
inline v1::StatsReply ParseStatsJson(const std::string& json, bool session_array = false) {
  v1::StatsReply reply;
  const std::string text = session_array ? "{\"all_sessions\": " + json + "}" : json;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &reply);
  EXPECT_TRUE(status.ok()) << status.ToString() << " in: " << json;
  return reply;
}

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTS_INTEGRATION_TEST_UTIL_H_
