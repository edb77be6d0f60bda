#include "client/rpc/attach_connection.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/attach_wire.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"

namespace actstash::client_internal {

absl::StatusOr<std::unique_ptr<AttachConnection>> AttachConnection::Connect(
    const std::string& socket_path, const std::string& token, std::chrono::milliseconds timeout) {
  absl::StatusOr<UniqueFd> connected = ConnectUnixSocket(socket_path);
  if (!connected.ok()) {
    return absl::Status(connected.status().code(),
                        absl::StrCat("attach socket: ", connected.status().message()));
  }
  UniqueFd fd = std::move(*connected);
  // Even if the hello cannot be written, a refusal may be waiting to be read.
  const absl::Status sent = attach::SendMessage(fd.get(), attach::MessageType::kHello, token);
  absl::StatusOr<attach::Message> welcome = attach::ReceiveMessage(fd.get(), timeout);
  if (!welcome.ok() && !sent.ok()) welcome = sent;
  if (!welcome.ok()) {
    return absl::Status(welcome.status().code(),
                        absl::StrCat("attach to ", socket_path, ": ", welcome.status().message()));
  }
  attach::WelcomePayload payload;
  if (welcome->type != attach::MessageType::kWelcome || welcome->payload.size() < sizeof(payload) ||
      !welcome->fds.empty()) {
    return absl::InternalError(absl::StrCat("attach to ", socket_path, ": unexpected reply"));
  }
  std::memcpy(&payload, welcome->payload.data(), sizeof(payload));
  if (payload.status_code != 0) {
    return absl::Status(
        static_cast<absl::StatusCode>(payload.status_code),
        absl::StrCat("actstashd refused the attach: ", welcome->payload.substr(sizeof(payload))));
  }
  UniqueFd wake_fd(eventfd(0, EFD_CLOEXEC));
  if (!wake_fd.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<AttachConnection>(
      new AttachConnection(std::move(fd), payload.session_id, std::move(wake_fd)));
}

AttachConnection::AttachConnection(UniqueFd fd, uint64_t session_id, UniqueFd wake_fd)
    : fd_(std::move(fd)), session_id_(session_id), wake_fd_(std::move(wake_fd)) {
  watcher_ = std::thread([this] { Watch(); });
}

AttachConnection::~AttachConnection() {
  const uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof(one));
  watcher_.join();
  // The members close wake_fd_, then fd_ (which ends the session).
}

void AttachConnection::Watch() {
  // POLLIN is not asked for: lease messages are ReceiveLease's to read.
  pollfd fds[2] = {{fd_.get(), POLLRDHUP, 0}, {wake_fd_.get(), POLLIN, 0}};
  while (true) {
    const int ready = poll(fds, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || (fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
      lost_.store(true, std::memory_order_release);
      return;
    }
    if (fds[1].revents != 0) return;
  }
}

absl::StatusOr<std::vector<UniqueFd>> AttachConnection::ReceiveLease(
    uint64_t lease_id, uint32_t segments, std::chrono::milliseconds timeout,
    std::vector<uint64_t>* stale) {
  std::vector<UniqueFd> fds;
  while (fds.size() < segments) {
    absl::StatusOr<attach::Message> message = attach::ReceiveMessage(fd_.get(), timeout);
    if (!message.ok()) return message.status();
    attach::SegmentsPayload payload;
    const bool well_formed = message->type == attach::MessageType::kSegments &&
                             message->payload.size() == sizeof(payload);
    if (well_formed) std::memcpy(&payload, message->payload.data(), sizeof(payload));
    if (well_formed && payload.lease_id != lease_id) {
      if (stale->empty() || stale->back() != payload.lease_id) stale->push_back(payload.lease_id);
      continue;
    }
    const size_t received = message->fds.size();
    for (UniqueFd& fd : message->fds) fds.push_back(std::move(fd));
    if (!well_formed || payload.first != fds.size() - received || payload.count != received ||
        payload.lease_segments != segments) {
      return absl::InternalError(
          absl::StrCat("attach channel: malformed segment message for lease ", lease_id));
    }
  }
  return fds;
}

bool AttachConnection::ConfirmLost(std::chrono::milliseconds wait) {
  if (lost()) return true;
  // POLLIN is not asked for, as in Watch(): a lease message waiting to be
  // read is not a hang-up.
  pollfd fd = {fd_.get(), POLLRDHUP, 0};
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    const int ready = poll(&fd, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || (fd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
      lost_.store(true, std::memory_order_release);
      return true;
    }
    return false;
  }
}

void AttachConnection::Shutdown() { shutdown(fd_.get(), SHUT_RDWR); }

}  // namespace actstash::client_internal
