// The CUDA engine's logic over a simulated device: gather/scatter round
// trips on random strided layouts, argument errors (nothing enqueued), failed
// deps and device errors, and event/stream lifetimes (no leaks, no double
// destruction, events that outlive the engine).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "client/copy/gpu_copy_engine.h"
#include "tests/client/sim_gpu_runtime.h"
#include "tests/kernels/test_layouts.h"

namespace actstash::client_internal {
namespace {

using ::actstash::client_internal::testing::ShareRuntime;
using ::actstash::client_internal::testing::SimGpuRuntime;
using ::actstash::client_internal::testing::SimOptions;
using ::actstash::kernels::testing::Describe;
using ::actstash::kernels::testing::NaiveOffset;
using ::actstash::kernels::testing::Numel;
using ::actstash::kernels::testing::RandomView;
using std::chrono::microseconds;

std::unique_ptr<CopyEngine> MakeEngine(const std::shared_ptr<SimGpuRuntime>& device,
                                       uint32_t max_in_flight = 64) {
  CudaCopyEngineOptions options;
  options.max_in_flight = max_in_flight;
  auto engine = CreateGpuCopyEngine(ShareRuntime(device), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

TensorLayout ToTensorLayout(const kernels::StridedLayout& layout) {
  TensorLayout out;
  out.sizes.assign(layout.sizes, layout.sizes + layout.ndim);
  out.strides.assign(layout.strides, layout.strides + layout.ndim);
  out.element_size = layout.elem_size;
  return out;
}

// Gather a random view into a packed buffer on the store stream, scatter it
// back into a zeroed tensor on the fetch stream (dep: the gather), and
// compare both with a naive index.
TEST(GpuCopyEngineErrorsTest, GatherScatterRoundTripOnRandomLayouts) {
  auto device = std::make_shared<SimGpuRuntime>(SimOptions{microseconds(5), 9});
  auto engine = MakeEngine(device, 4);
  std::mt19937_64 rng(11);
  for (int round = 0; round < 300; ++round) {
    const int elem = 1 << (round % 4);
    int64_t offset = 0, base_numel = 0;
    const kernels::StridedLayout view = RandomView(rng, elem, false, &offset, &base_numel);
    std::vector<uint8_t> base(base_numel * elem + 1);
    for (uint8_t& b : base) b = static_cast<uint8_t>(rng());
    const int64_t numel = Numel(view);
    std::vector<uint8_t> packed(numel * elem + 1), back(base.size(), 0);
    const TensorLayout layout = ToTensorLayout(view);
    auto gather = engine->GatherAsync(CopyStream::kStore, packed.data(), packed.size(),
                                      base.data() + offset * elem, layout, StreamHandle{});
    ASSERT_TRUE(gather.ok()) << gather.status() << " " << Describe(view);
    const std::shared_ptr<CopyEvent> deps[] = {*gather};
    auto scatter = engine->ScatterAsync(CopyStream::kFetch, back.data() + offset * elem, layout,
                                        packed.data(), packed.size(), StreamHandle{}, deps);
    ASSERT_TRUE(scatter.ok()) << scatter.status() << " " << Describe(view);
    ASSERT_TRUE((*scatter)->Wait().ok());
    ASSERT_TRUE((*gather)->Done());
    std::vector<uint8_t> expected_back(base.size(), 0);
    for (int64_t i = 0; i < numel; ++i) {
      const int64_t at = (offset + NaiveOffset(view, i)) * elem;
      ASSERT_EQ(std::memcmp(&packed[i * elem], &base[at], elem), 0) << Describe(view) << " " << i;
      std::memcpy(&expected_back[at], &base[at], elem);
    }
    ASSERT_EQ(back, expected_back) << Describe(view);
  }
}

// Every argument error is INVALID_ARGUMENT with nothing enqueued and no
// event created.
TEST(GpuCopyEngineErrorsTest, BadArgumentsEnqueueNothing) {
  auto device = std::make_shared<SimGpuRuntime>();
  auto engine = MakeEngine(device);
  const int64_t ops = device->ops_enqueued();
  const int64_t events = device->events_created();
  std::vector<uint8_t> tensor(256), packed(256);
  auto gather = [&](const TensorLayout& layout, void* dst, size_t dst_bytes) {
    return engine->GatherAsync(CopyStream::kStore, dst, dst_bytes, tensor.data(), layout, {})
        .status()
        .code();
  };
  auto scatter = [&](const TensorLayout& layout, const void* src, size_t src_bytes) {
    return engine->ScatterAsync(CopyStream::kFetch, tensor.data(), layout, src, src_bytes, {})
        .status()
        .code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  TensorLayout nine_dims{std::vector<int64_t>(9, 1), std::vector<int64_t>(9, 1), 1};
  EXPECT_EQ(gather(nine_dims, packed.data(), packed.size()), kInvalid);
  EXPECT_EQ(gather({{4, 4}, {4}, 1}, packed.data(), packed.size()), kInvalid);
  EXPECT_EQ(gather({{4, 4}, {4, 1}, 3}, packed.data(), packed.size()), kInvalid);
  EXPECT_EQ(gather({{4, 4}, {-4, 1}, 1}, packed.data(), packed.size()), kInvalid);
  EXPECT_EQ(gather({{4, 4}, {1, 4}, 4}, packed.data(), 63), kInvalid);              // short
  EXPECT_EQ(gather({{4, 4}, {1, 4}, 4}, tensor.data() + 8, 64), kInvalid);          // overlaps
  EXPECT_EQ(gather({{4, 4}, {1, 4}, 4}, nullptr, 64), kInvalid);                    // null
  EXPECT_EQ(scatter({{4, 4}, {0, 1}, 4}, packed.data(), packed.size()), kInvalid);  // broadcast
  EXPECT_EQ(scatter({{4, 4}, {1, 4}, 4}, packed.data(), 32), kInvalid);             // short
  EXPECT_EQ(engine->CopyAsync(CopyStream::kStore, nullptr, packed.data(), 8, {}).status().code(),
            kInvalid);
  EXPECT_EQ(device->ops_enqueued(), ops);
  EXPECT_EQ(device->events_created(), events);
  // Empty tensors and empty copies are fine and still ordered.
  EXPECT_TRUE(
      engine->GatherAsync(CopyStream::kStore, nullptr, 0, nullptr, {{0, 3}, {3, 1}, 2}, {}).ok());
  auto empty = engine->CopyAsync(CopyStream::kFetch, nullptr, nullptr, 0, {});
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE((*empty)->Wait().ok());
}

// A host event that fails (here SubmitAsync's) fails a copy that depends on
// it: the copy is not made, and OrderAfterAsync reports it.
TEST(GpuCopyEngineErrorsTest, FailedForeignDepFailsTheCopy) {
  auto device = std::make_shared<SimGpuRuntime>(SimOptions{microseconds(50), 2});
  auto engine = MakeEngine(device);
  auto failed =
      engine->SubmitAsync(CopyStream::kStore, [] { return absl::DataLossError("bad checksum"); });
  uint32_t src = 5, dst = 0;
  const std::shared_ptr<CopyEvent> deps[] = {failed};
  auto copy = engine->CopyAsync(CopyStream::kFetch, &dst, &src, 4, {}, deps);
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ((*copy)->Wait().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE((*copy)->Done());
  engine->Synchronize();
  EXPECT_EQ(dst, 0u);
  EXPECT_EQ(engine->OrderAfterAsync({}, **copy).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(engine->OrderAfterAsync({}, *failed).code(), absl::StatusCode::kDataLoss);
}

// A device error before a copy (a faulting "kernel" on the caller's stream)
// fails the copy, every copy that depends on it, and the host work queued
// behind it; nothing is copied.
TEST(GpuCopyEngineErrorsTest, DeviceErrorsSpreadToDependents) {
  auto device = std::make_shared<SimGpuRuntime>();
  auto engine = MakeEngine(device);
  const GpuStream compute = *device->CreateStream();
  ASSERT_TRUE(
      device->LaunchHostAsync(compute, [] { return absl::InternalError("illegal address"); }).ok());
  uint32_t act = 1, host = 0, back = 0;
  auto store = engine->CopyAsync(CopyStream::kStore, &host, &act, 4, StreamHandle{compute});
  ASSERT_TRUE(store.ok());
  const std::shared_ptr<CopyEvent> deps[] = {*store};
  // Submitted before the store is known to have failed: the device spreads it.
  auto fetch = engine->CopyAsync(CopyStream::kFetch, &back, &host, 4, {}, deps);
  ASSERT_TRUE(fetch.ok());
  bool ran = false;
  auto work = engine->SubmitAsync(CopyStream::kStore, [&ran] {
    ran = true;
    return absl::OkStatus();
  });
  EXPECT_EQ((*store)->Wait().code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*fetch)->Wait().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(work->Wait().code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(ran);
  // Submitted after: known failed, nothing enqueued.
  const int64_t ops = device->ops_enqueued();
  auto late = engine->CopyAsync(CopyStream::kFetch, &back, &host, 4, {}, deps);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ((*late)->Wait().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(device->ops_enqueued(), ops);
  EXPECT_EQ(engine->OrderAfterAsync(StreamHandle{compute}, **store).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(host, 0u);
  EXPECT_EQ(back, 0u);
  engine.reset();
  ASSERT_TRUE(device->DestroyStream(compute).ok());
}

// Every event and stream the engine creates is destroyed exactly once: by
// the engine, or by the last CopyEvent holding it, which may outlive the
// engine and still answer Done/Wait.
TEST(GpuCopyEngineErrorsTest, EventsAndStreamsAreDestroyedOnceAndMayOutliveTheEngine) {
  auto device = std::make_shared<SimGpuRuntime>(SimOptions{microseconds(10), 4});
  std::vector<std::shared_ptr<CopyEvent>> kept;
  std::vector<uint64_t> src(500, 3), dst(500, 0);
  {
    auto engine = MakeEngine(device, 8);
    for (size_t i = 0; i < src.size(); ++i) {
      auto store = engine->CopyAsync(CopyStream::kStore, &dst[i], &src[i], 8, {});
      ASSERT_TRUE(store.ok());
      const std::shared_ptr<CopyEvent> deps[] = {*store};
      auto fetch = engine->CopyAsync(CopyStream::kFetch, &src[i], &dst[i], 8, {}, deps);
      ASSERT_TRUE(fetch.ok());
      ASSERT_TRUE(engine->OrderAfterAsync({}, **fetch).ok());
      if (i % 50 == 0) kept.push_back(*fetch);
      if (i % 70 == 0)
        kept.push_back(engine->SubmitAsync(CopyStream::kStore, [] { return absl::OkStatus(); }));
    }
  }  // the engine drains and goes; `kept` holds some of its events
  EXPECT_EQ(device->streams_created(), 2);
  EXPECT_EQ(device->streams_destroyed(), 2);
  EXPECT_GT(device->live_events(), 0);
  for (const auto& event : kept) {
    EXPECT_TRUE(event->Done());
    EXPECT_TRUE(event->Wait().ok());
  }
  kept.clear();
  EXPECT_EQ(device->live_events(), 0);
  EXPECT_EQ(device->events_created(), device->events_destroyed());
  EXPECT_EQ(device->bad_handle_uses(), 0);
  EXPECT_EQ(dst, src);
}

}  // namespace
}  // namespace actstash::client_internal
