#include "server/restart/service_manager.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/attach_wire.h"
#include "common/errno_status.h"

namespace actstash::server {
namespace {

// The first passed fd (SD_LISTEN_FDS_START).
constexpr int kFirstPassedFd = 3;
// More than any daemon stores (a pool of 64 TiB in 64 MiB segments).
constexpr int64_t kMaxPassedFds = 1 << 20;

// `address` as a sockaddr_un: a path, or "@name" for the abstract namespace.
absl::StatusOr<std::pair<sockaddr_un, socklen_t>> NotifyAddress(absl::string_view address) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (address.empty() || address.size() >= sizeof(addr.sun_path) ||
      (address[0] != '/' && address[0] != '@')) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET '", address,
                     "' is neither an absolute path nor an abstract name (@...) that fits a "
                     "unix socket address"));
  }
  std::memcpy(addr.sun_path, address.data(), address.size());
  if (address[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() +
                                                  (address[0] == '@' ? 0 : 1));
  return std::make_pair(addr, length);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServiceNotifier>> ServiceNotifier::FromEnvironment() {
  const char* address = std::getenv("NOTIFY_SOCKET");
  if (address == nullptr || *address == '\0') return std::unique_ptr<ServiceNotifier>();
  return ForAddress(address);
}

absl::StatusOr<std::unique_ptr<ServiceNotifier>> ServiceNotifier::ForAddress(
    absl::string_view address) {
  if (absl::Status s = NotifyAddress(address).status(); !s.ok()) return s;
  UniqueFd socket(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!socket.valid()) return ErrnoStatus("socket for NOTIFY_SOCKET", errno);
  // A manager that does not read (its queue full) fails a notification
  // after this long instead of stalling the thread that sends it (a
  // renewal): the segment is then not counted as kept.
  const timeval timeout{5, 0};
  if (setsockopt(socket.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout)) != 0) {
    return ErrnoStatus("SO_SNDTIMEO for NOTIFY_SOCKET", errno);
  }
  return std::unique_ptr<ServiceNotifier>(
      new ServiceNotifier(std::string(address), std::move(socket)));
}

absl::Status ServiceNotifier::Notify(absl::string_view text, absl::Span<const int> fds) const {
  absl::StatusOr<std::pair<sockaddr_un, socklen_t>> addr = NotifyAddress(address_);
  if (!addr.ok()) return addr.status();
  if (fds.size() > attach::kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(absl::StrCat(fds.size(), " fds in one notification"));
  }
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_name = &addr->first;
  msg.msg_namelen = addr->second;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[attach::kRightsControlBytes];
  if (!fds.empty()) attach::AttachRights(fds, control, &msg);
  while (true) {
    if (sendmsg(socket_.get(), &msg, MSG_NOSIGNAL) >= 0) return absl::OkStatus();
    if (errno == EINTR) continue;
    return absl::UnavailableError(
        absl::StrCat("notifying the service manager at ", address_, ": ", std::strerror(errno)));
  }
}

absl::Status ServiceNotifier::StoreFd(absl::string_view name, int fd) const {
  if (!IsValidFdName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' cannot name stored fds"));
  }
  const int fds[] = {fd};
  return Notify(absl::StrCat("FDSTORE=1\nFDNAME=", name), fds);
}

absl::Status ServiceNotifier::RemoveFds(absl::string_view name) const {
  if (!IsValidFdName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' cannot name stored fds"));
  }
  return Notify(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name));
}

absl::Status ServiceNotifier::Barrier(std::chrono::milliseconds timeout) const {
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe for a barrier: ", std::strerror(errno)));
  }
  UniqueFd read_end(ends[0]);
  {
    UniqueFd write_end(ends[1]);
    const int fds[] = {write_end.get()};
    if (absl::Status s = Notify("BARRIER=1", fds); !s.ok()) return s;
  }  // only the manager's copy of the write end is left
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{read_end.get(), 0, 0};  // POLLHUP is reported unasked
    const int n = poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
    return absl::DeadlineExceededError(absl::StrCat("the service manager at ", address_,
                                                    " did not answer a barrier within ",
                                                    timeout.count(), " ms"));
  }
}

bool IsValidFdName(absl::string_view name) {
  if (name.empty() || name.size() > 255) return false;
  for (char c : name) {
    if (c < 0x20 || c > 0x7e || c == ':') return false;
  }
  return true;
}

absl::StatusOr<std::vector<PassedFd>> TakePassedFds() {
  const char* pid_text = std::getenv("LISTEN_PID");
  const char* count_text = std::getenv("LISTEN_FDS");
  const char* names_text = std::getenv("LISTEN_FDNAMES");
  const std::string names_value = names_text == nullptr ? "" : names_text;
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_FDNAMES");
  std::vector<PassedFd> passed;
  if (pid_text == nullptr || count_text == nullptr) return passed;
  int64_t pid = 0;
  int64_t count = 0;
  if (!absl::SimpleAtoi(pid_text, &pid) || !absl::SimpleAtoi(count_text, &count) || count < 0 ||
      count > kMaxPassedFds) {
    return absl::InvalidArgumentError(absl::StrCat("LISTEN_PID '", pid_text, "' or LISTEN_FDS '",
                                                   count_text, "' is not a number in range"));
  }
  if (pid != getpid()) return passed;  // meant for another process
  std::vector<std::string> names;
  if (!names_value.empty()) names = absl::StrSplit(names_value, ':');
  for (int64_t i = 0; i < count; ++i) {
    const int fd = kFirstPassedFd + static_cast<int>(i);
    const int flags = fcntl(fd, F_GETFD);
    if (flags < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("LISTEN_FDS says ", count, " fds were passed, but fd ", fd, " is not open"));
    }
    (void)fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    passed.push_back({i < static_cast<int64_t>(names.size()) ? names[i] : "unknown", UniqueFd(fd)});
  }
  return passed;
}

}  // namespace actstash::server
