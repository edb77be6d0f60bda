// kernels_bench: CPU throughput of actstash::kernels (strided gather/scatter,
// Checksum64, bf16 conversions) next to a single-thread memcpy of the same
// byte count measured in the same run. No daemon, no GPU.
//
//   kernels_bench                     # 1 MiB, 16 MiB, 64 MiB; 5 repetitions
//   kernels_bench --sizes 4MiB --reps 9 --checksum-threads 2
//   kernels_bench --quick             # smoke run (ctest kernels_bench_quick)
//
// Every row moves n bytes, n being the size in the first column:
// - gather/scatter: n is the contiguous side (numel * 4, fp32). Layouts (torch
//   conventions: sizes and strides in elements):
//     transpose 2-D: a dense [R, C] tensor viewed as its transpose [C, R]
//       (strides {1, C}; R the largest power of two with R * R <= numel,
//       C = numel / R: 512 x 512 at 1 MiB, 2048 x 2048 at 16 MiB);
//     slice, gap:    every other row of a dense [2R, 1024] tensor, [R, 1024]
//       (strides {2048, 1}: 4 KiB rows with 4 KiB gaps; extent 2n);
//     permute 4-D:   a dense [B=4, H=16, S, D=64] tensor permuted to
//       [B, S, H, D] (the attention head transpose; 256-byte runs).
//   Gather packs the view into a contiguous buffer, scatter unpacks it back.
// - Checksum64Cpu: n input bytes, on --checksum-threads threads.
// - conversions: n is the larger of input and output: fp32->bf16 reads n
//   (n/4 floats) and writes n/2; bf16->fp32 reads n/2 and writes n;
//   fp16->bf16 reads n (n/2 halves) and writes n.
// The baseline is memcpy of n bytes (reads n, writes n) between the same two
// buffers. Per size, each repetition times memcpy and then every case for
// ~--min-time s each (iterations calibrated once, after a warm-up); the ratio
// of a case is its GB/s over the memcpy GB/s of the same repetition; the
// median over --reps repetitions is printed. GB/s = 1e9 bytes of n per second.
// Gather and scatter results are checked element by element against a naive
// index walk before timing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "bench/bench_util.h"
#include "kernels/bf16.h"
#include "kernels/checksum64.h"
#include "kernels/strided_copy.h"
#include "kernels/strided_layout.h"

namespace {

using namespace actstash::bench;  // NOLINT: the shared helpers
using actstash::kernels::StridedLayout;

StridedLayout Layout(std::vector<int64_t> sizes, std::vector<int64_t> strides) {
  StridedLayout layout{};
  layout.ndim = static_cast<int>(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    layout.sizes[d] = sizes[d];
    layout.strides[d] = strides[d];
  }
  layout.elem_size = 4;
  return layout;
}

struct StridedCase {
  std::string name;
  StridedLayout layout;
};

// The three views of the header comment for numel fp32 elements; dies when
// numel does not fit them (n must be a multiple of 16 KiB).
std::vector<StridedCase> StridedCases(int64_t numel) {
  if (numel % 4096 != 0)
    Die("sizes must be multiples of 16 KiB (got " + std::to_string(numel * 4) + " bytes)");
  int64_t rows = 1;  // the largest power of two with rows * rows <= numel
  while (rows * rows * 4 <= numel) rows *= 2;
  const int64_t cols = numel / rows;
  if (rows * cols != numel) Die("transpose: " + std::to_string(numel) + " is not R * C");
  const int64_t width = std::min<int64_t>(1024, numel);
  constexpr int64_t kB = 4, kH = 16, kD = 64;
  const int64_t seq = numel / (kB * kH * kD);
  std::vector<StridedCase> cases;
  cases.push_back({"transpose 2-D", Layout({cols, rows}, {1, cols})});
  cases.push_back({"slice, gap", Layout({numel / width, width}, {2 * width, 1})});
  cases.push_back({"permute 4-D", Layout({kB, seq, kH, kD}, {kH * seq * kD, kD, seq * kD, 1})});
  return cases;
}

// Calls visit(i, offset) for every element i (logical order) of `layout`,
// with its offset in elements: the naive reference of the checks.
void ForEachElement(const StridedLayout& layout,
                    const std::function<void(int64_t, int64_t)>& visit) {
  int64_t index[actstash::kernels::kMaxDims] = {};
  int64_t numel = 1;
  for (int d = 0; d < layout.ndim; ++d) numel *= layout.sizes[d];
  int64_t offset = 0;
  for (int64_t i = 0; i < numel; ++i) {
    visit(i, offset);
    for (int d = layout.ndim - 1; d >= 0; --d) {
      offset += layout.strides[d];
      if (++index[d] < layout.sizes[d]) break;
      offset -= layout.strides[d] * layout.sizes[d];
      index[d] = 0;
    }
  }
}

// 2n-byte buffers (a strided source or destination spans up to 2n), touched
// before timing. `strided` holds random floats in [-1, 1); `half` random
// normal fp16 patterns (n bytes); `bf16` the bf16 of the first n/4 floats.
struct KernelBuffers {
  explicit KernelBuffers(size_t n) : strided(n / 2), dense(n / 2), half(n / 2), bf16(n / 4) {
    uint64_t x = 0x9E3779B97F4A7C15ull ^ n;
    auto next = [&x] {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    for (float& f : strided) f = static_cast<float>(next() >> 40) / (1 << 23) - 1.0f;
    std::fill(dense.begin(), dense.end(), 0.0f);
    for (uint16_t& h : half) {
      const uint64_t r = next();
      const auto exponent = static_cast<uint16_t>(1 + r % 30);  // normal: 1..30
      h = static_cast<uint16_t>(((r >> 8) & 0x8000) | (exponent << 10) | ((r >> 20) & 0x3FF));
    }
    actstash::kernels::Fp32ToBf16Cpu(strided.data(), bf16.data(), bf16.size());
  }
  std::vector<float> strided, dense;
  std::vector<uint16_t> half, bf16;
};

void CheckGatherScatter(KernelBuffers& b, const StridedCase& c, size_t n) {
  Check(actstash::kernels::GatherCpu(b.strided.data(), c.layout, b.dense.data(), n),
        "GatherCpu " + c.name);
  ForEachElement(c.layout, [&](int64_t i, int64_t offset) {
    if (b.dense[i] != b.strided[offset])
      Die("GatherCpu " + c.name + ": element " + std::to_string(i) + " differs");
  });
  // Scatter the gathered values, negated, into the view; every element the
  // view maps to must then hold its negated value.
  for (size_t i = 0; i < n / 4; ++i) b.dense[i] = -b.dense[i];
  Check(actstash::kernels::ScatterCpu(b.dense.data(), n, b.strided.data(), c.layout),
        "ScatterCpu " + c.name);
  ForEachElement(c.layout, [&](int64_t i, int64_t offset) {
    if (b.strided[offset] != b.dense[i])
      Die("ScatterCpu " + c.name + ": element " + std::to_string(i) + " differs");
  });
}

struct Case {
  Case(std::string name, std::function<void()> run) : name(std::move(name)), run(std::move(run)) {}
  std::string name;
  std::function<void()> run;
  long iters = 0;
  std::vector<double> gbps, ratio;
};

double TimeRuns(const Case& c, size_t n) {
  const Clock::time_point start = Clock::now();
  for (long i = 0; i < c.iters; ++i) c.run();
  return static_cast<double>(n) * static_cast<double>(c.iters) / 1e9 / Since(start);
}

void BenchSize(size_t n, double min_time, int reps, int checksum_threads) {
  KernelBuffers b(n);
  const auto numel = static_cast<int64_t>(n / 4);
  // bf16 -> fp32 of the bf16 of x is within 2^-8 relative of x.
  actstash::kernels::Bf16ToFp32Cpu(b.bf16.data(), b.dense.data(), n / 4);
  for (size_t i = 0; i < n / 4; ++i) {
    if (std::fabs(b.dense[i] - b.strided[i]) > std::fabs(b.strided[i]) / 256)
      Die("bf16 round trip of element " + std::to_string(i) + " is off");
  }
  const std::vector<StridedCase> strided = StridedCases(numel);
  for (const StridedCase& c : strided) CheckGatherScatter(b, c, n);

  std::vector<Case> cases;
  cases.push_back({"memcpy (baseline)", [&] {
                     std::memcpy(b.dense.data(), b.strided.data(), n);
                     Clobber(b.dense.data());
                   }});
  for (const StridedCase& c : strided) {
    cases.push_back(
        {"gather  " + c.name, [&b, &c, n] {
           Check(actstash::kernels::GatherCpu(b.strided.data(), c.layout, b.dense.data(), n),
                 "GatherCpu");
           Clobber(b.dense.data());
         }});
  }
  for (const StridedCase& c : strided) {
    cases.push_back(
        {"scatter " + c.name, [&b, &c, n] {
           Check(actstash::kernels::ScatterCpu(b.dense.data(), n, b.strided.data(), c.layout),
                 "ScatterCpu");
           Clobber(b.strided.data());
         }});
  }
  uint64_t checksum = actstash::kernels::Checksum64Cpu(b.strided.data(), n, checksum_threads);
  cases.push_back({"Checksum64Cpu x" + std::to_string(checksum_threads), [&] {
                     if (actstash::kernels::Checksum64Cpu(b.strided.data(), n, checksum_threads) !=
                         checksum)
                       Die("Checksum64Cpu: value changed between runs");
                   }});
  cases.push_back({"Fp32ToBf16Cpu", [&] {
                     actstash::kernels::Fp32ToBf16Cpu(
                         b.strided.data(), reinterpret_cast<uint16_t*>(b.dense.data()), n / 4);
                     Clobber(b.dense.data());
                   }});
  cases.push_back({"Bf16ToFp32Cpu", [&] {
                     actstash::kernels::Bf16ToFp32Cpu(b.bf16.data(), b.dense.data(), n / 4);
                     Clobber(b.dense.data());
                   }});
  cases.push_back({"Fp16ToBf16Cpu", [&] {
                     actstash::kernels::Fp16ToBf16Cpu(
                         b.half.data(), reinterpret_cast<uint16_t*>(b.dense.data()), n / 2);
                     Clobber(b.dense.data());
                   }});

  for (Case& c : cases) {
    c.run();  // warm-up
    c.iters = Calibrate(min_time, c.run);
  }
  for (int r = 0; r < reps; ++r) {
    double baseline = 0;
    for (Case& c : cases) {
      const double gbps = TimeRuns(c, n);
      if (&c == &cases.front()) baseline = gbps;
      c.gbps.push_back(gbps);
      c.ratio.push_back(gbps / baseline);
    }
  }
  for (const Case& c : cases) {
    std::printf("%-9s %-26s %7ld %9.2f %9.3f\n", SizeName(n).c_str(), c.name.c_str(), c.iters,
                Median(c.gbps), Median(c.ratio));
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  g_program = "kernels_bench";
  CLI::App app{"CPU throughput of actstash::kernels vs memcpy of the same bytes"};
  std::string sizes_text = "1MiB,16MiB,64MiB";
  bool quick = false;
  double min_time = 0.2;
  int reps = 5, checksum_threads = 1;
  app.add_flag("--quick", quick, "Smoke run: 64 KiB and 1 MiB, few iterations (< 5 s)");
  app.add_option("--sizes", sizes_text,
                 "Comma-separated sizes, multiples of 16 KiB (default 1MiB,16MiB,64MiB)");
  app.add_option("--min-time", min_time, "Seconds per case and repetition (default 0.2)")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Repetitions per size; the median is reported (default 5)")
      ->check(CLI::PositiveNumber);
  app.add_option("--checksum-threads", checksum_threads, "Threads of Checksum64Cpu (default 1)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  if (quick) {
    if (app.count("--sizes") == 0) sizes_text = "64KiB,1MiB";
    if (app.count("--min-time") == 0) min_time = 0.01;
    if (app.count("--reps") == 0) reps = 3;
  }
  std::vector<size_t> sizes;
  for (size_t start = 0; start <= sizes_text.size();) {
    size_t end = sizes_text.find(',', start);
    if (end == std::string::npos) end = sizes_text.size();
    size_t n = 0;
    if (!ParseSize(sizes_text.substr(start, end - start), &n) || n % (16 << 10) != 0)
      Die("bad size in --sizes (a multiple of 16 KiB): " + sizes_text);
    sizes.push_back(n);
    start = end + 1;
  }

  std::printf("min-time %.3g s per case and repetition, %d repetitions, medians; single thread\n",
              min_time, reps);
  std::printf("(Checksum64Cpu: %d thread(s)); GB/s = 1e9 B/s of n, the size column\n\n",
              checksum_threads);
  std::printf("%-9s %-26s %7s %9s %9s\n", "size", "case", "iters", "GB/s", "x memcpy");
  for (size_t n : sizes) BenchSize(n, min_time, reps, checksum_threads);
  std::printf(
      "(x memcpy: median over repetitions of the case's GB/s over the memcpy GB/s of the\n"
      " same repetition, so not exactly the quotient of the medians)\n");
  return 0;
}
