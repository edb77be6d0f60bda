#include "client/rpc/session_rpc.h"

#include <thread>
#include <utility>

#include "client/rpc/channel.h"
#include "common/protocol.h"

namespace actstash::client_internal {

SessionRpc::SessionRpc(std::string target, std::shared_ptr<grpc::Channel> channel,
                       std::chrono::milliseconds rpc_timeout)
    : target_(std::move(target)),
      channel_(channel),
      stub_(v1::Stash::NewStub(std::move(channel))),
      rpc_timeout_ms_(rpc_timeout.count()) {}

void SessionRpc::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() + rpc_timeout());
  ctx->AddMetadata(kTokenMetadataKey, token_);
}

absl::Status SessionRpc::Fail(const grpc::Status& status, const char* what) const {
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE && attach_ != nullptr &&
      attach_->ConfirmLost(std::chrono::milliseconds(200))) {
    return GoneError(what, "this session, its leases and its spilled buffers are gone");
  }
  return AnnotateRpcError(status, target_, what, rpc_timeout());
}

bool SessionRpc::Connected() const {
  return channel_->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
}

bool SessionRpc::Paused(const grpc::Status& status) const {
  // UNAVAILABLE: no daemon answered, or one that stops serving refused the
  // call before running it. CANCELLED: this library cancels none of its
  // unary calls, so the daemon did; it does so only when it stops serving,
  // to calls it had received but not started (those it started finish
  // first, server/daemon/daemon.cc StopServing). ConfirmLost waits up to its
  // limit for a closing connection to show: also the pause between tries
  // (a draining daemon answers at once), which an unattached session sleeps.
  const grpc::StatusCode code = status.error_code();
  if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::CANCELLED) return false;
  if (attach_ == nullptr) {
    if (unattached_pause_limit_.count() == 0 || unattached_gone_.load(std::memory_order_relaxed)) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return true;
  }
  return !attach_->ConfirmLost(std::chrono::milliseconds(200));
}

absl::Status SessionRpc::GoneError(absl::string_view what, absl::string_view consequence) const {
  return DaemonWentAway(target_, what, consequence,
                        attach_ == nullptr ? std::string() : attach_->lost_detail());
}

absl::Status ReturnLeases(const SessionRpc& rpc, absl::Span<const uint64_t> lease_ids) {
  v1::ReturnRequest request;
  for (uint64_t id : lease_ids) request.add_lease_ids(id);
  v1::ReturnReply reply;
  return rpc.Call(&v1::Stash::Stub::Return, request, &reply, "Return");
}

}  // namespace actstash::client_internal
