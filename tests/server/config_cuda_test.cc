// actstashd's CUDA settings: --cuda-pin and --device-pool (flags and TOML).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "server/daemon/config.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

struct Parsed {
  CommandLine command_line;
  std::string err;
};

Parsed ParseArgs(std::vector<std::string> args) {
  args.insert(args.begin(), "actstashd");
  std::vector<const char*> argv;
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  argv.push_back(nullptr);
  Parsed parsed;
  testing::internal::CaptureStderr();
  parsed.command_line = ParseCommandLine(static_cast<int>(argv.size() - 1), argv.data());
  parsed.err = testing::internal::GetCapturedStderr();
  return parsed;
}

DaemonConfig Accepted(const std::vector<std::string>& args) {
  Parsed parsed = ParseArgs(args);
  EXPECT_FALSE(parsed.command_line.exit_code.has_value()) << parsed.err;
  return parsed.command_line.config;
}

void ExpectUsageError(const std::vector<std::string>& args, const std::string& needle) {
  Parsed parsed = ParseArgs(args);
  ASSERT_TRUE(parsed.command_line.exit_code.has_value()) << "accepted: " << args.back();
  EXPECT_EQ(*parsed.command_line.exit_code, 2);
  EXPECT_NE(parsed.err.find(needle), std::string::npos)
      << "'" << needle << "' not in: " << parsed.err;
}

TEST(CudaConfigTest, CudaPinDefaultsToAuto) {
  EXPECT_EQ(Accepted({}).cuda_pin, Tristate::kAuto);
  EXPECT_TRUE(Accepted({}).device_pools.empty());
}

TEST(CudaConfigTest, CudaPinValues) {
  EXPECT_EQ(Accepted({"--cuda-pin", "auto"}).cuda_pin, Tristate::kAuto);
  EXPECT_EQ(Accepted({"--cuda-pin", "on"}).cuda_pin, Tristate::kOn);
  EXPECT_EQ(Accepted({"--cuda-pin=off"}).cuda_pin, Tristate::kOff);
}

TEST(CudaConfigTest, BadCudaPinIsAUsageErrorListingTheChoices) {
  ExpectUsageError({"--cuda-pin", "yes"}, "cuda_pin: 'yes' is not one of auto, on, off");
  ExpectUsageError({"--cuda-pin", ""}, "cuda_pin");
  ExpectUsageError({"--cuda-pin", "ON"}, "cuda_pin");
}

TEST(CudaConfigTest, TomlKeys) {
  char pattern[] = "/tmp/actstash-cuda-config-XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  const std::string path = std::string(pattern) + "/c.toml";
  std::ofstream(path) << "cuda_pin = \"off\"\ndevice_pool = \"1:1GiB\"\nallow_uid = \"1000\"\n";
  const DaemonConfig config = Accepted({"--config", path});
  EXPECT_EQ(config.cuda_pin, Tristate::kOff);
  ASSERT_EQ(config.device_pools.size(), 1u);
  EXPECT_EQ(config.device_pools[0].device, 1);
  EXPECT_EQ(config.device_pools[0].bytes, kGiB);
  // Flags win over the file.
  EXPECT_EQ(Accepted({"--config", path, "--cuda-pin", "on"}).cuda_pin, Tristate::kOn);
  std::ofstream(path) << "cuda_pin = \"sometimes\"\n";
  ExpectUsageError({"--config", path}, "cuda_pin");
  std::remove(path.c_str());
  rmdir(pattern);
}

TEST(CudaConfigTest, DevicePoolEntriesAreRoundedToWholeSegments) {
  const DaemonConfig config = Accepted(
      {"--segment-size", "64MiB", "--device-pool", "0:256MiB, 3:1000MiB", "--allow-uid", "1000"});
  ASSERT_EQ(config.device_pools.size(), 2u);
  EXPECT_EQ(config.device_pools[0].device, 0);
  EXPECT_EQ(config.device_pools[0].bytes, 256 * kMiB);
  EXPECT_EQ(config.device_pools[1].device, 3);
  EXPECT_EQ(config.device_pools[1].bytes, 960 * kMiB);
}

TEST(CudaConfigTest, BadDevicePoolsAreUsageErrorsNamingTheEntry) {
  ExpectUsageError({"--device-pool", "8GiB"}, "device_pool: '8GiB' is not GPU:SIZE");
  ExpectUsageError({"--device-pool", "x:8GiB"}, "'x:8GiB' is not GPU:SIZE");
  ExpectUsageError({"--device-pool", "-1:8GiB"}, "'-1:8GiB' is not GPU:SIZE");
  ExpectUsageError({"--device-pool", "5000:8GiB"}, "'5000:8GiB'");
  ExpectUsageError({"--device-pool", "0:lots"}, "'0:lots'");
  ExpectUsageError({"--device-pool", "0:50%"}, "'0:50%'");
  ExpectUsageError({"--device-pool", "0:1MiB"}, "smaller than one segment");
  ExpectUsageError({"--device-pool", "0:1GiB,0:2GiB"}, "GPU 0 has more than one device pool");
  ExpectUsageError({"--device-pool", ","}, "device_pool: no GPU:SIZE entry");
}

TEST(CudaConfigTest, DevicePoolsNeedAnAllowList) {
  // Importing a device pool maps all of it: only listed users may attach.
  ExpectUsageError({"--device-pool", "0:1GiB"}, "device pools need allow_uid");
  ExpectUsageError({"--device-pool", "0:1GiB", "--allow-gid", "100"},
                   "device pools need allow_uid");
  ExpectUsageError({"--device-pool", "0:1GiB", "--allow-uid", "0", "--allow-gid", "100"},
                   "no allow_gid");
  EXPECT_EQ(Accepted({"--device-pool", "0:1GiB", "--allow-uid", "0"}).device_pools.size(), 1u);
}

TEST(CudaConfigTest, SegmentSizeMustBeAPowerOfTwo) {
  ExpectUsageError({"--segment-size", "48MiB"}, "segment_size: 48.0 MiB is not a power of two");
  EXPECT_EQ(Accepted({"--segment-size", "32MiB"}).segment_bytes, 32 * kMiB);
}

TEST(CudaConfigTest, ParseDevicePoolsDirectly) {
  absl::StatusOr<std::vector<DevicePoolConfig>> pools = ParseDevicePools("2:3MiB", kMiB);
  ASSERT_TRUE(pools.ok()) << pools.status();
  ASSERT_EQ(pools->size(), 1u);
  EXPECT_EQ((*pools)[0].device, 2);
  EXPECT_EQ((*pools)[0].bytes, 3 * kMiB);
  EXPECT_FALSE(ParseDevicePools("", kMiB).ok());
  EXPECT_FALSE(ParseDevicePools("2:", kMiB).ok());
  EXPECT_FALSE(ParseDevicePools(":3MiB", kMiB).ok());
  EXPECT_FALSE(ParseDevicePools("2:18446744073709551616", kMiB).ok());
}

}  // namespace
}  // namespace actstash::server
