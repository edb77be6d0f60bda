// ACTSTASH_CHECK: aborts on a broken internal invariant, with file:line.
//
// Only for conditions that no client input can make false (see
// docs/ARCHITECTURE.md, "Errors and bad input"); anything a client controls
// returns absl::Status.
#ifndef ACTSTASH_COMMON_CHECK_H_
#define ACTSTASH_COMMON_CHECK_H_

namespace actstash::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const char* message);
}  // namespace actstash::internal

#define ACTSTASH_CHECK(condition, message)                                          \
  do {                                                                              \
    if (!(condition)) {                                                             \
      ::actstash::internal::CheckFailed(__FILE__, __LINE__, #condition, (message)); \
    }                                                                               \
  } while (false)

#endif  // ACTSTASH_COMMON_CHECK_H_
