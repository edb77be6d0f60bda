// SessionRpc: how the calls of one open session reach the daemon: the stub,
// the session's token and deadline on every call, and the one place a failed
// call becomes a Status (AnnotateRpcError, or the one "went away" error once
// the attach connection says the daemon is gone). Private to the client
// library; used by Client and by its rooms (HostLeases, DeviceTiers).
//
// Thread-safety: set up by Client::Connect (SetToken) and Client::Impl::Attach
// (SetAttach) before any other thread can reach it; read-only afterwards, so
// any thread may call the const members. The deadline is atomic:
// ShortenDeadline (the Client's destructor) may run while the store's
// background threads still return or lease.
#ifndef ACTSTASH_CLIENT_RPC_SESSION_RPC_H_
#define ACTSTASH_CLIENT_RPC_SESSION_RPC_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "client/rpc/attach_connection.h"

namespace actstash::client_internal {

class SessionRpc {
 public:
  // A stub on `channel` for the daemon at `target` (as the user named it,
  // resolved), every call bounded by `rpc_timeout`.
  SessionRpc(std::string target, std::shared_ptr<grpc::Channel> channel,
             std::chrono::milliseconds rpc_timeout);
  SessionRpc(const SessionRpc&) = delete;
  SessionRpc& operator=(const SessionRpc&) = delete;

  void SetToken(std::string token) { token_ = std::move(token); }
  // The attach connection (not owned; it must outlive every call that may
  // fail), consulted when a call finds the daemon unreachable.
  void SetAttach(AttachConnection* attach) { attach_ = attach; }
  void ShortenDeadline(std::chrono::milliseconds limit) {
    int64_t now = rpc_timeout_ms_.load(std::memory_order_relaxed);
    while (limit.count() < now &&
           !rpc_timeout_ms_.compare_exchange_weak(now, limit.count(), std::memory_order_relaxed)) {
    }
  }

  v1::Stash::Stub& stub() const { return *stub_; }
  const std::string& target() const { return target_; }
  const std::string& token() const { return token_; }
  std::chrono::milliseconds rpc_timeout() const {
    return std::chrono::milliseconds(rpc_timeout_ms_.load(std::memory_order_relaxed));
  }

  // Sets the call's deadline and the session's token.
  void Prepare(grpc::ClientContext* ctx) const;
  // One unary call of the stub (`method`, e.g. &v1::Stash::Stub::Stats):
  // Prepare'd, and a failure made the session's error by Fail. Streaming
  // calls (Put, Get) Prepare and Fail themselves.
  //
  // A daemon that does not answer while the attach connection stays open
  // is being replaced (actstashd --take-over hands the connection to its
  // successor, server/handover/take_over.h): a pause, not an error. The call
  // is then sent again, waiting for the channel to reconnect, until the
  // call's deadline. A call the daemon refused is never repeated: an
  // unreachable daemon has not run it.
  template <typename Request, typename Reply>
  absl::Status Call(grpc::Status (v1::Stash::Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Reply*),
                    const Request& request, Reply* reply, const char* what) const {
    const auto deadline = std::chrono::system_clock::now() + rpc_timeout();
    for (bool again = false;; again = true) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      ctx.set_deadline(deadline);
      ctx.set_wait_for_ready(again);
      const grpc::Status status = ((*stub_).*method)(&ctx, request, reply);
      if (status.ok()) return absl::OkStatus();
      if (!Paused(status)) return Fail(status, what);
      if (!again) paused_calls_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // Calls that found the daemon paused (being replaced) and were sent again.
  uint64_t paused_calls() const { return paused_calls_.load(std::memory_order_relaxed); }
  // A failed call's error. An attached client whose call found the daemon
  // unreachable looks at the attach connection (briefly: the kernel closes a
  // dead daemon's sockets one after the other) so that a daemon that went
  // away gives the one "went away" error, whichever the client noticed first.
  absl::Status Fail(const grpc::Status& status, const char* what) const;
  // Whether `status` says the daemon did not answer while the attach
  // connection is alive (see Call).
  bool Paused(const grpc::Status& status) const;
  // True once the attach connection saw the daemon go.
  bool Lost() const { return attach_ != nullptr && attach_->lost(); }
  // The one error for "the daemon went away" (see client/rpc/channel.h).
  absl::Status GoneError(absl::string_view what, absl::string_view consequence) const;

 private:
  const std::string target_;
  const std::unique_ptr<v1::Stash::Stub> stub_;
  std::atomic<int64_t> rpc_timeout_ms_;
  std::string token_;
  AttachConnection* attach_ = nullptr;
  mutable std::atomic<uint64_t> paused_calls_{0};
};

// Gives leases of any tier back to the daemon (the Return RPC).
absl::Status ReturnLeases(const SessionRpc& rpc, absl::Span<const uint64_t> lease_ids);

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_SESSION_RPC_H_
