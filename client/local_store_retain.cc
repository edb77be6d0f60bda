// LocalStore's lease retention: registered leases that empty stay mapped and
// registered for a while (the next training step needs them again), and a
// sweeper thread gives back those that stayed empty longer. Registering a
// lease (cudaHostRegister) runs on the thread that leases it, which is the
// trainer's storing thread: without retention every step that empties its
// leases in backward registers them again in the next forward.
#include <algorithm>
#include <chrono>

#include "absl/time/time.h"
#include "client/local_store.h"

namespace actstash::client_internal {

bool LocalStore::Retained(const Arena& arena, std::chrono::steady_clock::time_point now) const {
  return retain_.count() > 0 && arena.pinned && Empty(arena) && now - arena.emptied < retain_;
}

std::vector<std::unique_ptr<LocalStore::Arena>> LocalStore::DetachUnkept(bool expire_all) {
  const auto now = std::chrono::steady_clock::now();
  auto retained = [&](const Arena& a) { return !expire_all && Retained(a, now); };
  // The usual rules count what retention keeps: up to lease_batch_ empty
  // segments and one spare dedicated lease in all.
  size_t shared_kept = 0;
  bool spare_kept = false;
  for (const std::unique_ptr<Arena>& arena : arenas_) {
    if (!retained(*arena)) continue;
    shared_kept += !arena->dedicated;
    spare_kept |= arena->dedicated;
  }
  std::vector<Arena*> unkept;
  // From the last leased back: the usual rules keep the newest leases.
  for (size_t i = arenas_.size(); i-- > 0;) {
    Arena* arena = arenas_[i].get();
    if (!Empty(*arena) || retained(*arena)) continue;
    if (!arena->dedicated && shared_kept < lease_batch_) {
      shared_kept += 1;
    } else if (arena->dedicated && !spare_kept) {
      spare_kept = true;
    } else {
      unkept.push_back(arena);
    }
  }
  std::vector<std::unique_ptr<Arena>> detached;
  for (Arena* arena : unkept) detached.push_back(Detach(arena));
  return detached;
}

uint64_t LocalStore::GiveBackRetained() {
  if (retain_.count() == 0) return 0;
  std::vector<std::unique_ptr<Arena>> back;
  {
    absl::MutexLock lock(&mu_);
    back = DetachUnkept(/*expire_all=*/true);
  }
  uint64_t bytes = 0;
  for (std::unique_ptr<Arena>& arena : back) {
    bytes += arena->bytes;
    GiveBack(std::move(arena));
  }
  return bytes;
}

absl::Duration LocalStore::SweepPeriod(std::chrono::milliseconds retain) {
  return std::clamp(absl::FromChrono(retain) / 4, absl::Milliseconds(10), absl::Seconds(1));
}

void LocalStore::Sweep() {
  std::vector<std::unique_ptr<Arena>> back;
  {
    absl::MutexLock lock(&mu_);
    back = DetachUnkept(/*expire_all=*/false);
  }
  for (std::unique_ptr<Arena>& arena : back) GiveBack(std::move(arena));
}

}  // namespace actstash::client_internal
