#include "client/store/lease_retention.h"

#include <algorithm>

namespace actstash::client_internal {

LeaseRetention::LeaseRetention(BlockTable* table, ArenaLeases* leases, uint32_t lease_batch,
                               std::chrono::milliseconds retain)
    : table_(*table),
      leases_(*leases),
      lease_batch_(std::max<uint32_t>(1, lease_batch)),
      retain_(retain),
      sweeper_(SweepPeriod(retain), [this] { Sweep(); }) {}

bool LeaseRetention::Retained(const Arena& arena, std::chrono::steady_clock::time_point now) const {
  return retain_.count() > 0 && arena.pinned && BlockTable::Empty(arena) &&
         now - arena.emptied < retain_;
}

LeaseRetention::Arena* LeaseRetention::OnEmptied(Arenas arenas, Arena* emptied) {
  const auto now = std::chrono::steady_clock::now();
  emptied->emptied = now;
  if (Retained(*emptied, now)) {
    sweeper_.Start();  // kept for the next step; the sweeper gives it back later
    return nullptr;
  }
  if (emptied->dedicated) {
    // This one becomes the spare; an older spare goes back (unless retention
    // keeps it).
    for (const std::unique_ptr<Arena>& arena : arenas) {
      if (arena.get() != emptied && arena->dedicated && BlockTable::Empty(*arena) &&
          !Retained(*arena, now)) {
        return arena.get();
      }
    }
    return nullptr;
  }
  size_t empty_shared = 0;
  for (const std::unique_ptr<Arena>& arena : arenas) {
    empty_shared += !arena->dedicated && BlockTable::Empty(*arena);
  }
  return empty_shared > lease_batch_ ? emptied : nullptr;
}

std::vector<std::unique_ptr<LeaseRetention::Arena>> LeaseRetention::DetachUnkept(bool expire_all) {
  const auto now = std::chrono::steady_clock::now();
  const std::vector<std::unique_ptr<Arena>>& arenas = table_.arenas();
  auto retained = [&](const Arena& a) { return !expire_all && Retained(a, now); };
  // The usual rules count what retention keeps: up to lease_batch_ empty
  // segments and one spare dedicated lease in all.
  size_t shared_kept = 0;
  bool spare_kept = false;
  for (const std::unique_ptr<Arena>& arena : arenas) {
    if (!retained(*arena)) continue;
    shared_kept += !arena->dedicated;
    spare_kept |= arena->dedicated;
  }
  std::vector<Arena*> unkept;
  // From the last leased back: the usual rules keep the newest leases.
  for (size_t i = arenas.size(); i-- > 0;) {
    Arena* arena = arenas[i].get();
    if (!BlockTable::Empty(*arena) || retained(*arena)) continue;
    if (!arena->dedicated && shared_kept < lease_batch_) {
      shared_kept += 1;
    } else if (arena->dedicated && !spare_kept) {
      spare_kept = true;
    } else {
      unkept.push_back(arena);
    }
  }
  std::vector<std::unique_ptr<Arena>> detached;
  for (Arena* arena : unkept) detached.push_back(table_.Detach(arena));
  return detached;
}

uint64_t LeaseRetention::GiveBackRetained() {
  if (retain_.count() == 0) return 0;
  std::vector<std::unique_ptr<Arena>> back;
  {
    absl::MutexLock lock(&table_.mu());
    back = DetachUnkept(/*expire_all=*/true);
  }
  uint64_t bytes = 0;
  for (std::unique_ptr<Arena>& arena : back) {
    bytes += arena->bytes;
    leases_.GiveBack(std::move(arena));
  }
  return bytes;
}

absl::Duration LeaseRetention::SweepPeriod(std::chrono::milliseconds retain) {
  return std::clamp(absl::FromChrono(retain) / 4, absl::Milliseconds(10), absl::Seconds(1));
}

void LeaseRetention::Sweep() {
  std::vector<std::unique_ptr<Arena>> back;
  {
    absl::MutexLock lock(&table_.mu());
    back = DetachUnkept(/*expire_all=*/false);
  }
  for (std::unique_ptr<Arena>& arena : back) leases_.GiveBack(std::move(arena));
}

}  // namespace actstash::client_internal
