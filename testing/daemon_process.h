// DaemonProcess: a real actstashd child process on a private socket, for
// integration tests and benchmarks.
#ifndef ACTSTASH_TESTING_DAEMON_PROCESS_H_
#define ACTSTASH_TESTING_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "testing/fd_store.h"

namespace actstash::testing {

struct DaemonProcessOptions {
  std::string pool_size = "256MiB";
  std::string segment_size = "64MiB";
  std::vector<std::string> extra_args;  // more actstashd flags
  // Empty: a socket in a fresh temporary directory owned by the process.
  std::string socket_path;
  // Run actstashd with extra_args only (none of the flags above), to test its
  // defaults; socket_path must then name where it will listen.
  bool bare = false;
  // How long Start waits for SERVING. A bare daemon commits (and pins) a
  // pool of a quarter of RAM first, which takes far longer on a loaded host.
  std::chrono::seconds ready_timeout{30};
  // A cgroup.procs file the child writes its pid into before it becomes
  // actstashd (tests of a container's memory limit); empty: none.
  std::string cgroup_procs;
  // Run it as a service manager with a file-descriptor store would
  // (testing/fd_store.h): NOTIFY_SOCKET set, and what it kept passed back
  // (LISTEN_FDS) at every Restart, as after a crash.
  bool supervised = false;
};

// Not thread-safe: one thread starts, stops and restarts it. The child is
// SIGKILLed on destruction if still running; its log stays readable until
// then.
class DaemonProcess {
 public:
  // Starts actstashd and waits (up to options.ready_timeout) until its
  // health service says SERVING. Fails with the daemon's log when it exits
  // or never gets ready.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(DaemonProcessOptions options = {});
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Sends `signal` and waits for the exit; returns the exit code (or
  // 128+signal when killed by a signal). DEADLINE_EXCEEDED if it does not
  // exit within `timeout` (then it is SIGKILLed).
  absl::StatusOr<int> Stop(int signal = 15,
                           std::chrono::milliseconds timeout = std::chrono::seconds(10));
  // Starts a new daemon process on the same socket with the same options.
  absl::Status Restart();

  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  const std::string& socket_path() const { return socket_path_; }
  std::string address() const { return "unix://" + socket_path_; }
  std::string log() const;  // everything the daemon(s) wrote so far
  // The fd store of a supervised daemon (null otherwise).
  FdStore* fd_store() const { return fd_store_.get(); }

 private:
  explicit DaemonProcess(DaemonProcessOptions options) : options_(std::move(options)) {}
  absl::Status Launch();

  DaemonProcessOptions options_;
  std::string temp_dir_;
  std::string socket_path_;
  std::string log_path_;
  pid_t pid_ = -1;
  std::unique_ptr<FdStore> fd_store_;
};

// Path of the actstashd binary: $ACTSTASH_DAEMON_BINARY, else the one built
// with the tests, found from the running binary (testing/built_binary.h).
std::string DaemonBinaryPath();

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTING_DAEMON_PROCESS_H_
