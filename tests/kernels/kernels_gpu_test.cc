// GPU kernels equal their CPU implementations (label gpu: skips without a
// CUDA device). The argument checks and the launch-error path are tested
// without a device too.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/bf16_cuda.h"
#include "kernels/checksum64.h"
#include "kernels/checksum64_cuda.h"
#include "kernels/strided_copy.h"
#include "kernels/strided_copy_cuda.h"
#include "tests/kernels/test_layouts.h"

namespace actstash::kernels {
namespace {

using ::actstash::kernels::testing::Describe;
using ::actstash::kernels::testing::NaiveExtent;
using ::actstash::kernels::testing::Numel;
using ::actstash::kernels::testing::RandomArbitrary;
using ::actstash::kernels::testing::RandomView;

bool HaveDevice() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();  // clear a "no device" error
  return ok;
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t size) {
  std::vector<uint8_t> bytes(size);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// cudaMalloc'ed bytes, freed with the object.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t size) : size_(size) {
    if (cudaMalloc(&ptr_, size == 0 ? 1 : size) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  void Upload(const std::vector<uint8_t>& bytes) const {
    ASSERT_EQ(cudaMemcpy(ptr_, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> bytes(size_);
    EXPECT_EQ(cudaMemcpy(bytes.data(), ptr_, size_, cudaMemcpyDeviceToHost), cudaSuccess);
    return bytes;
  }

 private:
  void* ptr_ = nullptr;
  size_t size_;
};

class KernelsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

  cudaStream_t stream_ = nullptr;
};

TEST_F(KernelsGpuTest, GatherEqualsCpu) {
  std::mt19937_64 rng(21);
  for (int iter = 0; iter < 400; ++iter) {
    const int elem = 1 << (iter % 4);
    int64_t offset = 0;
    int64_t base_numel = 0;
    const StridedLayout layout = iter % 3 == 2
                                     ? RandomArbitrary(rng, elem)
                                     : RandomView(rng, elem, iter % 3 == 1, &offset, &base_numel);
    if (iter % 3 == 2) base_numel = NaiveExtent(layout);
    const std::vector<uint8_t> src = RandomBytes(rng, static_cast<size_t>(base_numel * elem));
    const size_t bytes = static_cast<size_t>(Numel(layout) * elem);
    std::vector<uint8_t> expected(bytes + 8, 0xCD);
    ASSERT_TRUE(GatherCpu(src.data() + offset * elem, layout, expected.data(), bytes).ok());
    DeviceBytes d_src(src.size());
    DeviceBytes d_dst(expected.size());
    d_src.Upload(src);
    d_dst.Upload(std::vector<uint8_t>(expected.size(), 0xCD));
    ASSERT_TRUE(GatherAsync(d_src.get() + offset * elem, layout, d_dst.get(), bytes, stream_).ok())
        << Describe(layout);
    Sync();
    ASSERT_EQ(d_dst.Download(), expected) << Describe(layout);
  }
}

TEST_F(KernelsGpuTest, ScatterEqualsCpu) {
  std::mt19937_64 rng(22);
  for (int iter = 0; iter < 400; ++iter) {
    const int elem = 1 << (iter % 4);
    int64_t offset = 0;
    int64_t base_numel = 0;
    const StridedLayout layout = RandomView(rng, elem, false, &offset, &base_numel);
    const std::vector<uint8_t> src = RandomBytes(rng, static_cast<size_t>(Numel(layout) * elem));
    std::vector<uint8_t> expected = RandomBytes(rng, static_cast<size_t>(base_numel * elem));
    DeviceBytes d_src(src.size());
    DeviceBytes d_dst(expected.size());
    d_src.Upload(src);
    d_dst.Upload(expected);
    ASSERT_TRUE(ScatterCpu(src.data(), src.size(), expected.data() + offset * elem, layout).ok());
    ASSERT_TRUE(
        ScatterAsync(d_src.get(), src.size(), d_dst.get() + offset * elem, layout, stream_).ok())
        << Describe(layout);
    Sync();
    ASSERT_EQ(d_dst.Download(), expected) << Describe(layout);
  }
}

// CudaCopyEngine's path: a transposed device tensor packed straight into
// registered (pinned, mapped) host memory, and unpacked from it.
TEST_F(KernelsGpuTest, GatherIntoAndScatterFromMappedHostMemory) {
  std::mt19937_64 rng(23);
  StridedLayout layout{};
  layout.ndim = 3;
  layout.elem_size = 2;
  const int64_t sizes[] = {64, 300, 33};
  const int64_t strides[] = {1, 64 * 33, 64};  // a permuted dense tensor
  for (int d = 0; d < 3; ++d) {
    layout.sizes[d] = sizes[d];
    layout.strides[d] = strides[d];
  }
  const std::vector<uint8_t> tensor = RandomBytes(rng, 64 * 300 * 33 * 2);
  DeviceBytes d_tensor(tensor.size());
  d_tensor.Upload(tensor);
  std::vector<uint8_t> host(tensor.size());
  ASSERT_EQ(cudaHostRegister(host.data(), host.size(), cudaHostRegisterMapped), cudaSuccess);
  void* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host.data(), 0), cudaSuccess);
  ASSERT_TRUE(GatherAsync(d_tensor.get(), layout, mapped, host.size(), stream_).ok());
  Sync();
  std::vector<uint8_t> expected(tensor.size());
  ASSERT_TRUE(GatherCpu(tensor.data(), layout, expected.data(), expected.size()).ok());
  EXPECT_EQ(host, expected);
  DeviceBytes d_back(tensor.size());
  ASSERT_TRUE(ScatterAsync(mapped, host.size(), d_back.get(), layout, stream_).ok());
  Sync();
  EXPECT_EQ(d_back.Download(), tensor);
  ASSERT_EQ(cudaHostUnregister(host.data()), cudaSuccess);
}

// An extent beyond 2^32 elements takes the 64-bit index path.
TEST_F(KernelsGpuTest, GatherWith64BitOffsets) {
  StridedLayout layout{};
  layout.ndim = 2;
  layout.elem_size = 1;
  layout.sizes[0] = 2;
  layout.sizes[1] = 3;
  layout.strides[0] = (int64_t{1} << 32) + 5;
  layout.strides[1] = 7;
  DeviceBytes d_src(static_cast<size_t>(NaiveExtent(layout)));
  if (d_src.get() == nullptr) GTEST_SKIP() << "cannot allocate 4 GiB on the device";
  std::vector<uint8_t> expected;
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      const auto value = static_cast<uint8_t>(10 * i + j + 1);
      const int64_t off = i * layout.strides[0] + j * layout.strides[1];
      ASSERT_EQ(cudaMemcpy(d_src.get() + off, &value, 1, cudaMemcpyHostToDevice), cudaSuccess);
      expected.push_back(value);
    }
  }
  DeviceBytes d_dst(6);
  ASSERT_TRUE(GatherAsync(d_src.get(), layout, d_dst.get(), 6, stream_).ok());
  Sync();
  EXPECT_EQ(d_dst.Download(), expected);
}

TEST_F(KernelsGpuTest, ChecksumEqualsCpu) {
  std::mt19937_64 rng(24);
  DeviceBytes d_result(8);
  const std::vector<size_t> sizes = {0, 1, 4095, 4096, 4097, (1u << 20) + 3, (64u << 20) + 5};
  for (size_t size : sizes) {
    const std::vector<uint8_t> data = RandomBytes(rng, size + 1);
    DeviceBytes d_data(data.size());
    d_data.Upload(data);
    for (size_t shift : {size_t{0}, size_t{1}}) {  // aligned and misaligned starts
      const size_t n = size;
      ASSERT_TRUE(Checksum64Async(d_data.get() + shift, n,
                                  reinterpret_cast<uint64_t*>(d_result.get()), stream_)
                      .ok());
      Sync();
      uint64_t got = 0;
      std::memcpy(&got, d_result.Download().data(), 8);
      EXPECT_EQ(got, Checksum64Cpu(data.data() + shift, n, 4)) << n << " shift " << shift;
    }
  }
}

TEST_F(KernelsGpuTest, Bf16ConversionsEqualCpu) {
  std::mt19937_64 rng(25);
  std::vector<uint32_t> bits(1 << 20);
  for (uint32_t& b : bits) b = static_cast<uint32_t>(rng());
  for (uint32_t special : {0x7F800001u, 0xFF800000u, 0x80000000u, 0x00018000u, 0x7F7FFFFFu}) {
    bits.push_back(special);
  }
  std::vector<float> floats(bits.size());
  std::memcpy(floats.data(), bits.data(), bits.size() * 4);
  std::vector<uint16_t> expected(floats.size());
  Fp32ToBf16Cpu(floats.data(), expected.data(), floats.size());
  DeviceBytes d_in(floats.size() * 4);
  DeviceBytes d_out(floats.size() * 4);
  ASSERT_EQ(cudaMemcpy(d_in.get(), floats.data(), floats.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_TRUE(Fp32ToBf16Async(reinterpret_cast<const float*>(d_in.get()),
                              reinterpret_cast<uint16_t*>(d_out.get()), floats.size(), stream_)
                  .ok());
  Sync();
  std::vector<uint16_t> got(floats.size());
  ASSERT_EQ(cudaMemcpy(got.data(), d_out.get(), got.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(got, expected);  // bit-identical, NaNs included (same math)

  std::vector<uint16_t> all16(0x10000);
  for (uint32_t i = 0; i < 0x10000; ++i) all16[i] = static_cast<uint16_t>(i);
  ASSERT_EQ(cudaMemcpy(d_in.get(), all16.data(), all16.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<uint16_t> expected16(all16.size());
  Fp16ToBf16Cpu(all16.data(), expected16.data(), all16.size());
  ASSERT_TRUE(Fp16ToBf16Async(reinterpret_cast<const uint16_t*>(d_in.get()),
                              reinterpret_cast<uint16_t*>(d_out.get()), all16.size(), stream_)
                  .ok());
  Sync();
  std::vector<uint16_t> got16(all16.size());
  ASSERT_EQ(cudaMemcpy(got16.data(), d_out.get(), got16.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(got16, expected16);

  std::vector<float> expected32(all16.size());
  Bf16ToFp32Cpu(all16.data(), expected32.data(), all16.size());
  ASSERT_TRUE(Bf16ToFp32Async(reinterpret_cast<const uint16_t*>(d_in.get()),
                              reinterpret_cast<float*>(d_out.get()), all16.size(), stream_)
                  .ok());
  Sync();
  std::vector<float> got32(all16.size());
  ASSERT_EQ(cudaMemcpy(got32.data(), d_out.get(), got32.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(0, std::memcmp(got32.data(), expected32.data(), got32.size() * 4));
}

// The checks run before any CUDA call: these need no device.
TEST(KernelsCudaArgumentsTest, BadArgumentsAreRejectedBeforeLaunching) {
  alignas(8) uint8_t buffer[64] = {};
  StridedLayout layout{};
  layout.ndim = 1;
  layout.sizes[0] = 4;
  layout.strides[0] = 2;
  layout.elem_size = 4;
  const auto invalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(GatherAsync(buffer + 1, layout, buffer + 32, 16, nullptr).code(), invalid);
  EXPECT_EQ(GatherAsync(buffer, layout, buffer + 34, 16, nullptr).code(), invalid);
  EXPECT_EQ(GatherAsync(buffer, layout, buffer + 32, 15, nullptr).code(), invalid);
  layout.strides[0] = 0;
  EXPECT_EQ(ScatterAsync(buffer + 32, 16, buffer, layout, nullptr).code(), invalid);
  EXPECT_EQ(Checksum64Async(buffer, 8, nullptr, nullptr).code(), invalid);
  EXPECT_EQ(Checksum64Async(buffer, 8, reinterpret_cast<uint64_t*>(buffer + 4), nullptr).code(),
            invalid);
  EXPECT_EQ(Fp32ToBf16Async(reinterpret_cast<const float*>(buffer + 2),
                            reinterpret_cast<uint16_t*>(buffer + 32), 4, nullptr)
                .code(),
            invalid);
  EXPECT_TRUE(Fp16ToBf16Async(nullptr, nullptr, 0, nullptr).ok());  // nothing to do
}

// Without a device, a launch fails; the failure comes back as a Status that
// names the call site (ACTSTASH_CUDA_RETURN_IF_ERROR), not a crash.
TEST(KernelsCudaArgumentsTest, LaunchFailureWithoutDeviceIsAStatus) {
  if (HaveDevice()) GTEST_SKIP() << "a device is present";
  alignas(8) uint8_t buffer[64] = {};
  StridedLayout layout{};
  layout.ndim = 1;
  layout.sizes[0] = 4;
  layout.strides[0] = 2;
  layout.elem_size = 4;
  const absl::Status status = GatherAsync(buffer, layout, buffer + 32, 16, nullptr);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("strided_copy_cuda.cc:"), std::string::npos) << status;
  EXPECT_FALSE(Checksum64Async(buffer, 8, reinterpret_cast<uint64_t*>(buffer + 56), nullptr).ok());
}

}  // namespace
}  // namespace actstash::kernels
