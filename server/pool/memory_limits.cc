#include "server/pool/memory_limits.h"

#include <sys/resource.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/text_file.h"
#include "common/units.h"

namespace actstash::server {
namespace {

// v1 writes "no limit" as the largest page-aligned value below 2^63.
constexpr uint64_t kV1Unlimited = uint64_t{1} << 62;

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// The limit in `file`, or 0 when it is absent, unreadable or unlimited.
uint64_t ReadLimit(const std::string& file) {
  std::string text;
  if (!ReadTextFile(file, &text)) return 0;
  const absl::string_view value = absl::StripAsciiWhitespace(text);
  uint64_t bytes = 0;
  if (value == "max" || !absl::SimpleAtoi(value, &bytes) || bytes >= kV1Unlimited) return 0;
  return bytes;
}

// `path` ("/a/b") and its ancestors up to "/", deepest first.
std::vector<std::string> SelfAndAncestors(std::string path) {
  std::vector<std::string> out;
  while (!path.empty() && path.back() == '/') path.pop_back();
  for (;;) {
    out.push_back(path.empty() ? "/" : path);
    if (path.empty()) break;
    path = path.substr(0, path.rfind('/'));
  }
  return out;
}

// Lowers `limits` to the smallest limit in `file_name` along `path` under
// `mount`. Directories that do not exist under the mount are skipped: inside
// a container without a cgroup namespace, /proc/self/cgroup names the host's
// path while the mount shows the container's own cgroup as its root.
void TakeSmallest(const std::string& mount, const std::string& path, const char* file_name,
                  MemoryLimits* limits) {
  if (!Exists(mount)) return;
  for (const std::string& dir : SelfAndAncestors(path)) {
    const std::string file = absl::StrCat(mount, dir == "/" ? "" : dir, "/", file_name);
    const uint64_t bytes = ReadLimit(file);
    if (bytes != 0 && (limits->cgroup_bytes == 0 || bytes < limits->cgroup_bytes)) {
      limits->cgroup_bytes = bytes;
      limits->cgroup_file = file;
    }
  }
}

}  // namespace

uint64_t MemoryLimits::usable_bytes() const {
  if (cgroup_bytes != 0 && (physical_bytes == 0 || cgroup_bytes < physical_bytes)) {
    return cgroup_bytes;
  }
  return physical_bytes;
}

std::string MemoryLimits::Describe() const {
  const std::string physical = physical_bytes == 0
                                   ? "physical memory unknown"
                                   : absl::StrCat("physical memory ", FormatBytes(physical_bytes));
  std::string out = usable_bytes() == cgroup_bytes && cgroup_bytes != 0
                        ? absl::StrCat("the cgroup limit ", FormatBytes(cgroup_bytes), " (",
                                       cgroup_file, "; ", physical, ")")
                        : absl::StrCat(physical, cgroup_bytes != 0 ? "" : " (no cgroup limit)");
  absl::StrAppend(&out, "; RLIMIT_MEMLOCK ",
                  memlock_bytes == UINT64_MAX ? "unlimited" : FormatBytes(memlock_bytes));
  return out;
}

MemoryLimits ReadMemoryLimits(const std::string& root) {
  MemoryLimits limits;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) {
    limits.physical_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  }
  rlimit memlock{};
  if (getrlimit(RLIMIT_MEMLOCK, &memlock) == 0 && memlock.rlim_cur != RLIM_INFINITY) {
    limits.memlock_bytes = memlock.rlim_cur;
  }
  std::string self;
  if (!ReadTextFile(root + "/proc/self/cgroup", &self)) return limits;
  const std::string cgroup_root = root + "/sys/fs/cgroup";
  // Lines are "hierarchy-id:controllers:path"; v2's is "0::path".
  for (absl::string_view line : absl::StrSplit(self, '\n', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) {
      const std::string unified =
          Exists(cgroup_root + "/cgroup.controllers") ? cgroup_root : cgroup_root + "/unified";
      TakeSmallest(unified, parts[2], "memory.max", &limits);
      continue;
    }
    for (absl::string_view controller : absl::StrSplit(parts[1], ',')) {
      if (controller == "memory") {
        TakeSmallest(cgroup_root + "/memory", parts[2], "memory.limit_in_bytes", &limits);
      }
    }
  }
  return limits;
}

}  // namespace actstash::server
