#include "server/pool/device_pool.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/units.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

#ifndef ACTSTASH_HAVE_CUDA
// The CUDA implementation is server/device_memory_cuda.cc.
absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateCudaDeviceMemory() {
  return absl::FailedPreconditionError(
      "device pools need CUDA, and this actstashd was built without CUDA");
}
#endif

absl::StatusOr<std::unique_ptr<DevicePool>> DevicePool::Create(DeviceMemory* memory,
                                                               const DevicePoolOptions& options) {
  if (options.device < 0 || options.device >= memory->device_count()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", options.device, " (", memory->device_count(), " visible)"));
  }
  if (options.segment_bytes == 0) return absl::InvalidArgumentError("segment size 0");
  const uint64_t bytes = options.pool_bytes - options.pool_bytes % options.segment_bytes;
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device pool of ", FormatBytes(options.pool_bytes), " on GPU ", options.device,
                     " is smaller than one segment (", FormatBytes(options.segment_bytes), ")"));
  }
  absl::StatusOr<DeviceRegion> region = memory->Allocate(options.device, bytes);
  if (!region.ok()) {
    return absl::Status(region.status().code(),
                        absl::StrCat("allocating the ", FormatBytes(bytes), " device pool on GPU ",
                                     options.device, ": ", region.status().message()));
  }
  auto fail = [&](absl::string_view what, const absl::Status& status) {
    if (absl::Status freed = memory->Free(*region); !freed.ok()) {
      spdlog::warn("freeing the device pool on GPU {}: {}", options.device, freed.ToString());
    }
    return absl::Status(status.code(), absl::StrCat(what, " the device pool on GPU ",
                                                    options.device, ": ", status.message()));
  };
  // Whatever the memory held before (another process's data) never reaches
  // a client.
  if (absl::Status s = memory->Zero(*region, 0, bytes); !s.ok()) return fail("zeroing", s);
  absl::StatusOr<std::string> handle = memory->ExportIpcHandle(*region);
  if (!handle.ok()) return fail("exporting", handle.status());
  if (handle->size() != kIpcHandleBytes) {
    return fail("exporting",
                absl::InternalError(absl::StrCat("IPC handle of ", handle->size(), " bytes")));
  }
  return std::unique_ptr<DevicePool>(
      new DevicePool(memory, *region, *std::move(handle), options.segment_bytes));
}

DevicePool::DevicePool(DeviceMemory* memory, DeviceRegion region, std::string ipc_handle,
                       uint64_t segment_bytes)
    : memory_(*memory),
      region_(region),
      ipc_handle_(std::move(ipc_handle)),
      segment_bytes_(segment_bytes),
      segments_(region.bytes / segment_bytes),
      allocator_(segments_, 1) {}

DevicePool::~DevicePool() {
  {
    absl::MutexLock lock(&mu_);
    ACTSTASH_CHECK(allocator_.allocation_count() == 0,
                   "DevicePool destroyed while segments are leased");
  }
  if (absl::Status s = memory_.Free(region_); !s.ok()) {
    spdlog::warn("freeing the device pool on GPU {}: {}", region_.device, s.ToString());
  }
}

absl::StatusOr<SegmentRun> DevicePool::AllocateSegments(uint32_t count, int /*numa_node*/) {
  if (count == 0 || count > segments_) {
    return absl::ResourceExhaustedError(absl::StrCat("requested ", count,
                                                     " segments; the device pool on GPU ",
                                                     region_.device, " has ", segments_));
  }
  const uint64_t bytes = uint64_t{count} * segment_bytes_;
  absl::MutexLock lock(&mu_);
  // The allocator counts segments.
  std::optional<uint64_t> first = allocator_.Allocate(count);
  if (!first.has_value()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device pool on GPU ", region_.device, " exhausted: requested ", count,
        " contiguous segments (", bytes, " bytes), available ",
        allocator_.free_bytes() * segment_bytes_, " bytes free of ", region_.bytes,
        ", largest free block ", allocator_.largest_free_block() * segment_bytes_, " bytes"));
  }
  const uint64_t offset = *first * segment_bytes_;
  SegmentRun run;
  run.first_segment = static_cast<uint32_t>(*first);
  run.count = count;
  run.needs_scrub = false;
  // A device address: never dereferenced in the daemon.
  run.memory =
      MakeAllocation(this, reinterpret_cast<std::byte*>(region_.address + offset), offset, bytes);
  return run;
}

absl::Status DevicePool::RenewSegments(const SegmentRun& run) {
  return memory_.Zero(region_, uint64_t{run.first_segment} * segment_bytes_,
                      uint64_t{run.count} * segment_bytes_);
}

PoolStats DevicePool::Stats() const {
  absl::MutexLock lock(&mu_);
  PoolStats stats;
  stats.set_total_bytes(region_.bytes);
  stats.set_used_bytes(allocator_.used_bytes() * segment_bytes_);
  stats.set_free_bytes(allocator_.free_bytes() * segment_bytes_);
  stats.set_largest_free_bytes(allocator_.largest_free_block() * segment_bytes_);
  stats.set_segment_bytes(segment_bytes_);
  stats.set_segments(segments_);
  stats.set_allocations(allocator_.allocation_count());
  return stats;
}

void DevicePool::Free(uint64_t offset) {
  absl::MutexLock lock(&mu_);
  ACTSTASH_CHECK(offset % segment_bytes_ == 0 &&
                     allocator_.AllocationSize(offset / segment_bytes_).has_value(),
                 "freeing a range the device pool did not hand out");
  allocator_.Free(offset / segment_bytes_);
}

}  // namespace actstash::server
