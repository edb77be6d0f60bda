// AttachChannel: what the Stash handlers use of the attach connections (the
// per-session Unix connections that carry lease fds): sending a grant's fds
// and closing a closed session's connection. AttachServer implements it;
// the handlers see only this, so the attach server and the handlers' state
// (StashCore) do not hold each other.
#ifndef ACTSTASH_SERVER_RPC_ATTACH_CHANNEL_H_
#define ACTSTASH_SERVER_RPC_ATTACH_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "server/sessions/lease_manager.h"

namespace actstash::server {

// Thread-safe: both members may be called from any thread.
class AttachChannel {
 public:
  using SendCallback = std::function<void(absl::Status)>;

  virtual ~AttachChannel() = default;

  // Queues the memfds of `leases` (duplicates) for the attach connection of
  // `session_id`, then calls `done` (perhaps on another thread, never
  // blocking there): OK once queued (the client reads them after its Lease
  // reply), FAILED_PRECONDITION without a connection, UNAVAILABLE when the
  // connection is closed or the channel stopped.
  virtual void SendLeases(uint64_t session_id, std::vector<std::shared_ptr<Lease>> leases,
                          SendCallback done) = 0;
  // Closes the session's attach connection (after the session was closed:
  // nothing may travel to it any more).
  virtual void Disconnect(uint64_t session_id) = 0;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_ATTACH_CHANNEL_H_
