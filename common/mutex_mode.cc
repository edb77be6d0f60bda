#include "common/mutex_mode.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/synchronization/mutex.h"

namespace actstash {

void ConfigureMutexes() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* asked = std::getenv("ACTSTASH_MUTEX_DEADLOCK_DETECTION");
#ifdef NDEBUG
    const bool detect = asked != nullptr && std::strcmp(asked, "1") == 0;
#else
    const bool detect = asked == nullptr || std::strcmp(asked, "0") != 0;
#endif
    absl::SetMutexDeadlockDetectionMode(detect ? absl::OnDeadlockCycle::kAbort
                                               : absl::OnDeadlockCycle::kIgnore);
  });
}

}  // namespace actstash
