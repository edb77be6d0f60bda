// UniqueFd: the owner of one file descriptor. Every fd the daemon, the
// client library and the test support open (sockets, memfds, spill files,
// directories) is held by one from the moment it is opened until it is
// closed or handed to another owner: this class makes their only call to
// close(2).
//
// Ownership: move-only. The fd is closed exactly once: by the destructor, by
// Reset(), or by a move assignment onto a UniqueFd that holds one.
// Release() hands it back to the caller unclosed. close(2) is called once
// and never retried (on Linux the fd is gone even when close fails with
// EINTR, so a retry could close an fd another thread has just been given);
// its errors are ignored.
//
// Thread-compatibility: not thread-safe. One owner at a time; const members
// (get(), valid()) may be called concurrently, but not alongside a move,
// Reset(), Release() or the destructor.
#ifndef ACTSTASH_COMMON_UNIQUE_FD_H_
#define ACTSTASH_COMMON_UNIQUE_FD_H_

#include <fcntl.h>
#include <unistd.h>

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/errno_status.h"

namespace actstash {

class UniqueFd {
 public:
  // Holds no fd (get() is -1).
  UniqueFd() = default;
  // Takes ownership of `fd`; a negative `fd` (a failed open) holds none.
  explicit UniqueFd(int fd) : fd_(fd < 0 ? -1 : fd) {}
  ~UniqueFd() { Close(); }

  // `other` is left empty.
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  // Closes the fd held here, then takes `other`'s (`other` is left empty).
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  // The fd, still owned here; -1 when none. The caller must not close it,
  // nor use it once this UniqueFd is reset, moved from or destroyed.
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

  // Gives up ownership without closing: the caller now owns the returned fd
  // (-1 when none was held). Leaves this UniqueFd empty.
  [[nodiscard]] int Release() { return std::exchange(fd_, -1); }

  // Closes the fd held here (if any), then takes ownership of `fd` (which
  // must not be the one held here; negative: none).
  void Reset(int fd = -1) {
    Close();
    fd_ = fd < 0 ? -1 : fd;
  }

 private:
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  int fd_ = -1;
};

// A close-on-exec duplicate of `fd`, owned by the caller; ErrnoStatus after
// `what` when the kernel refuses.
inline absl::StatusOr<UniqueFd> DupFd(int fd, absl::string_view what) {
  UniqueFd dup(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!dup.valid()) return ErrnoStatus(what, errno);
  return dup;
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_UNIQUE_FD_H_
