// DeviceImporter: the client's side of the daemon's device pool. A device
// lease grant names the pool's region by its CUDA IPC handle (the same for
// every grant of that pool) and a byte range in it; the importer opens each
// handle once per process (cudaIpcOpenMemHandle, with lazy peer access so
// that a pool on another GPU works over NVLink/PCIe) and turns grants into
// device pointers. The CUDA part is an IpcOpener, replaceable in tests.
//
// Trust: an opened handle maps the whole pool, not just the leased range;
// the device pool is for trusted, same-uid trainers (see the daemon's
// server/pool/device_pool.h).
#ifndef ACTSTASH_CLIENT_STORE_DEVICE_IMPORT_H_
#define ACTSTASH_CLIENT_STORE_DEVICE_IMPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace actstash::client_internal {

// Size of a CUDA IPC handle (cudaIpcMemHandle_t) as the daemon sends it.
inline constexpr size_t kDeviceIpcHandleBytes = 64;

// Maps and unmaps exported device regions. Implementations are thread-safe.
class IpcOpener {
 public:
  virtual ~IpcOpener() = default;
  // Maps the region exported as `handle` (kDeviceIpcHandleBytes bytes) on
  // `local_device` (this process's CUDA ordinal); its base address.
  virtual absl::StatusOr<void*> Open(absl::string_view handle, int local_device) = 0;
  // Unmaps a base that Open returned.
  virtual absl::Status Close(void* base, int local_device) = 0;
};

// cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess) and
// cudaIpcCloseMemHandle; the caller's current device is restored after each
// call. FAILED_PRECONDITION when built without CUDA or no device is visible.
absl::StatusOr<std::unique_ptr<IpcOpener>> CreateCudaIpcOpener();

// Makes the IpcOpener the client's device tier uses (CreateCudaIpcOpener).
using IpcOpenerFactory = std::function<absl::StatusOr<std::unique_ptr<IpcOpener>>()>;
// Tests only: replaces it for clients that import their first device lease
// from now on; an empty factory restores the CUDA one. Not thread-safe
// against clients importing concurrently.
void SetIpcOpenerFactoryForTesting(IpcOpenerFactory factory);

// What a device lease grant (actstash.v1.LeaseGrant, tier DEVICE) says.
struct DeviceGrant {
  std::string ipc_handle;     // kDeviceIpcHandleBytes opaque bytes
  uint64_t region_bytes = 0;  // size of the exported region
  uint64_t offset = 0;        // of the leased range in the region
  uint64_t bytes = 0;         // of the leased range
};

// Thread-safe. Every handle is opened at most once, by the first Resolve
// that names it (others naming it wait for that), and closed when the
// importer is destroyed: pointers it returned are valid until then (and for
// as long as the lease is held: after a Return the memory is another
// tenant's).
class DeviceImporter {
 public:
  DeviceImporter(std::unique_ptr<IpcOpener> opener, int local_device);
  ~DeviceImporter();
  DeviceImporter(const DeviceImporter&) = delete;
  DeviceImporter& operator=(const DeviceImporter&) = delete;

  // The device pointer of the grant's range. INVALID_ARGUMENT (with the
  // numbers) for a malformed grant: a handle of the wrong size, an empty
  // range, a range outside the region, or a region size that differs from
  // the one this handle was first imported with; the opener's error when the
  // handle cannot be opened (nothing is cached then: a later call retries).
  absl::StatusOr<void*> Resolve(const DeviceGrant& grant) ABSL_LOCKS_EXCLUDED(mu_);
  // Handles opened so far.
  size_t imported() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Imported {
    void* base = nullptr;
    uint64_t region_bytes = 0;
  };

  const std::unique_ptr<IpcOpener> opener_;
  const int local_device_;
  mutable absl::Mutex mu_;
  std::map<std::string, Imported> imported_ ABSL_GUARDED_BY(mu_);  // by handle bytes
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_DEVICE_IMPORT_H_
