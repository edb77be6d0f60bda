#include "client/store/lease_mapper.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/huge_pages.h"

namespace actstash::client_internal {
namespace {

absl::Status WrongTier(const GrantedLease& lease) {
  return absl::InternalError(
      absl::StrCat("lease ", lease.lease_id, " does not match this store's tier or size"));
}

// Maps one lease's segment fds back to back; closes the fds either way
// (lease->fds is left empty).
absl::StatusOr<std::byte*> MapSegments(GrantedLease* lease, uint64_t segment_bytes) {
  const uint64_t bytes = uint64_t{lease->segments} * segment_bytes;
  // On a 2 MiB boundary, so that the daemon's huge pages map as huge pages
  // here too.
  std::byte* reserved = ReserveAligned(bytes);
  absl::Status status;
  if (reserved == nullptr) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("reserving ", bytes, " bytes of address space: ", std::strerror(errno)));
  }
  for (size_t i = 0; status.ok() && i < lease->fds.size(); ++i) {
    // Populated: the page-table work happens now, not on the hot path.
    const absl::Status mapped = MapSharedPopulated(reserved + i * segment_bytes, segment_bytes,
                                                   lease->fds[i].get(), NodeShmemHugePages());
    if (!mapped.ok()) {
      status = absl::Status(mapped.code(), absl::StrCat("segment ", i, " of lease ",
                                                        lease->lease_id, ": ", mapped.message()));
    }
  }
  lease->fds.clear();
  if (!status.ok()) {
    if (reserved != nullptr) munmap(reserved, bytes);
    return status;
  }
  return reserved;
}

}  // namespace

HostLeaseMapper::HostLeaseMapper(uint64_t segment_bytes, PinnedRegistrar* registrar,
                                 bool require_pinned)
    : segment_bytes_(segment_bytes), registrar_(registrar), require_pinned_(require_pinned) {}

absl::StatusOr<MappedLease> HostLeaseMapper::Map(GrantedLease* lease, uint64_t bytes) {
  if (lease->device.has_value() || uint64_t{lease->segments} * segment_bytes_ != bytes ||
      lease->fds.size() != lease->segments) {
    lease->fds.clear();
    return WrongTier(*lease);
  }
  absl::StatusOr<std::byte*> base = MapSegments(lease, segment_bytes_);  // closes the fds
  if (!base.ok()) return base.status();
  MappedLease mapped;
  mapped.base = *base;
  if (registrar_ == nullptr || !registrar_->Ready()) return mapped;
  // Once per lease, for as long as it is mapped: a CUDA copy into or out of
  // it is then a plain DMA (no staging, asynchronous).
  mapped.pin_tried = true;
  absl::Status status = registrar_->Register(mapped.base, bytes);
  if (status.ok()) {
    mapped.pinned = true;
  } else if (require_pinned_) {
    munmap(mapped.base, bytes);
    return absl::Status(status.code(), absl::StrCat("registering leased memory for CUDA (pinning "
                                                    "is required by the client's options): ",
                                                    status.message()));
  } else {
    mapped.pin_error = std::move(status);
  }
  return mapped;
}

bool HostLeaseMapper::CanPinNow() const { return registrar_ != nullptr && registrar_->Ready(); }

absl::Status HostLeaseMapper::Pin(std::byte* base, uint64_t bytes) {
  if (registrar_ == nullptr) return LeaseMapper::Pin(base, bytes);
  return registrar_->Register(base, bytes);
}

void HostLeaseMapper::Unmap(std::byte* base, uint64_t bytes, bool pinned) {
  // A failed unregister leaves nothing to undo: the range goes anyway.
  if (pinned && registrar_ != nullptr) (void)registrar_->Unregister(base);
  munmap(base, bytes);
}

DeviceLeaseMapper::DeviceLeaseMapper(DeviceImporter* importer) : importer_(importer) {}

absl::StatusOr<MappedLease> DeviceLeaseMapper::Map(GrantedLease* lease, uint64_t bytes) {
  lease->fds.clear();
  if (!lease->device.has_value() || lease->device->bytes != bytes) return WrongTier(*lease);
  absl::StatusOr<void*> base = importer_->Resolve(*lease->device);
  if (!base.ok()) return base.status();
  MappedLease mapped;
  mapped.base = static_cast<std::byte*>(*base);
  return mapped;
}

}  // namespace actstash::client_internal
