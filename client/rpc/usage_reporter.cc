#include "client/rpc/usage_reporter.h"

#include <utility>

#include "absl/time/time.h"

namespace actstash::client_internal {

UsageReporter::UsageReporter(std::chrono::milliseconds interval, Read read, Send send, Give give)
    : read_(std::move(read)),
      send_(std::move(send)),
      give_(std::move(give)),
      worker_(absl::FromChrono(interval), [this] { Tick(); }) {}

void UsageReporter::Tick() {
  const v1::ClientUsage usage = read_();
  if (usage.stores() == last_stores_ && usage.fetches() == last_fetches_ &&
      usage.objects() == last_objects_ && usage.state_bytes() == last_state_bytes_ &&
      usage.leased_bytes() == 0) {
    return;
  }
  last_stores_ = usage.stores();
  last_fetches_ = usage.fetches();
  last_objects_ = usage.objects();
  last_state_bytes_ = usage.state_bytes();
  const uint64_t asked = send_(usage);
  if (asked > 0 && give_ != nullptr) give_(asked);
}

}  // namespace actstash::client_internal
