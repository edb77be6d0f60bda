// DeviceTiers: a client's stores in the daemon's device pools
// (actstashd --device-pool GPU:SIZE), so that a trainer can park activations
// in another GPU's spare memory (peer-to-peer over NVLink/PCIe) with the same
// lease rules as host memory. One LocalStore per pool it uses, created at
// first use, with one importer that maps the pools' regions into this
// process (CUDA IPC, each opened once). Private to the client library.
//
// Thread-safety: any thread; the table of stores is guarded by mu_, and a
// store, once made, lives as long as this object.
#ifndef ACTSTASH_CLIENT_RPC_DEVICE_TIERS_H_
#define ACTSTASH_CLIENT_RPC_DEVICE_TIERS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "actstash/client.h"
#include "client/rpc/session_rpc.h"
#include "client/store/device_import.h"
#include "client/store/local_store.h"

namespace actstash::client_internal {

class DeviceTiers {
 public:
  // The daemon's pools as OpenSession announced them. `rpc` is not owned
  // and must outlive this; `cuda_device` imports (ClientOptions::cuda_device).
  DeviceTiers(const SessionRpc* rpc, std::vector<DevicePoolInfo> pools, uint32_t lease_batch,
              int cuda_device);
  // The stores go before the importer whose mappings they use.
  ~DeviceTiers();
  DeviceTiers(const DeviceTiers&) = delete;
  DeviceTiers& operator=(const DeviceTiers&) = delete;

  const std::vector<DevicePoolInfo>& pools() const { return pools_; }
  // The store of the pool on `device` (the daemon's CUDA ordinal) and its
  // index, created (with the importer) at first use. FAILED_PRECONDITION
  // naming the pools there are when the daemon has none on `device`; the
  // importer's error when CUDA IPC cannot be opened.
  absl::StatusOr<LocalStore*> StoreFor(uint32_t device, size_t* index) ABSL_LOCKS_EXCLUDED(mu_);
  // The store of index `index` (from a ticket), or null.
  LocalStore* StoreAt(size_t index) const ABSL_LOCKS_EXCLUDED(mu_);
  // Adds every store's usage to `total`.
  void AddUsage(v1::ClientUsage* total) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class PoolLeases;  // the LeaseBackend of one pool's store
  // Leases device segments of the pool on `device`.
  absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t device, uint32_t count,
                                                  uint32_t segments_per_lease) const;

  const SessionRpc& rpc_;
  const std::vector<DevicePoolInfo> pools_;
  const uint32_t lease_batch_;
  const int cuda_device_;
  mutable absl::Mutex mu_;
  std::unique_ptr<DeviceImporter> importer_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<PoolLeases>> tiers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_DEVICE_TIERS_H_
