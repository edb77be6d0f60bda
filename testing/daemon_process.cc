#include "testing/daemon_process.h"

#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "actstash/client.h"
#include "common/unique_fd.h"
#include "testing/built_binary.h"

extern "C" char** environ;  // NOLINT

namespace actstash::testing {

std::string DaemonBinaryPath() {
  return BuiltBinary("ACTSTASH_DAEMON_BINARY", ACTSTASH_DAEMON_RELPATH);
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(DaemonProcessOptions options) {
  std::unique_ptr<DaemonProcess> daemon(new DaemonProcess(std::move(options)));
  char dir_template[] = "/tmp/actstash-test-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  daemon->temp_dir_ = dir_template;
  daemon->socket_path_ = daemon->options_.socket_path.empty() ? daemon->temp_dir_ + "/actstash.sock"
                                                              : daemon->options_.socket_path;
  daemon->log_path_ = daemon->temp_dir_ + "/actstashd.log";
  if (daemon->options_.supervised) {
    absl::StatusOr<std::unique_ptr<FdStore>> store = FdStore::Create();
    if (!store.ok()) return store.status();
    daemon->fd_store_ = *std::move(store);
  }
  if (absl::Status s = daemon->Launch(); !s.ok()) return s;
  return daemon;
}

absl::Status DaemonProcess::Launch() {
  std::vector<std::string> args = {DaemonBinaryPath(),    "--socket",         socket_path_,
                                   "--pool-size",         options_.pool_size, "--segment-size",
                                   options_.segment_size, "--log-level",      "debug"};
  // A test binary that crashes or is killed (a timeout) takes its daemon with
  // it rather than leaving it running beside the next tests.
  args.push_back("--exit-with-parent");
  if (options_.bare) args.resize(1);
  args.insert(args.end(), options_.extra_args.begin(), options_.extra_args.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const size_t log_start = log().size();  // Restart appends to the same log
  UniqueFd log_fd(open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!log_fd.valid()) {
    return absl::InternalError(absl::StrCat("open log: ", std::strerror(errno)));
  }
  // A supervised daemon's environment: NOTIFY_SOCKET, and the kept fds as a
  // service manager passes them (LISTEN_PID is filled in by the child).
  std::vector<std::pair<std::string, UniqueFd>> kept;
  std::vector<std::string> env;
  char listen_pid[32] = "LISTEN_PID=";
  if (fd_store_ != nullptr) {
    kept = fd_store_->Snapshot();
    for (char** e = environ; *e != nullptr; ++e) {
      if (!absl::StartsWith(*e, "NOTIFY_SOCKET=") && !absl::StartsWith(*e, "LISTEN_")) {
        env.push_back(*e);
      }
    }
    env.push_back("NOTIFY_SOCKET=" + fd_store_->address());
    if (!kept.empty()) {
      env.push_back(absl::StrCat("LISTEN_FDS=", kept.size()));
      std::string names = "LISTEN_FDNAMES=";
      for (size_t i = 0; i < kept.size(); ++i) absl::StrAppend(&names, i ? ":" : "", kept[i].first);
      env.push_back(names);
    }
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  if (!kept.empty()) envp.push_back(listen_pid);
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    dup2(log_fd.get(), STDOUT_FILENO);
    dup2(log_fd.get(), STDERR_FILENO);
    if (!kept.empty()) {
      // To 3, 4, ...: first out of the way, then in place (async-signal-safe).
      std::vector<int> high;
      for (auto& [name, fd] : kept) high.push_back(fcntl(fd.get(), F_DUPFD, 1000));
      for (size_t i = 0; i < high.size(); ++i) {
        dup2(high[i], 3 + static_cast<int>(i));
        close(high[i]);
      }
      std::snprintf(listen_pid + 11, sizeof(listen_pid) - 11, "%d", static_cast<int>(getpid()));
    }
    if (!options_.cgroup_procs.empty()) {
      // Only async-signal-safe calls between fork and exec.
      const int procs = open(options_.cgroup_procs.c_str(), O_WRONLY | O_CLOEXEC);
      char digits[16];
      const int n = std::snprintf(digits, sizeof(digits), "%d", static_cast<int>(getpid()));
      if (procs < 0 || write(procs, digits, static_cast<size_t>(n)) != n) {
        std::fprintf(stderr, "cannot join the cgroup %s: %s\n", options_.cgroup_procs.c_str(),
                     std::strerror(errno));
        _exit(126);
      }
      close(procs);
    }
    if (fd_store_ != nullptr) {
      execve(argv[0], argv.data(), envp.data());
    } else {
      execv(argv[0], argv.data());
    }
    std::fprintf(stderr, "execv %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  log_fd.Reset();
  pid_ = pid;
  const auto deadline = std::chrono::steady_clock::now() + options_.ready_timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::FailedPreconditionError(
          absl::StrCat("actstashd exited during start-up; its log:\n", log()));
    }
    // Another daemon may already answer on the socket (tests of exactly
    // that), so readiness is this child's own "ready" line, then a ping.
    if (log().find("] ready", log_start) != std::string::npos) {
      absl::StatusOr<PingResult> ping = Ping(address(), std::chrono::milliseconds(200));
      if (ping.ok() && ping->serving) return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  (void)Stop(SIGKILL);
  return absl::DeadlineExceededError(absl::StrCat("actstashd did not become ready in ",
                                                  options_.ready_timeout.count(), " s; its log:\n",
                                                  log()));
}

absl::StatusOr<int> DaemonProcess::Stop(int signal, std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("actstashd is not running");
  kill(pid_, signal);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      pid_ = -1;
      return absl::DeadlineExceededError("actstashd did not exit in time; killed it");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  pid_ = -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

absl::Status DaemonProcess::Restart() {
  if (running()) {
    absl::StatusOr<int> code = Stop();
    if (!code.ok()) return code.status();
  }
  return Launch();
}

std::string DaemonProcess::log() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) (void)Stop(SIGKILL);
  // nftw, not std::filesystem::remove_all: a test that links libtorch from
  // PyPI gets that libtorch's exported copy of std::filesystem, which crashes
  // (found running the adapter's tests against torch 2.11.0).
  if (!temp_dir_.empty()) {
    (void)nftw(
        temp_dir_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return remove(path); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
}

}  // namespace actstash::testing
