#include "client/usage_reporter.h"

#include <utility>

#include "absl/time/time.h"

namespace actstash::client_internal {

UsageReporter::UsageReporter(std::chrono::milliseconds interval, Read read, Send send)
    : interval_(interval), read_(std::move(read)), send_(std::move(send)) {}

UsageReporter::~UsageReporter() { Stop(); }

void UsageReporter::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
  }
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { Run(); });
}

void UsageReporter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void UsageReporter::Run() {
  uint64_t last_stores = 0, last_fetches = 0, last_objects = 0;
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::FromChrono(interval_))) {
    mu_.Unlock();  // neither read nor send may wait behind Stop
    const v1::ClientUsage usage = read_();
    const bool changed = usage.stores() != last_stores || usage.fetches() != last_fetches ||
                         usage.objects() != last_objects;
    if (changed) {
      last_stores = usage.stores();
      last_fetches = usage.fetches();
      last_objects = usage.objects();
      send_(usage);
    }
    mu_.Lock();
  }
}

}  // namespace actstash::client_internal
