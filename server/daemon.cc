#include "server/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "common/units.h"
#include "server/cuda_probe.h"
#include "server/host_pool.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

absl::Status MakeParentDirectory(const std::string& socket_path) {
  const std::string dir = socket_path.substr(0, socket_path.find_last_of('/'));
  if (dir.empty()) return absl::OkStatus();
  std::string prefix;
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    prefix = dir.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat("cannot create socket directory ",
                                                        prefix, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

// A live daemon at `path` refuses the start; a stale socket file is removed;
// anything else at the path is left alone and refuses the start.
absl::Status ClaimSocketPath(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot inspect ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; not replacing it"));
  }
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const bool alive = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  if (alive) {
    return absl::FailedPreconditionError(
        absl::StrCat("another actstashd is already listening on ", path));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove stale socket ", path, ": ", std::strerror(errno)));
  }
  spdlog::info("removed stale socket {}", path);
  return absl::OkStatus();
}

}  // namespace

Daemon::Daemon(const DaemonConfig& config, std::unique_ptr<MemoryPool> pool)
    : config_(config),
      pool_(std::move(pool)),
      sessions_(SessionManagerOptions{config.default_session_quota, config.max_session_quota,
                                      config.max_sessions}),
      core_(pool_.get(), &sessions_, &catalog_),
      service_(&core_) {}

Daemon::~Daemon() { Shutdown(std::chrono::milliseconds(0)); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonConfig& config) {
  spdlog::info("actstashd {} starting (pid {}); {}", kVersion, getpid(), DescribeCudaDevices());
  if (absl::Status s = MakeParentDirectory(config.socket_path); !s.ok()) return s;
  if (absl::Status s = ClaimSocketPath(config.socket_path); !s.ok()) return s;

  const auto pool_start = std::chrono::steady_clock::now();
  HostPoolOptions pool_options;
  pool_options.pool_bytes = config.pool_bytes;
  pool_options.segment_bytes = config.segment_bytes;
  pool_options.mlock = config.mlock;
  absl::StatusOr<std::unique_ptr<MemoryPool>> pool = CreateHostPool(pool_options);
  if (!pool.ok()) return pool.status();
  const PoolStats stats = (*pool)->Stats();
  spdlog::info("host pool: {} in {} segments of {} ({}), ready in {} ms",
               FormatBytes(stats.total_bytes), stats.segments, FormatBytes(stats.segment_bytes),
               stats.locked_bytes == stats.total_bytes ? "mlocked" : "NOT pinned",
               std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::steady_clock::now() - pool_start)
                   .count());

  std::unique_ptr<Daemon> daemon(new Daemon(config, *std::move(pool)));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string target = absl::StrCat("unix://", config.socket_path);
  builder.AddListeningPort(target, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(&daemon->service_);
  daemon->server_ = builder.BuildAndStart();
  if (daemon->server_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("gRPC could not listen on ", target, " (see the gRPC log above)"));
  }
  daemon->server_->GetHealthCheckService()->SetServingStatus(kStashServiceName, true);
  struct stat st {};
  if (chmod(config.socket_path.c_str(), config.socket_mode) != 0 ||
      stat(config.socket_path.c_str(), &st) != 0) {
    return absl::InternalError(absl::StrCat("cannot set the mode of ", config.socket_path, ": ",
                                            std::strerror(errno)));
  }
  daemon->socket_inode_ = st.st_ino;
  spdlog::info("listening on {} (mode {:04o}); session quota default {}, max {}; max sessions {}",
               target, config.socket_mode, FormatBytes(config.default_session_quota),
               FormatBytes(config.max_session_quota), config.max_sessions);
  return daemon;
}

void Daemon::Shutdown(std::chrono::milliseconds grace) {
  if (stopped_) return;
  stopped_ = true;
  if (server_ != nullptr) {
    // gRPC's own Shutdown(deadline) also waits for idle client connections
    // to go away, which a sync client notices only on its next poll (up to
    // 5 s). So drain the calls that matter here (streams in flight), then
    // shut down at once: what is still running past the grace is cancelled.
    core_.draining.store(true, std::memory_order_release);
    server_->GetHealthCheckService()->SetServingStatus(false);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (core_.streams_in_flight.load(std::memory_order_acquire) > 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const int64_t cancelled = core_.streams_in_flight.load(std::memory_order_acquire);
    if (cancelled > 0) spdlog::warn("cancelling {} calls still running after the grace period", cancelled);
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  // Remove the socket only if it is still ours (a new daemon may own the path).
  struct stat st {};
  if (socket_inode_ != 0 && stat(config_.socket_path.c_str(), &st) == 0 &&
      st.st_ino == socket_inode_) {
    unlink(config_.socket_path.c_str());
  }
  const RemovedTotals leftover{catalog_.size(), pool_->Stats().used_bytes};
  spdlog::info("stopped; {} sessions and {} objects ({}) released", sessions_.size(),
               leftover.objects, FormatBytes(leftover.bytes));
}

}  // namespace actstash::server
