#include "server/pool/host_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/check.h"
#include "common/huge_pages.h"
#include "common/unique_fd.h"
#include "common/units.h"
#include "server/pool/pool_segment.h"
#include "server/pool/range_allocator.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

// A part of the pool whose pages are bound to one NUMA node: the byte range
// [begin, end) of whole segments.
struct NumaSlice {
  int node = -1;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Splits `segments` segments into one part per node of a split pool (as
// even as whole segments allow, the first parts taking the remainder), or
// one part for a pool bound to a single node; none otherwise.
absl::StatusOr<std::vector<NumaSlice>> SliceByNode(const HostPoolOptions& options,
                                                   uint64_t segments) {
  std::vector<NumaSlice> slices;
  const std::vector<int>& nodes = options.numa_nodes;
  if (!options.numa_split && nodes.size() != 1) return slices;
  if (nodes.empty()) {
    return absl::InvalidArgumentError("a pool split per NUMA node needs the nodes");
  }
  if (nodes.size() > segments) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a pool of ", segments, " segments cannot be split over ", nodes.size(), " NUMA nodes (",
        absl::StrJoin(nodes, ","), "): give it at least one segment per node"));
  }
  uint64_t first = 0;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const uint64_t count = segments / nodes.size() + (k < segments % nodes.size() ? 1 : 0);
    slices.push_back(
        {nodes[k], first * options.segment_bytes, (first + count) * options.segment_bytes});
    first += count;
  }
  return slices;
}

// The nodes the segment at byte `at` is bound to: its part's node, else
// HostPoolOptions::numa_nodes.
std::vector<int> SegmentNodes(const std::vector<NumaSlice>& slices,
                              const std::vector<int>& numa_nodes, uint64_t at) {
  for (const NumaSlice& slice : slices) {
    if (at >= slice.begin && at < slice.end) return {slice.node};
  }
  return numa_nodes;
}

// Unregisters from CUDA the segments flagged in `registered`.
void UnregisterSegments(PinnedRegistrar* registrar, std::byte* base, uint64_t segment_bytes,
                        const std::vector<bool>& registered) {
  for (uint64_t i = 0; i < registered.size(); ++i) {
    if (!registered[i]) continue;
    if (absl::Status s = registrar->Unregister(base + i * segment_bytes); !s.ok()) {
      spdlog::warn("unregistering host pool segment {} from CUDA failed: {}", i, s.ToString());
    }
  }
}

std::string UnregisteredWarning(uint64_t unregistered, uint64_t segments,
                                const absl::Status& first_error) {
  return absl::StrCat(unregistered, " of ", segments,
                      " host pool segments could not be registered with CUDA (",
                      first_error.message(),
                      "); they stay unregistered: GPU copies from them are staged by the "
                      "driver (slower, and not asynchronous)");
}

// Thread-safety: the allocator, the segment fds and the per-segment flags are
// guarded by mu_; the address range is fixed between construction and
// destruction (renewal remaps a segment in place, for a run held exclusively).
// The registrar is called outside mu_, for segments the caller holds.
class MemfdHostPool final : public HostPool, private AllocationOwner {
 public:
  MemfdHostPool(std::byte* base, std::vector<UniqueFd> fds, const HostPoolOptions& options,
                std::vector<NumaSlice> slices, uint64_t locked_bytes,
                std::vector<bool> cuda_registered)
      : base_(base),
        segment_count_(fds.size()),
        segment_bytes_(options.segment_bytes),
        total_bytes_(segment_bytes_ * segment_count_),
        pinned_(locked_bytes != 0),
        registrar_(options.cuda_registrar),
        numa_nodes_(options.numa_nodes),
        numa_binder_(options.numa_binder),
        slices_(std::move(slices)),
        require_cuda_(options.require_cuda_pinned),
        allocator_(total_bytes_, options.alignment),
        segment_fds_(std::move(fds)),
        held_inline_(segment_count_, false),
        unpinned_(segment_count_, false),
        cuda_registered_(std::move(cuda_registered)),
        cuda_warned_(std::find(cuda_registered_.begin(), cuda_registered_.end(), false) !=
                     cuda_registered_.end()) {}

  ~MemfdHostPool() override {
    if (locker_.joinable()) locker_.join();
    std::vector<bool> registered;
    {
      absl::MutexLock lock(&mu_);
      ACTSTASH_CHECK(allocator_.allocation_count() == 0,
                     "HostPool destroyed while Allocations are alive");
      registered = cuda_registered_;
    }
    // Registrations go before the pages do.
    if (registrar_ != nullptr) UnregisterSegments(registrar_, base_, segment_bytes_, registered);
    munmap(base_, total_bytes_);
    absl::MutexLock lock(&mu_);
    segment_fds_.clear();
  }

  absl::StatusOr<Allocation> Allocate(uint64_t nbytes) override {
    if (nbytes == 0) return Allocation();
    absl::MutexLock lock(&mu_);
    std::optional<uint64_t> offset = allocator_.Allocate(nbytes);
    if (!offset.has_value()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host pool exhausted: requested ", nbytes, " bytes (", FormatBytes(nbytes),
                       "), available ", allocator_.free_bytes(), " bytes free of ", total_bytes_,
                       ", largest free block ", allocator_.largest_free_block(), " bytes"));
    }
    return MakeAllocation(this, base_ + *offset, *offset, nbytes);
  }

  absl::StatusOr<SegmentRun> AllocateSegments(uint32_t count, int numa_node) override {
    if (count == 0 || count > segment_count_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("requested ", count, " segments; the pool has ", segment_count_));
    }
    const uint64_t bytes = uint64_t{count} * segment_bytes_;
    absl::MutexLock lock(&mu_);
    // A split pool: the caller's node first, then the other parts in order,
    // and only then a run across parts (on two nodes).
    std::optional<uint64_t> offset;
    for (int pass = 0; pass < 2 && !offset.has_value(); ++pass) {
      for (const NumaSlice& slice : slices_) {
        if ((slice.node == numa_node) != (pass == 0)) continue;
        offset = allocator_.AllocateWithin(bytes, segment_bytes_, slice.begin, slice.end);
        if (offset.has_value()) break;
      }
    }
    if (!offset.has_value()) offset = allocator_.Allocate(bytes, segment_bytes_);
    if (!offset.has_value()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "host pool exhausted: requested ", count, " contiguous segments (", bytes,
          " bytes), available ", allocator_.free_bytes(), " bytes free of ", total_bytes_,
          ", largest free block ", allocator_.largest_free_block(), " bytes"));
    }
    SegmentRun run;
    run.first_segment = static_cast<uint32_t>(*offset / segment_bytes_);
    run.count = count;
    run.numa_node = NodeOf(*offset, bytes);
    run.spans_nodes = !slices_.empty() && run.numa_node < 0;
    // The flags are cleared by RenewSegments only: a run freed unrenewed
    // (its fds never left) keeps them.
    for (uint32_t i = run.first_segment; i < run.first_segment + count; ++i) {
      run.needs_scrub = run.needs_scrub || held_inline_[i];
    }
    segment_runs_.insert(*offset);
    run.memory = MakeAllocation(this, base_ + *offset, *offset, bytes);
    return run;
  }

  absl::StatusOr<UniqueFd> DupSegmentFd(uint32_t index) const override {
    ACTSTASH_CHECK(index < segment_count_, "segment index out of range");
    absl::MutexLock lock(&mu_);
    return DupFd(segment_fds_[index].get(), "duplicating a segment fd");
  }

  absl::Status RenewSegments(const SegmentRun& run) override {
    for (uint32_t i = run.first_segment; i < run.first_segment + run.count; ++i) {
      std::byte* at = base_ + uint64_t{i} * segment_bytes_;
      // A CUDA registration pins the pages mapped now: kept over the remap,
      // DMA would still reach the old (punched) memfd. Dropped first.
      bool was_registered = false;
      {
        absl::MutexLock lock(&mu_);
        was_registered = cuda_registered_[i];
        cuda_registered_[i] = false;
      }
      if (was_registered) {
        if (absl::Status s = registrar_->Unregister(at); !s.ok()) {
          spdlog::error("unregistering host pool segment {} from CUDA before its renewal: {}", i,
                        s.ToString());
        }
      }
      bool locked = false;
      absl::StatusOr<UniqueFd> fd = MapFreshSegment(at, i, segment_bytes_, pinned_.load(), &locked,
                                                    NodesOfSegment(i), numa_binder_);
      if (!fd.ok()) {
        // A failed MAP_FIXED may have unmapped the range: put the old memfd
        // back, or the pool has a hole the allocator does not know about.
        int old_fd;
        {
          absl::MutexLock lock(&mu_);
          old_fd = segment_fds_[i].get();
        }
        ACTSTASH_CHECK(mmap(at, segment_bytes_, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_FIXED | MAP_POPULATE, old_fd, 0) != MAP_FAILED,
                       "cannot restore a pool segment's mapping after a failed renewal");
        if (was_registered) RegisterSegment(i).IgnoreError();  // logged there
        return fd.status();
      }
      UniqueFd old_fd = *std::move(fd);
      {
        absl::MutexLock lock(&mu_);
        std::swap(segment_fds_[i], old_fd);
        held_inline_[i] = false;
        unpinned_[i] = pinned_.load() && !locked;  // stats say what is really pinned
      }
      // Empties the old memfd for whoever still maps it.
      fallocate(old_fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                static_cast<off_t>(segment_bytes_));
      old_fd.Reset();
      if (registrar_ != nullptr) {
        // Required: the run is kept out of use (quarantined by its owner)
        // rather than handed out unregistered.
        if (absl::Status s = RegisterSegment(i); !s.ok() && require_cuda_) return s;
      }
    }
    return absl::OkStatus();
  }

  uint64_t segment_bytes() const override { return segment_bytes_; }
  uint32_t segment_count() const override { return static_cast<uint32_t>(segment_count_); }

  absl::StatusOr<std::vector<UniqueFd>> DupSegmentFds() const override {
    absl::MutexLock lock(&mu_);
    std::vector<UniqueFd> fds;
    for (const UniqueFd& fd : segment_fds_) {
      absl::StatusOr<UniqueFd> dup = DupFd(fd.get(), "duplicating a segment fd");
      if (!dup.ok()) return dup.status();
      fds.push_back(*std::move(dup));
    }
    return fds;
  }

  std::vector<uint32_t> HeldInlineSegments() const override {
    absl::MutexLock lock(&mu_);
    std::vector<uint32_t> held;
    for (uint32_t i = 0; i < segment_count_; ++i) {
      if (held_inline_[i]) held.push_back(i);
    }
    return held;
  }

  absl::StatusOr<SegmentRun> AdoptRun(uint32_t first, uint32_t count) override {
    if (count == 0 || first >= segment_count_ || count > segment_count_ - first) {
      return absl::InvalidArgumentError(
          absl::StrCat("segments ", first, "+", count, " are outside a pool of ", segment_count_));
    }
    const uint64_t offset = uint64_t{first} * segment_bytes_;
    const uint64_t bytes = uint64_t{count} * segment_bytes_;
    absl::MutexLock lock(&mu_);
    const std::optional<uint64_t> at =
        allocator_.AllocateWithin(bytes, segment_bytes_, offset, offset + bytes);
    if (!at.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("segments ", first, "+", count, " meet a run already taken"));
    }
    ACTSTASH_CHECK(*at == offset, "an exact window allocated elsewhere");
    SegmentRun run;
    run.first_segment = first;
    run.count = count;
    run.numa_node = NodeOf(offset, bytes);
    run.spans_nodes = !slices_.empty() && run.numa_node < 0;
    segment_runs_.insert(offset);
    run.memory = MakeAllocation(this, base_ + offset, offset, bytes);
    return run;
  }

  absl::StatusOr<Allocation> AdoptAllocation(uint64_t offset, uint64_t nbytes) override {
    if (nbytes == 0) return Allocation();
    absl::MutexLock lock(&mu_);
    const uint64_t granule = allocator_.granule();
    if (offset % granule != 0 || offset >= total_bytes_ || nbytes > total_bytes_ - offset) {
      return absl::InvalidArgumentError(absl::StrCat("an object of ", nbytes, " bytes at offset ",
                                                     offset, " is outside a pool of ", total_bytes_,
                                                     " bytes or misaligned"));
    }
    const uint64_t rounded = (nbytes + granule - 1) / granule * granule;
    const std::optional<uint64_t> at = allocator_.AllocateWithin(
        nbytes, granule, offset, std::min(total_bytes_, offset + rounded));
    if (!at.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("an object of ", nbytes, " bytes at offset ",
                                                     offset, " meets a range already taken"));
    }
    ACTSTASH_CHECK(*at == offset, "an exact window allocated elsewhere");
    return MakeAllocation(this, base_ + offset, offset, nbytes);
  }

  void FinishBackgroundWork() override {
    if (locker_.joinable()) locker_.join();
  }

  // An adopted pool's mlock, on a thread of its own once the daemon serves
  // (the pages are resident: the predecessor locked them): building the page
  // tables of a large pool holds the process's mmap lock, which gRPC's start
  // needs too. kOn's failure can no longer fail the start: logged as an
  // error.
  void StartBackgroundWork() override {
    if (lock_mode_ == Tristate::kOff || locker_.joinable()) return;
    const Tristate mode = lock_mode_;
    locker_ = std::thread([this, mode] {
      const auto start = std::chrono::steady_clock::now();
      // Segment by segment: mlock holds the process's mmap lock while it
      // builds page tables, and the daemon's other threads (starting to
      // serve) need it too.
      int failed = 0;
      for (uint64_t i = 0; i < segment_count_ && failed == 0; ++i) {
        if (mlock(base_ + i * segment_bytes_, segment_bytes_) != 0) failed = errno;
      }
      if (failed == 0) {
        pinned_.store(true);
        spdlog::info("host pool: {} mlocked in {} ms (after serving started)",
                     FormatBytes(total_bytes_),
                     std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::steady_clock::now() - start)
                         .count());
        return;
      }
      munlock(base_, total_bytes_);  // all or nothing, as at creation
      if (mode == Tristate::kOn) {
        spdlog::error("mlock of the adopted host pool failed: {}", std::strerror(failed));
      } else {
        spdlog::warn("mlock of the adopted host pool failed: {}; it stays unpinned",
                     std::strerror(failed));
      }
    });
  }

  // AdoptHostPool: StartBackgroundWork locks the pool per `mode`.
  void LockLater(Tristate mode) { lock_mode_ = mode; }

  // AdoptHostPool: the segments to scrub before they are leased.
  void MarkHeldInline(const std::vector<uint32_t>& segments) {
    absl::MutexLock lock(&mu_);
    for (uint32_t i : segments) {
      if (i < segment_count_) held_inline_[i] = true;
    }
  }

  PoolStats Stats() const override {
    absl::MutexLock lock(&mu_);
    PoolStats stats;
    stats.set_total_bytes(total_bytes_);
    stats.set_used_bytes(allocator_.used_bytes());
    stats.set_free_bytes(allocator_.free_bytes());
    stats.set_largest_free_bytes(allocator_.largest_free_block());
    stats.set_segment_bytes(segment_bytes_);
    stats.set_segments(segment_count_);
    stats.set_locked_bytes(pinned_.load()
                               ? total_bytes_ -
                                     segment_bytes_ * static_cast<uint64_t>(std::count(
                                                          unpinned_.begin(), unpinned_.end(), true))
                               : 0);
    stats.set_cuda_pinned_bytes(
        segment_bytes_ *
        static_cast<uint64_t>(std::count(cuda_registered_.begin(), cuda_registered_.end(), true)));
    stats.set_allocations(allocator_.allocation_count());
    for (const NumaSlice& slice : slices_) {
      v1::NumaNodeStats* node = stats.add_numa_nodes();
      node->set_node(slice.node);
      node->set_total_bytes(slice.end - slice.begin);
      node->set_free_bytes(allocator_.FreeBytesWithin(slice.begin, slice.end));
      uint64_t leased = 0;
      for (uint64_t offset : segment_runs_) {
        const uint64_t end = offset + allocator_.AllocationSize(offset).value_or(0);
        if (end > slice.begin && offset < slice.end) {
          leased += std::min(end, slice.end) - std::max(offset, slice.begin);
        }
      }
      node->set_leased_bytes(leased);
    }
    return stats;
  }

 private:
  // Registers segment `i` (mapped now, held by the caller) with CUDA and
  // records the outcome; the first failure of a pool that does not require
  // registration is logged once.
  absl::Status RegisterSegment(uint64_t i) {
    const absl::Status status = registrar_->Register(base_ + i * segment_bytes_, segment_bytes_);
    absl::MutexLock lock(&mu_);
    cuda_registered_[i] = status.ok();
    if (!status.ok()) {
      if (require_cuda_) {
        spdlog::error("registering renewed host pool segment {} with CUDA failed: {}", i,
                      status.ToString());
      } else if (!cuda_warned_) {
        cuda_warned_ = true;
        spdlog::warn("{}", UnregisteredWarning(1, segment_count_, status));
      }
    }
    return status;
  }

  std::vector<int> NodesOfSegment(uint64_t i) const {
    return SegmentNodes(slices_, numa_nodes_, i * segment_bytes_);
  }

  // The node that holds all of [offset, offset + bytes), or -1.
  int NodeOf(uint64_t offset, uint64_t bytes) const {
    for (const NumaSlice& slice : slices_) {
      if (offset >= slice.begin && offset + bytes <= slice.end) return slice.node;
    }
    return -1;
  }

  void Free(uint64_t offset) override {
    absl::MutexLock lock(&mu_);
    const std::optional<uint64_t> size = allocator_.AllocationSize(offset);
    ACTSTASH_CHECK(size.has_value(), "freeing a range the pool did not hand out");
    // Inline objects may have been any session's data: the segments they
    // touched are renewed before they are leased. (Leases are renewed by
    // their owner before they come back here.)
    if (segment_runs_.erase(offset) == 0) {
      for (uint64_t i = offset / segment_bytes_; i <= (offset + *size - 1) / segment_bytes_; ++i) {
        held_inline_[i] = true;
      }
    }
    allocator_.Free(offset);
  }

  std::byte* const base_;
  const uint64_t segment_count_;
  const uint64_t segment_bytes_;
  const uint64_t total_bytes_;
  // The pool is mlocked (at creation, or by StartBackgroundWork): renewals
  // mlock too.
  std::atomic<bool> pinned_;
  std::thread locker_;  // StartBackgroundWork's; joined before the range is unmapped
  Tristate lock_mode_ = Tristate::kOff;  // an adopted pool's mlock, started later
  PinnedRegistrar* const registrar_;     // null: no CUDA registration
  const std::vector<int> numa_nodes_;    // HostPoolOptions::numa_nodes, for renewals
  const NumaBinder numa_binder_;
  // The pool's parts on NUMA nodes (byte ranges of the pool): one per node
  // of a split pool, one for a pool bound to one node, else none.
  const std::vector<NumaSlice> slices_;
  const bool require_cuda_;
  mutable absl::Mutex mu_;
  RangeAllocator allocator_ ABSL_GUARDED_BY(mu_);
  std::vector<UniqueFd> segment_fds_ ABSL_GUARDED_BY(mu_);
  // Segments that held inline objects since they were last renewed.
  std::vector<bool> held_inline_ ABSL_GUARDED_BY(mu_);
  // Segments a renewal could not mlock again (only when pinned_).
  std::vector<bool> unpinned_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> segment_runs_ ABSL_GUARDED_BY(mu_);  // offsets of leases
  // Segments registered with CUDA now.
  std::vector<bool> cuda_registered_ ABSL_GUARDED_BY(mu_);
  bool cuda_warned_ ABSL_GUARDED_BY(mu_);  // an unregistered segment was reported
};

std::string MemlockLimitText() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return FormatBytes(limit.rlim_cur);
}

}  // namespace

namespace {

// CreateHostPool, or AdoptHostPool when `adopt` is given (its memfds are
// mapped instead of fresh ones).
absl::StatusOr<std::unique_ptr<MemfdHostPool>> BuildHostPool(const HostPoolOptions& options,
                                                             std::vector<UniqueFd>* adopt) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (options.segment_bytes == 0 || options.segment_bytes % page != 0) {
    return absl::InvalidArgumentError(absl::StrCat("segment size ", options.segment_bytes,
                                                   " is not a positive multiple of the page size ",
                                                   page));
  }
  // A lease is a run of whole segments placed with segment alignment, which
  // the allocator takes only as a power of two.
  if (!IsPowerOfTwo(options.segment_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment size ", options.segment_bytes, " is not a power of two"));
  }
  if (!IsPowerOfTwo(options.alignment) || options.alignment > page) {
    return absl::InvalidArgumentError(
        absl::StrCat("alignment ", options.alignment, " is not a power of two <= ", page));
  }
  const uint64_t segments = options.pool_bytes / options.segment_bytes;
  if (segments == 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool size ", FormatBytes(options.pool_bytes),
                                                   " is smaller than one segment (",
                                                   FormatBytes(options.segment_bytes), ")"));
  }
  const uint64_t total = segments * options.segment_bytes;
  if (adopt != nullptr && adopt->size() != segments) {
    return absl::InvalidArgumentError(
        absl::StrCat("the serving daemon's pool has ", adopt->size(), " segments of ",
                     FormatBytes(options.segment_bytes), "; this one is configured for ", segments,
                     " (give it the same pool_size)"));
  }
  absl::StatusOr<std::vector<NumaSlice>> slices = SliceByNode(options, segments);
  if (!slices.ok()) return slices.status();

  // On a 2 MiB boundary: segments then start on one, and can use huge pages.
  std::byte* base = ReserveAligned(total);
  if (base == nullptr) return ErrnoStatus("reserving the pool's address range", errno);

  std::vector<UniqueFd> fds;
  auto fail = [&](absl::Status status) {
    munmap(base, total);
    fds.clear();
    return status;
  };
  // Each segment maps its handed memfd (adopt), or a fresh one: CreateHostPool,
  // and a segment whose fd was not handed.
  for (uint64_t i = 0; i < segments; ++i) {
    UniqueFd fd = adopt != nullptr ? std::move((*adopt)[i]) : UniqueFd();
    if (!fd.valid()) {
      bool unused = false;
      absl::StatusOr<UniqueFd> fresh = MapFreshSegment(
          base + i * options.segment_bytes, i, options.segment_bytes, false, &unused,
          SegmentNodes(*slices, options.numa_nodes, i * options.segment_bytes),
          options.numa_binder);
      if (!fresh.ok()) return fail(fresh.status());
      fds.push_back(*std::move(fresh));
      continue;
    }
    struct stat st {};
    if (fstat(fd.get(), &st) != 0) return fail(ErrnoStatus("fstat of a handed segment", errno));
    if (static_cast<uint64_t>(st.st_size) != options.segment_bytes) {
      return fail(absl::InvalidArgumentError(absl::StrCat("handed segment ", i, " is ", st.st_size,
                                                          " bytes, not ", options.segment_bytes)));
    }
    // Not populated: the pages are resident (clients' data), and building
    // the page tables of a large pool is most of a take-over's pause; the
    // daemon touches pool memory only for inline objects and renewals.
    if (mmap(base + i * options.segment_bytes, options.segment_bytes, PROT_READ | PROT_WRITE,
             MAP_SHARED | MAP_FIXED, fd.get(), 0) == MAP_FAILED) {
      return fail(ErrnoStatus("mapping a handed segment", errno));
    }
    fds.push_back(std::move(fd));
  }
  // Once per daemon: the node's setting decides, and an operator can change it.
  spdlog::info("{}", DescribePoolPages(NodeShmemHugePages()));

  uint64_t locked = 0;
  if (options.mlock != Tristate::kOff && adopt == nullptr) {  // adopted: StartBackgroundWork
    if (mlock(base, total) == 0) {
      locked = total;
    } else {
      const int error = errno;
      const std::string why = absl::StrCat(
          "mlock of the ", FormatBytes(total), " host pool failed: ", std::strerror(error),
          " (RLIMIT_MEMLOCK is ", MemlockLimitText(),
          "); raise it with `ulimit -l unlimited`, LimitMEMLOCK=infinity (systemd) or the "
          "IPC_LOCK capability (containers)");
      if (options.mlock == Tristate::kOn) {
        return fail(absl::ResourceExhaustedError(why));
      }
      spdlog::warn(
          "{}; continuing with unpinned memory (pages may be swapped out, and GPU "
          "copies from it will not run at full speed)",
          why);
    }
  }
  // Per segment, not the whole range: a renewal replaces one segment's pages.
  std::vector<bool> registered(segments, false);
  if (options.cuda_registrar != nullptr) {
    absl::Status first_error;
    uint64_t failed = 0;
    for (uint64_t i = 0; i < segments; ++i) {
      std::byte* at = base + i * options.segment_bytes;
      absl::Status status = options.cuda_registrar->Register(at, options.segment_bytes);
      registered[i] = status.ok();
      if (status.ok()) continue;
      if (options.require_cuda_pinned) {
        UnregisterSegments(options.cuda_registrar, base, options.segment_bytes, registered);
        return fail(absl::Status(
            status.code(), absl::StrCat("registering host pool segment ", i, " of ", segments, " (",
                                        FormatBytes(options.segment_bytes),
                                        ") with CUDA failed: ", status.message())));
      }
      if (failed++ == 0) first_error = status;
    }
    if (failed > 0) spdlog::warn("{}", UnregisteredWarning(failed, segments, first_error));
  }
  return std::make_unique<MemfdHostPool>(base, std::move(fds), options, *std::move(slices), locked,
                                         std::move(registered));
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostPool>> CreateHostPool(const HostPoolOptions& options) {
  absl::StatusOr<std::unique_ptr<MemfdHostPool>> pool = BuildHostPool(options, nullptr);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<HostPool>(*std::move(pool));
}

absl::StatusOr<std::unique_ptr<HostPool>> AdoptHostPool(const HostPoolOptions& options,
                                                        std::vector<UniqueFd> segments,
                                                        const std::vector<uint32_t>& held_inline) {
  absl::StatusOr<std::unique_ptr<MemfdHostPool>> pool = BuildHostPool(options, &segments);
  if (!pool.ok()) return pool.status();
  (*pool)->MarkHeldInline(held_inline);
  (*pool)->LockLater(options.mlock);
  return std::unique_ptr<HostPool>(*std::move(pool));
}

}  // namespace actstash::server
