#include "kernels/bf16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.cuh"

// x86-64 Linux: the chunk loop below also gets an AVX2 clone (16 lanes
// instead of SSE2's 8), chosen once at load time by the CPU it runs on.
// ACTSTASH_NO_TARGET_CLONES (CMake: ACTSTASH_TARGET_CLONES=OFF) leaves them
// out: ThreadSanitizer binaries crash in the IFUNC resolver that picks one.
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && \
    !defined(ACTSTASH_NO_TARGET_CLONES)
#if __has_attribute(target_clones)
#define ACTSTASH_BF16_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef ACTSTASH_BF16_CLONES
#define ACTSTASH_BF16_CLONES
#endif

namespace actstash::kernels {
namespace {

// fp16 patterns whose magnitude is a subnormal (exponent 0, mantissa != 0).
inline bool IsFp16Subnormal(uint16_t h) {
  return static_cast<uint16_t>((h & 0x7FFFu) - 1u) < 0x03FFu;
}

// Fp16BitsToBf16Bits(h) for every pattern except the subnormals, in 16-bit
// integer steps without branches, so that a loop of it vectorizes (8 lanes
// per SSE2 register). With a = h's magnitude bits (exponent << 10 | mantissa):
// - normal (0x0400 <= a < 0x7C00): the exponent is rebiased by 127 - 15 and
//   the 10-bit mantissa rounds to 7 bits, to nearest even; a carry out of
//   the mantissa bumps the exponent (65504 -> 65536), as when fp32 rounds;
// - +-0 stays +-0;
// - Inf and NaN (a >= 0x7C00): exponent all ones, the top 7 mantissa bits
//   kept and, for a NaN, the quiet bit set (what the fp32 step does).
// Bit-identical to the shared function on all those patterns, NaN payloads
// included; bf16_test.cc compares all 65536.
inline uint16_t Fp16BitsToBf16BitsNoSubnormal(uint16_t h) {
  const uint16_t a = h & 0x7FFFu;
  const auto normal =
      static_cast<uint16_t>(((a + 3u + ((a >> 3) & 1u)) >> 3) + ((127u - 15u) << 7));
  const auto special = static_cast<uint16_t>(((a >> 3) + ((255u - 31u) << 7)) |
                                             (static_cast<unsigned>(a > 0x7C00u) << 6));
  // All-ones / all-zeros masks instead of ?: keep the loop branch-free.
  const auto is_zero = static_cast<uint16_t>(0u - static_cast<unsigned>(a == 0));
  const auto is_special = static_cast<uint16_t>(0u - static_cast<unsigned>(a >= 0x7C00u));
  const auto magnitude =
      static_cast<uint16_t>((special & is_special) | (normal & ~(is_special | is_zero)));
  return static_cast<uint16_t>((h & 0x8000u) | magnitude);
}

constexpr size_t kFp16Chunk = 2048;  // 4 KiB of input: still in L1 for the fix-up pass

// Converts n elements (a chunk); returns nonzero when one of them is a
// subnormal, whose output then still has to be fixed.
ACTSTASH_BF16_CLONES uint16_t Fp16ToBf16Chunk(const uint16_t* __restrict src,
                                              uint16_t* __restrict dst, size_t n) {
  uint16_t subnormals = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = src[i];
    dst[i] = Fp16BitsToBf16BitsNoSubnormal(h);
    subnormals |= static_cast<uint16_t>(IsFp16Subnormal(h));
  }
  return subnormals;
}

}  // namespace

void Fp32ToBf16Cpu(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &src[i], sizeof(bits));
    dst[i] = Fp32BitsToBf16Bits(bits);
  }
}

void Bf16ToFp32Cpu(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = Bf16BitsToFp32Bits(src[i]);
    std::memcpy(&dst[i], &bits, sizeof(bits));
  }
}

// Chunk by chunk: the branch-free conversion, then (rarely: activations are
// seldom below 2^-14) the subnormals again through the shared function.
void Fp16ToBf16Cpu(const uint16_t* src, uint16_t* dst, size_t n) {
  for (size_t start = 0; start < n; start += kFp16Chunk) {
    const size_t count = std::min(kFp16Chunk, n - start);
    if (Fp16ToBf16Chunk(src + start, dst + start, count) == 0) continue;
    for (size_t i = start; i < start + count; ++i) {
      if (IsFp16Subnormal(src[i])) dst[i] = Fp16BitsToBf16Bits(src[i]);
    }
  }
}

}  // namespace actstash::kernels
