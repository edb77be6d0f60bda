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
      "Host<->device copy bandwidth into registered memfd memory, and copy/compute overlap"};
  std::string sizes_text = "1MiB,4MiB,16MiB,64MiB,256MiB", min_bytes_text = "1GiB";
  std::string fractions_text = "0.25,0.5,0.9", chunk_text = "16MiB", flags_text = "default";
  bool quick = false;
  int reps = 5, steps = 10, device = 0;
  double compute_ms = 20;
  app.add_flag("--quick", quick, "Smoke run: 1 and 4 MiB, few repetitions, a 5 ms kernel");
  app.add_option("--sizes", sizes_text, "Comma-separated copy sizes (default 1MiB..256MiB)");
  app.add_option("--min-bytes", min_bytes_text, "Bytes copied per measurement (default 1GiB)");
  app.add_option("--reps", reps, "Repetitions; medians are reported (default 5)")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", device, "CUDA device ordinal (default 0)");
  app.add_option("--register-flags", flags_text,
                 "cudaHostRegister flags: default, or portable-mapped (as the client registers)")
      ->check(CLI::IsMember({"default", "portable-mapped"}));
  app.add_option("--compute-ms", compute_ms, "Run time of the overlap's kernel (default 20)")
      ->check(CLI::PositiveNumber);
  app.add_option("--copy-fractions", fractions_text,
                 "Copy time alone as fractions of the compute time (default 0.25,0.5,0.9)");
  app.add_option("--chunk", chunk_text, "Size of each overlap copy (default 16MiB)");
  app.add_option("--steps", steps, "Steps per repetition of the overlap (default 10)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  if (quick) {
    if (app.count("--sizes") == 0) sizes_text = "1MiB,4MiB";
    if (app.count("--min-bytes") == 0) min_bytes_text = "32MiB";
    if (app.count("--reps") == 0) reps = 3;
    if (app.count("--compute-ms") == 0) compute_ms = 5;
    if (app.count("--copy-fractions") == 0) fractions_text = "0.5";
    if (app.count("--steps") == 0) steps = 3;
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
  size_t min_bytes = 0, chunk = 0;
  if (!ParseSize(min_bytes_text, &min_bytes)) Die("bad --min-bytes: " + min_bytes_text);
  if (!ParseSize(chunk_text, &chunk)) Die("bad --chunk: " + chunk_text);

  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    std::printf("gpu_copy_bench: no CUDA device: skipped (%s)\n",
                error != cudaSuccess ? cudaGetErrorName(error) : "0 devices");
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
  Memory m;
  m.bytes = std::max(*std::max_element(sizes.begin(), sizes.end()), chunk);
  const long page = sysconf(_SC_PAGESIZE);
  m.bytes = (m.bytes + page - 1) / page * page;
  BENCH_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&m.pinned), m.bytes, cudaHostAllocDefault));
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.device), m.bytes));
  MemfdSegment segment(m.bytes, register_flags);
  m.segment = &segment;
  std::memset(m.pinned, 0, m.bytes);
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Verify(m.pinned, segment, m.device, m.bytes, stream);

  std::printf(
      "cudaHostRegister flags: %s; >= %s per measurement, %d repetitions, medians;\n"
      "GB/s = 1e9 B/s\n\n",
      flags_text.c_str(), SizeName(min_bytes).c_str(), reps);
  double d2h = 0, h2d = 0;
  Bandwidth(m, sizes, min_bytes, reps, stream, &d2h, &h2d);
  Overlap(m, compute_ms, fractions, chunk, steps, reps, d2h, h2d, stream);

  BENCH_CUDA(cudaStreamDestroy(stream));
  BENCH_CUDA(cudaFree(m.device));
  BENCH_CUDA(cudaFreeHost(m.pinned));
  return 0;
}
