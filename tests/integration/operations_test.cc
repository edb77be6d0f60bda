// Operations against a real actstashd: Prometheus metrics scraped over HTTP,
// the TCP listener (plaintext on loopback, refusal elsewhere, TLS, mutual
// TLS), and the CLI's sessions/bench/verify commands.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "common/unique_fd.h"
#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;

// The first number the daemon logged after `marker`, e.g. "(port 43233)".
int LoggedPort(const DaemonProcess& daemon, const std::string& marker) {
  const std::string log = daemon.log();
  std::smatch match;
  const std::regex pattern(marker + R"([^\n]*\(port (\d+)\))");
  return std::regex_search(log, match, pattern) ? std::stoi(match[1]) : 0;
}

std::string HttpGet(int port, const std::string& path) {
  const UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return "";
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!write(fd.get(), request.data(), request.size());
  std::string response;
  char buffer[8192];
  ssize_t n = 0;
  while ((n = read(fd.get(), buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  return response;
}

// Metric lines "name{labels} value" into a map.
std::map<std::string, double> Scrape(int port) {
  std::map<std::string, double> metrics;
  std::istringstream body(HttpGet(port, "/metrics"));
  std::string line;
  while (std::getline(body, line)) {
    if (line.empty() || line[0] == '#' || line.find("actstash_") != 0) continue;
    const size_t space = line.rfind(' ');
    metrics[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return metrics;
}

TEST(OperationsTest, MetricsAreScrapedAndMove) {
  DaemonProcessOptions options;
  options.extra_args = {"--metrics-address", "127.0.0.1:0"};
  auto daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  const int port = LoggedPort(*daemon, "metrics on");
  ASSERT_GT(port, 0) << daemon->log();
  std::map<std::string, double> before = Scrape(port);
  EXPECT_EQ(before["actstash_pool_bytes{state=\"total\"}"], 256.0 * (1 << 20));
  EXPECT_EQ(before["actstash_stored_bytes_total"], 0);

  auto client = ConnectOrDie(*daemon, 0, "metrics");
  ASSERT_NE(client, nullptr);
  const std::vector<std::byte> data = RandomBytes(3 << 20, 1);
  absl::StatusOr<Handle> handle = client->Put(data.data(), data.size());
  ASSERT_TRUE(handle.ok());
  ASSERT_TRUE(client->Get(*handle).ok());
  EXPECT_EQ(client->Get(Handle{424242}).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<Ticket> ticket = client->Store(data.data(), data.size());  // zero-copy
  ASSERT_TRUE(ticket.ok());

  std::map<std::string, double> after = Scrape(port);
  EXPECT_EQ(after["actstash_stored_bytes_total"], 3.0 * (1 << 20));
  EXPECT_EQ(after["actstash_fetched_bytes_total"], 3.0 * (1 << 20));
  EXPECT_EQ(after["actstash_objects"], 1);
  EXPECT_EQ(after["actstash_sessions{attached=\"true\"}"], 1);
  EXPECT_GE(after["actstash_pool_bytes{state=\"leased\"}"], 16.0 * (1 << 20));
  EXPECT_GE(after["actstash_leases_granted_total"], 1);
  EXPECT_EQ(after["actstash_rpc_duration_seconds_count{method=\"actstash.v1.Stash/Put\"}"], 1);
  EXPECT_EQ(after["actstash_rpc_errors_total{code=\"NOT_FOUND\",method=\"actstash.v1.Stash/Get\"}"],
            1);
  EXPECT_GT(after["actstash_pool_bytes{state=\"used\"}"], 0);
  EXPECT_EQ(after["actstash_optimizer_state_bytes"], 0);

  // Long-lived state (an optimizer's) is counted apart from activations, by
  // the client and, once reported, by the daemon; releasing it uncounts it.
  absl::StatusOr<Reservation> state = client->ReserveState(5 << 20);
  ASSERT_TRUE(state.ok()) << state.status();
  absl::StatusOr<Reservation> activation = client->Reserve(2 << 20);
  ASSERT_TRUE(activation.ok()) << activation.status();
  EXPECT_EQ(client->zero_copy_usage().state_bytes(), 5u << 20);
  ASSERT_TRUE(client->Stats().ok());  // reports the client's usage
  EXPECT_EQ(Scrape(port)["actstash_optimizer_state_bytes"], 5.0 * (1 << 20));
  ASSERT_TRUE(client->ReleaseState(state->ticket).ok());
  EXPECT_EQ(client->ReleaseState(state->ticket).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client->zero_copy_usage().state_bytes(), 0u) << "a failed release uncounts nothing";
  ASSERT_TRUE(client->Stats().ok());
  EXPECT_EQ(Scrape(port)["actstash_optimizer_state_bytes"], 0);
}

// The CLI's stdout (and stderr) for `args`; its exit code must be `exit_code`.
std::string RunCli(const std::vector<std::string>& args, int exit_code = 0) {
  std::string command = Cli();
  for (const std::string& arg : args) command += " '" + arg + "'";
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  std::string output;
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  EXPECT_EQ(WEXITSTATUS(pclose(pipe)), exit_code) << output;
  return output;
}

// `actstash verify` stores more than the pool: the oldest objects go to disk
// (the daemon's spill counters and /metrics say so) and every byte comes back.
TEST(OperationsTest, CliVerifyGoesThroughTheSpillTier) {
  char spill_dir[] = "/tmp/actstash-verify-XXXXXX";
  ASSERT_NE(mkdtemp(spill_dir), nullptr);
  DaemonProcessOptions options;
  options.pool_size = "32MiB";
  options.segment_size = "4MiB";
  options.extra_args = {"--metrics-address", "127.0.0.1:0", "--spill-dir", spill_dir};
  auto daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  const int port = LoggedPort(*daemon, "metrics on");
  ASSERT_GT(port, 0) << daemon->log();
  for (const char* path : {"inline", "zero-copy"}) {
    std::vector<std::string> args = {"--address", daemon->address(), "verify", "--bytes",
                                     "96MiB",     "--object-size",   "4MiB",   "--require-spill"};
    if (std::string(path) == "zero-copy") args.push_back("--zero-copy");
    const std::string out = RunCli(args);
    EXPECT_THAT(out, HasSubstr(std::string(path == std::string("inline") ? "inline gRPC" : path) +
                               " path"));
    EXPECT_THAT(out, HasSubstr("every byte came back"));
    EXPECT_THAT(out, ::testing::Not(HasSubstr("spill tier: 0 B written")));
  }
  std::map<std::string, double> metrics = Scrape(port);
  EXPECT_GE(metrics["actstash_spill_io_bytes_total{direction=\"write\"}"], 64.0 * (1 << 20));
  EXPECT_GE(metrics["actstash_spill_io_bytes_total{direction=\"read\"}"], 64.0 * (1 << 20));
  EXPECT_EQ(metrics["actstash_spill_failures_total{kind=\"checksum\"}"], 0);
  // Less than the pool spills nothing, and --require-spill says so.
  EXPECT_THAT(RunCli({"--address", daemon->address(), "verify", "--bytes", "8MiB", "--object-size",
                      "1MiB", "--require-spill"},
                     /*exit_code=*/1),
              HasSubstr("nothing went to disk and back"));
  EXPECT_THAT(RunCli({"--address", daemon->address(), "verify", "--object-size", "7"},
                     /*exit_code=*/2),
              HasSubstr("multiple of 8"));
  daemon.reset();
  rmdir(spill_dir);
}

// Without --spill-dir, verify still checks every byte; --require-spill fails.
TEST(OperationsTest, CliVerifyWithoutSpillTier) {
  auto daemon = StartDaemonOrDie({});
  ASSERT_NE(daemon, nullptr);
  EXPECT_THAT(RunCli({"--address", daemon->address(), "verify", "--bytes", "16MiB"}),
              HasSubstr("spill tier: off"));
  EXPECT_THAT(
      RunCli({"--address", daemon->address(), "verify", "--bytes", "16MiB", "--require-spill"},
             /*exit_code=*/1),
      HasSubstr("no spill tier"));
}

TEST(OperationsTest, SpillMetricsAndCliStats) {
  char spill_dir[] = "/tmp/actstash-spill-ops-XXXXXX";
  ASSERT_NE(mkdtemp(spill_dir), nullptr);
  DaemonProcessOptions options;
  options.pool_size = "32MiB";
  options.segment_size = "4MiB";
  options.extra_args = {"--metrics-address", "127.0.0.1:0", "--spill-dir", spill_dir};
  auto daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  const int port = LoggedPort(*daemon, "metrics on");
  ASSERT_GT(port, 0) << daemon->log();
  auto client = ConnectOrDie(*daemon, 0, "spiller");
  ASSERT_NE(client, nullptr);
  const std::vector<std::byte> data = RandomBytes(3 << 20, 2);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 32; ++i) {  // 96 MiB through a 32 MiB pool
    absl::StatusOr<Ticket> ticket = client->Store(data.data(), data.size());
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    tickets.push_back(*ticket);
  }
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(client->Fetch(tickets.front(), back.data(), back.size()).ok());
  ASSERT_TRUE(client->Stats().ok());  // reports the client's waits
  std::map<std::string, double> metrics = Scrape(port);
  EXPECT_GE(metrics["actstash_spill_io_bytes_total{direction=\"write\"}"], 48.0 * (1 << 20));
  EXPECT_GT(metrics["actstash_spill_io_bytes_total{direction=\"read\"}"], 0);
  EXPECT_GT(metrics["actstash_spill_bytes{state=\"on_disk\"}"], 0);
  EXPECT_GT(metrics["actstash_spill_io_seconds_total{direction=\"write\"}"], 0);
  EXPECT_EQ(metrics["actstash_spill_failures_total{kind=\"checksum\"}"], 0);
  EXPECT_GT(metrics["actstash_spill_wait_seconds{op=\"spill\"}"], 0);
  EXPECT_EQ(metrics.count("actstash_reclaims{state=\"asked\"}"), 1u);  // one session: none asked
  EXPECT_EQ(metrics["actstash_reclaim_bytes{state=\"given\"}"], 0);

  const std::string table = RunCli({"--address", daemon->address(), "stats"});
  EXPECT_THAT(table, HasSubstr("spill "));
  EXPECT_THAT(table, HasSubstr(spill_dir));
  // Who holds what, how long idle, what was asked back for sessions that waited.
  EXPECT_THAT(table, HasSubstr("LEASED"));
  EXPECT_THAT(table, HasSubstr("IDLE"));
  EXPECT_THAT(table, HasSubstr("ASKED BACK"));
  const std::string json = RunCli({"--address", daemon->address(), "stats", "--json"});
  const v1::StatsReply parsed = ParseStatsJson(json);
  ASSERT_TRUE(parsed.has_spill()) << json;
  EXPECT_EQ(parsed.spill().dir(), spill_dir);
  EXPECT_GT(parsed.spill().bytes_written(), 0u);
  ASSERT_GE(parsed.all_sessions_size(), 1) << json;
  uint64_t spilled = 0;
  for (const v1::SessionStats& session : parsed.all_sessions()) {
    spilled += session.spill().spilled_bytes();
  }
  EXPECT_EQ(spilled, parsed.spill().bytes_written()) << "every spill is some session's";
  client.reset();
  daemon.reset();
  rmdir(spill_dir);
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class TcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/actstash-certs-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    certs_ = dir;
    ASSERT_EQ(std::system((std::string(ACTSTASH_CERT_SCRIPT) + " " + certs_).c_str()), 0);
  }
  void TearDown() override { std::system(("rm -rf " + certs_).c_str()); }

  std::unique_ptr<DaemonProcess> Start(std::vector<std::string> args) {
    DaemonProcessOptions options;
    options.extra_args = std::move(args);
    auto daemon = StartDaemonOrDie(options);
    if (daemon != nullptr) port_ = LoggedPort(*daemon, "also listening on TCP");
    return daemon;
  }
  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& ca, const std::string& cert,
                                                  const std::string& key) {
    ClientOptions options;
    options.address = "127.0.0.1:" + std::to_string(port_);
    options.connect_timeout = std::chrono::seconds(3);
    if (!ca.empty()) options.tls_root_certs = Read(certs_ + "/" + ca);
    if (!cert.empty()) options.tls_cert_chain = Read(certs_ + "/" + cert);
    if (!key.empty()) options.tls_private_key = Read(certs_ + "/" + key);
    return Client::Connect(options);
  }
  static void RoundTrip(Client& client) {
    const std::vector<std::byte> data = RandomBytes(2 << 20, 7);
    absl::StatusOr<Ticket> ticket = client.Store(data.data(), data.size());
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    std::vector<std::byte> back(data.size());
    ASSERT_TRUE(client.Fetch(*ticket, back.data(), back.size()).ok());
    EXPECT_TRUE(back == data);
  }

  std::string certs_;
  int port_ = 0;
};

TEST_F(TcpTest, PlaintextOnLoopbackWorksWithoutZeroCopy) {
  auto daemon = Start({"--listen-tcp", "127.0.0.1:0"});
  ASSERT_NE(daemon, nullptr);
  ASSERT_GT(port_, 0) << daemon->log();
  auto client = Connect("", "", "");
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE((*client)->attached()) << "a TCP client cannot map the daemon's memory";
  RoundTrip(**client);
}

TEST_F(TcpTest, NonLoopbackWithoutTlsRefusesToStartUnlessInsecure) {
  DaemonProcessOptions options;
  options.extra_args = {"--listen-tcp", "0.0.0.0:0"};
  absl::StatusOr<std::unique_ptr<DaemonProcess>> refused = DaemonProcess::Start(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("refusing to serve"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--insecure"));
  auto insecure = Start({"--listen-tcp", "0.0.0.0:0", "--insecure"});
  ASSERT_NE(insecure, nullptr);
  EXPECT_GT(port_, 0);
}

TEST_F(TcpTest, TlsWithTheTestCa) {
  auto daemon = Start({"--listen-tcp", "127.0.0.1:0", "--tls-cert", certs_ + "/server.pem",
                       "--tls-key", certs_ + "/server.key"});
  ASSERT_NE(daemon, nullptr);
  auto client = Connect("ca.pem", "", "");
  ASSERT_TRUE(client.ok()) << client.status();
  RoundTrip(**client);
  auto plaintext = Connect("", "", "");
  EXPECT_FALSE(plaintext.ok()) << "a plaintext client cannot talk to a TLS listener";
  auto wrong_ca = Connect("rogue-ca.pem", "", "");
  EXPECT_FALSE(wrong_ca.ok()) << "the daemon's certificate is not signed by that CA";
}

TEST_F(TcpTest, MutualTlsRejectsWrongAndMissingClientCertificates) {
  auto daemon = Start({"--listen-tcp", "127.0.0.1:0", "--tls-cert", certs_ + "/server.pem",
                       "--tls-key", certs_ + "/server.key", "--tls-client-ca", certs_ + "/ca.pem"});
  ASSERT_NE(daemon, nullptr);
  auto good = Connect("ca.pem", "client.pem", "client.key");
  ASSERT_TRUE(good.ok()) << good.status();
  RoundTrip(**good);
  auto rogue = Connect("ca.pem", "rogue.pem", "rogue.key");
  ASSERT_FALSE(rogue.ok());
  EXPECT_EQ(rogue.status().code(), absl::StatusCode::kUnavailable) << rogue.status();
  auto anonymous = Connect("ca.pem", "", "");
  EXPECT_FALSE(anonymous.ok());
  // The CLI speaks TLS too.
  const std::string cli =
      Cli() + " --address 127.0.0.1:" + std::to_string(port_) + " --tls-ca " + certs_ + "/ca.pem";
  EXPECT_EQ(WEXITSTATUS(std::system((cli + " --tls-cert " + certs_ + "/client.pem --tls-key " +
                                     certs_ + "/client.key ping > /dev/null")
                                        .c_str())),
            0);
  EXPECT_EQ(WEXITSTATUS(std::system((cli + " --timeout 2 ping > /dev/null 2>&1").c_str())), 1);
}

TEST(OperationsTest, CliSessionsAndBench) {
  DaemonProcessOptions options;
  options.segment_size = "16MiB";  // room for the holder's batch and the bench's
  auto daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  auto holder = ConnectOrDie(*daemon, 0, "holder");
  ASSERT_NE(holder, nullptr);
  const std::vector<std::byte> data = RandomBytes(1 << 20, 3);
  ASSERT_TRUE(holder->Store(data.data(), data.size()).ok());
  ASSERT_TRUE(holder->Stats().ok());  // reports its zero-copy usage now
  const std::string cli = Cli() + " --address " + daemon->address();
  auto run = [](const std::string& command, std::string* output) {
    FILE* pipe = popen((command + " 2>&1").c_str(), "r");
    char buffer[4096];
    size_t n = 0;
    while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output->append(buffer, n);
    return WEXITSTATUS(pclose(pipe));
  };
  std::string table, json, bench, usage, dead;
  EXPECT_EQ(run(cli + " sessions", &table), 0);
  EXPECT_THAT(table, HasSubstr("holder"));
  EXPECT_THAT(table, HasSubstr(std::to_string(getpid())));
  EXPECT_EQ(run(cli + " sessions --json", &json), 0);
  bool holder_listed = false;
  const v1::StatsReply sessions = ParseStatsJson(json, /*session_array=*/true);
  for (const v1::SessionStats& session : sessions.all_sessions()) {
    if (session.client_name() != "holder") continue;
    holder_listed = true;
    EXPECT_TRUE(session.attached());
    EXPECT_EQ(session.client().objects(), 1u) << "as the client reported it";
  }
  EXPECT_TRUE(holder_listed) << json;
  EXPECT_EQ(run(cli + " bench --sizes 1MiB --seconds 0.2", &bench), 0) << bench;
  EXPECT_THAT(bench, HasSubstr("zero-copy"));
  EXPECT_THAT(bench, HasSubstr("1.0 MiB"));
  EXPECT_EQ(run(cli + " bench --sizes 0", &usage), 2) << usage;
  ASSERT_TRUE(daemon->Stop().ok());
  EXPECT_EQ(run(cli + " --timeout 1 sessions", &dead), 1);
  EXPECT_THAT(dead, HasSubstr("not reachable"));
}

}  // namespace
}  // namespace actstash::testing
