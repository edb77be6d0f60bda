#include "kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/bf16.cuh"

namespace actstash::kernels {
namespace {

#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && \
    !defined(ACTSTASH_NO_TARGET_CLONES)
#if __has_attribute(target_clones)
#define ACTSTASH_ADAMW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef ACTSTASH_ADAMW_CLONES
#define ACTSTASH_ADAMW_CLONES
#endif

// The step's scalars, rounded to float once (as torch's CPU kernels take
// them).
struct Scalars {
  float decay;         // 1 - lr * weight_decay
  float one_minus_b1;  // lerp weight
  float b2;
  float one_minus_b2;
  float step_size;     // lr / bias_correction1
  float inv_bc2_sqrt;  // 1 / sqrt(bias_correction2): a multiply, not a second division
  float eps;
};

ACTSTASH_ADAMW_CLONES
void Update(float* __restrict p, const float* __restrict g, float* __restrict m,
            float* __restrict v, size_t n, Scalars s) {
  for (size_t i = 0; i < n; ++i) {
    const float grad = g[i];
    const float param = p[i] * s.decay;
    const float avg = m[i] + (grad - m[i]) * s.one_minus_b1;
    const float sq = v[i] * s.b2 + s.one_minus_b2 * grad * grad;
    const float denom = std::sqrt(sq) * s.inv_bc2_sqrt + s.eps;
    m[i] = avg;
    v[i] = sq;
    p[i] = param - s.step_size * (avg / denom);
  }
}

inline float FloatOfBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t BitsOfFloat(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Update with a bf16 gradient and the bf16 parameter written beside its
// master `p`: the same operations in the same order.
ACTSTASH_ADAMW_CLONES
void UpdateBf16(float* __restrict p, const uint16_t* __restrict g, float* __restrict m,
                float* __restrict v, uint16_t* __restrict out, size_t n, Scalars s) {
  for (size_t i = 0; i < n; ++i) {
    const float grad = FloatOfBits(Bf16BitsToFp32Bits(g[i]));
    const float param = p[i] * s.decay;
    const float avg = m[i] + (grad - m[i]) * s.one_minus_b1;
    const float sq = v[i] * s.b2 + s.one_minus_b2 * grad * grad;
    const float denom = std::sqrt(sq) * s.inv_bc2_sqrt + s.eps;
    const float updated = param - s.step_size * (avg / denom);
    m[i] = avg;
    v[i] = sq;
    p[i] = updated;
    out[i] = Fp32BitsToBf16Bits(BitsOfFloat(updated));
  }
}

// Elements per thread below which another thread costs more than it saves.
constexpr size_t kMinPerThread = size_t{1} << 16;

}  // namespace

void AdamWStepCpu(const AdamWTensor* tensors, size_t count, const AdamWHyper& hyper,
                  int num_threads) {
  const double step = static_cast<double>(hyper.step);
  const double bias_correction1 = 1 - std::pow(hyper.beta1, step);
  const double bias_correction2 = 1 - std::pow(hyper.beta2, step);
  const Scalars s{static_cast<float>(1 - hyper.lr * hyper.weight_decay),
                  static_cast<float>(1 - hyper.beta1),
                  static_cast<float>(hyper.beta2),
                  static_cast<float>(1 - hyper.beta2),
                  static_cast<float>(hyper.lr / bias_correction1),
                  static_cast<float>(1 / std::sqrt(bias_correction2)),
                  static_cast<float>(hyper.eps)};
  size_t total = 0;
  for (size_t t = 0; t < count; ++t) total += tensors[t].n;
  const size_t threads =
      std::clamp<size_t>(total / kMinPerThread, 1, static_cast<size_t>(std::max(num_threads, 1)));
  // Thread k takes elements [k * per, (k + 1) * per) of all tensors in order,
  // in 64-element steps so that no two threads share a cache line.
  const size_t per = (total / threads + 63) / 64 * 64;
  auto work = [&](size_t k) {
    const size_t begin = k * per;
    const size_t end = std::min(total, begin + per);
    size_t at = 0;  // first element of tensor t in the concatenation
    for (size_t t = 0; t < count && at < end; at += tensors[t].n, ++t) {
      const AdamWTensor& x = tensors[t];
      const size_t lo = std::max(begin, at);
      const size_t hi = std::min(end, at + x.n);
      if (lo >= hi) continue;
      const size_t o = lo - at;
      if (x.grad_bf16 != nullptr) {
        UpdateBf16(x.param + o, x.grad_bf16 + o, x.exp_avg + o, x.exp_avg_sq + o, x.param_bf16 + o,
                   hi - lo, s);
      } else {
        Update(x.param + o, x.grad + o, x.exp_avg + o, x.exp_avg_sq + o, hi - lo, s);
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (size_t k = 1; k < threads; ++k) pool.emplace_back(work, k);
  work(0);
  for (std::thread& thread : pool) thread.join();
}

}  // namespace actstash::kernels
