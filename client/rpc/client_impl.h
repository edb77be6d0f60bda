// Client::Impl: the state behind actstash::Client, wired from rooms with one
// job each: SessionRpc (calls and their errors), HostLeases (the host store's
// leases and spill tier), LocalStore (zero-copy placement), DeviceTiers (the
// daemon's device pools) and UsageReporter. Private to the client library.
//
// Thread-safety: the members set by Connect/Attach are read-only afterwards;
// `closed` is atomic; each room is thread-safe on its own terms (its header).
#ifndef ACTSTASH_CLIENT_RPC_CLIENT_IMPL_H_
#define ACTSTASH_CLIENT_RPC_CLIENT_IMPL_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "actstash/client.h"
#include "actstash/v1/stash.pb.h"
#include "client/rpc/attach_connection.h"
#include "client/rpc/device_tiers.h"
#include "client/rpc/host_leases.h"
#include "client/rpc/session_rpc.h"
#include "client/rpc/usage_reporter.h"
#include "client/store/local_store.h"
#include "common/pinned_registrar.h"
#include "common/protocol.h"
#include "common/tiered_id.h"
#include "common/tristate.h"

namespace actstash {

// The public PinPolicy is the registrar's Tristate under another name: the
// same enumerators with the same values, so one converts by a cast.
static_assert(static_cast<int>(PinPolicy::kAuto) == static_cast<int>(Tristate::kAuto) &&
              static_cast<int>(PinPolicy::kOn) == static_cast<int>(Tristate::kOn) &&
              static_cast<int>(PinPolicy::kOff) == static_cast<int>(Tristate::kOff));

struct Client::Impl final {
  ClientOptions options;
  std::unique_ptr<client_internal::SessionRpc> rpc;  // set by Connect, before anything else
  uint64_t session_id = 0;
  uint64_t quota_bytes = 0;
  uint64_t max_chunk_bytes = kMaxChunkBytes;
  uint64_t segment_bytes = 0;
  bool spill_enabled = false;  // the daemon has a spill tier (OpenSession)
  std::atomic<bool> closed{false};
  std::atomic<uint64_t> state_bytes{0};  // ReserveState'd and not released
  // v1::ObjectHeader.put_id of the next Put: one id per Put, the same for
  // each time it is sent, so the daemon stores it once.
  std::atomic<uint64_t> next_put_id{1};
  // Zero-copy data plane (Attach); all null when not attached. Declared in
  // the order they depend on each other, so that they go in reverse: the
  // store unregisters (registrar) and returns (leases) what it unmaps, and
  // the leases receive over the attach connection.
  std::unique_ptr<client_internal::AttachConnection> attach;
  // Registers leases with CUDA (ClientOptions::pin_leases); null: none.
  std::unique_ptr<PinnedRegistrar> registrar;
  std::unique_ptr<client_internal::HostLeases> host_leases;
  std::unique_ptr<client_internal::LocalStore> local;
  // The daemon's device pools (from OpenSession) and this client's stores in
  // them; set by Connect.
  std::unique_ptr<client_internal::DeviceTiers> device_tiers;
  absl::Status attach_status = absl::FailedPreconditionError("not attached");
  // Usage reporter (only when attached; set once, by Attach).
  std::unique_ptr<client_internal::UsageReporter> reporter;

  ~Impl() { StopReporter(); }

  // The store of the device pool on `device` and its index (see
  // DeviceTiers::StoreFor); FAILED_PRECONDITION when not attached.
  absl::StatusOr<client_internal::LocalStore*> DeviceStore(uint32_t device, size_t* index);

  // Zero-copy ticket ids (common/tiered_id.h): the host store's in tier 0,
  // device store `index`'s in tier index + 1.
  static uint64_t DeviceTicket(size_t index, uint64_t local_id) {
    return tiered_id::Make(static_cast<uint32_t>(index + 1), local_id);
  }
  // The store a zero-copy ticket belongs to and its id there; null if none.
  client_internal::LocalStore* StoreOf(uint64_t id, uint64_t* local_id) {
    *local_id = tiered_id::SerialOf(id);
    const uint32_t tier = tiered_id::TierOf(id);
    return tier == 0 ? local.get() : device_tiers->StoreAt(tier - 1);
  }

  // The zero-copy usage of every local store (host and device tiers) summed.
  v1::ClientUsage TotalUsage() {
    v1::ClientUsage total = local->usage();
    device_tiers->AddUsage(&total);
    total.set_state_bytes(state_bytes.load(std::memory_order_relaxed));
    return total;
  }
  absl::Status ReportUsage() { return ReportUsage(TotalUsage()); }
  // Sends `usage`; `reclaim_bytes` (if set): what the daemon asked back.
  absl::Status ReportUsage(const v1::ClientUsage& usage, uint64_t* reclaim_bytes = nullptr);
  void StartReporter();
  void StopReporter() {
    if (reporter != nullptr) reporter->Stop();
  }

  absl::Status CheckOpen() const {
    if (closed.load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError("the actstash session was closed");
    }
    return absl::OkStatus();
  }

  // Connects the attach channel (the attach socket sits beside the gRPC
  // socket, under the name the daemon gave) and starts the zero-copy path.
  absl::Status Attach(const std::string& socket_name);

  // Streams an object: the header goes to `on_header`, which returns where
  // the payload goes (or an error, which cancels the stream).
  absl::StatusOr<ObjectInfo> Fetch(
      Handle handle, const std::function<absl::StatusOr<std::byte*>(const ObjectInfo&)>& on_header);
};

}  // namespace actstash

#endif  // ACTSTASH_CLIENT_RPC_CLIENT_IMPL_H_
