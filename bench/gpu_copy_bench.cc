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
// 3. engine and 4. strided, actstash's own path: gpu_copy_bench_engine.cc.
// Shared by all four (options, memory, memfd mapping, cudaEvent timing):
// gpu_copy_bench_common.h.
#include "bench/gpu_copy_bench.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/gpu_copy_bench_common.h"
#include "bench/gpu_copy_bench_engine.h"

namespace {

using namespace actstash::bench;            // NOLINT: bench_util's helpers
using namespace actstash::bench::gpu_copy;  // NOLINT: the shared helpers

enum class Direction { kD2H, kH2D };

const char* Name(Direction dir) { return dir == Direction::kD2H ? "D2H" : "H2D"; }
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

}  // namespace

int main(int argc, char** argv) {
  g_program = "gpu_copy_bench";
  Options options;
  if (std::optional<int> exit_code = ParseOptions(argc, argv, &options)) return *exit_code;
  const std::vector<size_t>& sizes = options.sizes;
  const size_t strided_bytes = static_cast<size_t>(options.strided_dim) *
                               static_cast<size_t>(options.strided_dim) * sizeof(float);

  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    std::printf("gpu_copy_bench: no CUDA device: skipped (%s; would run: %s)\n",
                error != cudaSuccess ? cudaGetErrorName(error) : "0 devices",
                options.measure_text.c_str());
    return 0;
  }
  const int device = options.device;
  BENCH_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s, PCI bus %d device %d, %d copy engines\n", device, prop.name,
              prop.pciBusID, prop.pciDeviceID, prop.asyncEngineCount);

  const unsigned register_flags = options.register_flags == "default"
                                      ? cudaHostRegisterDefault
                                      : cudaHostRegisterPortable | cudaHostRegisterMapped;
  const long page = sysconf(_SC_PAGESIZE);
  auto round_up = [page](size_t n) { return (n + page - 1) / page * page; };
  Memory m;
  m.bytes = round_up(std::max(*std::max_element(sizes.begin(), sizes.end()), options.chunk));
  m.pinned_bytes = m.bytes;
  // Sections 3 and 4: the baseline writes as many distinct bytes per batch
  // as the engine reserves.
  if (options.run_engine || options.run_strided)
    m.pinned_bytes = std::max(m.pinned_bytes, round_up(options.window));
  if (options.run_strided) m.pinned_bytes = std::max(m.pinned_bytes, round_up(strided_bytes));
  BENCH_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&m.pinned), m.pinned_bytes, cudaHostAllocDefault));
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.device), m.bytes));
  std::memset(m.pinned, 0, m.pinned_bytes);
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("sections: %s; >= %s per measurement, %d repetitions, medians; GB/s = 1e9 B/s\n",
              options.measure_text.c_str(), SizeName(options.min_bytes).c_str(), options.reps);

  if (options.run_bandwidth || options.run_overlap) {
    MemfdSegment segment(m.bytes, register_flags);
    m.segment = &segment;
    Verify(m.pinned, segment, m.device, m.bytes, stream);
    std::printf("cudaHostRegister flags (sections 1, 2): %s\n\n", options.register_flags.c_str());
    double d2h = 0, h2d = 0;
    if (options.run_bandwidth) {
      Bandwidth(m, sizes, options.min_bytes, options.reps, stream, &d2h, &h2d);
    } else {
      RegisteredGbps(m, sizes.back(), options.min_bytes, options.reps, stream, &d2h, &h2d);
    }
    if (options.run_overlap) {
      Overlap(m, options.compute_ms, options.fractions, options.chunk, options.steps, options.reps,
              d2h, h2d, stream);
    }
    m.segment = nullptr;
  }

  if (options.run_engine || options.run_strided) RunEngineSections(options, m, stream);

  BENCH_CUDA(cudaStreamDestroy(stream));
  BENCH_CUDA(cudaFree(m.device));
  BENCH_CUDA(cudaFreeHost(m.pinned));
  return 0;
}
