// The names of EngineStats' counters and of the keep reasons
// (actstash/saved_tensors.h): one table behind stats dictionaries, the C
// ABI's description and the libtorch adapter.
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "actstash/saved_tensors.h"

namespace actstash {

namespace {

using Counter = uint64_t EngineStats::*;
struct NamedCounter {
  const char* name;
  Counter counter;
};
// EngineStats' scalar counters before and after kept_by_reason, in
// declaration order: the one table behind both EngineStatNames and
// EngineStatValues.
constexpr NamedCounter kCountersBefore[] = {{"tensors_offloaded", &EngineStats::tensors_offloaded},
                                            {"bytes_offloaded", &EngineStats::bytes_offloaded},
                                            {"tensors_kept", &EngineStats::tensors_kept},
                                            {"bytes_kept", &EngineStats::bytes_kept}};
constexpr NamedCounter kCountersAfter[] = {
    {"tensors_fetched", &EngineStats::tensors_fetched},
    {"bytes_fetched", &EngineStats::bytes_fetched},
    {"views", &EngineStats::views},
    {"prefetch_issued", &EngineStats::prefetch_issued},
    {"prefetch_hits", &EngineStats::prefetch_hits},
    {"unpacked_from_source", &EngineStats::unpacked_from_source},
    {"store_failures", &EngineStats::store_failures},
    {"live_tensors", &EngineStats::live_tensors},
    {"live_bytes", &EngineStats::live_bytes},
    {"peak_live_bytes", &EngineStats::peak_live_bytes},
    {"in_flight", &EngineStats::in_flight},
    {"inline_stores", &EngineStats::inline_stores},
    {"wait_ns", &EngineStats::wait_ns},
    {"in_flight_bytes", &EngineStats::in_flight_bytes},
    {"peak_in_flight_bytes", &EngineStats::peak_in_flight_bytes},
    {"in_flight_waits", &EngineStats::in_flight_waits},
    {"in_flight_wait_ns", &EngineStats::in_flight_wait_ns},
    {"unpinned_device_stores", &EngineStats::unpinned_device_stores}};
constexpr const char* kKeepReasonNames[] = {"small",  "parameter", "keep_listed", "layout",
                                            "device", "failed",    "unavailable", "no_copy_engine"};
static_assert(std::size(kKeepReasonNames) == static_cast<size_t>(KeepReason::kCount));
// Every uint64_t of EngineStats is in the table (it holds nothing else).
static_assert(sizeof(EngineStats) ==
              sizeof(uint64_t) * (std::size(kCountersBefore) + std::size(kCountersAfter) +
                                  static_cast<size_t>(KeepReason::kCount)));

}  // namespace

const char* KeepReasonName(KeepReason reason) {
  const int i = static_cast<int>(reason);
  return i >= 0 && i < static_cast<int>(KeepReason::kCount) ? kKeepReasonNames[i] : "";
}

const std::vector<std::string>& EngineStatNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const NamedCounter& c : kCountersBefore) out.emplace_back(c.name);
    for (const char* reason : kKeepReasonNames) out.push_back(absl::StrCat("kept_", reason));
    for (const NamedCounter& c : kCountersAfter) out.emplace_back(c.name);
    return out;
  }();
  return names;
}

std::vector<uint64_t> EngineStatValues(const EngineStats& s) {
  std::vector<uint64_t> values;
  values.reserve(EngineStatNames().size());
  for (const NamedCounter& c : kCountersBefore) values.push_back(s.*c.counter);
  values.insert(values.end(), std::begin(s.kept_by_reason), std::end(s.kept_by_reason));
  for (const NamedCounter& c : kCountersAfter) values.push_back(s.*c.counter);
  return values;
}

}  // namespace actstash
