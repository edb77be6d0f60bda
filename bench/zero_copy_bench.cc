// zero_copy_bench: actstashd's zero-copy local data plane (Client::Store /
// Fetch / Release on an attached client: one memcpy into shared memory leased
// from the daemon, one memcpy out), next to a memcpy baseline and the inline
// gRPC path, all measured in the same run.
//
//   zero_copy_bench                   # starts its own actstashd (2 GiB pool)
//   zero_copy_bench --address unix:///run/actstash/actstash.sock
//   zero_copy_bench --quick           # smoke run (ctest zero_copy_bench_quick)
//
// 1. Lease cost (first, while the daemon's segments are pristine): the first
//    Store on fresh clients with lease_batch 1, of 1 byte (one Lease RPC, fd
//    passing, MAP_POPULATE of one segment) and of 2 segments (a dedicated
//    lease; its copy is timed apart and subtracted). Clients stay open so each
//    gets unused segments; then all close and the same runs again on segments
//    used before, which the daemon renews (fresh memfd, populated, mlocked).
// 2. Throughput: per size, Store -> Fetch -> Release rounds, each call timed,
//    ~--min-time s per repetition after warm-up rounds, each repetition followed
//    at once by the memcpy baseline (src -> staging -> dst, pre-faulted); the
//    median of --reps repetitions. GB/s = 1e9 bytes of payload per second.
// 3. Latency of 4 KiB rounds, one steady_clock sample per call, on the hot path
//    (no lease in the timed region, checked) and on the inline path (kOff).
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
using actstash::AttachMode;
using actstash::Client;

std::unique_ptr<Client> Connect(const std::string& address, AttachMode mode, uint32_t lease_batch) {
  actstash::ClientOptions options;
  options.address = address;
  options.client_name = "zero_copy_bench";
  options.attach = mode;
  options.lease_batch = lease_batch;
  options.rpc_timeout = std::chrono::seconds(120);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  Check(client.status(), "Connect");
  if (mode == AttachMode::kRequired && !(*client)->attached()) Die("Connect: not attached");
  return *std::move(client);
}

uint64_t LeasesGranted(Client& client) {
  absl::StatusOr<actstash::v1::StatsReply> stats = client.Stats();
  Check(stats.status(), "Stats");
  return stats->leases_granted();
}

struct RoundTime {
  double store = 0, fetch = 0, release = 0;
  double total() const { return store + fetch + release; }
};

// One Store -> Fetch -> Release, each call timed on its own (seconds).
RoundTime Round(Client& client, Buffers& b, size_t n) {
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<actstash::Ticket> ticket = client.Store(b.src.data(), n);
  const Clock::time_point t1 = Clock::now();
  const absl::Status fetched =
      ticket.ok() ? client.Fetch(*ticket, b.dst.data(), n) : ticket.status();
  const Clock::time_point t2 = Clock::now();
  const absl::Status released = fetched.ok() ? client.Release(*ticket) : fetched;
  const Clock::time_point t3 = Clock::now();
  Check(released, "Store/Fetch/Release of " + SizeName(n));
  using Seconds = std::chrono::duration<double>;
  return {Seconds(t1 - t0).count(), Seconds(t2 - t1).count(), Seconds(t3 - t2).count()};
}

void PrintStat(const char* name, const std::vector<double>& ms) {
  std::printf("  %-46s %9.2f %9.2f %9.2f\n", name, Median(ms),
              *std::min_element(ms.begin(), ms.end()), *std::max_element(ms.begin(), ms.end()));
}

// First Stores on `clients` fresh clients (lease_batch 1) per kind of lease.
// The clients stay open (their leases held) until the end of the phase, so
// that on a pristine daemon each one gets segments nobody used before.
void LeasePhase(const std::string& address, uint64_t segment, int clients, bool renewed) {
  Buffers big(2 * segment);
  std::vector<std::unique_ptr<Client>> open;
  std::vector<double> connect, small, dedicated, copy, lease, release;
  for (int i = 0; i < clients; ++i) {
    const Clock::time_point start = Clock::now();
    open.push_back(Connect(address, AttachMode::kRequired, 1));
    connect.push_back(Since(start) * 1e3);
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<actstash::Ticket> ticket = open.back()->Store(big.src.data(), 1);
    small.push_back(Since(t0) * 1e3);
    Check(ticket.status(), "first Store of 1 byte");
  }
  for (int i = 0; i < clients; ++i) {
    open.push_back(Connect(address, AttachMode::kRequired, 1));
    Clock::time_point start = Clock::now();
    absl::StatusOr<actstash::Ticket> ticket = open.back()->Store(big.src.data(), 2 * segment);
    dedicated.push_back(Since(start) * 1e3);
    Check(ticket.status(), "first Store of 2 segments");
    start = Clock::now();
    std::memcpy(big.dst.data(), big.src.data(), 2 * segment);  // the copy inside that Store
    Clobber(big.dst.data());
    copy.push_back(Since(start) * 1e3);
    lease.push_back(dedicated.back() - copy.back());
    if (renewed) {  // on a pristine run, a Release would dirty the next client's segments
      start = Clock::now();
      Check(open.back()->Release(*ticket), "Release of a dedicated lease");
      release.push_back(Since(start) * 1e3);
    }
  }
  for (std::unique_ptr<Client>& client : open) Check(client->Close(), "Close");
  std::printf("\nLease cost, %d fresh clients, %s segments (ms)\n", clients,
              renewed ? "renewed (used before)" : "pristine");
  std::printf("  %-46s %9s %9s %9s\n", "", "median", "min", "max");
  PrintStat("Connect (OpenSession + attach)", connect);
  PrintStat("first Store of 1 B (lease of 1 segment)", small);
  const std::string big_name = SizeName(2 * segment);
  PrintStat(("first Store of " + big_name + " (dedicated lease)").c_str(), dedicated);
  PrintStat(("  memcpy of " + big_name + " right after").c_str(), copy);
  PrintStat("  difference: dedicated lease of 2 segments", lease);
  if (renewed) PrintStat("Release of it (Return RPC + munmap)", release);
}

// Measures and prints one row of the throughput table.
void Throughput(Client& client, size_t n, double min_time, int reps) {
  Buffers b(n);
  for (int i = 0; i < 3; ++i) Round(client, b, n);  // warm-up: leases mapped, pages touched
  // Verify once: the bytes that come back are the bytes that went in.
  std::memset(b.dst.data(), 0, n);
  Round(client, b, n);
  if (std::memcmp(b.src.data(), b.dst.data(), n) != 0) Die("bytes differ: Fetch of " + SizeName(n));
  CopyTwice(b, n);
  if (std::memcmp(b.src.data(), b.dst.data(), n) != 0) Die("memcpy baseline: bytes differ");

  const long iters = Calibrate(min_time, [&] { Round(client, b, n); });
  const long copy_iters = Calibrate(min_time, [&] { CopyTwice(b, n); });
  const double gb = static_cast<double>(n) / 1e9;
  std::vector<double> store, fetch, release_us, round, copy, ratio;
  const uint64_t leases_before = LeasesGranted(client);
  for (int r = 0; r < reps; ++r) {  // each repetition, then its baseline right after
    RoundTime sum;
    for (long i = 0; i < iters; ++i) {
      const RoundTime t = Round(client, b, n);
      sum = {sum.store + t.store, sum.fetch + t.fetch, sum.release + t.release};
    }
    const double total = gb * static_cast<double>(iters);
    store.push_back(total / sum.store);
    fetch.push_back(total / sum.fetch);
    release_us.push_back(sum.release * 1e6 / static_cast<double>(iters));
    round.push_back(total / sum.total());
    const Clock::time_point start = Clock::now();
    for (long i = 0; i < copy_iters; ++i) CopyTwice(b, n);
    copy.push_back(gb * static_cast<double>(copy_iters) / Since(start));
    ratio.push_back(round.back() / copy.back());
  }
  const uint64_t leases = LeasesGranted(client) - leases_before;
  std::printf("%-8s %6ld %7llu %8.3f %8.3f %9.2f %9.3f %10.3f %7.3f\n", SizeName(n).c_str(), iters,
              static_cast<unsigned long long>(leases), Median(store), Median(fetch),
              Median(release_us), Median(round), Median(copy), Median(ratio));
  std::fflush(stdout);
}

void PrintPercentiles(const char* name, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  std::printf("  %-30s %9.3f %9.3f %9.3f\n", name, Percentile(us, 50), Percentile(us, 90),
              Percentile(us, 99));
}

// Per-call latency of `iters` Store -> Fetch -> Release rounds after warm-up.
void LatencyRows(const char* path, Client& client, Client& stats, Buffers& b, size_t n, int iters) {
  for (int i = 0; i < std::max(20, iters / 10); ++i) Round(client, b, n);  // warm-up
  const uint64_t leases_before = LeasesGranted(stats);
  std::vector<double> us[4];  // Store, Fetch, Release, all three
  for (int i = 0; i < iters; ++i) {
    const RoundTime t = Round(client, b, n);
    const double parts[] = {t.store, t.fetch, t.release, t.total()};
    for (int k = 0; k < 4; ++k) us[k].push_back(parts[k] * 1e6);
  }
  const uint64_t leases = LeasesGranted(stats) - leases_before;
  const char* names[] = {" Store", " Fetch", " Release", " Store+Fetch+Release"};
  for (int k = 0; k < 4; ++k) PrintPercentiles((std::string(path) + names[k]).c_str(), us[k]);
  std::printf("  (%s: %d rounds, %llu leases granted by the daemon meanwhile)\n", path, iters,
              static_cast<unsigned long long>(leases));
}

void Latency(Client& zero_copy, Client& inline_path, size_t n, int iters, int inline_iters) {
  Buffers b(n);
  std::printf("\nLatency, %s buffers (microseconds)\n", SizeName(n).c_str());
  std::printf("  %-30s %9s %9s %9s\n", "operation", "p50", "p90", "p99");
  LatencyRows("zero-copy", zero_copy, zero_copy, b, n, iters);
  LatencyRows("inline", inline_path, zero_copy, b, n, inline_iters);
  // memcpy of n bytes: one clock read per call would dominate, so every
  // sample is the mean over a batch of copies.
  constexpr int kBatch = 256;
  std::vector<double> two, clock;  // clock: a timed interval with nothing in it
  for (int i = 0; i < std::max(1, iters / 10); ++i) {
    Clock::time_point start = Clock::now();
    for (int k = 0; k < kBatch; ++k) CopyTwice(b, n);
    two.push_back(Since(start) * 1e6 / kBatch);
    start = Clock::now();
    clock.push_back(Since(start) * 1e6);
  }
  PrintPercentiles("memcpy x2 (mean of 256)", two);
  PrintPercentiles("empty timed interval", clock);
}

}  // namespace

int main(int argc, char** argv) {
  g_program = "zero_copy_bench";
  CLI::App app{"Throughput, latency and lease cost of actstashd's zero-copy data plane vs memcpy"};
  std::string address, pool;
  std::vector<size_t> sizes = {1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20};
  size_t lat_size = 4096;
  bool quick = false;
  double min_time = 0.3;
  int reps = 3, lat_iters = 100000, inline_iters = 2000, lease_clients = 5;
  app.add_option("--address", address, "Use this running daemon instead of starting one");
  app.add_flag("--quick", quick, "Smoke run: 2 small sizes, few iterations (< 5 s)");
  app.add_option("--sizes", sizes, "Comma-separated buffer sizes (1MiB, 64MiB, ...)")
      ->delimiter(',')
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--min-time", min_time, "Seconds per repetition and size (default 0.3)");
  app.add_option("--reps", reps, "Repetitions per size; the median is reported (default 3)")
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-iters", lat_iters, "Zero-copy latency rounds (default 100000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--inline-iters", inline_iters, "Inline latency rounds (default 2000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-size", lat_size, "Buffer size of the latency test (default 4KiB)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--lease-clients", lease_clients, "Fresh clients per lease test (default 5)")
      ->check(CLI::PositiveNumber);
  app.add_option("--pool", pool, "Pool of the daemon started here (default 2GiB, quick: 1GiB)");
  CLI11_PARSE(app, argc, argv);

  if (quick) {
    if (app.count("--sizes") == 0) sizes = {1 << 20, 4 << 20};
    if (app.count("--min-time") == 0) min_time = 0.02;
    if (app.count("--latency-iters") == 0) lat_iters = 5000;
    if (app.count("--inline-iters") == 0) inline_iters = 100;
    if (app.count("--lease-clients") == 0) lease_clients = 2;
  }
  if (pool.empty()) pool = quick ? "1GiB" : "2GiB";

  std::unique_ptr<actstash::testing::DaemonProcess> daemon = StartDaemonUnless(&address, pool);
  uint64_t segment = 0;
  {
    std::unique_ptr<Client> probe = Connect(address, AttachMode::kRequired, 1);
    absl::StatusOr<actstash::v1::StatsReply> stats = probe->Stats();
    Check(stats.status(), "Stats");
    segment = stats->pool().segment_bytes();
    std::printf(
        "actstashd %s at %s (%s): pool %.0f MiB, %.0f MiB locked, segments of %s, "
        "session quota %.0f MiB\n",
        stats->daemon_version().c_str(), probe->address().c_str(),
        daemon ? "started by zero_copy_bench" : "already running",
        static_cast<double>(stats->pool().total_bytes()) / (1 << 20),
        static_cast<double>(stats->pool().locked_bytes()) / (1 << 20), SizeName(segment).c_str(),
        static_cast<double>(probe->quota_bytes()) / (1 << 20));
    Check(probe->Close(), "Close");
  }

  LeasePhase(address, segment, lease_clients, /*renewed=*/false);
  LeasePhase(address, segment, lease_clients, /*renewed=*/true);

  std::unique_ptr<Client> client = Connect(address, AttachMode::kRequired, 4);
  std::printf(
      "\nThroughput, one thread, min-time %.3g s per repetition, %d repetitions, "
      "medians; GB/s = 1e9 B/s\n",
      min_time, reps);
  std::printf("%-8s %6s %7s %8s %8s %9s %9s %10s %7s\n", "size", "rounds", "leases", "Store",
              "Fetch", "Release", "S+F+R", "memcpy x2", "ratio");
  std::printf("%-8s %6s %7s %8s %8s %9s %9s %10s %7s\n", "", "", "", "GB/s", "GB/s", "us/call",
              "GB/s", "GB/s", "zc/mcp");
  for (size_t n : sizes) Throughput(*client, n, min_time, reps);
  std::printf(
      "(rounds per repetition; leases: granted during all timed repetitions; S+F+R:\n"
      " bytes / (Store + Fetch + Release time); memcpy x2: bytes / time of memcpy into\n"
      " a staging buffer and back out; ratio: median of per-repetition S+F+R / memcpy x2)\n");

  std::unique_ptr<Client> inline_client = Connect(address, AttachMode::kOff, 4);
  Latency(*client, *inline_client, lat_size, lat_iters, inline_iters);

  Check(inline_client->Close(), "Close");
  Check(client->Close(), "Close");
  StopDaemon(daemon.get());
  return 0;
}
