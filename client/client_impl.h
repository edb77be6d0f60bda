// Client::Impl: the state behind actstash::Client, and its zero-copy side
// (the LeaseBackend of its LocalStore, the attach channel, the usage
// reporter). Private to the client library.
//
// Thread-safety: the members set by Connect/Attach are read-only afterwards;
// `closed` is atomic; the usage reporter is a room of its own
// (client/usage_reporter.h).
#ifndef ACTSTASH_CLIENT_CLIENT_IMPL_H_
#define ACTSTASH_CLIENT_CLIENT_IMPL_H_

#include <grpcpp/client_context.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "actstash/client.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "client/attach_connection.h"
#include "client/channel.h"
#include "client/local_store.h"
#include "client/usage_reporter.h"
#include "common/address.h"
#include "common/numa_node.h"
#include "common/pinned_registrar.h"
#include "common/protocol.h"
#include "common/tiered_id.h"
#include "common/tristate.h"
#include "common/unique_fd.h"

namespace actstash {

// The public PinPolicy is the registrar's Tristate under another name: the
// same enumerators with the same values, so one converts by a cast.
static_assert(static_cast<int>(PinPolicy::kAuto) == static_cast<int>(Tristate::kAuto) &&
              static_cast<int>(PinPolicy::kOn) == static_cast<int>(Tristate::kOn) &&
              static_cast<int>(PinPolicy::kOff) == static_cast<int>(Tristate::kOff));

struct Client::Impl final : public client_internal::LeaseBackend {
  ClientOptions options;
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Stash::Stub> stub;
  uint64_t session_id = 0;
  std::string token;
  uint64_t quota_bytes = 0;
  uint64_t max_chunk_bytes = kMaxChunkBytes;
  uint64_t segment_bytes = 0;
  std::atomic<bool> closed{false};
  // Zero-copy data plane; both null when not attached.
  std::unique_ptr<client_internal::AttachConnection> attach;
  // Registers leases with CUDA (ClientOptions::pin_leases); null: none.
  // Declared before `local`, so it is destroyed after it (LocalStore
  // unregisters what it unmaps).
  std::unique_ptr<PinnedRegistrar> registrar;
  std::unique_ptr<client_internal::LocalStore> local;
  // The daemon's device pools (from OpenSession) and this client's stores in
  // them, created at first use; the importer maps their regions.
  // One device pool as this client uses it: the LeaseBackend of its store.
  struct DevicePoolLeases final : public client_internal::LeaseBackend {
    DevicePoolLeases(Impl* impl, uint32_t device) : impl(impl), device(device) {}
    absl::StatusOr<std::vector<client_internal::GrantedLease>> Lease(
        uint32_t count, uint32_t segments_per_lease) override {
      return impl->LeaseDevice(device, count, segments_per_lease);
    }
    absl::Status Return(absl::Span<const uint64_t> lease_ids) override {
      return impl->Return(lease_ids);
    }
    bool Lost() const override { return impl->Lost(); }
    absl::Status GoneError(absl::string_view what, absl::string_view consequence) const override {
      return impl->GoneError(what, consequence);
    }

    Impl* const impl;
    const uint32_t device;
    std::unique_ptr<client_internal::LocalStore> store;  // set once, under device_mu
  };
  std::vector<DevicePoolInfo> device_pools;
  absl::Mutex device_mu;
  std::unique_ptr<client_internal::DeviceImporter> importer ABSL_GUARDED_BY(device_mu);
  std::vector<std::unique_ptr<DevicePoolLeases>> device_tiers ABSL_GUARDED_BY(device_mu);
  absl::Status attach_status = absl::FailedPreconditionError("not attached");
  // Usage reporter (only when attached; set once, by Attach).
  std::unique_ptr<client_internal::UsageReporter> reporter;

  ~Impl() override;

  // LeaseBackend: the Lease RPC, then the fds from the attach channel.
  absl::StatusOr<std::vector<client_internal::GrantedLease>> Lease(
      uint32_t count, uint32_t segments_per_lease) override {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::LeaseRequest request;
    request.set_count(count);
    request.set_segments_per_lease(segments_per_lease);
    const int numa_node = options.numa_node >= 0 ? options.numa_node : CallerNumaNode();
    if (numa_node >= 0) request.set_numa_node(numa_node);
    v1::LeaseReply reply;
    grpc::Status status = stub->Lease(&ctx, request, &reply);
    if (!status.ok()) return Fail(status, "Lease");
    std::vector<client_internal::GrantedLease> granted;
    std::vector<uint64_t> stale;  // leases of earlier calls that timed out here
    absl::Status error;
    for (const v1::LeaseGrant& grant : reply.leases()) {
      client_internal::GrantedLease lease{grant.lease_id(), grant.segments(), {}, std::nullopt};
      if (error.ok()) {
        absl::StatusOr<std::vector<UniqueFd>> fds =
            attach->ReceiveLease(grant.lease_id(), grant.segments(), options.rpc_timeout, &stale);
        if (fds.ok()) {
          lease.fds = *std::move(fds);
        } else {
          error = fds.status();
        }
      }
      granted.push_back(std::move(lease));
    }
    if (!error.ok()) {
      for (client_internal::GrantedLease& lease : granted) {
        lease.fds.clear();
        stale.push_back(lease.lease_id);
      }
    }
    // Best effort: the daemon frees what it still has of these; the rest
    // goes when the session closes.
    if (!stale.empty()) (void)Return(stale);
    if (!error.ok()) return error;
    return granted;
  }

  absl::Status Return(absl::Span<const uint64_t> lease_ids) override {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::ReturnRequest request;
    for (uint64_t id : lease_ids) request.add_lease_ids(id);
    v1::ReturnReply reply;
    grpc::Status status = stub->Return(&ctx, request, &reply);
    return status.ok() ? absl::OkStatus() : Fail(status, "Return");
  }

  bool Lost() const override { return attach != nullptr && attach->lost(); }
  absl::Status GoneError(absl::string_view what, absl::string_view consequence) const override {
    return client_internal::DaemonWentAway(target, what, consequence);
  }

  // Spill tier: the daemon's Spill/Restore/DropSpilled.
  bool spill_enabled = false;  // the daemon has one (OpenSession)
  bool CanSpill() const override { return spill_enabled && options.spill; }
  absl::StatusOr<std::vector<uint64_t>> Spill(absl::Span<const uint64_t> lease_ids,
                                              uint64_t* return_bytes) override {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::SpillRequest request;
    for (uint64_t id : lease_ids) request.add_lease_ids(id);
    v1::SpillReply reply;
    grpc::Status status = stub->Spill(&ctx, request, &reply);
    if (!status.ok()) return Fail(status, "Spill");
    std::vector<uint64_t> ids;
    for (const v1::SpilledLease& spilled : reply.spilled()) ids.push_back(spilled.spill_id());
    *return_bytes = reply.return_bytes();
    return ids;
  }
  absl::Status Restore(uint64_t spill_id, uint64_t lease_id) override {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::RestoreRequest request;
    request.set_spill_id(spill_id);
    request.set_lease_id(lease_id);
    v1::RestoreReply reply;
    grpc::Status status = stub->Restore(&ctx, request, &reply);
    return status.ok() ? absl::OkStatus() : Fail(status, "Restore");
  }
  absl::Status DropSpilled(absl::Span<const uint64_t> spill_ids) override {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::DropSpilledRequest request;
    for (uint64_t id : spill_ids) request.add_spill_ids(id);
    v1::DropSpilledReply reply;
    grpc::Status status = stub->DropSpilled(&ctx, request, &reply);
    return status.ok() ? absl::OkStatus() : Fail(status, "DropSpilled");
  }

  // Leases device segments of the daemon's device pool on `device`.
  absl::StatusOr<std::vector<client_internal::GrantedLease>> LeaseDevice(
      uint32_t device, uint32_t count, uint32_t segments_per_lease);
  // The store of the device pool on `device` (created, with the importer, at
  // first use). Only when attached.
  absl::StatusOr<client_internal::LocalStore*> DeviceStore(uint32_t device, size_t* index)
      ABSL_LOCKS_EXCLUDED(device_mu);
  // The store of tier index `index` (from a ticket), or null.
  client_internal::LocalStore* DeviceStoreAt(size_t index) ABSL_LOCKS_EXCLUDED(device_mu);

  // Zero-copy ticket ids (common/tiered_id.h): the host store's in tier 0,
  // device store `index`'s in tier index + 1.
  static uint64_t DeviceTicket(size_t index, uint64_t local_id) {
    return tiered_id::Make(static_cast<uint32_t>(index + 1), local_id);
  }
  // The store a zero-copy ticket belongs to and its id there; null if none.
  client_internal::LocalStore* StoreOf(uint64_t id, uint64_t* local_id) {
    *local_id = tiered_id::SerialOf(id);
    const uint32_t tier = tiered_id::TierOf(id);
    return tier == 0 ? local.get() : DeviceStoreAt(tier - 1);
  }

  // This client's zero-copy usage: the host store and its device stores.
  // The zero-copy usage of every local store (host and device tiers) summed.
  v1::ClientUsage TotalUsage() ABSL_LOCKS_EXCLUDED(device_mu) {
    v1::ClientUsage total = local->usage();
    absl::MutexLock lock(&device_mu);
    for (const std::unique_ptr<DevicePoolLeases>& tier : device_tiers) {
      client_internal::AddUsage(tier->store->usage(), &total);
    }
    return total;
  }

  absl::Status ReportUsage() { return ReportUsage(TotalUsage()); }
  absl::Status ReportUsage(const v1::ClientUsage& usage) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::ReportUsageReply reply;
    grpc::Status status = stub->ReportUsage(&ctx, usage, &reply);
    return status.ok() ? absl::OkStatus() : Fail(status, "ReportUsage");
  }

  void StartReporter() {
    reporter = std::make_unique<client_internal::UsageReporter>(
        options.usage_report_interval, [this] { return TotalUsage(); },
        [this](const v1::ClientUsage& usage) {
          if (!Lost()) (void)ReportUsage(usage);
        });
    reporter->Start();
  }

  void StopReporter() {
    if (reporter != nullptr) reporter->Stop();
  }

  absl::Status CheckOpen() const {
    if (closed.load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError("the actstash session was closed");
    }
    return absl::OkStatus();
  }
  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() + options.rpc_timeout);
    ctx->AddMetadata(kTokenMetadataKey, token);
  }
  // A failed RPC's error. An attached client whose RPC found the daemon
  // unreachable looks at the attach connection (briefly: the kernel closes a
  // dead daemon's sockets one after the other) so that a daemon that went
  // away gives the one "went away" error, whichever the client noticed first.
  absl::Status Fail(const grpc::Status& status, const char* what) const {
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE && attach != nullptr &&
        attach->ConfirmLost(std::chrono::milliseconds(200))) {
      return GoneError(what, "this session, its leases and its spilled buffers are gone");
    }
    return client_internal::AnnotateRpcError(status, target, what, options.rpc_timeout);
  }

  // Connects the attach channel (the attach socket sits beside the gRPC
  // socket, under the name the daemon gave) and starts the zero-copy path.
  absl::Status Attach(const std::string& socket_name) {
    const std::string grpc_socket = UnixSocketPath(target);
    // The segment size comes from the daemon: it must make sense before the
    // arenas are built on it.
    if (segment_bytes % 4096 != 0 || segment_bytes > (uint64_t{1} << 40)) {
      attach_status = absl::InternalError(
          absl::StrCat("not attached: the daemon announced a segment size of ", segment_bytes));
      return attach_status;
    }
    if (grpc_socket.empty() || socket_name.empty() || segment_bytes == 0) {
      attach_status = absl::FailedPreconditionError(
          "not attached: the daemon is not on a local Unix socket (zero-copy needs one)");
      return attach_status;
    }
    absl::StatusOr<std::unique_ptr<PinnedRegistrar>> pinner = RegistrarForPolicy(
        static_cast<Tristate>(options.pin_leases), nullptr, /*only_in_cuda_threads=*/true);
    if (!pinner.ok()) {  // kOn without a usable device
      attach_status = pinner.status();
      return attach_status;
    }
    const std::string path = grpc_socket.substr(0, grpc_socket.find_last_of('/') + 1) + socket_name;
    absl::StatusOr<std::unique_ptr<client_internal::AttachConnection>> channel =
        client_internal::AttachConnection::Connect(path, token, options.connect_timeout);
    if (!channel.ok()) {
      attach_status = channel.status();
      return attach_status;
    }
    registrar = *std::move(pinner);
    attach = *std::move(channel);
    local = std::make_unique<client_internal::LocalStore>(
        this, segment_bytes, options.lease_batch, registrar.get(),
        options.pin_leases == PinPolicy::kOn, options.restore_ahead, options.pool_wait,
        options.lease_retain);
    attach_status = absl::OkStatus();
    StartReporter();
    return attach_status;
  }

  // Streams an object: the header goes to `on_header`, which returns where
  // the payload goes (or an error, which cancels the stream).
  absl::StatusOr<ObjectInfo> Fetch(
      Handle handle, const std::function<absl::StatusOr<std::byte*>(const ObjectInfo&)>& on_header);
};

}  // namespace actstash

#endif  // ACTSTASH_CLIENT_CLIENT_IMPL_H_
