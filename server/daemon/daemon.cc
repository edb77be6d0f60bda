#include "server/daemon/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/attach_wire.h"
#include "common/protocol.h"
#include "common/units.h"
#include "server/base/socket_path.h"
#include "server/pool/host_pool.h"
#include "server/pool/numa_topology.h"
#include "server/rpc/calls_in_flight.h"
#include "spdlog/spdlog.h"

#ifdef ACTSTASH_HAVE_CUDA
#include "common/cuda_device_guard.h"
#endif

namespace actstash::server {

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot read ", what, " ", path));
  }
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::FailedPreconditionError(absl::StrCat(what, " ", path, " is not PEM"));
  }
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const DaemonConfig& config) {
  if (config.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadPem(config.tls_cert, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(config.tls_key, "tls_key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *cert;
  pair.private_key = *key;
  options.pem_key_cert_pairs.push_back(pair);
  if (!config.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(config.tls_client_ca, "tls_client_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

std::vector<std::unique_ptr<LeaseManager>> DeviceLeaseManagers(
    const std::vector<std::unique_ptr<DevicePool>>& pools, WorkQueue* work) {
  std::vector<std::unique_ptr<LeaseManager>> managers;
  for (size_t i = 0; i < pools.size(); ++i) {
    managers.push_back(
        std::make_unique<LeaseManager>(pools[i].get(), work, static_cast<uint32_t>(i + 1)));
  }
  return managers;
}

std::vector<DeviceTier> DeviceTiers(const std::vector<std::unique_ptr<DevicePool>>& pools,
                                    const std::vector<std::unique_ptr<LeaseManager>>& managers) {
  std::vector<DeviceTier> tiers;
  for (size_t i = 0; i < pools.size(); ++i) tiers.push_back({pools[i].get(), managers[i].get()});
  return tiers;
}

}  // namespace

Daemon::Daemon(const DaemonConfig& config, Parts parts)
    : config_(config),
      registrar_(std::move(parts.registrar)),
      pool_(std::move(parts.pool)),
      device_memory_(std::move(parts.device_memory)),
      device_pools_(std::move(parts.device_pools)),
      notifier_(std::move(parts.notifier)),
      journal_(std::move(parts.journal)),
      sessions_(SessionManagerOptions{config.default_session_quota, config.max_session_quota,
                                      config.max_sessions},
                journal_.get()),
      catalog_(journal_.get()),
      copy_bandwidth_(config.copy_bandwidth, &work_),
      leases_(pool_.get(), &work_, /*tier=*/0, journal_.get()),
      device_leases_(DeviceLeaseManagers(device_pools_, &work_)),
      spill_(std::move(parts.spill)),
      attach_(*std::move(parts.attach_socket), &sessions_, pool_.get(),
              [this](uint64_t session_id) { ReclaimDisconnected(session_id); }),
      core_(StashParts{pool_.get(), pool_.get(), &sessions_, &catalog_, &leases_,
                       DeviceTiers(device_pools_, device_leases_), &work_, spill_.get(), &attach_,
                       attach_.socket_path().substr(attach_.socket_path().find_last_of('/') + 1),
                       &copy_bandwidth_}),
      service_(&core_) {}

TableGeometry Daemon::GeometryOf(const DaemonConfig& config) {
  // What the spill tier can hold: --spill-size, else the size of the file
  // system it is on (the pool's size when that cannot be read).
  uint64_t spill_tier_bytes = 0;
  if (!config.spill_dir.empty()) {
    spill_tier_bytes = config.spill_bytes;
    struct statvfs fs;
    if (spill_tier_bytes == 0) {
      spill_tier_bytes = statvfs(config.spill_dir.c_str(), &fs) == 0
                             ? uint64_t{fs.f_blocks} * fs.f_frsize
                             : config.pool_bytes;
    }
  }
  return TableGeometryFor(config.pool_bytes, config.segment_bytes, config.max_sessions,
                          spill_tier_bytes);
}

absl::Status Daemon::CreateMemory(const DaemonConfig& config,
                                  std::unique_ptr<DeviceMemory> device_memory, Parts* parts,
                                  AdoptedSegments* adopt) {
  std::string why_not;
  // auto registers only when the daemon holds CUDA contexts anyway (device
  // pools): clients register their own mappings, which is what their copies
  // use, and a context on GPU 0 would cost every GPU node hundreds of MiB
  // (and GPU 0 itself under exclusive compute mode).
  const bool skip = config.cuda_pin == Tristate::kAuto && config.device_pools.empty();
  absl::StatusOr<std::unique_ptr<PinnedRegistrar>> registrar =
      skip ? std::unique_ptr<PinnedRegistrar>() : RegistrarForPolicy(config.cuda_pin, &why_not);
  if (skip) {
    why_not =
        "cuda_pin auto registers with --device-pool only (clients register their own "
        "mappings); cuda_pin on forces it";
  }
  if (!registrar.ok()) {
    return absl::Status(registrar.status().code(),
                        absl::StrCat("cuda_pin is on: ", registrar.status().message()));
  }
  parts->registrar = *std::move(registrar);

  const auto pool_start = std::chrono::steady_clock::now();
  HostPoolOptions pool_options;
  pool_options.pool_bytes = config.pool_bytes;
  pool_options.segment_bytes = config.segment_bytes;
  pool_options.mlock = config.mlock;
  pool_options.cuda_registrar = parts->registrar.get();
  pool_options.require_cuda_pinned = config.cuda_pin == Tristate::kOn;
  absl::StatusOr<NumaTopology> numa = ReadNumaTopology();
  if (!numa.ok()) {
    if (config.numa.mode != NumaSetting::Mode::kAuto &&
        config.numa.mode != NumaSetting::Mode::kOff) {
      return absl::Status(numa.status().code(), absl::StrCat("numa: cannot read the topology: ",
                                                             numa.status().message()));
    }
    spdlog::warn("numa: cannot read the topology ({}); the kernel places the pool",
                 std::string(numa.status().message()));
  } else {
    absl::StatusOr<PoolPlacement> placement = ChoosePoolPlacement(config.numa, *numa);
    if (!placement.ok()) {
      return absl::Status(placement.status().code(),
                          absl::StrCat("numa: ", placement.status().message()));
    }
    pool_options.numa_nodes = placement->nodes;
    pool_options.numa_split = placement->split;
    spdlog::info("numa: {}; {}", numa->Describe(), placement->why);
  }
  absl::StatusOr<std::unique_ptr<HostPool>> pool;
  {
#ifdef ACTSTASH_HAVE_CUDA
    // Registration runs in the context of the current device: that of the
    // first device pool, so that no context is made on GPU 0 for it.
    std::optional<ScopedCudaDevice> device;
    if (parts->registrar != nullptr && !config.device_pools.empty()) {
      device.emplace(config.device_pools.front().device);
    }
#endif
    if (adopt != nullptr) {
      pool = AdoptHostPool(pool_options, std::move(adopt->fds), adopt->held_inline);
    } else {
      pool = CreateHostPool(pool_options);
    }
    if (!pool.ok() && adopt == nullptr && !pool_options.numa_nodes.empty() &&
        config.numa.mode == NumaSetting::Mode::kAuto) {
      // A container's seccomp profile may forbid mbind (Docker's does without
      // CAP_SYS_NICE): placement chosen by auto is a gain, not a requirement.
      spdlog::warn("numa: {}; the kernel places the pool instead",
                   std::string(pool.status().message()));
      pool_options.numa_nodes.clear();
      pool_options.numa_split = false;
      pool = CreateHostPool(pool_options);
    }
  }
  if (!pool.ok()) return pool.status();
  parts->pool = *std::move(pool);
  const PoolStats stats = parts->pool->Stats();
  const std::string cuda =
      parts->registrar == nullptr ? absl::StrCat("not CUDA-registered: ", why_not)
      : stats.cuda_pinned_bytes() == stats.total_bytes()
          ? std::string("CUDA-registered")
          : absl::StrCat("CUDA-registered: only ", FormatBytes(stats.cuda_pinned_bytes()),
                         " (registration failed, see above)");
  if (!config.memory_basis.empty()) {
    spdlog::info("memory: {} (percentages and the default pool are of the first)",
                 config.memory_basis);
  }
  spdlog::info("host pool: {} in {} segments of {} ({}; {}), ready in {} ms",
               FormatBytes(stats.total_bytes()), stats.segments(),
               FormatBytes(stats.segment_bytes()),
               stats.locked_bytes() == stats.total_bytes() ? "mlocked"
               : adopt != nullptr && config.mlock != Tristate::kOff
                   ? "adopted; mlocked in the background once it serves"
                   : "NOT pinned",
               cuda,
               std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::steady_clock::now() - pool_start)
                   .count());

  if (config.device_pools.empty()) return absl::OkStatus();
  if (device_memory == nullptr) {
    absl::StatusOr<std::unique_ptr<DeviceMemory>> cuda_memory = CreateCudaDeviceMemory();
    if (!cuda_memory.ok()) {
      return absl::Status(cuda_memory.status().code(),
                          absl::StrCat("device_pool: ", cuda_memory.status().message()));
    }
    device_memory = *std::move(cuda_memory);
  }
  parts->device_memory = std::move(device_memory);
  for (const DevicePoolConfig& entry : config.device_pools) {
    DevicePoolOptions options;
    options.device = entry.device;
    options.pool_bytes = entry.bytes;
    options.segment_bytes = config.segment_bytes;
    absl::StatusOr<std::unique_ptr<DevicePool>> device_pool =
        DevicePool::Create(parts->device_memory.get(), options);
    if (!device_pool.ok()) {
      return absl::Status(device_pool.status().code(),
                          absl::StrCat("device_pool: ", device_pool.status().message()));
    }
    spdlog::info(
        "device pool: {} on GPU {} ({}) in {} segments, exported as one CUDA IPC handle; "
        "clients that open it can reach the whole pool: for trusted, same-uid trainers only",
        FormatBytes((*device_pool)->region_bytes()), entry.device,
        parts->device_memory->Describe(entry.device), (*device_pool)->Stats().segments());
    parts->device_pools.push_back(*std::move(device_pool));
  }
  return absl::OkStatus();
}

Daemon::~Daemon() {
  Shutdown(std::chrono::milliseconds(0));
  // Spilled objects drop their files through the spill tier: the catalog
  // empties first.
  catalog_.RemoveAll();
  // The spill tier goes before the rest: its destructor finishes the
  // operations in flight, whose callbacks use the core, the catalog, the
  // lease managers and the pools.
  spill_.reset();
}

absl::Status Daemon::StartServing(UniqueFd handed_listener) {
  absl::MutexLock serving(&serving_mu_);
  core_.draining.store(false, std::memory_order_release);
  if (absl::Status s = Serve(); !s.ok()) return s;
  {
    absl::MutexLock lock(&reaper_mu_);
    reaper_stop_ = false;
  }
  reaper_ = std::thread([this] { ReapIdleSessions(); });
  attach_.StartAccepting();
  if (handover_ == nullptr) {
    absl::StatusOr<std::unique_ptr<HandoverListener>> listener = HandoverListener::Start(
        attach::HandoverSocketPath(config_.socket_path), std::move(handed_listener),
        [this](const v1::TakeOverHello& hello) { return PrepareHandover(hello); },
        [this](bool adopted) { FinishHandover(adopted); });
    if (!listener.ok()) return listener.status();
    handover_ = *std::move(listener);
  }
  return absl::OkStatus();
}

absl::Status Daemon::Serve() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string target = absl::StrCat("unix://", config_.socket_path);
  builder.AddListeningPort(target, grpc::InsecureServerCredentials());
  int tcp_port = 0;
  if (!config_.listen_tcp.empty()) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = TcpCredentials(config_);
    if (!credentials.ok()) return credentials.status();
    builder.AddListeningPort(config_.listen_tcp, *credentials, &tcp_port);
  }
  if (!config_.metrics_address.empty() && metrics_ == nullptr) {
    absl::StatusOr<std::unique_ptr<Metrics>> metrics =
        Metrics::Start(config_.metrics_address, &core_);
    if (!metrics.ok()) return metrics.status();
    metrics_ = *std::move(metrics);
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(CountCallsInFlight(&core_.calls_in_flight));
  if (metrics_ != nullptr) creators.push_back(metrics_->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(&service_);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("gRPC could not listen on ", target, " (see the gRPC log above)"));
  }
  if (!config_.listen_tcp.empty() && tcp_port == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("gRPC could not listen on TCP ", config_.listen_tcp));
  }
  server_->GetHealthCheckService()->SetServingStatus(kStashServiceName, true);
  if (tcp_port != 0) {
    spdlog::info("also listening on TCP {} (port {}), {}", config_.listen_tcp, tcp_port,
                 config_.tls_cert.empty()        ? "plaintext"
                 : config_.tls_client_ca.empty() ? "TLS"
                                                 : "mutual TLS (client certificates required)");
  }
  if (metrics_ != nullptr) {
    spdlog::info("metrics on http://{}/metrics (port {})", config_.metrics_address,
                 metrics_->port());
  }
  absl::StatusOr<ino_t> inode = SetSocketMode(config_.socket_path, config_.socket_mode);
  if (!inode.ok()) return inode.status();
  socket_inode_ = *inode;
  spdlog::info("listening on {} (mode {:04o}); session quota default {}, max {}; max sessions {}",
               target, config_.socket_mode, FormatBytes(config_.default_session_quota),
               FormatBytes(config_.max_session_quota), config_.max_sessions);
  spdlog::info("attach socket {}; idle sessions without one close after {} s",
               attach_.socket_path(), config_.session_idle_ttl_seconds);
  switch (config_.copy_bandwidth.mode) {
    case CopyBandwidthSetting::Mode::kFixed:
      spdlog::info("node copy bandwidth {:.2f} GB/s (configured), shared by copying sessions",
                   config_.copy_bandwidth.bytes_per_second / 1e9);
      break;
    case CopyBandwidthSetting::Mode::kOff:
      spdlog::info("node copy bandwidth off: sessions plan with what they measure alone");
      break;
    case CopyBandwidthSetting::Mode::kAuto:
      spdlog::info("node copy bandwidth: measured at the first CopyShare request");
      break;
  }
  return absl::OkStatus();
}

void Daemon::ReclaimDisconnected(uint64_t session_id) {
  if (std::optional<SessionTotals> freed = CloseSessionAndFree(core_, session_id)) {
    core_.sessions_reclaimed.fetch_add(1, std::memory_order_relaxed);
    spdlog::info(
        "session {} reclaimed: {} objects ({} bytes), {} leases ({} bytes), "
        "{} spill files ({} bytes)",
        session_id, freed->objects.objects, freed->objects.bytes, freed->leases.objects,
        freed->leases.bytes, freed->spilled.objects, freed->spilled.bytes);
  }
}

void Daemon::ReapIdleSessions() {
  const int64_t ttl_ms = static_cast<int64_t>(config_.session_idle_ttl_seconds * 1000);
  const int64_t unused_ms = static_cast<int64_t>(config_.exit_when_unused_seconds * 1000);
  int64_t unused_since_ms = SteadyNowMs();  // no session open since then
  absl::MutexLock lock(&reaper_mu_);
  while (!reaper_mu_.AwaitWithTimeout(absl::Condition(&reaper_stop_), absl::Seconds(1))) {
    reaper_mu_.Unlock();
    ReapUnreattached();
    const int64_t now_ms = SteadyNowMs();
    if (sessions_.size() > 0) {
      unused_since_ms = now_ms;
    } else if (unused_ms > 0 && now_ms - unused_since_ms >= unused_ms &&
               sessions_.RefuseIfUnused()) {
      spdlog::info("no session for {} s (exit_when_unused_seconds): shutting down",
                   (now_ms - unused_since_ms) / 1000);
      unused_since_ms = now_ms;  // one signal; the main thread stops this thread
      kill(getpid(), SIGTERM);
    }
    const std::vector<std::shared_ptr<Session>> idle =
        ttl_ms > 0 ? sessions_.IdleSessions(now_ms, ttl_ms)
                   : std::vector<std::shared_ptr<Session>>();
    for (const std::shared_ptr<Session>& session : idle) {
      if (std::optional<SessionTotals> freed = CloseSessionAndFree(core_, session->id())) {
        core_.sessions_reclaimed.fetch_add(1, std::memory_order_relaxed);
        spdlog::info(
            "session {} ('{}') idle for {} s without an attach connection: closed, "
            "freed {} objects ({} bytes)",
            session->id(), session->name(), (now_ms - session->last_active_ms()) / 1000,
            freed->objects.objects, freed->objects.bytes);
      }
    }
    reaper_mu_.Lock();
  }
}

void Daemon::StopServing(std::chrono::milliseconds grace, bool wait_for_calls, bool stop_attach) {
  absl::MutexLock serving(&serving_mu_);
  if (reaper_.joinable()) {
    {
      absl::MutexLock lock(&reaper_mu_);
      reaper_stop_ = true;
    }
    reaper_.join();
  }
  if (server_ == nullptr) return;
  // gRPC's own Shutdown(deadline) also waits for idle client connections
  // to go away, which a sync client notices only on its next poll (up to
  // 5 s). So drain the calls that matter here (streams in flight), then
  // shut down at once: what is still running past the grace is cancelled.
  core_.draining.store(true, std::memory_order_release);
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Unary calls too when asked (a take-over): new calls are refused with
  // UNAVAILABLE now (draining), so only those already running remain.
  std::atomic<int64_t>& running = wait_for_calls ? core_.calls_in_flight : core_.streams_in_flight;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (running.load(std::memory_order_acquire) > 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  const int64_t cancelled = running.load(std::memory_order_acquire);
  if (cancelled > 0)
    spdlog::warn("cancelling {} calls still running after the grace period", cancelled);
  // At shutdown the attach server goes before the gRPC server: it fails the
  // sends of pending Lease calls (and refuses new ones), so that those calls
  // finish and Wait returns even when a client stopped reading its attach
  // socket.
  if (stop_attach) attach_.Stop();
  // A call that slipped in after the count reached zero is cancelled
  // unstarted: an attached client sends it again (SessionRpc::Paused).
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  // Kept, not destroyed: gRPC 1.51's ~Server can block joining its executor
  // while clients are still connected (main.cc's exit avoids it for the
  // same reason). A take-over that does not complete serves again with a
  // new server.
  stopped_servers_.push_back(std::move(server_));
}

void Daemon::Shutdown(std::chrono::milliseconds grace) {
  if (stopped_) return;
  stopped_ = true;
  handover_.reset();  // no take-over from now on (joins its thread)
  if (journal_ != nullptr && started_) {
    // A clean stop releases every session: the next start has nothing to
    // recover (and must not hand these sessions' memory to anyone).
    journal_->table().Retire();
  }
  if (notifier_ != nullptr && started_) (void)notifier_->Notify("STOPPING=1");

  StopServing(grace, /*wait_for_calls=*/false, /*stop_attach=*/true);
  // Without a server (a failed start) too: no disconnect callback runs from
  // now on.
  attach_.Stop();
  // Released leases are freed as they are from now on: renewing memory the
  // daemon is about to give back to the kernel is wasted work. Then the
  // work queue runs what it holds (renewals, Lease continuations) while
  // everything those use is alive, and stops.
  leases_.StopRenewing();
  for (auto& device_leases : device_leases_) device_leases->StopRenewing();
  work_.Stop();
  pool_->FinishBackgroundWork();
  // Remove the socket only if it is still ours (a new daemon may own the path).
  RemoveSocketIfOurs(config_.socket_path, socket_inode_);
  const RemovedTotals leftover{catalog_.size(), pool_->Stats().used_bytes()};
  spdlog::info("stopped; {} sessions and {} objects ({}) released", sessions_.size(),
               leftover.objects, FormatBytes(leftover.bytes));
}

}  // namespace actstash::server
