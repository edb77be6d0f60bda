// AttachServer: the attach channel (Boost.Asio, Unix socket beside the gRPC
// one). A local client presents its session token; the daemon checks the
// peer's credentials (SO_PEERCRED) and binds the connection to the session.
// Segment memfds of the session's leases then travel over it (SCM_RIGHTS),
// and only over it. Its end is the session's end: when it closes (client
// exit, crash, SIGKILL) the owner's disconnect callback reclaims the session.
#ifndef ACTSTASH_SERVER_RPC_ATTACH_SERVER_H_
#define ACTSTASH_SERVER_RPC_ATTACH_SERVER_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "server/pool/segment_leaser.h"
#include "server/rpc/attach_channel.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session_manager.h"

namespace actstash::server {

struct AttachServerOptions {
  std::string socket_path;
  uint32_t socket_mode = 0660;
  // Peers allowed to attach: any uid in allow_uids or gid in allow_gids.
  // Both empty: anyone who can open the socket. The daemon's own uid is
  // always allowed.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  std::chrono::milliseconds hello_timeout{5000};
  // Tell clients they may attach again after a crash (kWelcomeRecoverable):
  // the daemon's state outlives it.
  bool recoverable = false;
  // Accept nothing until StartAccepting (connections wait in the backlog):
  // a daemon that adopts sessions first (after a crash or a take-over) must
  // not refuse their clients' hellos meanwhile.
  bool accept_later = false;
};

// The attach socket, bound and listening (AttachServer::Listen) but not
// served yet: its path is claimed, and connections wait in the backlog.
// Move-only. An AttachServer takes it over; dropped unserved, it closes
// and removes its socket file.
class AttachSocket {
 public:
  AttachSocket(AttachSocket&&) = default;
  AttachSocket& operator=(AttachSocket&&) = delete;
  ~AttachSocket();

  const std::string& path() const { return options_.socket_path; }
  // The listening socket (owned here; -1 once served or moved from).
  int listener_fd() const { return fd_.get(); }

 private:
  friend class AttachServer;
  AttachSocket(AttachServerOptions options, UniqueFd fd, ino_t inode)
      : options_(std::move(options)), fd_(std::move(fd)), inode_(inode) {}

  AttachServerOptions options_;
  UniqueFd fd_;  // the listener; empty once served or moved from
  ino_t inode_ = 0;
};

// Thread model: one I/O thread owns every connection. SendLeases and
// Disconnect may be called from any thread; callbacks (disconnect, send
// completion) run on the I/O thread and must not block.
class AttachServer final : public AttachChannel {
 public:
  using DisconnectCallback = std::function<void(uint64_t session_id)>;

  // Claims the socket path (a live listener there refuses, a stale socket
  // file is removed), binds and listens, with the options' mode.
  // FAILED_PRECONDITION (or the claim's error) when it cannot.
  static absl::StatusOr<AttachSocket> Listen(const AttachServerOptions& options);
  // Serves `socket` on a new I/O thread. `sessions` and `segments` (the
  // host pool's) are not owned and must outlive the server. `on_disconnect`
  // runs on the I/O thread when the attach connection of a session ends
  // while the server runs (client exit, crash, SIGKILL): the owner reclaims
  // the session. Connections bind to sessions only, so it never runs before
  // a session exists.
  AttachServer(AttachSocket socket, SessionManager* sessions, FdSegmentLeaser* segments,
               DisconnectCallback on_disconnect);
  // Stops (see Stop).
  ~AttachServer() override;
  AttachServer(const AttachServer&) = delete;
  AttachServer& operator=(const AttachServer&) = delete;

  // AttachChannel. SendLeases answers UNAVAILABLE at once, on the calling
  // thread, once the server stopped.
  void SendLeases(uint64_t session_id, std::vector<std::shared_ptr<Lease>> leases,
                  SendCallback done) override;
  // Closes the session's attach connection (after CloseSession), without
  // the disconnect callback's reclaim mattering: the session is gone.
  void Disconnect(uint64_t session_id) override;

  // Take-over (server/handover). Freeze, on the serving daemon: a duplicate
  // of the listener and of each attached session's connection; from then on
  // nothing is accepted, connections without a hello are closed, and a
  // connection that ends reclaims nothing (until Thaw). Thaw: serves again
  // on `listener` (Freeze's) after a take-over that did not happen, and
  // reclaims the sessions whose connections ended meanwhile.
  struct Handed {
    UniqueFd listener;
    std::vector<std::pair<uint64_t, UniqueFd>> connections;  // (session id, connection)
  };
  absl::StatusOr<Handed> Freeze();
  void Thaw(UniqueFd listener);
  // On the successor: binds a handed connection to its session as a hello
  // would have (before the successor serves anything).
  absl::Status Adopt(std::shared_ptr<Session> session, UniqueFd fd);
  // The successor's attach socket: the handed listener, whose path the
  // serving daemon left in place.
  static absl::StatusOr<AttachSocket> FromHandedListener(const AttachServerOptions& options,
                                                         UniqueFd listener);

  // Starts accepting (with options.accept_later); idempotent. Any thread.
  void StartAccepting();

  // Closes the listener and every connection, without disconnect callbacks,
  // joins the I/O thread and removes the socket file. Idempotent; call it
  // from one thread (the owner's).
  void Stop();

  const std::string& socket_path() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_ATTACH_SERVER_H_
