// register_probe: what registering a lease with CUDA costs, on the memory as
// the client really maps it: several memfd segments mapped back to back into
// one reserved range (client/store/local_store.cc, MapLease), registered as one
// range with the client's flags (common/pinned_registrar.cc). Prints, per
// GiB, the median cudaHostRegister and cudaHostUnregister times next to
// cudaHostAlloc and cudaFreeHost of the same size measured in the same run,
// and checks a D2H and H2D round trip through the registered range (bytes
// compared, GB/s printed).
//
//   register_probe [--gib N] [--segments N] [--reps N]
//
// Without a CUDA device it prints "no CUDA device: skipped" and exits 77
// (the skip code of the project's tests). Exits 1 on a CUDA error or wrong
// bytes.
#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_util.h"
#include "kernels/cuda_status.h"

namespace actstash::bench {
namespace {

#define PROBE_CUDA(expr) Check(ACTSTASH_CUDA_STATUS(expr), "CUDA")

constexpr unsigned kClientFlags = cudaHostRegisterPortable | cudaHostRegisterMapped;

// `segments` memfds of `segment_bytes` mapped back to back into one range,
// MAP_POPULATE as the client maps them. Unmapped (and the memfds closed)
// when destroyed.
class Lease {
 public:
  Lease(size_t segments, size_t segment_bytes) : bytes_(segments * segment_bytes) {
    void* reserved =
        mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (reserved == MAP_FAILED) Die("reserving the lease's range: " + std::string(strerror(errno)));
    base_ = static_cast<unsigned char*>(reserved);
    for (size_t i = 0; i < segments; ++i) {
      const int fd = memfd_create("actstash-probe", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, static_cast<off_t>(segment_bytes)) != 0) {
        Die("memfd: " + std::string(strerror(errno)));
      }
      if (mmap(base_ + i * segment_bytes, segment_bytes, PROT_READ | PROT_WRITE,
               MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0) == MAP_FAILED) {
        Die("mapping segment " + std::to_string(i) + ": " + std::string(strerror(errno)));
      }
      close(fd);  // the mapping keeps the memory
    }
  }
  ~Lease() { munmap(base_, bytes_); }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  unsigned char* base() const { return base_; }
  size_t bytes() const { return bytes_; }

 private:
  const size_t bytes_;
  unsigned char* base_ = nullptr;
};

double Seconds(Clock::time_point start) { return Since(start); }

int Main(int argc, char** argv) {
  CLI::App app{
      "cudaHostRegister of a lease made of several memfd mappings against "
      "cudaHostAlloc, per GiB, and a round trip through it (exits 77 without a device)"};
  size_t gib = 1, segments = 8;
  int reps = 3;
  app.add_option("--gib", gib, "GiB registered per repetition (default 1)")
      ->check(CLI::PositiveNumber);
  app.add_option("--segments", segments, "memfd mappings the lease is made of (default 8)")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Repetitions; the median is reported (default 3)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  const size_t bytes = gib << 30;
  if (bytes % segments != 0 || (bytes / segments) % 4096 != 0) {
    Die("--gib must split into --segments page-aligned segments");
  }
  PROBE_CUDA(cudaFree(nullptr));  // the context exists before anything is timed
  std::vector<double> reg, unreg, alloc, free_host;
  double d2h_gbps = 0, h2d_gbps = 0;
  void* device = nullptr;
  PROBE_CUDA(cudaMalloc(&device, bytes));
  cudaStream_t stream;
  PROBE_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int rep = 0; rep < reps; ++rep) {
    Lease lease(segments, bytes / segments);
    auto start = Clock::now();
    PROBE_CUDA(cudaHostRegister(lease.base(), lease.bytes(), kClientFlags));
    reg.push_back(Seconds(start));
    if (rep == 0) {  // the round trip, through the registered range
      for (size_t i = 0; i < bytes; i += 4096)
        lease.base()[i] = static_cast<unsigned char>(i >> 12);
      start = Clock::now();
      PROBE_CUDA(cudaMemcpyAsync(device, lease.base(), bytes, cudaMemcpyHostToDevice, stream));
      PROBE_CUDA(cudaStreamSynchronize(stream));
      h2d_gbps = static_cast<double>(bytes) / Seconds(start) / 1e9;
      std::memset(lease.base(), 0, bytes);
      start = Clock::now();
      PROBE_CUDA(cudaMemcpyAsync(lease.base(), device, bytes, cudaMemcpyDeviceToHost, stream));
      PROBE_CUDA(cudaStreamSynchronize(stream));
      d2h_gbps = static_cast<double>(bytes) / Seconds(start) / 1e9;
      for (size_t i = 0; i < bytes; i += 4096) {
        if (lease.base()[i] != static_cast<unsigned char>(i >> 12)) {
          Die("round trip through the registered lease: byte " + std::to_string(i) + " differs");
        }
      }
    }
    start = Clock::now();
    PROBE_CUDA(cudaHostUnregister(lease.base()));
    unreg.push_back(Seconds(start));
    void* pinned = nullptr;
    start = Clock::now();
    PROBE_CUDA(cudaHostAlloc(&pinned, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
    alloc.push_back(Seconds(start));
    start = Clock::now();
    PROBE_CUDA(cudaFreeHost(pinned));
    free_host.push_back(Seconds(start));
  }
  PROBE_CUDA(cudaStreamDestroy(stream));
  PROBE_CUDA(cudaFree(device));
  const double per_gib = 1e3 / static_cast<double>(gib);
  std::printf("register_probe: a lease of %zu memfd segments, %zu GiB, median of %d\n", segments,
              gib, reps);
  std::printf("  cudaHostRegister   %8.1f ms/GiB   cudaHostAlloc  %8.1f ms/GiB   ratio %.2f\n",
              Median(reg) * per_gib, Median(alloc) * per_gib, Median(reg) / Median(alloc));
  std::printf("  cudaHostUnregister %8.1f ms/GiB   cudaFreeHost   %8.1f ms/GiB\n",
              Median(unreg) * per_gib, Median(free_host) * per_gib);
  std::printf("  round trip through the registered lease: H2D %.1f GB/s, D2H %.1f GB/s, bytes ok\n",
              h2d_gbps, d2h_gbps);
  return 0;
}

}  // namespace
}  // namespace actstash::bench

int main(int argc, char** argv) {
  actstash::bench::g_program = "register_probe";
  return actstash::bench::Main(argc, argv);
}
