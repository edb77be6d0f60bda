#include "server/restart/successor.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/unique_fd.h"

extern char** environ;

namespace actstash::server {
namespace {

constexpr char kTakeOverFlag[] = "--take-over";
constexpr char kTakeOverValue[] = "--take-over=";

}  // namespace

absl::StatusOr<std::string> OwnExecutable(const char* argv0) {
  if (argv0 != nullptr && std::strchr(argv0, '/') != nullptr) {
    if (argv0[0] == '/') return std::string(argv0);
    std::string cwd(4096, '\0');
    if (getcwd(cwd.data(), cwd.size()) == nullptr) {
      return absl::InternalError(absl::StrCat("getcwd: ", std::strerror(errno)));
    }
    cwd.resize(std::strlen(cwd.c_str()));
    return absl::StrCat(cwd, "/", argv0);
  }
  std::string path(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size());
  if (n <= 0 || static_cast<size_t>(n) >= path.size()) {
    return absl::InternalError(
        absl::StrCat("reading /proc/self/exe: ", n < 0 ? std::strerror(errno) : "too long"));
  }
  path.resize(static_cast<size_t>(n));
  return path;
}

std::vector<std::string> SuccessorArguments(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i > 0 && arg == kTakeOverFlag) {
      // Its optional value is the next word when that is not a flag.
      if (i + 1 < argc && argv[i + 1][0] != '-') ++i;
      continue;
    }
    if (i > 0 &&
        (arg.substr(0, sizeof(kTakeOverValue) - 1) == kTakeOverValue || arg == "--handed-over")) {
      continue;
    }
    out.emplace_back(arg);
  }
  out.push_back(std::string(kTakeOverValue) + "on");
  return out;
}

absl::StatusOr<pid_t> SpawnSuccessor(const std::string& path, const std::vector<std::string>& args,
                                     pid_t watched_parent) {
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const std::string watch = absl::StrCat(kWatchPidVariable, "=", watched_parent);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry = *e;
    if (entry.substr(0, sizeof(kWatchPidVariable) - 1) != kWatchPidVariable ||
        entry.substr(sizeof(kWatchPidVariable) - 1, 1) != "=") {
      envp.push_back(*e);
    }
  }
  if (watched_parent != 0) envp.push_back(const_cast<char*>(watch.c_str()));
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attributes;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attributes);
  // Only the standard streams: the successor receives what it needs over
  // the take-over socket.
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = 0;
  const int error =
      posix_spawn(&pid, path.c_str(), &actions, &attributes, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (error != 0) {
    return absl::InternalError(absl::StrCat("starting ", path, ": ", std::strerror(error)));
  }
  return pid;
}

pid_t ParentToWatch() {
  pid_t pid = 0;
  if (const char* text = std::getenv(kWatchPidVariable); text != nullptr) {
    int parsed = 0;
    if (absl::SimpleAtoi(text, &parsed) && parsed >= 1) pid = parsed;
    unsetenv(kWatchPidVariable);
  }
  return pid != 0 ? pid : getppid();
}

void WaitForExit(pid_t pid) {
  UniqueFd pidfd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  if (pidfd.valid()) {
    pollfd p{pidfd.get(), POLLIN, 0};
    while (poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
    return;
  }
  if (errno == ESRCH) return;
  // No pidfds (kernels before 5.3): poll for the process.
  while (kill(pid, 0) == 0 || errno == EPERM) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace actstash::server
