// Unit tests of actstashd's configuration: flags over a TOML file over defaults.
#include "server/daemon/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/address.h"
#include "server/pool/memory_limits.h"
#include "server/restart/successor.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

// What percentages are of: physical memory, or this process's cgroup limit
// when lower (memory_limits_test covers how that is found).
uint64_t UsableMemory() { return ReadMemoryLimits().usable_bytes(); }

uint64_t RoundDown(uint64_t value, uint64_t multiple) { return value - value % multiple; }

// What ParseCommandLine returned and printed.
struct Parsed {
  CommandLine command_line;
  std::string out;
  std::string err;
};

// Runs ParseCommandLine on {"actstashd", args...}, capturing what it prints.
Parsed ParseArgs(const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"actstashd"};
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  argv.push_back(nullptr);
  Parsed parsed;
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  parsed.command_line = ParseCommandLine(static_cast<int>(argv.size() - 1), argv.data());
  parsed.err = testing::internal::GetCapturedStderr();
  parsed.out = testing::internal::GetCapturedStdout();
  return parsed;
}

Parsed Parse(std::initializer_list<std::string> args) { return ParseArgs(args); }

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/actstash-config-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    for (const std::string& file : files_) std::remove(file.c_str());
    rmdir(dir_.c_str());
  }

  std::string WriteToml(const std::string& contents) {
    const std::string path = absl::StrCat(dir_, "/config", files_.size(), ".toml");
    std::ofstream(path) << contents;
    files_.push_back(path);
    return path;
  }

  // Parses with a TOML file made of `contents` plus the extra flags.
  Parsed ParseWithToml(const std::string& contents, std::initializer_list<std::string> flags = {}) {
    std::vector<std::string> args = {"--config", WriteToml(contents)};
    args.insert(args.end(), flags.begin(), flags.end());
    return ParseArgs(args);
  }

  std::string dir_;
  std::vector<std::string> files_;
};

// Expects a usage error (exit code 2) whose message names `setting`.
void ExpectUsageError(const Parsed& parsed, const std::string& setting) {
  ASSERT_TRUE(parsed.command_line.exit_code.has_value()) << "accepted; stderr: " << parsed.err;
  EXPECT_EQ(*parsed.command_line.exit_code, 2) << parsed.err;
  EXPECT_NE(parsed.err.find(setting), std::string::npos)
      << "message does not name '" << setting << "': " << parsed.err;
}

TEST(DefaultPoolBytesTest, IsAQuarterOfMemoryCappedAt32GiB) {
  EXPECT_EQ(DefaultPoolBytes(), std::min(UsableMemory() / 4, 32 * kGiB));
  EXPECT_EQ(DefaultPoolBytes(8 * kGiB), 2 * kGiB);
  EXPECT_EQ(DefaultPoolBytes(512 * kGiB), 32 * kGiB);
  EXPECT_GT(DefaultPoolBytes(), 0u);
}

TEST_F(ConfigTest, Defaults) {
  const Parsed parsed = Parse({});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const DaemonConfig& config = parsed.command_line.config;
  EXPECT_EQ(config.socket_path, DefaultSocketPath());
  if (geteuid() == 0) {
    EXPECT_EQ(config.socket_path, "/run/actstash/actstash.sock");
  }
  EXPECT_EQ(config.socket_mode, 0660u);
  // The default pool, in whole default segments.
  EXPECT_EQ(config.pool_bytes, RoundDown(DefaultPoolBytes(), 64 * kMiB));
  EXPECT_EQ(config.segment_bytes, 64 * kMiB);
  EXPECT_EQ(config.max_session_quota, config.pool_bytes);
  EXPECT_EQ(config.default_session_quota, config.pool_bytes);
  EXPECT_EQ(config.max_sessions, 1024u);
  EXPECT_EQ(config.mlock, Tristate::kAuto);
  EXPECT_EQ(config.log_level, "info");
  EXPECT_DOUBLE_EQ(config.shutdown_grace_seconds, 5.0);
}

TEST_F(ConfigTest, EveryFlagIsParsed) {
  const Parsed parsed = Parse({"--socket",
                               "/tmp/x/actstash.sock",
                               "--socket-mode",
                               "0600",
                               "--pool-size",
                               "1GiB",
                               "--segment-size",
                               "4MiB",
                               "--max-session-quota",
                               "512MiB",
                               "--default-session-quota",
                               "128MiB",
                               "--max-sessions",
                               "7",
                               "--mlock",
                               "on",
                               "--log-level",
                               "debug",
                               "--shutdown-grace-seconds",
                               "2.5"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const DaemonConfig& config = parsed.command_line.config;
  EXPECT_EQ(config.socket_path, "/tmp/x/actstash.sock");
  EXPECT_EQ(config.socket_mode, 0600u);
  EXPECT_EQ(config.pool_bytes, kGiB);
  EXPECT_EQ(config.segment_bytes, 4 * kMiB);
  EXPECT_EQ(config.max_session_quota, 512 * kMiB);
  EXPECT_EQ(config.default_session_quota, 128 * kMiB);
  EXPECT_EQ(config.max_sessions, 7u);
  EXPECT_EQ(config.mlock, Tristate::kOn);
  EXPECT_EQ(config.log_level, "debug");
  EXPECT_DOUBLE_EQ(config.shutdown_grace_seconds, 2.5);
}

TEST_F(ConfigTest, FlagsAcceptEqualsForm) {
  const Parsed parsed = Parse({"--pool-size=2GiB", "--mlock=off", "--max-sessions=3"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.pool_bytes, 2 * kGiB);
  EXPECT_EQ(parsed.command_line.config.mlock, Tristate::kOff);
  EXPECT_EQ(parsed.command_line.config.max_sessions, 3u);
}

// A successor started on SIGUSR2 (server/restart/successor.h) gets the
// daemon's own arguments with --take-over, whatever the daemon's said, and
// they parse, the TOML file's take_over overridden.
TEST_F(ConfigTest, ASuccessorsArgumentsTakeOver) {
  const std::string toml = WriteToml("take_over = \"off\"\n");
  for (const std::vector<std::string>& daemon_args : std::vector<std::vector<std::string>>{
           {"--pool-size", "1GiB", "--config", toml},
           {"--take-over", "auto", "--pool-size", "1GiB", "--config", toml},
           {"--take-over=auto", "--pool-size", "1GiB", "--handed-over", "--config", toml},
           {"--take-over", "--pool-size", "1GiB", "--config", toml}}) {
    std::vector<char*> argv = {const_cast<char*>("actstashd")};
    for (const std::string& arg : daemon_args) argv.push_back(const_cast<char*>(arg.c_str()));
    const std::vector<std::string> successor =
        SuccessorArguments(static_cast<int>(argv.size()), argv.data());
    EXPECT_EQ(successor, (std::vector<std::string>{"actstashd", "--pool-size", "1GiB", "--config",
                                                   toml, "--take-over=on"}))
        << daemon_args[0];
    const Parsed parsed = ParseArgs({successor.begin() + 1, successor.end()});
    ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
    EXPECT_EQ(parsed.command_line.config.take_over, Tristate::kOn);
    EXPECT_EQ(parsed.command_line.config.pool_bytes, kGiB);
  }
}

TEST_F(ConfigTest, Tristates) {
  EXPECT_EQ(Parse({"--mlock", "auto"}).command_line.config.mlock, Tristate::kAuto);
  EXPECT_EQ(Parse({"--mlock", "on"}).command_line.config.mlock, Tristate::kOn);
  EXPECT_EQ(Parse({"--mlock", "off"}).command_line.config.mlock, Tristate::kOff);
}

TEST_F(ConfigTest, PoolSizePercentageIsOfUsableMemory) {
  const Parsed parsed = Parse({"--pool-size", "10%"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const uint64_t pool = parsed.command_line.config.pool_bytes;
  const uint64_t tenth = UsableMemory() / 10;
  // 10% of memory, in whole 64 MiB segments (the percentage is computed in
  // floating point, hence the few bytes of slack).
  EXPECT_EQ(pool % (64 * kMiB), 0u);
  EXPECT_LE(pool, tenth + 16);
  EXPECT_GT(pool + 64 * kMiB + 16, tenth);
  // Quotas follow the pool.
  EXPECT_EQ(parsed.command_line.config.max_session_quota, parsed.command_line.config.pool_bytes);
}

TEST_F(ConfigTest, QuotaPercentagesAreOfThePool) {
  const Parsed parsed = Parse({"--pool-size", "1GiB", "--max-session-quota", "50%"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.max_session_quota, 512 * kMiB);
  // The default quota follows the max when not given.
  EXPECT_EQ(parsed.command_line.config.default_session_quota, 512 * kMiB);

  const Parsed both = Parse(
      {"--pool-size", "1GiB", "--max-session-quota", "50%", "--default-session-quota", "25%"});
  ASSERT_FALSE(both.command_line.exit_code.has_value()) << both.err;
  EXPECT_EQ(both.command_line.config.default_session_quota, 256 * kMiB);

  // Percentages apply to the configured pool whatever the flag order.
  const Parsed reordered = Parse({"--max-session-quota", "25%", "--pool-size", "4GiB"});
  ASSERT_FALSE(reordered.command_line.exit_code.has_value()) << reordered.err;
  EXPECT_EQ(reordered.command_line.config.max_session_quota, kGiB);
}

TEST_F(ConfigTest, DefaultSessionQuotaIsCappedAtMax) {
  const Parsed parsed = Parse({"--pool-size", "1GiB", "--max-session-quota", "100MiB",
                               "--default-session-quota", "200MiB"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.max_session_quota, 100 * kMiB);
  EXPECT_EQ(parsed.command_line.config.default_session_quota, 100 * kMiB);
}

TEST_F(ConfigTest, PoolIsWholeSegmentsAndQuotasAreOfThatPool) {
  const Parsed parsed =
      Parse({"--pool-size", "1000MiB", "--segment-size", "64MiB", "--max-session-quota", "50%"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.pool_bytes, 960 * kMiB);
  EXPECT_EQ(parsed.command_line.config.max_session_quota, 480 * kMiB);
  EXPECT_EQ(parsed.command_line.config.default_session_quota, 480 * kMiB);

  const Parsed exact = Parse({"--pool-size", "96MiB", "--segment-size", "32MiB"});
  ASSERT_FALSE(exact.command_line.exit_code.has_value()) << exact.err;
  EXPECT_EQ(exact.command_line.config.pool_bytes, 96 * kMiB);
  EXPECT_EQ(exact.command_line.config.max_session_quota, 96 * kMiB);
}

TEST_F(ConfigTest, TomlFileSetsEverySetting) {
  const Parsed parsed = ParseWithToml(R"(
socket = "/tmp/from-file/actstash.sock"
socket_mode = "0640"
pool_size = 1073741824
segment_size = "2MiB"
max_session_quota = "50%"
default_session_quota = 67108864
max_sessions = 16
mlock = "off"
log_level = "warn"
shutdown_grace_seconds = 1.5
)");
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const DaemonConfig& config = parsed.command_line.config;
  EXPECT_EQ(config.socket_path, "/tmp/from-file/actstash.sock");
  EXPECT_EQ(config.socket_mode, 0640u);
  EXPECT_EQ(config.pool_bytes, kGiB);
  EXPECT_EQ(config.segment_bytes, 2 * kMiB);
  EXPECT_EQ(config.max_session_quota, 512 * kMiB);
  EXPECT_EQ(config.default_session_quota, 64 * kMiB);
  EXPECT_EQ(config.max_sessions, 16u);
  EXPECT_EQ(config.mlock, Tristate::kOff);
  EXPECT_EQ(config.log_level, "warn");
  EXPECT_DOUBLE_EQ(config.shutdown_grace_seconds, 1.5);
}

TEST_F(ConfigTest, TomlStringSizesWithUnitsAndPercent) {
  const Parsed parsed = ParseWithToml(R"(
pool_size = "1.5GiB"
segment_size = "1M"
max_session_quota = "25%"
)");
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.pool_bytes, 3 * kGiB / 2);
  EXPECT_EQ(parsed.command_line.config.segment_bytes, kMiB);
  EXPECT_EQ(parsed.command_line.config.max_session_quota, 3 * kGiB / 8);
}

TEST_F(ConfigTest, ShortConfigFlag) {
  const std::string path = WriteToml("max_sessions = 9\n");
  const Parsed parsed = Parse({"-c", path});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.max_sessions, 9u);
}

TEST_F(ConfigTest, EmptyTomlFileGivesDefaults) {
  const Parsed parsed = ParseWithToml("# nothing\n");
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.pool_bytes, RoundDown(DefaultPoolBytes(), 64 * kMiB));
  EXPECT_EQ(parsed.command_line.config.max_session_quota, parsed.command_line.config.pool_bytes);
  EXPECT_EQ(parsed.command_line.config.max_sessions, 1024u);
}

TEST_F(ConfigTest, FlagsOverrideTheFile) {
  const Parsed parsed = ParseWithToml(R"(
pool_size = "1GiB"
max_session_quota = "50%"
mlock = "off"
max_sessions = 16
)",
                                      {"--pool-size", "2GiB", "--max-sessions", "4"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const DaemonConfig& config = parsed.command_line.config;
  EXPECT_EQ(config.pool_bytes, 2 * kGiB);
  EXPECT_EQ(config.max_sessions, 4u);
  // Untouched file settings stay, and resolve against the overriding pool.
  EXPECT_EQ(config.mlock, Tristate::kOff);
  EXPECT_EQ(config.max_session_quota, kGiB);
}

TEST_F(ConfigTest, UnknownTomlKeyIsUsageError) {
  ExpectUsageError(ParseWithToml("pool_size = \"1GiB\"\npool_sise = \"2GiB\"\n"), "pool_sise");
  // Flag spellings are not TOML keys.
  ExpectUsageError(ParseWithToml("pool-size = \"1GiB\"\n"), "pool-size");
}

TEST_F(ConfigTest, MalformedTomlIsUsageError) {
  const Parsed parsed = ParseWithToml("pool_size = \n");
  ASSERT_TRUE(parsed.command_line.exit_code.has_value());
  EXPECT_EQ(*parsed.command_line.exit_code, 2) << parsed.err;
}

TEST_F(ConfigTest, BadTomlValuesAreUsageErrors) {
  ExpectUsageError(ParseWithToml("mlock = \"maybe\"\n"), "mlock");
  ExpectUsageError(ParseWithToml("socket = \"relative/actstash.sock\"\n"), "socket");
  ExpectUsageError(ParseWithToml("socket_mode = \"0999\"\n"), "socket_mode");
  ExpectUsageError(ParseWithToml("max_sessions = 0\n"), "max_sessions");
  ExpectUsageError(ParseWithToml("pool_size = -5\n"), "pool_size");
  ExpectUsageError(ParseWithToml("pool_size = \"lots\"\n"), "pool_size");
  ExpectUsageError(ParseWithToml("segment_size = \"-1MiB\"\n"), "segment_size");
  ExpectUsageError(ParseWithToml("log_level = \"loud\"\n"), "log_level");
  ExpectUsageError(ParseWithToml("mlock = true\n"), "mlock");
  ExpectUsageError(ParseWithToml("max_sessions = [1, 2]\n"), "max_sessions");
}

TEST_F(ConfigTest, BadFlagValuesAreUsageErrors) {
  ExpectUsageError(Parse({"--mlock", "maybe"}), "mlock");
  ExpectUsageError(Parse({"--socket", "relative/actstash.sock"}), "socket");
  ExpectUsageError(Parse({"--socket", ""}), "socket");
  ExpectUsageError(Parse({"--socket-mode", "0999"}), "socket_mode");
  ExpectUsageError(Parse({"--socket-mode", "01000"}), "socket_mode");
  ExpectUsageError(Parse({"--socket-mode", "rw"}), "socket_mode");
  ExpectUsageError(Parse({"--max-sessions", "0"}), "max_sessions");
  ExpectUsageError(Parse({"--max-sessions", "-3"}), "max_sessions");
  ExpectUsageError(Parse({"--max-sessions", "many"}), "max_sessions");
  ExpectUsageError(Parse({"--pool-size", "-1GiB"}), "pool_size");
  ExpectUsageError(Parse({"--pool-size", "garbage"}), "pool_size");
  ExpectUsageError(Parse({"--pool-size", "150%"}), "pool_size");
  ExpectUsageError(Parse({"--pool-size", "20000000TiB"}), "pool_size");
  ExpectUsageError(Parse({"--segment-size", "10%"}), "segment_size");  // no base for segments
  ExpectUsageError(Parse({"--segment-size", "4 parsecs"}), "segment_size");
  ExpectUsageError(Parse({"--max-session-quota", "-1"}), "max_session_quota");
  ExpectUsageError(Parse({"--default-session-quota", "x"}), "default_session_quota");
  ExpectUsageError(Parse({"--log-level", "verbose"}), "log_level");
  ExpectUsageError(Parse({"--shutdown-grace-seconds", "-1"}), "shutdown_grace_seconds");
  ExpectUsageError(Parse({"--shutdown-grace-seconds", "soon"}), "shutdown_grace_seconds");
  ExpectUsageError(Parse({"--copy-bandwidth", "fast"}), "copy_bandwidth");
  ExpectUsageError(Parse({"--copy-bandwidth", "0GB/s"}), "copy_bandwidth");
  ExpectUsageError(Parse({"--numa", "near"}), "numa");
}

TEST_F(ConfigTest, NumaDefaultsToAutoAndTakesANode) {
  EXPECT_EQ(Parse({}).command_line.config.numa.mode, NumaSetting::Mode::kAuto);
  const Parsed node = Parse({"--numa", "1"});
  ASSERT_FALSE(node.command_line.exit_code.has_value()) << node.err;
  EXPECT_EQ(node.command_line.config.numa.mode, NumaSetting::Mode::kNode);
  EXPECT_EQ(node.command_line.config.numa.node, 1);
  EXPECT_EQ(Parse({"--numa", "interleave"}).command_line.config.numa.mode,
            NumaSetting::Mode::kInterleave);
}

TEST_F(ConfigTest, CopyBandwidthDefaultsToAutoAndTakesARate) {
  EXPECT_EQ(Parse({}).command_line.config.copy_bandwidth.mode, CopyBandwidthSetting::Mode::kAuto);
  const Parsed parsed = Parse({"--copy-bandwidth", "150GB/s"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.copy_bandwidth.mode, CopyBandwidthSetting::Mode::kFixed);
  EXPECT_EQ(parsed.command_line.config.copy_bandwidth.bytes_per_second, 150e9);
  EXPECT_EQ(Parse({"--copy-bandwidth", "off"}).command_line.config.copy_bandwidth.mode,
            CopyBandwidthSetting::Mode::kOff);
}

TEST_F(ConfigTest, HelpAndVersionExitZero) {
  const Parsed help = Parse({"--help"});
  ASSERT_TRUE(help.command_line.exit_code.has_value());
  EXPECT_EQ(*help.command_line.exit_code, 0);
  EXPECT_NE(help.out.find("--pool-size"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("--config"), std::string::npos) << help.out;

  const Parsed version = Parse({"--version"});
  ASSERT_TRUE(version.command_line.exit_code.has_value());
  EXPECT_EQ(*version.command_line.exit_code, 0);
}

// Errors CLI11 itself finds are usage errors too.
TEST_F(ConfigTest, UnknownFlagAndMissingConfigFileExitTwo) {
  const Parsed unknown = Parse({"--pool-sise", "1GiB"});
  ASSERT_TRUE(unknown.command_line.exit_code.has_value());
  EXPECT_EQ(*unknown.command_line.exit_code, 2);

  const Parsed missing = Parse({"--config", dir_ + "/does-not-exist.toml"});
  ASSERT_TRUE(missing.command_line.exit_code.has_value());
  EXPECT_EQ(*missing.command_line.exit_code, 2);
}

// A TOML integer socket_mode is octal: 0o640 means 0640; a decimal 640 reads
// as 01200 and is refused rather than silently becoming another mode.
TEST_F(ConfigTest, TomlIntegerSocketModeIsOctal) {
  const Parsed octal = ParseWithToml("socket_mode = 0o640\n");
  ASSERT_FALSE(octal.command_line.exit_code.has_value()) << octal.err;
  EXPECT_EQ(octal.command_line.config.socket_mode, 0640u);
  const Parsed decimal = ParseWithToml("socket_mode = 640\n");
  ASSERT_TRUE(decimal.command_line.exit_code.has_value());
  EXPECT_EQ(*decimal.command_line.exit_code, 2);
}

TEST_F(ConfigTest, SocketPathsTooLongForTheAttachSocketAreUsageErrors) {
  const std::string longest = "/" + std::string(100, 's') + ".sock";  // 106 bytes
  const Parsed parsed = ParseArgs({"--socket", longest});
  ASSERT_TRUE(parsed.command_line.exit_code.has_value());
  EXPECT_EQ(*parsed.command_line.exit_code, 2);
  EXPECT_NE(parsed.err.find("attach socket"), std::string::npos) << parsed.err;
  const Parsed fits = ParseArgs({"--socket", "/" + std::string(93, 's') + ".sock"});
  EXPECT_FALSE(fits.command_line.exit_code.has_value()) << fits.err;
}

TEST_F(ConfigTest, TcpAndTlsSettings) {
  // Loopback plaintext is fine; elsewhere it needs TLS or an explicit insecure.
  EXPECT_FALSE(ParseArgs({"--listen-tcp", "127.0.0.1:7000"}).command_line.exit_code.has_value());
  EXPECT_FALSE(ParseArgs({"--listen-tcp", "[::1]:7000"}).command_line.exit_code.has_value());
  const Parsed open = ParseArgs({"--listen-tcp", "0.0.0.0:7000"});
  ASSERT_TRUE(open.command_line.exit_code.has_value());
  EXPECT_EQ(*open.command_line.exit_code, 2);
  EXPECT_NE(open.err.find("refusing"), std::string::npos) << open.err;
  const Parsed insecure = ParseArgs({"--listen-tcp", "0.0.0.0:7000", "--insecure"});
  ASSERT_FALSE(insecure.command_line.exit_code.has_value()) << insecure.err;
  EXPECT_TRUE(insecure.command_line.config.insecure);
  const Parsed tls = ParseArgs({"--listen-tcp", "10.0.0.1:7000", "--tls-cert", "c.pem", "--tls-key",
                                "k.pem", "--tls-client-ca", "ca.pem"});
  ASSERT_FALSE(tls.command_line.exit_code.has_value()) << tls.err;
  EXPECT_EQ(tls.command_line.config.tls_client_ca, "ca.pem");
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--listen-tcp", "nocolon"},
        std::vector<std::string>{"--listen-tcp", "127.0.0.1:99999"},
        std::vector<std::string>{"--listen-tcp", "127.0.0.1:1", "--tls-cert", "c.pem"},
        std::vector<std::string>{"--tls-cert", "c.pem", "--tls-key", "k.pem"}}) {
    const Parsed parsed = ParseArgs(bad);
    ASSERT_TRUE(parsed.command_line.exit_code.has_value()) << bad[1];
    EXPECT_EQ(*parsed.command_line.exit_code, 2);
  }
  const Parsed toml = ParseWithToml(
      "listen_tcp = \"0.0.0.0:7000\"\ninsecure = true\nmetrics_address = \"127.0.0.1:9464\"\n");
  ASSERT_FALSE(toml.command_line.exit_code.has_value()) << toml.err;
  EXPECT_TRUE(toml.command_line.config.insecure);
  EXPECT_EQ(toml.command_line.config.metrics_address, "127.0.0.1:9464");
}

TEST_F(ConfigTest, ExitWithParentIsABooleanFlagAndKey) {
  EXPECT_FALSE(ParseArgs({}).command_line.config.exit_with_parent);
  const Parsed flag = ParseArgs({"--exit-with-parent"});
  ASSERT_FALSE(flag.command_line.exit_code.has_value()) << flag.err;
  EXPECT_TRUE(flag.command_line.config.exit_with_parent);
  const Parsed toml = ParseWithToml("exit_with_parent = true\n");
  ASSERT_FALSE(toml.command_line.exit_code.has_value()) << toml.err;
  EXPECT_TRUE(toml.command_line.config.exit_with_parent);
  const Parsed bad = ParseWithToml("exit_with_parent = \"sometimes\"\n");
  ASSERT_TRUE(bad.command_line.exit_code.has_value());
  EXPECT_EQ(*bad.command_line.exit_code, 2);
  EXPECT_NE(bad.err.find("exit_with_parent: 'sometimes' is not true/false"), std::string::npos)
      << bad.err;
}

TEST_F(ConfigTest, ExitWhenUnusedIsSecondsOffByDefault) {
  EXPECT_EQ(ParseArgs({}).command_line.config.exit_when_unused_seconds, 0);
  const Parsed flag = ParseArgs({"--exit-when-unused-seconds", "30"});
  ASSERT_FALSE(flag.command_line.exit_code.has_value()) << flag.err;
  EXPECT_EQ(flag.command_line.config.exit_when_unused_seconds, 30);
  const Parsed toml = ParseWithToml("exit_when_unused_seconds = 2.5\n");
  ASSERT_FALSE(toml.command_line.exit_code.has_value()) << toml.err;
  EXPECT_EQ(toml.command_line.config.exit_when_unused_seconds, 2.5);
  const Parsed bad = ParseArgs({"--exit-when-unused-seconds", "-1"});
  ASSERT_TRUE(bad.command_line.exit_code.has_value());
  EXPECT_EQ(*bad.command_line.exit_code, 2);
  EXPECT_NE(bad.err.find("exit_when_unused_seconds: '-1' is not a number of seconds"),
            std::string::npos)
      << bad.err;
}

TEST_F(ConfigTest, SizesThatCannotWorkAreUsageErrors) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--pool-size", "10MiB"},
        std::vector<std::string>{"--segment-size", "0"},
        std::vector<std::string>{"--segment-size", "1000"},
        std::vector<std::string>{"--pool-size", "1GiB", "--segment-size", "2GiB"}}) {
    const Parsed parsed = ParseArgs(args);
    ASSERT_TRUE(parsed.command_line.exit_code.has_value()) << args[0] << " " << args[1];
    EXPECT_EQ(*parsed.command_line.exit_code, 2);
  }
}

}  // namespace
}  // namespace actstash::server
