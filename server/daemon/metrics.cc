#include "server/daemon/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <chrono>
#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/rpc/stats.h"
#include "server/sessions/lease_manager.h"

namespace actstash::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const char* name, const char* help, MetricType type) {
  MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

void AddValue(MetricFamily* family, double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric metric;
  metric.label = std::move(labels);
  if (family->type == MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family->metric.push_back(std::move(metric));
}

// Reads the daemon's state at scrape time: nothing to keep in sync.
class StashCollector final : public prometheus::Collectable {
 public:
  explicit StashCollector(StashCore* core) : core_(*core) {}

  std::vector<MetricFamily> Collect() const override {
    v1::StatsReply stats;
    FillStats(core_, /*self=*/nullptr, /*all_sessions=*/true, &stats);
    const v1::PoolStats& pool = stats.pool();
    std::vector<MetricFamily> out;
    MetricFamily bytes =
        Family("actstash_pool_bytes", "Host pool bytes by state (used = held by sessions)",
               MetricType::Gauge);
    const std::pair<const char*, uint64_t> states[] = {{"total", pool.total_bytes()},
                                                       {"used", pool.used_bytes()},
                                                       {"free", pool.free_bytes()},
                                                       {"renewing", pool.renewing_bytes()},
                                                       {"leased", pool.leased_bytes()},
                                                       {"locked", pool.locked_bytes()},
                                                       {"cuda_pinned", pool.cuda_pinned_bytes()}};
    for (const auto& [state, value] : states) {
      AddValue(&bytes, static_cast<double>(value), {{"state", state}});
    }
    out.push_back(std::move(bytes));
    if (pool.numa_nodes_size() > 0) {
      MetricFamily node_bytes =
          Family("actstash_pool_numa_bytes",
                 "Host pool bytes on each NUMA node the pool is bound to (--numa), by state",
                 MetricType::Gauge);
      for (const v1::NumaNodeStats& node : pool.numa_nodes()) {
        const std::string id = std::to_string(node.node());
        const std::pair<const char*, uint64_t> node_states[] = {{"total", node.total_bytes()},
                                                                {"free", node.free_bytes()},
                                                                {"leased", node.leased_bytes()}};
        for (const auto& [state, value] : node_states) {
          AddValue(&node_bytes, static_cast<double>(value), {{"node", id}, {"state", state}});
        }
      }
      out.push_back(std::move(node_bytes));
    }
    if (stats.device_pools_size() > 0) {
      MetricFamily device_bytes = Family(
          "actstash_device_pool_bytes",
          "Device pool bytes by GPU and state (used = leased to sessions; scrubbing = returned, "
          "being zeroed)",
          MetricType::Gauge);
      MetricFamily device_leases =
          Family("actstash_device_leases", "Device pool leases held by sessions, by GPU",
                 MetricType::Gauge);
      for (const v1::DevicePoolStats& device : stats.device_pools()) {
        const v1::PoolStats& d = device.pool();
        const std::string gpu = std::to_string(device.device());
        const std::pair<const char*, uint64_t> device_states[] = {
            {"total", d.total_bytes()},
            {"used", d.used_bytes()},
            {"free", d.free_bytes()},
            {"scrubbing", d.renewing_bytes()}};
        for (const auto& [state, value] : device_states) {
          AddValue(&device_bytes, static_cast<double>(value), {{"device", gpu}, {"state", state}});
        }
        AddValue(&device_leases, static_cast<double>(d.leases()), {{"device", gpu}});
      }
      out.push_back(std::move(device_bytes));
      out.push_back(std::move(device_leases));
    }
    size_t attached = 0;
    for (const v1::SessionStats& s : stats.all_sessions()) attached += s.attached();
    MetricFamily session_gauge = Family("actstash_sessions", "Open sessions", MetricType::Gauge);
    AddValue(&session_gauge, static_cast<double>(stats.all_sessions_size() - attached),
             {{"attached", "false"}});
    AddValue(&session_gauge, static_cast<double>(attached), {{"attached", "true"}});
    out.push_back(std::move(session_gauge));
    const std::tuple<const char*, const char*, MetricType, double> simple[] = {
        {"actstash_pool_segments", "Segments in the host pool", MetricType::Gauge,
         static_cast<double>(pool.segments())},
        {"actstash_leases", "Leases held by sessions", MetricType::Gauge,
         static_cast<double>(pool.leases())},
        {"actstash_objects", "Objects stored through the inline path", MetricType::Gauge,
         static_cast<double>(stats.objects())},
        {"actstash_stored_bytes_total", "Bytes stored through the inline path (Put)",
         MetricType::Counter, static_cast<double>(stats.bytes_stored())},
        {"actstash_fetched_bytes_total", "Bytes fetched through the inline path (Get)",
         MetricType::Counter, static_cast<double>(stats.bytes_fetched())},
        {"actstash_leases_granted_total", "Leases granted since start", MetricType::Counter,
         static_cast<double>(stats.leases_granted())},
        {"actstash_sessions_reclaimed_total",
         "Sessions closed because their client vanished or idled out", MetricType::Counter,
         static_cast<double>(stats.sessions_reclaimed())},
        {"actstash_copying_sessions",
         "Sessions that copied within the copy window (they share the node's copy bandwidth)",
         MetricType::Gauge, static_cast<double>(stats.copy().copying_sessions())},
        {"actstash_node_copy_bytes_per_second",
         "The node's copy bandwidth, all sessions together (--copy-bandwidth; 0: unknown)",
         MetricType::Gauge, stats.copy().node_bytes_per_second()},
    };
    for (const auto& [name, help, type, value] : simple) {
      MetricFamily family = Family(name, help, type);
      AddValue(&family, value);
      out.push_back(std::move(family));
    }
    // Zero-copy traffic is placed by the clients; they report it (ReportUsage).
    double local_stored = 0, local_fetched = 0, state_bytes = 0;
    for (const v1::SessionStats& s : stats.all_sessions()) {
      local_stored += static_cast<double>(s.client().bytes_stored());
      local_fetched += static_cast<double>(s.client().bytes_fetched());
      state_bytes += static_cast<double>(s.client().state_bytes());
    }
    MetricFamily local = Family("actstash_zero_copy_bytes",
                                "Bytes stored/fetched by open sessions through the zero-copy "
                                "path, as reported by their clients",
                                MetricType::Gauge);
    AddValue(&local, local_stored, {{"direction", "stored"}});
    AddValue(&local, local_fetched, {{"direction", "fetched"}});
    out.push_back(std::move(local));
    MetricFamily state = Family("actstash_optimizer_state_bytes",
                                "Long-lived state (optimizer moments, master weights) that open "
                                "sessions keep in leased pool memory, as their clients report it",
                                MetricType::Gauge);
    AddValue(&state, state_bytes);
    out.push_back(std::move(state));
    if (stats.has_spill()) AddSpill(stats, &out);
    return out;
  }

 private:
  // The spill tier's numbers (--spill-dir only).
  static void AddSpill(const v1::StatsReply& stats, std::vector<MetricFamily>* out) {
    const v1::SpillStats& spill = stats.spill();
    MetricFamily bytes = Family("actstash_spill_bytes",
                                "Spill tier bytes by state (on_disk includes writing; capacity "
                                "is --spill-size, 0 for the free space)",
                                MetricType::Gauge);
    AddValue(&bytes, static_cast<double>(spill.on_disk_bytes()), {{"state", "on_disk"}});
    AddValue(&bytes, static_cast<double>(spill.writing_bytes()), {{"state", "writing"}});
    AddValue(&bytes, static_cast<double>(spill.reading_bytes()), {{"state", "reading"}});
    AddValue(&bytes, static_cast<double>(spill.capacity_bytes()), {{"state", "capacity"}});
    out->push_back(std::move(bytes));
    MetricFamily io =
        Family("actstash_spill_io_bytes_total",
               "Bytes written to and read back from the spill tier", MetricType::Counter);
    AddValue(&io, static_cast<double>(spill.bytes_written()), {{"direction", "write"}});
    AddValue(&io, static_cast<double>(spill.bytes_read()), {{"direction", "read"}});
    out->push_back(std::move(io));
    MetricFamily busy = Family("actstash_spill_io_seconds_total",
                               "Time spill writes (checksum included) and reads took, summed; "
                               "bytes over seconds is the throughput",
                               MetricType::Counter);
    AddValue(&busy, spill.write_seconds(), {{"direction", "write"}});
    AddValue(&busy, spill.read_seconds(), {{"direction", "read"}});
    out->push_back(std::move(busy));
    MetricFamily failures = Family("actstash_spill_failures_total",
                                   "Failed spill writes/reads (kind=io, disk or space full "
                                   "included) and restores refused for a bad checksum",
                                   MetricType::Counter);
    AddValue(&failures, static_cast<double>(spill.failures()), {{"kind", "io"}});
    AddValue(&failures, static_cast<double>(spill.checksum_failures()), {{"kind", "checksum"}});
    out->push_back(std::move(failures));
    double spill_wait = 0, restore_wait = 0;
    for (const v1::SessionStats& s : stats.all_sessions()) {
      spill_wait += static_cast<double>(s.client().spill_wait_ns()) * 1e-9;
      restore_wait += static_cast<double>(s.client().restore_wait_ns()) * 1e-9;
    }
    MetricFamily wait = Family("actstash_spill_wait_seconds",
                               "Time trainers of open sessions waited for spills (stores) and "
                               "restores (fetches), as their clients report it",
                               MetricType::Gauge);
    AddValue(&wait, spill_wait, {{"op", "spill"}});
    AddValue(&wait, restore_wait, {{"op", "restore"}});
    out->push_back(std::move(wait));
    // Memory asked back from sessions for others that waited, and given.
    double asks = 0, answered = 0, asked_bytes = 0, given_bytes = 0;
    for (const v1::SessionStats& s : stats.all_sessions()) {
      asks += static_cast<double>(s.reclaims_asked());
      answered += static_cast<double>(s.client().reclaims_answered());
      asked_bytes += static_cast<double>(s.reclaim_bytes_asked());
      given_bytes += static_cast<double>(s.client().reclaim_bytes_given());
    }
    MetricFamily reclaims = Family("actstash_reclaims",
                                   "Open sessions asked to give pool memory back for a session "
                                   "that waited, and the asks their clients answered",
                                   MetricType::Gauge);
    AddValue(&reclaims, asks, {{"state", "asked"}});
    AddValue(&reclaims, answered, {{"state", "answered"}});
    out->push_back(std::move(reclaims));
    MetricFamily reclaim_bytes = Family("actstash_reclaim_bytes",
                                        "Pool bytes open sessions were asked to give back for "
                                        "others, and gave (spilled or retained leases returned)",
                                        MetricType::Gauge);
    AddValue(&reclaim_bytes, asked_bytes, {{"state", "asked"}});
    AddValue(&reclaim_bytes, given_bytes, {{"state", "given"}});
    out->push_back(std::move(reclaim_bytes));
  }

  StashCore& core_;
};

class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(Metrics* metrics, std::string method)
      : metrics_(*metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      metrics_.ObserveRpc(
          method_, methods->GetSendStatus().error_code(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
    }
    methods->Proceed();
  }

 private:
  Metrics& metrics_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
};

class RpcInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(metrics_, std::string(absl::StripPrefix(info->method(), "/")));
  }

 private:
  Metrics* const metrics_;
};

const char* CodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "UNKNOWN";
}

}  // namespace

struct Metrics::State {
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::shared_ptr<StashCollector> collector;
  prometheus::Family<prometheus::Histogram>* latency = nullptr;
  prometheus::Family<prometheus::Counter>* errors = nullptr;
};

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(const std::string& address,
                                                        StashCore* core) {
  auto state = std::make_unique<State>();
  try {  // prometheus-cpp reports a failed bind by throwing: contained here
    state->exposer = std::make_unique<prometheus::Exposer>(address, 1);
  } catch (const std::exception& error) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot serve metrics on ", address, ": ", error.what()));
  }
  state->latency = &prometheus::BuildHistogram()
                        .Name("actstash_rpc_duration_seconds")
                        .Help("Time from the start of a call to its status, by method")
                        .Register(*state->registry);
  state->errors = &prometheus::BuildCounter()
                       .Name("actstash_rpc_errors_total")
                       .Help("Calls that ended with an error, by method and code")
                       .Register(*state->registry);
  state->collector = std::make_shared<StashCollector>(core);
  state->exposer->RegisterCollectable(state->registry);
  state->exposer->RegisterCollectable(state->collector);
  return std::unique_ptr<Metrics>(new Metrics(std::move(state)));
}

Metrics::Metrics(std::unique_ptr<State> state) : state_(std::move(state)) {}
Metrics::~Metrics() = default;

int Metrics::port() const {
  const std::vector<int> ports = state_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
Metrics::InterceptorFactory() {
  return std::make_unique<RpcInterceptorFactory>(this);
}

void Metrics::ObserveRpc(const std::string& method, grpc::StatusCode code, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10};
  state_->latency->Add({{"method", method}}, kBuckets).Observe(seconds);
  if (code != grpc::StatusCode::OK) {
    state_->errors->Add({{"method", method}, {"code", CodeName(code)}}).Increment();
  }
}

}  // namespace actstash::server
