// 2 MiB pages for the pool's shared memory: what the node allows, and the
// one way the daemon and the clients map a memfd with them.
//
// The pool is memfd (shmem) memory. Linux backs shmem with transparent huge
// pages according to /sys/kernel/mm/transparent_hugepage/shmem_enabled:
// "always"/"within_size"/"force" for every mapping, "advise" for mappings
// given MADV_HUGEPAGE, "never"/"deny" not at all. With 2 MiB pages a first
// touch faults once per 2 MiB instead of once per 4 KiB (5-12 us each on
// virtual machines), page tables shrink 512x, and cudaHostRegister pins
// fewer, larger pages. Thread-safe: no shared state but a cached read of the
// node's setting.
#ifndef ACTSTASH_COMMON_HUGE_PAGES_H_
#define ACTSTASH_COMMON_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace actstash {

inline constexpr uint64_t kHugePageBytes = 2 << 20;
// MADV_POPULATE_WRITE (Linux 5.14; Debian 12's headers predate it): fault in
// pages for writing without changing their contents. EINVAL on older kernels.
inline constexpr int kMadvPopulateWrite = 23;
inline constexpr const char* kShmemEnabledPath =
    "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

enum class ShmemHugePages { kAlways, kWithinSize, kAdvise, kNever, kDeny, kForce, kUnknown };

// The bracketed word of shmem_enabled ("always within_size [advise] never
// deny force"); kUnknown when there is none.
ShmemHugePages ParseShmemEnabled(absl::string_view text);
// The node's setting, read once per process (kUnknown without the file).
ShmemHugePages NodeShmemHugePages();
// Whether memfd mappings can get 2 MiB pages under `mode` (with advice).
bool HugePagesAllowed(ShmemHugePages mode);
// One sentence for the daemon's log: which pages the pool gets and, where
// 4 KiB ones, why and how to change it.
std::string DescribePoolPages(ShmemHugePages mode);

// Maps [at, at + bytes) of a reserved range to `fd` from offset 0
// (MAP_SHARED | MAP_FIXED), asks for 2 MiB pages where `mode` allows
// (MADV_HUGEPAGE: needed under "advise", harmless otherwise), then faults in
// every page for writing without changing its contents (MADV_POPULATE_WRITE;
// MAP_POPULATE on kernels before 5.14): the page-table work happens here,
// not on the hot path.
absl::Status MapSharedPopulated(std::byte* at, uint64_t bytes, int fd, ShmemHugePages mode);

// Reserves `bytes` of address space (PROT_NONE) starting on a 2 MiB
// boundary, so that mappings placed in it at 2 MiB offsets can use huge
// pages; nullptr with errno set on failure. Release with munmap(at, bytes).
std::byte* ReserveAligned(uint64_t bytes);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_HUGE_PAGES_H_
