#include "server/restart/take_over.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/attach_wire.h"
#include "common/errno_status.h"
#include "common/unix_socket.h"
#include "server/base/socket_path.h"
#include "server/restart/state_image.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

using attach::MessageType;

constexpr std::chrono::milliseconds kHelloTimeout{5000};
// How long the serving daemon waits for TakeOverAdopted: the successor maps
// the pool (mlock, registration) before it confirms.
constexpr std::chrono::milliseconds kAdoptTimeout{120000};

void Refuse(int fd, absl::string_view reason) {
  spdlog::warn("take-over refused: {}", std::string(reason));
  attach::SendMessage(fd, MessageType::kTakeOverRefused, reason.substr(0, attach::kMaxPayloadBytes))
      .IgnoreError();
}

// Accepts every connection waiting on `listener` and refuses it: a take-over
// is running.
void RefuseWaiting(int listener) {
  for (;;) {
    UniqueFd other(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!other.valid()) return;
    const int flags = fcntl(other.get(), F_GETFL);
    fcntl(other.get(), F_SETFL, flags & ~O_NONBLOCK);
    Refuse(other.get(), "another take-over of this actstashd is in progress");
  }
}

// Waits until `fd` is readable (or hung up), refusing other successors
// meanwhile. DEADLINE_EXCEEDED after `timeout`.
absl::Status WaitReadableRefusing(int fd, int listener, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return absl::DeadlineExceededError("no answer from the successor");
    pollfd fds[2] = {{fd, POLLIN, 0}, {listener, POLLIN, 0}};
    const int n = poll(fds, 2, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (n < 0 && errno != EINTR) return ErrnoStatus("poll", errno);
    if (n <= 0) continue;
    if (fds[1].revents & POLLIN) RefuseWaiting(listener);
    if (fds[0].revents != 0) return absl::OkStatus();
  }
}

absl::Status SendPackage(int fd, HandoverPackage package) {
  std::vector<int> numbers;
  numbers.push_back(package.state_image.get());
  for (const UniqueFd& f : package.fds) numbers.push_back(f.get());
  const uint32_t total = static_cast<uint32_t>(numbers.size());
  for (uint32_t first = 0; first < total; first += attach::kMaxFdsPerMessage) {
    attach::TakeOverStatePayload payload;
    payload.total = total;
    payload.first = first;
    payload.count = std::min(attach::kMaxFdsPerMessage, total - first);
    if (absl::Status s =
            attach::SendMessage(fd, MessageType::kTakeOverState, attach::PayloadOf(payload),
                                absl::MakeConstSpan(numbers.data() + first, payload.count));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<HandoverListener>> HandoverListener::Start(const std::string& path,
                                                                          UniqueFd handed,
                                                                          Prepare prepare,
                                                                          Finish finish) {
  UniqueFd listener = std::move(handed);
  if (!listener.valid()) {
    if (absl::Status s = ClaimSocketPath(path); !s.ok()) return s;
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    if (path.size() >= sizeof(address.sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("take-over socket path too long: ", path));
    }
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    listener = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener.valid()) return ErrnoStatus("socket for the take-over channel", errno);
    if (bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        listen(listener.get(), 8) != 0) {
      return ErrnoStatus(absl::StrCat("listening on the take-over socket ", path), errno);
    }
  }
  // Non-blocking: RefuseWaiting accepts until nothing waits (Run polls).
  if (fcntl(listener.get(), F_SETFL, fcntl(listener.get(), F_GETFL) | O_NONBLOCK) != 0) {
    return ErrnoStatus("O_NONBLOCK on the take-over listener", errno);
  }
  // Only the daemon's own user may connect (and SO_PEERCRED is checked).
  absl::StatusOr<ino_t> inode = SetSocketMode(path, 0600);
  if (!inode.ok()) return inode.status();
  std::unique_ptr<HandoverListener> self(new HandoverListener(
      path, std::move(listener), *inode, std::move(prepare), std::move(finish)));
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return ErrnoStatus("pipe", errno);
  self->stop_read_ = UniqueFd(pipe_fds[0]);
  self->stop_write_ = UniqueFd(pipe_fds[1]);
  HandoverListener* raw = self.get();
  self->thread_ = std::thread([raw] { raw->Run(); });
  return self;
}

HandoverListener::HandoverListener(std::string path, UniqueFd listener, ino_t inode,
                                   Prepare prepare, Finish finish)
    : path_(std::move(path)),
      listener_(std::move(listener)),
      inode_(inode),
      prepare_(std::move(prepare)),
      finish_(std::move(finish)) {}

HandoverListener::~HandoverListener() {
  if (stop_write_.valid()) {
    const char byte = 0;
    (void)!write(stop_write_.get(), &byte, 1);
  }
  if (thread_.joinable()) thread_.join();
  if (!keep_file_.load()) RemoveSocketIfOurs(path_, inode_);
}

absl::StatusOr<UniqueFd> HandoverListener::DupListener() const {
  return DupFd(listener_.get(), "dup of the take-over listener");
}

void HandoverListener::Run() {
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {stop_read_.get(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("take-over socket: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    UniqueFd connection(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection.valid()) continue;  // EAGAIN: someone else took it (a probe that left)
    Serve(std::move(connection));
  }
}

void HandoverListener::Serve(UniqueFd connection) {
  const int fd = connection.get();
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  if (cred.uid != geteuid() && cred.uid != 0) {
    return Refuse(
        fd, absl::StrCat("uid ", cred.uid, " may not take over this actstashd (it runs as uid ",
                         geteuid(), ")"));
  }
  absl::StatusOr<attach::Message> hello_message = attach::ReceiveMessage(fd, kHelloTimeout);
  if (!hello_message.ok()) return;  // a probe (ClaimSocketPath) or a client that left
  v1::TakeOverHello hello;
  if (hello_message->type != MessageType::kTakeOverHello ||
      !hello.ParseFromString(hello_message->payload)) {
    return Refuse(fd, "expected a take-over hello");
  }
  if (hello.protocol() != kTakeOverProtocol) {
    return Refuse(fd, absl::StrCat("the successor (actstashd ", hello.daemon_version(),
                                   ") speaks take-over protocol ", hello.protocol(),
                                   "; this actstashd speaks ", kTakeOverProtocol,
                                   ": drain the node and restart instead"));
  }
  spdlog::info("take-over requested by pid {} (actstashd {})", hello.pid(), hello.daemon_version());
  absl::StatusOr<HandoverPackage> package = prepare_(hello);
  if (!package.ok()) return Refuse(fd, package.status().message());
  if (absl::Status s = SendPackage(fd, *std::move(package)); !s.ok()) {
    spdlog::error("take-over: sending the state failed: {}; serving again", s.ToString());
    return finish_(false);
  }
  absl::Status waited = WaitReadableRefusing(fd, listener_.get(), kAdoptTimeout);
  absl::StatusOr<attach::Message> answer = waited.ok() ? attach::ReceiveMessage(fd, kHelloTimeout)
                                                       : absl::StatusOr<attach::Message>(waited);
  if (!answer.ok() || answer->type != MessageType::kTakeOverAdopted) {
    spdlog::error("take-over by pid {} did not complete ({}); serving again", hello.pid(),
                  answer.ok() ? "unexpected message" : answer.status().ToString());
    return finish_(false);
  }
  spdlog::info("take-over by pid {} complete", hello.pid());
  keep_file_.store(true);
  finish_(true);
}

absl::StatusOr<TakenOver> RequestTakeOver(const std::string& grpc_socket_path,
                                          const v1::TakeOverHello& hello,
                                          std::chrono::milliseconds timeout) {
  const std::string path = attach::HandoverSocketPath(grpc_socket_path);
  absl::StatusOr<UniqueFd> connection = ConnectUnixSocket(path);
  if (!connection.ok()) {
    return absl::UnavailableError(absl::StrCat("--take-over: no actstashd to take over at ", path,
                                               " (", connection.status().message(), ")"));
  }
  const int fd = connection->get();
  if (absl::Status s =
          attach::SendMessage(fd, MessageType::kTakeOverHello, hello.SerializeAsString());
      !s.ok()) {
    return s;
  }
  TakenOver taken;
  std::vector<UniqueFd> all;
  uint32_t total = 0;
  do {
    absl::StatusOr<attach::Message> message = attach::ReceiveMessage(fd, timeout);
    if (!message.ok()) {
      return absl::Status(message.status().code(),
                          absl::StrCat("--take-over: ", message.status().message()));
    }
    if (message->type == MessageType::kTakeOverRefused) {
      return absl::FailedPreconditionError(
          absl::StrCat("the serving actstashd refused the take-over: ", message->payload));
    }
    attach::TakeOverStatePayload payload;
    if (message->type != MessageType::kTakeOverState ||
        message->payload.size() != sizeof(payload)) {
      return absl::InvalidArgumentError("--take-over: unexpected message from the serving daemon");
    }
    std::memcpy(&payload, message->payload.data(), sizeof(payload));
    if (payload.first != all.size() || payload.count != message->fds.size() ||
        (total != 0 && payload.total != total) || payload.total == 0 ||
        payload.first + payload.count > payload.total) {
      return absl::InvalidArgumentError("--take-over: the handed fds do not add up");
    }
    total = payload.total;
    for (UniqueFd& received : message->fds) all.push_back(std::move(received));
  } while (all.size() < total);
  absl::StatusOr<v1::DaemonState> state = ReadStateImage(all[0].get());
  if (!state.ok()) {
    return absl::Status(
        state.status().code(),
        absl::StrCat("--take-over: the handed state is not trusted: ", state.status().message()));
  }
  taken.state = *std::move(state);
  taken.fds.assign(std::make_move_iterator(all.begin() + 1), std::make_move_iterator(all.end()));
  taken.connection = *std::move(connection);
  return taken;
}

absl::Status ConfirmTakeOver(TakenOver* taken, std::chrono::milliseconds timeout) {
  const int fd = taken->connection.get();
  if (absl::Status s = attach::SendMessage(fd, MessageType::kTakeOverAdopted, ""); !s.ok()) {
    return s;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char byte;
  while (timeout.count() > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError("the serving actstashd did not exit after the take-over");
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = read(fd, &byte, 1);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;  // it exited
  }
  taken->connection.Reset();
  return absl::OkStatus();
}

}  // namespace actstash::server
