// LeaseMapper: how one tier's granted leases become memory of this process,
// and stop being it. LocalStore places buffers in leases; what a lease's bytes
// are (host segments mapped from memfds and registered for CUDA, or ranges of
// a daemon device pool opened over CUDA IPC) is the mapper's. The two tiers
// are two types, each with its own rules, not a flag of the store.
#ifndef ACTSTASH_CLIENT_STORE_LEASE_MAPPER_H_
#define ACTSTASH_CLIENT_STORE_LEASE_MAPPER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/store/device_import.h"
#include "common/pinned_registrar.h"
#include "common/unique_fd.h"

namespace actstash::client_internal {

// A lease as the daemon granted it.
struct GrantedLease {
  uint64_t lease_id = 0;
  uint32_t segments = 0;
  std::vector<UniqueFd> fds;          // host: one per segment
  std::optional<DeviceGrant> device;  // device tier: where in the pool's region
};

// One lease made addressable.
struct MappedLease {
  std::byte* base = nullptr;
  bool pinned = false;     // registered for CUDA
  bool pin_tried = false;  // registration was tried (it is not tried again)
  absl::Status pin_error;  // why a tried registration failed (mapped unpinned)
};

// Thread-safe: every method may run on any thread, concurrently, with no
// LocalStore lock held (they make syscalls and CUDA calls). The pointers a
// mapper is built with must outlive it.
class LeaseMapper {
 public:
  virtual ~LeaseMapper() = default;
  // Device memory: only CUDA copies reach its bytes (no host memcpy), and
  // they do not outlive the daemon (it zeroes and grants device segments
  // again in place), so they neither spill nor survive its going away.
  virtual bool on_device() const = 0;
  // Maps a lease of `bytes` (its segments back to back). Consumes the fds
  // (lease->fds is empty afterwards, whatever the outcome). INTERNAL for a
  // lease of another tier or size; the mapping's or registration's error.
  virtual absl::StatusOr<MappedLease> Map(GrantedLease* lease, uint64_t bytes) = 0;
  // Whether this tier's leases are registered for CUDA at all (fixed).
  virtual bool registers() const { return false; }
  // Whether registering from the calling thread can work now (a lease mapped
  // by a thread without CUDA work is registered by the first that has some).
  virtual bool CanPinNow() const { return false; }
  // Registers a mapped, unpinned lease; then Unmap gets pinned = true.
  virtual absl::Status Pin(std::byte* base, uint64_t bytes) {
    return absl::UnimplementedError("this tier's leases are not registered");
  }
  // Undoes Map (and Pin when `pinned`). The lease must hold no buffer in use.
  virtual void Unmap(std::byte* base, uint64_t bytes, bool pinned) = 0;
};

// Host leases: memfd segments mapped back to back (MAP_POPULATE, so page-table
// work happens at lease time, not per buffer). With a registrar, each lease
// is registered once when mapped (when registrar->Ready()); a failure fails
// Map when `require_pinned`, else the lease maps unpinned and Map reports it.
class HostLeaseMapper final : public LeaseMapper {
 public:
  HostLeaseMapper(uint64_t segment_bytes, PinnedRegistrar* registrar, bool require_pinned);
  bool on_device() const override { return false; }
  absl::StatusOr<MappedLease> Map(GrantedLease* lease, uint64_t bytes) override;
  bool registers() const override { return registrar_ != nullptr; }
  bool CanPinNow() const override;
  absl::Status Pin(std::byte* base, uint64_t bytes) override;
  void Unmap(std::byte* base, uint64_t bytes, bool pinned) override;

 private:
  const uint64_t segment_bytes_;
  PinnedRegistrar* const registrar_;  // null: leases are never registered
  const bool require_pinned_;
};

// Device leases: ranges of a daemon device pool, resolved by `importer`,
// which keeps each region open until it is destroyed (Unmap does nothing).
class DeviceLeaseMapper final : public LeaseMapper {
 public:
  explicit DeviceLeaseMapper(DeviceImporter* importer);
  bool on_device() const override { return true; }
  absl::StatusOr<MappedLease> Map(GrantedLease* lease, uint64_t bytes) override;
  void Unmap(std::byte* base, uint64_t bytes, bool pinned) override {}

 private:
  DeviceImporter* const importer_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_LEASE_MAPPER_H_
