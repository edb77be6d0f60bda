// bf16 conversions: hand-checked vectors, exhaustive properties, and
// bit-exact agreement with torch's .bfloat16() (run in a Python child).
#include "kernels/bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/bf16.cuh"
#include "tests/kernels/python_runner.h"

namespace actstash::kernels {
namespace {

using ::actstash::kernels::testing::PythonHas;
using ::actstash::kernels::testing::ScratchDir;

bool IsNan32(uint32_t f) { return (f & 0x7FFFFFFFu) > 0x7F800000u; }
bool IsNan16(uint16_t b) { return (b & 0x7FFFu) > 0x7F80u; }

uint32_t FloatBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

TEST(Bf16Test, HandCheckedFp32Values) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000, 0x3F80},  // 1.0
      {0x3F808000, 0x3F80},  // halfway, even below: down
      {0x3F818000, 0x3F82},  // halfway, odd below: up
      {0x3F808001, 0x3F81},  // just above halfway
      {0x3F807FFF, 0x3F80},  // just below halfway
      {0x7F7FFFFF, 0x7F80},  // FLT_MAX rounds to +Inf
      {0x7F7F7FFF, 0x7F7F},  // stays finite
      {0xFF7FFFFF, 0xFF80},  // -FLT_MAX rounds to -Inf
      {0x7F800000, 0x7F80},  // +Inf
      {0xFF800000, 0xFF80},  // -Inf
      {0x00000000, 0x0000},  // +0
      {0x80000000, 0x8000},  // -0
      {0x00008000, 0x0000},  // subnormal halfway, even: to +0
      {0x00018000, 0x0002},  // subnormal halfway, odd: up
      {0x007FFFFF, 0x0080},  // largest subnormal rounds up to the smallest normal
      {0x80000001, 0x8000},  // tiny negative subnormal: to -0
      {0x00800000, 0x0080},  // smallest normal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Fp32BitsToBf16Bits(c.in), c.out) << std::hex << c.in;
  }
  // NaNs stay NaN, quiet, with their sign; low-bit payloads must not become Inf.
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7F80FFFFu, 0x7FFFFFFFu, 0xFFFFFFFFu,
                       0x7FA00000u}) {
    const uint16_t out = Fp32BitsToBf16Bits(nan);
    EXPECT_TRUE(IsNan16(out)) << std::hex << nan;
    EXPECT_EQ(out & 0x0040u, 0x0040u) << std::hex << nan;
    EXPECT_EQ(out >> 15, nan >> 31) << std::hex << nan;
  }
}

TEST(Bf16Test, HandCheckedFp16Values) {
  EXPECT_EQ(Fp16BitsToBf16Bits(0x3C00), 0x3F80);  // 1.0
  EXPECT_EQ(Fp16BitsToBf16Bits(0x0001), 0x3380);  // 2^-24, a subnormal in fp16
  EXPECT_EQ(Fp16BitsToBf16Bits(0x8001), 0xB380);
  EXPECT_EQ(Fp16BitsToBf16Bits(0x7C00), 0x7F80);     // +Inf
  EXPECT_EQ(Fp16BitsToBf16Bits(0xFC00), 0xFF80);     // -Inf
  EXPECT_EQ(Fp16BitsToBf16Bits(0x8000), 0x8000);     // -0
  EXPECT_EQ(Fp16BitsToBf16Bits(0x3C04), 0x3F80);     // 1 + 2^-8: halfway, to even
  EXPECT_EQ(Fp16BitsToBf16Bits(0x3C0C), 0x3F82);     // 1 + 3*2^-8: halfway, to even (up)
  EXPECT_EQ(Fp16BitsToBf16Bits(0x7BFF), 0x4780);     // 65504 rounds to 65536
  EXPECT_TRUE(IsNan16(Fp16BitsToBf16Bits(0x7C01)));  // signalling, payload in the low bits
  EXPECT_TRUE(IsNan16(Fp16BitsToBf16Bits(0xFE00)));
}

TEST(Bf16Test, Fp16ToFp32IsExactForEveryPattern) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const int exponent = (h >> 10) & 0x1F;
    const int mantissa = h & 0x3FF;
    const float sign = (h & 0x8000) ? -1.0f : 1.0f;
    const uint32_t got = Fp16BitsToFp32Bits(static_cast<uint16_t>(h));
    if (exponent == 0x1F) {
      EXPECT_EQ(IsNan32(got), mantissa != 0) << h;
      if (mantissa == 0) {
        EXPECT_EQ(got, FloatBits(sign * INFINITY)) << h;
      }
      continue;
    }
    const float value = exponent == 0 ? sign * std::ldexp(static_cast<float>(mantissa), -24)
                                      : sign * std::ldexp(1.0f + mantissa / 1024.0f, exponent - 15);
    ASSERT_EQ(got, FloatBits(value)) << h;
  }
}

TEST(Bf16Test, Bf16RoundTripsThroughFp32) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t bf = static_cast<uint16_t>(b);
    const uint16_t back = Fp32BitsToBf16Bits(Bf16BitsToFp32Bits(bf));
    if (IsNan16(bf)) {
      EXPECT_TRUE(IsNan16(back)) << b;
    } else {
      ASSERT_EQ(back, bf) << b;
    }
  }
}

// The CPU loop (a branch-free form plus a fix-up of subnormals) against the
// shared function the GPU runs: bit-identical for every pattern, NaN payloads
// included, whatever the position in the array and the chunk boundaries.
TEST(Bf16Test, Fp16ToBf16CpuMatchesTheSharedFunctionBitForBit) {
  std::vector<uint16_t> all16(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) all16[h] = static_cast<uint16_t>(h);
  std::vector<uint16_t> out(all16.size());
  Fp16ToBf16Cpu(all16.data(), out.data(), all16.size());
  for (uint32_t h = 0; h < 0x10000; ++h) {
    ASSERT_EQ(out[h], Fp16BitsToBf16Bits(static_cast<uint16_t>(h))) << std::hex << "fp16 0x" << h;
  }
  // Random arrays of odd lengths at odd offsets: normal values only, or with
  // a few subnormals (and zeros, Infs, NaNs) sprinkled into some stretches.
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 200; ++iter) {
    const size_t n = static_cast<size_t>(rng() % 9000);
    const size_t offset = static_cast<size_t>(rng() % 8);
    std::vector<uint16_t> in(n + offset);
    for (uint16_t& h : in) {
      const auto r = static_cast<uint32_t>(rng());
      h = static_cast<uint16_t>((r & 0x83FFu) | ((1u + (r >> 16) % 30u) << 10));  // normal
    }
    const int specials = iter % 3 == 0 ? 0 : static_cast<int>(rng() % 6);
    for (int k = 0; k < specials && n > 0; ++k) {
      const uint16_t pick[] = {0x0001, 0x83FF, 0x0200, 0x0000, 0x8000, 0x7C00, 0xFC01, 0x7E00};
      in[offset + rng() % n] = pick[rng() % 8];
    }
    std::vector<uint16_t> got(n + 1, 0xBEEF);
    Fp16ToBf16Cpu(in.data() + offset, got.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[i], Fp16BitsToBf16Bits(in[offset + i])) << i << " of " << n;
    }
    ASSERT_EQ(got[n], 0xBEEF);
  }
}

// Inputs for the torch comparison: random bit patterns plus the edges.
std::vector<uint32_t> Fp32Inputs() {
  std::vector<uint32_t> in = {0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                              0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FFFFFFF, 0xFFFFFFFF,
                              0x7FA00000, 0xFFC00001, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000,
                              0x80800000, 0x00000001, 0x007FFFFF, 0x807FFFFF, 0x00008000,
                              0x00018000, 0x00007FFF, 0x00008001, 0x7F7F8000, 0x7F7E8000};
  std::mt19937_64 rng(2024);
  for (int i = 0; i < 20000; ++i) {  // around every kind of halfway point
    const uint32_t upper = static_cast<uint32_t>(rng()) & 0xFFFFu;
    for (uint32_t low : {0x7FFFu, 0x8000u, 0x8001u}) in.push_back(upper << 16 | low);
  }
  for (uint32_t upper = 0; upper < 0x10000; upper += 0x0101) in.push_back(upper << 16 | 0x8000);
  for (int i = 0; i < (1 << 20); ++i) in.push_back(static_cast<uint32_t>(rng()));
  return in;
}

constexpr char kTorchScript[] = R"(
import sys, torch
d = sys.argv[1]
def load(name, dtype):
    with open(d + '/' + name, 'rb') as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype)
def save(name, t):
    with open(d + '/' + name, 'wb') as f:
        f.write(t.contiguous().numpy().tobytes())
f32 = load('f32.in', torch.int32).view(torch.float32)
save('f32_bf16.out', f32.bfloat16().view(torch.int16))
all16 = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16)
save('f16_bf16.out', all16.view(torch.float16).bfloat16().view(torch.int16))
save('bf16_f32.out', all16.view(torch.bfloat16).float().view(torch.int32))
)";

TEST(Bf16Test, BitExactAgainstTorch) {
  if (!PythonHas("torch")) {
    GTEST_SKIP() << "no torch in " << testing::TestPython()
                 << " (set ACTSTASH_TEST_PYTHON to an interpreter with torch)";
  }
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  const std::vector<uint32_t> in = Fp32Inputs();
  dir.Write("f32.in", in);
  ASSERT_TRUE(dir.RunPython(kTorchScript)) << dir.Log();

  const std::vector<uint16_t> torch_f32 = dir.Read<uint16_t>("f32_bf16.out");
  ASSERT_EQ(torch_f32.size(), in.size());
  std::vector<float> floats(in.size());
  std::memcpy(floats.data(), in.data(), in.size() * sizeof(uint32_t));
  std::vector<uint16_t> ours(in.size());
  Fp32ToBf16Cpu(floats.data(), ours.data(), floats.size());
  size_t nans = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (IsNan32(in[i])) {
      ++nans;
      ASSERT_TRUE(IsNan16(torch_f32[i]) && IsNan16(ours[i])) << std::hex << in[i];
    } else {
      ASSERT_EQ(ours[i], torch_f32[i]) << std::hex << "input 0x" << in[i];
    }
  }
  EXPECT_GT(nans, 10u);

  std::vector<uint16_t> all16(0x10000);
  for (uint32_t i = 0; i < 0x10000; ++i) all16[i] = static_cast<uint16_t>(i);
  const std::vector<uint16_t> torch_f16 = dir.Read<uint16_t>("f16_bf16.out");
  ASSERT_EQ(torch_f16.size(), all16.size());
  Fp16ToBf16Cpu(all16.data(), ours.data(), all16.size());
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7FFF) > 0x7C00) {
      ASSERT_TRUE(IsNan16(torch_f16[h]) && IsNan16(ours[h])) << h;
    } else {
      ASSERT_EQ(ours[h], torch_f16[h]) << std::hex << "fp16 0x" << h;
    }
  }

  const std::vector<uint32_t> torch_bf16 = dir.Read<uint32_t>("bf16_f32.out");
  ASSERT_EQ(torch_bf16.size(), all16.size());
  std::vector<float> widened(all16.size());
  Bf16ToFp32Cpu(all16.data(), widened.data(), all16.size());
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint32_t got = FloatBits(widened[b]);
    if (IsNan16(static_cast<uint16_t>(b))) {
      ASSERT_TRUE(IsNan32(got) && IsNan32(torch_bf16[b])) << b;
    } else {
      ASSERT_EQ(got, torch_bf16[b]) << std::hex << "bf16 0x" << b;
    }
  }
}

}  // namespace
}  // namespace actstash::kernels
