// HostCopyEngine: order within a stream, events, and a producer/consumer
// chain across the two streams under random delays that never sees stale data.
#include "actstash/copy_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

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

}  // namespace
}  // namespace actstash
