// Unit tests of actstashd's configuration: flags over a TOML file over defaults.
#include "server/config.h"

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

namespace actstash::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

uint64_t PhysicalMemory() {
  return static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

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
  Parsed ParseWithToml(const std::string& contents,
                       std::initializer_list<std::string> flags = {}) {
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
  EXPECT_EQ(DefaultPoolBytes(), std::min(PhysicalMemory() / 4, 32 * kGiB));
  EXPECT_GT(DefaultPoolBytes(), 0u);
}

TEST_F(ConfigTest, Defaults) {
  const Parsed parsed = Parse({});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const DaemonConfig& config = parsed.command_line.config;
  EXPECT_EQ(config.socket_path, DefaultSocketPath());
  if (geteuid() == 0) EXPECT_EQ(config.socket_path, "/run/actstash/actstash.sock");
  EXPECT_EQ(config.socket_mode, 0660u);
  EXPECT_EQ(config.pool_bytes, DefaultPoolBytes());
  EXPECT_EQ(config.segment_bytes, 64 * kMiB);
  EXPECT_EQ(config.max_session_quota, config.pool_bytes);
  EXPECT_EQ(config.default_session_quota, config.pool_bytes);
  EXPECT_EQ(config.max_sessions, 1024u);
  EXPECT_EQ(config.mlock, MlockMode::kAuto);
  EXPECT_EQ(config.log_level, "info");
  EXPECT_DOUBLE_EQ(config.shutdown_grace_seconds, 5.0);
}

TEST_F(ConfigTest, EveryFlagIsParsed) {
  const Parsed parsed = Parse({"--socket", "/tmp/x/actstash.sock", "--socket-mode", "0600",
                               "--pool-size", "1GiB", "--segment-size", "4MiB",
                               "--max-session-quota", "512MiB", "--default-session-quota",
                               "128MiB", "--max-sessions", "7", "--mlock", "on", "--log-level",
                               "debug", "--shutdown-grace-seconds", "2.5"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const DaemonConfig& config = parsed.command_line.config;
  EXPECT_EQ(config.socket_path, "/tmp/x/actstash.sock");
  EXPECT_EQ(config.socket_mode, 0600u);
  EXPECT_EQ(config.pool_bytes, kGiB);
  EXPECT_EQ(config.segment_bytes, 4 * kMiB);
  EXPECT_EQ(config.max_session_quota, 512 * kMiB);
  EXPECT_EQ(config.default_session_quota, 128 * kMiB);
  EXPECT_EQ(config.max_sessions, 7u);
  EXPECT_EQ(config.mlock, MlockMode::kOn);
  EXPECT_EQ(config.log_level, "debug");
  EXPECT_DOUBLE_EQ(config.shutdown_grace_seconds, 2.5);
}

TEST_F(ConfigTest, FlagsAcceptEqualsForm) {
  const Parsed parsed = Parse({"--pool-size=2GiB", "--mlock=off", "--max-sessions=3"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.pool_bytes, 2 * kGiB);
  EXPECT_EQ(parsed.command_line.config.mlock, MlockMode::kOff);
  EXPECT_EQ(parsed.command_line.config.max_sessions, 3u);
}

TEST_F(ConfigTest, MlockModes) {
  EXPECT_EQ(Parse({"--mlock", "auto"}).command_line.config.mlock, MlockMode::kAuto);
  EXPECT_EQ(Parse({"--mlock", "on"}).command_line.config.mlock, MlockMode::kOn);
  EXPECT_EQ(Parse({"--mlock", "off"}).command_line.config.mlock, MlockMode::kOff);
}

TEST_F(ConfigTest, PoolSizePercentageIsOfPhysicalMemory) {
  const Parsed parsed = Parse({"--pool-size", "10%"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  const double expected = static_cast<double>(PhysicalMemory()) / 10;
  EXPECT_NEAR(static_cast<double>(parsed.command_line.config.pool_bytes), expected, 16.0);
  // Quotas follow the pool.
  EXPECT_EQ(parsed.command_line.config.max_session_quota, parsed.command_line.config.pool_bytes);
}

TEST_F(ConfigTest, QuotaPercentagesAreOfThePool) {
  const Parsed parsed =
      Parse({"--pool-size", "1GiB", "--max-session-quota", "50%"});
  ASSERT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  EXPECT_EQ(parsed.command_line.config.max_session_quota, 512 * kMiB);
  // The default quota follows the max when not given.
  EXPECT_EQ(parsed.command_line.config.default_session_quota, 512 * kMiB);

  const Parsed both = Parse({"--pool-size", "1GiB", "--max-session-quota", "50%",
                             "--default-session-quota", "25%"});
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
  EXPECT_EQ(config.mlock, MlockMode::kOff);
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
  EXPECT_EQ(parsed.command_line.config.pool_bytes, DefaultPoolBytes());
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
  EXPECT_EQ(config.mlock, MlockMode::kOff);
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

TEST_F(ConfigTest, UnknownFlagAndMissingConfigFileExitNonZero) {
  const Parsed unknown = Parse({"--pool-sise", "1GiB"});
  ASSERT_TRUE(unknown.command_line.exit_code.has_value());
  EXPECT_NE(*unknown.command_line.exit_code, 0);

  const Parsed missing = Parse({"--config", dir_ + "/does-not-exist.toml"});
  ASSERT_TRUE(missing.command_line.exit_code.has_value());
  EXPECT_NE(*missing.command_line.exit_code, 0);
}

// BUG (reported): config.h promises "A bad value in either is a usage error
// (exit code 2)", but errors that CLI11 itself detects come back with CLI11's
// own exit codes (ExtrasError 109 for an unknown flag, ValidationError 105
// for a --config file that does not exist), because ParseCommandLine returns
// app.exit(error) unchanged (server/config.cc). Enable once they map to 2.
TEST_F(ConfigTest, DISABLED_UnknownFlagAndMissingConfigFileExitTwo) {
  const Parsed unknown = Parse({"--pool-sise", "1GiB"});
  ASSERT_TRUE(unknown.command_line.exit_code.has_value());
  EXPECT_EQ(*unknown.command_line.exit_code, 2);

  const Parsed missing = Parse({"--config", dir_ + "/does-not-exist.toml"});
  ASSERT_TRUE(missing.command_line.exit_code.has_value());
  EXPECT_EQ(*missing.command_line.exit_code, 2);
}

// BUG (reported): a TOML integer socket_mode is turned into its decimal text
// and then parsed as octal (server/config.cc, ReadToml + Resolve), so the
// natural TOML octal literal 0o640 (= 416) silently becomes mode 0416.
// Either it means 0640 or it must be a usage error; never a different mode.
TEST_F(ConfigTest, DISABLED_TomlOctalIntegerSocketModeIsNotMisread) {
  const Parsed parsed = ParseWithToml("socket_mode = 0o640\n");
  if (parsed.command_line.exit_code.has_value()) {
    EXPECT_EQ(*parsed.command_line.exit_code, 2);
  } else {
    EXPECT_EQ(parsed.command_line.config.socket_mode, 0640u);
  }
}

}  // namespace
}  // namespace actstash::server
