// actstashd: see `actstashd --help` and README.md.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "common/mutex_mode.h"
#include "server/daemon/config.h"
#include "server/daemon/daemon.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  actstash::ConfigureMutexes();
  actstash::server::CommandLine command_line = actstash::server::ParseCommandLine(argc, argv);
  if (command_line.exit_code.has_value()) return *command_line.exit_code;
  const actstash::server::DaemonConfig& config = command_line.config;

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
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto daemon = actstash::server::Daemon::Start(config);
  if (!daemon.ok()) {
    spdlog::critical("cannot start: {}", daemon.status().ToString());
    return 1;
  }
  if (config.exit_with_parent) {
    // Polls rather than PR_SET_PDEATHSIG, which fires when the *thread* that
    // started the daemon exits, not the trainer process. When the parent
    // dies the daemon is re-parented, so getppid() changes.
    const pid_t parent = getppid();
    std::thread([parent] {
      while (getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      spdlog::info("parent process {} exited (exit_with_parent)", parent);
      kill(getpid(), SIGTERM);
    }).detach();
  }
  spdlog::info("ready");
  int received = 0;
  sigwait(&signals, &received);
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
