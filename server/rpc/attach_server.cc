#include "server/rpc/attach_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <cerrno>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/attach_wire.h"
#include "common/check.h"
#include "common/unique_fd.h"
#include "server/base/socket_path.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

namespace asio = boost::asio;
using Socket = asio::local::stream_protocol::socket;

// One message on its way out; fds leave with its first byte. Owns its fds
// (duplicates taken while the lease was held), so a renewal that closes the
// pool's fds meanwhile cannot make it send some other file.
struct Outgoing {
  explicit Outgoing(std::string b) : bytes(std::move(b)) {}
  Outgoing(Outgoing&&) = default;
  Outgoing& operator=(Outgoing&&) = default;

  std::string bytes;
  std::vector<UniqueFd> fds;
  size_t sent = 0;
  AttachServer::SendCallback done;  // may be empty
};

// Connections that have not said hello yet ("pending") cost the daemon a
// socket and a timer and can be opened by any local user who can reach the
// socket, so they are bounded; attached connections never count and are never
// closed for room. A legitimate client sends its hello right after connecting,
// which is why, past the limits, the *oldest* pending connection makes room
// for the newest (a flood cannot lock clients out by getting there first),
// and why a crowded server gives newcomers a short hello deadline.
constexpr size_t kMaxPendingConnections = 256;
constexpr size_t kMaxPendingPerUid = 64;
constexpr size_t kCrowdedPending = 32;
constexpr std::chrono::milliseconds kCrowdedHelloTimeout{250};

}  // namespace

class AttachServer::Impl {
 public:
  class Connection;

  // Serves `socket` (see AttachServer's constructor): accepts on it and
  // starts the I/O thread.
  Impl(const AttachServerOptions& options, ino_t socket_inode, UniqueFd listener,
       SessionManager* sessions, FdSegmentLeaser* pool, DisconnectCallback on_disconnect);

  void Stop();
  void SendLeases(uint64_t session_id, std::vector<std::shared_ptr<Lease>> leases,
                  SendCallback done);
  void Disconnect(uint64_t session_id);
  // Runs `task` on the I/O thread and waits for it; false once stopped.
  bool RunOnIo(std::function<void()> task);

  const AttachServerOptions options_;
  const ino_t socket_inode_;
  SessionManager& sessions_;
  FdSegmentLeaser& pool_;
  const DisconnectCallback on_disconnect_;
  asio::io_context io_;
  // Keeps io_.run() going while nothing is pending (not accepting yet, or
  // frozen with no connection); Stop drops it.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> keep_running_;
  asio::local::stream_protocol::acceptor acceptor_;
  asio::steady_timer accept_backoff_{io_};
  std::chrono::steady_clock::time_point last_accept_warning_{};
  std::thread thread_;
  // Posting to io_ after Stop would lose the work (and its callback).
  absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
  // I/O thread only.
  bool stopping_ = false;
  // Between Freeze and Thaw: nothing is accepted, and sessions whose
  // connection ends are only noted.
  bool frozen_ = false;
  bool accepting_ = false;  // Accept() armed once (I/O thread after the constructor)
  std::vector<uint64_t> ended_while_frozen_;
  absl::flat_hash_map<uint64_t, std::weak_ptr<Connection>> by_session_;
  std::vector<std::weak_ptr<Connection>> all_;

  void Accept();

 private:
  // Connections without a hello yet, oldest first.
  std::vector<std::shared_ptr<Connection>> Pending() const;
  // Closes the oldest pending connections while there are more than
  // kMaxPendingConnections, or more than kMaxPendingPerUid of `uid`'s.
  void LimitPending(uint32_t uid);

  uint64_t evicted_pending_ = 0;  // since the last warning
  std::chrono::steady_clock::time_point last_eviction_warning_{};
};

// Lives as long as an asynchronous operation holds it. I/O thread only.
class AttachServer::Impl::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Impl* server, Socket socket)
      : server_(*server), socket_(std::move(socket)), hello_timer_(server->io_) {}

  // `crowded`: many connections are pending; this one gets a short hello
  // deadline.
  void Start(bool crowded) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(socket_.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      Close(absl::StrCat("SO_PEERCRED failed: ", std::strerror(errno)));
      return;
    }
    peer_ = PeerCredentials{static_cast<uint32_t>(cred.uid), static_cast<uint32_t>(cred.gid),
                            static_cast<uint32_t>(cred.pid)};
    auto self = shared_from_this();
    hello_timer_.expires_after(crowded ? std::min(server_.options_.hello_timeout,
                                                  std::chrono::milliseconds(kCrowdedHelloTimeout))
                                       : server_.options_.hello_timeout);
    hello_timer_.async_wait([self](const boost::system::error_code& error) {
      if (!error && self->session_ == nullptr) self->Close("no hello before the timeout");
    });
    asio::async_read(
        socket_, asio::buffer(&header_, sizeof(header_)),
        [self](const boost::system::error_code& error, size_t) { self->OnHeader(error); });
  }

  // Queues a message; `done` (if any) learns whether it went out.
  void Send(Outgoing message) {
    if (closed_) {
      if (message.done) message.done(absl::UnavailableError("the attach connection is closed"));
      return;
    }
    queue_.push_back(std::move(message));
    if (queue_.size() == 1) Flush();
  }

  bool attached() const { return session_ != nullptr; }
  bool closed() const { return closed_; }
  uint32_t peer_uid() const { return peer_.uid; }
  int native_handle() { return socket_.native_handle(); }

  // Take-over: binds a connection handed by the daemon this one succeeds to
  // its session, as a hello would have.
  void Adopt(std::shared_ptr<Session> session) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(socket_.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      peer_ = PeerCredentials{static_cast<uint32_t>(cred.uid), static_cast<uint32_t>(cred.gid),
                              static_cast<uint32_t>(cred.pid)};
    }
    session_ = std::move(session);
    session_->SetAttached(peer_);
    session_->Touch();
    server_.by_session_[session_->id()] = weak_from_this();
    WatchForClose();
  }

  // Closes the connection; if it was bound, the session is reclaimed.
  void Close(const std::string& reason) {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ignored;
    hello_timer_.cancel();
    socket_.close(ignored);
    for (Outgoing& message : queue_) {
      if (message.done) message.done(absl::UnavailableError("the attach connection closed"));
    }
    queue_.clear();
    if (session_ == nullptr) {
      spdlog::debug("attach connection of pid {} closed: {}", peer_.pid, reason);
      return;
    }
    session_->SetDetached();
    server_.by_session_.erase(session_->id());
    if (server_.stopping_) return;
    if (server_.frozen_) {  // reclaimed by Thaw, or by no one once handed over
      server_.ended_while_frozen_.push_back(session_->id());
      return;
    }
    spdlog::info("session {} (pid {}, uid {}): attach connection closed ({}); reclaiming",
                 session_->id(), peer_.pid, peer_.uid, reason);
    server_.on_disconnect_(session_->id());
  }

 private:
  bool Allowed() const {
    const AttachServerOptions& o = server_.options_;
    if (o.allow_uids.empty() && o.allow_gids.empty()) return true;
    if (peer_.uid == geteuid()) return true;
    return std::find(o.allow_uids.begin(), o.allow_uids.end(), peer_.uid) != o.allow_uids.end() ||
           std::find(o.allow_gids.begin(), o.allow_gids.end(), peer_.gid) != o.allow_gids.end();
  }

  void OnHeader(const boost::system::error_code& error) {
    if (error) return Close(error.message());
    if (!attach::CheckHeader(header_).ok() ||
        header_.type != static_cast<uint16_t>(attach::MessageType::kHello) ||
        header_.payload_bytes == 0 || header_.payload_bytes > 256) {
      return Refuse(absl::InvalidArgumentError("expected a hello message with a session token"));
    }
    payload_.resize(header_.payload_bytes);
    auto self = shared_from_this();
    asio::async_read(
        socket_, asio::buffer(payload_),
        [self](const boost::system::error_code& error, size_t) { self->OnHello(error); });
  }

  void OnHello(const boost::system::error_code& error) {
    if (error) return Close(error.message());
    // Checked after the (bounded) hello was read, so that the client's write
    // of it cannot fail before it reads the refusal.
    if (!Allowed()) {
      return Refuse(absl::PermissionDeniedError(
          absl::StrCat("uid ", peer_.uid, " / gid ", peer_.gid,
                       " may not attach (see --allow-uid, --allow-gid)")));
    }
    absl::StatusOr<std::shared_ptr<Session>> session = server_.sessions_.Authenticate(payload_);
    if (!session.ok()) return Refuse(session.status());
    if (server_.by_session_.contains((*session)->id())) {
      return Refuse(absl::FailedPreconditionError("the session already has an attach connection"));
    }
    hello_timer_.cancel();
    session_ = *std::move(session);
    session_->SetAttached(peer_);
    session_->Touch();
    server_.by_session_[session_->id()] = weak_from_this();
    spdlog::info("session {} attached: pid {} uid {} gid {}", session_->id(), peer_.pid, peer_.uid,
                 peer_.gid);
    attach::WelcomePayload welcome;
    welcome.session_id = session_->id();
    if (server_.options_.recoverable) welcome.flags |= attach::kWelcomeRecoverable;
    Send(
        Outgoing(attach::EncodeMessage(attach::MessageType::kWelcome, attach::PayloadOf(welcome))));
    WatchForClose();
  }

  // After the hello the client only listens; anything it sends, or its
  // end of stream, ends the session.
  void WatchForClose() {
    auto self = shared_from_this();
    socket_.async_read_some(
        asio::buffer(&watch_byte_, 1), [self](const boost::system::error_code& error, size_t) {
          self->Close(error ? error.message() : "unexpected data from the client");
        });
  }

  void Refuse(const absl::Status& status) {
    spdlog::warn("attach refused for pid {} uid {}: {}", peer_.pid, peer_.uid,
                 std::string(status.message()));
    attach::WelcomePayload welcome;
    welcome.status_code = static_cast<int32_t>(status.code());
    auto self = shared_from_this();
    Outgoing message(
        attach::EncodeMessage(attach::MessageType::kWelcome,
                              attach::PayloadOf(welcome, status.message().substr(0, 1024))));
    message.done = [self](absl::Status) { self->Close("attach refused"); };
    Send(std::move(message));
  }

  // Writes queued messages without blocking the I/O thread: sendmsg with
  // MSG_DONTWAIT, and a wait for writability when the socket buffer is full.
  void Flush() {
    while (!queue_.empty()) {
      Outgoing& message = queue_.front();
      iovec iov{message.bytes.data() + message.sent, message.bytes.size() - message.sent};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      alignas(cmsghdr) char control[attach::kRightsControlBytes];
      int numbers[attach::kMaxFdsPerMessage];
      if (message.sent == 0 && !message.fds.empty()) {
        // The numbers only: the message keeps owning the fds (see Outgoing).
        for (size_t i = 0; i < message.fds.size(); ++i) numbers[i] = message.fds[i].get();
        attach::AttachRights(absl::MakeConstSpan(numbers, message.fds.size()), control, &msg);
      }
      const ssize_t n = sendmsg(socket_.native_handle(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        auto self = shared_from_this();
        socket_.async_wait(Socket::wait_write, [self](const boost::system::error_code& error) {
          if (error) return self->Close(error.message());
          self->Flush();
        });
        return;
      }
      if (n < 0) return Close(absl::StrCat("sendmsg: ", std::strerror(errno)));
      message.sent += static_cast<size_t>(n);
      if (message.sent == message.bytes.size()) {
        SendCallback done = std::move(message.done);
        queue_.pop_front();
        if (done) done(absl::OkStatus());
        if (closed_) return;
      }
    }
  }

  Impl& server_;
  Socket socket_;
  asio::steady_timer hello_timer_;
  attach::MessageHeader header_;
  std::string payload_;
  char watch_byte_ = 0;
  PeerCredentials peer_;
  std::shared_ptr<Session> session_;
  std::deque<Outgoing> queue_;
  bool closed_ = false;
};

absl::StatusOr<AttachSocket> AttachServer::Listen(const AttachServerOptions& options) {
  if (absl::Status s = MakeParentDirectory(options.socket_path); !s.ok()) return s;
  if (absl::Status s = ClaimSocketPath(options.socket_path); !s.ok()) return s;
  asio::io_context io;
  asio::local::stream_protocol::acceptor acceptor(io);
  boost::system::error_code error;
  const asio::local::stream_protocol::endpoint endpoint(options.socket_path);
  acceptor.open(endpoint.protocol(), error);
  if (!error) acceptor.bind(endpoint, error);
  if (!error) acceptor.listen(asio::socket_base::max_listen_connections, error);
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat("cannot listen on attach socket ",
                                                      options.socket_path, ": ", error.message()));
  }
  UniqueFd fd(acceptor.release(error));
  if (error) {
    return absl::InternalError(
        absl::StrCat("attach socket ", options.socket_path, ": ", error.message()));
  }
  absl::StatusOr<ino_t> inode = SetSocketMode(options.socket_path, options.socket_mode);
  if (!inode.ok()) return inode.status();
  return AttachSocket(options, std::move(fd), *inode);
}

AttachSocket::~AttachSocket() {
  if (fd_.valid()) RemoveSocketIfOurs(options_.socket_path, inode_);
}

AttachServer::Impl::Impl(const AttachServerOptions& options, ino_t socket_inode, UniqueFd listener,
                         SessionManager* sessions, FdSegmentLeaser* pool,
                         DisconnectCallback on_disconnect)
    : options_(options),
      socket_inode_(socket_inode),
      sessions_(*sessions),
      pool_(*pool),
      on_disconnect_(std::move(on_disconnect)),
      acceptor_(io_) {
  boost::system::error_code error;
  acceptor_.assign(asio::local::stream_protocol(), listener.Release(), error);
  ACTSTASH_CHECK(!error, "serving the attach socket failed");
  keep_running_.emplace(asio::make_work_guard(io_));
  if (!options_.accept_later) {
    accepting_ = true;
    Accept();
  }
  thread_ = std::thread([this] { io_.run(); });
}

void AttachServer::Impl::Accept() {
  acceptor_.async_accept([this](const boost::system::error_code& error, Socket socket) {
    if (error == asio::error::operation_aborted || stopping_) return;
    all_.erase(std::remove_if(all_.begin(), all_.end(),
                              [](const std::weak_ptr<Connection>& c) { return c.expired(); }),
               all_.end());
    if (error) {
      // Out of fds (EMFILE/ENFILE) and the like: retrying at once would spin.
      const auto now = std::chrono::steady_clock::now();
      if (now - last_accept_warning_ > std::chrono::seconds(10)) {
        last_accept_warning_ = now;
        spdlog::warn("attach accept failed: {}; pausing accepts for 100 ms", error.message());
      }
      accept_backoff_.expires_after(std::chrono::milliseconds(100));
      accept_backoff_.async_wait([this](const boost::system::error_code& e) {
        if (!e && !stopping_) Accept();
      });
      return;
    }
    auto connection = std::make_shared<Connection>(this, std::move(socket));
    all_.push_back(connection);
    connection->Start(/*crowded=*/Pending().size() > kCrowdedPending);
    if (!connection->closed()) LimitPending(connection->peer_uid());
    Accept();
  });
}

std::vector<std::shared_ptr<AttachServer::Impl::Connection>> AttachServer::Impl::Pending() const {
  std::vector<std::shared_ptr<Connection>> pending;
  for (const std::weak_ptr<Connection>& weak : all_) {  // oldest first
    std::shared_ptr<Connection> connection = weak.lock();
    if (connection != nullptr && !connection->closed() && !connection->attached()) {
      pending.push_back(std::move(connection));
    }
  }
  return pending;
}

void AttachServer::Impl::LimitPending(uint32_t uid) {
  std::vector<std::shared_ptr<Connection>> pending = Pending();
  size_t of_uid = static_cast<size_t>(std::count_if(
      pending.begin(), pending.end(), [uid](const auto& c) { return c->peer_uid() == uid; }));
  size_t total = pending.size();
  for (const std::shared_ptr<Connection>& connection : pending) {
    if (total <= kMaxPendingConnections && of_uid <= kMaxPendingPerUid) break;
    const bool same_uid = connection->peer_uid() == uid;
    if (total <= kMaxPendingConnections && !same_uid) continue;  // only uid is over its limit
    connection->Close("too many connections without a hello; the oldest makes room");
    --total;
    if (same_uid) --of_uid;
    ++evicted_pending_;
  }
  const auto now = std::chrono::steady_clock::now();
  if (evicted_pending_ > 0 && now - last_eviction_warning_ > std::chrono::seconds(10)) {
    last_eviction_warning_ = now;
    spdlog::warn(
        "attach socket: {} connections closed without a hello to make room (limits: "
        "{} pending, {} per uid; last newcomer uid {})",
        evicted_pending_, kMaxPendingConnections, kMaxPendingPerUid, uid);
    evicted_pending_ = 0;
  }
}

void AttachServer::Impl::SendLeases(uint64_t session_id, std::vector<std::shared_ptr<Lease>> leases,
                                    SendCallback done) {
  absl::MutexLock lock(&stop_mu_);
  if (stopped_) {
    done(absl::UnavailableError("actstashd is shutting down"));
    return;
  }
  asio::post(io_, [this, session_id, leases = std::move(leases), done = std::move(done)] {
    auto it = by_session_.find(session_id);
    std::shared_ptr<Connection> connection = it == by_session_.end() ? nullptr : it->second.lock();
    if (connection == nullptr) {
      done(absl::FailedPreconditionError(absl::StrCat("session ", session_id,
                                                      " has no attach connection (connect to ",
                                                      options_.socket_path, " first)")));
      return;
    }
    // The leases are held here, so their segments' fds are theirs: duplicate
    // them now; the messages own the duplicates.
    std::vector<Outgoing> messages;
    for (const std::shared_ptr<Lease>& lease : leases) {
      for (uint32_t first = 0; first < lease->segments(); first += attach::kMaxFdsPerMessage) {
        attach::SegmentsPayload payload;
        payload.lease_id = lease->id();
        payload.segment_bytes = pool_.segment_bytes();
        payload.first = first;
        payload.count = std::min(attach::kMaxFdsPerMessage, lease->segments() - first);
        payload.lease_segments = lease->segments();
        Outgoing message(
            attach::EncodeMessage(attach::MessageType::kSegments, attach::PayloadOf(payload)));
        for (uint32_t i = 0; i < payload.count; ++i) {
          absl::StatusOr<UniqueFd> fd = pool_.DupSegmentFd(lease->first_segment() + first + i);
          if (!fd.ok()) {
            done(fd.status());
            return;
          }
          message.fds.push_back(*std::move(fd));
        }
        messages.push_back(std::move(message));
      }
    }
    // Queued is enough to answer: the client reads its fds after the reply,
    // and the socket drains as it does (waiting for the drain here would
    // deadlock once the messages outgrow the socket buffer).
    for (Outgoing& message : messages) connection->Send(std::move(message));
    done(connection->closed() ? absl::UnavailableError("the attach connection closed")
                              : absl::OkStatus());
  });
}

void AttachServer::Impl::Disconnect(uint64_t session_id) {
  absl::MutexLock lock(&stop_mu_);
  if (stopped_) return;
  asio::post(io_, [this, session_id] {
    auto it = by_session_.find(session_id);
    if (it == by_session_.end()) return;
    if (std::shared_ptr<Connection> connection = it->second.lock()) {
      connection->Close("the session was closed");
    }
  });
}

bool AttachServer::Impl::RunOnIo(std::function<void()> task) {
  absl::Notification done;
  {
    absl::MutexLock lock(&stop_mu_);
    if (stopped_) return false;
    asio::post(io_, [&] {
      task();
      done.Notify();
    });
  }
  done.WaitForNotification();
  return true;
}

void AttachServer::Impl::Stop() {
  {
    absl::MutexLock lock(&stop_mu_);
    if (stopped_) return;
    stopped_ = true;
    asio::post(io_, [this] {
      stopping_ = true;
      keep_running_.reset();
      boost::system::error_code ignored;
      acceptor_.close(ignored);
      accept_backoff_.cancel();
      for (const std::weak_ptr<Connection>& weak : all_) {
        if (std::shared_ptr<Connection> connection = weak.lock()) {
          connection->Close("daemon stopping");
        }
      }
      all_.clear();
    });
  }
  if (thread_.joinable()) thread_.join();
  RemoveSocketIfOurs(options_.socket_path, socket_inode_);
}

AttachServer::AttachServer(AttachSocket socket, SessionManager* sessions, FdSegmentLeaser* segments,
                           DisconnectCallback on_disconnect)
    : impl_(std::make_unique<Impl>(socket.options_, socket.inode_, std::move(socket.fd_), sessions,
                                   segments, std::move(on_disconnect))) {}

absl::StatusOr<AttachSocket> AttachServer::FromHandedListener(const AttachServerOptions& options,
                                                              UniqueFd listener) {
  struct stat st {};
  if (stat(options.socket_path.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("the handed attach socket's file ",
                                                      options.socket_path,
                                                      " is gone: ", std::strerror(errno)));
  }
  return AttachSocket(options, std::move(listener), st.st_ino);
}

absl::StatusOr<AttachServer::Handed> AttachServer::Freeze() {
  Handed handed;
  absl::Status status;
  const bool ran = impl_->RunOnIo([&] {
    Impl& server = *impl_;
    absl::StatusOr<UniqueFd> listener =
        DupFd(server.acceptor_.native_handle(), "dup of the attach listener");
    if (!listener.ok()) {
      status = listener.status();
      return;
    }
    handed.listener = *std::move(listener);
    server.frozen_ = true;
    boost::system::error_code ignored;
    server.acceptor_.close(ignored);
    server.accept_backoff_.cancel();
    for (const std::weak_ptr<Impl::Connection>& weak : server.all_) {
      std::shared_ptr<Impl::Connection> connection = weak.lock();
      if (connection != nullptr && !connection->closed() && !connection->attached()) {
        connection->Close("the daemon is handing over; attach again");
      }
    }
    for (const auto& [session_id, weak] : server.by_session_) {
      std::shared_ptr<Impl::Connection> connection = weak.lock();
      if (connection == nullptr || connection->closed()) continue;
      absl::StatusOr<UniqueFd> fd =
          DupFd(connection->native_handle(),
                absl::StrCat("dup of session ", session_id, "'s attach connection"));
      if (!fd.ok()) {
        status = fd.status();
        return;
      }
      handed.connections.emplace_back(session_id, *std::move(fd));
    }
  });
  if (!ran) return absl::FailedPreconditionError("the attach server has stopped");
  if (!status.ok()) {
    if (handed.listener.valid()) Thaw(std::move(handed.listener));
    return status;
  }
  return handed;
}

void AttachServer::StartAccepting() {
  impl_->RunOnIo([&] {
    Impl& server = *impl_;
    if (server.accepting_ || server.stopping_) return;
    server.accepting_ = true;
    server.Accept();
  });
}

void AttachServer::Thaw(UniqueFd listener) {
  std::vector<uint64_t> ended;
  impl_->RunOnIo([&] {
    Impl& server = *impl_;
    boost::system::error_code error;
    server.acceptor_.assign(asio::local::stream_protocol(), listener.Release(), error);
    if (error) spdlog::error("attach socket: cannot serve it again: {}", error.message());
    server.frozen_ = false;
    ended.swap(server.ended_while_frozen_);
    if (!error) server.Accept();
  });
  for (uint64_t session_id : ended) {
    impl_->RunOnIo([&] { impl_->on_disconnect_(session_id); });
  }
}

absl::Status AttachServer::Adopt(std::shared_ptr<Session> session, UniqueFd fd) {
  absl::Status status;
  const bool ran = impl_->RunOnIo([&] {
    Socket socket(impl_->io_);
    boost::system::error_code error;
    socket.assign(asio::local::stream_protocol(), fd.Release(), error);
    if (error) {
      status = absl::InternalError(absl::StrCat("adopting session ", session->id(),
                                                "'s attach connection: ", error.message()));
      return;
    }
    auto connection = std::make_shared<Impl::Connection>(impl_.get(), std::move(socket));
    impl_->all_.push_back(connection);
    connection->Adopt(std::move(session));
  });
  if (!ran) return absl::FailedPreconditionError("the attach server has stopped");
  return status;
}

AttachServer::~AttachServer() { Stop(); }
void AttachServer::Stop() { impl_->Stop(); }
void AttachServer::Disconnect(uint64_t session_id) { impl_->Disconnect(session_id); }
const std::string& AttachServer::socket_path() const { return impl_->options_.socket_path; }

void AttachServer::SendLeases(uint64_t session_id, std::vector<std::shared_ptr<Lease>> leases,
                              SendCallback done) {
  if (leases.empty()) {
    done(absl::OkStatus());
    return;
  }
  impl_->SendLeases(session_id, std::move(leases), std::move(done));
}

}  // namespace actstash::server
