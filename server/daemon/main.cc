// actstashd: see `actstashd --help` and README.md.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mutex_mode.h"
#include "server/daemon/config.h"
#include "server/daemon/daemon.h"
#include "server/restart/successor.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace {

// A daemon that handed over with after_take_over = wait execs itself with
// --handed-over (daemon_handover.cc): it holds nothing (every fd but the
// standard ones closed) and exits 0 on SIGTERM or SIGINT, so that a
// supervisor that restarts exited processes leaves it be until it stops it.
int WaitHandedOver() {
  close_range(3, ~0U, 0);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::fprintf(stderr, "actstashd (pid %d): handed over to a successor; waiting for SIGTERM\n",
               static_cast<int>(getpid()));
  int received = 0;
  sigwait(&signals, &received);
  return 0;
}

// SIGUSR2: starts a successor (successor.h), one at a time; a successor
// that fails is reaped and logged, and this daemon serves on.
void StartSuccessor(actstash::server::Daemon* daemon, const absl::StatusOr<std::string>& binary,
                    const std::vector<std::string>& args, pid_t watched_parent,
                    bool wait_after_take_over) {
  static std::atomic<bool> running{false};
  if (getpid() == 1 && !wait_after_take_over) {
    spdlog::error(
        "SIGUSR2: actstashd is process 1 (a container's entrypoint), whose exit would end the "
        "successor with it: not upgrading in place (run it with --after-take-over wait)");
    return;
  }
  if (!binary.ok()) {
    spdlog::error("SIGUSR2: cannot start a successor: {}", binary.status().ToString());
    return;
  }
  if (running.exchange(true)) {
    spdlog::warn("SIGUSR2: a successor is starting already");
    return;
  }
  absl::StatusOr<pid_t> pid = actstash::server::SpawnSuccessor(*binary, args, watched_parent);
  if (!pid.ok()) {
    running = false;
    spdlog::error("SIGUSR2: {}; serving on", pid.status().ToString());
    return;
  }
  daemon->ExpectSuccessor(*pid);
  spdlog::info("SIGUSR2: started the successor {} (pid {}) to take over", *binary, *pid);
  std::thread([pid = *pid] {
    // Returns only when the take-over failed: this process exits otherwise.
    int status = 0;
    pid_t waited = -1;
    while ((waited = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    if (waited != pid) {
      spdlog::error("waiting for the successor (pid {}): {}", pid, std::strerror(errno));
      return;  // `running` stays set: no second successor beside one not known to be gone
    }
    spdlog::error("the successor (pid {}) {} {} before it took over; serving on", pid,
                  WIFSIGNALED(status) ? "was killed by signal" : "exited with status",
                  WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    running = false;
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == "--handed-over") return WaitHandedOver();
  actstash::ConfigureMutexes();
  actstash::server::CommandLine command_line = actstash::server::ParseCommandLine(argc, argv);
  if (command_line.exit_code.has_value()) return *command_line.exit_code;
  const actstash::server::DaemonConfig& config = command_line.config;
  // Found now: the path may name a new binary by the time a successor starts.
  const absl::StatusOr<std::string> binary = actstash::server::OwnExecutable(argv[0]);
  const std::vector<std::string> successor_args = actstash::server::SuccessorArguments(argc, argv);
  const pid_t watched_parent = actstash::server::ParentToWatch();

  auto logger = spdlog::stderr_logger_mt("actstashd");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%t] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  spdlog::flush_on(spdlog::level::info);

  // Block the shutdown signals before gRPC starts its threads, so only the
  // sigwait below receives them. A client vanishing mid-write must not kill
  // the daemon either.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto daemon = actstash::server::Daemon::Start(config);
  if (!daemon.ok()) {
    spdlog::critical("cannot start: {}", daemon.status().ToString());
    return 1;
  }
  if (config.exit_with_parent) {
    // Waits on the process rather than PR_SET_PDEATHSIG, which fires when
    // the *thread* that started the daemon exits, not the trainer process.
    // A successor watches its predecessor's parent (ParentToWatch).
    std::thread([watched_parent] {
      actstash::server::WaitForExit(watched_parent);
      spdlog::info("parent process {} exited (exit_with_parent)", watched_parent);
      kill(getpid(), SIGTERM);
    }).detach();
  }
  spdlog::info("ready");
  int received = 0;
  while (sigwait(&signals, &received) == 0 && received == SIGUSR2) {
    StartSuccessor(daemon->get(), binary, successor_args,
                   config.exit_with_parent ? watched_parent : 0, config.wait_after_take_over);
  }
  spdlog::info("received {}, shutting down (grace {} s)",
               received == SIGTERM ? "SIGTERM" : "SIGINT", config.shutdown_grace_seconds);
  (*daemon)->Shutdown(
      std::chrono::milliseconds(static_cast<int64_t>(config.shutdown_grace_seconds * 1000)));
  // Everything that matters is done: calls finished or cancelled, sockets
  // removed, sessions dropped. Exit without running destructors: with
  // clients still connected, gRPC 1.51's grpc_shutdown (run by
  // ~grpc::Server) can block forever joining its executor thread (seen in
  // tests, about 1 stop in 25). The kernel frees the pool either way.
  spdlog::shutdown();
  std::fflush(nullptr);
  _exit(0);
}
