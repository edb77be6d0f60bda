// HostLeases: where a client's host store gets its leases: the Lease RPC
// (host tier, naming the NUMA node the caller copies from) whose memfds
// arrive over the attach connection, Return, and the daemon's spill tier
// (Spill, Restore, DropSpilled). Private to the client library.
//
// It remembers which host leases it holds (granted and not given back), so
// that after the daemon restarted or was taken over, the first Lease call
// first tells the daemon (ConfirmLeases): a grant the old daemon recorded
// but whose answer never arrived would otherwise count against the
// session's quota until the session ends.
//
// Thread-safety: any thread; the store calls Lease one at a time, the others
// concurrently.
#ifndef ACTSTASH_CLIENT_RPC_HOST_LEASES_H_
#define ACTSTASH_CLIENT_RPC_HOST_LEASES_H_

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  // ConfirmLeases once per reattach (before the next grant); a failure is
  // tried again at the next Lease call.
  void ConfirmAfterRestart() ABSL_LOCKS_EXCLUDED(held_mu_);

  const SessionRpc& rpc_;
  AttachConnection& attach_;
  LeaseNumaNode numa_node_;
  const bool can_spill_;
  absl::Mutex held_mu_;
  // Granted and not given back (whether or not Return reached the daemon:
  // the caller no longer maps what it returns).
  absl::flat_hash_set<uint64_t> held_ ABSL_GUARDED_BY(held_mu_);
  // The reattach count the daemon was last told held_ at.
  std::atomic<uint64_t> confirmed_reattaches_{0};
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_RPC_HOST_LEASES_H_
