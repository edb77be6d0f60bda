// AttachServer: the attach channel (Boost.Asio, Unix socket beside the gRPC
// one). A local client presents its session token; the daemon checks the
// peer's credentials (SO_PEERCRED) and binds the connection to the session.
// Segment memfds of the session's leases then travel over it (SCM_RIGHTS),
// and only over it. Its end is the session's end: when it closes (client
// exit, crash, SIGKILL) the disconnect callback reclaims the session.
#ifndef ACTSTASH_SERVER_ATTACH_SERVER_H_
#define ACTSTASH_SERVER_ATTACH_SERVER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/lease_manager.h"
#include "server/memory_pool.h"
#include "server/session_manager.h"

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
};

// Thread model: one I/O thread owns every connection. SendLeases may be
// called from any thread; callbacks (disconnect, send completion) run on the
// I/O thread and must not block.
class AttachServer {
 public:
  using DisconnectCallback = std::function<void(uint64_t session_id)>;
  using SendCallback = std::function<void(absl::Status)>;

  // Claims the socket path and starts listening. `sessions` and `pool` must
  // outlive the server.
  static absl::StatusOr<std::unique_ptr<AttachServer>> Start(const AttachServerOptions& options,
                                                             SessionManager* sessions,
                                                             MemoryPool* pool,
                                                             DisconnectCallback on_disconnect);
  // Stops (see Stop).
  ~AttachServer();
  AttachServer(const AttachServer&) = delete;
  AttachServer& operator=(const AttachServer&) = delete;

  // Queues the memfds of `leases` (duplicates) for the attach connection of
  // `session_id`, one message per lease (or per 128 segments), then calls
  // `done`: OK once queued (the client reads them after its Lease reply),
  // FAILED_PRECONDITION without a connection, UNAVAILABLE when the
  // connection is closed or the server stopped (then at once, on the
  // calling thread).
  void SendLeases(uint64_t session_id, std::vector<std::shared_ptr<Lease>> leases,
                  SendCallback done);
  // Closes the session's attach connection (after CloseSession), without
  // the disconnect callback's reclaim mattering: the session is gone.
  void Disconnect(uint64_t session_id);

  // Closes the listener and every connection, without disconnect callbacks,
  // joins the I/O thread and removes the socket file. Idempotent.
  void Stop();

  const std::string& socket_path() const;

 private:
  class Impl;
  explicit AttachServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_ATTACH_SERVER_H_
