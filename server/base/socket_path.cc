#include "server/base/socket_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

absl::Status MakeParentDirectory(const std::string& socket_path) {
  const std::string dir = socket_path.substr(0, socket_path.find_last_of('/'));
  if (dir.empty()) return absl::OkStatus();
  std::string prefix;
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    prefix = dir.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create socket directory ", prefix, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status ClaimSocketPath(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot inspect ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; not replacing it"));
  }
  absl::StatusOr<UniqueFd> probe = ConnectUnixSocket(path);
  if (absl::IsInvalidArgument(probe.status()) || absl::IsInternal(probe.status())) {
    return probe.status();
  }
  const bool alive = probe.ok();
  if (alive) {
    return absl::FailedPreconditionError(
        absl::StrCat("another actstashd is already listening on ", path));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove stale socket ", path, ": ", std::strerror(errno)));
  }
  spdlog::info("removed stale socket {}", path);
  return absl::OkStatus();
}

absl::StatusOr<ino_t> SetSocketMode(const std::string& path, uint32_t mode) {
  struct stat st {};
  if (chmod(path.c_str(), mode) != 0 || stat(path.c_str(), &st) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot set the mode of ", path, ": ", std::strerror(errno)));
  }
  return st.st_ino;
}

void RemoveSocketIfOurs(const std::string& path, ino_t inode) {
  struct stat st {};
  if (inode != 0 && stat(path.c_str(), &st) == 0 && st.st_ino == inode) unlink(path.c_str());
}

}  // namespace actstash::server
