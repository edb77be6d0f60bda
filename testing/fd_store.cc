#include "testing/fd_store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace actstash::testing {

absl::StatusOr<std::unique_ptr<FdStore>> FdStore::Create() {
  static std::atomic<int> count{0};
  const std::string address = absl::StrCat("@actstash-fdstore-", getpid(), "-", count++);
  UniqueFd socket(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!socket.valid()) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, address.data() + 1, address.size() - 1);
  if (bind(socket.get(), reinterpret_cast<sockaddr*>(&addr),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size())) != 0) {
    return absl::InternalError(absl::StrCat("bind ", address, ": ", std::strerror(errno)));
  }
  UniqueFd wake(eventfd(0, EFD_CLOEXEC));
  if (!wake.valid()) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  return std::unique_ptr<FdStore>(new FdStore(address, std::move(socket), std::move(wake)));
}

FdStore::FdStore(std::string address, UniqueFd socket, UniqueFd wake)
    : address_(std::move(address)), socket_(std::move(socket)), wake_(std::move(wake)) {
  thread_ = std::thread([this] { Receive(); });
}

FdStore::~FdStore() {
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
  thread_.join();
}

void FdStore::Receive() {
  while (true) {
    pollfd fds[2] = {{socket_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    Drain();
  }
}

void FdStore::Drain() {
  absl::MutexLock receiving(&receive_mu_);
  while (ReceiveOne()) {
  }
}

bool FdStore::ReceiveOne() {
  char text[4096];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
  iovec iov{text, sizeof(text) - 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(socket_.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return errno == EINTR;
  std::vector<UniqueFd> fds_received;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds_received.emplace_back(fd);
    }
  }
  std::string name = "stored";
  bool store = false;
  bool remove = false;
  bool ready = false;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text, n), '\n')) {
    if (line == "FDSTORE=1") store = true;
    if (line == "FDSTOREREMOVE=1") remove = true;
    if (line == "READY=1") ready = true;
    if (absl::StartsWith(line, "FDNAME=")) name = std::string(line.substr(7));
  }
  absl::MutexLock lock(&mu_);
  if (remove) {
    std::vector<std::pair<std::string, UniqueFd>> left;
    for (auto& entry : kept_) {
      if (entry.first != name) left.push_back(std::move(entry));
    }
    kept_ = std::move(left);
  }
  if (store) {
    for (UniqueFd& fd : fds_received) {
      struct stat st {};
      fstat(fd.get(), &st);
      bool known = false;  // the same file kept already: dropped, as systemd does
      for (const auto& entry : kept_) {
        struct stat other {};
        fstat(entry.second.get(), &other);
        known = known || (other.st_dev == st.st_dev && other.st_ino == st.st_ino);
      }
      if (!known) kept_.emplace_back(name, std::move(fd));
    }
  }
  if (ready) ++ready_;
  return true;
}

std::vector<std::pair<std::string, UniqueFd>> FdStore::Snapshot() {
  // What the dead process sent last is read first, as systemd handles a
  // service's notifications before its exit.
  Drain();
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, UniqueFd>> out;
  for (const auto& [name, fd] : kept_) {
    out.emplace_back(name, UniqueFd(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0)));
  }
  return out;
}

bool FdStore::WaitReady(int after, std::chrono::milliseconds timeout) {
  absl::MutexLock lock(&mu_);
  auto done = [this, after]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_ > after; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), absl::FromChrono(timeout));
}

int FdStore::ready_count() const {
  absl::MutexLock lock(&mu_);
  return ready_;
}

absl::Status FdStore::Corrupt(const std::string& name, off_t offset, const std::string& bytes) {
  absl::MutexLock lock(&mu_);
  for (const auto& [kept_name, fd] : kept_) {
    if (kept_name != name) continue;
    if (pwrite(fd.get(), bytes.data(), bytes.size(), offset) !=
        static_cast<ssize_t>(bytes.size())) {
      return absl::InternalError(absl::StrCat("pwrite: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("no kept fd named ", name));
}

size_t FdStore::Forget(const std::string& prefix) {
  Drain();
  absl::MutexLock lock(&mu_);
  const size_t before = kept_.size();
  kept_.erase(std::remove_if(kept_.begin(), kept_.end(),
                             [&](const auto& kept) { return kept.first.rfind(prefix, 0) == 0; }),
              kept_.end());
  return before - kept_.size();
}

}  // namespace actstash::testing
