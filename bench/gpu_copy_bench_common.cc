// gpu_copy_bench's shared pieces: its command line, the doubly mapped memfd,
// cudaEvent timing and the fill pattern (see gpu_copy_bench_common.h).
#include "bench/gpu_copy_bench_common.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "CLI/CLI.hpp"

namespace actstash::bench::gpu_copy {
namespace {

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

std::optional<int> ParseOptions(int argc, char** argv, Options* options) {
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
  Options& o = *options;
  o.run_bandwidth = selected("bandwidth");
  o.run_overlap = selected("overlap");
  o.run_engine = selected("engine");
  o.run_strided = selected("strided");
  o.measure_text.clear();
  for (const char* name : {"bandwidth", "overlap", "engine", "strided"}) {
    if (!selected(name)) continue;
    o.measure_text += (o.measure_text.empty() ? "" : ",") + std::string(name);
  }
  o.sizes.clear();
  for (const std::string& part : SplitComma(sizes_text)) {
    size_t n = 0;
    if (!ParseSize(part, &n)) Die("bad size in --sizes: " + sizes_text);
    o.sizes.push_back(n);
  }
  o.fractions.clear();
  for (const std::string& part : SplitComma(fractions_text)) {
    char* end = nullptr;
    const double f = std::strtod(part.c_str(), &end);
    if (end == part.c_str() || *end != '\0' || !(f > 0 && f < 1))
      Die("bad --copy-fractions (each in (0, 1)): " + fractions_text);
    o.fractions.push_back(f);
  }
  if (!ParseSize(min_bytes_text, &o.min_bytes)) Die("bad --min-bytes: " + min_bytes_text);
  if (!ParseSize(chunk_text, &o.chunk)) Die("bad --chunk: " + chunk_text);
  if (!ParseSize(window_text, &o.window)) Die("bad --engine-window: " + window_text);
  o.reps = reps;
  o.steps = steps;
  o.device = device;
  o.strided_dim = strided_dim;
  o.compute_ms = compute_ms;
  o.register_flags = flags_text;
  o.address = address;
  o.pool = pool_text;
  return std::nullopt;
}

MemfdSegment::MemfdSegment(size_t bytes, unsigned register_flags) : bytes_(bytes) {
  fd_ = memfd_create("gpu_copy_bench", MFD_CLOEXEC);
  if (fd_ < 0) Die(std::string("memfd_create: ") + std::strerror(errno));
  if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
    Die(std::string("ftruncate: ") + std::strerror(errno));
  registered_ = Map();
  pageable_ = Map();
  BENCH_CUDA(cudaHostRegister(registered_, bytes, register_flags));
}

MemfdSegment::~MemfdSegment() {
  BENCH_CUDA(cudaHostUnregister(registered_));
  munmap(registered_, bytes_);
  munmap(pageable_, bytes_);
  close(fd_);
}

void* MemfdSegment::Map() const {
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, 0);
  if (p == MAP_FAILED) Die(std::string("mmap of the memfd: ") + std::strerror(errno));
  return p;
}

EventPair::EventPair() {
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
}

EventPair::~EventPair() {
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

float EventPair::Ms() const {
  BENCH_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return ms;
}

void FillPattern(unsigned char* p, size_t n, uint64_t seed) {
  uint64_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<unsigned char>(x);
  }
}

}  // namespace actstash::bench::gpu_copy
