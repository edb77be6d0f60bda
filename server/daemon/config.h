// actstashd configuration: command-line flags (CLI11) over an optional TOML
// file (toml++) over built-in defaults.
#ifndef ACTSTASH_SERVER_DAEMON_CONFIG_H_
#define ACTSTASH_SERVER_DAEMON_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tristate.h"
#include "server/pool/device_pool_config.h"
#include "server/pool/host_pool.h"
#include "server/pool/numa_topology.h"
#include "server/sessions/copy_share.h"

namespace actstash::server {

struct DaemonConfig {
  std::string socket_path;  // gRPC Unix socket
  uint32_t socket_mode = 0660;
  uint64_t pool_bytes = 0;
  // What a percentage pool_size and the default pool were taken of
  // (MemoryLimits::Describe), for the start-up log.
  std::string memory_basis;
  uint64_t segment_bytes = 64ull << 20;
  uint64_t max_session_quota = 0;      // cap on any session's quota
  uint64_t default_session_quota = 0;  // what a session asking for 0 gets
  size_t max_sessions = 1024;
  Tristate mlock = Tristate::kAuto;
  // Registration of the host pool's segments with CUDA (cudaHostRegister):
  // kAuto when a device is present, kOn fails start-up without it, kOff never.
  Tristate cuda_pin = Tristate::kAuto;
  // Device pools (CUDA builds only), at most one per device.
  std::vector<DevicePoolConfig> device_pools;
  std::string log_level = "info";
  double shutdown_grace_seconds = 5;
  // Sessions without an attach connection are closed after this long without
  // a call (0: never).
  double session_idle_ttl_seconds = 600;
  // Shut down once no session has been open for this long, the start included
  // (0: never): the shared daemon connect() starts (Daemon::ReapIdleSessions).
  double exit_when_unused_seconds = 0;
  // Who may attach (zero-copy); both empty: whoever can open the socket.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  // Prometheus /metrics over HTTP ("127.0.0.1:9464"); empty: off.
  std::string metrics_address;
  // gRPC over TCP as well ("HOST:PORT"); empty: Unix socket only. A
  // non-loopback address needs TLS (tls_cert + tls_key) or `insecure`.
  std::string listen_tcp;
  std::string tls_cert;       // PEM file
  std::string tls_key;        // PEM file
  std::string tls_client_ca;  // PEM file: require client certificates it signed (mTLS)
  bool insecure = false;
  // Spill tier: where spilled segments go (empty: no spilling) and the most
  // bytes it may hold (0: the file system's free space).
  std::string spill_dir;
  uint64_t spill_bytes = 0;
  // Where the pool's pages go (ChoosePoolPlacement decides at start).
  NumaSetting numa;
  // The node's copy bandwidth, shared by the copying sessions (CopyShare).
  CopyBandwidthSetting copy_bandwidth;
  // Shut down when the parent process exits (a private daemon started by a
  // trainer, e.g. actstash.connect(start="auto")).
  bool exit_with_parent = false;
  // Start by taking over from the daemon serving on socket_path
  // (server/restart/take_over.h) instead of making a pool: kOn requires
  // it, kAuto takes over when a daemon answers there and starts afresh
  // otherwise.
  Tristate take_over = Tristate::kOff;
  // After handing over: exit 0 (false), or close everything and wait for
  // SIGTERM (true).
  bool wait_after_take_over = false;
  // After recovering a crashed daemon's state: how long its sessions have to
  // attach again (server/restart/crash_recovery.h).
  double reattach_grace_seconds = 60;
};

// True for 127.0.0.0/8, ::1 and localhost.
bool IsLoopbackHost(const std::string& host_port);

// The outcome of parsing argv: either a configuration to run with, or an
// exit code (after --help/--version, or after printing a usage error).
struct CommandLine {
  DaemonConfig config;
  std::optional<int> exit_code;
};

// Parses flags and the TOML file named by --config. A bad value in either is
// a usage error (exit code 2) whose message names the setting.
CommandLine ParseCommandLine(int argc, const char* const* argv);

// The default pool size: 25% of the memory the daemon may use
// (MemoryLimits::usable_bytes: its cgroup's limit when below physical
// memory), capped at 32 GiB.
uint64_t DefaultPoolBytes(uint64_t usable_bytes);
uint64_t DefaultPoolBytes();  // of ReadMemoryLimits()

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_DAEMON_CONFIG_H_
