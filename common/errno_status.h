// A failed system call as a Status: RESOURCE_EXHAUSTED when the system ran
// out of memory or space (ENOMEM, ENOSPC; a full pool is a normal outcome),
// INTERNAL otherwise, with errno's text after `what`.
#ifndef ACTSTASH_COMMON_ERRNO_STATUS_H_
#define ACTSTASH_COMMON_ERRNO_STATUS_H_

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace actstash {

inline absl::Status ErrnoStatus(absl::string_view what, int error) {
  const absl::StatusCode code = (error == ENOMEM || error == ENOSPC)
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(error)));
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_ERRNO_STATUS_H_
