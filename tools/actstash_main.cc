// actstash: operator CLI for a running actstashd.
//
// Exit codes: 0 success; 1 the daemon could not be reached or refused the
// request; 2 usage error; 3 the daemon answered but is not serving.
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "actstash/client.h"
#include "actstash/v1/stash.pb.h"
#include "common/units.h"
#include "tools/cli_common.h"
#include "tools/verify_command.h"

namespace {

using actstash::cli::Common;
using actstash::cli::ConnectCli;
using actstash::cli::kExitNotServing;
using actstash::cli::kExitUnavailable;
using actstash::cli::kExitUsage;

// The stats messages as JSON: protobuf's own printer (proto field names,
// every field, one line). 64-bit integers are JSON strings, as the proto3
// JSON mapping has them (jq: tonumber).
std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  // Printing a generated message cannot fail (no Any, no unknown types).
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

void PrintSessionTable(const actstash::v1::StatsReply& s) {
  using actstash::FormatBytes;
  using ull = unsigned long long;
  std::printf("%8s  %-20s %8s %6s %12s %12s %12s %8s %12s %12s %12s %8s %12s %12s\n", "SESSION",
              "NAME", "PID", "UID", "QUOTA", "USED", "LEASED", "OBJECTS", "STORED", "FETCHED",
              "SPILLED", "IDLE", "ASKED BACK", "GAVE BACK");
  for (const actstash::v1::SessionStats& e : s.all_sessions()) {
    // Attached sessions show the kernel's view of the peer (SO_PEERCRED),
    // the others what the client said; objects of both data paths count.
    const std::string uid = e.attached() ? std::to_string(e.peer_uid()) : "-";
    // Idle: since its last copy; asked back / gave back: for sessions that
    // waited for the pool (the daemon's asks, what the client gave).
    const std::string idle = e.idle_ms() < 0 ? "-" : absl::StrFormat("%.1fs", e.idle_ms() / 1e3);
    std::printf("%8llu  %-20s %8u %6s %12s %12s %12s %8llu %12s %12s %12s %8s %12s %12s\n",
                ull(e.session_id()), e.client_name().substr(0, 20).c_str(),
                e.attached() ? e.peer_pid() : e.client_pid(), uid.c_str(),
                FormatBytes(e.quota_bytes()).c_str(), FormatBytes(e.used_bytes()).c_str(),
                FormatBytes(e.leased_bytes()).c_str(), ull(e.objects() + e.client().objects()),
                FormatBytes(e.bytes_stored()).c_str(), FormatBytes(e.bytes_fetched()).c_str(),
                FormatBytes(e.spill().on_disk_bytes()).c_str(), idle.c_str(),
                FormatBytes(e.reclaim_bytes_asked()).c_str(),
                FormatBytes(e.client().reclaim_bytes_given()).c_str());
  }
}

int RunPing(const Common& common) {
  absl::StatusOr<actstash::PingResult> ping =
      actstash::Ping(common.address, common.timeout, common.tls);
  if (!ping.ok()) {
    std::fprintf(stderr, "actstash ping: %s\n", std::string(ping.status().message()).c_str());
    return kExitUnavailable;
  }
  std::printf("%s: %s (%.3f ms)\n", ping->address.c_str(),
              ping->serving ? "SERVING" : "NOT SERVING", ping->round_trip.count() / 1000.0);
  return ping->serving ? 0 : kExitNotServing;
}

int RunStats(const Common& common, bool json, bool sessions_only) {
  auto client = ConnectCli(common, /*quota=*/1, /*attach=*/false);  // stats store nothing
  if (!client.ok()) {
    std::fprintf(stderr, "actstash stats: %s\n", std::string(client.status().message()).c_str());
    return kExitUnavailable;
  }
  absl::StatusOr<actstash::v1::StatsReply> stats = (*client)->Stats(/*all_sessions=*/true);
  if (!stats.ok()) {
    std::fprintf(stderr, "actstash stats: %s\n", std::string(stats.status().message()).c_str());
    return kExitUnavailable;
  }
  const actstash::v1::StatsReply& s = *stats;
  using ull = unsigned long long;
  if (json && sessions_only) {
    std::printf("[");
    for (int i = 0; i < s.all_sessions_size(); ++i) {
      std::printf("%s%s", i > 0 ? ", " : "", ToJson(s.all_sessions(i)).c_str());
    }
    std::printf("]\n");
    return 0;
  }
  if (json) {
    std::printf("%s\n", ToJson(s).c_str());
    return 0;
  }
  using actstash::FormatBytes;
  if (sessions_only) {
    PrintSessionTable(s);
    return 0;
  }
  std::printf("actstashd %s (pid %u, up %llus) at %s\n", s.daemon_version().c_str(), s.daemon_pid(),
              ull(s.uptime_seconds()), (*client)->address().c_str());
  const actstash::v1::PoolStats& pool = s.pool();
  std::printf("pool     %s total, %s used, %s free (largest free block %s), %s renewing\n",
              FormatBytes(pool.total_bytes()).c_str(), FormatBytes(pool.used_bytes()).c_str(),
              FormatBytes(pool.free_bytes()).c_str(),
              FormatBytes(pool.largest_free_bytes()).c_str(),
              FormatBytes(pool.renewing_bytes()).c_str());
  std::printf(
      "         %llu segments of %s, %s pinned (mlock), %s CUDA-registered; %s in %llu "
      "leases\n",
      ull(pool.segments()), FormatBytes(pool.segment_bytes()).c_str(),
      FormatBytes(pool.locked_bytes()).c_str(), FormatBytes(pool.cuda_pinned_bytes()).c_str(),
      FormatBytes(pool.leased_bytes()).c_str(), ull(pool.leases()));
  for (const actstash::v1::NumaNodeStats& node : pool.numa_nodes()) {
    std::printf("numa     node %d: %s of the pool bound there, %s free, %s leased\n", node.node(),
                FormatBytes(node.total_bytes()).c_str(), FormatBytes(node.free_bytes()).c_str(),
                FormatBytes(node.leased_bytes()).c_str());
  }
  for (const actstash::v1::DevicePoolStats& device : s.device_pools()) {
    const actstash::v1::PoolStats& d = device.pool();
    std::printf("gpu %-4u %s total, %s used, %s free, %s scrubbing; %llu segments, %llu leases\n",
                device.device(), FormatBytes(d.total_bytes()).c_str(),
                FormatBytes(d.used_bytes()).c_str(), FormatBytes(d.free_bytes()).c_str(),
                FormatBytes(d.renewing_bytes()).c_str(), ull(d.segments()), ull(d.leases()));
  }
  if (s.has_spill()) {
    const actstash::v1::SpillStats& p = s.spill();
    auto rate = [](uint64_t bytes, double seconds) {
      return seconds > 0 ? absl::StrFormat("%.0f MB/s", bytes / seconds / 1e6) : std::string("-");
    };
    std::printf(
        "spill    %s on disk in %llu files (of %s) in %s, %s; %s being written, %s being read\n"
        "         %s written (%s), %s read (%s) since start; %llu failures, %llu checksum "
        "failures\n",
        FormatBytes(p.on_disk_bytes()).c_str(), ull(p.files()),
        p.capacity_bytes() > 0 ? FormatBytes(p.capacity_bytes()).c_str() : "the free space",
        p.dir().c_str(), p.io_mode().c_str(), FormatBytes(p.writing_bytes()).c_str(),
        FormatBytes(p.reading_bytes()).c_str(), FormatBytes(p.bytes_written()).c_str(),
        rate(p.bytes_written(), p.write_seconds()).c_str(), FormatBytes(p.bytes_read()).c_str(),
        rate(p.bytes_read(), p.read_seconds()).c_str(), ull(p.failures()),
        ull(p.checksum_failures()));
  }
  const actstash::v1::CopyStats& copy = s.copy();
  std::printf("copy     node %s, shared by %u session(s) copying in the last %u s\n",
              copy.node_bytes_per_second() > 0
                  ? absl::StrFormat("%.2f GB/s (%s)", copy.node_bytes_per_second() / 1e9,
                                    copy.node_source())
                        .c_str()
                  : "unknown",
              copy.copying_sessions(), copy.window_seconds());
  std::printf("objects  %llu stored; %s stored and %s fetched since start\n", ull(s.objects()),
              FormatBytes(s.bytes_stored()).c_str(), FormatBytes(s.bytes_fetched()).c_str());
  std::printf("sessions %llu open (this one included)\n\n", ull(s.sessions()));
  PrintSessionTable(s);
  return 0;
}

// Store → Fetch → Release rounds against the live daemon, next to memcpy of the
// same bytes (into a staging buffer and back) measured in the same run.
int RunBench(const Common& common, const std::vector<std::string>& sizes, double seconds) {
  auto client = ConnectCli(common, /*quota=*/0, /*attach=*/true);
  if (!client.ok()) {
    std::fprintf(stderr, "actstash bench: %s\n", std::string(client.status().message()).c_str());
    return kExitUnavailable;
  }
  std::printf("actstash bench against %s (%s path), %.1f s per size\n",
              (*client)->address().c_str(), (*client)->attached() ? "zero-copy" : "inline gRPC",
              seconds);
  std::printf("%10s %10s %14s %14s %8s\n", "size", "rounds", "store+fetch", "memcpy x2", "ratio");
  using Clock = std::chrono::steady_clock;
  for (const std::string& text : sizes) {
    absl::StatusOr<uint64_t> n = actstash::ParseByteSize(text);
    if (!n.ok() || *n == 0) {
      std::fprintf(stderr, "actstash bench: bad size '%s'\n", text.c_str());
      return kExitUsage;
    }
    std::vector<char> src(*n, 'a'), staging(*n, 'b'), dst(*n, 'c');
    auto timed = [&](auto&& body) -> std::pair<long, double> {
      long rounds = 0;
      const auto start = Clock::now();
      double elapsed = 0;
      while (elapsed < seconds) {
        if (!body()) return {-1, 0};
        ++rounds;
        elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      }
      return {rounds, elapsed};
    };
    absl::Status failure;
    auto [rounds, store_time] = timed([&] {
      absl::StatusOr<actstash::Ticket> t = (*client)->Store(src.data(), src.size());
      if (t.ok()) failure = (*client)->Fetch(*t, dst.data(), dst.size());
      if (t.ok() && failure.ok()) failure = (*client)->Release(*t);
      if (!t.ok()) failure = t.status();
      return failure.ok();
    });
    if (!failure.ok()) {
      std::fprintf(stderr, "actstash bench: %s\n", failure.ToString().c_str());
      return kExitUnavailable;
    }
    auto [copies, copy_time] = timed([&] {
      std::memcpy(staging.data(), src.data(), src.size());
      std::memcpy(dst.data(), staging.data(), staging.size());
      asm volatile("" : : "r"(dst.data()) : "memory");
      return true;
    });
    const double ours = static_cast<double>(*n) * rounds / store_time / 1e9;
    const double base = static_cast<double>(*n) * copies / copy_time / 1e9;
    std::printf("%10s %10ld %11.2f GB/s %11.2f GB/s %8.3f\n", actstash::FormatBytes(*n).c_str(),
                rounds, ours, base, ours / base);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "actstash: talk to a running actstashd. Exit codes: 0 success, 1 the daemon "
      "could not be reached or refused, 2 usage error, 3 not serving",
      "actstash"};
  app.require_subcommand(1);
  Common common;
  double timeout_seconds = 5;
  std::string tls_ca, tls_cert, tls_key;
  app.add_option("-a,--address", common.address,
                 "Daemon address: socket path, unix:///path or host:port (default: "
                 "$ACTSTASH_ADDRESS, else the default socket)");
  app.add_option("-t,--timeout", timeout_seconds, "Deadline in seconds (default 5)")
      ->check(CLI::PositiveNumber);
  app.add_option("--tls-ca", tls_ca, "PEM CA of the daemon's TCP certificate (enables TLS)");
  app.add_option("--tls-cert", tls_cert, "PEM client certificate (mutual TLS)");
  app.add_option("--tls-key", tls_key, "PEM client key (mutual TLS)");
  CLI::App* ping = app.add_subcommand("ping", "Check that the daemon is serving");
  CLI::App* stats = app.add_subcommand("stats", "Show pool and session statistics");
  bool json = false;
  stats->add_flag(
      "--json", json,
      "Print the StatsReply message (actstash/v1/stash.proto) as protobuf JSON: proto field "
      "names, 64-bit integers as strings");
  CLI::App* sessions = app.add_subcommand("sessions", "Who holds what: one line per session");
  sessions->add_flag("--json", json,
                     "Print a JSON array of SessionStats messages (as stats --json)");
  CLI::App* bench = app.add_subcommand(
      "bench", "Store/Fetch/Release throughput against the daemon, next to memcpy");
  std::vector<std::string> sizes = {"1MiB", "64MiB"};
  double seconds = 1;
  bench->add_option("--sizes", sizes, "Buffer sizes (default 1MiB 64MiB)");
  bench->add_option("--seconds", seconds, "Time per size (default 1)")->check(CLI::PositiveNumber);
  CLI::App* verify = app.add_subcommand(
      "verify",
      "Store --bytes of patterned data, read every byte back and compare; with more than the "
      "session's quota or the pool, a daemon with --spill-dir writes to disk and reads back");
  actstash::cli::VerifyOptions verify_options;
  std::string verify_bytes = "64MiB", verify_object = "8MiB";
  verify->add_option("--bytes", verify_bytes, "Data to store in all (default 64MiB)");
  verify->add_option("--object-size", verify_object, "Size of each object (default 8MiB)");
  verify->add_flag("--zero-copy", verify_options.zero_copy,
                   "Use the attached (leased memory) path instead of inline gRPC");
  verify->add_flag("--require-spill", verify_options.require_spill,
                   "Fail unless the spill tier wrote to disk and read back meanwhile");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : kExitUsage;
  }
  common.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  for (const auto& [path, out, what] :
       {std::tuple{&tls_ca, &common.tls.tls_root_certs, "--tls-ca"},
        std::tuple{&tls_cert, &common.tls.tls_cert_chain, "--tls-cert"},
        std::tuple{&tls_key, &common.tls.tls_private_key, "--tls-key"}}) {
    if (!path->empty() && !actstash::cli::ReadFile(*path, out)) {
      std::fprintf(stderr, "actstash: cannot read %s %s\n", what, path->c_str());
      return kExitUsage;
    }
  }
  if (ping->parsed()) return RunPing(common);
  if (stats->parsed()) return RunStats(common, json, /*sessions_only=*/false);
  if (sessions->parsed()) return RunStats(common, json, /*sessions_only=*/true);
  if (bench->parsed()) return RunBench(common, sizes, seconds);
  if (verify->parsed()) {
    for (const auto& [text, out] : {std::pair{&verify_bytes, &verify_options.total_bytes},
                                    std::pair{&verify_object, &verify_options.object_bytes}}) {
      absl::StatusOr<uint64_t> n = actstash::ParseByteSize(*text);
      if (!n.ok()) {
        std::fprintf(stderr, "actstash verify: bad size '%s'\n", text->c_str());
        return kExitUsage;
      }
      *out = *n;
    }
    return actstash::cli::RunVerify(common, verify_options);
  }
  return kExitUsage;
}
