#include "server/pool/pool_segment.h"

#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/huge_pages.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

// Faults in every page of a fresh mapping (what MAP_POPULATE does at mmap,
// which would come before the binding).
absl::Status Populate(std::byte* at, uint64_t bytes) {
  if (madvise(at, bytes, kMadvPopulateWrite) == 0) return absl::OkStatus();
  if (errno != EINVAL) return ErrnoStatus("populating a pool segment", errno);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t offset = 0; offset < bytes; offset += page) {
    *reinterpret_cast<volatile std::byte*>(at + offset) = std::byte{0};  // a fresh memfd is zero
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MbindToNodes(std::byte* at, uint64_t bytes, const std::vector<int>& nodes) {
  constexpr int kMaxNodes = 1024;
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  for (int node : nodes) {
    if (node < 0 || node >= kMaxNodes) {
      return absl::InvalidArgumentError(absl::StrCat("NUMA node ", node, " is out of range"));
    }
    mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  }
  const int mode = nodes.size() == 1 ? MPOL_BIND : MPOL_INTERLEAVE;
  if (syscall(SYS_mbind, at, bytes, mode, mask, kMaxNodes + 1, 0) != 0) {
    return ErrnoStatus(
        absl::StrCat("binding a pool segment to NUMA node(s) ", absl::StrJoin(nodes, ",")), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> MapFreshSegment(std::byte* at, uint64_t index, uint64_t bytes, bool lock,
                                         bool* locked, const std::vector<int>& nodes,
                                         const NumaBinder& binder) {
  const std::string name = absl::StrCat("actstash-segment-", index);
  UniqueFd fd(memfd_create(name.c_str(), MFD_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus("memfd_create", errno);
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus("ftruncate of a pool segment", errno);
  }
  const ShmemHugePages pages = NodeShmemHugePages();
  if (nodes.empty()) {
    if (absl::Status s = MapSharedPopulated(at, bytes, fd.get(), pages); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("pool segment ", index, ": ", s.message()));
    }
  } else {
    void* mapped = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd.get(), 0);
    if (mapped == MAP_FAILED) return ErrnoStatus("mapping a pool segment", errno);
    if (HugePagesAllowed(pages)) (void)madvise(at, bytes, MADV_HUGEPAGE);  // advice only
    const absl::Status bound = binder ? binder(at, bytes, nodes) : MbindToNodes(at, bytes, nodes);
    if (!bound.ok()) return bound;
    if (absl::Status s = Populate(at, bytes); !s.ok()) return s;
  }
  *locked = lock && mlock(at, bytes) == 0;
  if (lock && !*locked) {
    spdlog::warn("mlock of a renewed segment failed: {}; it stays unpinned", std::strerror(errno));
  }
  return fd;
}

}  // namespace actstash::server
