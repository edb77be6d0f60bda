// Element math of the lossy bf16 conversions, shared by the CPU (bf16.cc)
// and the GPU (bf16_kernels.cu). Values are passed as their IEEE bit
// patterns (binary32 as uint32_t, binary16 and bfloat16 as uint16_t).
//
// fp32 -> bf16 rounds to nearest, ties to even (IEEE roundTiesToEven on the
// top 16 bits): finite values too large round to +-Inf, +-Inf and +-0 are
// kept, subnormals round like any other value (to a bf16 subnormal, or up to
// the smallest normal). A NaN stays a NaN: sign and the top 7 payload bits
// are kept and the quiet bit is set, so a signalling NaN whose payload sits
// in the low bits never turns into an Inf. (torch canonicalizes NaNs
// instead; only NaN-ness is part of the contract.)
// bf16 -> fp32 and fp16 -> fp32 are exact; fp16 -> bf16 is fp16 -> fp32 ->
// bf16, a single rounding.
#ifndef ACTSTASH_KERNELS_BF16_CUH_
#define ACTSTASH_KERNELS_BF16_CUH_

#include <cstdint>

#include "kernels/hd.cuh"

namespace actstash::kernels {

// Without branches (an all-ones mask picks the NaN's value), so that loops
// of it vectorize (the AdamW step's bf16 parameters, kernels/adamw.cc).
ACTSTASH_HD inline uint16_t Fp32BitsToBf16Bits(uint32_t f) {
  const uint32_t rounding_bias = 0x7FFFu + ((f >> 16) & 1u);
  const uint32_t rounded = (f + rounding_bias) >> 16;  // wraps for some NaNs only: not taken
  const uint32_t quiet_nan = (f >> 16) | 0x0040u;
  const uint32_t is_nan = 0u - static_cast<uint32_t>((f & 0x7FFFFFFFu) > 0x7F800000u);
  return static_cast<uint16_t>((quiet_nan & is_nan) | (rounded & ~is_nan));
}

ACTSTASH_HD inline uint32_t Bf16BitsToFp32Bits(uint16_t b) {
  return static_cast<uint32_t>(b) << 16;
}

ACTSTASH_HD inline uint32_t Fp16BitsToFp32Bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return sign | 0x7F800000u | (mantissa << 13);  // Inf, NaN (payload kept)
  if (exponent != 0) return sign | ((exponent + 112u) << 23) | (mantissa << 13);
  if (mantissa == 0) return sign;  // +-0
  // Subnormal: mantissa * 2^-24; normalize so that bit 10 is the implicit one.
  uint32_t biased = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --biased;
  }
  return sign | (biased << 23) | ((mantissa & 0x3FFu) << 13);
}

ACTSTASH_HD inline uint16_t Fp16BitsToBf16Bits(uint16_t h) {
  return Fp32BitsToBf16Bits(Fp16BitsToFp32Bits(h));
}

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_BF16_CUH_
