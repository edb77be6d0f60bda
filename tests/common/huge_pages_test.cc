#include "common/huge_pages.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace actstash {
namespace {

TEST(HugePagesTest, ParsesTheBracketedSetting) {
  EXPECT_EQ(ParseShmemEnabled("always within_size advise [never] deny force\n"),
            ShmemHugePages::kNever);
  EXPECT_EQ(ParseShmemEnabled("always within_size [advise] never deny force"),
            ShmemHugePages::kAdvise);
  EXPECT_EQ(ParseShmemEnabled("[always] within_size advise never deny force"),
            ShmemHugePages::kAlways);
  EXPECT_EQ(ParseShmemEnabled("always [within_size] advise never"), ShmemHugePages::kWithinSize);
  EXPECT_EQ(ParseShmemEnabled("always advise never [deny] force"), ShmemHugePages::kDeny);
  EXPECT_EQ(ParseShmemEnabled("always advise never deny [force]"), ShmemHugePages::kForce);
  EXPECT_EQ(ParseShmemEnabled(""), ShmemHugePages::kUnknown);
  EXPECT_EQ(ParseShmemEnabled("[sometimes]"), ShmemHugePages::kUnknown);
  EXPECT_EQ(ParseShmemEnabled("always [advise"), ShmemHugePages::kUnknown);
}

TEST(HugePagesTest, AllowedOnlyWhereTheKernelGivesThem) {
  EXPECT_TRUE(HugePagesAllowed(ShmemHugePages::kAlways));
  EXPECT_TRUE(HugePagesAllowed(ShmemHugePages::kWithinSize));
  EXPECT_TRUE(HugePagesAllowed(ShmemHugePages::kAdvise));
  EXPECT_TRUE(HugePagesAllowed(ShmemHugePages::kForce));
  EXPECT_FALSE(HugePagesAllowed(ShmemHugePages::kNever));
  EXPECT_FALSE(HugePagesAllowed(ShmemHugePages::kDeny));
  EXPECT_FALSE(HugePagesAllowed(ShmemHugePages::kUnknown));
}

TEST(HugePagesTest, TheLogLineSaysWhyAndHowWhenThePoolGetsSmallPages) {
  const std::string never = DescribePoolPages(ShmemHugePages::kNever);
  EXPECT_NE(never.find("4 KiB"), std::string::npos) << never;
  EXPECT_NE(never.find("is never"), std::string::npos) << never;
  EXPECT_NE(never.find("echo advise > "), std::string::npos) << never;
  EXPECT_NE(DescribePoolPages(ShmemHugePages::kAdvise).find("2 MiB"), std::string::npos);
}

long MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// What the daemon and then a client do with a segment: reserve aligned, map
// populated. The contents survive, the range starts on a 2 MiB boundary, and
// touching every page afterwards faults nothing: the first touch happened
// in the mapping call, not on the hot path.
TEST(HugePagesTest, MappedSegmentsKeepTheirBytesAndTouchNothingLater) {
  constexpr uint64_t kBytes = 8 << 20;
  const int fd = memfd_create("huge-pages-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  {
    // The daemon's mapping, which allocates the pages.
    std::byte* first = ReserveAligned(kBytes);
    ASSERT_NE(first, nullptr);
    ASSERT_TRUE(MapSharedPopulated(first, kBytes, fd, NodeShmemHugePages()).ok());
    for (uint64_t i = 0; i < kBytes; i += 4096) first[i] = std::byte(i >> 12);
    munmap(first, kBytes);
  }
  std::byte* at = ReserveAligned(kBytes);
  ASSERT_NE(at, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(at) % kHugePageBytes, 0u);
  ASSERT_TRUE(MapSharedPopulated(at, kBytes, fd, NodeShmemHugePages()).ok());
  [[maybe_unused]] const long before = MinorFaults();
  uint64_t mismatches = 0;
  for (uint64_t i = 0; i < kBytes; i += 4096) {
    mismatches += static_cast<char>(at[i]) != char(i >> 12);
    at[i + 1] = std::byte{1};  // a write as well: populated for writing
  }
#if !defined(__SANITIZE_THREAD__)
  // Under TSan every first access also faults in the access's shadow memory
  // (two shadow pages per page here): a sanitizer's cost, not the mapping's.
  EXPECT_EQ(MinorFaults() - before, 0);
#endif
  EXPECT_EQ(mismatches, 0u);
  if (HugePagesAllowed(NodeShmemHugePages())) {
    // The kernel may still fall back to small pages (fragmented memory): say
    // what it did rather than fail on it.
    std::ifstream smaps("/proc/self/smaps_rollup");
    std::string line;
    while (std::getline(smaps, line)) {
      if (line.rfind("ShmemPmdMapped", 0) == 0) std::printf("%s\n", line.c_str());
    }
  }
  munmap(at, kBytes);
  close(fd);
}

TEST(HugePagesTest, MappingABadDescriptorIsAnError) {
  std::byte* at = ReserveAligned(kHugePageBytes);
  ASSERT_NE(at, nullptr);
  const absl::Status status = MapSharedPopulated(at, kHugePageBytes, -1, ShmemHugePages::kNever);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(std::string(status.message()).find("mapping shared memory"), std::string::npos);
  munmap(at, kHugePageBytes);
}

}  // namespace
}  // namespace actstash
