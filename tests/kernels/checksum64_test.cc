// Checksum64 on the CPU: known values, its defining properties, and a Python
// transcription of the definition in kernels/checksum64.cuh.
#include "kernels/checksum64.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/checksum64.cuh"
#include "tests/kernels/python_runner.h"

namespace actstash::kernels {
namespace {

using ::actstash::kernels::testing::PythonHas;
using ::actstash::kernels::testing::ScratchDir;

std::vector<uint8_t> Pattern(size_t size) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(i * 131 + (i >> 8) + 7);
  return bytes;
}

std::vector<uint8_t> RandomBytes(size_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(size);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

uint64_t Sum(const std::vector<uint8_t>& data) { return Checksum64Cpu(data.data(), data.size()); }

// Computed once from the Python transcription of the definition (the test
// below re-checks that transcription against this code on random data).
TEST(Checksum64Test, KnownValues) {
  EXPECT_EQ(Checksum64Cpu(nullptr, 0), 0x155C40B635671F15ull);
  EXPECT_EQ(Sum(Pattern(1)), 0x0AAAC706174707A3ull);
  EXPECT_EQ(Sum(Pattern(4095)), 0x871EAFD40C64D170ull);
  EXPECT_EQ(Sum(Pattern(4096)), 0x0CB57CB2E9501F93ull);
  EXPECT_EQ(Sum(Pattern(4097)), 0xF90D2D07CC1450F9ull);
  EXPECT_EQ(Sum(Pattern(1 << 20)), 0xB7DBBBBAC1914539ull);
}

TEST(Checksum64Test, AnySingleByteChangeChangesTheValue) {
  const std::vector<uint8_t> original = RandomBytes(3 * 4096 + 777, 7);
  const uint64_t reference = Sum(original);
  std::mt19937_64 rng(8);
  std::vector<uint8_t> data = original;
  for (size_t i = 0; i < data.size(); ++i) {  // every position, a random nonzero change
    const auto delta = static_cast<uint8_t>(1 + rng() % 255);
    data[i] ^= delta;
    ASSERT_NE(Sum(data), reference) << "byte " << i;
    data[i] ^= delta;
  }
  for (int bit = 0; bit < 64; ++bit) {  // every bit of one word
    data[4096 + bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(Sum(data), reference) << bit;
    data[4096 + bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
}

TEST(Checksum64Test, LengthAndBlockOrderMatter) {
  std::vector<uint8_t> data = RandomBytes(2 * 4096, 9);
  const uint64_t reference = Sum(data);
  data.push_back(0);  // the same words, one zero byte longer
  EXPECT_NE(Sum(data), reference);
  data.pop_back();
  std::swap_ranges(data.begin(), data.begin() + 4096, data.begin() + 4096);
  EXPECT_NE(Sum(data), reference);
  const std::vector<uint8_t> zeros(4096, 0);
  const std::vector<uint8_t> empty;
  EXPECT_NE(Sum(zeros), Sum(empty));
}

TEST(Checksum64Test, IndependentOfPartitionOrderThreadsAndAlignment) {
  const std::vector<uint8_t> data = RandomBytes(8 * 1024 * 1024 + 12345, 10);
  const uint64_t reference = Sum(data);
  for (int threads : {2, 3, 4, 8, 64}) {
    EXPECT_EQ(Checksum64Cpu(data.data(), data.size(), threads), reference) << threads;
  }
  const uint64_t blocks = (data.size() + 4095) / 4096;
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<uint64_t> cuts = {0, blocks};
    for (int i = 0; i < trial; ++i) cuts.push_back(rng() % blocks);
    std::sort(cuts.begin(), cuts.end());
    std::vector<uint64_t> partials;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const uint64_t begin = cuts[i] * 4096;
      const uint64_t end = std::min<uint64_t>(cuts[i + 1] * 4096, data.size());
      partials.push_back(Checksum64PartialSum(data.data() + begin, end - begin, cuts[i]));
    }
    std::shuffle(partials.begin(), partials.end(), rng);
    uint64_t sum = 0;
    for (uint64_t p : partials) sum += p;
    ASSERT_EQ(Checksum64Finish(sum, data.size()), reference) << trial;
  }
  std::vector<uint8_t> shifted(data.size() + 3);  // misaligned copy: same value
  std::copy(data.begin(), data.end(), shifted.begin() + 3);
  EXPECT_EQ(Checksum64Cpu(shifted.data() + 3, data.size(), 4), reference);
}

// The GPU computes and mixes one lane per thread, then folds the mixed states
// (ChecksumLane, ChecksumMix64, ChecksumFoldMixed); the CPU runs the lanes
// interleaved. Both must give every block the same hash.
TEST(Checksum64Test, LaneByLaneFormEqualsTheCpuPath) {
  const std::vector<uint8_t> data = RandomBytes(5 * 4096 + 1, 12);
  for (uint32_t len : {1u, 7u, 8u, 9u, 255u, 256u, 257u, 4095u, 4096u}) {
    for (uint64_t index : {uint64_t{0}, uint64_t{3}, uint64_t{1} << 40}) {
      uint64_t fold = kChecksumFoldInit;
      for (int lane = 0; lane < kChecksumLanes; ++lane) {
        const uint64_t mixed = ChecksumMix64(ChecksumLane(data.data() + 1, len, index, lane));
        fold = ChecksumFoldMixed(fold, mixed);
      }
      const uint64_t lanes = ChecksumFoldFinish(fold);
      EXPECT_EQ(lanes, ChecksumBlock(data.data() + 1, len, index)) << len;
      EXPECT_EQ(lanes, Checksum64PartialSum(data.data() + 1, len, index)) << len;
    }
  }
}

constexpr char kDefinitionScript[] = R"(
import sys
d = sys.argv[1]
M = (1 << 64) - 1
K1, K2, K3 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
def mix64(x):
    x ^= x >> 30; x = (x * 0xBF58476D1CE4E5B9) & M
    x ^= x >> 27; x = (x * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)
def step(s, w):
    t = ((s ^ w) * K2) & M
    return t ^ (t >> 29)
def checksum64(data):
    n, total = len(data), 0
    for b in range((n + 4095) // 4096):
        block = data[4096 * b:4096 * (b + 1)]
        block += bytes(-len(block) % 8)
        words = [int.from_bytes(block[i:i + 8], 'little') for i in range(0, len(block), 8)]
        h = K1
        for lane in range(32):
            s = mix64((K3 + 32 * b + lane) & M)
            for w in words[lane::32]:
                s = step(s, w)
            h = step(h, mix64(s))
        total = (total + mix64(h)) & M
    return mix64(total ^ mix64((n + K3) & M))
data = open(d + '/data.bin', 'rb').read()
sizes = [int(x) for x in open(d + '/sizes.txt').read().split()]
open(d + '/sums.txt', 'w').write(' '.join(str(checksum64(data[:n])) for n in sizes))
)";

TEST(Checksum64Test, MatchesPythonTranscriptionOfTheDefinition) {
  if (!PythonHas("")) GTEST_SKIP() << "no Python at " << testing::TestPython();
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  const std::vector<uint8_t> data = RandomBytes(70000, 13);
  const std::vector<size_t> sizes = {0, 1, 7, 8, 9, 255, 4095, 4096, 4097, 8192, 12345, 70000};
  dir.Write("data.bin", data);
  std::string text;
  for (size_t size : sizes) text += std::to_string(size) + " ";
  dir.WriteBytes("sizes.txt", text.data(), text.size());
  ASSERT_TRUE(dir.RunPython(kDefinitionScript)) << dir.Log();
  const std::vector<char> text_out = dir.Read<char>("sums.txt");
  std::istringstream sums(std::string(text_out.begin(), text_out.end()));
  for (size_t size : sizes) {
    uint64_t expected = 0;
    ASSERT_TRUE(sums >> expected);
    EXPECT_EQ(Checksum64Cpu(data.data(), size), expected) << size;
  }
}

}  // namespace
}  // namespace actstash::kernels
