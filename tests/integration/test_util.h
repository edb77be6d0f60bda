// Helpers shared by the integration tests.
#ifndef ACTSTASH_TESTS_INTEGRATION_TEST_UTIL_H_
#define ACTSTASH_TESTS_INTEGRATION_TEST_UTIL_H_

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "actstash/client.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "actstash/v1/stash.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
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

// Buffers a test stored with their tickets, to fetch back after the daemon
// was replaced or restarted.
using StoredBuffers = std::vector<std::pair<Ticket, std::vector<std::byte>>>;

// Stores 1 MiB + seed * 4 KiB of random bytes through `client`.
inline void StoreRandom(Client& client, uint64_t seed, StoredBuffers* stored) {
  std::vector<std::byte> bytes = RandomBytes((1 << 20) + seed * 4096, seed);
  absl::StatusOr<Ticket> ticket = client.Store(bytes.data(), bytes.size());
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  stored->emplace_back(*ticket, std::move(bytes));
}

// Every stored buffer comes back as it was.
inline void ExpectFetched(Client& client, const StoredBuffers& stored) {
  for (const auto& [ticket, bytes] : stored) {
    std::vector<std::byte> back(bytes.size());
    ASSERT_TRUE(client.Fetch(ticket, back.data(), back.size()).ok());
    ASSERT_TRUE(back == bytes);
  }
}

// A fresh folder under the temporary directory (a spill dir).
inline std::string MakeTempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "actstash-spill-XXXXXX").string();
  const char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return pattern;
}

// The daemon's open spill files: /proc/<pid>/fd links into `dir`.
inline std::vector<std::string> SpillFds(pid_t pid, const std::string& dir) {
  std::vector<std::string> fds;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& entry : std::filesystem::directory_iterator(fd_dir)) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && target.rfind(dir + "/", 0) == 0) fds.push_back(entry.path().string());
  }
  return fds;
}

inline std::unique_ptr<DaemonProcess> StartDaemonOrDie(DaemonProcessOptions options = {}) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> daemon = DaemonProcess::Start(options);
  EXPECT_TRUE(daemon.ok()) << daemon.status();
  return daemon.ok() ? *std::move(daemon) : nullptr;
}

// A session opened over a raw gRPC stub, for the calls and messages the
// Client API never makes; `token` goes in each call's x-actstash-token.
struct RawStub {
  std::unique_ptr<v1::Stash::Stub> stub;
  std::string token;  // empty when OpenSession failed (the test failed too)
};

inline RawStub OpenRawSession(const DaemonProcess& daemon) {
  RawStub raw;
  raw.stub =
      v1::Stash::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::OpenSessionReply reply;
  grpc::Status status = raw.stub->OpenSession(&ctx, v1::OpenSessionRequest(), &reply);
  EXPECT_TRUE(status.ok()) << status.error_message();
  raw.token = reply.token();
  return raw;
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
