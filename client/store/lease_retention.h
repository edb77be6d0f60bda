// LeaseRetention: which of a LocalStore's empty leases stay mapped, and for
// how long. The usual rules: up to `lease_batch` empty segments, and one
// spare dedicated lease (the last emptied: a layer's big buffer comes back
// every step). Retention: an emptied lease that is registered for CUDA stays
// `retain` beyond that, because the next training step needs the same
// leases and registering them again (cudaHostRegister) would run on its
// storing thread. A sweeper thread, started when the first lease is
// retained, gives back what stayed empty longer; when no lease can be had,
// what only retention keeps goes back before anything spills or waits.
// Private to LocalStore.
//
// Thread-safety: Retained and OnEmptied are decisions over arenas of the
// table, made under its lock by the caller (they read and write arena
// fields); the other methods lock the table themselves and may run on any
// thread. The table and leases must outlive the object; Stop before the
// arenas are unmapped.
#ifndef ACTSTASH_CLIENT_STORE_LEASE_RETENTION_H_
#define ACTSTASH_CLIENT_STORE_LEASE_RETENTION_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/store/arena_leases.h"
#include "client/store/background_worker.h"
#include "client/store/block_table.h"

namespace actstash::client_internal {

class LeaseRetention {
 public:
  using Arena = BlockTable::Arena;
  using Arenas = absl::Span<const std::unique_ptr<Arena>>;

  // `retain` 0: no retention (only the usual rules).
  LeaseRetention(BlockTable* table, ArenaLeases* leases, uint32_t lease_batch,
                 std::chrono::milliseconds retain);
  ~LeaseRetention() { Stop(); }
  LeaseRetention(const LeaseRetention&) = delete;
  LeaseRetention& operator=(const LeaseRetention&) = delete;

  uint32_t lease_batch() const { return lease_batch_; }
  // Whether retention keeps an empty arena at `now`: registered, and
  // emptied less than `retain` ago. Caller holds the table lock.
  bool Retained(const Arena& arena, std::chrono::steady_clock::time_point now) const;
  // `emptied`, a resident arena of `arenas` (the table's), just became
  // empty: records when, and answers the one arena that goes back now
  // (null: none): `emptied` itself when the usual rules have enough empty
  // segments, or an older spare dedicated lease when `emptied` becomes the
  // spare. Starts the sweeper when retention keeps `emptied`. Caller holds
  // the table lock, detaches the answer and gives it back after unlocking.
  Arena* OnEmptied(Arenas arenas, Arena* emptied);
  // Gives back every empty arena that only retention keeps; its bytes.
  uint64_t GiveBackRetained() ABSL_LOCKS_EXCLUDED(table_.mu());
  // Stops the sweeper (joins it). Idempotent.
  void Stop() { sweeper_.Stop(); }

  // How often the sweeper looks: a lease goes back at most a quarter of
  // `retain` (10 ms to 1 s) late.
  static absl::Duration SweepPeriod(std::chrono::milliseconds retain);

 private:
  // Detaches the empty arenas that neither the usual rules nor retention
  // keep (`expire_all`: as if every retention had expired).
  std::vector<std::unique_ptr<Arena>> DetachUnkept(bool expire_all)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_.mu());
  // The sweeper's tick: gives back what stayed empty longer than `retain`.
  void Sweep() ABSL_LOCKS_EXCLUDED(table_.mu());

  BlockTable& table_;
  ArenaLeases& leases_;
  const uint32_t lease_batch_;
  const std::chrono::milliseconds retain_;
  PeriodicWorker sweeper_;
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_LEASE_RETENTION_H_
