// The monotonic clock as integers, for durations in counters and deadlines.
//
// Thread-safety: free functions.
#ifndef ACTSTASH_COMMON_CLOCK_H_
#define ACTSTASH_COMMON_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace actstash {

// steady_clock's time since its epoch: only differences mean anything.
inline uint64_t MonotonicNowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_CLOCK_H_
