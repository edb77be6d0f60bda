#include "client/rpc/device_tiers.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace actstash::client_internal {
namespace {

// Replaced by tests (a fake opener over host memory); the CUDA one otherwise.
IpcOpenerFactory& OpenerFactory() {
  static IpcOpenerFactory factory = CreateCudaIpcOpener;
  return factory;
}

}  // namespace

void SetIpcOpenerFactoryForTesting(IpcOpenerFactory factory) {
  OpenerFactory() = factory ? std::move(factory) : IpcOpenerFactory(CreateCudaIpcOpener);
}

class DeviceTiers::PoolLeases final : public LeaseBackend {
 public:
  PoolLeases(const DeviceTiers* tiers, uint32_t device) : tiers_(*tiers), device_(device) {}
  absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t count,
                                                  uint32_t segments_per_lease) override {
    return tiers_.Lease(device_, count, segments_per_lease);
  }
  absl::Status Return(absl::Span<const uint64_t> lease_ids) override {
    return ReturnLeases(tiers_.rpc_, lease_ids);
  }
  bool Lost() const override { return tiers_.rpc_.Lost(); }
  absl::Status GoneError(absl::string_view what, absl::string_view consequence) const override {
    return tiers_.rpc_.GoneError(what, consequence);
  }

  uint32_t device() const { return device_; }
  // Set once, right after construction (under the table's lock).
  std::unique_ptr<LocalStore> store;

 private:
  const DeviceTiers& tiers_;
  const uint32_t device_;
};

DeviceTiers::DeviceTiers(const SessionRpc* rpc, std::vector<DevicePoolInfo> pools,
                         uint32_t lease_batch, int cuda_device)
    : rpc_(*rpc), pools_(std::move(pools)), lease_batch_(lease_batch), cuda_device_(cuda_device) {}

DeviceTiers::~DeviceTiers() {
  absl::MutexLock lock(&mu_);
  tiers_.clear();
  importer_.reset();
}

absl::StatusOr<std::vector<GrantedLease>> DeviceTiers::Lease(uint32_t device, uint32_t count,
                                                             uint32_t segments_per_lease) const {
  v1::LeaseRequest request;
  request.set_count(count);
  request.set_segments_per_lease(segments_per_lease);
  request.set_tier(v1::LEASE_TIER_DEVICE);
  request.set_device(device);
  v1::LeaseReply reply;
  if (absl::Status s = rpc_.Call(&v1::Stash::Stub::Lease, request, &reply, "Lease (device pool)");
      !s.ok()) {
    return s;
  }
  std::vector<GrantedLease> granted;
  std::vector<uint64_t> ids;
  absl::Status error;
  for (const v1::LeaseGrant& grant : reply.leases()) {
    ids.push_back(grant.lease_id());
    if (grant.tier() != v1::LEASE_TIER_DEVICE || grant.device() != device) {
      error = absl::InternalError(absl::StrCat("the daemon granted lease ", grant.lease_id(),
                                               " of another tier or device"));
    }
    granted.push_back(GrantedLease{
        grant.lease_id(),
        grant.segments(),
        {},
        DeviceGrant{grant.ipc_handle(), grant.region_bytes(), grant.offset(), grant.bytes()}});
  }
  if (!error.ok()) {
    (void)ReturnLeases(rpc_, ids);
    return error;
  }
  return granted;
}

absl::StatusOr<LocalStore*> DeviceTiers::StoreFor(uint32_t device, size_t* index) {
  uint64_t segment = 0;
  for (const DevicePoolInfo& pool : pools_) {
    if (pool.device == device) segment = pool.segment_bytes;
  }
  if (segment == 0) {
    std::string have;
    for (const DevicePoolInfo& pool : pools_) {
      absl::StrAppend(&have, have.empty() ? "" : ", ", pool.device);
    }
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon has no device pool on GPU ", device,
                     have.empty() ? " (it has none: start it with --device-pool GPU:SIZE)"
                                  : absl::StrCat(" (it has pools on GPU ", have, ")")));
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < tiers_.size(); ++i) {
    if (tiers_[i]->device() == device) {
      *index = i;
      return tiers_[i]->store.get();
    }
  }
  if (importer_ == nullptr) {
    absl::StatusOr<std::unique_ptr<IpcOpener>> opener = OpenerFactory()();
    if (!opener.ok()) return opener.status();
    importer_ = std::make_unique<DeviceImporter>(*std::move(opener), cuda_device_);
  }
  auto tier = std::make_unique<PoolLeases>(this, device);
  tier->store = std::make_unique<LocalStore>(tier.get(), segment, lease_batch_, importer_.get());
  *index = tiers_.size();
  tiers_.push_back(std::move(tier));
  return tiers_.back()->store.get();
}

LocalStore* DeviceTiers::StoreAt(size_t index) const {
  absl::MutexLock lock(&mu_);
  return index < tiers_.size() ? tiers_[index]->store.get() : nullptr;
}

void DeviceTiers::AddUsage(v1::ClientUsage* total) const {
  absl::MutexLock lock(&mu_);
  for (const std::unique_ptr<PoolLeases>& tier : tiers_) {
    client_internal::AddUsage(tier->store->usage(), total);
  }
}

}  // namespace actstash::client_internal
