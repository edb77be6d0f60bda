#include "kernels/bf16.h"

#include <cstdint>
#include <cstring>

#include "kernels/bf16.cuh"

namespace actstash::kernels {

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

void Fp16ToBf16Cpu(const uint16_t* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Fp16BitsToBf16Bits(src[i]);
}

}  // namespace actstash::kernels
