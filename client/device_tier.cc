// The client's device tier: leases of the daemon's device pools
// (--device-pool), imported once per process (CUDA IPC) and placed by a
// LocalStore of their own, so that a trainer can park activations in another
// GPU's spare memory (peer-to-peer over NVLink/PCIe) with the same lease
// rules as host memory.
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client_impl.h"

namespace actstash {
namespace {

// Replaced by tests (a fake opener over host memory); the CUDA one otherwise.
client_internal::IpcOpenerFactory& OpenerFactory() {
  static client_internal::IpcOpenerFactory factory = client_internal::CreateCudaIpcOpener;
  return factory;
}

}  // namespace

namespace client_internal {

void SetIpcOpenerFactoryForTesting(IpcOpenerFactory factory) {
  OpenerFactory() = factory ? std::move(factory) : IpcOpenerFactory(CreateCudaIpcOpener);
}

}  // namespace client_internal

Client::Impl::~Impl() {
  StopReporter();
  absl::MutexLock lock(&device_mu);
  device_tiers.clear();  // the stores, before the importer they use
  importer.reset();
}

absl::StatusOr<std::vector<client_internal::GrantedLease>> Client::Impl::LeaseDevice(
    uint32_t device, uint32_t count, uint32_t segments_per_lease) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::LeaseRequest request;
  request.set_count(count);
  request.set_segments_per_lease(segments_per_lease);
  request.set_tier(v1::LEASE_TIER_DEVICE);
  request.set_device(device);
  v1::LeaseReply reply;
  grpc::Status status = stub->Lease(&ctx, request, &reply);
  if (!status.ok()) return Fail(status, "Lease (device pool)");
  std::vector<client_internal::GrantedLease> granted;
  std::vector<uint64_t> ids;
  absl::Status error;
  for (const v1::LeaseGrant& grant : reply.leases()) {
    ids.push_back(grant.lease_id());
    if (grant.tier() != v1::LEASE_TIER_DEVICE || grant.device() != device) {
      error = absl::InternalError(absl::StrCat("the daemon granted lease ", grant.lease_id(),
                                               " of another tier or device"));
    }
    granted.push_back(client_internal::GrantedLease{
        grant.lease_id(),
        grant.segments(),
        {},
        client_internal::DeviceGrant{grant.ipc_handle(), grant.region_bytes(), grant.offset(),
                                     grant.bytes()}});
  }
  if (!error.ok()) {
    (void)Return(ids);
    return error;
  }
  return granted;
}

absl::StatusOr<client_internal::LocalStore*> Client::Impl::DeviceStore(uint32_t device,
                                                                       size_t* index) {
  if (local == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the device pool needs the zero-copy path (", attach_status.message(), ")"));
  }
  uint64_t segment = 0;
  for (const DevicePoolInfo& pool : device_pools) {
    if (pool.device == device) segment = pool.segment_bytes;
  }
  if (segment == 0) {
    std::string have;
    for (const DevicePoolInfo& pool : device_pools) {
      absl::StrAppend(&have, have.empty() ? "" : ", ", pool.device);
    }
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon has no device pool on GPU ", device,
                     have.empty() ? " (it has none: start it with --device-pool GPU:SIZE)"
                                  : absl::StrCat(" (it has pools on GPU ", have, ")")));
  }
  absl::MutexLock lock(&device_mu);
  for (size_t i = 0; i < device_tiers.size(); ++i) {
    if (device_tiers[i]->device == device) {
      *index = i;
      return device_tiers[i]->store.get();
    }
  }
  if (importer == nullptr) {
    absl::StatusOr<std::unique_ptr<client_internal::IpcOpener>> opener = OpenerFactory()();
    if (!opener.ok()) return opener.status();
    importer =
        std::make_unique<client_internal::DeviceImporter>(*std::move(opener), options.cuda_device);
  }
  auto tier = std::make_unique<DevicePoolLeases>(this, device);
  tier->store = std::make_unique<client_internal::LocalStore>(tier.get(), segment,
                                                              options.lease_batch, importer.get());
  *index = device_tiers.size();
  device_tiers.push_back(std::move(tier));
  return device_tiers.back()->store.get();
}

client_internal::LocalStore* Client::Impl::DeviceStoreAt(size_t index) {
  absl::MutexLock lock(&device_mu);
  return index < device_tiers.size() ? device_tiers[index]->store.get() : nullptr;
}

}  // namespace actstash
