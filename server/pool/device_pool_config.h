// The --device-pool setting: which GPUs get a device pool, and how big.
#ifndef ACTSTASH_SERVER_POOL_DEVICE_POOL_CONFIG_H_
#define ACTSTASH_SERVER_POOL_DEVICE_POOL_CONFIG_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace actstash::server {

// One --device-pool entry: `bytes` (whole segments) of device memory on
// CUDA device `device` (the daemon's ordinal).
struct DevicePoolConfig {
  int device = 0;
  uint64_t bytes = 0;
};

// Parses --device-pool: "GPU:SIZE[,GPU:SIZE...]", each SIZE at least one
// segment (rounded down to whole segments), one entry per GPU.
// INVALID_ARGUMENT naming the bad entry otherwise. Thread-safe.
absl::StatusOr<std::vector<DevicePoolConfig>> ParseDevicePools(absl::string_view text,
                                                               uint64_t segment_bytes);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_POOL_DEVICE_POOL_CONFIG_H_
