// inline_bench: throughput and small-object latency of actstashd's inline
// gRPC data path (Put / Get into a caller buffer / Delete), each next to a
// single-thread memcpy baseline of the same bytes measured in the same run.
//
//   inline_bench                      # starts its own actstashd (1 GiB pool)
//   inline_bench --address unix:///run/actstash/actstash.sock
//   inline_bench --quick              # smoke run (ctest inline_bench_quick)
//
// Throughput: per size, rounds of Put -> Get(handle, dst, cap) -> Delete;
// Put and Get are timed separately (Delete is not timed), ~--min-time seconds
// per repetition, the median of --reps repetitions is printed. The baseline
// is the store+fetch equivalent in memory: memcpy into a staging buffer and
// back out into the destination (two copies), timed the same way right after
// each inline repetition. GB/s = 1e9 bytes per second of payload.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "actstash/client.h"
#include "actstash/v1/stash.pb.h"
#include "bench/bench_util.h"
#include "testing/daemon_process.h"

namespace {

using namespace actstash::bench;  // NOLINT: the shared helpers

struct RoundTime {
  double put = 0, get = 0, del = 0;
};

RoundTime Round(actstash::Client& client, Buffers& b, size_t n) {
  RoundTime t;
  Clock::time_point start = Clock::now();
  absl::StatusOr<actstash::Handle> handle = client.Put(b.src.data(), n);
  t.put = Since(start);
  Check(handle.status(), "Put of " + SizeName(n));
  start = Clock::now();
  absl::StatusOr<actstash::ObjectInfo> info = client.Get(*handle, b.dst.data(), n);
  t.get = Since(start);
  Check(info.status(), "Get of " + SizeName(n));
  if (info->nbytes != n)
    Die("Get of " + SizeName(n) + " returned " + std::to_string(info->nbytes) + " bytes");
  start = Clock::now();
  Check(client.Delete(*handle), "Delete");
  t.del = Since(start);
  return t;
}

struct ThroughputRow {
  size_t size = 0;
  long iters = 0, copy_iters = 0;
  double put = 0, get = 0, put_get = 0, memcpy2 = 0, ratio = 0;  // medians over repetitions
};

ThroughputRow Throughput(actstash::Client& client, size_t n, double min_time, int reps) {
  Buffers b(n);
  // Verify once: the bytes that come back are the bytes that went in.
  Round(client, b, n);
  if (std::memcmp(b.src.data(), b.dst.data(), n) != 0)
    Die("Get of " + SizeName(n) + ": bytes differ from the Put");
  CopyTwice(b, n);
  if (std::memcmp(b.src.data(), b.dst.data(), n) != 0) Die("memcpy baseline: bytes differ");

  ThroughputRow row;
  row.size = n;
  row.iters = Calibrate(min_time, [&] { Round(client, b, n); });
  row.copy_iters = Calibrate(min_time, [&] { CopyTwice(b, n); });
  const double gb = static_cast<double>(n) / 1e9;
  std::vector<double> put, get, put_get, copy, ratio;
  // Each repetition times the inline path, then the baseline right after it,
  // so that both see the same load on a shared machine.
  for (int r = 0; r < reps; ++r) {
    double put_s = 0, get_s = 0;
    for (long i = 0; i < row.iters; ++i) {
      const RoundTime t = Round(client, b, n);
      put_s += t.put;
      get_s += t.get;
    }
    const double total = gb * static_cast<double>(row.iters);
    put.push_back(total / put_s);
    get.push_back(total / get_s);
    put_get.push_back(total / (put_s + get_s));
    const Clock::time_point start = Clock::now();
    for (long i = 0; i < row.copy_iters; ++i) CopyTwice(b, n);
    copy.push_back(gb * static_cast<double>(row.copy_iters) / Since(start));
    ratio.push_back(put_get.back() / copy.back());
  }
  row.put = Median(put);
  row.get = Median(get);
  row.put_get = Median(put_get);
  row.memcpy2 = Median(copy);
  row.ratio = Median(ratio);
  return row;
}

void PrintPercentiles(const char* name, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  std::printf("  %-24s %10.3f %10.3f %10.3f\n", name, Percentile(us, 50), Percentile(us, 90),
              Percentile(us, 99));
}

void Latency(actstash::Client& client, size_t n, int iters) {
  Buffers b(n);
  for (int i = 0; i < std::max(20, iters / 10); ++i) Round(client, b, n);  // warm-up
  std::vector<double> put, get, del, total;
  for (int i = 0; i < iters; ++i) {
    const RoundTime t = Round(client, b, n);
    put.push_back(t.put * 1e6);
    get.push_back(t.get * 1e6);
    del.push_back(t.del * 1e6);
    total.push_back((t.put + t.get + t.del) * 1e6);
  }
  // memcpy of n bytes: one clock read per call would dominate, so every
  // sample is the mean over a batch of copies.
  constexpr int kBatch = 256;
  std::vector<double> one, two;
  for (int i = 0; i < iters; ++i) {
    Clock::time_point start = Clock::now();
    for (int k = 0; k < kBatch; ++k) {
      std::memcpy(b.staging.data(), b.src.data(), n);
      Clobber(b.staging.data());
    }
    one.push_back(Since(start) * 1e6 / kBatch);
    start = Clock::now();
    for (int k = 0; k < kBatch; ++k) CopyTwice(b, n);
    two.push_back(Since(start) * 1e6 / kBatch);
  }
  std::printf("\nLatency, %s objects, %d rounds after warm-up (microseconds)\n",
              SizeName(n).c_str(), iters);
  std::printf("  %-24s %10s %10s %10s\n", "operation", "p50", "p90", "p99");
  PrintPercentiles("Put", put);
  PrintPercentiles("Get", get);
  PrintPercentiles("Delete", del);
  PrintPercentiles("Put+Get+Delete", total);
  PrintPercentiles("memcpy (1 copy)", one);
  PrintPercentiles("memcpy (2 copies)", two);
  std::printf("  (memcpy rows: each sample is the mean of %d copies)\n", kBatch);
}

}  // namespace

int main(int argc, char** argv) {
  g_program = "inline_bench";
  CLI::App app{"Throughput and latency of actstashd's inline gRPC data path vs memcpy"};
  std::string address, pool, sizes_text = "4KiB,64KiB,1MiB,16MiB,64MiB";
  bool quick = false;
  double min_time = 0.3;
  int reps = 3, lat_iters = 2000;
  std::string lat_size_text = "4KiB";
  app.add_option("--address", address, "Use this running daemon instead of starting one");
  app.add_flag("--quick", quick, "Smoke run: 3 small sizes, few iterations (< 5 s)");
  app.add_option("--sizes", sizes_text, "Comma-separated object sizes (4KiB, 1MiB, ...)");
  app.add_option("--min-time", min_time, "Seconds per repetition and size (default 0.3)");
  app.add_option("--reps", reps, "Repetitions per size; the median is reported (default 3)")
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-iters", lat_iters, "Latency rounds after warm-up (default 2000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-size", lat_size_text, "Object size of the latency test (default 4KiB)");
  app.add_option("--pool", pool, "Pool of the daemon started here (default 1GiB, quick: 256MiB)");
  CLI11_PARSE(app, argc, argv);

  if (quick) {
    if (app.count("--sizes") == 0) sizes_text = "4KiB,1MiB,16MiB";
    if (app.count("--min-time") == 0) min_time = 0.03;
    if (app.count("--latency-iters") == 0) lat_iters = 200;
  }
  if (pool.empty()) pool = quick ? "256MiB" : "1GiB";
  std::vector<size_t> sizes;
  for (size_t start = 0; start <= sizes_text.size();) {
    size_t end = sizes_text.find(',', start);
    if (end == std::string::npos) end = sizes_text.size();
    size_t n = 0;
    if (!ParseSize(sizes_text.substr(start, end - start), &n))
      Die("bad size in --sizes: " + sizes_text);
    sizes.push_back(n);
    start = end + 1;
  }
  size_t lat_size = 0;
  if (!ParseSize(lat_size_text, &lat_size)) Die("bad --latency-size: " + lat_size_text);

  std::unique_ptr<actstash::testing::DaemonProcess> daemon = StartDaemonUnless(&address, pool);
  actstash::ClientOptions options;
  options.address = address;
  options.client_name = "inline_bench";
  options.rpc_timeout = std::chrono::seconds(120);
  absl::StatusOr<std::unique_ptr<actstash::Client>> connected = actstash::Client::Connect(options);
  Check(connected.status(), "Connect");
  actstash::Client& client = **connected;
  absl::StatusOr<actstash::v1::StatsReply> stats = client.Stats();
  Check(stats.status(), "Stats");
  std::printf("actstashd %s at %s (%s): pool %.0f MiB, %.0f MiB locked, session quota %.0f MiB\n",
              stats->daemon_version().c_str(), client.address().c_str(),
              daemon ? "started by inline_bench" : "already running",
              static_cast<double>(stats->pool().total_bytes()) / (1 << 20),
              static_cast<double>(stats->pool().locked_bytes()) / (1 << 20),
              static_cast<double>(client.quota_bytes()) / (1 << 20));
  std::printf("min-time %.3g s per repetition, %d repetitions, medians; GB/s = 1e9 B/s\n\n",
              min_time, reps);

  std::printf("%-9s %8s %8s %9s %9s %12s %9s\n", "size", "rounds", "Put", "Get", "Put+Get",
              "memcpy x2", "ratio");
  std::printf("%-9s %8s %8s %9s %9s %12s %9s\n", "", "", "GB/s", "GB/s", "GB/s", "GB/s", "inl/mcp");
  for (size_t n : sizes) {
    const ThroughputRow row = Throughput(client, n, min_time, reps);
    std::printf("%-9s %8ld %8.3f %9.3f %9.3f %12.3f %9.4f\n", SizeName(n).c_str(), row.iters,
                row.put, row.get, row.put_get, row.memcpy2, row.ratio);
    std::fflush(stdout);
  }
  std::printf(
      "(Put+Get: payload bytes / (Put time + Get time); memcpy x2: payload bytes /\n"
      " time of memcpy into a staging buffer and back out; ratio: median over repetitions\n"
      " of Put+Get / memcpy x2, each pair measured back to back)\n");

  Latency(client, lat_size, lat_iters);

  Check(client.Close(), "Close");
  StopDaemon(daemon.get());
  return 0;
}
