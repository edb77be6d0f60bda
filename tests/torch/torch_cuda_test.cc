// actstash::torch on CUDA tensors against a real actstashd: an Offloader with
// a CudaCopyEngine stores activations D2H into leased, registered memory
// after the current stream and brings them back with the current stream
// waiting; gradients must be bitwise equal to plain libtorch autograd, also
// when the compute stream is slowed by a spin kernel before each producer
// (the race that corrupts gradients when a copy does not wait for the
// kernel that writes its source). Built only against a libtorch with CUDA
// (pip's torch); skips without a device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "actstash/torch.h"
#include "testing/daemon_process.h"
#include "tests/torch/session_counts.h"

namespace actstash::torch {
namespace {

using ::actstash::testing::DaemonProcess;

// About 1 ms of spinning on an H100's clock: long enough that a D2H copy
// that does not wait for its producer reads the buffer before it is written.
constexpr int64_t kSpinCycles = 2'000'000;

struct CudaMlp {
  CudaMlp(at::ScalarType dtype, bool slow) : slow(slow) {
    at::manual_seed(7);
    const int64_t dims[] = {256, 1024, 1024, 1024, 16};
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (int i = 0; i < 4; ++i) {
      params.push_back((at::randn({dims[i + 1], dims[i]}, options) * 0.05).requires_grad_());
      params.push_back((at::randn({dims[i + 1]}, options) * 0.05).requires_grad_());
    }
  }
  at::Tensor Layer(const at::Tensor& h, int i) const {
    if (slow) at::cuda::sleep(kSpinCycles);  // on the current stream, before the producer
    return at::gelu(at::linear(h, params[2 * i], params[2 * i + 1]));
  }
  at::Tensor Block(const at::Tensor& h) const { return Layer(Layer(h, 1), 2); }
  at::Tensor Loss(const at::Tensor& x, const at::Tensor& y, bool checkpoint,
                  const std::shared_ptr<Offloader>& offloader) const {
    at::Tensor h = Layer(x, 0);
    h = checkpoint ? Checkpoint([this](const at::Tensor& t) { return Block(t); }, h, offloader)
                   : Block(h);
    return at::cross_entropy_loss(at::linear(h, params[6], params[7]).to(at::kFloat), y);
  }
  bool slow;
  std::vector<at::Tensor> params;
};

struct Result {
  std::vector<at::Tensor> grads;
  OffloadStats after_forward;
};

Result Train(CudaMlp& mlp, bool checkpoint, const std::shared_ptr<Offloader>& offloader) {
  for (at::Tensor& p : mlp.params) p.mutable_grad() = at::Tensor();
  at::manual_seed(1234);
  std::vector<at::Tensor> losses;
  {
    std::unique_ptr<OffloadScope> scope;
    if (offloader && !checkpoint) scope = std::make_unique<OffloadScope>(offloader);
    for (int i = 0; i < 2; ++i) {
      const auto options = at::TensorOptions().device(at::kCUDA);
      at::Tensor x = at::randn({512, 256}, options.dtype(mlp.params[0].scalar_type()));
      at::Tensor y = at::randint(16, {512}, options.dtype(at::kLong));
      losses.push_back(mlp.Loss(x, y, checkpoint, checkpoint ? offloader : nullptr));
    }
  }
  Result result;
  if (offloader) result.after_forward = offloader->stats();
  for (at::Tensor& loss : losses) loss.backward();
  for (const at::Tensor& p : mlp.params) result.grads.push_back(p.grad().clone().cpu());
  return result;
}

class TorchCudaTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    // Deterministic cuBLAS (before its first handle) and kernels: "bitwise"
    // then compares actstash with plain autograd, not run-to-run noise.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
    if (!at::cuda::is_available() || !CudaDeviceAvailable()) {
      GTEST_SKIP() << "skipped (no GPU): torch sees " << static_cast<int>(at::cuda::device_count())
                   << " CUDA device(s); actstash " << (CudaDeviceAvailable() ? "does" : "does not");
    }
    testing::DaemonProcessOptions options;
    options.segment_size = "64MiB";
    auto daemon = DaemonProcess::Start(options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    ClientOptions client_options;
    client_options.address = daemon_->address();
    client_options.client_name = "torch_cuda_test";
    auto client = Client::Connect(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::shared_ptr<Client>(std::move(*client));
    ASSERT_TRUE(client_->attached()) << client_->attach_status();
  }

  std::shared_ptr<Offloader> MakeOffloader() {
    CudaCopyEngineOptions engine_options;
    engine_options.device = 0;
    auto engine = CreateCudaCopyEngine(engine_options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    OffloadOptions options;
    options.min_bytes = 64 << 10;
    options.cuda_engine = std::move(*engine);
    options.current_stream = [](int device) {
      return reinterpret_cast<uintptr_t>(
          c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
    };
    auto offloader = Offloader::Create(client_, options);
    EXPECT_TRUE(offloader.ok()) << offloader.status();
    return offloader.ok() ? *offloader : nullptr;
  }

  // The caching allocator hands the next run the blocks the plain run
  // freed, still holding its activations: a copy that raced its producer
  // could read the right bytes by luck. Fill every cached block with NaN
  // first, so that such a copy reads NaN and the gradients differ.
  static void Poison() {
    c10::cuda::CUDACachingAllocator::emptyCache();
    at::Tensor poison =
        at::full({256ll << 20}, NAN, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
    c10::cuda::device_synchronize();
  }

  void ExpectBitwise(const Result& expected, const Result& actual) {
    ASSERT_EQ(expected.grads.size(), actual.grads.size());
    for (size_t i = 0; i < expected.grads.size(); ++i) {
      EXPECT_TRUE(at::equal(expected.grads[i], actual.grads[i]))
          << "grad " << i << " max diff "
          << (expected.grads[i].to(at::kFloat) - actual.grads[i].to(at::kFloat))
                 .abs()
                 .max()
                 .item<float>();
    }
  }

  void ExpectAllReleased(Offloader& offloader) {
    offloader.Synchronize();
    EXPECT_EQ(offloader.stats().live_tensors, 0u);
    EXPECT_EQ(offloader.stats().live_bytes, 0u);
    auto counts = CountSession(offloader.client());
    ASSERT_TRUE(counts.ok()) << counts.status();
    EXPECT_EQ(counts->zero_copy_objects, 0u);
    EXPECT_EQ(counts->inline_objects, 0u);
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::shared_ptr<Client> client_;
};

// The plain run's backward comes first, on torch's base engine, before any
// Offloader installs actstash's hook engine: the order in which a second
// engine of its own found no CUDA queue (see offload_scope.cc's HookEngine).
TEST_P(TorchCudaTest, OffloadIsBitwiseWithASlowComputeStream) {
  for (bool slow : {false, true}) {
    SCOPED_TRACE(slow ? "spin kernel before each producer" : "no spin");
    CudaMlp mlp(GetParam(), slow);
    const Result plain = Train(mlp, /*checkpoint=*/false, nullptr);
    auto offloader = MakeOffloader();
    ASSERT_NE(offloader, nullptr);
    Poison();
    const Result offloaded = Train(mlp, /*checkpoint=*/false, offloader);
    ExpectBitwise(plain, offloaded);
    // The effect, not only the result: CUDA tensors went to leased memory and came back.
    EXPECT_GE(offloaded.after_forward.tensors_offloaded, 6u);
    EXPECT_GT(offloaded.after_forward.live_bytes, 1u << 20);
    // Each offloaded tensor came back from leased memory, or, when backward
    // reached it while its store still waited behind the slowed stream, from
    // its source (which the engine holds until the store ends).
    const OffloadStats after = offloader->stats();
    EXPECT_EQ(after.tensors_fetched + after.unpacked_from_source,
              offloaded.after_forward.tensors_offloaded);
    EXPECT_GE(after.tensors_fetched, offloaded.after_forward.tensors_offloaded / 2);
    EXPECT_EQ(after.store_failures, 0u);
    ExpectAllReleased(*offloader);
  }
}

TEST_P(TorchCudaTest, CheckpointOffloadIsBitwiseWithASlowComputeStream) {
  CudaMlp mlp(GetParam(), /*slow=*/true);
  const Result plain = Train(mlp, /*checkpoint=*/false, nullptr);
  auto offloader = MakeOffloader();
  ASSERT_NE(offloader, nullptr);
  Poison();
  const Result checkpointed = Train(mlp, /*checkpoint=*/true, offloader);
  ExpectBitwise(plain, checkpointed);
  EXPECT_GE(checkpointed.after_forward.tensors_offloaded, 2u);  // each block's input
  EXPECT_EQ(offloader->stats().tensors_fetched, checkpointed.after_forward.tensors_offloaded);
  ExpectAllReleased(*offloader);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TorchCudaTest, ::testing::Values(at::kFloat, at::kBFloat16),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

}  // namespace
}  // namespace actstash::torch
