// The CUDA engine's logic (gpu_copy_engine.cc) over a simulated device:
// ordering against a slow compute stream, deps between the store and fetch
// streams, OrderAfterAsync without host waits, SubmitAsync, the in-flight
// bound. Errors and lifetimes: gpu_copy_engine_errors_test.cc.
#include "client/copy/gpu_copy_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "tests/client/sim_gpu_runtime.h"

namespace actstash::client_internal {
namespace {

using ::actstash::client_internal::testing::ShareRuntime;
using ::actstash::client_internal::testing::SimGpuRuntime;
using ::actstash::client_internal::testing::SimOptions;
using std::chrono::microseconds;

struct Sim {
  std::shared_ptr<SimGpuRuntime> device;
  std::unique_ptr<CopyEngine> engine;
  GpuStream compute = 0;  // created after the engine's two streams (1 and 2)
};

Sim MakeSim(microseconds max_op_delay, uint32_t max_in_flight = 64, uint64_t seed = 1) {
  Sim sim;
  sim.device = std::make_shared<SimGpuRuntime>(SimOptions{max_op_delay, seed});
  CudaCopyEngineOptions options;
  options.max_in_flight = max_in_flight;
  auto engine = CreateGpuCopyEngine(ShareRuntime(sim.device), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (engine.ok()) sim.engine = *std::move(engine);
  sim.compute = *sim.device->CreateStream();
  return sim;
}

constexpr GpuStream kStoreStream = 1;
constexpr GpuStream kFetchStream = 2;

uint8_t Pattern(int i, size_t byte) { return static_cast<uint8_t>(i * 131 + byte * 7 + 1); }

// Offload's shape: a producer writes an activation on a slowed compute
// stream, the store copies it out after the compute stream, the fetch copies
// it back after the store (deps), and a consumer on the compute stream,
// ordered after the fetch by OrderAfterAsync, checks it. Activation and
// input slots are reused, so any missing order shows up as stale bytes.
TEST(GpuCopyEngineTest, ChainOfTenThousandCopiesNeverSeesStaleData) {
  Sim sim = MakeSim(microseconds(20), /*max_in_flight=*/8, /*seed=*/42);
  sim.device->SetStreamDelay(sim.compute, microseconds(5));
  constexpr int kCopies = 10000;
  constexpr int kSlots = 3;
  constexpr size_t kBytes = 48;
  std::vector<std::vector<uint8_t>> activation(kSlots, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> input(kSlots, std::vector<uint8_t>(kBytes));
  std::vector<uint8_t> host(kCopies * kBytes);
  std::vector<std::shared_ptr<CopyEvent>> last_store(kSlots);
  std::atomic<int> stale{0};
  const StreamHandle compute{sim.compute};
  for (int i = 0; i < kCopies; ++i) {
    const int slot = i % kSlots;
    if (last_store[slot] != nullptr) {  // the slot is free once its last store is done
      ASSERT_TRUE(sim.engine->OrderAfterAsync(compute, *last_store[slot]).ok());
    }
    uint8_t* act = activation[slot].data();
    uint8_t* in = input[slot].data();
    ASSERT_TRUE(sim.device
                    ->LaunchHostAsync(sim.compute,
                                      [act, i] {
                                        for (size_t b = 0; b < kBytes; ++b) act[b] = Pattern(i, b);
                                        return absl::OkStatus();
                                      })
                    .ok());
    auto store = sim.engine->CopyAsync(CopyStream::kStore, &host[i * kBytes], act, kBytes, compute);
    ASSERT_TRUE(store.ok()) << store.status();
    const std::shared_ptr<CopyEvent> deps[] = {*store};
    auto fetch =
        sim.engine->CopyAsync(CopyStream::kFetch, in, &host[i * kBytes], kBytes, compute, deps);
    ASSERT_TRUE(fetch.ok()) << fetch.status();
    ASSERT_TRUE(sim.engine->OrderAfterAsync(compute, **fetch).ok());
    ASSERT_TRUE(sim.device
                    ->LaunchHostAsync(sim.compute,
                                      [in, i, &stale] {
                                        for (size_t b = 0; b < kBytes; ++b) {
                                          if (in[b] != Pattern(i, b)) {
                                            ++stale;
                                            break;
                                          }
                                        }
                                        return absl::OkStatus();
                                      })
                    .ok());
    last_store[slot] = *store;
  }
  sim.device->SynchronizeStream(sim.compute);
  sim.engine->Synchronize();
  EXPECT_EQ(stale.load(), 0);
  for (int i = 0; i < kCopies; ++i) {
    for (size_t b = 0; b < kBytes; ++b) ASSERT_EQ(host[i * kBytes + b], Pattern(i, b)) << i;
  }
  EXPECT_LE(sim.device->max_copies_in_flight(kStoreStream), 8);
  EXPECT_LE(sim.device->max_copies_in_flight(kFetchStream), 8);
}

// A copy after the compute stream waits for it (the host does not), and the
// same copy ordered after another, idle stream reads the bytes before the
// producer wrote them: the check above can see a missing order.
TEST(GpuCopyEngineTest, CopyWaitsForTheCallersStreamOnlyWhenAfterIt) {
  for (bool after_compute : {true, false}) {
    Sim sim = MakeSim(microseconds(0));
    absl::Notification gate;
    uint8_t act = 0, out = 0;
    ASSERT_TRUE(sim.device
                    ->LaunchHostAsync(sim.compute,
                                      [&] {
                                        gate.WaitForNotification();
                                        act = 7;
                                        return absl::OkStatus();
                                      })
                    .ok());
    const StreamHandle after{after_compute ? sim.compute : GpuStream{0}};
    auto store = sim.engine->CopyAsync(CopyStream::kStore, &out, &act, 1, after);
    ASSERT_TRUE(store.ok());
    if (after_compute) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      EXPECT_FALSE((*store)->Done());  // held back by the compute stream
      gate.Notify();
      ASSERT_TRUE((*store)->Wait().ok());
      EXPECT_EQ(out, 7);
    } else {
      ASSERT_TRUE((*store)->Wait().ok());
      EXPECT_EQ(out, 0);  // stale: the copy ran before the producer
      gate.Notify();
    }
    sim.device->SynchronizeStream(sim.compute);
  }
}

// OrderAfterAsync on an engine event makes the stream wait on the device:
// the calling thread returns while the copy is still pending.
TEST(GpuCopyEngineTest, OrderAfterAsyncDoesNotBlockTheHost) {
  Sim sim = MakeSim(microseconds(0));
  GpuStream blocker = *sim.device->CreateStream();
  absl::Notification gate;
  ASSERT_TRUE(sim.device
                  ->LaunchHostAsync(blocker,
                                    [&] {
                                      gate.WaitForNotification();
                                      return absl::OkStatus();
                                    })
                  .ok());
  uint64_t src = 0x1234, dst = 0, seen = 0;
  auto fetch = sim.engine->CopyAsync(CopyStream::kFetch, &dst, &src, 8, StreamHandle{blocker});
  ASSERT_TRUE(fetch.ok());
  ASSERT_TRUE(sim.engine->OrderAfterAsync(StreamHandle{sim.compute}, **fetch).ok());
  ASSERT_TRUE(sim.device
                  ->LaunchHostAsync(sim.compute,
                                    [&] {
                                      seen = dst;
                                      return absl::OkStatus();
                                    })
                  .ok());
  EXPECT_FALSE((*fetch)->Done());
  gate.Notify();
  sim.device->SynchronizeStream(sim.compute);
  EXPECT_EQ(seen, 0x1234u);
  ASSERT_TRUE(sim.device->DestroyStream(blocker).ok());
}

// A fetch with the store as a dep reads what the store wrote, whatever the
// two streams' delays.
TEST(GpuCopyEngineTest, DepsOrderTheFetchStreamAfterTheStoreStream) {
  Sim sim = MakeSim(microseconds(30), 64, 7);
  constexpr int kCopies = 2000;
  std::vector<uint32_t> device(kCopies), host(kCopies, 0), back(kCopies, 0);
  for (int i = 0; i < kCopies; ++i) device[i] = 0xabc00000u + i;
  std::vector<std::shared_ptr<CopyEvent>> fetches;
  for (int i = 0; i < kCopies; ++i) {
    auto store = sim.engine->CopyAsync(CopyStream::kStore, &host[i], &device[i], 4, {});
    ASSERT_TRUE(store.ok());
    const std::shared_ptr<CopyEvent> deps[] = {*store};
    auto fetch = sim.engine->CopyAsync(CopyStream::kFetch, &back[i], &host[i], 4, {}, deps);
    ASSERT_TRUE(fetch.ok());
    fetches.push_back(*fetch);
  }
  for (const auto& fetch : fetches) ASSERT_TRUE(fetch->Wait().ok());
  EXPECT_EQ(back, device);
}

// SubmitAsync's work runs on the host after every earlier copy of its stream
// completed, in submission order.
TEST(GpuCopyEngineTest, SubmitAsyncRunsAfterEarlierCopiesInOrder) {
  Sim sim = MakeSim(microseconds(30), 4, 3);
  constexpr int kRounds = 300;
  std::vector<uint64_t> src(kRounds), dst(kRounds, 0);
  std::vector<int> order;  // written by the completion thread only
  std::atomic<int> missing{0};
  std::vector<std::shared_ptr<CopyEvent>> results;
  for (int i = 0; i < kRounds; ++i) {
    src[i] = 1000 + i;
    ASSERT_TRUE(
        sim.engine->CopyAsync(CopyStream::kStore, &dst[i], &src[i], 8, StreamHandle{}).ok());
    results.push_back(sim.engine->SubmitAsync(CopyStream::kStore, [&, i] {
      for (int j = 0; j <= i; ++j) {
        if (dst[j] != src[j]) ++missing;
      }
      order.push_back(i);
      return absl::OkStatus();
    }));
  }
  for (const auto& result : results) ASSERT_TRUE(result->Wait().ok());
  EXPECT_EQ(missing.load(), 0);
  ASSERT_EQ(order.size(), static_cast<size_t>(kRounds));
  for (int i = 0; i < kRounds; ++i) EXPECT_EQ(order[i], i);
  auto failed =
      sim.engine->SubmitAsync(CopyStream::kFetch, [] { return absl::DataLossError("checksum"); });
  EXPECT_EQ(failed->Wait().code(), absl::StatusCode::kDataLoss);
}

// Several threads submit at once; no stream ever has more than
// max_in_flight copies pending, and every copy lands.
TEST(GpuCopyEngineTest, InFlightCopiesStayBounded) {
  constexpr uint32_t kMax = 3;
  Sim sim = MakeSim(microseconds(40), kMax, 5);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 150;
  std::vector<uint32_t> src(kThreads * kPerThread), dst(src.size(), 0), back(src.size(), 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint32_t>(i * 2654435761u);
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        const size_t i = t * kPerThread + k;
        auto store = sim.engine->CopyAsync(CopyStream::kStore, &dst[i], &src[i], 4, {});
        if (!store.ok()) {
          ++errors;
          continue;
        }
        const std::shared_ptr<CopyEvent> deps[] = {*store};
        if (!sim.engine->CopyAsync(CopyStream::kFetch, &back[i], &dst[i], 4, {}, deps).ok()) {
          ++errors;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  sim.engine->Synchronize();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(back, src);
  EXPECT_LE(sim.device->max_copies_in_flight(kStoreStream), kMax);
  EXPECT_LE(sim.device->max_copies_in_flight(kFetchStream), kMax);
  EXPECT_GE(sim.device->max_copies_in_flight(kStoreStream), 2);  // the bound was exercised
}

// The downcast is ordered like a copy: after the (slow) compute stream that
// produces its input, and the consumer after it.
TEST(GpuCopyEngineTest, ConvertAsyncRunsAfterTheProducerAndBeforeTheConsumer) {
  Sim sim = MakeSim(microseconds(10));
  sim.device->SetStreamDelay(sim.compute, microseconds(2000));
  std::vector<float> activation(4096, 0.0f);
  std::vector<uint16_t> stored(activation.size());
  std::vector<float> restored(activation.size());
  for (int round = 1; round <= 20; ++round) {
    ASSERT_TRUE(sim.device
                    ->LaunchHostAsync(sim.compute,
                                      [&, round] {
                                        for (float& v : activation) v = 1.0f + round;
                                        return absl::OkStatus();
                                      })
                    .ok());
    auto down = sim.engine->ConvertAsync(CopyStream::kStore, stored.data(), activation.data(),
                                         activation.size(), Conversion::kFp32ToBf16,
                                         StreamHandle{sim.compute});
    ASSERT_TRUE(down.ok()) << down.status();
    const std::shared_ptr<CopyEvent> deps[] = {*down};
    auto up =
        sim.engine->ConvertAsync(CopyStream::kFetch, restored.data(), stored.data(), stored.size(),
                                 Conversion::kBf16ToFp32, StreamHandle{sim.compute}, deps);
    ASSERT_TRUE(up.ok()) << up.status();
    ASSERT_TRUE(sim.engine->OrderAfterAsync(StreamHandle{sim.compute}, **up).ok());
    std::atomic<bool> fresh{false};
    ASSERT_TRUE(sim.device
                    ->LaunchHostAsync(sim.compute,
                                      [&, round] {
                                        fresh = restored.front() == 1.0f + round &&
                                                restored.back() == 1.0f + round;
                                        return absl::OkStatus();
                                      })
                    .ok());
    sim.engine->Synchronize();
    sim.device->SynchronizeStream(sim.compute);
    EXPECT_TRUE(fresh) << "round " << round << ": the consumer saw stale values";
  }
}

TEST(GpuCopyEngineTest, ZeroMaxInFlightIsInvalid) {
  CudaCopyEngineOptions options;
  options.max_in_flight = 0;
  auto engine = CreateGpuCopyEngine(std::make_unique<SimGpuRuntime>(), options);
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace actstash::client_internal
