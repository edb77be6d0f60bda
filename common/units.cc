#include "common/units.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace actstash {

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text, uint64_t percent_base) {
  const absl::string_view original = text;
  text = absl::StripAsciiWhitespace(text);
  size_t number_end = 0;
  while (number_end < text.size() &&
         (absl::ascii_isdigit(text[number_end]) || text[number_end] == '.')) {
    ++number_end;
  }
  const absl::string_view number = text.substr(0, number_end);
  const std::string suffix =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(number_end)));
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat("not a byte size: '", original, "'"));
  }
  double multiplier = 1;
  if (suffix == "%") {
    if (percent_base == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a percentage is not allowed here: '", original, "'"));
    }
    if (value > 100) {
      return absl::InvalidArgumentError(absl::StrCat("percentage above 100: '", original, "'"));
    }
    multiplier = static_cast<double>(percent_base) / 100.0;
  } else if (suffix.empty() || suffix == "b") {
    multiplier = 1;
  } else {
    static constexpr struct {
      char letter;
      double binary;
      double decimal;
    } kUnits[] = {{'k', 0x1p10, 1e3}, {'m', 0x1p20, 1e6}, {'g', 0x1p30, 1e9}, {'t', 0x1p40, 1e12}};
    bool found = false;
    for (const auto& unit : kUnits) {
      if (suffix[0] != unit.letter) continue;
      const absl::string_view rest = absl::string_view(suffix).substr(1);
      if (rest.empty() || rest == "ib") {
        multiplier = unit.binary;
        found = true;
      } else if (rest == "b") {
        multiplier = unit.decimal;
        found = true;
      }
      break;
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown size unit in '", original,
                       "' (use B, KiB, MiB, GiB, TiB (binary), KB, MB, GB, TB (decimal) or %)"));
    }
  }
  // Whole numbers with a unit are computed exactly in integers (a double
  // would round above 2^53); fractions and percentages go through double,
  // which is exact enough for them.
  uint64_t whole = 0;
  if (suffix != "%" && absl::SimpleAtoi(number, &whole)) {
    const uint64_t factor = static_cast<uint64_t>(multiplier);
    if (factor != 0 && whole > UINT64_MAX / factor) {
      return absl::InvalidArgumentError(absl::StrCat("byte size too large: '", original, "'"));
    }
    return whole * factor;
  }
  const double bytes = value * multiplier;
  if (bytes >= 0x1p64) {
    return absl::InvalidArgumentError(absl::StrCat("byte size too large: '", original, "'"));
  }
  return static_cast<uint64_t>(bytes);
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes);
  int unit = 0;
  // 1023.95+ would print as "1024.0"; move to the next unit instead.
  while (value >= 1023.95 && unit < 6) {
    value /= 1024;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f %s", value, kNames[unit]);
  return buffer;
}

absl::Status CheckBytesPerSecond(absl::string_view name, double value) {
  if (std::isfinite(value) && value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": ", value, " is not a rate in bytes per second (finite, >= 0)"));
}

}  // namespace actstash
