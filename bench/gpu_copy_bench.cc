// gpu_copy_bench: host<->device copy bandwidth into the kind of memory
// actstash's leased segments are (a memfd mapped MAP_SHARED|MAP_POPULATE and
// registered with cudaHostRegister), against cudaHostAlloc memory measured in
// the same run; whether such copies on a separate non-blocking stream overlap
// with compute; and what actstash itself does (Client::Reserve/Locate and a
// CudaCopyEngine on leases of a private actstashd) next to the same baseline.
// Needs a CUDA device; without one it prints "no CUDA device: skipped" and
// exits 0.
//
//   gpu_copy_bench                    # all four measurements, 1..256 MiB, 5 repetitions
//   gpu_copy_bench --measure engine,strided
//   gpu_copy_bench --compute-ms 50 --copy-fractions 0.5,0.95
//   gpu_copy_bench --quick            # smoke run (ctest gpu_copy_bench_quick)
//
// --measure picks the sections (default: bandwidth,overlap,engine,strided).
// GB/s = 1e9 B/s throughout.
//
// 1. bandwidth: per size and direction (D2H, H2D), cudaMemcpyAsync between a
//    cudaMalloc buffer and (a) cudaHostAlloc memory, the baseline; (b) a memfd
//    mapping registered with cudaHostRegister (--register-flags); (c) a second
//    mapping of the same memfd, i.e. the same pages, that is not registered
//    (pageable: the driver stages it through its own pinned buffers). Each
//    measurement is back-to-back copies moving >= --min-bytes on one
//    non-blocking stream, timed with cudaEvents around them; (a), (b), (c) run
//    one after the other in every repetition, and the ratios (b)/(a), (c)/(a)
//    are taken per repetition; medians over --reps repetitions are printed.
// 2. overlap: a compute-bound FMA kernel sized to take --compute-ms on the
//    legacy default stream (where a framework's compute runs), and C bytes of
//    copies (--chunk each) between device memory and the registered mapping on
//    a non-blocking stream, started with the kernel (event) and joined to the
//    compute stream after it (event), the way CudaCopyEngine orders them. C is
//    each --copy-fractions of the compute time at the D2H (or H2D) bandwidth
//    into registered memory at the last --sizes entry (measured in section 1,
//    or apart when it does not run), so that the copies alone take less time
//    than the compute. Step = event on the compute stream before the kernel to
//    event after the join. Per repetition: --steps steps without copies and
//    with them, alternating; ratio = total with / total without; the median
//    over --reps repetitions is printed (target: <= 1.05).
// 3. engine: actstash's own path. A private actstashd (--pool, 64 MiB
//    segments; or --address), one attached Client with pin_leases kOn (every
//    lease registered with CUDA, a failure is an error) and lease_batch large
//    enough to keep --engine-window of segments leased, and a CudaCopyEngine
//    on the device. Per size n: `copies` = --min-bytes / n buffers (at least
//    1), handled in batches of depth = --engine-window / n (at least 1, at
//    most `copies`). Per batch, host clock: D2H = for each buffer
//    Client::Reserve(n) + CopyAsync(kStore, reservation, device, n, after the
//    compute stream), then Wait on every event; H2D = for each buffer
//    Client::Locate + CopyAsync(kFetch, device, located, n, after the compute
//    stream) + OrderAfterAsync(compute stream), then one
//    cudaStreamSynchronize(compute stream); then Release of each (not timed).
//    The baseline (a) is timed the same way in the same repetition, right
//    before: per batch, depth cudaMemcpyAsync into successive n-byte pieces of
//    cudaHostAlloc memory and a stream sync, then the same back. Medians over
//    --reps repetitions, and of the per-repetition ratio engine/(a).
//    Target: engine D2H >= 0.90 x (a).
// 4. strided: a D x D fp32 device tensor (--strided-dim) viewed transposed
//    (sizes {D, D}, strides {1, D}) packed by CopyEngine::GatherAsync straight
//    into a reservation, against (a) cudaMemcpyAsync of the same bytes into
//    cudaHostAlloc memory and (e) the engine's contiguous CopyAsync of them
//    into a reservation; D2H only, batched and timed as in section 3.
#include "bench/gpu_copy_bench.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "bench/bench_util.h"
#include "common/cuda_status.h"
#include "tests/support/daemon_process.h"

// Dies with the CUDA error, its expression and file:line when `expr` fails.
#define BENCH_CUDA(expr) ::actstash::bench::Check(ACTSTASH_CUDA_STATUS(expr), "CUDA")

namespace {

using namespace actstash::bench;  // NOLINT: the shared helpers
using actstash::Client;
using actstash::CopyEngine;
using actstash::CopyEvent;
using actstash::CopyStream;
using actstash::StreamHandle;
using actstash::TensorLayout;

enum class Direction { kD2H, kH2D };

const char* Name(Direction dir) { return dir == Direction::kD2H ? "D2H" : "H2D"; }

// A memfd of `bytes` mapped twice, MAP_SHARED|MAP_POPULATE (as the client maps
// a leased segment): `registered` gets cudaHostRegister'ed, `pageable` (the
// same pages) never does.
class MemfdSegment {
 public:
  MemfdSegment(size_t bytes, unsigned register_flags) : bytes_(bytes) {
    fd_ = memfd_create("gpu_copy_bench", MFD_CLOEXEC);
    if (fd_ < 0) Die(std::string("memfd_create: ") + std::strerror(errno));
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
      Die(std::string("ftruncate: ") + std::strerror(errno));
    registered_ = Map();
    pageable_ = Map();
    BENCH_CUDA(cudaHostRegister(registered_, bytes, register_flags));
  }
  ~MemfdSegment() {
    BENCH_CUDA(cudaHostUnregister(registered_));
    munmap(registered_, bytes_);
    munmap(pageable_, bytes_);
    close(fd_);
  }
  MemfdSegment(const MemfdSegment&) = delete;
  MemfdSegment& operator=(const MemfdSegment&) = delete;

  unsigned char* registered() const { return static_cast<unsigned char*>(registered_); }
  unsigned char* pageable() const { return static_cast<unsigned char*>(pageable_); }

 private:
  void* Map() const {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, 0);
    if (p == MAP_FAILED) Die(std::string("mmap of the memfd: ") + std::strerror(errno));
    return p;
  }

  size_t bytes_;
  int fd_ = -1;
  void* registered_ = nullptr;
  void* pageable_ = nullptr;
};

// Events around work on one stream; milliseconds between them.
struct EventPair {
  EventPair() {
    BENCH_CUDA(cudaEventCreate(&start));
    BENCH_CUDA(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  float Ms() const {
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }
  cudaEvent_t start = nullptr, stop = nullptr;
};

// Enqueues `total` bytes of copies in pieces of at most `chunk` between
// `device` and `host` (both of `span` bytes; offsets wrap around them).
void EnqueueCopies(Direction dir, unsigned char* host, unsigned char* device, size_t span,
                   size_t chunk, size_t total, cudaStream_t stream) {
  size_t offset = 0;
  for (size_t done = 0; done < total;) {
    const size_t n = std::min({chunk, total - done, span - offset});
    if (dir == Direction::kD2H) {
      BENCH_CUDA(
          cudaMemcpyAsync(host + offset, device + offset, n, cudaMemcpyDeviceToHost, stream));
    } else {
      BENCH_CUDA(
          cudaMemcpyAsync(device + offset, host + offset, n, cudaMemcpyHostToDevice, stream));
    }
    done += n;
    offset = (offset + n) % span;
  }
}

// GB/s of `copies` back-to-back copies of n bytes, event-timed on `stream`.
double CopyGbps(Direction dir, unsigned char* host, unsigned char* device, size_t n, long copies,
                cudaStream_t stream) {
  EventPair events;
  BENCH_CUDA(cudaEventRecord(events.start, stream));
  for (long i = 0; i < copies; ++i) {
    if (dir == Direction::kD2H) {
      BENCH_CUDA(cudaMemcpyAsync(host, device, n, cudaMemcpyDeviceToHost, stream));
    } else {
      BENCH_CUDA(cudaMemcpyAsync(device, host, n, cudaMemcpyHostToDevice, stream));
    }
  }
  BENCH_CUDA(cudaEventRecord(events.stop, stream));
  return static_cast<double>(n) * static_cast<double>(copies) / 1e6 / events.Ms();
}

// Fills n bytes with an xorshift64 sequence (not constant, differs per seed).
void FillPattern(unsigned char* p, size_t n, uint64_t seed) {
  uint64_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<unsigned char>(x);
  }
}

// The bytes survive every path: device -> registered, device -> pageable
// view, and registered -> device -> host-alloc, at `n` bytes.
void Verify(unsigned char* pinned, const MemfdSegment& segment, unsigned char* device, size_t n,
            cudaStream_t stream) {
  FillPattern(pinned, n, 0x2545F4914F6CDD1Dull);
  BENCH_CUDA(cudaMemcpyAsync(device, pinned, n, cudaMemcpyHostToDevice, stream));
  std::memset(segment.registered(), 0, n);
  BENCH_CUDA(cudaMemcpyAsync(segment.registered(), device, n, cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  if (std::memcmp(segment.registered(), pinned, n) != 0) Die("D2H into registered: bytes differ");
  if (std::memcmp(segment.pageable(), pinned, n) != 0)
    Die("the pageable mapping does not show the registered mapping's bytes");
  std::memset(segment.pageable(), 0, n);
  BENCH_CUDA(cudaMemcpyAsync(segment.pageable(), device, n, cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  if (std::memcmp(segment.pageable(), pinned, n) != 0) Die("D2H into pageable: bytes differ");
  BENCH_CUDA(cudaMemsetAsync(device, 0, n, stream));
  BENCH_CUDA(cudaMemcpyAsync(device, segment.registered(), n, cudaMemcpyHostToDevice, stream));
  std::memset(pinned, 0, n);
  BENCH_CUDA(cudaMemcpyAsync(pinned, device, n, cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  if (std::memcmp(segment.registered(), pinned, n) != 0) Die("H2D from registered: bytes differ");
}

struct Memory {
  unsigned char* pinned = nullptr;        // cudaHostAlloc, pinned_bytes
  const MemfdSegment* segment = nullptr;  // bytes; null when sections 1 and 2 do not run
  unsigned char* device = nullptr;        // cudaMalloc, bytes
  size_t bytes = 0;
  size_t pinned_bytes = 0;  // >= bytes, and >= what sections 3 and 4 copy per batch
};

// Section 1; sets the median GB/s of D2H and H2D with registered memory at
// the last size (they size the overlap's copies).
void Bandwidth(const Memory& m, const std::vector<size_t>& sizes, size_t min_bytes, int reps,
               cudaStream_t stream, double* d2h_registered, double* h2d_registered) {
  std::printf("%-9s %-4s %7s %10s %10s %10s %9s %9s\n", "size", "dir", "copies", "HostAlloc",
              "registered", "pageable", "reg/HA", "page/HA");
  std::printf("%-9s %-4s %7s %10s %10s %10s %9s %9s\n", "", "", "", "(a) GB/s", "(b) GB/s",
              "(c) GB/s", "(b)/(a)", "(c)/(a)");
  for (size_t n : sizes) {
    for (Direction dir : {Direction::kD2H, Direction::kH2D}) {
      const long copies = static_cast<long>(std::max<size_t>(1, min_bytes / n));
      unsigned char* hosts[3] = {m.pinned, m.segment->registered(), m.segment->pageable()};
      for (unsigned char* host : hosts) CopyGbps(dir, host, m.device, n, 2, stream);  // warm-up
      std::vector<double> gbps[3], reg_ratio, page_ratio;
      for (int r = 0; r < reps; ++r) {
        for (int k = 0; k < 3; ++k)
          gbps[k].push_back(CopyGbps(dir, hosts[k], m.device, n, copies, stream));
        reg_ratio.push_back(gbps[1].back() / gbps[0].back());
        page_ratio.push_back(gbps[2].back() / gbps[0].back());
      }
      std::printf("%-9s %-4s %7ld %10.2f %10.2f %10.2f %9.3f %9.3f\n", SizeName(n).c_str(),
                  Name(dir), copies, Median(gbps[0]), Median(gbps[1]), Median(gbps[2]),
                  Median(reg_ratio), Median(page_ratio));
      std::fflush(stdout);
      *(dir == Direction::kD2H ? d2h_registered : h2d_registered) = Median(gbps[1]);
    }
  }
  std::printf(
      "(a) cudaHostAlloc, (b) memfd mapping + cudaHostRegister, (c) the same pages through a\n"
      " second, unregistered mapping (pageable). Ratios: median over repetitions of the\n"
      " per-repetition ratio. Targets: (b)/(a) >= 0.90 for D2H.\n");
}

struct SpinKernel {
  float* out = nullptr;
  unsigned blocks = 0, threads = 256;
  long long iters = 0;
  float ms = 0;  // calibrated run time
};

float SpinMs(const SpinKernel& k, long long iters, cudaStream_t stream) {
  EventPair events;
  std::vector<double> ms;
  for (int i = 0; i < 3; ++i) {
    BENCH_CUDA(cudaEventRecord(events.start, stream));
    BENCH_CUDA(actstash::bench::LaunchSpin(k.out, k.blocks, k.threads, iters, stream));
    BENCH_CUDA(cudaEventRecord(events.stop, stream));
    ms.push_back(events.Ms());
  }
  return static_cast<float>(Median(ms));
}

// Sizes the spin kernel to take ~target_ms on `stream`.
SpinKernel CalibrateSpin(double target_ms, cudaStream_t stream) {
  int device = 0, sms = 0;
  BENCH_CUDA(cudaGetDevice(&device));
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SpinKernel k;
  k.blocks = static_cast<unsigned>(4 * sms);
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&k.out), sizeof(float) * k.blocks * k.threads));
  k.iters = 1 << 12;
  float ms = SpinMs(k, k.iters, stream);
  while (ms < 1.0f && k.iters < (1ll << 40)) {  // grow until the time is measurable
    k.iters *= 8;
    ms = SpinMs(k, k.iters, stream);
  }
  for (int round = 0; round < 3; ++round) {
    k.iters = std::max(1ll, static_cast<long long>(static_cast<double>(k.iters) * target_ms / ms));
    ms = SpinMs(k, k.iters, stream);
  }
  k.ms = ms;
  return k;
}

// Section 2.
void Overlap(const Memory& m, double compute_ms, const std::vector<double>& fractions, size_t chunk,
             int steps, int reps, double d2h_gbps, double h2d_gbps, cudaStream_t copy_stream) {
  cudaStream_t compute = cudaStreamLegacy;
  const SpinKernel spin = CalibrateSpin(compute_ms, compute);
  std::printf(
      "\nOverlap: compute kernel %.2f ms (%u blocks x %u threads, %lld FMA iterations) on the\n"
      "legacy default stream; copies in %s pieces between device memory and the registered\n"
      "memfd mapping on a non-blocking stream; %d steps of each kind per repetition, %d\n"
      "repetitions, medians\n",
      spin.ms, spin.blocks, spin.threads, spin.iters, SizeName(chunk).c_str(), steps, reps);
  std::printf("%-8s %-4s %12s %10s %10s %10s %9s\n", "fraction", "dir", "copy MiB", "copy ms",
              "step ms", "step ms", "ratio");
  std::printf("%-8s %-4s %12s %10s %10s %10s %9s\n", "", "", "", "alone", "no copies", "w/ copies",
              "(<=1.05)");
  EventPair step, copies;
  cudaEvent_t copies_done = nullptr;
  BENCH_CUDA(cudaEventCreateWithFlags(&copies_done, cudaEventDisableTiming));
  for (double fraction : fractions) {
    for (Direction dir : {Direction::kD2H, Direction::kH2D}) {
      const double gbps = dir == Direction::kD2H ? d2h_gbps : h2d_gbps;
      const auto total = static_cast<size_t>(fraction * spin.ms / 1e3 * gbps * 1e9);
      std::vector<double> alone, base, with, ratio;
      for (int r = 0; r < reps; ++r) {
        double base_sum = 0, with_sum = 0;
        for (int s = 0; s < steps; ++s) {
          BENCH_CUDA(cudaEventRecord(step.start, compute));
          BENCH_CUDA(actstash::bench::LaunchSpin(spin.out, spin.blocks, spin.threads, spin.iters,
                                                 compute));
          BENCH_CUDA(cudaEventRecord(step.stop, compute));
          base.push_back(step.Ms());
          base_sum += base.back();

          BENCH_CUDA(cudaEventRecord(step.start, compute));
          BENCH_CUDA(cudaStreamWaitEvent(copy_stream, step.start, 0));
          BENCH_CUDA(actstash::bench::LaunchSpin(spin.out, spin.blocks, spin.threads, spin.iters,
                                                 compute));
          EnqueueCopies(dir, m.segment->registered(), m.device, m.bytes, chunk, total, copy_stream);
          BENCH_CUDA(cudaEventRecord(copies_done, copy_stream));
          BENCH_CUDA(cudaStreamWaitEvent(compute, copies_done, 0));
          BENCH_CUDA(cudaEventRecord(step.stop, compute));
          with.push_back(step.Ms());
          with_sum += with.back();
        }
        ratio.push_back(with_sum / base_sum);
        BENCH_CUDA(cudaEventRecord(copies.start, copy_stream));
        EnqueueCopies(dir, m.segment->registered(), m.device, m.bytes, chunk, total, copy_stream);
        BENCH_CUDA(cudaEventRecord(copies.stop, copy_stream));
        alone.push_back(copies.Ms());
      }
      std::printf("%-8.2f %-4s %12.1f %10.3f %10.3f %10.3f %9.3f\n", fraction, Name(dir),
                  static_cast<double>(total) / (1 << 20), Median(alone), Median(base), Median(with),
                  Median(ratio));
      std::fflush(stdout);
    }
  }
  BENCH_CUDA(cudaEventDestroy(copies_done));
  BENCH_CUDA(cudaFree(spin.out));
  std::printf(
      "(copy ms alone: the same copies with no kernel running; ratio: median over repetitions\n"
      " of (sum of step times with copies) / (sum without))\n");
}

// Medians of D2H and H2D GB/s with registered memory at n bytes: what section
// 1 measures as (b), for the overlap when section 1 does not run.
void RegisteredGbps(const Memory& m, size_t n, size_t min_bytes, int reps, cudaStream_t stream,
                    double* d2h, double* h2d) {
  const long copies = static_cast<long>(std::max<size_t>(1, min_bytes / n));
  for (Direction dir : {Direction::kD2H, Direction::kH2D}) {
    CopyGbps(dir, m.segment->registered(), m.device, n, 2, stream);  // warm-up
    std::vector<double> gbps;
    for (int r = 0; r < reps; ++r)
      gbps.push_back(CopyGbps(dir, m.segment->registered(), m.device, n, copies, stream));
    *(dir == Direction::kD2H ? d2h : h2d) = Median(gbps);
  }
}

// Sections 3 and 4: an attached client whose leases are registered with CUDA,
// a CudaCopyEngine on the device, and the caller's stream ("compute", idle)
// that every engine copy is ordered after.
struct EngineRig {
  Client* client = nullptr;
  CopyEngine* engine = nullptr;
  cudaStream_t compute = nullptr;
  StreamHandle after() const { return StreamHandle{reinterpret_cast<uintptr_t>(compute)}; }
};

// Host seconds of one repetition, per direction.
struct Times {
  double d2h = 0, h2d = 0;
};

double Gbps(size_t n, long count, double seconds) {
  return static_cast<double>(n) * static_cast<double>(count) / 1e9 / seconds;
}

// The baseline of sections 3 and 4: `count` copies of n bytes in batches of
// `depth`; per batch, host clock around D2H cudaMemcpyAsync from `device` into
// successive n-byte pieces of `pinned` (`pinned_bytes`, wrapping) and a sync of
// `stream`, then (when `h2d`) around the same copies back and a sync.
Times HostAllocRounds(unsigned char* pinned, size_t pinned_bytes, unsigned char* device, size_t n,
                      long count, long depth, bool h2d, cudaStream_t stream) {
  const size_t pieces = std::max<size_t>(1, pinned_bytes / n);
  Times t;
  for (long done = 0; done < count;) {
    const long batch = std::min(depth, count - done);
    Clock::time_point start = Clock::now();
    for (long k = 0; k < batch; ++k) {
      unsigned char* host = pinned + static_cast<size_t>(k) % pieces * n;
      BENCH_CUDA(cudaMemcpyAsync(host, device, n, cudaMemcpyDeviceToHost, stream));
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    t.d2h += Since(start);
    if (h2d) {
      start = Clock::now();
      for (long k = 0; k < batch; ++k) {
        const unsigned char* host = pinned + static_cast<size_t>(k) % pieces * n;
        BENCH_CUDA(cudaMemcpyAsync(device, host, n, cudaMemcpyHostToDevice, stream));
      }
      BENCH_CUDA(cudaStreamSynchronize(stream));
      t.h2d += Since(start);
    }
    done += batch;
  }
  return t;
}

// actstash's path, `count` buffers of n bytes in batches of `depth`. Per
// batch, host clock around: for each buffer Client::Reserve(n) and the
// engine's store from `device` (CopyAsync, or GatherAsync of the view
// `gather` of it when not null) ordered after rig.compute, then Wait on every
// event (D2H); when `h2d`, for each buffer Client::Locate, CopyAsync(kFetch)
// into `device` and OrderAfterAsync(rig.compute), then one sync of rig.compute
// (H2D). Then each buffer is released (not timed).
Times EngineRounds(const EngineRig& rig, unsigned char* device, size_t n, long count, long depth,
                   const TensorLayout* gather, bool h2d) {
  Times t;
  std::vector<actstash::Ticket> tickets;
  std::vector<std::shared_ptr<CopyEvent>> events;
  for (long done = 0; done < count;) {
    const long batch = std::min(depth, count - done);
    tickets.clear();
    events.clear();
    Clock::time_point start = Clock::now();
    for (long k = 0; k < batch; ++k) {
      absl::StatusOr<actstash::Reservation> reservation = rig.client->Reserve(n);
      Check(reservation.status(), "Client::Reserve of " + SizeName(n));
      if (!reservation->pinned) Die("Client::Reserve: leased memory not registered with CUDA");
      absl::StatusOr<std::shared_ptr<CopyEvent>> event =
          gather == nullptr
              ? rig.engine->CopyAsync(CopyStream::kStore, reservation->data, device, n, rig.after())
              : rig.engine->GatherAsync(CopyStream::kStore, reservation->data, n, device, *gather,
                                        rig.after());
      Check(event.status(), gather == nullptr ? "CopyAsync(kStore)" : "GatherAsync(kStore)");
      tickets.push_back(reservation->ticket);
      events.push_back(*std::move(event));
    }
    for (const std::shared_ptr<CopyEvent>& event : events) Check(event->Wait(), "engine store");
    t.d2h += Since(start);
    if (h2d) {
      events.clear();
      start = Clock::now();
      for (const actstash::Ticket& ticket : tickets) {
        absl::StatusOr<actstash::StoredBytes> located = rig.client->Locate(ticket);
        Check(located.status(), "Client::Locate");
        absl::StatusOr<std::shared_ptr<CopyEvent>> event =
            rig.engine->CopyAsync(CopyStream::kFetch, device, located->data, n, rig.after());
        Check(event.status(), "CopyAsync(kFetch)");
        Check(rig.engine->OrderAfterAsync(rig.after(), **event), "OrderAfterAsync");
        events.push_back(*std::move(event));
      }
      BENCH_CUDA(cudaStreamSynchronize(rig.compute));
      t.h2d += Since(start);
      for (const std::shared_ptr<CopyEvent>& event : events) Check(event->Wait(), "engine fetch");
    }
    for (const actstash::Ticket& ticket : tickets) Check(rig.client->Release(ticket), "Release");
    done += batch;
  }
  return t;
}

uint64_t LeasesGranted(Client& client) {
  absl::StatusOr<actstash::StatsSnapshot> stats = client.Stats();
  Check(stats.status(), "Client::Stats");
  return stats->leases_granted;
}

// The bytes survive the engine's path at n bytes: device -> reservation
// (compared with the source on the host), reservation -> zeroed device -> host.
void VerifyEngine(const EngineRig& rig, const Memory& m, size_t n, cudaStream_t stream) {
  FillPattern(m.pinned, n, 0x9E3779B97F4A7C15ull);
  BENCH_CUDA(cudaMemcpyAsync(m.device, m.pinned, n, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  absl::StatusOr<actstash::Reservation> reservation = rig.client->Reserve(n);
  Check(reservation.status(), "Client::Reserve of " + SizeName(n));
  absl::StatusOr<std::shared_ptr<CopyEvent>> event =
      rig.engine->CopyAsync(CopyStream::kStore, reservation->data, m.device, n, rig.after());
  Check(event.status(), "CopyAsync(kStore)");
  Check((*event)->Wait(), "engine store");
  if (std::memcmp(reservation->data, m.pinned, n) != 0) Die("engine D2H: bytes differ");
  BENCH_CUDA(cudaMemsetAsync(m.device, 0, n, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  absl::StatusOr<actstash::StoredBytes> located = rig.client->Locate(reservation->ticket);
  Check(located.status(), "Client::Locate");
  if (!located->pinned) Die("Client::Locate: leased memory not registered with CUDA");
  event = rig.engine->CopyAsync(CopyStream::kFetch, m.device, located->data, n, rig.after());
  Check(event.status(), "CopyAsync(kFetch)");
  Check(rig.engine->OrderAfterAsync(rig.after(), **event), "OrderAfterAsync");
  BENCH_CUDA(cudaStreamSynchronize(rig.compute));
  Check((*event)->Wait(), "engine fetch");
  std::vector<unsigned char> back(n);
  BENCH_CUDA(cudaMemcpy(back.data(), m.device, n, cudaMemcpyDeviceToHost));
  if (std::memcmp(back.data(), m.pinned, n) != 0) Die("engine H2D: bytes differ");
  Check(rig.client->Release(reservation->ticket), "Release");
}

const char* TargetMark(double ratio) { return ratio >= 0.90 ? "met" : "MISSED"; }

// Section 3.
void EngineBandwidth(const EngineRig& rig, const Memory& m, const std::vector<size_t>& sizes,
                     size_t min_bytes, size_t window, int reps, cudaStream_t stream) {
  VerifyEngine(rig, m, *std::max_element(sizes.begin(), sizes.end()), stream);
  std::printf(
      "\nEngine: Client::Reserve/Locate + CudaCopyEngine on leased segments registered by the\n"
      "client, vs cudaMemcpyAsync with cudaHostAlloc memory, host-timed in batches of `depth`\n"
      "buffers (<= %s at a time), %d repetitions, medians\n",
      SizeName(window).c_str(), reps);
  std::printf("%-9s %-4s %7s %6s %10s %10s %9s %15s %7s %7s\n", "size", "dir", "copies", "depth",
              "HostAlloc", "engine", "(e)/(a)", "(e)/(a)", "leases", "target");
  std::printf("%-9s %-4s %7s %6s %10s %10s %9s %15s %7s %7s\n", "", "", "", "", "(a) GB/s",
              "(e) GB/s", "median", "min..max", "in reps", ">=0.90");
  for (size_t n : sizes) {
    const long count = static_cast<long>(std::max<size_t>(1, min_bytes / n));
    const long depth = std::min(count, static_cast<long>(std::max<size_t>(1, window / n)));
    // Warm-up: leases mapped and registered, pieces of pinned memory touched.
    HostAllocRounds(m.pinned, m.pinned_bytes, m.device, n, depth, depth, true, stream);
    EngineRounds(rig, m.device, n, depth, depth, nullptr, true);
    const uint64_t leases_before = LeasesGranted(*rig.client);
    std::vector<double> base[2], engine[2], ratio[2];
    for (int r = 0; r < reps; ++r) {
      const Times a =
          HostAllocRounds(m.pinned, m.pinned_bytes, m.device, n, count, depth, true, stream);
      const Times e = EngineRounds(rig, m.device, n, count, depth, nullptr, true);
      base[0].push_back(Gbps(n, count, a.d2h));
      base[1].push_back(Gbps(n, count, a.h2d));
      engine[0].push_back(Gbps(n, count, e.d2h));
      engine[1].push_back(Gbps(n, count, e.h2d));
      for (int d = 0; d < 2; ++d) ratio[d].push_back(engine[d].back() / base[d].back());
    }
    const uint64_t leases = LeasesGranted(*rig.client) - leases_before;
    for (int d = 0; d < 2; ++d) {
      const double median = Median(ratio[d]);
      char range[32];
      std::snprintf(range, sizeof(range), "%.3f..%.3f",
                    *std::min_element(ratio[d].begin(), ratio[d].end()),
                    *std::max_element(ratio[d].begin(), ratio[d].end()));
      std::printf("%-9s %-4s %7ld %6ld %10.2f %10.2f %9.3f %15s %7llu %7s\n", SizeName(n).c_str(),
                  d == 0 ? "D2H" : "H2D", count, depth, Median(base[d]), Median(engine[d]), median,
                  range, static_cast<unsigned long long>(leases),
                  d == 0 ? TargetMark(median) : "-");
    }
    std::fflush(stdout);
  }
  std::printf(
      "(a) cudaMemcpyAsync with cudaHostAlloc memory; (e) Reserve + CopyAsync(kStore) + Wait "
      "(D2H),\n"
      " Locate + CopyAsync(kFetch) + OrderAfterAsync + stream sync (H2D), into/out of leased\n"
      " segments; both host-timed per batch, same repetitions. (e)/(a): per-repetition ratio,\n"
      " median and range. leases: Lease RPCs the daemon granted during the timed repetitions\n"
      " (expected 0: segments are kept leased; with --address, other sessions' count too).\n"
      " TARGET: engine D2H (e)/(a) >= 0.90 at every size (column `target`); H2D: no target.\n");
}

// Section 4.
void Strided(const EngineRig& rig, const Memory& m, int64_t dim, size_t min_bytes, size_t window,
             int reps, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(dim) * static_cast<size_t>(dim) * sizeof(float);
  unsigned char* tensor = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&tensor), bytes));
  FillPattern(m.pinned, bytes, 0xD1B54A32D192ED03ull);
  BENCH_CUDA(cudaMemcpyAsync(tensor, m.pinned, bytes, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const TensorLayout layout{{dim, dim}, {1, dim}, static_cast<int>(sizeof(float))};

  // Verify: element (i, j) of the view is element (j, i) of the tensor.
  {
    absl::StatusOr<actstash::Reservation> reservation = rig.client->Reserve(bytes);
    Check(reservation.status(), "Client::Reserve of " + SizeName(bytes));
    absl::StatusOr<std::shared_ptr<CopyEvent>> event = rig.engine->GatherAsync(
        CopyStream::kStore, reservation->data, bytes, tensor, layout, rig.after());
    Check(event.status(), "GatherAsync(kStore)");
    Check((*event)->Wait(), "engine gather");
    const auto* in = reinterpret_cast<const uint32_t*>(m.pinned);
    const auto* out = static_cast<const uint32_t*>(reservation->data);
    const auto d = static_cast<size_t>(dim);
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = 0; j < d; ++j) {
        if (out[i * d + j] != in[j * d + i])
          Die("GatherAsync of the transposed view: wrong element");
      }
    }
    Check(rig.client->Release(reservation->ticket), "Release");
  }

  const long count = static_cast<long>(std::max<size_t>(1, min_bytes / bytes));
  const long depth = std::min(count, static_cast<long>(std::max<size_t>(1, window / bytes)));
  HostAllocRounds(m.pinned, m.pinned_bytes, tensor, bytes, depth, depth, false, stream);  // warm-up
  EngineRounds(rig, tensor, bytes, depth, depth, nullptr, false);
  EngineRounds(rig, tensor, bytes, depth, depth, &layout, false);
  std::vector<double> base, contiguous, gathered, vs_base, vs_contiguous;
  for (int r = 0; r < reps; ++r) {
    base.push_back(Gbps(
        bytes, count,
        HostAllocRounds(m.pinned, m.pinned_bytes, tensor, bytes, count, depth, false, stream).d2h));
    contiguous.push_back(
        Gbps(bytes, count, EngineRounds(rig, tensor, bytes, count, depth, nullptr, false).d2h));
    gathered.push_back(
        Gbps(bytes, count, EngineRounds(rig, tensor, bytes, count, depth, &layout, false).d2h));
    vs_base.push_back(gathered.back() / base.back());
    vs_contiguous.push_back(gathered.back() / contiguous.back());
  }
  std::printf(
      "\nStrided D2H: a %lld x %lld fp32 device tensor viewed transposed (sizes {%lld, %lld},\n"
      "strides {1, %lld}), %s, %d repetitions, medians\n",
      static_cast<long long>(dim), static_cast<long long>(dim), static_cast<long long>(dim),
      static_cast<long long>(dim), static_cast<long long>(dim), SizeName(bytes).c_str(), reps);
  std::printf("%7s %6s %10s %10s %10s %9s %9s\n", "copies", "depth", "HostAlloc", "engine",
              "engine", "(g)/(a)", "(g)/(e)");
  std::printf("%7s %6s %10s %10s %10s %9s %9s\n", "", "", "(a) GB/s", "copy (e)", "gather (g)", "",
              "");
  std::printf("%7ld %6ld %10.2f %10.2f %10.2f %9.3f %9.3f\n", count, depth, Median(base),
              Median(contiguous), Median(gathered), Median(vs_base), Median(vs_contiguous));
  std::printf(
      "(a) cudaMemcpyAsync of the tensor's bytes into cudaHostAlloc memory; (e) Reserve +\n"
      " CopyAsync(kStore) of them (contiguous) + Wait; (g) Reserve + GatherAsync(kStore) of the\n"
      " transposed view into the reservation + Wait. Ratios: median of per-repetition ratios.\n"
      " No target: reported.\n");
  std::fflush(stdout);
  BENCH_CUDA(cudaFree(tensor));
}

std::vector<std::string> SplitComma(const std::string& text) {
  std::vector<std::string> parts;
  for (size_t start = 0; start <= text.size();) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    parts.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

}  // namespace

int main(int argc, char** argv) {
  g_program = "gpu_copy_bench";
  CLI::App app{
      "Host<->device copy bandwidth into registered memfd memory, copy/compute overlap, and "
      "actstash's Client + CudaCopyEngine path against cudaHostAlloc"};
  std::string sizes_text = "1MiB,4MiB,16MiB,64MiB,256MiB", min_bytes_text = "1GiB";
  std::string fractions_text = "0.25,0.5,0.9", chunk_text = "16MiB", flags_text = "default";
  std::string address, pool_text = "2GiB", window_text = "256MiB";
  std::vector<std::string> measure = {"bandwidth", "overlap", "engine", "strided"};
  bool quick = false;
  int reps = 5, steps = 10, device = 0;
  int64_t strided_dim = 4096;
  double compute_ms = 20;
  app.add_flag("--quick", quick,
               "Smoke run: 1 and 4 MiB, few repetitions, a 5 ms kernel, a 1024 x 1024 tensor, a "
               "1 GiB pool");
  app.add_option("--measure", measure,
                 "Comma-separated sections to run: bandwidth, overlap, engine, strided "
                 "(default all)")
      ->delimiter(',')
      ->check(CLI::IsMember({"bandwidth", "overlap", "engine", "strided"}));
  app.add_option("--sizes", sizes_text, "Comma-separated copy sizes (default 1MiB..256MiB)");
  app.add_option("--min-bytes", min_bytes_text, "Bytes copied per measurement (default 1GiB)");
  app.add_option("--reps", reps, "Repetitions; medians are reported (default 5)")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", device, "CUDA device ordinal (default 0)");
  app.add_option("--register-flags", flags_text,
                 "cudaHostRegister flags of sections 1 and 2: default, or portable-mapped (as the "
                 "client registers)")
      ->check(CLI::IsMember({"default", "portable-mapped"}));
  app.add_option("--compute-ms", compute_ms, "Run time of the overlap's kernel (default 20)")
      ->check(CLI::PositiveNumber);
  app.add_option("--copy-fractions", fractions_text,
                 "Copy time alone as fractions of the compute time (default 0.25,0.5,0.9)");
  app.add_option("--chunk", chunk_text, "Size of each overlap copy (default 16MiB)");
  app.add_option("--steps", steps, "Steps per repetition of the overlap (default 10)")
      ->check(CLI::PositiveNumber);
  app.add_option("--address", address,
                 "engine/strided: use this running actstashd instead of starting one");
  app.add_option("--pool", pool_text,
                 "engine/strided: pool of the actstashd started here "
                 "(default 2GiB, quick: 1GiB; 64 MiB segments)");
  app.add_option("--engine-window", window_text,
                 "engine/strided: bytes reserved at a time, i.e. per batch (default 256MiB)");
  app.add_option("--strided-dim", strided_dim,
                 "strided: D of the D x D fp32 tensor viewed transposed (default 4096)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  if (quick) {
    if (app.count("--sizes") == 0) sizes_text = "1MiB,4MiB";
    if (app.count("--min-bytes") == 0) min_bytes_text = "32MiB";
    if (app.count("--reps") == 0) reps = 3;
    if (app.count("--compute-ms") == 0) compute_ms = 5;
    if (app.count("--copy-fractions") == 0) fractions_text = "0.5";
    if (app.count("--steps") == 0) steps = 3;
    if (app.count("--strided-dim") == 0) strided_dim = 1024;
    if (app.count("--pool") == 0) pool_text = "1GiB";
  }
  auto selected = [&measure](const char* name) {
    return std::find(measure.begin(), measure.end(), name) != measure.end();
  };
  const bool run_bandwidth = selected("bandwidth"), run_overlap = selected("overlap");
  const bool run_engine = selected("engine"), run_strided = selected("strided");
  std::string measure_text;
  for (const char* name : {"bandwidth", "overlap", "engine", "strided"}) {
    if (!selected(name)) continue;
    measure_text += (measure_text.empty() ? "" : ",") + std::string(name);
  }
  std::vector<size_t> sizes;
  for (const std::string& part : SplitComma(sizes_text)) {
    size_t n = 0;
    if (!ParseSize(part, &n)) Die("bad size in --sizes: " + sizes_text);
    sizes.push_back(n);
  }
  std::vector<double> fractions;
  for (const std::string& part : SplitComma(fractions_text)) {
    char* end = nullptr;
    const double f = std::strtod(part.c_str(), &end);
    if (end == part.c_str() || *end != '\0' || !(f > 0 && f < 1))
      Die("bad --copy-fractions (each in (0, 1)): " + fractions_text);
    fractions.push_back(f);
  }
  size_t min_bytes = 0, chunk = 0, window = 0;
  if (!ParseSize(min_bytes_text, &min_bytes)) Die("bad --min-bytes: " + min_bytes_text);
  if (!ParseSize(chunk_text, &chunk)) Die("bad --chunk: " + chunk_text);
  if (!ParseSize(window_text, &window)) Die("bad --engine-window: " + window_text);
  const size_t strided_bytes =
      static_cast<size_t>(strided_dim) * static_cast<size_t>(strided_dim) * sizeof(float);

  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    std::printf("gpu_copy_bench: no CUDA device: skipped (%s; would run: %s)\n",
                error != cudaSuccess ? cudaGetErrorName(error) : "0 devices", measure_text.c_str());
    return 0;
  }
  BENCH_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s, PCI bus %d device %d, %d copy engines\n", device, prop.name,
              prop.pciBusID, prop.pciDeviceID, prop.asyncEngineCount);

  const unsigned register_flags = flags_text == "default"
                                      ? cudaHostRegisterDefault
                                      : cudaHostRegisterPortable | cudaHostRegisterMapped;
  const long page = sysconf(_SC_PAGESIZE);
  auto round_up = [page](size_t n) { return (n + page - 1) / page * page; };
  Memory m;
  m.bytes = round_up(std::max(*std::max_element(sizes.begin(), sizes.end()), chunk));
  m.pinned_bytes = m.bytes;
  // Sections 3 and 4: the baseline writes as many distinct bytes per batch
  // as the engine reserves.
  if (run_engine || run_strided) m.pinned_bytes = std::max(m.pinned_bytes, round_up(window));
  if (run_strided) m.pinned_bytes = std::max(m.pinned_bytes, round_up(strided_bytes));
  BENCH_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&m.pinned), m.pinned_bytes, cudaHostAllocDefault));
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.device), m.bytes));
  std::memset(m.pinned, 0, m.pinned_bytes);
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("sections: %s; >= %s per measurement, %d repetitions, medians; GB/s = 1e9 B/s\n",
              measure_text.c_str(), SizeName(min_bytes).c_str(), reps);

  if (run_bandwidth || run_overlap) {
    MemfdSegment segment(m.bytes, register_flags);
    m.segment = &segment;
    Verify(m.pinned, segment, m.device, m.bytes, stream);
    std::printf("cudaHostRegister flags (sections 1, 2): %s\n\n", flags_text.c_str());
    double d2h = 0, h2d = 0;
    if (run_bandwidth) {
      Bandwidth(m, sizes, min_bytes, reps, stream, &d2h, &h2d);
    } else {
      RegisteredGbps(m, sizes.back(), min_bytes, reps, stream, &d2h, &h2d);
    }
    if (run_overlap) Overlap(m, compute_ms, fractions, chunk, steps, reps, d2h, h2d, stream);
    m.segment = nullptr;
  }

  if (run_engine || run_strided) {
    std::unique_ptr<actstash::testing::DaemonProcess> daemon =
        StartDaemonUnless(&address, pool_text);
    actstash::ClientOptions options;
    options.address = address;
    options.client_name = "gpu_copy_bench";
    options.attach = actstash::AttachMode::kRequired;
    options.pin_leases = actstash::PinPolicy::kOn;
    options.cuda_device = device;
    options.rpc_timeout = std::chrono::seconds(120);
    options.lease_batch = 1;
    uint64_t segment_bytes = 0;
    std::string version;
    {
      absl::StatusOr<std::unique_ptr<Client>> probe = Client::Connect(options);
      Check(probe.status(), "Client::Connect");
      absl::StatusOr<actstash::StatsSnapshot> stats = (*probe)->Stats();
      Check(stats.status(), "Client::Stats");
      segment_bytes = stats->segment_bytes;
      version = stats->daemon_version;
      Check((*probe)->Close(), "Client::Close");
    }
    if (segment_bytes == 0) Die("the daemon reports 0-byte segments");
    // Keeps a whole window of segments leased across batches (Release gives
    // back empty segments beyond lease_batch), so no Lease RPC is timed.
    options.lease_batch = static_cast<uint32_t>((window + segment_bytes - 1) / segment_bytes + 1);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    Check(client.status(), "Client::Connect");
    if (!(*client)->attached()) Die("Client::Connect: not attached");
    actstash::CudaCopyEngineOptions engine_options;
    engine_options.device = device;
    absl::StatusOr<std::unique_ptr<CopyEngine>> engine =
        actstash::CreateCudaCopyEngine(engine_options);
    Check(engine.status(), "CreateCudaCopyEngine");
    EngineRig rig;
    rig.client = client->get();
    rig.engine = engine->get();
    BENCH_CUDA(cudaStreamCreateWithFlags(&rig.compute, cudaStreamNonBlocking));
    std::printf(
        "\nactstashd %s at %s (%s), %s segments; client attached, pin_leases on, lease_batch %u;\n"
        "CudaCopyEngine on device %d; copies ordered after a non-blocking \"compute\" stream\n",
        version.c_str(), address.c_str(), daemon != nullptr ? "started here" : "--address",
        SizeName(segment_bytes).c_str(), options.lease_batch, device);

    if (run_engine) EngineBandwidth(rig, m, sizes, min_bytes, window, reps, stream);
    if (run_strided) Strided(rig, m, strided_dim, min_bytes, window, reps, stream);

    (*engine)->Synchronize();
    engine->reset();
    BENCH_CUDA(cudaStreamDestroy(rig.compute));
    Check((*client)->Close(), "Client::Close");
    client->reset();
    StopDaemon(daemon.get());
    g_daemon = nullptr;
  }

  BENCH_CUDA(cudaStreamDestroy(stream));
  BENCH_CUDA(cudaFree(m.device));
  BENCH_CUDA(cudaFreeHost(m.pinned));
  return 0;
}
