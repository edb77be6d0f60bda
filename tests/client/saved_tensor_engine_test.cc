// SavedTensorEngine against a real actstashd: every path of a saved tensor's
// life (inline and asynchronous stores, views, fetches, prefetch, release,
// version check, downcast, failure policies) with byte checks, owner
// reference counts and the daemon's own accounting.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "actstash/client.h"
#include "actstash/saved_tensors.h"
#include "actstash/v1/stash.pb.h"
#include "client/copy/gpu_copy_engine.h"
#include "kernels/bf16.h"
#include "testing/daemon_process.h"
#include "tests/client/sim_gpu_runtime.h"

namespace actstash {
namespace {

// An owner reference: the engine acquires and releases it through the
// functions below; the test checks every acquire was released.
struct Owner {
  std::atomic<int> refs{0};
  std::atomic<int> acquired{0};
};
void AcquireOwner(void* p) {
  static_cast<Owner*>(p)->refs += 1;
  static_cast<Owner*>(p)->acquired += 1;
}
void ReleaseOwner(void* p) { static_cast<Owner*>(p)->refs -= 1; }

class SavedTensorEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    testing::DaemonProcessOptions options;
    options.pool_size = "256MiB";
    options.segment_size = "8MiB";
    auto daemon = testing::DaemonProcess::Start(options);
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
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::shared_ptr<Client>(std::move(*client));
  }

  // Views for every CPU size unless a test says otherwise.
  std::unique_ptr<SavedTensorEngine> Engine(std::shared_ptr<Client> client,
                                            EngineOptions options = ViewsOfAnySize()) {
    options.acquire_owner = &AcquireOwner;
    options.release_owner = &ReleaseOwner;
    auto engine = SavedTensorEngine::Create(std::move(client), std::move(options));
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }

  static EngineOptions ViewsOfAnySize() {
    EngineOptions options;
    options.view_min_bytes = 0;
    return options;
  }

  // Every CPU store through a host copy engine that sleeps a random time up
  // to `max_delay` (seeded) before each copy: stores stay in flight.
  static EngineOptions SlowStores(std::chrono::microseconds max_delay, uint64_t seed = 0) {
    EngineOptions options = ViewsOfAnySize();
    options.inline_store_bytes = 0;
    HostCopyEngineOptions slow;
    slow.max_injected_delay = max_delay;
    slow.seed = seed;
    options.host_engine = CreateHostCopyEngine(slow);
    return options;
  }

  static SavedTensorInfo Dense(const std::vector<float>& v, Owner* owner = nullptr,
                               uint64_t version = 0) {
    SavedTensorInfo info;
    info.data = reinterpret_cast<uintptr_t>(v.data());
    info.nbytes = v.size() * sizeof(float);
    info.element_size = 4;
    info.is_fp32 = true;
    info.owner = owner;
    info.version = version;
    return info;
  }

  static std::vector<float> Iota(size_t n, float start = 0.5f) {
    std::vector<float> v(n);
    std::iota(v.begin(), v.end(), start);
    return v;
  }

  static testing::DaemonProcess* daemon_;
};

testing::DaemonProcess* SavedTensorEngineTest::daemon_ = nullptr;

constexpr KeepReason kNone = KeepReason::kCount;

// A stand-in for Python's GIL: Pack is called with it held; the engine lets
// it go (unlock_caller/relock_caller) while it waits for copies.
// RelockCaller takes it back only once another thread has had it (within
// 10 s): proof that it was free while the engine waited.
std::mutex g_caller_lock;
std::atomic<bool> g_caller_holds{false};
std::atomic<int> g_unlocks{0};
std::atomic<int> g_taken_by_other{0};
std::atomic<int> g_expected_taken{0};
void* UnlockCaller() {
  g_unlocks += 1;
  g_expected_taken = g_taken_by_other + 1;
  g_caller_holds = false;
  g_caller_lock.unlock();
  return &g_caller_lock;
}
void RelockCaller(void* token) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (g_taken_by_other < g_expected_taken && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  static_cast<std::mutex*>(token)->lock();
  g_caller_holds = true;
}

// Copies slower than the producer (a GPU ahead of PCIe): the sources held
// for stores in flight stay within max_in_flight_bytes; Pack waits for the
// oldest (counted), and every byte still arrives.
TEST_F(SavedTensorEngineTest, SourcesInFlightStayWithinTheByteBound) {
  auto client = Connect();
  EngineOptions options = SlowStores(std::chrono::milliseconds(4));
  constexpr uint64_t kTensorBytes = 256 << 10;
  options.max_in_flight_bytes = 3 * kTensorBytes;
  auto engine = Engine(client, options);
  std::vector<std::vector<float>> tensors;
  std::vector<Owner> owners(24);
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < owners.size(); ++i) {
    tensors.push_back(Iota(kTensorBytes / 4, static_cast<float>(i)));
  }
  for (size_t i = 0; i < owners.size(); ++i) {
    ids.push_back(engine->Pack(Dense(tensors[i], &owners[i]), kNone, 0));
    ASSERT_GT(ids.back(), 0u);
    const EngineStats s = engine->stats();
    EXPECT_LE(s.in_flight_bytes, options.max_in_flight_bytes) << "after pack " << i;
    int held = 0;
    for (const Owner& owner : owners) held += owner.refs;
    EXPECT_LE(static_cast<uint64_t>(held) * kTensorBytes, options.max_in_flight_bytes)
        << "sources held after pack " << i;
  }
  EngineStats s = engine->stats();
  EXPECT_GT(s.in_flight_waits, 0u);
  EXPECT_GT(s.in_flight_wait_ns, 0u);
  EXPECT_LE(s.peak_in_flight_bytes, options.max_in_flight_bytes);
  EXPECT_GE(s.peak_in_flight_bytes, 2 * kTensorBytes) << "copies did overlap the producer";
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<float> back(tensors[i].size());
    auto r = engine->UnpackBegin(ids[i], 0);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->kind == UnpackKind::kView) {
      std::memcpy(back.data(), r->data, kTensorBytes);
      engine->ViewDone(ids[i]);
    } else {
      ASSERT_EQ(r->kind, UnpackKind::kSource) << "store " << i;
      ReleaseOwner(r->owner);
      back = tensors[i];
    }
    EXPECT_EQ(back, tensors[i]) << "tensor " << i;
    engine->Release(ids[i]);
  }
  engine->Synchronize();
  for (const Owner& owner : owners) EXPECT_EQ(owner.refs, 0);
}

// With no bound, the same producer piles up every source: what the bound
// prevents.
TEST_F(SavedTensorEngineTest, WithoutTheBoundSourcesPileUp) {
  auto client = Connect();
  EngineOptions options = SlowStores(std::chrono::milliseconds(4));
  options.max_in_flight_bytes = 0;
  options.max_in_flight_stores = 0;
  auto engine = Engine(client, options);
  constexpr uint64_t kTensorBytes = 256 << 10;
  std::vector<std::vector<float>> tensors(24, Iota(kTensorBytes / 4));
  std::vector<Owner> owners(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    ASSERT_GT(engine->Pack(Dense(tensors[i], &owners[i]), kNone, 0), 0u);
  }
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.in_flight_waits, 0u);
  EXPECT_GT(s.peak_in_flight_bytes, 3 * kTensorBytes);
  engine->Synchronize();
}

// The caller's lock (the GIL) is free while Pack waits for the bound, and
// Pack gets it back before returning. Deterministic: the first store cannot
// finish until a gate on the (simulated) producer's stream opens, and only
// another thread holding the caller's lock opens it. So the second Pack must
// wait, and that wait ends only if the lock was let go (else the gate times
// out after 10 s and the test fails instead of hanging).
TEST_F(SavedTensorEngineTest, PackWaitsWithTheCallersLockLetGo) {
  using client_internal::testing::ShareRuntime;
  using client_internal::testing::SimGpuRuntime;
  auto device = std::make_shared<SimGpuRuntime>();
  auto gpu = client_internal::CreateGpuCopyEngine(ShareRuntime(device), CudaCopyEngineOptions{});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const client_internal::GpuStream compute = *device->CreateStream();
  auto client = Connect();
  EngineOptions options = ViewsOfAnySize();
  options.cuda_engines = {std::shared_ptr<CopyEngine>(*std::move(gpu))};
  options.max_in_flight_bytes = 1;  // every store waits for the one before it
  options.unlock_caller = &UnlockCaller;
  options.relock_caller = &RelockCaller;
  auto engine = Engine(client, options);
  std::atomic<bool> gate{false};
  std::atomic<bool> gate_timed_out{false};
  ASSERT_TRUE(device
                  ->LaunchHostAsync(compute,
                                    [&] {
                                      const auto deadline = std::chrono::steady_clock::now() +
                                                            std::chrono::seconds(10);
                                      while (!gate && std::chrono::steady_clock::now() < deadline) {
                                        std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                      }
                                      gate_timed_out = !gate;
                                      return absl::OkStatus();
                                    })
                  .ok());
  std::vector<std::vector<float>> tensors(4, Iota(16 << 10));
  std::vector<Owner> owners(tensors.size());
  g_unlocks = 0;
  g_taken_by_other = 0;
  std::atomic<bool> packing{true};
  g_caller_lock.lock();
  g_caller_holds = true;
  std::thread other([&] {
    while (true) {
      std::lock_guard<std::mutex> hold(g_caller_lock);  // free only while Pack waits
      if (!packing) break;
      g_taken_by_other += 1;
      gate = true;
    }
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    SavedTensorInfo info = Dense(tensors[i], &owners[i]);
    info.device = 0;  // on the simulated device, produced on `compute`
    info.stream = StreamHandle{compute};
    EXPECT_GT(engine->Pack(info, kNone, 0), 0u);
    EXPECT_TRUE(g_caller_holds) << "Pack returned without the caller's lock";
  }
  packing = false;
  g_caller_holds = false;
  g_caller_lock.unlock();
  other.join();
  device->SynchronizeStream(compute);
  EXPECT_FALSE(gate_timed_out) << "Pack waited with the caller's lock held";
  const EngineStats s = engine->stats();
  EXPECT_GE(s.in_flight_waits, 1u) << "the second store had to wait for the gated first";
  EXPECT_EQ(static_cast<uint64_t>(g_unlocks.load()), s.in_flight_waits);
  EXPECT_GE(g_taken_by_other.load(), g_unlocks.load())
      << "the caller's lock was not free during every wait";
  engine->Synchronize();
  for (const Owner& owner : owners) EXPECT_EQ(owner.refs, 0);
}

// A CUDA tensor on a GPU whose copy engine cannot be created (here: no
// device, or a build without CUDA) is kept with its own reason, and the
// CUDA error reaches the front-end: an error under kRaise, a notice under
// kKeep, where CPU offload goes on.
TEST_F(SavedTensorEngineTest, FailedCudaEngineCreationIsReportedNotSilent) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: creation succeeds";
  for (const FailurePolicy policy : {FailurePolicy::kRaise, FailurePolicy::kKeep}) {
    auto client = Connect();
    EngineOptions options = ViewsOfAnySize();
    options.on_failure = policy;
    auto engine = Engine(client, options);
    const std::vector<float> v = Iota(4096);
    SavedTensorInfo on_gpu = Dense(v);
    on_gpu.device = 0;  // never read: no engine copies it
    EXPECT_EQ(engine->Pack(on_gpu, kNone, 0), 0u);
    EXPECT_EQ(engine->stats().kept_by_reason[static_cast<int>(KeepReason::kNoCopyEngine)], 1u);
    EXPECT_EQ(engine->stats().kept_by_reason[static_cast<int>(KeepReason::kDevice)], 0u);
    const absl::Status error = engine->TakeError();
    const absl::Status notice = engine->TakeNotice();
    const absl::Status& reported = policy == FailurePolicy::kRaise ? error : notice;
    EXPECT_FALSE(reported.ok());
    EXPECT_NE(reported.message().find("CUDA copy engine for GPU 0 could not be created"),
              std::string::npos)
        << reported;
    EXPECT_TRUE((policy == FailurePolicy::kRaise ? notice : error).ok());
    // Not tried again, reported once; the tensor is kept for the same reason.
    EXPECT_EQ(engine->Pack(on_gpu, kNone, 0), 0u);
    EXPECT_EQ(engine->stats().kept_by_reason[static_cast<int>(KeepReason::kNoCopyEngine)], 2u);
    EXPECT_TRUE(engine->TakeError().ok());
    EXPECT_TRUE(engine->TakeNotice().ok());
    // CPU tensors are still offloaded.
    EXPECT_GT(engine->Pack(Dense(v), kNone, 0), 0u);
    EXPECT_TRUE(engine->available());
  }
}

// Device tensors through the real CUDA engine logic (GpuCopyEngine) on the
// simulated device, with random op delays and a deliberately slow compute
// stream: each activation is written late by a "kernel" on the compute
// stream, packed right away (the store must wait for the producer, the host
// must not), its source slot reused by a later "kernel" once the engine lets
// go of it, and read back in backward (fetch or prefetch) by a "kernel" that
// checks the bytes on the compute stream (the consumer must wait for the
// fetch). Any missing order shows as wrong bytes.
TEST_F(SavedTensorEngineTest, DeviceTensorsThroughTheGpuEngineOnASimulatedDevice) {
  using client_internal::testing::ShareRuntime;
  using client_internal::testing::SimGpuRuntime;
  using client_internal::testing::SimOptions;
  auto device =
      std::make_shared<SimGpuRuntime>(SimOptions{std::chrono::microseconds(200), /*seed=*/11});
  auto gpu = client_internal::CreateGpuCopyEngine(ShareRuntime(device), CudaCopyEngineOptions{});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const client_internal::GpuStream compute = *device->CreateStream();
  device->SetStreamDelay(compute, std::chrono::microseconds(1500));
  auto client = Connect();
  EngineOptions options = ViewsOfAnySize();
  options.prefetch = 2;
  options.cuda_engines = {std::shared_ptr<CopyEngine>(*std::move(gpu))};
  options.max_in_flight_bytes = 2 * (64 << 10);  // the bound waits on simulated events too
  auto engine = Engine(client, options);
  constexpr int kTensors = 12;
  constexpr size_t kFloats = 16 << 10;  // 64 KiB
  auto value = [](int i, size_t k) { return static_cast<float>(i * 100003 + k); };
  // Source slots on the "device", reused: three, as a caching allocator would.
  std::vector<std::vector<float>> slots(3, std::vector<float>(kFloats));
  std::vector<Owner> owners(kTensors);
  std::vector<Owner> cookies(kTensors);
  std::vector<uint64_t> ids;
  for (int i = 0; i < kTensors; ++i) {
    std::vector<float>& slot = slots[i % slots.size()];
    // The slot is free once the engine released the source that used it.
    if (i >= static_cast<int>(slots.size())) {
      const Owner& previous = owners[i - slots.size()];
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (previous.refs > 0 && std::chrono::steady_clock::now() < deadline) {
        (void)engine->Reap(/*wait=*/false);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      ASSERT_EQ(previous.refs, 0) << "source " << i - slots.size() << " never released";
    }
    float* data = slot.data();
    ASSERT_TRUE(device
                    ->LaunchHostAsync(compute,
                                      [data, i, &value] {
                                        for (size_t k = 0; k < kFloats; ++k) data[k] = value(i, k);
                                        return absl::OkStatus();
                                      })
                    .ok());
    SavedTensorInfo info = Dense(slot, &owners[i]);
    info.device = 0;
    info.stream = StreamHandle{compute};
    info.cookie = &cookies[i];
    ids.push_back(engine->Pack(info, kNone, 0));
    ASSERT_GT(ids.back(), 0u) << i;
  }
  std::vector<std::vector<float>> back(kTensors, std::vector<float>(kFloats));
  std::vector<Owner> dst_owners(kTensors);
  std::atomic<int> wrong{0};
  for (int i = kTensors - 1; i >= 0; --i) {
    auto r = engine->UnpackBegin(ids[i], 0);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->kind == UnpackKind::kSource) {
      // The store was still in flight: the source itself is handed back. Its
      // slot was not reused meanwhile (the engine held it).
      ASSERT_EQ(r->owner, &owners[i]);
      ReleaseOwner(r->owner);
      engine->Release(ids[i]);
      continue;
    }
    if (r->kind == UnpackKind::kPrefetched) {
      ReleaseOwner(r->owner);
      ASSERT_TRUE(engine->Finish(ids[i], StreamHandle{compute}).ok());
    } else {
      ASSERT_EQ(r->kind, UnpackKind::kDestination) << i;
      ASSERT_TRUE(engine
                      ->FetchInto(ids[i], reinterpret_cast<uintptr_t>(back[i].data()), kFloats * 4,
                                  StreamHandle{compute})
                      .ok());
    }
    for (size_t k = 0; k < r->prefetch_ids.size(); ++k) {
      const int j = static_cast<int>(r->prefetch_ids[k] - ids[0]);
      ReleaseOwner(r->prefetch_cookies[k]);
      ASSERT_TRUE(engine
                      ->Prefetch(r->prefetch_ids[k], reinterpret_cast<uintptr_t>(back[j].data()),
                                 kFloats * 4, &dst_owners[j], StreamHandle{compute})
                      .ok());
    }
    const float* got = back[i].data();
    ASSERT_TRUE(device
                    ->LaunchHostAsync(compute,
                                      [got, i, &wrong, &value] {
                                        for (size_t k = 0; k < kFloats; ++k) {
                                          if (got[k] != value(i, k)) {
                                            ++wrong;
                                            break;
                                          }
                                        }
                                        return absl::OkStatus();
                                      })
                    .ok());
    engine->Release(ids[i]);
  }
  device->SynchronizeStream(compute);
  engine->Synchronize();
  EXPECT_EQ(wrong.load(), 0) << "a consumer read bytes its fetch had not written yet";
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.tensors_offloaded, static_cast<uint64_t>(kTensors));
  EXPECT_GT(s.prefetch_hits, 0u);
  // Most came back through the device engine (the last ones packed may still
  // have been in flight: served from their sources).
  EXPECT_GE(s.tensors_fetched + s.unpacked_from_source, static_cast<uint64_t>(kTensors));
  EXPECT_GE(s.tensors_fetched, static_cast<uint64_t>(kTensors) / 2) << s.unpacked_from_source;
  EXPECT_GT(s.in_flight_waits, 0u) << "the producer outran the copies: the bound waited";
  EXPECT_LE(s.peak_in_flight_bytes, options.max_in_flight_bytes);
  EXPECT_EQ(s.live_tensors, 0u);
  for (const Owner& owner : owners) EXPECT_EQ(owner.refs, 0);
  EXPECT_EQ(device->bad_handle_uses(), 0);
}

TEST_F(SavedTensorEngineTest, SmallCpuTensorIsStoredInlineAndReadAsAView) {
  auto client = Connect();
  auto engine = Engine(client);
  const std::vector<float> v = Iota(1024);
  Owner owner;
  const uint64_t id = engine->Pack(Dense(v, &owner), kNone, 0);
  ASSERT_GT(id, 0u);
  EXPECT_EQ(owner.acquired, 0) << "an inline store holds no source";
  EXPECT_EQ(client->zero_copy_usage().bytes(), v.size() * 4) << "the bytes are in leased memory";
  auto r = engine->UnpackBegin(id, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->kind, UnpackKind::kView);
  EXPECT_EQ(std::memcmp(r->data, v.data(), v.size() * 4), 0);
  EngineStats s = engine->stats();
  EXPECT_EQ(s.tensors_offloaded, 1u);
  EXPECT_EQ(s.inline_stores, 1u);
  EXPECT_EQ(s.views, 1u);
  engine->Release(id);  // autograd dropped it; the view still reads the bytes
  EXPECT_EQ(client->zero_copy_usage().objects(), 1u);
  EXPECT_EQ(std::memcmp(r->data, v.data(), v.size() * 4), 0);
  engine->ViewDone(id);
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);
  EXPECT_EQ(engine->stats().live_bytes, 0u);
}

TEST_F(SavedTensorEngineTest, SmallCpuTensorsAreCopiedBackOnTheUnpackingThread) {
  auto client = Connect();
  auto engine = Engine(client, EngineOptions{});  // views from 32 KiB up
  const std::vector<float> small = Iota(1024);
  const std::vector<float> large = Iota(16 << 10);
  const uint64_t small_id = engine->Pack(Dense(small), kNone, 0);
  const uint64_t large_id = engine->Pack(Dense(large), kNone, 0);
  auto r = engine->UnpackBegin(large_id, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kind, UnpackKind::kView);
  EXPECT_TRUE(r->prefetch_ids.empty()) << "CPU tensors are not prefetched with views on";
  engine->ViewDone(large_id);
  r = engine->UnpackBegin(small_id, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->kind, UnpackKind::kDestination);
  std::vector<float> out(1024);
  ASSERT_TRUE(
      engine->FetchInto(small_id, reinterpret_cast<uintptr_t>(out.data()), 4096, StreamHandle{})
          .ok());
  EXPECT_EQ(out, small);
  EXPECT_EQ(
      engine->FetchInto(small_id, reinterpret_cast<uintptr_t>(out.data()), 4092, StreamHandle{})
          .code(),
      absl::StatusCode::kOutOfRange);
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.views, 1u);
  EXPECT_EQ(s.tensors_fetched, 2u);
  EXPECT_EQ(s.wait_ns, 0u) << "no copy stream was involved";
  engine->Release(small_id);
  engine->Release(large_id);
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);
}

TEST_F(SavedTensorEngineTest, AsyncStoreHoldsItsSourceUntilDoneAndUnpackUsesItMeanwhile) {
  auto client = Connect();
  EngineOptions options = SlowStores(std::chrono::milliseconds(200), 7);
  auto engine = Engine(client, options);
  std::vector<std::vector<float>> sources;
  std::vector<Owner> owners(20);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 20; ++i) sources.push_back(Iota(4096, i));
  for (int i = 0; i < 20; ++i) ids.push_back(engine->Pack(Dense(sources[i], &owners[i]), kNone, 0));
  int from_source = 0;
  for (int i = 19; i >= 0; --i) {
    auto r = engine->UnpackBegin(ids[i], 0);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->kind == UnpackKind::kSource) {
      EXPECT_EQ(r->owner, &owners[i]);
      ReleaseOwner(r->owner);  // the reference handed over
      ++from_source;
    } else {
      ASSERT_EQ(r->kind, UnpackKind::kView);
      EXPECT_EQ(std::memcmp(r->data, sources[i].data(), 4096 * 4), 0) << i;
      engine->ViewDone(ids[i]);
    }
    engine->Release(ids[i]);
  }
  EXPECT_GT(from_source, 0) << "with 200 ms delays some stores were still in flight";
  engine->Synchronize();
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(owners[i].refs, 0) << i;
    EXPECT_GE(owners[i].acquired, 1) << i;
  }
  EXPECT_EQ(engine->stats().unpacked_from_source, static_cast<uint64_t>(from_source));
  EXPECT_EQ(engine->stats().live_bytes, 0u);
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);
}

// A front-end that passes no owners (it keeps its sources alive itself):
// while a store runs there is no source to serve an unpack, so the unpack
// waits for the store and then reads exact bytes; a tensor released while
// its store runs keeps its reservation until the copy into it ends (the
// state is kReleasedStoring, not "no owner, so stored").
TEST_F(SavedTensorEngineTest, StoresWithoutOwnersAreWaitedForAndOutliveTheirRelease) {
  auto client = Connect();
  EngineOptions options = SlowStores(std::chrono::milliseconds(100), 11);
  auto engine = Engine(client, options);
  std::vector<std::vector<float>> sources;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 8; ++i) sources.push_back(Iota(16 << 10, 2.0f * i));
  for (int i = 0; i < 8; ++i) ids.push_back(engine->Pack(Dense(sources[i]), kNone, 0));
  ASSERT_GT(engine->stats().in_flight, 0u) << "with 100 ms delays some stores are in flight";
  // The even ones are released at once, their stores still running.
  for (int i = 0; i < 8; i += 2) engine->Release(ids[i]);
  EXPECT_EQ(engine->stats().live_tensors, 4u);
  for (int i = 7; i >= 1; i -= 2) {
    auto r = engine->UnpackBegin(ids[i], SavedTensorEngine::kUnknownVersion);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->kind, UnpackKind::kView) << i;
    EXPECT_EQ(std::memcmp(r->data, sources[i].data(), sources[i].size() * 4), 0) << i;
    engine->ViewDone(ids[i]);
    engine->Release(ids[i]);
  }
  EXPECT_EQ(engine->stats().unpacked_from_source, 0u);
  ASSERT_TRUE(engine->Reap(/*wait=*/true).ok());
  engine->Synchronize();
  const EngineStats stats = engine->stats();
  EXPECT_EQ(stats.in_flight, 0u);
  EXPECT_EQ(stats.live_bytes, 0u);
  EXPECT_EQ(stats.store_failures, 0u);
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);  // every reservation given back
}

TEST_F(SavedTensorEngineTest, ViewWithGapsIsGatheredInlineAndAsynchronously) {
  auto client = Connect();
  for (uint64_t inline_bytes : {uint64_t{1} << 20, uint64_t{0}}) {
    EngineOptions options = ViewsOfAnySize();
    options.inline_store_bytes = inline_bytes;
    auto engine = Engine(client, options);
    // A [8, 16] view with a row stride of 32 (every other half row unused), transposed.
    const std::vector<float> base = Iota(8 * 32);
    const int64_t sizes[] = {16, 8};
    const int64_t strides[] = {1, 32};
    SavedTensorInfo info = Dense(base);
    info.dense = false;
    info.nbytes = 16 * 8 * 4;
    info.ndim = 2;
    info.sizes = sizes;
    info.strides = strides;
    Owner owner;
    info.owner = &owner;
    const uint64_t id = engine->Pack(info, kNone, 0);
    ASSERT_GT(id, 0u);
    engine->Synchronize();
    auto r = engine->UnpackBegin(id, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->kind, UnpackKind::kView);
    const float* got = static_cast<const float*>(r->data);
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 8; ++j) ASSERT_EQ(got[i * 8 + j], base[i + j * 32]) << i << "," << j;
    }
    engine->ViewDone(id);
    engine->Release(id);
    EXPECT_EQ(owner.refs, 0);
  }
}

// Prefetch applies to device tensors (CPU tensors are copied on demand on
// the unpacking thread). "Device 0" here is served by a host engine standing
// in for a CUDA engine, over host memory: the engine's bookkeeping is the
// same, only the copies differ.
TEST_F(SavedTensorEngineTest, FetchIntoAndPrefetchInReverseSaveOrder) {
  auto client = Connect();
  EngineOptions options = ViewsOfAnySize();
  options.prefetch = 2;
  HostCopyEngineOptions delays;
  delays.max_injected_delay = std::chrono::microseconds(500);
  options.cuda_engines = {CreateHostCopyEngine(delays)};
  auto engine = Engine(client, options);
  std::vector<std::vector<float>> sources;
  std::vector<Owner> cookies(6);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) sources.push_back(Iota(2048, 10 * i));
  for (int i = 0; i < 6; ++i) {
    SavedTensorInfo info = Dense(sources[i]);
    info.device = 0;
    info.cookie = &cookies[i];
    ids.push_back(engine->Pack(info, kNone, 0));
  }
  engine->Synchronize();
  std::vector<std::vector<float>> prefetched(6);
  std::vector<Owner> dst_owners(6);
  for (int i = 5; i >= 0; --i) {
    auto r = engine->UnpackBegin(ids[i], 0);
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t k = 0; k < r->prefetch_ids.size(); ++k) {
      // Offered in reverse save order, just below the one unpacked.
      const uint64_t pid = r->prefetch_ids[k];
      const int j = static_cast<int>(pid - ids[0]);
      EXPECT_LT(j, i);
      EXPECT_EQ(r->prefetch_cookies[k], &cookies[j]);
      ReleaseOwner(r->prefetch_cookies[k]);
      prefetched[j].resize(2048);
      ASSERT_TRUE(engine
                      ->Prefetch(pid, reinterpret_cast<uintptr_t>(prefetched[j].data()), 2048 * 4,
                                 &dst_owners[j], StreamHandle{})
                      .ok());
    }
    std::vector<float> out(2048);
    if (i == 5) {
      ASSERT_EQ(r->kind, UnpackKind::kDestination);
      ASSERT_TRUE(
          engine
              ->FetchInto(ids[i], reinterpret_cast<uintptr_t>(out.data()), 2048 * 4, StreamHandle{})
              .ok());
    } else {
      ASSERT_EQ(r->kind, UnpackKind::kPrefetched) << i;
      EXPECT_EQ(r->owner, &dst_owners[i]);
      ReleaseOwner(r->owner);
      ASSERT_TRUE(engine->Finish(ids[i], StreamHandle{}).ok());
      out = prefetched[i];
    }
    EXPECT_EQ(out, sources[i]) << i;
    engine->Release(ids[i]);
  }
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.prefetch_issued, 5u);
  EXPECT_EQ(s.prefetch_hits, 5u);
  EXPECT_EQ(s.tensors_fetched, 6u);
  // No registrar here (no CUDA device): every "device" store went into
  // unregistered memory, which a real device copies synchronously. Counted,
  // and said once.
  if (!CudaDeviceAvailable()) {
    EXPECT_EQ(s.unpinned_device_stores, 6u);
    const absl::Status notice = engine->TakeNotice();
    EXPECT_NE(notice.message().find("not registered with CUDA"), std::string::npos) << notice;
    EXPECT_TRUE(engine->TakeNotice().ok());
  }
  engine->Synchronize();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(dst_owners[i].refs, 0) << i;
  for (int i = 0; i < 6; ++i) EXPECT_EQ(cookies[i].refs, 0) << i;
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);
}

TEST_F(SavedTensorEngineTest, ReleasedBeforeItsPrefetchFinishedKeepsTheDestinationUntilDone) {
  auto client = Connect();
  EngineOptions options = ViewsOfAnySize();
  HostCopyEngineOptions slow;
  slow.max_injected_delay = std::chrono::milliseconds(50);
  options.cuda_engines = {CreateHostCopyEngine(slow)};  // "device 0", as above
  auto engine = Engine(client, options);
  const std::vector<float> v = Iota(1024);
  SavedTensorInfo info = Dense(v);
  info.device = 0;
  const uint64_t id = engine->Pack(info, kNone, 0);
  engine->Synchronize();
  std::vector<float> dst(1024);
  Owner dst_owner;
  ASSERT_TRUE(
      engine
          ->Prefetch(id, reinterpret_cast<uintptr_t>(dst.data()), 4096, &dst_owner, StreamHandle{})
          .ok());
  engine->Release(id);
  EXPECT_EQ(dst_owner.refs, 1) << "the copy may still write it";
  engine->Synchronize();
  EXPECT_EQ(dst_owner.refs, 0);
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);
}

TEST_F(SavedTensorEngineTest, ChangedVersionFailsTheUnpack) {
  auto engine = Engine(Connect());
  const std::vector<float> v = Iota(64);
  const uint64_t id = engine->Pack(Dense(v, nullptr, 3), kNone, 0);
  auto r = engine->UnpackBegin(id, 4);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("modified by an inplace operation"), std::string::npos);
  EXPECT_TRUE(engine->UnpackBegin(id, SavedTensorEngine::kUnknownVersion).ok());
  EXPECT_TRUE(engine->UnpackBegin(id, 3).ok());
}

TEST_F(SavedTensorEngineTest, Bf16DowncastStoresHalfAndRestoresRounded) {
  auto client = Connect();
  for (uint64_t inline_bytes : {uint64_t{1} << 20, uint64_t{0}}) {
    EngineOptions options = ViewsOfAnySize();
    options.downcast_bf16 = true;
    options.inline_store_bytes = inline_bytes;
    auto engine = Engine(client, options);
    std::vector<float> v(1000);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (float& x : v) x = normal(rng);
    Owner owner;
    const uint64_t id = engine->Pack(Dense(v, &owner), kNone, 0);
    ASSERT_GT(id, 0u);
    EXPECT_EQ(engine->stats().bytes_offloaded, 2000u);
    auto r = engine->UnpackBegin(id, 0);  // waits for an asynchronous store: rounded, always
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->kind, UnpackKind::kDestination);
    EXPECT_TRUE(r->downcast);
    std::vector<float> out(1000);
    ASSERT_TRUE(
        engine->FetchInto(id, reinterpret_cast<uintptr_t>(out.data()), 4000, StreamHandle{}).ok());
    std::vector<uint16_t> bf16(1000);
    std::vector<float> expected(1000);
    kernels::Fp32ToBf16Cpu(v.data(), bf16.data(), 1000);
    kernels::Bf16ToFp32Cpu(bf16.data(), expected.data(), 1000);
    EXPECT_EQ(out, expected);
    engine->Release(id);
    engine->Synchronize();
    EXPECT_EQ(owner.refs, 0);
  }
}

TEST_F(SavedTensorEngineTest, KeepReasonsAreCounted) {
  auto engine = Engine(Connect());
  const std::vector<float> v = Iota(64);
  EXPECT_EQ(engine->Pack(Dense(v), kNone, 1 << 20), 0u);
  EXPECT_EQ(engine->Pack(Dense(v), KeepReason::kParameter, 0), 0u);
  EXPECT_EQ(engine->Pack(Dense(v), KeepReason::kKeepListed, 0), 0u);
  SavedTensorInfo cuda = Dense(v);
  cuda.device = 0;
  EngineOptions no_cuda;
  no_cuda.cuda = false;
  auto engine2 = Engine(Connect(), no_cuda);
  EXPECT_EQ(engine2->Pack(cuda, kNone, 0), 0u);
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.tensors_kept, 3u);
  EXPECT_EQ(s.kept_by_reason[static_cast<int>(KeepReason::kSmall)], 1u);
  EXPECT_EQ(s.kept_by_reason[static_cast<int>(KeepReason::kParameter)], 1u);
  EXPECT_EQ(s.kept_by_reason[static_cast<int>(KeepReason::kKeepListed)], 1u);
  EXPECT_EQ(engine2->stats().kept_by_reason[static_cast<int>(KeepReason::kDevice)], 1u);
  auto no_daemon = Engine(nullptr);
  EXPECT_EQ(no_daemon->Pack(Dense(v), kNone, 0), 0u);
  EXPECT_EQ(no_daemon->stats().kept_by_reason[static_cast<int>(KeepReason::kUnavailable)], 1u);
  EXPECT_FALSE(no_daemon->available());
}

TEST_F(SavedTensorEngineTest, FullQuotaRaisesOnceOrTurnsOffloadOff) {
  const std::vector<float> big = Iota(3 << 20);  // 12 MiB > the 8 MiB quota
  const std::vector<float> small = Iota(1024);
  for (FailurePolicy policy : {FailurePolicy::kRaise, FailurePolicy::kKeep}) {
    EngineOptions options = ViewsOfAnySize();
    options.on_failure = policy;
    auto engine = Engine(Connect(8 << 20), options);
    const uint64_t kept_id = engine->Pack(Dense(small), kNone, 0);
    ASSERT_GT(kept_id, 0u);
    EXPECT_EQ(engine->Pack(Dense(big), kNone, 0), 0u) << "kept: it does not fit";
    EXPECT_EQ(engine->stats().kept_by_reason[static_cast<int>(KeepReason::kFailed)], 1u);
    if (policy == FailurePolicy::kRaise) {
      EXPECT_EQ(engine->TakeError().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_TRUE(engine->TakeError().ok()) << "taken once";
      EXPECT_TRUE(engine->available());
      EXPECT_GT(engine->Pack(Dense(small), kNone, 0), 0u) << "offload goes on after the error";
    } else {
      EXPECT_TRUE(engine->TakeError().ok());
      EXPECT_FALSE(engine->available());
      EXPECT_EQ(engine->Pack(Dense(small), kNone, 0), 0u) << "offload is off";
    }
    // What was stored before the failure is still there.
    auto r = engine->UnpackBegin(kept_id, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(std::memcmp(r->data, small.data(), 4096), 0);
    engine->ViewDone(kept_id);
  }
}

TEST_F(SavedTensorEngineTest, ThreadsPackUnpackAndReleaseConcurrently) {
  auto client = Connect();
  EngineOptions options = ViewsOfAnySize();
  options.inline_store_bytes = 16 << 10;  // a mix of inline and asynchronous stores
  HostCopyEngineOptions delays;
  delays.max_injected_delay = std::chrono::microseconds(200);
  options.host_engine = CreateHostCopyEngine(delays);
  auto engine = Engine(client, options);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  std::vector<Owner> owners(4 * 300);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      // Sources stay alive until stored (what the owners do for a front-end).
      std::vector<std::vector<float>> sources;
      sources.reserve(300);
      std::vector<std::pair<uint64_t, const std::vector<float>*>> live;
      for (int i = 0; i < 300; ++i) {
        sources.push_back(Iota(1 + rng() % 12000, t * 1000 + i));
        const uint64_t id = engine->Pack(Dense(sources.back(), &owners[t * 300 + i]), kNone, 0);
        if (id == 0) continue;
        live.emplace_back(id, &sources.back());
        if (live.size() > 8 || rng() % 3 == 0) {
          auto [lid, source] = live.back();
          const std::vector<float>& expected = *source;
          live.pop_back();
          auto r = engine->UnpackBegin(lid, 0);
          if (!r.ok()) {
            mismatches += 1;
          } else if (r->kind == UnpackKind::kView) {
            if (std::memcmp(r->data, expected.data(), expected.size() * 4) != 0) mismatches += 1;
            engine->ViewDone(lid);
          } else if (r->kind == UnpackKind::kSource) {
            ReleaseOwner(r->owner);
          }
          engine->Release(lid);
        }
      }
      for (auto& [id, v] : live) engine->Release(id);
      engine->Synchronize();  // sources are read until stored
    });
  }
  for (auto& t : threads) t.join();
  engine->Synchronize();
  EXPECT_EQ(mismatches, 0);
  for (const Owner& o : owners) ASSERT_EQ(o.refs, 0);
  EXPECT_EQ(engine->stats().live_bytes, 0u);
  EXPECT_EQ(client->zero_copy_usage().objects(), 0u);
}

TEST(SavedTensorEngineOptions, BadOptionsAreRefused) {
  EngineOptions half;
  half.acquire_owner = &AcquireOwner;
  EXPECT_EQ(SavedTensorEngine::Create(nullptr, half).status().code(),
            absl::StatusCode::kInvalidArgument);
  EngineOptions prefetch;
  prefetch.prefetch = -1;
  EXPECT_EQ(SavedTensorEngine::Create(nullptr, prefetch).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EngineStatNames().size(), EngineStatValues(EngineStats{}).size());
}

}  // namespace
}  // namespace actstash
