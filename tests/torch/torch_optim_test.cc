// actstash::torch::OffloadAdamW against torch::optim::AdamW on the same
// seed, with a real actstashd: the moments live in the session's leased pool
// memory (the daemon's usage and the client's state count say so, and the
// tensors' addresses lie in a mapped pool segment), parameters and moments
// are bitwise equal after 20 steps, save/load resumes bitwise with or
// without actstash, and bad parameters or a small quota are refused with
// nothing kept.
#include "actstash/torch_optim.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "actstash/client.h"
#include "testing/daemon_process.h"
#include "tests/torch/session_counts.h"

namespace actstash::torch {
namespace {

using ::actstash::testing::DaemonProcess;

constexpr int kSteps = 20;

void Seed(uint64_t seed) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

std::vector<at::Tensor> Params(uint64_t seed) {
  Seed(seed);
  std::vector<at::Tensor> params;
  const int64_t dims[] = {32, 128, 128, 10};
  for (int i = 0; i < 3; ++i) {
    params.push_back((at::randn({dims[i + 1], dims[i]}) * 0.1).requires_grad_());
    params.push_back((at::randn({dims[i + 1]}) * 0.1).requires_grad_());
  }
  return params;
}

std::vector<at::Tensor> Clone(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// Steps [from, to) of an MLP's training; the data is a function of the step.
void Train(std::vector<at::Tensor>& params, ::torch::optim::Optimizer& opt, int from, int to) {
  for (int step = from; step < to; ++step) {
    Seed(1000 + step);
    at::Tensor h = at::randn({64, 32});
    at::Tensor y = at::randint(10, {64}, at::kLong);
    for (size_t i = 0; i + 2 < params.size(); i += 2) {
      h = at::tanh(at::linear(h, params[i], params[i + 1]));
    }
    at::Tensor logits = at::linear(h, params[params.size() - 2], params.back());
    opt.zero_grad();
    at::nll_loss(at::log_softmax(logits, 1), y).backward();
    opt.step();
  }
}

// The file behind the mapping of `address` (/proc/self/maps).
std::string MappingOf(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(address);
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, perms, offset, dev, inode, path;
    fields >> range >> perms >> offset >> dev >> inode >> path;
    const size_t dash = range.find('-');
    const uintptr_t start = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (start <= at && at < end) return path;
  }
  return "";
}

class TorchOptimTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    at::set_num_threads(1);
    testing::DaemonProcessOptions options;
    options.segment_size = "4MiB";
    auto daemon = DaemonProcess::Start(options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  std::shared_ptr<Client> Connect(uint64_t quota = 0) {
    ClientOptions options;
    options.address = daemon_->address();
    options.quota_bytes = quota;
    options.client_name = "torch_optim_test";
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::shared_ptr<Client>(std::move(*client)) : nullptr;
  }
  static uint64_t Bytes(const std::vector<at::Tensor>& params, int per) {
    uint64_t n = 0;
    for (const at::Tensor& p : params) n += static_cast<uint64_t>(p.numel()) * 4 * per;
    return n;
  }
  static DaemonProcess* daemon_;
};
DaemonProcess* TorchOptimTest::daemon_ = nullptr;

const ::torch::optim::AdamWParamState& StateOf(::torch::optim::Optimizer& opt,
                                               const at::Tensor& p) {
  const ::torch::optim::AdamWParamState* state = AdamWStateOf(opt, p);
  if (state == nullptr) throw std::out_of_range("the optimizer holds no state for a parameter");
  return *state;
}

TEST_F(TorchOptimTest, BitwiseEqualToAdamWWithTheMomentsInThePool) {
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "adamw");
    std::vector<at::Tensor> plain = Params(3);
    std::vector<at::Tensor> ours = Clone(plain);
    auto options = ::torch::optim::AdamWOptions(3e-3).weight_decay(0.1).amsgrad(amsgrad);
    ::torch::optim::AdamW reference(plain, options);
    std::shared_ptr<Client> client = Connect();
    ASSERT_NE(client, nullptr);
    auto before = CountSession(*client);
    ASSERT_TRUE(before.ok()) << before.status();
    auto opt = OffloadAdamW::Create(client, ours, options);
    ASSERT_TRUE(opt.ok()) << opt.status();
    const uint64_t expected = Bytes(ours, amsgrad ? 3 : 2);
    EXPECT_EQ((*opt)->offloaded_bytes(), expected);
    auto after = CountSession(*client);
    ASSERT_TRUE(after.ok()) << after.status();
    // The bytes went to the daemon: the session's pool usage holds them.
    EXPECT_EQ(after->state_bytes, expected);
    EXPECT_GE(after->used_bytes - before->used_bytes, expected);
    Train(plain, reference, 0, kSteps);
    Train(ours, **opt, 0, kSteps);
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(at::equal(plain[i], ours[i])) << i;
      const auto& r = StateOf(reference, plain[i]);
      const auto& o = StateOf(**opt, ours[i]);
      EXPECT_EQ(o.step(), kSteps);
      EXPECT_TRUE(at::equal(r.exp_avg(), o.exp_avg())) << i;
      EXPECT_TRUE(at::equal(r.exp_avg_sq(), o.exp_avg_sq())) << i;
      // Stepped in place in the pool: a mapped segment, not the heap.
      EXPECT_NE(MappingOf(o.exp_avg().data_ptr()).find("actstash-segment"), std::string::npos);
      if (amsgrad) {
        EXPECT_TRUE(at::equal(r.max_exp_avg_sq(), o.max_exp_avg_sq())) << i;
        EXPECT_NE(MappingOf(o.max_exp_avg_sq().data_ptr()).find("actstash-segment"),
                  std::string::npos);
      }
    }
    opt->reset();  // the buffers go back with the last tensors viewing them
    auto gone = CountSession(*client);
    ASSERT_TRUE(gone.ok());
    EXPECT_EQ(gone->state_bytes, 0u);
  }
}

TEST_F(TorchOptimTest, SaveAndLoadResumeBitwiseWithOrWithoutActstash) {
  auto options = ::torch::optim::AdamWOptions(1e-3);
  std::vector<at::Tensor> straight = Params(4);
  std::vector<at::Tensor> first = Clone(straight);
  ::torch::optim::AdamW reference(straight, options);
  Train(straight, reference, 0, kSteps);

  std::shared_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  auto opt = OffloadAdamW::Create(client, first, options);
  ASSERT_TRUE(opt.ok()) << opt.status();
  Train(first, **opt, 0, kSteps / 2);
  std::stringstream saved;
  ::torch::save(**opt, saved);
  const std::string bytes = saved.str();

  // Into a new OffloadAdamW: the loaded moments go into its pool buffers.
  std::vector<at::Tensor> resumed = Clone(first);
  auto opt2 = OffloadAdamW::Create(client, resumed, options);
  ASSERT_TRUE(opt2.ok()) << opt2.status();
  std::istringstream in2(bytes);
  ::torch::load(**opt2, in2);
  for (const at::Tensor& p : resumed) {
    EXPECT_NE(MappingOf(StateOf(**opt2, p).exp_avg().data_ptr()).find("actstash-segment"),
              std::string::npos);
  }
  Train(resumed, **opt2, kSteps / 2, kSteps);
  // And into libtorch's own AdamW.
  std::vector<at::Tensor> plain = Clone(first);
  ::torch::optim::AdamW opt3(plain, options);
  std::istringstream in3(bytes);
  ::torch::load(opt3, in3);
  Train(plain, opt3, kSteps / 2, kSteps);
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(at::equal(straight[i], resumed[i])) << i;
    EXPECT_TRUE(at::equal(straight[i], plain[i])) << i;
  }
}

TEST_F(TorchOptimTest, BadParametersAndASmallQuotaAreRefusedWithNothingKept) {
  std::shared_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  auto refused = [&](std::vector<at::Tensor> params, const char* why) {
    auto opt = OffloadAdamW::Create(client, params);
    ASSERT_FALSE(opt.ok()) << why;
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument) << opt.status();
    EXPECT_NE(std::string(opt.status().message()).find(why), std::string::npos) << opt.status();
  };
  refused({at::zeros({8, 8}).t().requires_grad_()}, "not contiguous");
  refused({at::zeros({8}, at::kDouble).requires_grad_()}, "not fp32");
  refused({at::zeros({4, 4}).to_sparse().requires_grad_()}, "sparse");
  auto bad = OffloadAdamW::Create(client, {at::zeros({8}).requires_grad_()},
                                  ::torch::optim::AdamWOptions(-1.0));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  auto counts = CountSession(*client);
  ASSERT_TRUE(counts.ok());
  EXPECT_EQ(counts->state_bytes, 0u);

  // A session whose quota cannot hold the states: RESOURCE_EXHAUSTED, and
  // every buffer reserved on the way goes back.
  std::shared_ptr<Client> small = Connect(16 << 20);
  ASSERT_NE(small, nullptr);
  std::vector<at::Tensor> big;
  for (int i = 0; i < 4; ++i) big.push_back(at::zeros({1 << 20}).requires_grad_());  // 4 MiB
  auto full = OffloadAdamW::Create(small, big);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_NE(std::string(full.status().message()).find("nothing was kept"), std::string::npos);
  auto left = CountSession(*small);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->state_bytes, 0u);
}

}  // namespace
}  // namespace actstash::torch
