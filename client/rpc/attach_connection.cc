#include "client/rpc/attach_connection.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
namespace {

// Between tries to attach again while the daemon restarts.
constexpr std::chrono::milliseconds kReattachPause{50};

struct Welcome {
  attach::WelcomePayload payload;
  std::string message;  // the daemon's reason, when it refused
};

// Reads the welcome on `fd`, waiting up to `timeout` for it. A transport
// failure is the error; a refusal is in the payload.
absl::StatusOr<Welcome> ReadWelcome(int fd, const std::string& socket_path,
                                    std::chrono::milliseconds timeout) {
  absl::StatusOr<attach::Message> welcome = attach::ReceiveMessage(fd, timeout);
  if (!welcome.ok()) {
    return absl::Status(welcome.status().code(),
                        absl::StrCat("attach to ", socket_path, ": ", welcome.status().message()));
  }
  Welcome out;
  if (welcome->type != attach::MessageType::kWelcome ||
      welcome->payload.size() < sizeof(out.payload) || !welcome->fds.empty()) {
    return absl::InternalError(absl::StrCat("attach to ", socket_path, ": unexpected reply"));
  }
  std::memcpy(&out.payload, welcome->payload.data(), sizeof(out.payload));
  out.message = welcome->payload.substr(sizeof(out.payload));
  return out;
}

// Sends the hello on `fd` and reads the welcome (ReadWelcome).
absl::StatusOr<Welcome> Hello(int fd, const std::string& socket_path, const std::string& token,
                              std::chrono::milliseconds timeout) {
  // Even if the hello cannot be written, a refusal may be waiting to be read.
  const absl::Status sent = attach::SendMessage(fd, attach::MessageType::kHello, token);
  absl::StatusOr<Welcome> welcome = ReadWelcome(fd, socket_path, timeout);
  if (!welcome.ok() && !sent.ok()) {
    return absl::Status(sent.code(), absl::StrCat("attach to ", socket_path, ": ", sent.message()));
  }
  return welcome;
}

absl::Status Refusal(const Welcome& welcome) {
  return absl::Status(static_cast<absl::StatusCode>(welcome.payload.status_code),
                      absl::StrCat("actstashd refused the attach: ", welcome.message));
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttachConnection>> AttachConnection::Connect(
    const std::string& socket_path, const std::string& token, std::chrono::milliseconds timeout,
    std::chrono::milliseconds reattach_timeout) {
  absl::StatusOr<UniqueFd> connected = ConnectUnixSocket(socket_path);
  if (!connected.ok()) {
    return absl::Status(connected.status().code(),
                        absl::StrCat("attach socket: ", connected.status().message()));
  }
  UniqueFd fd = std::move(*connected);
  absl::StatusOr<Welcome> welcome = Hello(fd.get(), socket_path, token, timeout);
  if (!welcome.ok()) return welcome.status();
  if (welcome->payload.status_code != 0) return Refusal(*welcome);
  UniqueFd wake_fd(eventfd(0, EFD_CLOEXEC));
  if (!wake_fd.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  const bool recoverable = (welcome->payload.flags & attach::kWelcomeRecoverable) != 0;
  return std::unique_ptr<AttachConnection>(
      new AttachConnection(std::move(fd), welcome->payload.session_id, std::move(wake_fd),
                           socket_path, token, recoverable, reattach_timeout));
}

AttachConnection::AttachConnection(UniqueFd fd, uint64_t session_id, UniqueFd wake_fd,
                                   std::string socket_path, std::string token, bool recoverable,
                                   std::chrono::milliseconds reattach_timeout)
    : fd_number_(fd.get()),
      session_id_(session_id),
      wake_fd_(std::move(wake_fd)),
      socket_path_(std::move(socket_path)),
      token_(std::move(token)),
      recoverable_(recoverable),
      reattach_timeout_(reattach_timeout) {
  {
    absl::MutexLock lock(&fd_mu_);
    fd_ = std::move(fd);
  }
  watcher_ = std::thread([this] { Watch(); });
}

AttachConnection::~AttachConnection() {
  const uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof(one));
  watcher_.join();
  // The members close wake_fd_, then fd_ (which ends the session).
}

void AttachConnection::SetState(State state, std::string detail) {
  absl::MutexLock lock(&state_mu_);
  state_ = state;
  if (state == State::kLost) {
    lost_detail_ = std::move(detail);
    lost_.store(true, std::memory_order_release);
  }
}

std::string AttachConnection::lost_detail() const {
  absl::MutexLock lock(&state_mu_);
  return lost_detail_;
}

bool AttachConnection::Sleep(std::chrono::milliseconds wait) {
  pollfd wake = {wake_fd_.get(), POLLIN, 0};
  const int ready = poll(&wake, 1, static_cast<int>(wait.count()));
  return !(ready > 0 && wake.revents != 0);
}

void AttachConnection::Watch() {
  while (true) {
    // POLLIN is not asked for: lease messages are ReceiveLease's to read.
    pollfd fds[2] = {{fd_number_.load(), POLLRDHUP, 0}, {wake_fd_.get(), POLLIN, 0}};
    const int ready = poll(fds, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready > 0 && fds[1].revents != 0) {  // destruction or Shutdown
      if (shutting_down_.load()) SetState(State::kLost);
      return;
    }
    if (ready < 0 || (fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
      if (!recoverable_ || shutting_down_.load() || reattach_timeout_.count() <= 0) {
        SetState(State::kLost);
        return;
      }
      SetState(State::kReattaching);
      if (!Reattach()) return;
    }
  }
}

bool AttachConnection::Reattach() {
  const auto deadline = std::chrono::steady_clock::now() + reattach_timeout_;
  auto left = [deadline] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  while (true) {
    struct stat st {};
    if (stat(socket_path_.c_str(), &st) != 0 && errno == ENOENT) {
      stopped_cleanly_.store(true, std::memory_order_release);
      SetState(State::kLost, "it stopped (its attach socket is gone)");
      return false;
    }
    // Not waiting on a full backlog (a kept listener while the daemon is
    // down): that wait would ignore the deadline and Shutdown.
    absl::StatusOr<UniqueFd> connected = ConnectUnixSocket(socket_path_, /*wait_for_room=*/false);
    if (connected.ok()) {
      // A connection that sent its hello is kept until the welcome comes (a
      // daemon that recovers answers once it serves): given up, it would
      // end the session it attached.
      pollfd fds[2] = {{connected->get(), POLLIN | POLLRDHUP, 0}, {wake_fd_.get(), POLLIN, 0}};
      const absl::Status sent =
          attach::SendMessage(connected->get(), attach::MessageType::kHello, token_);
      int ready = 0;
      while (sent.ok() && (ready = poll(fds, 2, static_cast<int>(left().count()))) < 0 &&
             errno == EINTR) {
      }
      if (ready > 0 && fds[1].revents != 0) {
        SetState(State::kLost, "the client closed while actstashd restarted");
        return false;
      }
      absl::StatusOr<Welcome> welcome =
          sent.ok() && ready > 0 ? ReadWelcome(connected->get(), socket_path_, left())
                                 : absl::StatusOr<Welcome>(absl::UnavailableError("no welcome"));
      if (welcome.ok()) {
        if (welcome->payload.status_code != 0 || welcome->payload.session_id != session_id_) {
          SetState(State::kLost, absl::StrCat("it restarted without this session's state (",
                                              welcome->message, ")"));
          return false;
        }
        {
          absl::MutexLock lock(&fd_mu_);
          absl::MutexLock swap(&swap_mu_);
          if (shutting_down_.load()) {  // Shutdown meanwhile: this connection ends it
            SetState(State::kLost);
            return false;
          }
          fd_number_.store(connected->get());
          fd_ = *std::move(connected);  // closes the old connection
        }
        reattaches_.fetch_add(1, std::memory_order_relaxed);
        SetState(State::kAttached);
        return true;
      }
    }
    if (left().count() == 0) {
      SetState(State::kLost, absl::StrCat("it did not come back within ",
                                          reattach_timeout_.count() / 1000.0, " s"));
      return false;
    }
    if (!Sleep(std::min(kReattachPause, left()))) {
      SetState(State::kLost, "the client closed while actstashd restarted");
      return false;
    }
  }
}

absl::StatusOr<std::vector<UniqueFd>> AttachConnection::ReceiveLease(
    uint64_t lease_id, uint32_t segments, std::chrono::milliseconds timeout,
    std::vector<uint64_t>* stale) {
  absl::MutexLock lock(&fd_mu_);
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
  const auto deadline = std::chrono::steady_clock::now() + wait;
  const uint64_t seen = reattaches();
  {
    absl::MutexLock lock(&state_mu_);
    if (state_ == State::kLost) return true;
    if (state_ == State::kReattaching) {
      state_mu_.AwaitWithDeadline(
          absl::Condition(
              +[](State* state) { return *state != State::kReattaching; }, &state_),
          absl::FromChrono(std::chrono::system_clock::now() + wait));
      return state_ == State::kLost;
    }
  }
  // A duplicate: the watcher may close the connection it polls meanwhile.
  UniqueFd watched;
  {
    absl::MutexLock swap(&swap_mu_);
    watched.Reset(fcntl(fd_number_.load(), F_DUPFD_CLOEXEC, 0));
  }
  // POLLIN is not asked for, as in Watch(): a lease message waiting to be
  // read is not a hang-up.
  pollfd fd = {watched.get(), POLLRDHUP, 0};
  int ready = 0;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    ready = poll(&fd, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (!(ready < 0 && errno == EINTR)) break;
  }
  if (ready == 0) return false;
  if (!recoverable_ || reattach_timeout_.count() <= 0) {
    SetState(State::kLost);
    return true;
  }
  // Hung up: the watcher attaches again; its verdict, if it comes in time.
  absl::MutexLock lock(&state_mu_);
  auto decided = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_) {
    return state_ == State::kLost || reattaches() != seen;
  };
  state_mu_.AwaitWithDeadline(
      absl::Condition(&decided),
      absl::FromChrono(std::chrono::system_clock::now() +
                       std::max(std::chrono::milliseconds(0),
                                std::chrono::duration_cast<std::chrono::milliseconds>(
                                    deadline - std::chrono::steady_clock::now()))));
  return state_ == State::kLost;
}

void AttachConnection::Shutdown() {
  shutting_down_.store(true);
  {
    absl::MutexLock swap(&swap_mu_);
    shutdown(fd_number_.load(), SHUT_RDWR);
  }
  const uint64_t one = 1;  // stops an attach in progress
  (void)!write(wake_fd_.get(), &one, sizeof(one));
}

}  // namespace actstash::client_internal
