// gpu_copy_bench, sections 3 and 4 (--measure engine,strided): actstash's own
// path next to the cudaHostAlloc baseline. GB/s = 1e9 B/s. Entry point:
// RunEngineSections (gpu_copy_bench_engine.h); the rest of the benchmark and
// its usage: gpu_copy_bench.cc.
//
// 3. engine: actstash's own path. A private actstashd (--pool, 64 MiB
//    segments; or --address), one attached Client with pin_leases kOn (every
//    lease registered with CUDA, a failure is an error) and lease_batch large
//    enough to keep --engine-window of segments leased, and a CudaCopyEngine
//    on the device. Per size n: `copies` = --min-bytes / n buffers (at least
//    1), handled in batches of depth = --engine-window / n (at least 1, at
//    most `copies`). Per batch, host clock: D2H = for each buffer
//    Client::Reserve(n) + CopyAsync(kStore, reservation, device, n, after the
//    compute stream), then Wait on every event; H2D = for each buffer
//    Client::Locate + CopyAsync(kFetch, device, located, n, after the compute
//    stream) + OrderAfterAsync(compute stream), then one
//    cudaStreamSynchronize(compute stream); then Release of each (not timed).
//    The baseline (a) is timed the same way in the same repetition, right
//    before: per batch, depth cudaMemcpyAsync into successive n-byte pieces of
//    cudaHostAlloc memory and a stream sync, then the same back. Medians over
//    --reps repetitions, and of the per-repetition ratio engine/(a).
//    Target: engine D2H >= 0.90 x (a).
// 4. strided: a D x D fp32 device tensor (--strided-dim) viewed transposed
//    (sizes {D, D}, strides {1, D}) packed by CopyEngine::GatherAsync straight
//    into a reservation, against (a) cudaMemcpyAsync of the same bytes into
//    cudaHostAlloc memory and (e) the engine's contiguous CopyAsync of them
//    into a reservation; D2H only, batched and timed as in section 3.
#include "bench/gpu_copy_bench_engine.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "actstash/v1/stash.pb.h"
#include "bench/bench_util.h"
#include "testing/daemon_process.h"

namespace actstash::bench::gpu_copy {
namespace {

using actstash::Client;
using actstash::CopyEngine;
using actstash::CopyEvent;
using actstash::CopyStream;
using actstash::StreamHandle;
using actstash::TensorLayout;

// Sections 3 and 4: an attached client whose leases are registered with CUDA,
// a CudaCopyEngine on the device, and the caller's stream ("compute", idle)
// that every engine copy is ordered after.
struct EngineRig {
  Client* client = nullptr;
  CopyEngine* engine = nullptr;
  cudaStream_t compute = nullptr;
  StreamHandle after() const { return StreamHandle{reinterpret_cast<uintptr_t>(compute)}; }
};

// Host seconds of one repetition, per direction.
struct Times {
  double d2h = 0, h2d = 0;
};

double Gbps(size_t n, long count, double seconds) {
  return static_cast<double>(n) * static_cast<double>(count) / 1e9 / seconds;
}

// The baseline of sections 3 and 4: `count` copies of n bytes in batches of
// `depth`; per batch, host clock around D2H cudaMemcpyAsync from `device` into
// successive n-byte pieces of `pinned` (`pinned_bytes`, wrapping) and a sync of
// `stream`, then (when `h2d`) around the same copies back and a sync.
Times HostAllocRounds(unsigned char* pinned, size_t pinned_bytes, unsigned char* device, size_t n,
                      long count, long depth, bool h2d, cudaStream_t stream) {
  const size_t pieces = std::max<size_t>(1, pinned_bytes / n);
  Times t;
  for (long done = 0; done < count;) {
    const long batch = std::min(depth, count - done);
    Clock::time_point start = Clock::now();
    for (long k = 0; k < batch; ++k) {
      unsigned char* host = pinned + static_cast<size_t>(k) % pieces * n;
      BENCH_CUDA(cudaMemcpyAsync(host, device, n, cudaMemcpyDeviceToHost, stream));
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    t.d2h += Since(start);
    if (h2d) {
      start = Clock::now();
      for (long k = 0; k < batch; ++k) {
        const unsigned char* host = pinned + static_cast<size_t>(k) % pieces * n;
        BENCH_CUDA(cudaMemcpyAsync(device, host, n, cudaMemcpyHostToDevice, stream));
      }
      BENCH_CUDA(cudaStreamSynchronize(stream));
      t.h2d += Since(start);
    }
    done += batch;
  }
  return t;
}

// actstash's path, `count` buffers of n bytes in batches of `depth`. Per
// batch, host clock around: for each buffer Client::Reserve(n) and the
// engine's store from `device` (CopyAsync, or GatherAsync of the view
// `gather` of it when not null) ordered after rig.compute, then Wait on every
// event (D2H); when `h2d`, for each buffer Client::Locate, CopyAsync(kFetch)
// into `device` and OrderAfterAsync(rig.compute), then one sync of rig.compute
// (H2D). Then each buffer is released (not timed).
Times EngineRounds(const EngineRig& rig, unsigned char* device, size_t n, long count, long depth,
                   const TensorLayout* gather, bool h2d) {
  Times t;
  std::vector<actstash::Ticket> tickets;
  std::vector<std::shared_ptr<CopyEvent>> events;
  for (long done = 0; done < count;) {
    const long batch = std::min(depth, count - done);
    tickets.clear();
    events.clear();
    Clock::time_point start = Clock::now();
    for (long k = 0; k < batch; ++k) {
      absl::StatusOr<actstash::Reservation> reservation = rig.client->Reserve(n);
      Check(reservation.status(), "Client::Reserve of " + SizeName(n));
      if (!reservation->pinned) Die("Client::Reserve: leased memory not registered with CUDA");
      absl::StatusOr<std::shared_ptr<CopyEvent>> event =
          gather == nullptr
              ? rig.engine->CopyAsync(CopyStream::kStore, reservation->data, device, n, rig.after())
              : rig.engine->GatherAsync(CopyStream::kStore, reservation->data, n, device, *gather,
                                        rig.after());
      Check(event.status(), gather == nullptr ? "CopyAsync(kStore)" : "GatherAsync(kStore)");
      tickets.push_back(reservation->ticket);
      events.push_back(*std::move(event));
    }
    for (const std::shared_ptr<CopyEvent>& event : events) Check(event->Wait(), "engine store");
    t.d2h += Since(start);
    if (h2d) {
      events.clear();
      start = Clock::now();
      for (const actstash::Ticket& ticket : tickets) {
        absl::StatusOr<actstash::StoredBytes> located = rig.client->Locate(ticket);
        Check(located.status(), "Client::Locate");
        absl::StatusOr<std::shared_ptr<CopyEvent>> event =
            rig.engine->CopyAsync(CopyStream::kFetch, device, located->data, n, rig.after());
        Check(event.status(), "CopyAsync(kFetch)");
        Check(rig.engine->OrderAfterAsync(rig.after(), **event), "OrderAfterAsync");
        events.push_back(*std::move(event));
      }
      BENCH_CUDA(cudaStreamSynchronize(rig.compute));
      t.h2d += Since(start);
      for (const std::shared_ptr<CopyEvent>& event : events) Check(event->Wait(), "engine fetch");
    }
    for (const actstash::Ticket& ticket : tickets) Check(rig.client->Release(ticket), "Release");
    done += batch;
  }
  return t;
}

uint64_t LeasesGranted(Client& client) {
  absl::StatusOr<actstash::v1::StatsReply> stats = client.Stats();
  Check(stats.status(), "Client::Stats");
  return stats->leases_granted();
}

// The bytes survive the engine's path at n bytes: device -> reservation
// (compared with the source on the host), reservation -> zeroed device -> host.
void VerifyEngine(const EngineRig& rig, const Memory& m, size_t n, cudaStream_t stream) {
  FillPattern(m.pinned, n, 0x9E3779B97F4A7C15ull);
  BENCH_CUDA(cudaMemcpyAsync(m.device, m.pinned, n, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  absl::StatusOr<actstash::Reservation> reservation = rig.client->Reserve(n);
  Check(reservation.status(), "Client::Reserve of " + SizeName(n));
  absl::StatusOr<std::shared_ptr<CopyEvent>> event =
      rig.engine->CopyAsync(CopyStream::kStore, reservation->data, m.device, n, rig.after());
  Check(event.status(), "CopyAsync(kStore)");
  Check((*event)->Wait(), "engine store");
  if (std::memcmp(reservation->data, m.pinned, n) != 0) Die("engine D2H: bytes differ");
  BENCH_CUDA(cudaMemsetAsync(m.device, 0, n, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  absl::StatusOr<actstash::StoredBytes> located = rig.client->Locate(reservation->ticket);
  Check(located.status(), "Client::Locate");
  if (!located->pinned) Die("Client::Locate: leased memory not registered with CUDA");
  event = rig.engine->CopyAsync(CopyStream::kFetch, m.device, located->data, n, rig.after());
  Check(event.status(), "CopyAsync(kFetch)");
  Check(rig.engine->OrderAfterAsync(rig.after(), **event), "OrderAfterAsync");
  BENCH_CUDA(cudaStreamSynchronize(rig.compute));
  Check((*event)->Wait(), "engine fetch");
  std::vector<unsigned char> back(n);
  BENCH_CUDA(cudaMemcpy(back.data(), m.device, n, cudaMemcpyDeviceToHost));
  if (std::memcmp(back.data(), m.pinned, n) != 0) Die("engine H2D: bytes differ");
  Check(rig.client->Release(reservation->ticket), "Release");
}

const char* TargetMark(double ratio) { return ratio >= 0.90 ? "met" : "MISSED"; }

// Section 3.
void EngineBandwidth(const EngineRig& rig, const Memory& m, const std::vector<size_t>& sizes,
                     size_t min_bytes, size_t window, int reps, cudaStream_t stream) {
  VerifyEngine(rig, m, *std::max_element(sizes.begin(), sizes.end()), stream);
  std::printf(
      "\nEngine: Client::Reserve/Locate + CudaCopyEngine on leased segments registered by the\n"
      "client, vs cudaMemcpyAsync with cudaHostAlloc memory, host-timed in batches of `depth`\n"
      "buffers (<= %s at a time), %d repetitions, medians\n",
      SizeName(window).c_str(), reps);
  std::printf("%-9s %-4s %7s %6s %10s %10s %9s %15s %7s %7s\n", "size", "dir", "copies", "depth",
              "HostAlloc", "engine", "(e)/(a)", "(e)/(a)", "leases", "target");
  std::printf("%-9s %-4s %7s %6s %10s %10s %9s %15s %7s %7s\n", "", "", "", "", "(a) GB/s",
              "(e) GB/s", "median", "min..max", "in reps", ">=0.90");
  for (size_t n : sizes) {
    const long count = static_cast<long>(std::max<size_t>(1, min_bytes / n));
    const long depth = std::min(count, static_cast<long>(std::max<size_t>(1, window / n)));
    // Warm-up: leases mapped and registered, pieces of pinned memory touched.
    HostAllocRounds(m.pinned, m.pinned_bytes, m.device, n, depth, depth, true, stream);
    EngineRounds(rig, m.device, n, depth, depth, nullptr, true);
    const uint64_t leases_before = LeasesGranted(*rig.client);
    std::vector<double> base[2], engine[2], ratio[2];
    for (int r = 0; r < reps; ++r) {
      const Times a =
          HostAllocRounds(m.pinned, m.pinned_bytes, m.device, n, count, depth, true, stream);
      const Times e = EngineRounds(rig, m.device, n, count, depth, nullptr, true);
      base[0].push_back(Gbps(n, count, a.d2h));
      base[1].push_back(Gbps(n, count, a.h2d));
      engine[0].push_back(Gbps(n, count, e.d2h));
      engine[1].push_back(Gbps(n, count, e.h2d));
      for (int d = 0; d < 2; ++d) ratio[d].push_back(engine[d].back() / base[d].back());
    }
    const uint64_t leases = LeasesGranted(*rig.client) - leases_before;
    for (int d = 0; d < 2; ++d) {
      const double median = Median(ratio[d]);
      char range[32];
      std::snprintf(range, sizeof(range), "%.3f..%.3f",
                    *std::min_element(ratio[d].begin(), ratio[d].end()),
                    *std::max_element(ratio[d].begin(), ratio[d].end()));
      std::printf("%-9s %-4s %7ld %6ld %10.2f %10.2f %9.3f %15s %7llu %7s\n", SizeName(n).c_str(),
                  d == 0 ? "D2H" : "H2D", count, depth, Median(base[d]), Median(engine[d]), median,
                  range, static_cast<unsigned long long>(leases),
                  d == 0 ? TargetMark(median) : "-");
    }
    std::fflush(stdout);
  }
  std::printf(
      "(a) cudaMemcpyAsync with cudaHostAlloc memory; (e) Reserve + CopyAsync(kStore) + Wait "
      "(D2H),\n"
      " Locate + CopyAsync(kFetch) + OrderAfterAsync + stream sync (H2D), into/out of leased\n"
      " segments; both host-timed per batch, same repetitions. (e)/(a): per-repetition ratio,\n"
      " median and range. leases: Lease RPCs the daemon granted during the timed repetitions\n"
      " (expected 0: segments are kept leased; with --address, other sessions' count too).\n"
      " TARGET: engine D2H (e)/(a) >= 0.90 at every size (column `target`); H2D: no target.\n");
}

// Section 4.
void Strided(const EngineRig& rig, const Memory& m, int64_t dim, size_t min_bytes, size_t window,
             int reps, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(dim) * static_cast<size_t>(dim) * sizeof(float);
  unsigned char* tensor = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&tensor), bytes));
  FillPattern(m.pinned, bytes, 0xD1B54A32D192ED03ull);
  BENCH_CUDA(cudaMemcpyAsync(tensor, m.pinned, bytes, cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const TensorLayout layout{{dim, dim}, {1, dim}, static_cast<int>(sizeof(float))};

  // Verify: element (i, j) of the view is element (j, i) of the tensor.
  {
    absl::StatusOr<actstash::Reservation> reservation = rig.client->Reserve(bytes);
    Check(reservation.status(), "Client::Reserve of " + SizeName(bytes));
    absl::StatusOr<std::shared_ptr<CopyEvent>> event = rig.engine->GatherAsync(
        CopyStream::kStore, reservation->data, bytes, tensor, layout, rig.after());
    Check(event.status(), "GatherAsync(kStore)");
    Check((*event)->Wait(), "engine gather");
    const auto* in = reinterpret_cast<const uint32_t*>(m.pinned);
    const auto* out = static_cast<const uint32_t*>(reservation->data);
    const auto d = static_cast<size_t>(dim);
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = 0; j < d; ++j) {
        if (out[i * d + j] != in[j * d + i])
          Die("GatherAsync of the transposed view: wrong element");
      }
    }
    Check(rig.client->Release(reservation->ticket), "Release");
  }

  const long count = static_cast<long>(std::max<size_t>(1, min_bytes / bytes));
  const long depth = std::min(count, static_cast<long>(std::max<size_t>(1, window / bytes)));
  HostAllocRounds(m.pinned, m.pinned_bytes, tensor, bytes, depth, depth, false, stream);  // warm-up
  EngineRounds(rig, tensor, bytes, depth, depth, nullptr, false);
  EngineRounds(rig, tensor, bytes, depth, depth, &layout, false);
  std::vector<double> base, contiguous, gathered, vs_base, vs_contiguous;
  for (int r = 0; r < reps; ++r) {
    base.push_back(Gbps(
        bytes, count,
        HostAllocRounds(m.pinned, m.pinned_bytes, tensor, bytes, count, depth, false, stream).d2h));
    contiguous.push_back(
        Gbps(bytes, count, EngineRounds(rig, tensor, bytes, count, depth, nullptr, false).d2h));
    gathered.push_back(
        Gbps(bytes, count, EngineRounds(rig, tensor, bytes, count, depth, &layout, false).d2h));
    vs_base.push_back(gathered.back() / base.back());
    vs_contiguous.push_back(gathered.back() / contiguous.back());
  }
  std::printf(
      "\nStrided D2H: a %lld x %lld fp32 device tensor viewed transposed (sizes {%lld, %lld},\n"
      "strides {1, %lld}), %s, %d repetitions, medians\n",
      static_cast<long long>(dim), static_cast<long long>(dim), static_cast<long long>(dim),
      static_cast<long long>(dim), static_cast<long long>(dim), SizeName(bytes).c_str(), reps);
  std::printf("%7s %6s %10s %10s %10s %9s %9s\n", "copies", "depth", "HostAlloc", "engine",
              "engine", "(g)/(a)", "(g)/(e)");
  std::printf("%7s %6s %10s %10s %10s %9s %9s\n", "", "", "(a) GB/s", "copy (e)", "gather (g)", "",
              "");
  std::printf("%7ld %6ld %10.2f %10.2f %10.2f %9.3f %9.3f\n", count, depth, Median(base),
              Median(contiguous), Median(gathered), Median(vs_base), Median(vs_contiguous));
  std::printf(
      "(a) cudaMemcpyAsync of the tensor's bytes into cudaHostAlloc memory; (e) Reserve +\n"
      " CopyAsync(kStore) of them (contiguous) + Wait; (g) Reserve + GatherAsync(kStore) of the\n"
      " transposed view into the reservation + Wait. Ratios: median of per-repetition ratios.\n"
      " No target: reported.\n");
  std::fflush(stdout);
  BENCH_CUDA(cudaFree(tensor));
}

}  // namespace

void RunEngineSections(const Options& options, const Memory& m, cudaStream_t stream) {
  std::string address = options.address;
  std::unique_ptr<actstash::testing::DaemonProcess> daemon =
      StartDaemonUnless(&address, options.pool);
  actstash::ClientOptions client_options;
  client_options.address = address;
  client_options.client_name = "gpu_copy_bench";
  client_options.attach = actstash::AttachMode::kRequired;
  client_options.pin_leases = actstash::PinPolicy::kOn;
  client_options.cuda_device = options.device;
  client_options.rpc_timeout = std::chrono::seconds(120);
  client_options.lease_batch = 1;
  uint64_t segment_bytes = 0;
  std::string version;
  {
    absl::StatusOr<std::unique_ptr<Client>> probe = Client::Connect(client_options);
    Check(probe.status(), "Client::Connect");
    absl::StatusOr<actstash::v1::StatsReply> stats = (*probe)->Stats();
    Check(stats.status(), "Client::Stats");
    segment_bytes = stats->pool().segment_bytes();
    version = stats->daemon_version();
    Check((*probe)->Close(), "Client::Close");
  }
  if (segment_bytes == 0) Die("the daemon reports 0-byte segments");
  // Keeps a whole window of segments leased across batches (Release gives
  // back empty segments beyond lease_batch), so no Lease RPC is timed.
  client_options.lease_batch =
      static_cast<uint32_t>((options.window + segment_bytes - 1) / segment_bytes + 1);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  Check(client.status(), "Client::Connect");
  if (!(*client)->attached()) Die("Client::Connect: not attached");
  actstash::CudaCopyEngineOptions engine_options;
  engine_options.device = options.device;
  absl::StatusOr<std::unique_ptr<CopyEngine>> engine =
      actstash::CreateCudaCopyEngine(engine_options);
  Check(engine.status(), "CreateCudaCopyEngine");
  EngineRig rig;
  rig.client = client->get();
  rig.engine = engine->get();
  BENCH_CUDA(cudaStreamCreateWithFlags(&rig.compute, cudaStreamNonBlocking));
  std::printf(
      "\nactstashd %s at %s (%s), %s segments; client attached, pin_leases on, lease_batch %u;\n"
      "CudaCopyEngine on device %d; copies ordered after a non-blocking \"compute\" stream\n",
      version.c_str(), address.c_str(), daemon != nullptr ? "started here" : "--address",
      SizeName(segment_bytes).c_str(), client_options.lease_batch, options.device);

  if (options.run_engine) {
    EngineBandwidth(rig, m, options.sizes, options.min_bytes, options.window, options.reps, stream);
  }
  if (options.run_strided) {
    Strided(rig, m, options.strided_dim, options.min_bytes, options.window, options.reps, stream);
  }

  (*engine)->Synchronize();
  engine->reset();
  BENCH_CUDA(cudaStreamDestroy(rig.compute));
  Check((*client)->Close(), "Client::Close");
  client->reset();
  StopDaemon(daemon.get());
  g_daemon = nullptr;
}

}  // namespace actstash::bench::gpu_copy
