// Byte sizes as humans write them ("64MiB", "4G", "1.5GiB", "25%").
#ifndef ACTSTASH_COMMON_UNITS_H_
#define ACTSTASH_COMMON_UNITS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace actstash {

// Parses a byte size: an integer or decimal number with an optional unit,
// case-insensitive, as GNU dd and numfmt read them: KiB/MiB/GiB/TiB and the
// bare letters K/M/G/T are binary (2^10...), KB/MB/GB/TB decimal (10^3...),
// B or none bytes; or a percentage of `percent_base` ("25%"; rejected when
// percent_base is 0). Fails with INVALID_ARGUMENT on anything else, negative
// numbers or overflow. The one size parser of the project: the daemon's
// flags, the CLI and the C ABI (Python's sizes) all go through it.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text, uint64_t percent_base = 0);

// "64.0 MiB", "512 B": for logs and CLI tables.
std::string FormatBytes(uint64_t bytes);

// A rate in bytes per second that a client reports (CopyShare's probes):
// finite and >= 0, else INVALID_ARGUMENT "<name>: <value> is not a rate in
// bytes per second". The client checks before sending and the daemon on
// receipt, with this one rule.
absl::Status CheckBytesPerSecond(absl::string_view name, double value);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_UNITS_H_
