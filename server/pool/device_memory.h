// DeviceMemory: the few operations on GPU memory that a device pool needs
// (one region per pool: allocate, export as a CUDA IPC handle, zero, free),
// behind an interface so that the pool's logic is tested on the CPU with a
// fake (host memory standing in for the device's).
#ifndef ACTSTASH_SERVER_POOL_DEVICE_MEMORY_H_
#define ACTSTASH_SERVER_POOL_DEVICE_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace actstash::server {

// Size of an exported handle (cudaIpcMemHandle_t): opaque bytes.
inline constexpr size_t kIpcHandleBytes = 64;

// One allocation. `address` is the device's virtual address, meaningful
// only to the DeviceMemory that made it (a fake may use a host pointer).
struct DeviceRegion {
  int device = -1;
  uint64_t address = 0;
  uint64_t bytes = 0;
};

// Thread-safe: every member may be called from any thread (the CUDA
// implementation selects the region's device on the calling thread first).
// A region must be freed by the DeviceMemory that allocated it, which must
// outlive it.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // Devices visible to this process.
  virtual int device_count() const = 0;
  // One line for the start-up log ("NVIDIA H100 80GB HBM3, 79.1 GiB of 79.6 GiB free").
  virtual std::string Describe(int device) const = 0;
  // `bytes` (> 0) of memory on `device` (< device_count()). RESOURCE_EXHAUSTED
  // when the device has no room; INTERNAL with the CUDA error otherwise.
  virtual absl::StatusOr<DeviceRegion> Allocate(int device, uint64_t bytes) = 0;
  // The region's IPC handle: kIpcHandleBytes opaque bytes that another
  // process opens (cudaIpcOpenMemHandle) to map the whole region.
  virtual absl::StatusOr<std::string> ExportIpcHandle(const DeviceRegion& region) = 0;
  // Zeroes [offset, offset + bytes) of the region and waits until done.
  virtual absl::Status Zero(const DeviceRegion& region, uint64_t offset, uint64_t bytes) = 0;
  // Gives the region back. Processes that opened its IPC handle keep the
  // memory alive until they close it (a CUDA rule).
  virtual absl::Status Free(const DeviceRegion& region) = 0;
};

// The CUDA runtime implementation. FAILED_PRECONDITION when this build has
// no CUDA ("built without CUDA") or no device is visible.
absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateCudaDeviceMemory();

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_DEVICE_MEMORY_H_
