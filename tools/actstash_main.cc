// actstash: operator CLI for a running actstashd.
//
// Exit codes: 0 success; 1 the daemon could not be reached or refused the
// request; 2 usage error; 3 the daemon answered but is not serving.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "actstash/client.h"
#include "common/units.h"

namespace {

constexpr int kExitUnavailable = 1;
constexpr int kExitNotServing = 3;

std::string JsonEscape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

void PrintSessionJson(const actstash::SessionStatsEntry& s) {
  std::printf(
      "{\"session_id\": %llu, \"client_name\": \"%s\", \"client_pid\": %u, "
      "\"quota_bytes\": %llu, \"used_bytes\": %llu, \"objects\": %llu, \"bytes_stored\": %llu, "
      "\"bytes_fetched\": %llu, \"attached\": %s, \"peer_uid\": %u, \"peer_pid\": %u, "
      "\"leases\": %llu, \"leased_bytes\": %llu, \"local_objects\": %llu, \"local_bytes\": %llu}",
      static_cast<unsigned long long>(s.session_id), JsonEscape(s.client_name).c_str(),
      s.client_pid, static_cast<unsigned long long>(s.quota_bytes),
      static_cast<unsigned long long>(s.used_bytes), static_cast<unsigned long long>(s.objects),
      static_cast<unsigned long long>(s.bytes_stored),
      static_cast<unsigned long long>(s.bytes_fetched), s.attached ? "true" : "false",
      s.peer_uid, s.peer_pid, static_cast<unsigned long long>(s.leases),
      static_cast<unsigned long long>(s.leased_bytes),
      static_cast<unsigned long long>(s.local_objects),
      static_cast<unsigned long long>(s.local_bytes));
}

int RunPing(const std::string& address, std::chrono::milliseconds timeout) {
  absl::StatusOr<actstash::PingResult> ping = actstash::Ping(address, timeout);
  if (!ping.ok()) {
    std::fprintf(stderr, "actstash ping: %s\n", std::string(ping.status().message()).c_str());
    return kExitUnavailable;
  }
  std::printf("%s: %s (%.3f ms)\n", ping->address.c_str(),
              ping->serving ? "SERVING" : "NOT SERVING", ping->round_trip.count() / 1000.0);
  return ping->serving ? 0 : kExitNotServing;
}

int RunStats(const std::string& address, std::chrono::milliseconds timeout, bool json) {
  actstash::ClientOptions options;
  options.address = address;
  options.client_name = "actstash-cli";
  options.connect_timeout = timeout;
  options.rpc_timeout = timeout;
  options.quota_bytes = 1;  // the CLI stores nothing
  auto client = actstash::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "actstash stats: %s\n", std::string(client.status().message()).c_str());
    return kExitUnavailable;
  }
  absl::StatusOr<actstash::StatsSnapshot> stats = (*client)->Stats(/*all_sessions=*/true);
  if (!stats.ok()) {
    std::fprintf(stderr, "actstash stats: %s\n", std::string(stats.status().message()).c_str());
    return kExitUnavailable;
  }
  const actstash::StatsSnapshot& s = *stats;
  using ull = unsigned long long;
  if (json) {
    std::printf(
        "{\"daemon_version\": \"%s\", \"daemon_pid\": %u, \"uptime_seconds\": %llu, "
        "\"pool\": {\"total_bytes\": %llu, \"used_bytes\": %llu, \"free_bytes\": %llu, "
        "\"largest_free_bytes\": %llu, \"locked_bytes\": %llu, \"segment_bytes\": %llu, "
        "\"segments\": %llu, \"leased_bytes\": %llu, \"leases\": %llu, \"renewing_bytes\": %llu}, \"sessions\": %llu, \"objects\": %llu, \"bytes_stored\": %llu, "
        "\"bytes_fetched\": %llu, \"session_list\": [",
        JsonEscape(s.daemon_version).c_str(), s.daemon_pid, ull(s.uptime_seconds),
        ull(s.pool_total_bytes), ull(s.pool_used_bytes), ull(s.pool_free_bytes),
        ull(s.pool_largest_free_bytes), ull(s.pool_locked_bytes), ull(s.segment_bytes),
        ull(s.segments), ull(s.pool_leased_bytes), ull(s.pool_leases),
        ull(s.pool_renewing_bytes), ull(s.sessions),
        ull(s.objects), ull(s.bytes_stored),
        ull(s.bytes_fetched));
    for (size_t i = 0; i < s.all_sessions.size(); ++i) {
      if (i > 0) std::printf(", ");
      PrintSessionJson(s.all_sessions[i]);
    }
    std::printf("]}\n");
    return 0;
  }
  using actstash::FormatBytes;
  std::printf("actstashd %s (pid %u, up %llus) at %s\n", s.daemon_version.c_str(), s.daemon_pid,
              ull(s.uptime_seconds), (*client)->address().c_str());
  std::printf("pool     %s total, %s used, %s free (largest free block %s), %s renewing\n",
              FormatBytes(s.pool_total_bytes).c_str(), FormatBytes(s.pool_used_bytes).c_str(),
              FormatBytes(s.pool_free_bytes).c_str(),
              FormatBytes(s.pool_largest_free_bytes).c_str(),
              FormatBytes(s.pool_renewing_bytes).c_str());
  std::printf("         %llu segments of %s, %s pinned; %s in %llu leases\n", ull(s.segments),
              FormatBytes(s.segment_bytes).c_str(), FormatBytes(s.pool_locked_bytes).c_str(),
              FormatBytes(s.pool_leased_bytes).c_str(), ull(s.pool_leases));
  std::printf("objects  %llu stored; %s stored and %s fetched since start\n", ull(s.objects),
              FormatBytes(s.bytes_stored).c_str(), FormatBytes(s.bytes_fetched).c_str());
  std::printf("sessions %llu open (this one included)\n\n", ull(s.sessions));
  std::printf("%8s  %-20s %8s %6s %12s %12s %12s %8s %12s %12s\n", "SESSION", "NAME", "PID",
              "UID", "QUOTA", "USED", "LEASED", "OBJECTS", "STORED", "FETCHED");
  for (const actstash::SessionStatsEntry& e : s.all_sessions) {
    // Attached sessions show the kernel's view of the peer (SO_PEERCRED),
    // the others what the client said; objects of both data paths count.
    const std::string uid = e.attached ? std::to_string(e.peer_uid) : "-";
    std::printf("%8llu  %-20s %8u %6s %12s %12s %12s %8llu %12s %12s\n", ull(e.session_id),
                e.client_name.substr(0, 20).c_str(), e.attached ? e.peer_pid : e.client_pid,
                uid.c_str(), FormatBytes(e.quota_bytes).c_str(),
                FormatBytes(e.used_bytes).c_str(), FormatBytes(e.leased_bytes).c_str(),
                ull(e.objects + e.local_objects), FormatBytes(e.bytes_stored).c_str(),
                FormatBytes(e.bytes_fetched).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"actstash: talk to a running actstashd", "actstash"};
  app.require_subcommand(1);
  std::string address;
  double timeout_seconds = 5;
  app.add_option("-a,--address", address,
                 "Daemon address: socket path, unix:///path or host:port (default: "
                 "$ACTSTASH_ADDRESS, else the default socket)");
  app.add_option("-t,--timeout", timeout_seconds, "Deadline in seconds (default 5)")
      ->check(CLI::PositiveNumber);
  CLI::App* ping = app.add_subcommand("ping", "Check that the daemon is serving");
  CLI::App* stats = app.add_subcommand("stats", "Show pool and session statistics");
  bool json = false;
  stats->add_flag("--json", json, "Print JSON instead of a table");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  if (ping->parsed()) return RunPing(address, timeout);
  if (stats->parsed()) return RunStats(address, timeout, json);
  return 2;
}
