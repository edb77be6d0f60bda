// Client::Impl's zero-copy side: attaching (the attach connection, the
// registrar, the host store and its leases), the device pools' stores and the
// usage reports.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/rpc/client_impl.h"
#include "common/address.h"

namespace actstash {

absl::Status Client::Impl::Attach(const std::string& socket_name) {
  const std::string grpc_socket = UnixSocketPath(rpc->target());
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
      client_internal::AttachConnection::Connect(path, rpc->token(), options.connect_timeout,
                                                 options.reattach_timeout);
  if (!channel.ok()) {
    attach_status = channel.status();
    return attach_status;
  }
  registrar = *std::move(pinner);
  attach = *std::move(channel);
  rpc->SetAttach(attach.get());
  host_leases = std::make_unique<client_internal::HostLeases>(
      rpc.get(), attach.get(), options.numa_node, spill_enabled && options.spill);
  local = std::make_unique<client_internal::LocalStore>(
      host_leases.get(), segment_bytes, options.lease_batch, registrar.get(),
      options.pin_leases == PinPolicy::kOn, options.restore_ahead, options.pool_wait,
      options.lease_retain);
  attach_status = absl::OkStatus();
  StartReporter();
  return attach_status;
}

absl::StatusOr<client_internal::LocalStore*> Client::Impl::DeviceStore(uint32_t device,
                                                                       size_t* index) {
  if (local == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the device pool needs the zero-copy path (", attach_status.message(), ")"));
  }
  return device_tiers->StoreFor(device, index);
}

absl::Status Client::Impl::ReportUsage(const v1::ClientUsage& usage, uint64_t* reclaim_bytes) {
  v1::ReportUsageReply reply;
  absl::Status s = rpc->Call(&v1::Stash::Stub::ReportUsage, usage, &reply, "ReportUsage");
  if (reclaim_bytes != nullptr) *reclaim_bytes = s.ok() ? reply.reclaim_bytes() : 0;
  return s;
}

void Client::Impl::StartReporter() {
  reporter = std::make_unique<client_internal::UsageReporter>(
      options.usage_report_interval, [this] { return TotalUsage(); },
      [this](const v1::ClientUsage& usage) -> uint64_t {
        uint64_t asked = 0;
        if (!rpc->Lost()) (void)ReportUsage(usage, &asked);
        return asked;
      },
      [this](uint64_t bytes) {
        // Another session waits for the pool: what this one can give, on this
        // (the reporter's) thread. A failure is the next store's to meet.
        if (local != nullptr) (void)local->GiveForOthers(bytes);
      });
  reporter->Start();
}

}  // namespace actstash
