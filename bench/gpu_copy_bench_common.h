// Internal to gpu_copy_bench: what its measurements share. The parsed command
// line (Options, ParseOptions), the memory every section copies between
// (Memory, and the memfd mapped twice of sections 1 and 2: MemfdSegment),
// cudaEvent timing (EventPair), a fill pattern for the byte checks, and
// BENCH_CUDA. Sections 1 and 2 and main: gpu_copy_bench.cc; sections 3 and 4:
// gpu_copy_bench_engine.cc.
#ifndef ACTSTASH_BENCH_GPU_COPY_BENCH_COMMON_H_
#define ACTSTASH_BENCH_GPU_COPY_BENCH_COMMON_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/cuda_status.h"

// Dies with the CUDA error, its expression and file:line when `expr` fails.
#define BENCH_CUDA(expr) ::actstash::bench::Check(ACTSTASH_CUDA_STATUS(expr), "CUDA")

namespace actstash::bench::gpu_copy {

// The command line, parsed and with --quick's defaults applied.
struct Options {
  bool run_bandwidth = false, run_overlap = false, run_engine = false, run_strided = false;
  std::string measure_text;  // the selected sections, comma-separated, in section order
  std::vector<size_t> sizes;
  size_t min_bytes = 0, chunk = 0, window = 0;
  std::vector<double> fractions;  // --copy-fractions
  int reps = 5, steps = 10, device = 0;
  int64_t strided_dim = 4096;
  double compute_ms = 20;
  std::string register_flags = "default";  // --register-flags
  std::string address, pool = "2GiB";      // --address, --pool
};

// Parses argv into *options (dies on a malformed size or fraction). Returns
// the exit code when main should stop here (--help, or a flag CLI11 rejected:
// it printed why), else nullopt.
std::optional<int> ParseOptions(int argc, char** argv, Options* options);

// A memfd of `bytes` mapped twice, MAP_SHARED|MAP_POPULATE (as the client maps
// a leased segment): `registered` gets cudaHostRegister'ed, `pageable` (the
// same pages) never does.
class MemfdSegment {
 public:
  MemfdSegment(size_t bytes, unsigned register_flags);
  ~MemfdSegment();
  MemfdSegment(const MemfdSegment&) = delete;
  MemfdSegment& operator=(const MemfdSegment&) = delete;

  unsigned char* registered() const { return static_cast<unsigned char*>(registered_); }
  unsigned char* pageable() const { return static_cast<unsigned char*>(pageable_); }

 private:
  void* Map() const;

  size_t bytes_;
  int fd_ = -1;
  void* registered_ = nullptr;
  void* pageable_ = nullptr;
};

// Events around work on one stream; milliseconds between them.
struct EventPair {
  EventPair();
  ~EventPair();
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  float Ms() const;
  cudaEvent_t start = nullptr, stop = nullptr;
};

// Fills n bytes with an xorshift64 sequence (not constant, differs per seed).
void FillPattern(unsigned char* p, size_t n, uint64_t seed);

struct Memory {
  unsigned char* pinned = nullptr;        // cudaHostAlloc, pinned_bytes
  const MemfdSegment* segment = nullptr;  // bytes; null when sections 1 and 2 do not run
  unsigned char* device = nullptr;        // cudaMalloc, bytes
  size_t bytes = 0;
  size_t pinned_bytes = 0;  // >= bytes, and >= what sections 3 and 4 copy per batch
};

}  // namespace actstash::bench::gpu_copy

#endif  // ACTSTASH_BENCH_GPU_COPY_BENCH_COMMON_H_
