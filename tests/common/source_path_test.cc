#include <string>

#include "gtest/gtest.h"

// What a binary says of its sources (__FILE__ in CHECKs and Status messages)
// is their path in the checkout, with no path of the machine that built it,
// whether the compiler ran directly or through the compiler cache, which
// hands it paths relative to the build directory (CMakeLists.txt,
// cmake/ActstashCcache.cmake).
TEST(SourcePathTest, FileIsRelativeToTheCheckout) {
  EXPECT_EQ(std::string(__FILE__), "tests/common/source_path_test.cc");
}
