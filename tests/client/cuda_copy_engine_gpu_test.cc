// CudaCopyEngine on a real device (label gpu: skips without one): ordering
// against a deliberately slowed compute stream, D2H/H2D round trips through
// cudaHostRegister'ed mmap memory and through pageable memory, a transposed
// device tensor gathered straight into registered host memory, many copies
// under a small in-flight bound, and OrderAfterAsync without a host wait.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "actstash/copy_engine.h"
#include "tests/client/spin_kernel.h"

namespace actstash {
namespace {

using ::actstash::testing::LaunchFill;
using ::actstash::testing::LaunchSpin;

uint8_t FillByte(uint32_t seed, size_t i) { return static_cast<uint8_t>(seed + i * 7); }

// Anonymous mmap'ed memory registered with CUDA (pinned, mapped).
class RegisteredHost {
 public:
  explicit RegisteredHost(size_t size) : size_(size) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    ptr_ = static_cast<uint8_t*>(p);
    registered_ = cudaHostRegister(ptr_, size, cudaHostRegisterMapped) == cudaSuccess;
  }
  ~RegisteredHost() {
    if (registered_) cudaHostUnregister(ptr_);
    if (ptr_ != nullptr) munmap(ptr_, size_);
  }
  RegisteredHost(const RegisteredHost&) = delete;
  RegisteredHost& operator=(const RegisteredHost&) = delete;
  bool ok() const { return registered_; }
  uint8_t* get() const { return ptr_; }
  // The pointer kernels use (the host pointer itself on most systems).
  uint8_t* device() const {
    void* mapped = nullptr;
    return cudaHostGetDevicePointer(&mapped, ptr_, 0) == cudaSuccess ? static_cast<uint8_t*>(mapped)
                                                                     : nullptr;
  }

 private:
  uint8_t* ptr_ = nullptr;
  size_t size_;
  bool registered_ = false;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size) {
    if (cudaMalloc(&ptr_, size == 0 ? 1 : size) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

class CudaCopyEngineGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    engine_.reset();
    if (compute_ != nullptr) cudaStreamDestroy(compute_);
  }
  void MakeEngine(uint32_t max_in_flight) {
    CudaCopyEngineOptions options;
    options.max_in_flight = max_in_flight;
    auto engine = CreateCudaCopyEngine(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }
  StreamHandle compute() const { return StreamHandle{reinterpret_cast<uintptr_t>(compute_)}; }

  // Offload's chain through `host` (kCopies * kBytes): a slowed producer
  // fills a reused activation slot, the store copies it out after the
  // compute stream, the fetch brings it back after the store, and the
  // compute stream, ordered after the fetch, copies it to `out`.
  void RunChain(uint8_t* host) {
    constexpr int kCopies = 600;
    constexpr size_t kBytes = 16 << 10;
    constexpr int kSlots = 3;
    DeviceBuffer act(kSlots * kBytes), in(kSlots * kBytes), out(kCopies * kBytes);
    ASSERT_NE(out.get(), nullptr);
    std::vector<std::shared_ptr<CopyEvent>> last_store(kSlots);
    for (int i = 0; i < kCopies; ++i) {
      const int slot = i % kSlots;
      if (last_store[slot] != nullptr) {
        ASSERT_TRUE(engine_->OrderAfterAsync(compute(), *last_store[slot]).ok());
      }
      ASSERT_EQ(LaunchSpin(20000, compute_), cudaSuccess);
      ASSERT_EQ(LaunchFill(act.get() + slot * kBytes, kBytes, i, compute_), cudaSuccess);
      auto store = engine_->CopyAsync(CopyStream::kStore, host + i * kBytes,
                                      act.get() + slot * kBytes, kBytes, compute());
      ASSERT_TRUE(store.ok()) << store.status();
      const std::shared_ptr<CopyEvent> deps[] = {*store};
      auto fetch = engine_->CopyAsync(CopyStream::kFetch, in.get() + slot * kBytes,
                                      host + i * kBytes, kBytes, compute(), deps);
      ASSERT_TRUE(fetch.ok()) << fetch.status();
      ASSERT_TRUE(engine_->OrderAfterAsync(compute(), **fetch).ok());
      ASSERT_EQ(cudaMemcpyAsync(out.get() + i * kBytes, in.get() + slot * kBytes, kBytes,
                                cudaMemcpyDeviceToDevice, compute_),
                cudaSuccess);
      last_store[slot] = *store;
    }
    ASSERT_EQ(cudaStreamSynchronize(compute_), cudaSuccess);
    engine_->Synchronize();
    std::vector<uint8_t> result(kCopies * kBytes);
    ASSERT_EQ(cudaMemcpy(result.data(), out.get(), result.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int i = 0; i < kCopies; ++i) {
      for (size_t b = 0; b < kBytes; ++b) {
        ASSERT_EQ(host[i * kBytes + b], FillByte(i, b)) << "stored copy " << i;
        ASSERT_EQ(result[i * kBytes + b], FillByte(i, b)) << "fetched copy " << i;
      }
    }
  }

  cudaStream_t compute_ = nullptr;
  std::unique_ptr<CopyEngine> engine_;
};

TEST_F(CudaCopyEngineGpuTest, ChainThroughRegisteredMmapMemory) {
  MakeEngine(8);
  RegisteredHost host(600 * (16 << 10));
  ASSERT_TRUE(host.ok());
  RunChain(host.get());
}

TEST_F(CudaCopyEngineGpuTest, ChainThroughPageableMemory) {
  MakeEngine(8);
  std::vector<uint8_t> host(600 * (16 << 10));
  RunChain(host.data());
}

// A transposed (non-contiguous) device tensor packed straight into mapped
// registered host memory, then unpacked into a fresh device tensor.
TEST_F(CudaCopyEngineGpuTest, GatherTransposedDeviceTensorIntoRegisteredHost) {
  MakeEngine(4);
  constexpr int64_t kRows = 513, kCols = 257;
  constexpr size_t kBytes = kRows * kCols * 4;
  std::vector<float> tensor(kRows * kCols);
  for (size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<float>(i) * 0.5f;
  DeviceBuffer d_tensor(kBytes), d_back(kBytes);
  RegisteredHost host(kBytes);
  ASSERT_TRUE(host.ok());
  ASSERT_NE(host.device(), nullptr);
  ASSERT_EQ(LaunchSpin(2000000, compute_), cudaSuccess);  // the upload runs late
  ASSERT_EQ(
      cudaMemcpyAsync(d_tensor.get(), tensor.data(), kBytes, cudaMemcpyHostToDevice, compute_),
      cudaSuccess);
  const TensorLayout transposed{{kCols, kRows}, {1, kCols}, 4};
  auto gather = engine_->GatherAsync(CopyStream::kStore, host.device(), kBytes, d_tensor.get(),
                                     transposed, compute());
  ASSERT_TRUE(gather.ok()) << gather.status();
  ASSERT_TRUE((*gather)->Wait().ok());
  const auto* packed = reinterpret_cast<const float*>(host.get());
  for (int64_t c = 0; c < kCols; ++c) {
    for (int64_t r = 0; r < kRows; ++r) {
      ASSERT_EQ(packed[c * kRows + r], tensor[r * kCols + c]) << r << "," << c;
    }
  }
  auto scatter = engine_->ScatterAsync(CopyStream::kFetch, d_back.get(), transposed, host.device(),
                                       kBytes, compute());
  ASSERT_TRUE(scatter.ok()) << scatter.status();
  ASSERT_TRUE((*scatter)->Wait().ok());
  std::vector<float> back(tensor.size());
  ASSERT_EQ(cudaMemcpy(back.data(), d_back.get(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, tensor);
}

// Thousands of small copies under max_in_flight 4 (the submitting thread
// waits for the oldest), with host work after them in order.
TEST_F(CudaCopyEngineGpuTest, ManyCopiesUnderASmallInFlightBound) {
  MakeEngine(4);
  constexpr int kCopies = 5000;
  constexpr size_t kBytes = 4096;
  DeviceBuffer src(kCopies * kBytes);
  RegisteredHost host(kCopies * kBytes);
  ASSERT_TRUE(host.ok());
  ASSERT_EQ(LaunchFill(src.get(), kCopies * kBytes, 3, compute_), cudaSuccess);
  std::vector<std::shared_ptr<CopyEvent>> events;
  int next = 0;
  std::vector<int> order;
  for (int i = 0; i < kCopies; ++i) {
    auto copy = engine_->CopyAsync(CopyStream::kStore, host.get() + i * kBytes,
                                   src.get() + i * kBytes, kBytes, compute());
    ASSERT_TRUE(copy.ok()) << copy.status();
    events.push_back(*copy);
    if (i % 500 == 499) {
      events.push_back(engine_->SubmitAsync(CopyStream::kStore, [&order, &next] {
        order.push_back(next++);
        return absl::OkStatus();
      }));
    }
  }
  for (const auto& event : events) ASSERT_TRUE(event->Wait().ok());
  for (size_t b = 0; b < kCopies * kBytes; ++b) ASSERT_EQ(host.get()[b], FillByte(3, b)) << b;
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

// OrderAfterAsync returns at once while the copy waits for a long kernel.
TEST_F(CudaCopyEngineGpuTest, OrderAfterAsyncDoesNotWaitOnTheHost) {
  MakeEngine(4);
  DeviceBuffer d(4096);
  RegisteredHost host(4096);
  ASSERT_TRUE(host.ok());
  ASSERT_EQ(LaunchSpin(int64_t{1} << 30, compute_), cudaSuccess);  // ~0.5 s
  auto copy = engine_->CopyAsync(CopyStream::kFetch, d.get(), host.get(), 4096, compute());
  ASSERT_TRUE(copy.ok());
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(
      engine_->OrderAfterAsync(StreamHandle{reinterpret_cast<uintptr_t>(other)}, **copy).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_FALSE((*copy)->Done());
  EXPECT_EQ(cudaStreamQuery(other), cudaErrorNotReady);  // it waits for the copy
  EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  EXPECT_TRUE((*copy)->Done());
  cudaStreamDestroy(other);
}

}  // namespace
}  // namespace actstash
