// Optional lossy downcast of offloaded activations to bfloat16, on the CPU
// (the GPU versions are in bf16_cuda.h). Rounding and special values are
// defined in kernels/bf16.cuh: round to nearest even, NaN stays (quiet) NaN,
// +-Inf and +-0 kept, subnormals rounded like any value. bf16 and fp16 values
// are held as their 16-bit patterns in uint16_t.
//
// Thread-safety: stateless; concurrent calls on disjoint outputs are safe.
// Preconditions: the arrays hold n elements (may be null when n is 0) and the
// output does not overlap the input.
#ifndef ACTSTASH_KERNELS_BF16_H_
#define ACTSTASH_KERNELS_BF16_H_

#include <cstddef>
#include <cstdint>

namespace actstash::kernels {

// dst[i] = bf16(src[i]), rounded to nearest even.
void Fp32ToBf16Cpu(const float* src, uint16_t* dst, size_t n);

// dst[i] = the float of bf16 pattern src[i] (exact).
void Bf16ToFp32Cpu(const uint16_t* src, float* dst, size_t n);

// dst[i] = bf16 of the fp16 pattern src[i] (one rounding, to nearest even).
void Fp16ToBf16Cpu(const uint16_t* src, uint16_t* dst, size_t n);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_BF16_H_
