// Byte sizes as humans write them ("64MiB", "4G", "1.5GiB", "25%").
#ifndef ACTSTASH_COMMON_UNITS_H_
#define ACTSTASH_COMMON_UNITS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace actstash {

// Parses a byte size: an integer or decimal number with an optional suffix
// B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (all binary, case-insensitive),
// or a percentage of `percent_base` ("25%"; rejected when percent_base is 0).
// Fails with INVALID_ARGUMENT on anything else, negative numbers or overflow.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text, uint64_t percent_base = 0);

// "64.0 MiB", "512 B": for logs and CLI tables.
std::string FormatBytes(uint64_t bytes);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_UNITS_H_
