// SessionRpc: how the calls of one open session reach the daemon: the stub,
// the session's token and deadline on every call, and the one place a failed
// call becomes a Status (AnnotateRpcError, or the one "went away" error once
// the attach connection says the daemon is gone). Private to the client
// library; used by Client and by its rooms (HostLeases, DeviceTiers).
//
// Thread-safety: set up by Client::Connect (SetToken, SetUnattachedPauseLimit)
// and Client::Impl::Attach (SetAttach) before any other thread can reach it; read-only afterwards,
// so any thread may call the const members. The deadline is atomic: ShortenDeadline (the Client's
// destructor) may run while the store's background threads still return or lease.
#ifndef ACTSTASH_CLIENT_RPC_SESSION_RPC_H_
#define ACTSTASH_CLIENT_RPC_SESSION_RPC_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <algorithm>
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
  // How long a call of an unattached session waits for a daemon that does
  // not answer (see Retrying); 0: not at all.
  void SetUnattachedPauseLimit(std::chrono::milliseconds limit) { unattached_pause_limit_ = limit; }
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
  // One unary call of the stub (`method`, e.g. &v1::Stash::Stub::Stats)
  // through Retrying.
  template <typename Request, typename Reply>
  absl::Status Call(grpc::Status (v1::Stash::Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Reply*),
                    const Request& request, Reply* reply, const char* what,
                    bool* resent = nullptr) const {
    return Retrying(
        what, [&](grpc::ClientContext* ctx) { return ((*stub_).*method)(ctx, request, reply); },
        resent);
  }
  // Runs `attempt(ctx)` (one whole call of the stub, a Put or Get stream
  // included, on a Prepare'd context bounded by the call's deadline) and
  // makes a failure the session's error by Fail.
  //
  // A daemon that does not answer is being replaced (actstashd --take-over
  // hands the session to its successor, server/restart/take_over.h) or
  // restarted under a service manager: a pause, not an error. For an
  // attached session that is so while the attach connection stays open (or
  // reattaches); an unattached one cannot tell, so it waits up to its pause
  // limit (ClientOptions::reattach_timeout). The call is then sent again,
  // waiting for the channel to reconnect, until the deadline; one that runs
  // out of time without a daemon to talk to fails with the pause's
  // UNAVAILABLE, and an unattached session's later calls then fail at once
  // until one gets through (a daemon that is gone does not cost every call
  // its limit). A call the
  // daemon refused is never repeated: an unreachable or draining daemon has
  // not run it, but one that crashed may have run it and lost its answer:
  // `resent` (if set) says whether the call was tried again after a pause
  // (whether or not the first try reached a daemon), for a caller whose call
  // is not idempotent (a Restore deletes its spill).
  //
  // A Put is resent too: a stopping daemon cancels the calls it has not
  // started, and waits for those it runs to send their status first, so a
  // CANCELLED Put was not stored; one that a crash or restart cut short
  // after it was is stored once all the same (Client::Put sends the same
  // ObjectHeader.put_id each time).
  template <typename Attempt>
  absl::Status Retrying(const char* what, Attempt attempt, bool* resent = nullptr) const {
    const auto deadline = std::chrono::system_clock::now() + rpc_timeout();
    auto until = deadline;
    grpc::Status pause;
    for (bool again = false;; again = true) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      ctx.set_deadline(until);
      ctx.set_wait_for_ready(again);
      const grpc::Status status = attempt(&ctx);
      if (status.ok()) {
        if (unattached_gone_.load(std::memory_order_relaxed)) {
          unattached_gone_.store(false, std::memory_order_relaxed);
        }
        return absl::OkStatus();
      }
      if (again && status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !Connected()) {
        // The daemon never came back within the limit (a call it answered
        // too slowly is the deadline's error, below).
        if (attach_ == nullptr) unattached_gone_.store(true, std::memory_order_relaxed);
        return Fail(pause, what);
      }
      if (!Paused(status)) return Fail(status, what);
      if (resent != nullptr) *resent = true;
      if (!again) {
        paused_calls_.fetch_add(1, std::memory_order_relaxed);
        pause = status;
        if (attach_ == nullptr)
          until = std::min(deadline, std::chrono::system_clock::now() + unattached_pause_limit_);
      }
    }
  }
  // Calls that found the daemon paused (being replaced) and were sent again.
  uint64_t paused_calls() const { return paused_calls_.load(std::memory_order_relaxed); }
  // A failed call's error. An attached client whose call found the daemon
  // unreachable looks at the attach connection (briefly: the kernel closes a
  // dead daemon's sockets one after the other) so that a daemon that went
  // away gives the one "went away" error, whichever the client noticed first.
  absl::Status Fail(const grpc::Status& status, const char* what) const;
  // Whether the channel is connected to a daemon now.
  bool Connected() const;
  // Whether `status` says the daemon did not answer while the attach
  // connection is alive, or for an unattached session at all (see Retrying).
  bool Paused(const grpc::Status& status) const;
  // True once the attach connection saw the daemon go.
  bool Lost() const { return attach_ != nullptr && attach_->lost(); }
  // The one error for "the daemon went away" (see client/rpc/channel.h).
  absl::Status GoneError(absl::string_view what, absl::string_view consequence) const;

 private:
  const std::string target_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Stash::Stub> stub_;
  std::atomic<int64_t> rpc_timeout_ms_;
  std::string token_;
  AttachConnection* attach_ = nullptr;
  std::chrono::milliseconds unattached_pause_limit_{0};
  mutable std::atomic<bool> unattached_gone_{false};  // a pause ran out (see Retrying)
  mutable std::atomic<uint64_t> paused_calls_{0};
};

// Gives leases of any tier back to the daemon (the Return RPC).
absl::Status ReturnLeases(const SessionRpc& rpc, absl::Span<const uint64_t> lease_ids);

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_SESSION_RPC_H_
