// Settings that take one of a few names ("auto", "on", "off", ...): one parser
// for the daemon's flags and config file and the client's C API, so that every
// such setting reads and fails the same way.
//
// Thread-safety: pure functions.
#ifndef ACTSTASH_COMMON_CHOICE_H_
#define ACTSTASH_COMMON_CHOICE_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace actstash {

template <typename T>
struct Choice {
  absl::string_view name;
  T value;
};

// The value named `text` among `choices` (exact, case-sensitive match). Fails
// with INVALID_ARGUMENT "<what>: '<text>' is not one of a, b, c" otherwise.
template <typename T, size_t N>
absl::StatusOr<T> ParseChoice(absl::string_view text, absl::string_view what,
                              const Choice<T> (&choices)[N]) {
  static_assert(N > 0, "a choice needs at least one name");
  for (const Choice<T>& choice : choices) {
    if (text == choice.name) return choice.value;
  }
  std::string names;
  for (size_t i = 0; i < N; ++i) absl::StrAppend(&names, i ? ", " : "", choices[i].name);
  return absl::InvalidArgumentError(absl::StrCat(what, ": '", text, "' is not one of ", names));
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_CHOICE_H_
