// Inline gRPC data path against a real actstashd process: round trips,
// concurrency, quotas, handles.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "tests/integration/test_util.h"

namespace actstash::testing {
namespace {

using ::testing::HasSubstr;

class InlineRoundTripTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    DaemonProcessOptions options;
    options.pool_size = "320MiB";
    options.segment_size = "16MiB";
    daemon_ = StartDaemonOrDie(options).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr); }

  static DaemonProcess* daemon_;
};
DaemonProcess* InlineRoundTripTest::daemon_ = nullptr;

class SizedRoundTripTest : public InlineRoundTripTest,
                           public ::testing::WithParamInterface<size_t> {};

TEST_P(SizedRoundTripTest, BytesComeBackIdentical) {
  const size_t size = GetParam();
  auto client = ConnectOrDie(*daemon_);
  ASSERT_NE(client, nullptr);
  const std::vector<std::byte> payload = RandomBytes(size, size + 17);
  for (bool checksum : {false, true}) {
    PutOptions put;
    put.dtype = "float32";
    put.shape = {static_cast<int64_t>(size / 4), 1};
    put.checksum = checksum;
    absl::StatusOr<Handle> handle = client->Put(payload.data(), payload.size(), put);
    ASSERT_TRUE(handle.ok()) << handle.status();
    EXPECT_NE(handle->id, 0u);

    absl::StatusOr<Object> object = client->Get(*handle);
    ASSERT_TRUE(object.ok()) << object.status();
    EXPECT_EQ(object->info.nbytes, size);
    EXPECT_EQ(object->info.dtype, "float32");
    EXPECT_EQ(object->info.shape, put.shape);
    EXPECT_EQ(object->info.checksum_xxh3.has_value(), checksum);
    ASSERT_EQ(object->data.size(), size);
    EXPECT_TRUE(object->data == payload) << "payload of " << size << " bytes differs";

    std::vector<std::byte> into(size + 3);
    absl::StatusOr<ObjectInfo> info = client->Get(*handle, into.data(), into.size());
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(0, size == 0 ? 0 : std::memcmp(into.data(), payload.data(), size));

    absl::StatusOr<v1::StatsReply> stats = client->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->self().used_bytes(), size);
    EXPECT_EQ(stats->self().objects(), 1u);
    ASSERT_TRUE(client->Delete(*handle).ok());
    stats = client->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->self().used_bytes(), 0u);
    EXPECT_EQ(stats->self().objects(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, SizedRoundTripTest,
                         ::testing::Values(0, 1, 4096, 5 << 20, 64 << 20, (1 << 20) + 1,
                                           3 * (16 << 20) + 12345));

TEST_F(InlineRoundTripTest, GetIntoSmallBufferFailsWithoutWriting) {
  auto client = ConnectOrDie(*daemon_);
  ASSERT_NE(client, nullptr);
  const std::vector<std::byte> payload = RandomBytes(5000, 1);
  absl::StatusOr<Handle> handle = client->Put(payload.data(), payload.size());
  ASSERT_TRUE(handle.ok()) << handle.status();
  std::vector<std::byte> small(4999, std::byte{0x5a});
  absl::StatusOr<ObjectInfo> info = client->Get(*handle, small.data(), small.size());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("5000"));
  for (std::byte b : small) ASSERT_EQ(b, std::byte{0x5a});
  // The object is still there after the refused Get.
  EXPECT_TRUE(client->Get(*handle).ok());
}

TEST_F(InlineRoundTripTest, ConcurrentClientsEightThreadsTwoHundredOps) {
  constexpr int kThreads = 8;
  constexpr int kOps = 200;
  auto shared = ConnectOrDie(*daemon_, 0, "shared");
  ASSERT_NE(shared, nullptr);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Even threads share one client, odd ones have their own session.
      std::unique_ptr<Client> own = t % 2 ? ConnectOrDie(*daemon_, 0, "own") : nullptr;
      Client* client = own != nullptr ? own.get() : shared.get();
      std::mt19937_64 rng(t);
      std::vector<std::pair<Handle, std::vector<std::byte>>> live;
      for (int op = 0; op < kOps; ++op) {
        if (live.empty() || rng() % 3 != 0) {
          const size_t size = rng() % 10 == 0 ? rng() % (2 << 20) : rng() % 8192;
          std::vector<std::byte> data = RandomBytes(size, rng());
          absl::StatusOr<Handle> handle = client->Put(data.data(), data.size());
          if (!handle.ok()) {
            ADD_FAILURE() << handle.status();
            ++failures;
            continue;
          }
          live.emplace_back(*handle, std::move(data));
        } else {
          const size_t i = rng() % live.size();
          absl::StatusOr<Object> object = client->Get(live[i].first);
          if (!object.ok() || object->data != live[i].second) {
            ADD_FAILURE() << "thread " << t << " op " << op << ": "
                          << (object.ok() ? "bytes differ" : object.status().ToString());
            ++failures;
          }
          if (rng() % 2 == 0) {
            EXPECT_TRUE(client->Delete(live[i].first).ok());
            live.erase(live.begin() + static_cast<ptrdiff_t>(i));
          }
        }
      }
      for (const auto& [handle, data] : live) {
        absl::StatusOr<Object> object = client->Get(handle);
        if (!object.ok() || object->data != data) ++failures;
        EXPECT_TRUE(client->Delete(handle).ok());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  absl::StatusOr<v1::StatsReply> stats = shared->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->self().used_bytes(), 0u);
}

TEST_F(InlineRoundTripTest, QuotaExhaustedSaysRequestedAndAvailable) {
  auto client = ConnectOrDie(*daemon_, 1 << 20);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->quota_bytes(), 1u << 20);
  const std::vector<std::byte> big = RandomBytes((1 << 20) + 1, 2);
  absl::StatusOr<Handle> handle = client->Put(big.data(), big.size());
  ASSERT_EQ(handle.status().code(), absl::StatusCode::kResourceExhausted) << handle.status();
  EXPECT_THAT(std::string(handle.status().message()), HasSubstr("requested 1048577 bytes"));
  EXPECT_THAT(std::string(handle.status().message()), HasSubstr("available 1048576 bytes"));

  // Fill most of the quota; the next Put says exactly what is left.
  handle = client->Put(big.data(), 700000);
  ASSERT_TRUE(handle.ok()) << handle.status();
  absl::StatusOr<Handle> second = client->Put(big.data(), 400000);
  ASSERT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("available 348576 bytes"));
  absl::StatusOr<v1::StatsReply> stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->self().used_bytes(), 700000u) << "a refused Put must store nothing";
  EXPECT_EQ(stats->self().objects(), 1u);
  // Freeing makes room again.
  ASSERT_TRUE(client->Delete(*handle).ok());
  EXPECT_TRUE(client->Put(big.data(), 1 << 20).ok());
}

TEST_F(InlineRoundTripTest, PoolExhaustedIsResourceExhaustedAndLeavesNothing) {
  auto a = ConnectOrDie(*daemon_);
  auto b = ConnectOrDie(*daemon_);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<std::byte> chunk = RandomBytes(100 << 20, 3);
  std::vector<Handle> held;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Handle> h = a->Put(chunk.data(), chunk.size());
    ASSERT_TRUE(h.ok()) << h.status();
    held.push_back(*h);
  }
  absl::StatusOr<v1::StatsReply> before = b->Stats();
  ASSERT_TRUE(before.ok());
  absl::StatusOr<Handle> refused = b->Put(chunk.data(), chunk.size());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("requested 104857600 bytes"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("available"));
  absl::StatusOr<v1::StatsReply> after = b->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pool().used_bytes(), before->pool().used_bytes());
  EXPECT_EQ(after->self().used_bytes(), 0u);
  ASSERT_TRUE(a->Delete(absl::MakeConstSpan(held)).ok());
  EXPECT_TRUE(b->Put(chunk.data(), chunk.size()).ok());
}

TEST_F(InlineRoundTripTest, UnknownAndForeignHandlesAreNotFound) {
  auto owner = ConnectOrDie(*daemon_);
  auto other = ConnectOrDie(*daemon_);
  ASSERT_NE(owner, nullptr);
  ASSERT_NE(other, nullptr);
  const std::vector<std::byte> secret = RandomBytes(4096, 4);
  absl::StatusOr<Handle> handle = owner->Put(secret.data(), secret.size());
  ASSERT_TRUE(handle.ok());

  absl::StatusOr<Object> stolen = other->Get(*handle);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other->Delete(*handle).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(owner->Get(Handle{987654321}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(owner->Get(Handle{0}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(owner->Delete(Handle{987654321}).code(), absl::StatusCode::kNotFound);

  // Delete is all-or-nothing: one bad handle keeps the good one alive.
  const Handle batch[] = {*handle, Handle{987654321}};
  EXPECT_EQ(owner->Delete(absl::MakeConstSpan(batch)).code(), absl::StatusCode::kNotFound);
  const Handle twice[] = {*handle, *handle};
  EXPECT_EQ(owner->Delete(absl::MakeConstSpan(twice)).code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Object> still = owner->Get(*handle);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_TRUE(still->data == secret);
  ASSERT_TRUE(owner->Delete(*handle).ok());
  EXPECT_EQ(owner->Get(*handle).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(InlineRoundTripTest, ClosingASessionFreesEverythingItHolds) {
  auto observer = ConnectOrDie(*daemon_, 0, "observer");
  ASSERT_NE(observer, nullptr);
  absl::StatusOr<v1::StatsReply> before = observer->Stats();
  ASSERT_TRUE(before.ok());
  {
    auto client = ConnectOrDie(*daemon_, 0, "closer");
    ASSERT_NE(client, nullptr);
    const std::vector<std::byte> data = RandomBytes(3 << 20, 5);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(client->Put(data.data(), data.size()).ok());
    absl::StatusOr<v1::StatsReply> during = observer->Stats(/*all_sessions=*/true);
    ASSERT_TRUE(during.ok());
    EXPECT_GE(during->pool().used_bytes(), before->pool().used_bytes() + 15 * (1 << 20));
    bool listed = false;
    for (const v1::SessionStats& s : during->all_sessions()) {
      if (s.session_id() == client->session_id()) {
        listed = true;
        EXPECT_EQ(s.client_name(), "closer");
        EXPECT_EQ(s.objects(), 5u);
        EXPECT_EQ(s.used_bytes(), 15u << 20);
        EXPECT_EQ(s.client_pid(), static_cast<uint32_t>(getpid()));
      }
    }
    EXPECT_TRUE(listed);
    ASSERT_TRUE(client->Close().ok());
    EXPECT_EQ(client->Stats().status().code(), absl::StatusCode::kFailedPrecondition);
  }
  absl::StatusOr<v1::StatsReply> after = observer->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pool().used_bytes(), before->pool().used_bytes());
  EXPECT_EQ(after->objects(), before->objects());
}

}  // namespace
}  // namespace actstash::testing
