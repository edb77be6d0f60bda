// Tristate: how a setting that the machine may not support is asked for
// (page-locking the daemon's pool, registering memory with CUDA). The one
// vocabulary the daemon and the client share below the client's public API;
// the public `PinPolicy` (actstash/pinned.h) maps onto it one to one.
//
// Thread-safety: constants and a pure function.
#ifndef ACTSTASH_COMMON_TRISTATE_H_
#define ACTSTASH_COMMON_TRISTATE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/choice.h"

namespace actstash {

enum class Tristate {
  kAuto,  // when the machine supports it; a failure falls back to without
  kOn,    // always; a failure (or no support) is an error
  kOff,   // never
};

// The settings' spelling: "auto", "on", "off".
inline constexpr Choice<Tristate> kTristateNames[] = {
    {"auto", Tristate::kAuto}, {"on", Tristate::kOn}, {"off", Tristate::kOff}};

// `text` as a Tristate; INVALID_ARGUMENT naming `what` otherwise.
inline absl::StatusOr<Tristate> ParseTristate(absl::string_view text, absl::string_view what) {
  return ParseChoice(text, what, kTristateNames);
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_TRISTATE_H_
