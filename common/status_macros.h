// Early-return helpers for absl::Status / absl::StatusOr.
#ifndef ACTSTASH_COMMON_STATUS_MACROS_H_
#define ACTSTASH_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ACTSTASH_STATUS_CONCAT_INNER(a, b) a##b
#define ACTSTASH_STATUS_CONCAT(a, b) ACTSTASH_STATUS_CONCAT_INNER(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define ACTSTASH_RETURN_IF_ERROR(expr)        \
  do {                                        \
    ::absl::Status actstash_status_ = (expr); \
    if (!actstash_status_.ok()) {             \
      return actstash_status_;                \
    }                                         \
  } while (false)

// `lhs = value of expr`, or returns its status from the enclosing function.
#define ACTSTASH_ASSIGN_OR_RETURN(lhs, expr) \
  ACTSTASH_ASSIGN_OR_RETURN_IMPL(ACTSTASH_STATUS_CONCAT(actstash_statusor_, __LINE__), lhs, expr)

#define ACTSTASH_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) {                                     \
    return std::move(statusor).status();                    \
  }                                                         \
  lhs = *std::move(statusor)

#endif  // ACTSTASH_COMMON_STATUS_MACROS_H_
