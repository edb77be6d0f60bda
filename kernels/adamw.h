// AdamW on the CPU over fp32 arrays, in place: the optimizer step of
// parameters whose states live in the daemon's pool (actstash.optim,
// OffloadAdamW's "fast" mode). Multi-threaded over all tensors of a step at
// once, vectorized (an AVX2/AVX-512 clone is picked at load time on x86-64).
//
// Per element, in float, with the scalars computed in double as torch does
// and rounded to float once:
//   p  = p * (1 - lr * weight_decay)
//   m  = m + (g - m) * (1 - beta1)          (torch's lerp, weight < 0.5)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p - (lr / (1 - beta1^t)) * (m / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps))
// (one division per element: torch divides by sqrt(1 - beta2^t), which rounds
// differently; divisions, not memory, bounded the step at 500M parameters)
// Every operation rounds on its own (no fused multiply-add): the same bits on
// every CPU, clone and thread split. torch's kernels may fuse (or split a
// lerp differently), so results may differ from torch.optim.AdamW's by a few
// ulps per step (tests/kernels/adamw_test.cc and the Python tests measure
// it). Bitwise equality is OffloadAdamW's default mode, which runs torch's
// own kernels.
//
// Thread-safety: stateless; concurrent calls on disjoint arrays are safe.
#ifndef ACTSTASH_KERNELS_ADAMW_H_
#define ACTSTASH_KERNELS_ADAMW_H_

#include <cstddef>
#include <cstdint>

namespace actstash::kernels {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  uint64_t step = 1;  // after the increment: the first step is 1
};

// One tensor's arrays: n elements each (grad read-only).
struct AdamWTensor {
  float* param = nullptr;  // an fp32 parameter, or a bf16 one's fp32 master weight
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  size_t n = 0;
  // A bf16 parameter (both set, `grad` then unused): its gradient, read as
  // fp32 (exact), and the parameter itself, written with `param` rounded to
  // nearest even (kernels/bf16.cuh) once it is updated. The same bits as
  // the fp32 step on the cast gradient followed by a cast of the master: one
  // pass over memory, no fp32 gradient.
  const uint16_t* grad_bf16 = nullptr;
  uint16_t* param_bf16 = nullptr;
};

// Updates every tensor in place, splitting their elements over up to
// `num_threads` threads (the caller's included; < 1 means 1).
void AdamWStepCpu(const AdamWTensor* tensors, size_t count, const AdamWHyper& hyper,
                  int num_threads);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_ADAMW_H_
