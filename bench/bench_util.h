// Helpers shared by the benchmarks: timing, statistics, sizes, failing loudly
// (with the daemon's log when the benchmark started one).
#ifndef ACTSTASH_BENCH_BENCH_UTIL_H_
#define ACTSTASH_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/units.h"
#include "testing/daemon_process.h"

namespace actstash::bench {

using Clock = std::chrono::steady_clock;

// Set by main once it started a daemon: its log is printed on failure.
inline const char* g_program = "bench";
inline actstash::testing::DaemonProcess* g_daemon = nullptr;

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", g_program, what.c_str());
  if (g_daemon != nullptr) std::fprintf(stderr, "--- daemon log ---\n%s", g_daemon->log().c_str());
  std::exit(1);
}

inline void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(what + ": " + status.ToString());
}

inline double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Keeps the compiler from dropping or merging copies whose result it cannot see used.
inline void Clobber(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Nearest-rank percentile of sorted samples.
inline double Percentile(const std::vector<double>& sorted, double p) {
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size(), std::max<size_t>(rank, 1)) - 1];
}

// "4096", "4K", "4KiB", "64MiB", "1G" (binary units); false when not a size > 0.
inline bool ParseSize(const std::string& text, size_t* out) {
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok() || *bytes == 0) return false;
  *out = static_cast<size_t>(*bytes);
  return true;
}

inline std::string SizeName(size_t n) {
  if (n >= (1u << 20) && n % (1u << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n >= 1024 && n % 1024 == 0) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

// Source, staging and destination buffers of n bytes; the source is filled
// with a size-dependent pattern, every page is touched before timing.
struct Buffers {
  explicit Buffers(size_t n) : src(n), staging(n), dst(n) {
    uint64_t x = 0x9E3779B97F4A7C15ull ^ n;  // xorshift64: not constant, differs per size
    for (size_t i = 0; i < n; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      src[i] = static_cast<unsigned char>(x);
    }
    std::memset(staging.data(), 0, n);
    std::memset(dst.data(), 0, n);
  }
  std::vector<unsigned char> src, staging, dst;
};

// The memcpy baseline: n bytes into the staging buffer and back out.
inline void CopyTwice(Buffers& b, size_t n) {
  std::memcpy(b.staging.data(), b.src.data(), n);
  Clobber(b.staging.data());
  std::memcpy(b.dst.data(), b.staging.data(), n);
  Clobber(b.dst.data());
}

// Runs `body` until a tenth of `min_time` has passed (at least twice); returns
// how many runs fill `min_time`.
template <typename Body>
long Calibrate(double min_time, Body body) {
  const Clock::time_point start = Clock::now();
  long runs = 0;
  double elapsed = 0;
  while (runs < 2 || elapsed < min_time / 10) {
    body();
    ++runs;
    elapsed = Since(start);
  }
  return std::max(1L, std::lround(min_time * static_cast<double>(runs) / elapsed));
}

// When *address is empty: starts a daemon with a `pool_size` pool, makes it
// the one whose log Die prints, and sets *address to it. Else returns null.
inline std::unique_ptr<actstash::testing::DaemonProcess> StartDaemonUnless(
    std::string* address, const std::string& pool_size) {
  if (!address->empty()) return nullptr;
  actstash::testing::DaemonProcessOptions options;
  options.pool_size = pool_size;
  absl::StatusOr<std::unique_ptr<actstash::testing::DaemonProcess>> started =
      actstash::testing::DaemonProcess::Start(options);
  Check(started.status(), "starting actstashd");
  g_daemon = started->get();
  *address = (*started)->address();
  return *std::move(started);
}

// Stops a daemon StartDaemonUnless started (null: nothing); dies unless it
// exits with 0.
inline void StopDaemon(actstash::testing::DaemonProcess* daemon) {
  if (daemon == nullptr) return;
  absl::StatusOr<int> code = daemon->Stop();
  Check(code.status(), "stopping actstashd");
  if (*code != 0) Die("actstashd exited with code " + std::to_string(*code));
}

}  // namespace actstash::bench

#endif  // ACTSTASH_BENCH_BENCH_UTIL_H_
