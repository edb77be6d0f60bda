// HostLeases: where a client's host store gets its leases: the Lease RPC
// (host tier, naming the NUMA node the caller copies from) whose memfds
// arrive over the attach connection, Return, and the daemon's spill tier
// (Spill, Restore, DropSpilled). Private to the client library.
//
// Thread-safety: any thread; the store calls Lease one at a time, the others
// concurrently. Immutable after construction.
#ifndef ACTSTASH_CLIENT_RPC_HOST_LEASES_H_
#define ACTSTASH_CLIENT_RPC_HOST_LEASES_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/rpc/attach_connection.h"
#include "client/rpc/session_rpc.h"
#include "client/store/local_store.h"
#include "common/numa_node.h"

namespace actstash::client_internal {

class HostLeases final : public LeaseBackend {
 public:
  // `rpc` and `attach` are not owned and must outlive this. `numa_node`:
  // ClientOptions::numa_node (-1: as LeaseNumaNode chooses).
  // `can_spill`: the daemon has a spill tier and the client may use it.
  HostLeases(const SessionRpc* rpc, AttachConnection* attach, int numa_node, bool can_spill)
      : rpc_(*rpc), attach_(*attach), numa_node_(numa_node), can_spill_(can_spill) {}

  absl::StatusOr<std::vector<GrantedLease>> Lease(uint32_t count,
                                                  uint32_t segments_per_lease) override;
  absl::Status Return(absl::Span<const uint64_t> lease_ids) override;
  bool Lost() const override { return rpc_.Lost(); }
  bool MemoryReclaimedWhenLost() const override { return attach_.daemon_may_reclaim(); }
  absl::Status GoneError(absl::string_view what, absl::string_view consequence) const override {
    return rpc_.GoneError(what, consequence);
  }
  bool CanSpill() const override { return can_spill_; }
  absl::StatusOr<std::vector<SpillFile>> Spill(absl::Span<const uint64_t> lease_ids,
                                               uint64_t* return_bytes) override;
  absl::Status Restore(uint64_t spill_id, uint64_t lease_id, bool* resent) override;
  absl::Status DropSpilled(absl::Span<const uint64_t> spill_ids) override;

 private:
  // One Lease call and the receipt of its fds.
  absl::StatusOr<std::vector<GrantedLease>> LeaseOnce(uint32_t count, uint32_t segments_per_lease);

  const SessionRpc& rpc_;
  AttachConnection& attach_;
  LeaseNumaNode numa_node_;
  const bool can_spill_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_HOST_LEASES_H_
