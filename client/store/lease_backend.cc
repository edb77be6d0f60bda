#include "client/store/lease_backend.h"

#include "absl/strings/str_cat.h"

namespace actstash::client_internal {

absl::Status LeaseBackend::GoneError(absl::string_view what, absl::string_view consequence) const {
  return absl::UnavailableError(
      absl::StrCat(what, ": actstashd went away (its attach connection closed): ", consequence));
}

}  // namespace actstash::client_internal
