// ParkUntilExit: for test objects whose destructor may block (gRPC's ~Server
// waits on channels this same process still holds): they are never destroyed,
// but stay reachable until the process exits, so LeakSanitizer does not report
// them as leaks.
#ifndef ACTSTASH_TESTING_PARK_H_
#define ACTSTASH_TESTING_PARK_H_

#include <memory>
#include <vector>

namespace actstash::testing {

// Not thread-safe: call from the test's main thread.
template <typename T>
void ParkUntilExit(std::unique_ptr<T> object) {
  static auto* parked = new std::vector<T*>();  // a root for LeakSanitizer
  parked->push_back(object.release());
}

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTING_PARK_H_
