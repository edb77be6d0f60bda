// Claiming and releasing the filesystem path of a listening Unix socket.
#ifndef ACTSTASH_SERVER_BASE_SOCKET_PATH_H_
#define ACTSTASH_SERVER_BASE_SOCKET_PATH_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"

namespace actstash::server {

// Creates the socket's parent directories (mode 0755) when missing.
absl::Status MakeParentDirectory(const std::string& socket_path);

// Makes `path` free for a new listener: a live listener there refuses
// (FAILED_PRECONDITION "another actstashd is already listening"); a stale
// socket file is removed; anything that is not a socket refuses.
absl::Status ClaimSocketPath(const std::string& path);

// After binding: sets the mode and returns the socket's inode, so that
// RemoveSocketIfOurs removes only the file this process created.
absl::StatusOr<ino_t> SetSocketMode(const std::string& path, uint32_t mode);
void RemoveSocketIfOurs(const std::string& path, ino_t inode);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_BASE_SOCKET_PATH_H_
