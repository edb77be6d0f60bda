#include "server/daemon/config.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/address.h"
#include "common/attach_wire.h"
#include "common/protocol.h"
#include "common/tristate.h"
#include "common/units.h"
#include "server/pool/memory_limits.h"
#include "toml++/toml.h"

namespace actstash::server {
namespace {

// Every setting once: its TOML key, its flag, its help text. Values travel as
// strings (flag text or TOML scalar) and are resolved in one place, so the
// file and the flags accept exactly the same spellings.
struct Setting {
  const char* key;
  const char* help;
};

constexpr Setting kSettings[] = {
    {"socket",
     "Unix socket path of the gRPC service (default: /run/actstash/actstash.sock "
     "as root, else $XDG_RUNTIME_DIR/actstash/actstash.sock)"},
    {"socket_mode", "Permissions of the socket, octal (default 0660)"},
    {"pool_size",
     "Host pool size: bytes with a unit (16GiB) or a percentage of the memory "
     "the daemon may use (25%: of its cgroup's memory limit when one is set "
     "below physical memory); default 25% of it, at most 32 GiB"},
    {"segment_size", "Size of one memfd segment of the pool (default 64MiB)"},
    {"max_session_quota",
     "Largest quota one session may hold: bytes or a percentage of the "
     "pool (default 100%)"},
    {"default_session_quota",
     "Quota of a session that asks for none: bytes or a percentage "
     "of the pool (default: max_session_quota)"},
    {"max_sessions", "Largest number of open sessions (default 1024)"},
    {"mlock",
     "Pin the pool with mlock: auto (try, warn and continue unpinned), on (fail "
     "without it), off (default auto)"},
    {"cuda_pin",
     "Register the pool's segments with CUDA in the daemon (cudaHostRegister; clients "
     "register their own mappings of leased segments regardless): auto (only with "
     "--device-pool, when the daemon has CUDA contexts anyway; failures warn), on (always; "
     "fail without a device), off (default auto)"},
    {"device_pool",
     "Device pool(s) for CUDA IPC leases: GPU:SIZE, comma-separated for several GPUs "
     "(e.g. 0:8GiB,1:8GiB); rounded down to whole segments; off by default. For trusted, "
     "same-uid trainers: a client may keep its IPC mapping after a lease ends"},
    {"log_level", "trace, debug, info, warn, error or off (default info)"},
    {"shutdown_grace_seconds",
     "On SIGTERM/SIGINT, how long in-flight calls may run before "
     "they are cancelled (default 5)"},
    {"session_idle_ttl_seconds",
     "Close sessions that have no attach connection after this "
     "many seconds without a call; 0 never (default 600)"},
    {"allow_uid",
     "Comma-separated uids allowed to attach (zero-copy); with allow_gid empty "
     "too, anyone who can open the socket (default)"},
    {"allow_gid", "Comma-separated gids allowed to attach (zero-copy)"},
    {"metrics_address",
     "Serve Prometheus metrics at http://HOST:PORT/metrics (e.g. "
     "127.0.0.1:9464); off by default"},
    {"listen_tcp",
     "Also serve gRPC on HOST:PORT (TCP); off by default. A non-loopback "
     "address needs --tls-cert and --tls-key, or --insecure"},
    {"tls_cert", "PEM certificate chain for the TCP listener"},
    {"tls_key", "PEM private key for the TCP listener"},
    {"tls_client_ca", "PEM CA: TCP clients must present a certificate it signed (mTLS)"},
    {"insecure",
     "Allow plaintext TCP on a non-loopback address (true/false; the flag "
     "alone means true)"},
    {"spill_dir",
     "Spill tier: when a session's lease cannot be granted from memory, its coldest "
     "leased segments are written to unlinked files in this directory (on local NVMe "
     "ideally) and read back ahead of backward; off by default"},
    {"spill_size",
     "Most bytes the spill tier may hold on disk, all sessions together (e.g. 200GiB); "
     "default: the file system's free space"},
    {"copy_bandwidth",
     "The node's copy bandwidth, all trainers together, which the daemon divides among the "
     "sessions copying at once so that auto plans count on their share: a rate (e.g. "
     "150GB/s: the host memory bandwidth of the GPUs' socket), auto (measure memcpy over "
     "every core, at the first request) or off (default auto)"},
    {"numa",
     "Where the pool's pages go on a machine with several NUMA nodes: auto (bound to the "
     "node of the GPUs; split over their nodes when they sit on several), split (one part "
     "of the pool bound to each node; a session leases from its GPU's or CPU's node "
     "first), interleave (over every node), a node number, or off (the kernel's default); "
     "default auto"},
    {"exit_when_unused_seconds",
     "Shut down (as on SIGTERM) once no session has been open for this many seconds, "
     "counted from the start too: the node's shared daemon that actstash.connect() starts "
     "when none serves, which lives while any trainer uses it; 0 never (default 0)"},
    {"exit_with_parent",
     "Shut down (as on SIGTERM) when the process that started the daemon exits, for a "
     "private daemon that lives as long as its trainer (true/false; the flag alone means "
     "true; default false)"},
    {"take_over",
     "Take over from the actstashd serving on the same socket (an upgrade or restart "
     "without losing its sessions, leases or pool): start this one with the same settings "
     "plus --take-over; the serving one hands its state and memory over, and this one "
     "serves on the same sockets. Fails, leaving the serving one as it was, when the two "
     "cannot agree. auto: take over when a daemon serves there, else start afresh (a "
     "Kubernetes pod surging beside the old one). Alone or on: required; default off "
     "(see docs/OPERATIONS.md)"},
    {"after_take_over",
     "What a daemon does once a successor took over: exit (0, default) or wait (close "
     "everything and wait for SIGTERM, so that a supervisor that restarts exited "
     "containers does not start it again; Kubernetes)"},
    {"reattach_grace_seconds",
     "After a restart that recovered the state of a crashed daemon (under a service "
     "manager that keeps its fds: systemd's FileDescriptorStoreMax), how long the "
     "recovered sessions have to attach again before they are closed and their leases "
     "freed (default 60)"},
};

// Settings whose flag takes no value (present means true); in the TOML file
// they are booleans or "true"/"false".
bool IsBooleanFlag(const std::string& key) {
  return key == "insecure" || key == "exit_with_parent";
}

absl::StatusOr<bool> ParseBool(const char* key, const std::string& value) {
  if (value != "true" && value != "false") {
    return absl::InvalidArgumentError(absl::StrCat(key, ": '", value, "' is not true/false"));
  }
  return value == "true";
}

std::string FlagName(const char* key) {
  std::string flag = absl::StrCat("--", key);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

absl::Status ReadToml(const std::string& path, std::map<std::string, std::string>* values) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& error) {
    std::ostringstream where;
    where << error.source().begin;
    return absl::InvalidArgumentError(absl::StrCat(
        "config file ", path, ": ", std::string(error.description()), " at ", where.str()));
  }
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    const bool known = std::any_of(std::begin(kSettings), std::end(kSettings),
                                   [&](const Setting& s) { return name == s.key; });
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", path, ": unknown key '", name, "'"));
    }
    if (auto s = node.value<std::string>(); node.is_string() && s) {
      (*values)[name] = *s;
    } else if (auto i = node.value<int64_t>(); node.is_integer() && i) {
      // A mode is octal: TOML's 0o640 arrives as 416 and must read as 0640.
      // (A decimal 640 then reads as 01200 and is refused as out of range.)
      (*values)[name] = name == "socket_mode" ? absl::StrFormat("%o", *i) : absl::StrCat(*i);
    } else if (auto b = node.value<bool>(); node.is_boolean() && b) {
      (*values)[name] = *b ? "true" : "false";
    } else if (auto d = node.value<double>(); node.is_floating_point() && d) {
      (*values)[name] = absl::StrCat(*d);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": '", name,
                                                     "' must be a string, a number or a boolean"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> Resolve(const std::map<std::string, std::string>& values) {
  DaemonConfig config;
  auto get = [&](const char* key) -> const std::string* {
    auto it = values.find(key);
    return it == values.end() ? nullptr : &it->second;
  };
  auto bad = [](const char* key, const absl::Status& status) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", status.message()));
  };
  config.socket_path = get("socket") ? *get("socket") : DefaultSocketPath();
  if (config.socket_path.empty() || config.socket_path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("socket: '", config.socket_path, "' is not an absolute path"));
  }
  // sockaddr_un holds 108 bytes with the terminator; the attach socket's
  // name is longer than the gRPC socket's.
  constexpr size_t kMaxSocketPath = 107;
  if (attach::AttachSocketPath(config.socket_path).size() > kMaxSocketPath) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket: '", config.socket_path, "' is too long: its attach socket '",
                     attach::AttachSocketPath(config.socket_path), "' exceeds ", kMaxSocketPath,
                     " bytes, the limit of a Unix socket path"));
  }
  if (const std::string* mode = get("socket_mode")) {
    char* end = nullptr;
    const unsigned long parsed = std::strtoul(mode->c_str(), &end, 8);
    if (mode->empty() || *end != '\0' || parsed > 0777) {
      return absl::InvalidArgumentError(
          absl::StrCat("socket_mode: '", *mode, "' is not an octal mode like 0660"));
    }
    config.socket_mode = static_cast<uint32_t>(parsed);
  }
  // Percentages and the default are of the memory the daemon may use: its
  // container's limit, not the machine's.
  const MemoryLimits limits = ReadMemoryLimits();
  const uint64_t memory = limits.usable_bytes();
  config.memory_basis = limits.Describe();
  config.pool_bytes = DefaultPoolBytes(memory);
  if (const std::string* size = get("pool_size")) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(*size, memory);
    if (!parsed.ok()) return bad("pool_size", parsed.status());
    config.pool_bytes = *parsed;
  }
  if (const std::string* size = get("segment_size")) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(*size);
    if (!parsed.ok()) return bad("segment_size", parsed.status());
    config.segment_bytes = *parsed;
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (config.segment_bytes == 0 || config.segment_bytes % page != 0) {
    return absl::InvalidArgumentError(absl::StrCat("segment_size: ", config.segment_bytes,
                                                   " bytes is not a positive multiple of the "
                                                   "page size (",
                                                   page, ")"));
  }
  // Leases are placed by segment alignment (a power of two).
  if ((config.segment_bytes & (config.segment_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment_size: ", FormatBytes(config.segment_bytes), " is not a power of two"));
  }
  if (config.pool_bytes < config.segment_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("pool_size: ", FormatBytes(config.pool_bytes),
                                                   " is smaller than one segment (",
                                                   FormatBytes(config.segment_bytes), ")"));
  }
  // The pool holds whole segments only; quotas (and their percentages) are
  // of what it really holds.
  config.pool_bytes -= config.pool_bytes % config.segment_bytes;
  config.max_session_quota = config.pool_bytes;
  if (const std::string* size = get("max_session_quota")) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(*size, config.pool_bytes);
    if (!parsed.ok()) return bad("max_session_quota", parsed.status());
    config.max_session_quota = *parsed;
  }
  config.default_session_quota = config.max_session_quota;
  if (const std::string* size = get("default_session_quota")) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(*size, config.pool_bytes);
    if (!parsed.ok()) return bad("default_session_quota", parsed.status());
    config.default_session_quota = std::min(*parsed, config.max_session_quota);
  }
  if (const std::string* n = get("max_sessions")) {
    uint64_t parsed = 0;
    if (!absl::SimpleAtoi(*n, &parsed) || parsed == 0 || parsed > 1000000) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_sessions: '", *n, "' is not a number in [1, 1000000]"));
    }
    config.max_sessions = parsed;
  }
  if (const std::string* mode = get("take_over")) {
    // The flag alone (an empty value) or true: take over, or fail.
    if (mode->empty() || *mode == "true") {
      config.take_over = Tristate::kOn;
    } else if (*mode == "false") {
      config.take_over = Tristate::kOff;
    } else {
      absl::StatusOr<Tristate> parsed = ParseTristate(*mode, "take_over");
      if (!parsed.ok()) return parsed.status();
      config.take_over = *parsed;
    }
  }
  if (const std::string* v = get("after_take_over")) {
    if (*v != "exit" && *v != "wait") {
      return absl::InvalidArgumentError(
          absl::StrCat("after_take_over: '", *v, "' is neither exit nor wait"));
    }
    config.wait_after_take_over = *v == "wait";
  }
  if (const std::string* mode = get("mlock")) {
    absl::StatusOr<Tristate> parsed = ParseTristate(*mode, "mlock");
    if (!parsed.ok()) return parsed.status();
    config.mlock = *parsed;
  }
  if (const std::string* mode = get("cuda_pin")) {
    absl::StatusOr<Tristate> parsed = ParseTristate(*mode, "cuda_pin");
    if (!parsed.ok()) return parsed.status();
    config.cuda_pin = *parsed;
  }
  if (const std::string* pools = get("device_pool")) {
    absl::StatusOr<std::vector<DevicePoolConfig>> parsed =
        ParseDevicePools(*pools, config.segment_bytes);
    if (!parsed.ok()) return bad("device_pool", parsed.status());
    config.device_pools = *std::move(parsed);
  }
  if (const std::string* level = get("log_level")) {
    // A set of names: the values are unused.
    static constexpr Choice<bool> kLevels[] = {{"trace", true}, {"debug", true}, {"info", true},
                                               {"warn", true},  {"error", true}, {"off", true}};
    absl::Status known = ParseChoice(*level, "log_level", kLevels).status();
    if (!known.ok()) return known;
    config.log_level = *level;
  }
  // A number of seconds in [0, max] (a grace period).
  auto seconds = [&get](const char* key, int max, double* out) -> absl::Status {
    const std::string* text = get(key);
    if (text == nullptr) return absl::OkStatus();
    double parsed = 0;
    if (!absl::SimpleAtod(*text, &parsed) || !(parsed >= 0 && parsed <= max)) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": '", *text, "' is not a number of seconds in [0, ", max, "]"));
    }
    *out = parsed;
    return absl::OkStatus();
  };
  if (absl::Status s = seconds("shutdown_grace_seconds", 3600, &config.shutdown_grace_seconds);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = seconds("reattach_grace_seconds", 86400, &config.reattach_grace_seconds);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = seconds("exit_when_unused_seconds", 86400, &config.exit_when_unused_seconds);
      !s.ok()) {
    return s;
  }
  if (const std::string* ttl = get("session_idle_ttl_seconds")) {
    double parsed = 0;
    if (!absl::SimpleAtod(*ttl, &parsed) || !(parsed >= 0 && parsed <= 1e7)) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_idle_ttl_seconds: '", *ttl, "' is not a number of seconds >= 0"));
    }
    config.session_idle_ttl_seconds = parsed;
  }
  for (const auto& [key, ids] :
       {std::pair{"allow_uid", &config.allow_uids}, std::pair{"allow_gid", &config.allow_gids}}) {
    const std::string* text = get(key);
    if (text == nullptr) continue;
    for (absl::string_view part : absl::StrSplit(*text, ',', absl::SkipWhitespace())) {
      uint32_t id = 0;
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
        return absl::InvalidArgumentError(absl::StrCat(key, ": '", part, "' is not a numeric id"));
      }
      ids->push_back(id);
    }
  }
  if (!config.device_pools.empty() && (config.allow_uids.empty() || !config.allow_gids.empty())) {
    // One IPC handle maps the whole device pool: whoever imports it can read
    // and write every session's segments for as long as it lives.
    return absl::InvalidArgumentError(
        "device_pool: a process that imports a device pool maps all of it (every session's "
        "data), so device pools need allow_uid: the users whose trainers may attach (e.g. "
        "--allow-uid $(id -u) for one user's trainers), and no allow_gid (a group is wider)");
  }
  if (const std::string* v = get("metrics_address")) config.metrics_address = *v;
  if (const std::string* v = get("spill_dir")) config.spill_dir = *v;
  if (const std::string* size = get("spill_size")) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(*size);
    if (!parsed.ok()) return bad("spill_size", parsed.status());
    if (config.spill_dir.empty()) {
      return absl::InvalidArgumentError("spill_size: needs spill_dir (where to spill)");
    }
    if (*parsed < config.segment_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("spill_size: ", FormatBytes(*parsed),
                                                     " is smaller than one segment (",
                                                     FormatBytes(config.segment_bytes), ")"));
    }
    config.spill_bytes = *parsed;
  }
  if (const std::string* v = get("numa")) {
    absl::StatusOr<NumaSetting> parsed = ParseNumaSetting(*v);
    if (!parsed.ok()) return bad("numa", parsed.status());
    config.numa = *parsed;
  }
  if (const std::string* v = get("copy_bandwidth")) {
    absl::StatusOr<CopyBandwidthSetting> parsed = ParseCopyBandwidth(*v);
    if (!parsed.ok()) return bad("copy_bandwidth", parsed.status());
    config.copy_bandwidth = *parsed;
  }
  if (const std::string* v = get("tls_cert")) config.tls_cert = *v;
  if (const std::string* v = get("tls_key")) config.tls_key = *v;
  if (const std::string* v = get("tls_client_ca")) config.tls_client_ca = *v;
  for (auto [key, field] : {std::pair{"insecure", &config.insecure},
                            std::pair{"exit_with_parent", &config.exit_with_parent}}) {
    if (const std::string* v = get(key)) {
      absl::StatusOr<bool> parsed = ParseBool(key, *v);
      if (!parsed.ok()) return parsed.status();
      *field = *parsed;
    }
  }
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return absl::InvalidArgumentError("tls_cert and tls_key go together");
  }
  if (!config.tls_client_ca.empty() && config.tls_cert.empty()) {
    return absl::InvalidArgumentError("tls_client_ca needs tls_cert and tls_key");
  }
  if (const std::string* v = get("listen_tcp")) {
    config.listen_tcp = *v;
    const size_t colon = v->rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(v->substr(colon + 1), &port) || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("listen_tcp: '", *v, "' is not HOST:PORT"));
    }
    if (!IsLoopbackHost(*v) && config.tls_cert.empty() && !config.insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "listen_tcp: refusing to serve ", *v,
          " without TLS on a non-loopback address: give "
          "--tls-cert and --tls-key (and --tls-client-ca for mTLS), or --insecure if the "
          "network is trusted (session tokens would travel in clear)"));
    }
  } else if (!config.tls_cert.empty()) {
    return absl::InvalidArgumentError("tls_cert is set but listen_tcp is not");
  }
  return config;
}

}  // namespace

bool IsLoopbackHost(const std::string& host_port) {
  std::string host = host_port.substr(0, host_port.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

uint64_t DefaultPoolBytes(uint64_t usable_bytes) {
  constexpr uint64_t kCap = 32ull << 30;
  return std::min(usable_bytes / 4, kCap);
}

uint64_t DefaultPoolBytes() { return DefaultPoolBytes(ReadMemoryLimits().usable_bytes()); }

CommandLine ParseCommandLine(int argc, const char* const* argv) {
  CommandLine result;
  CLI::App app{
      absl::StrCat("actstashd ", kVersion,
                   ": node-local activation offload daemon. Settings come from flags, then the "
                   "TOML file given by --config (keys are the flag names with '_' for '-'), "
                   "then defaults."),
      "actstashd"};
  app.set_version_flag("--version", std::string(kVersion));
  std::string config_file;
  app.add_option("-c,--config", config_file, "TOML configuration file")->check(CLI::ExistingFile);
  std::map<std::string, std::string> flag_values;
  std::vector<std::pair<const char*, CLI::Option*>> options;
  std::map<std::string, bool> boolean_flags;
  for (const Setting& setting : kSettings) {
    if (IsBooleanFlag(setting.key)) {
      options.emplace_back(setting.key, app.add_flag(FlagName(setting.key),
                                                     boolean_flags[setting.key], setting.help));
      continue;
    }
    CLI::Option* option =
        app.add_option(FlagName(setting.key), flag_values[setting.key], setting.help);
    if (std::string(setting.key) == "take_over") option->expected(0, 1);  // a value is optional
    options.emplace_back(setting.key, option);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version exit 0; every usage error exits 2, as documented.
    result.exit_code = app.exit(error) == 0 ? 0 : 2;
    return result;
  }
  std::map<std::string, std::string> values;
  if (!config_file.empty()) {
    if (absl::Status status = ReadToml(config_file, &values); !status.ok()) {
      std::cerr << "actstashd: " << status.message() << "\n";
      result.exit_code = 2;
      return result;
    }
  }
  for (const auto& [key, option] : options) {
    if (option->count() == 0) continue;
    values[key] = IsBooleanFlag(key) ? (boolean_flags[key] ? "true" : "false") : flag_values[key];
  }
  absl::StatusOr<DaemonConfig> config = Resolve(values);
  if (!config.ok()) {
    std::cerr << "actstashd: " << config.status().message() << "\n";
    result.exit_code = 2;
    return result;
  }
  result.config = *std::move(config);
  return result;
}

}  // namespace actstash::server
