// HostCopyEngine: order within a stream, events, a producer/consumer chain
// across the two streams under random delays that never sees stale data, and
// the copy calls (copy, gather, scatter, deps, OrderAfterAsync), a simulated
// link (each copy at least bytes / rate, queued per direction, the two
// directions independent). Also: the CUDA entry points without a device.
#include "actstash/copy_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"

namespace actstash {
namespace {

TEST(HostCopyEngineTest, WorkOnOneStreamRunsInSubmissionOrder) {
  HostCopyEngineOptions options;
  options.max_injected_delay = std::chrono::microseconds(50);
  auto engine = CreateHostCopyEngine(options);
  std::vector<int> order;
  std::vector<std::shared_ptr<CopyEvent>> events;
  for (int i = 0; i < 200; ++i) {
    events.push_back(engine->SubmitAsync(CopyStream::kStore, [&order, i] {
      order.push_back(i);  // one worker per stream: no race
      return absl::OkStatus();
    }));
  }
  ASSERT_TRUE(events.back()->Wait().ok());
  for (const auto& e : events) EXPECT_TRUE(e->Done());
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
}

TEST(HostCopyEngineTest, EventsCarryTheWorksStatus) {
  auto engine = CreateHostCopyEngine();
  auto failed =
      engine->SubmitAsync(CopyStream::kFetch, [] { return absl::DataLossError("bad bytes"); });
  EXPECT_EQ(failed->Wait().code(), absl::StatusCode::kDataLoss);
  engine->Synchronize();
}

// Like offload: the store stream copies a producer's buffer out, the fetch
// stream copies it back after waiting for that store's event; with random
// delays on both streams, no fetch may ever see an older value.
TEST(HostCopyEngineTest, ChainOfTenThousandCopiesNeverSeesStaleData) {
  HostCopyEngineOptions options;
  options.max_injected_delay = std::chrono::microseconds(20);
  options.seed = 42;
  auto engine = CreateHostCopyEngine(options);
  constexpr int kCopies = 10000;
  std::vector<uint64_t> produced(kCopies), stored(kCopies), fetched(kCopies, 0);
  std::atomic<int> stale{0};
  for (int i = 0; i < kCopies; ++i) {
    produced[i] = 0x9e3779b97f4a7c15ull * (i + 1);
    auto store = engine->SubmitAsync(CopyStream::kStore, [&, i] {
      std::memcpy(&stored[i], &produced[i], sizeof(uint64_t));
      return absl::OkStatus();
    });
    engine->SubmitAsync(CopyStream::kFetch, [&, i, store] {
      absl::Status s = store->Wait();  // the consumer is ordered after its producer
      std::memcpy(&fetched[i], &stored[i], sizeof(uint64_t));
      if (fetched[i] != produced[i]) ++stale;
      return s;
    });
  }
  engine->Synchronize();
  EXPECT_EQ(stale.load(), 0);
  EXPECT_EQ(fetched, produced);
}

// The same chain through CopyAsync and deps: the fetch of copy i depends on
// its store, and the store stream's copies run late.
TEST(HostCopyEngineTest, CopiesWithDepsNeverSeeStaleData) {
  HostCopyEngineOptions options;
  options.max_injected_delay = std::chrono::microseconds(20);
  options.seed = 7;
  auto engine = CreateHostCopyEngine(options);
  constexpr int kCopies = 3000;
  std::vector<uint64_t> produced(kCopies), stored(kCopies, 0), fetched(kCopies, 0);
  std::vector<std::shared_ptr<CopyEvent>> fetches;
  for (int i = 0; i < kCopies; ++i) {
    produced[i] = 0x9e3779b97f4a7c15ull * (i + 1);
    auto store = engine->CopyAsync(CopyStream::kStore, &stored[i], &produced[i], 8, {});
    ASSERT_TRUE(store.ok());
    const std::shared_ptr<CopyEvent> deps[] = {*store};
    auto fetch = engine->CopyAsync(CopyStream::kFetch, &fetched[i], &stored[i], 8, {}, deps);
    ASSERT_TRUE(fetch.ok());
    fetches.push_back(*fetch);
  }
  for (const auto& fetch : fetches) ASSERT_TRUE(fetch->Wait().ok());
  EXPECT_EQ(fetched, produced);
}

// A transposed 2-D int32 tensor packed and unpacked again.
TEST(HostCopyEngineTest, GatherAndScatterATransposedTensor) {
  auto engine = CreateHostCopyEngine();
  constexpr int64_t kRows = 37, kCols = 11;
  std::vector<int32_t> tensor(kRows * kCols);
  std::iota(tensor.begin(), tensor.end(), 100);
  const TensorLayout transposed{{kCols, kRows}, {1, kCols}, 4};
  std::vector<int32_t> packed(kRows * kCols, 0), back(kRows * kCols, 0);
  auto gather = engine->GatherAsync(CopyStream::kStore, packed.data(), packed.size() * 4,
                                    tensor.data(), transposed, {});
  ASSERT_TRUE(gather.ok()) << gather.status();
  const std::shared_ptr<CopyEvent> deps[] = {*gather};
  auto scatter = engine->ScatterAsync(CopyStream::kFetch, back.data(), transposed, packed.data(),
                                      packed.size() * 4, {}, deps);
  ASSERT_TRUE(scatter.ok()) << scatter.status();
  ASSERT_TRUE((*scatter)->Wait().ok());
  for (int64_t c = 0; c < kCols; ++c) {
    for (int64_t r = 0; r < kRows; ++r) ASSERT_EQ(packed[c * kRows + r], tensor[r * kCols + c]);
  }
  EXPECT_EQ(back, tensor);
}

// Bad layouts and buffers are INVALID_ARGUMENT and nothing runs: a stream
// whose worker is blocked still accepts (and rejects) the call at once.
TEST(HostCopyEngineTest, BadGatherAndScatterArgumentsAreRejectedUpFront) {
  auto engine = CreateHostCopyEngine();
  absl::Notification gate;
  engine->SubmitAsync(CopyStream::kStore, [&gate] {
    gate.WaitForNotification();
    return absl::OkStatus();
  });
  std::vector<uint8_t> tensor(64), packed(64);
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  auto gather = [&](const TensorLayout& layout, void* dst, size_t bytes) {
    return engine->GatherAsync(CopyStream::kStore, dst, bytes, tensor.data(), layout, {})
        .status()
        .code();
  };
  EXPECT_EQ(gather({{2, 2}, {2}, 1}, packed.data(), 64), kInvalid);
  EXPECT_EQ(gather({{2, 2}, {2, 1}, 16}, packed.data(), 64), kInvalid);
  EXPECT_EQ(gather({std::vector<int64_t>(9, 1), std::vector<int64_t>(9, 1), 1}, packed.data(), 64),
            kInvalid);
  EXPECT_EQ(gather({{8, 8}, {8, 1}, 1}, packed.data(), 63), kInvalid);
  EXPECT_EQ(gather({{8, 4}, {8, 1}, 1}, tensor.data() + 4, 32), kInvalid);
  EXPECT_EQ(engine
                ->ScatterAsync(CopyStream::kFetch, tensor.data(), {{4, 4}, {1, 1}, 1},
                               packed.data(), 64, {})
                .status()
                .code(),
            kInvalid);
  gate.Notify();
  engine->Synchronize();
}

// A failed dep fails the dependent copy with the dep's status; nothing is
// copied.
TEST(HostCopyEngineTest, FailedDepFailsTheDependentCopy) {
  auto engine = CreateHostCopyEngine();
  auto failed =
      engine->SubmitAsync(CopyStream::kStore, [] { return absl::UnavailableError("gone"); });
  uint32_t src = 9, dst = 0;
  const std::shared_ptr<CopyEvent> deps[] = {failed};
  auto copy = engine->CopyAsync(CopyStream::kFetch, &dst, &src, 4, {}, deps);
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ((*copy)->Wait().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(dst, 0u);
}

// OrderAfterAsync blocks the caller (its own "stream") until the event is
// done and returns the event's status.
TEST(HostCopyEngineTest, OrderAfterAsyncWaitsForTheEvent) {
  auto engine = CreateHostCopyEngine();
  std::atomic<bool> finished{false};
  auto slow = engine->SubmitAsync(CopyStream::kFetch, [&finished] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    finished = true;
    return absl::OkStatus();
  });
  ASSERT_TRUE(engine->OrderAfterAsync({}, *slow).ok());
  EXPECT_TRUE(finished.load());
  auto failed = engine->SubmitAsync(CopyStream::kFetch, [] { return absl::AbortedError("x"); });
  EXPECT_EQ(engine->OrderAfterAsync({}, *failed).code(), absl::StatusCode::kAborted);
}

// Without a device (this machine, or a build without CUDA) the CUDA engine
// cannot be created, and says why.
// The bf16 downcast and back through the engine: the kernels' rounding
// (tested against torch in tests/kernels), ordered after a dep, and the
// argument checks.
TEST(HostCopyEngineTest, ConvertAsyncRoundTripsThroughBf16) {
  auto engine = CreateHostCopyEngine();
  std::vector<float> src(10001);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.37f - 1000.0f;
  src[0] = std::numeric_limits<float>::infinity();
  src[1] = -0.0f;
  std::vector<float> staged(src.size());
  std::vector<uint16_t> bf16(src.size());
  std::vector<float> back(src.size());
  auto copied = engine->CopyAsync(CopyStream::kStore, staged.data(), src.data(),
                                  src.size() * sizeof(float), StreamHandle{});
  ASSERT_TRUE(copied.ok());
  const std::shared_ptr<CopyEvent> deps[] = {*copied};
  auto down = engine->ConvertAsync(CopyStream::kFetch, bf16.data(), staged.data(), src.size(),
                                   Conversion::kFp32ToBf16, StreamHandle{}, deps);
  ASSERT_TRUE(down.ok()) << down.status();
  const std::shared_ptr<CopyEvent> after_down[] = {*down};
  auto up = engine->ConvertAsync(CopyStream::kFetch, back.data(), bf16.data(), src.size(),
                                 Conversion::kBf16ToFp32, StreamHandle{}, after_down);
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_TRUE((*up)->Wait().ok());
  for (size_t i = 0; i < src.size(); ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, &src[i], 4);
    // Round to nearest even on the upper 16 bits (no NaNs in this input).
    const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
    uint32_t got = 0;
    std::memcpy(&got, &back[i], 4);
    ASSERT_EQ(got, i == 0 ? bits : rounded) << "element " << i;
  }
  // Misaligned, null and overlapping arguments: rejected, nothing runs.
  auto* bytes = reinterpret_cast<char*>(bf16.data());
  EXPECT_EQ(engine
                ->ConvertAsync(CopyStream::kStore, bytes + 1, src.data(), 4,
                               Conversion::kFp32ToBf16, StreamHandle{})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine
                ->ConvertAsync(CopyStream::kStore, nullptr, src.data(), 4, Conversion::kFp32ToBf16,
                               StreamHandle{})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine
                ->ConvertAsync(CopyStream::kStore, src.data(), src.data(), 4,
                               Conversion::kFp32ToBf16, StreamHandle{})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine
                  ->ConvertAsync(CopyStream::kStore, nullptr, nullptr, 0, Conversion::kBf16ToFp32,
                                 StreamHandle{})
                  .ok());
}

// 1 MiB at 100 MB/s: at least 10.49 ms per copy. Lower bounds only (a
// loaded machine only makes copies slower), except that the two directions
// must overlap: both at once take well under their sum.
TEST(HostCopyEngineTest, ASimulatedLinkTimesEachCopyAndQueuesThemPerDirection) {
  HostCopyEngineOptions options;
  options.link_bytes_per_second = 100'000'000;
  auto engine = CreateHostCopyEngine(options);
  constexpr size_t kBytes = 1 << 20;
  const auto one = std::chrono::nanoseconds(kBytes * 10);  // 1e9 / 1e8 ns per byte
  std::vector<char> a(kBytes, 'a'), b(kBytes), c(kBytes), d(kBytes);
  using Clock = std::chrono::steady_clock;

  Clock::time_point start = Clock::now();
  auto first = engine->CopyAsync(CopyStream::kStore, b.data(), a.data(), kBytes, {}, {});
  auto second = engine->CopyAsync(CopyStream::kStore, c.data(), a.data(), kBytes, {}, {});
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE((*first)->Wait().ok());
  EXPECT_GE(Clock::now() - start, one);
  ASSERT_TRUE((*second)->Wait().ok());
  EXPECT_GE(Clock::now() - start, 2 * one);  // one lane per direction
  EXPECT_EQ(std::memcmp(c.data(), a.data(), kBytes), 0);

  // The other direction does not queue behind this one; repeated so that
  // one scheduling hiccup on a loaded machine does not decide it.
  Clock::duration best = Clock::duration::max();
  for (int round = 0; round < 5; ++round) {
    start = Clock::now();
    auto store = engine->CopyAsync(CopyStream::kStore, b.data(), a.data(), kBytes, {}, {});
    auto fetch = engine->CopyAsync(CopyStream::kFetch, d.data(), a.data(), kBytes, {}, {});
    ASSERT_TRUE(store.ok() && fetch.ok());
    ASSERT_TRUE((*store)->Wait().ok() && (*fetch)->Wait().ok());
    best = std::min(best, Clock::now() - start);
  }
  EXPECT_GE(best, one);
  EXPECT_LT(best, one * 19 / 10);

  // A copy's time starts once its deps are done, and work that is not a copy
  // is not timed.
  start = Clock::now();
  auto gate = engine->SubmitAsync(CopyStream::kFetch, [one] {
    std::this_thread::sleep_for(3 * one);
    return absl::OkStatus();
  });
  const std::shared_ptr<CopyEvent> deps[] = {gate};
  auto after = engine->CopyAsync(CopyStream::kStore, b.data(), a.data(), kBytes, {}, deps);
  ASSERT_TRUE(after.ok());
  ASSERT_TRUE((*after)->Wait().ok());
  EXPECT_GE(Clock::now() - start, 4 * one);
  start = Clock::now();
  ASSERT_TRUE(
      engine->SubmitAsync(CopyStream::kStore, [] { return absl::OkStatus(); })->Wait().ok());
  EXPECT_LT(Clock::now() - start, one);
}

TEST(CudaCopyEngineTest, CreationFailsWithoutADevice) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present";
  auto engine = CreateCudaCopyEngine();
  EXPECT_FALSE(engine.ok());
}

}  // namespace
}  // namespace actstash
