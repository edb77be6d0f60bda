// The CPU AdamW step (kernels/adamw.h): the same bits whatever the thread
// split, each operation rounded on its own as the header says (against a
// scalar reference written out step by step), and close to AdamW computed
// in double over many steps.
#include "kernels/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/bf16.h"

namespace actstash::kernels {
namespace {

struct State {
  std::vector<float> p, g, m, v;
};

State Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  for (size_t i = 0; i < n; ++i) {
    s.p.push_back(normal(rng));
    s.g.push_back(normal(rng) * 0.1f);
    s.m.push_back(0.0f);
    s.v.push_back(0.0f);
  }
  return s;
}

void Step(std::vector<State*> states, const AdamWHyper& hyper, int threads) {
  std::vector<AdamWTensor> tensors;
  for (State* s : states) {
    tensors.push_back({s->p.data(), s->g.data(), s->m.data(), s->v.data(), s->p.size()});
  }
  AdamWStepCpu(tensors.data(), tensors.size(), hyper, threads);
}

TEST(AdamWTest, TheSameBitsWhateverTheThreadsAndOperationByOperation) {
  // Sizes that straddle thread boundaries and vector widths.
  const std::vector<size_t> sizes = {1, 17, 300001, 65536, 5, 131075};
  std::vector<State> one, many, ref;
  for (size_t i = 0; i < sizes.size(); ++i) {
    one.push_back(Random(sizes[i], static_cast<uint32_t>(i)));
  }
  many = one;
  ref = one;
  AdamWHyper hyper;
  hyper.lr = 3e-3;
  hyper.weight_decay = 0.1;
  for (uint64_t step = 1; step <= 5; ++step) {
    hyper.step = step;
    std::vector<State*> a, b;
    for (State& s : one) a.push_back(&s);
    for (State& s : many) b.push_back(&s);
    Step(a, hyper, 1);
    Step(b, hyper, 7);
    // Written out one rounding at a time.
    const float decay = static_cast<float>(1 - hyper.lr * hyper.weight_decay);
    const float w = static_cast<float>(1 - hyper.beta1);
    const float b2 = static_cast<float>(hyper.beta2);
    const float w2 = static_cast<float>(1 - hyper.beta2);
    const float step_size =
        static_cast<float>(hyper.lr / (1 - std::pow(hyper.beta1, static_cast<double>(step))));
    const float inv_bc2 =
        static_cast<float>(1 / std::sqrt(1 - std::pow(hyper.beta2, static_cast<double>(step))));
    const float eps = static_cast<float>(hyper.eps);
    for (State& s : ref) {
      for (size_t i = 0; i < s.p.size(); ++i) {
        volatile float param = s.p[i] * decay;
        volatile float diff = s.g[i] - s.m[i];
        volatile float scaled = diff * w;
        volatile float avg = s.m[i] + scaled;
        volatile float sq1 = s.v[i] * b2;
        volatile float gw = w2 * s.g[i];
        volatile float gg = gw * s.g[i];
        volatile float sq = sq1 + gg;
        volatile float root = std::sqrt(static_cast<float>(sq));
        volatile float scaled_root = root * inv_bc2;
        volatile float denom = scaled_root + eps;
        volatile float ratio = avg / denom;
        volatile float delta = step_size * ratio;
        s.m[i] = avg;
        s.v[i] = sq;
        s.p[i] = param - delta;
      }
    }
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    ASSERT_EQ(std::memcmp(one[t].p.data(), many[t].p.data(), sizes[t] * 4), 0) << t;
    ASSERT_EQ(std::memcmp(one[t].v.data(), many[t].v.data(), sizes[t] * 4), 0) << t;
    ASSERT_EQ(std::memcmp(one[t].p.data(), ref[t].p.data(), sizes[t] * 4), 0) << t;
    ASSERT_EQ(std::memcmp(one[t].m.data(), ref[t].m.data(), sizes[t] * 4), 0) << t;
  }
}

TEST(AdamWTest, Bf16ParametersAreTheFp32StepOnTheCastGradientThenACast) {
  // Masters stepped with bf16 gradients, the bf16 parameters written beside
  // them, against the fp32 step on the gradients cast to fp32 followed by a
  // cast of the masters: the same bits, whatever the threads.
  const std::vector<size_t> sizes = {3, 70001, 65536, 129};
  std::vector<State> fp32;
  std::vector<std::vector<uint16_t>> grads, params;
  for (size_t t = 0; t < sizes.size(); ++t) {
    State s = Random(sizes[t], static_cast<uint32_t>(100 + t));
    std::vector<uint16_t> g(sizes[t]);
    Fp32ToBf16Cpu(s.g.data(), g.data(), g.size());
    Bf16ToFp32Cpu(g.data(), s.g.data(), g.size());  // the exact fp32 of the bf16 gradient
    grads.push_back(std::move(g));
    params.emplace_back(sizes[t], uint16_t{0});
    fp32.push_back(std::move(s));
  }
  std::vector<State> mixed = fp32;
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    AdamWHyper hyper;
    hyper.lr = 1e-2;
    hyper.weight_decay = 0.1;
    for (uint64_t step = 1; step <= 4; ++step) {
      hyper.step = step;
      std::vector<State*> plain;
      for (State& s : fp32) plain.push_back(&s);
      Step(plain, hyper, threads);
      std::vector<AdamWTensor> tensors;
      for (size_t t = 0; t < sizes.size(); ++t) {
        AdamWTensor x{mixed[t].p.data(), nullptr, mixed[t].m.data(), mixed[t].v.data(), sizes[t]};
        x.grad_bf16 = grads[t].data();
        x.param_bf16 = params[t].data();
        tensors.push_back(x);
      }
      AdamWStepCpu(tensors.data(), tensors.size(), hyper, threads);
      for (size_t t = 0; t < sizes.size(); ++t) {
        ASSERT_EQ(std::memcmp(fp32[t].p.data(), mixed[t].p.data(), sizes[t] * 4), 0) << t;
        ASSERT_EQ(std::memcmp(fp32[t].m.data(), mixed[t].m.data(), sizes[t] * 4), 0) << t;
        ASSERT_EQ(std::memcmp(fp32[t].v.data(), mixed[t].v.data(), sizes[t] * 4), 0) << t;
        std::vector<uint16_t> cast(sizes[t]);
        Fp32ToBf16Cpu(fp32[t].p.data(), cast.data(), cast.size());
        ASSERT_EQ(cast, params[t]) << t;
      }
    }
  }
  // The parameters moved away from their first values' rounding.
  std::vector<uint16_t> first(sizes[1]);
  State again = Random(sizes[1], 101);
  Fp32ToBf16Cpu(again.p.data(), first.data(), first.size());
  EXPECT_NE(first, params[1]);
}

TEST(AdamWTest, CloseToAdamWInDouble) {
  State s = Random(10000, 42);
  std::vector<double> p(s.p.begin(), s.p.end()), m(s.p.size(), 0), v(s.p.size(), 0);
  AdamWHyper hyper;
  double worst = 0;
  for (uint64_t step = 1; step <= 50; ++step) {
    hyper.step = step;
    Step({&s}, hyper, 2);
    const double bc1 = 1 - std::pow(hyper.beta1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(hyper.beta2, static_cast<double>(step));
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = s.g[i];
      p[i] *= 1 - hyper.lr * hyper.weight_decay;
      m[i] = hyper.beta1 * m[i] + (1 - hyper.beta1) * g;
      v[i] = hyper.beta2 * v[i] + (1 - hyper.beta2) * g * g;
      p[i] -= hyper.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + hyper.eps);
      worst = std::max(worst, std::abs(p[i] - s.p[i]) / (std::abs(p[i]) + 1e-3));
    }
  }
  // float against double over 50 steps: rounding of 1e-7 per operation adds up.
  EXPECT_LT(worst, 5e-5);
}

}  // namespace
}  // namespace actstash::kernels
