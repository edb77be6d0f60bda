// spill_bench: the spill tier's write and read-back throughput, next to what
// dd reaches with sequential direct I/O on the same directory in the same run.
//
// A client stores `factor` times the pool (1 MiB buffers) through a daemon
// started with --spill-dir, then fetches everything back in reverse order
// (backward's order). Spill write throughput is the bytes the daemon wrote
// over the time the client's stores waited for Spill calls (checksum, write
// and RPC included: what a trainer sees); read throughput is the bytes read
// back over the daemon's summed read time (reads run one at a time). The
// baseline is `dd bs=SEGMENT oflag=direct conv=fsync` and `iflag=direct` of
// the same number of bytes in the same directory.
//
// --sessions N: N clients (sessions of their own, one thread each) store and
// fetch a share each at once, sharing the pool. Their spill write throughput
// is the bytes the daemon wrote over the store phase's wall time (every
// store's copy and lease call included: a lower bound), read-back the bytes
// read over the fetch phase's wall time; the single-session figures above
// stay as they are.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <regex>
#include <thread>

#include "CLI/CLI.hpp"
#include "actstash/client.h"
#include "actstash/v1/stash.pb.h"
#include "bench/bench_util.h"

namespace {

using namespace actstash;
using namespace actstash::bench;

// Seconds dd took, from its summary line ("N bytes ... copied, T s, R MB/s").
double RunDd(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  std::string out;
  char buffer[1024];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  if (pclose(pipe) != 0) Die("dd failed: " + command + "\n" + out);
  std::smatch match;
  if (!std::regex_search(out, match, std::regex(R"(copied, ([0-9.eE+-]+) s)"))) {
    Die("cannot read dd's output: " + out);
  }
  return std::stod(match[1]);
}

struct Round {
  double dd_write = 0, dd_read = 0;  // bytes/s
  double spill_write = 0, spill_read = 0;
  double store_seconds = 0, fetch_seconds = 0;
  double restore_wait = 0, ahead_fraction = 0;
  uint64_t spilled = 0, restored = 0;
};

// One client's share: stores `bytes` in 1 MiB buffers, then fetches them back
// in reverse order and checks them.
void StoreAndFetch(Client* client, uint64_t bytes) {
  const size_t buffer = 1 << 20;
  Buffers data(buffer);
  std::vector<Ticket> tickets;
  for (uint64_t stored = 0; stored < bytes; stored += buffer) {
    absl::StatusOr<Ticket> ticket = client->Store(data.src.data(), buffer);
    Check(ticket.status(), "Store");
    tickets.push_back(*ticket);
  }
  for (size_t i = tickets.size(); i-- > 0;) {
    Check(client->Fetch(tickets[i], data.dst.data(), buffer), "Fetch");
    if (std::memcmp(data.dst.data(), data.src.data(), buffer) != 0) Die("bytes came back wrong");
    Check(client->Release(tickets[i]), "Release");
  }
}

Round RunOnce(const std::string& dir, const std::string& pool, uint64_t segment, double factor,
              int sessions) {
  Round round;
  uint64_t pool_bytes = ParseByteSize(pool).value();
  const uint64_t total = static_cast<uint64_t>(factor * static_cast<double>(pool_bytes));
  const uint64_t dd_count = (total - pool_bytes) / segment;
  const std::string file = dir + "/actstash-spill-bench-dd";
  const double dd_bytes = static_cast<double>(dd_count * segment);
  round.dd_write =
      dd_bytes / RunDd("dd if=/dev/zero of=" + file + " bs=" + std::to_string(segment) +
                       " count=" + std::to_string(dd_count) + " oflag=direct conv=fsync");
  round.dd_read = dd_bytes / RunDd("dd if=" + file + " of=/dev/null bs=" + std::to_string(segment) +
                                   " iflag=direct");
  std::filesystem::remove(file);

  actstash::testing::DaemonProcessOptions options;
  options.pool_size = pool;
  options.segment_size = std::to_string(segment);
  options.extra_args = {"--spill-dir", dir};
  absl::StatusOr<std::unique_ptr<actstash::testing::DaemonProcess>> daemon =
      actstash::testing::DaemonProcess::Start(options);
  Check(daemon.status(), "starting actstashd");
  g_daemon = daemon->get();
  ClientOptions client_options;
  client_options.address = (*daemon)->address();
  client_options.attach = AttachMode::kRequired;
  client_options.lease_batch = 4;
  if (sessions > 1) {
    std::vector<std::unique_ptr<Client>> clients;
    for (int i = 0; i < sessions; ++i) {
      absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(client_options);
      Check(c.status(), "connecting");
      clients.push_back(*std::move(c));
    }
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> threads;
    for (auto& c : clients) threads.emplace_back(StoreAndFetch, c.get(), total / sessions);
    for (std::thread& t : threads) t.join();
    const double wall = Since(start);
    absl::StatusOr<v1::StatsReply> stats = clients[0]->Stats();
    Check(stats.status(), "Stats");
    if (!stats->has_spill() || stats->spill().bytes_written() == 0) Die("nothing was spilled");
    round.spilled = stats->spill().bytes_written();
    round.restored = stats->spill().bytes_read();
    // Write and read-back in one wall time: both directions over it, as one
    // figure (the phases of the sessions overlap).
    round.spill_write = round.spill_read =
        static_cast<double>(round.spilled + round.restored) / wall;
    round.store_seconds = round.fetch_seconds = wall;
    clients.clear();
    Check((*daemon)->Stop().status(), "stopping actstashd");
    g_daemon = nullptr;
    return round;
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  Check(client.status(), "connecting");
  const size_t buffer = 1 << 20;
  Buffers data(buffer);
  std::vector<Ticket> tickets;
  const Clock::time_point store_start = Clock::now();
  for (uint64_t stored = 0; stored < total; stored += buffer) {
    absl::StatusOr<Ticket> ticket = (*client)->Store(data.src.data(), buffer);
    Check(ticket.status(), "Store");
    tickets.push_back(*ticket);
  }
  round.store_seconds = Since(store_start);
  const v1::ClientUsage stored = (*client)->zero_copy_usage();
  const Clock::time_point fetch_start = Clock::now();
  for (size_t i = tickets.size(); i-- > 0;) {
    Check((*client)->Fetch(tickets[i], data.dst.data(), buffer), "Fetch");
    Clobber(data.dst.data());
    Check((*client)->Release(tickets[i]), "Release");
  }
  round.fetch_seconds = Since(fetch_start);
  if (std::memcmp(data.dst.data(), data.src.data(), buffer) != 0) Die("bytes came back wrong");
  const v1::ClientUsage usage = (*client)->zero_copy_usage();
  absl::StatusOr<v1::StatsReply> stats = (*client)->Stats();
  Check(stats.status(), "Stats");
  if (!stats->has_spill() || stats->spill().bytes_written() == 0) Die("nothing was spilled");
  round.spilled = stats->spill().bytes_written();
  round.restored = stats->spill().bytes_read();
  round.spill_write = static_cast<double>(round.spilled) / (stored.spill_wait_ns() * 1e-9);
  round.spill_read = static_cast<double>(round.restored) / stats->spill().read_seconds();
  round.restore_wait = usage.restore_wait_ns() * 1e-9;
  round.ahead_fraction =
      usage.restores() == 0 ? 0 : static_cast<double>(usage.restores_ahead()) / usage.restores();
  client->reset();
  Check((*daemon)->Stop().status(), "stopping actstashd");
  g_daemon = nullptr;
  return round;
}

}  // namespace

int main(int argc, char** argv) {
  g_program = "spill_bench";
  CLI::App app{"Spill tier throughput vs dd direct I/O on the same directory"};
  std::string dir = "/var/tmp", pool = "256MiB";
  size_t segment = 16 << 20;
  double factor = 3;
  int reps = 3, sessions = 1;
  bool quick = false;
  app.add_option("--dir", dir, "Spill directory (and dd's) (default /var/tmp)");
  app.add_option("--pool", pool, "Pool of the daemon (default 256MiB)");
  app.add_option("--segment", segment, "Segment size (default 16MiB)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--factor", factor, "Bytes stored, in pools (default 3)");
  app.add_option("--reps", reps, "Repetitions; medians reported (default 3)");
  app.add_flag("--quick", quick, "Smoke run: a 32 MiB pool, one repetition");
  app.add_option("--sessions", sessions, "Clients storing and fetching at once (default 1)")
      ->check(CLI::Range(1, 64));
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    pool = "32MiB";
    segment = 4 << 20;
    reps = 1;
  }
  std::vector<Round> rounds;
  for (int r = 0; r < reps; ++r) rounds.push_back(RunOnce(dir, pool, segment, factor, sessions));
  auto median = [&](double Round::*field) {
    std::vector<double> v;
    for (const Round& round : rounds) v.push_back(round.*field);
    return Median(v);
  };
  struct stat st {};
  stat(dir.c_str(), &st);
  std::printf(
      "spill_bench: pool %s, segments of %s, %.1fx the pool stored, spill dir %s "
      "(device %u:%u), %d repetitions (medians)\n",
      pool.c_str(), SizeName(segment).c_str(), factor, dir.c_str(), major(st.st_dev),
      minor(st.st_dev), reps);
  std::printf("  spilled %.0f MiB, read back %.0f MiB per repetition\n",
              rounds.back().spilled / 1048576.0, rounds.back().restored / 1048576.0);
  const double dw = median(&Round::dd_write), dr = median(&Round::dd_read);
  const double sw = median(&Round::spill_write), sr = median(&Round::spill_read);
  if (sessions > 1) {
    // dd's time for the same bytes, written then read: the baseline of one figure.
    const double written = rounds.back().spilled, read = rounds.back().restored;
    const double dd_both = (written + read) / (written / dw + read / dr);
    std::printf("  %-34s %10.0f MB/s\n", "dd write (oflag=direct, fsync)", dw / 1e6);
    std::printf("  %-34s %10.0f MB/s\n", "dd read (iflag=direct)", dr / 1e6);
    std::printf("  %-34s %10.0f MB/s\n", "dd, those bytes written then read", dd_both / 1e6);
    std::printf(
        "  %d sessions at once: spill write + read-back %.0f MB/s over the wall time "
        "(%.2f s)   %.2fx dd\n",
        sessions, sw / 1e6, median(&Round::store_seconds), sw / dd_both);
    return 0;
  }
  std::printf("  %-34s %10.0f MB/s\n", "dd write (oflag=direct, fsync)", dw / 1e6);
  std::printf("  %-34s %10.0f MB/s   %.2fx dd\n", "spill write (as the trainer waits)", sw / 1e6,
              sw / dw);
  std::printf("  %-34s %10.0f MB/s\n", "dd read (iflag=direct)", dr / 1e6);
  std::printf("  %-34s %10.0f MB/s   %.2fx dd\n", "restore read (daemon, verified)", sr / 1e6,
              sr / dr);
  std::printf(
      "  store phase %.2f s, fetch phase %.2f s (restore waits %.2f s; %.0f%% of restores "
      "read back ahead of the fetch)\n",
      median(&Round::store_seconds), median(&Round::fetch_seconds), median(&Round::restore_wait),
      100 * median(&Round::ahead_fraction));
  return 0;
}
