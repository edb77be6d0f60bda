#include "common/huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"

namespace actstash {
ShmemHugePages ParseShmemEnabled(absl::string_view text) {
  const size_t open = text.find('[');
  const size_t close = text.find(']', open);
  if (open == absl::string_view::npos || close == absl::string_view::npos) {
    return ShmemHugePages::kUnknown;
  }
  const absl::string_view word = text.substr(open + 1, close - open - 1);
  if (word == "always") return ShmemHugePages::kAlways;
  if (word == "within_size") return ShmemHugePages::kWithinSize;
  if (word == "advise") return ShmemHugePages::kAdvise;
  if (word == "never") return ShmemHugePages::kNever;
  if (word == "deny") return ShmemHugePages::kDeny;
  if (word == "force") return ShmemHugePages::kForce;
  return ShmemHugePages::kUnknown;
}

ShmemHugePages NodeShmemHugePages() {
  static const ShmemHugePages mode = [] {
    std::ifstream in(kShmemEnabledPath);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return ParseShmemEnabled(text);
  }();
  return mode;
}

bool HugePagesAllowed(ShmemHugePages mode) {
  return mode == ShmemHugePages::kAlways || mode == ShmemHugePages::kWithinSize ||
         mode == ShmemHugePages::kAdvise || mode == ShmemHugePages::kForce;
}

std::string DescribePoolPages(ShmemHugePages mode) {
  if (HugePagesAllowed(mode)) {
    return "pool pages: 2 MiB where the kernel can place them (transparent huge pages for "
           "shared memory allowed; MADV_HUGEPAGE given); ShmemHugePages in /proc/meminfo "
           "counts them";
  }
  const std::string setting = mode == ShmemHugePages::kNever  ? "never"
                              : mode == ShmemHugePages::kDeny ? "deny"
                                                              : "unreadable";
  return absl::StrCat(
      "pool pages: 4 KiB (", kShmemEnabledPath, " is ", setting,
      "): every first touch of the pool faults once per 4 KiB and cudaHostRegister pins 4 KiB "
      "pages; `echo advise > ",
      kShmemEnabledPath, "` lets the pool use 2 MiB pages");
}

absl::Status MapSharedPopulated(std::byte* at, uint64_t bytes, int fd, ShmemHugePages mode) {
  if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    return ErrnoStatus("mapping shared memory", errno);
  }
  if (HugePagesAllowed(mode)) (void)madvise(at, bytes, MADV_HUGEPAGE);  // advice only
  if (madvise(at, bytes, kMadvPopulateWrite) == 0) return absl::OkStatus();
  if (errno != EINVAL) return ErrnoStatus("populating shared memory", errno);
  // A kernel before 5.14: map it again, populated by mmap (same file, same
  // contents), which also drops the advice.
  if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0) ==
      MAP_FAILED) {
    return ErrnoStatus("mapping shared memory", errno);
  }
  return absl::OkStatus();
}

std::byte* ReserveAligned(uint64_t bytes) {
  const uint64_t slack = kHugePageBytes;
  void* raw =
      mmap(nullptr, bytes + slack, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + slack - 1) & ~(uintptr_t{slack} - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + bytes + slack;
  if (end > aligned + bytes)
    munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  return reinterpret_cast<std::byte*>(aligned);
}

}  // namespace actstash
