// Unit tests of ParseByteSize and FormatBytes.
#include "common/units.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace actstash {
namespace {

constexpr uint64_t kKiB = 1ull << 10;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kTiB = 1ull << 40;

void ExpectSize(const std::string& text, uint64_t expected, uint64_t percent_base = 0) {
  absl::StatusOr<uint64_t> parsed = ParseByteSize(text, percent_base);
  ASSERT_TRUE(parsed.ok()) << "'" << text << "': " << parsed.status();
  EXPECT_EQ(*parsed, expected) << "'" << text << "'";
}

void ExpectInvalid(const std::string& text, uint64_t percent_base = 0) {
  absl::StatusOr<uint64_t> parsed = ParseByteSize(text, percent_base);
  ASSERT_FALSE(parsed.ok()) << "'" << text << "' parsed as " << *parsed;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << text;
  // The message quotes what was written.
  EXPECT_NE(std::string(parsed.status().message()).find(text), std::string::npos)
      << parsed.status();
}

TEST(ParseByteSizeTest, PlainNumbersAreBytes) {
  ExpectSize("0", 0);
  ExpectSize("1", 1);
  ExpectSize("4096", 4096);
  ExpectSize("512B", 512);
  ExpectSize("512b", 512);
  ExpectSize("1099511627776", kTiB);
}

TEST(ParseByteSizeTest, BinaryUnitsInEverySpelling) {
  for (const char* text : {"4k", "4K", "4KiB", "4kib", "4KIB"}) ExpectSize(text, 4 * kKiB);
  for (const char* text : {"64m", "64M", "64MiB"}) ExpectSize(text, 64 * kMiB);
  for (const char* text : {"2g", "2G", "2GiB"}) ExpectSize(text, 2 * kGiB);
  for (const char* text : {"3t", "3T", "3TiB"}) ExpectSize(text, 3 * kTiB);
}

// As GNU dd and numfmt read them: a B after the letter means powers of ten.
TEST(ParseByteSizeTest, DecimalUnitsWithB) {
  for (const char* text : {"4kb", "4KB", "4kB"}) ExpectSize(text, 4000);
  ExpectSize("64MB", 64'000'000);
  ExpectSize("1.5GB", 1'500'000'000);
  ExpectSize("6 GB", 6'000'000'000);
  ExpectSize("3TB", 3'000'000'000'000);
  ExpectSize("18446744TB", 18'446'744'000'000'000'000ULL);  // exact, below 2^64
  ExpectInvalid("18446745TB");                              // above it
}

TEST(ParseByteSizeTest, DecimalNumbers) {
  ExpectSize("1.5GiB", 3 * kGiB / 2);
  ExpectSize("0.5k", 512);
  ExpectSize("2.25MiB", 2 * kMiB + kMiB / 4);
  ExpectSize("1.0", 1);
}

TEST(ParseByteSizeTest, WhitespaceAroundAndBeforeTheUnit) {
  ExpectSize(" 64MiB ", 64 * kMiB);
  ExpectSize("64 MiB", 64 * kMiB);
  ExpectSize("\t8 k\n", 8 * kKiB);
}

TEST(ParseByteSizeTest, PercentagesOfTheBase) {
  ExpectSize("25%", 250, 1000);
  ExpectSize("100%", 8 * kGiB, 8 * kGiB);
  ExpectSize("0%", 0, 8 * kGiB);
  ExpectSize("12.5%", 100, 800);
  ExpectSize("50%", 16 * kGiB, 32 * kGiB);
  ExpectSize("25 %", 25, 100);
  // A base is harmless for plain sizes.
  ExpectSize("4KiB", 4 * kKiB, 1000);
}

TEST(ParseByteSizeTest, PercentageWithoutBaseIsRejected) {
  ExpectInvalid("25%");
  ExpectInvalid("100%", 0);
}

TEST(ParseByteSizeTest, PercentageAbove100IsRejected) {
  ExpectInvalid("150%", 1000);
  ExpectInvalid("100.5%", 1000);
}

TEST(ParseByteSizeTest, GarbageIsRejected) {
  for (const char* text : {"", " ", "abc", "GiB", "k", "%", "1.2.3", "1e3", "0x10", "12XB", "4KiBB",
                           "4 KiB B", "1P", "1PiB", "4kk", "1,5GiB", "nan", "inf", "5-"}) {
    ExpectInvalid(text);
  }
}

TEST(ParseByteSizeTest, NegativeNumbersAreRejected) {
  ExpectInvalid("-1");
  ExpectInvalid("-1GiB");
  ExpectInvalid("-0.5k");
  ExpectInvalid("-25%", 1000);
}

TEST(ParseByteSizeTest, OverflowIsRejected) {
  ExpectInvalid("20000000TiB");
  ExpectInvalid("16777216TiB");  // exactly 2^64
  ExpectInvalid("18446744073709551616");
  ExpectInvalid("99999999999999999999999999");
  // The largest whole number of TiB that fits.
  ExpectSize("16777215TiB", 16777215ull * kTiB);
}

// Whole numbers are exact above 2^53, up to UINT64_MAX itself.
TEST(ParseByteSizeTest, LargeIntegersAreExact) {
  ExpectSize("9007199254740993", 9007199254740993ull);  // 2^53 + 1
  ExpectSize("18446744073709551615", UINT64_MAX);
}

TEST(FormatBytesTest, SmallValuesInBytes) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1), "1 B");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
}

TEST(FormatBytesTest, LargerValuesWithOneDecimal) {
  EXPECT_EQ(FormatBytes(kKiB), "1.0 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(kMiB - 1), "1.0 MiB");  // not "1024.0 KiB"
  EXPECT_EQ(FormatBytes(64 * kMiB), "64.0 MiB");
  EXPECT_EQ(FormatBytes(3 * kGiB / 2), "1.5 GiB");
  EXPECT_EQ(FormatBytes(kTiB), "1.0 TiB");
  EXPECT_EQ(FormatBytes(1024 * kTiB), "1.0 PiB");
  EXPECT_EQ(FormatBytes(UINT64_MAX), "16.0 EiB");
}

TEST(FormatBytesTest, RoundTripsThroughParseByteSize) {
  for (uint64_t bytes :
       {uint64_t{0}, uint64_t{17}, kKiB, 3 * kKiB / 2, 64 * kMiB, 5 * kGiB / 2, 7 * kTiB}) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(FormatBytes(bytes));
    ASSERT_TRUE(parsed.ok()) << FormatBytes(bytes) << ": " << parsed.status();
    EXPECT_EQ(*parsed, bytes) << FormatBytes(bytes);
  }
}

}  // namespace
}  // namespace actstash
