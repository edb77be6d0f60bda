// Upgrade in place: on SIGUSR2 a serving daemon starts its own successor
// (the binary at the path it was started from, so a newly installed one,
// with the same arguments plus --take-over), which takes over from it
// (server/restart/take_over.h). Under a service manager the successor is
// then the service's main process (MAINPID=, daemon_handover.cc): that is
// how `systemctl reload actstashd` upgrades a running service without
// ending its sessions. Called from the main thread only.
#ifndef ACTSTASH_SERVER_RESTART_SUCCESSOR_H_
#define ACTSTASH_SERVER_RESTART_SUCCESSOR_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace actstash::server {

// Set in a successor's environment when its predecessor runs with
// exit_with_parent: the pid of the process to outlive no longer (the
// predecessor's parent), since the successor's own parent is the
// predecessor, which exits.
inline constexpr char kWatchPidVariable[] = "ACTSTASH_WATCH_PID";

// The path this process's executable was started from, read at start: a
// binary replaced later (or a symlink pointed elsewhere) is found there by
// the successor. `argv0` made absolute when it names a path (has a '/'),
// else /proc/self/exe.
absl::StatusOr<std::string> OwnExecutable(const char* argv0);

// `argv` without any --take-over (with its value) or --handed-over, plus
// --take-over=on.
std::vector<std::string> SuccessorArguments(int argc, char** argv);

// Starts `path` with `args` (args[0] included) and this process's
// environment (plus kWatchPidVariable=`watched_parent` when not 0), every
// fd from 3 on closed and no signal blocked. The child's pid, or INTERNAL
// with the errno text.
absl::StatusOr<pid_t> SpawnSuccessor(const std::string& path, const std::vector<std::string>& args,
                                     pid_t watched_parent);

// The process exit_with_parent watches: $ACTSTASH_WATCH_PID (then unset)
// when set, else the parent.
pid_t ParentToWatch();

// Returns once process `pid` has exited (at once when there is none).
void WaitForExit(pid_t pid);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RESTART_SUCCESSOR_H_
