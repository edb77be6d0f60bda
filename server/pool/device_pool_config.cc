#include "server/pool/device_pool_config.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/units.h"

namespace actstash::server {

absl::StatusOr<std::vector<DevicePoolConfig>> ParseDevicePools(absl::string_view text,
                                                               uint64_t segment_bytes) {
  constexpr int kMaxDevice = 1023;
  std::vector<DevicePoolConfig> pools;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const size_t colon = entry.find(':');
    int device = -1;
    if (colon == absl::string_view::npos ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(entry.substr(0, colon)), &device) ||
        device < 0 || device > kMaxDevice) {
      return absl::InvalidArgumentError(absl::StrCat("'", entry,
                                                     "' is not GPU:SIZE with a GPU ordinal in [0, ",
                                                     kMaxDevice, "] (e.g. 0:8GiB)"));
    }
    absl::StatusOr<uint64_t> bytes =
        ParseByteSize(absl::StripAsciiWhitespace(entry.substr(colon + 1)));
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("'", entry, "': ", bytes.status().message()));
    }
    if (*bytes < segment_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("'", entry, "': ", FormatBytes(*bytes),
                                                     " is smaller than one segment (",
                                                     FormatBytes(segment_bytes), ")"));
    }
    for (const DevicePoolConfig& pool : pools) {
      if (pool.device == device) {
        return absl::InvalidArgumentError(
            absl::StrCat("GPU ", device, " has more than one device pool"));
      }
    }
    pools.push_back({device, *bytes - *bytes % segment_bytes});
  }
  if (pools.empty()) return absl::InvalidArgumentError("no GPU:SIZE entry");
  return pools;
}

}  // namespace actstash::server
