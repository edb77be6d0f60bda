// What the take-over tests share: their daemons' options and one take-over
// (a successor started beside the serving daemon, which then exits).
#ifndef ACTSTASH_TESTS_INTEGRATION_TAKEOVER_UTIL_H_
#define ACTSTASH_TESTS_INTEGRATION_TAKEOVER_UTIL_H_

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "testing/daemon_process.h"

namespace actstash::testing {

inline constexpr const char* kPool = "256MiB";
inline constexpr const char* kSegment = "4MiB";
inline constexpr uint64_t kSegmentBytes = 4 << 20;

inline DaemonProcessOptions Options(const std::string& socket_path = "",
                                    std::vector<std::string> extra_args = {}) {
  DaemonProcessOptions options;
  options.pool_size = kPool;
  options.segment_size = kSegment;
  options.socket_path = socket_path;
  options.extra_args = std::move(extra_args);
  return options;
}

inline bool LogHas(const DaemonProcess& daemon, const std::string& text) {
  return daemon.log().find(text) != std::string::npos;
}

// The daemons that handed over: kept until the test ends, since the first
// one's temporary folder holds the sockets every successor serves.
inline std::vector<std::unique_ptr<DaemonProcess>>& Retired() {
  static auto* retired = new std::vector<std::unique_ptr<DaemonProcess>>();
  return *retired;
}

// Starts a successor of `serving` (Options plus `extra_args` and
// --take-over) and waits until it took over and the serving daemon exited
// (0). Null on failure, with both logs in the failure.
inline std::unique_ptr<DaemonProcess> TakeOver(std::unique_ptr<DaemonProcess> serving,
                                               std::vector<std::string> extra_args = {}) {
  Retired().push_back(std::move(serving));
  DaemonProcess* const retiring = Retired().back().get();
  extra_args.push_back("--take-over");
  DaemonProcessOptions options = Options(retiring->socket_path(), std::move(extra_args));
  absl::StatusOr<std::unique_ptr<DaemonProcess>> successor = DaemonProcess::Start(options);
  if (!successor.ok()) {
    ADD_FAILURE() << successor.status() << "\nserving:\n" << retiring->log();
    return nullptr;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!LogHas(**successor, "took over") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(LogHas(**successor, "took over")) << (*successor)->log();
  absl::StatusOr<int> code = retiring->Stop(SIGTERM, std::chrono::seconds(30));
  EXPECT_TRUE(code.ok() && *code == 0) << code.status() << retiring->log();
  EXPECT_TRUE(LogHas(*retiring, "handed over; exiting")) << retiring->log();
  return *std::move(successor);
}

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTS_INTEGRATION_TAKEOVER_UTIL_H_
