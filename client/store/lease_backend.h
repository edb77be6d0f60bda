// LeaseBackend: where a LocalStore's leases come from, and where its spilled
// blocks go. The daemon (Lease/Return/Spill/Restore RPCs plus the attach
// channel: client/rpc/host_leases.h), a device pool (client/rpc/device_tiers.cc), or
// a fake in unit tests.
#ifndef ACTSTASH_CLIENT_STORE_LEASE_BACKEND_H_
#define ACTSTASH_CLIENT_STORE_LEASE_BACKEND_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/store/lease_mapper.h"

namespace actstash::client_internal {

// A lease's bytes on the daemon's disk: the spill's id and the XXH3 64 of
// the bytes written (0 when the daemon did not say).
struct SpillFile {
  uint64_t id = 0;
  uint64_t checksum = 0;
};

// Called with no LocalStore lock held, by one thread at a time for Lease.
class LeaseBackend {
 public:
  virtual ~LeaseBackend() = default;
  virtual absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t count,
                                                          uint32_t segments_per_lease) = 0;
  virtual absl::Status Return(absl::Span<const uint64_t> lease_ids) = 0;
  // True once the daemon is gone: nothing more can be leased or returned.
  virtual bool Lost() const = 0;
  // Whether leased memory may be taken back once Lost(): a daemon that
  // restarts with its state (and frees what no client reclaims) does; one
  // that died for good leaves the mappings' pages to this client.
  virtual bool MemoryReclaimedWhenLost() const { return false; }
  // The one error for "the daemon went away" (UNAVAILABLE): `what` failed,
  // `consequence` says what is lost and what still works. The real backend
  // names the daemon's address and how to start it again.
  virtual absl::Status GoneError(absl::string_view what, absl::string_view consequence) const;
  // Spill tier (the daemon's disk). Without one (the default) nothing
  // spills. Spill writes whole leases and answers one spill per lease, all
  // or nothing; the leases stay this client's. Restore reads a spill back
  // into a lease of the same size and deletes it; `resent` says whether
  // the call went to the daemon more than once (it restarted meanwhile), so
  // that a NOT_FOUND may follow a read-back done before it went down.
  // DropSpilled deletes spills no longer needed. Any thread, concurrently.
  virtual bool CanSpill() const { return false; }
  // `return_bytes`: how much memory the daemon asks back (another session
  // waits for the pool and this one holds more than its share).
  virtual absl::StatusOr<std::vector<SpillFile>> Spill(absl::Span<const uint64_t> lease_ids,
                                                       uint64_t* return_bytes) {
    return absl::UnimplementedError("no spill tier");
  }
  virtual absl::Status Restore(uint64_t spill_id, uint64_t lease_id, bool* resent) {
    return absl::UnimplementedError("no spill tier");
  }
  virtual absl::Status DropSpilled(absl::Span<const uint64_t> spill_ids) {
    return absl::UnimplementedError("no spill tier");
  }
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_LEASE_BACKEND_H_
