// hotpath_count: the saved-tensor hot path through the C ABI (pack ->
// store -> fetch -> release of one dense CPU tensor), in a form whose
// instruction count callgrind measures exactly, next to a plain memcpy of the
// same bytes in the same run. scripts/check-hotpath runs it under
//   valgrind --tool=callgrind --collect-atstart=no
// and compares the counts with bench/hotpath_baseline.txt.
//
//   hotpath_count                      # starts its own actstashd
//   hotpath_count --address unix:///run/actstash/actstash.sock
//
// For each size, after --warmup untimed rounds (leases taken, pages of the
// caller's buffers and of the pool touched), --ops rounds run in StashRounds
// and are dumped as "stash <size>"; then as many memcpys of the same bytes
// into a pre-touched buffer (MemcpyRounds), dumped as "memcpy <size>".
// Outside valgrind the requests do nothing, and the program prints
// wall-clock ns per op and the caller's minor faults per op over the
// measured rounds (0 when the hot path keeps what it touches mapped).
//
// One round is what the Python front-end does for a CPU tensor: pack it
// (actstash_engine_pack_dense_cpu: copied into leased memory on this thread
// up to inline_store_bytes, by the host engine's thread above), for a store
// above that wait for it (actstash_engine_synchronize, which also drops the
// source; forward never waits so, its later packs reap), then
// unpack it: below view_min_bytes copied back into a destination
// (actstash_engine_unpack_into), else a view of the leased bytes, given back
// with actstash_engine_view_done; then actstash_engine_release.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <valgrind/callgrind.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "actstash/c_api.h"

extern char** environ;

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "hotpath_count: %s\n", what.c_str());
  std::exit(1);
}

void CheckCode(int code, const char* what) {
  if (code != 0) Die(std::string(what) + ": " + actstash_last_error());
}

std::string SizeName(uint64_t n) {
  if (n % (1 << 20) == 0) return std::to_string(n >> 20) + "MiB";
  return std::to_string(n >> 10) + "KiB";
}

long MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// A private actstashd (the C ABI is the only client code linked: the
// testing library's DaemonProcess would bring a second copy of the protocol's
// descriptors). Stopped with SIGTERM when the run ends.
class Daemon {
 public:
  Daemon(const std::string& binary, const std::string& pool) {
    char dir[] = "/tmp/actstash-hotpath-XXXXXX";
    if (mkdtemp(dir) == nullptr) Die("mkdtemp failed");
    dir_ = dir;
    socket_ = dir_ + "/actstash.sock";
    log_ = dir_ + "/actstashd.log";
    std::vector<std::string> args = {binary, "--socket",    socket_, "--pool-size",
                                     pool,   "--log-level", "warn"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_addopen(&files, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&files, 1, 2);
    const int spawned = posix_spawn(&pid_, binary.c_str(), &files, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&files);
    if (spawned != 0) Die("cannot start " + binary);
  }
  ~Daemon() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    unlink(log_.c_str());
    rmdir(dir_.c_str());
  }
  std::string address() const { return "unix://" + socket_; }
  bool exited() {
    int status = 0;
    return waitpid(pid_, &status, WNOHANG) == pid_;
  }

 private:
  pid_t pid_ = 0;
  std::string dir_, socket_, log_;
};

struct Engine {
  actstash_client* client = nullptr;
  actstash_engine* engine = nullptr;
  ~Engine() {
    if (engine != nullptr) actstash_engine_free(engine);
    if (client != nullptr) {
      actstash_client_close(client);
      actstash_client_free(client);
    }
  }
};

constexpr uint64_t kFlags = 4 | ACTSTASH_FP32;  // float32 elements, dense
constexpr int kOutLen = 5;                      // no prefetch offers on the CPU

// One round; false when the bytes did not come back (checked in warm-up).
// Engine settings the round follows, read back from the engine.
struct Thresholds {
  uint64_t view_min = 0;    // view_min_bytes
  uint64_t inline_max = 0;  // inline_store_bytes
};

bool Round(actstash_engine* engine, const char* src, char* dst, uint64_t n, const Thresholds& t,
           bool verify) {
  const uint64_t id = actstash_engine_pack_dense_cpu(engine, reinterpret_cast<uintptr_t>(src), n,
                                                     kFlags, 0, nullptr, nullptr);
  if (id == 0) {
    CheckCode(actstash_engine_take_error(engine), "pack");
    Die("pack of " + SizeName(n) + " kept the tensor (not attached to the daemon?)");
  }
  // A store above inline_store_bytes runs on the host engine's thread: wait
  // for it (and drop its source) as forward's later packs would. A smaller
  // one is done when pack returns.
  if (n > t.inline_max) actstash_engine_synchronize(engine);
  uint64_t out[kOutLen] = {};
  bool same = true;
  if (n < t.view_min) {
    CheckCode(actstash_engine_unpack_into(engine, id, 0, reinterpret_cast<uintptr_t>(dst), n, out,
                                          kOutLen),
              "unpack_into");
    if (out[0] != ACTSTASH_UNPACK_COPIED) Die("a small unpack was not copied back");
    if (verify) same = std::memcmp(src, dst, n) == 0;
  } else {
    CheckCode(actstash_engine_unpack(engine, id, 0, out, kOutLen), "unpack");
    if (out[0] != ACTSTASH_UNPACK_VIEW) Die("a large unpack was not a view");
    if (verify) same = std::memcmp(src, reinterpret_cast<const void*>(out[1]), n) == 0;
    actstash_engine_view_done(engine, id);
  }
  actstash_engine_release(engine, id);
  return same;
}

// The measured loops, by name: scripts/check-hotpath collects exactly these
// functions (--toggle-collect) and the host copy engine's threads, so the
// client library's other threads (gRPC, usage reports) count for nothing.
// `regress`: one more copy of the bytes per round, a regression that
// scripts/check-hotpath's self-test must catch.
__attribute__((noinline)) void StashRounds(actstash_engine* engine, const char* src, char* dst,
                                           uint64_t n, const Thresholds& t, int ops, bool regress) {
  for (int i = 0; i < ops; ++i) {
    Round(engine, src, dst, n, t, false);
    if (regress) {
      std::memcpy(dst, src, n);
      asm volatile("" : : "r"(dst) : "memory");
    }
  }
}

__attribute__((noinline)) void MemcpyRounds(char* dst, const char* src, uint64_t n, int ops) {
  for (int i = 0; i < ops; ++i) {
    std::memcpy(dst, src, n);
    asm volatile("" : : "r"(dst) : "memory");  // the copy is not elided
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Instruction counts (under callgrind) of the C ABI's hot path next to memcpy"};
  std::string address;
  std::string binary = ACTSTASH_DAEMON_PATH;
  std::vector<uint64_t> sizes = {4 << 10, 64 << 10, 1 << 20, 4 << 20};
  int ops = 200, warmup = 50;
  bool regress = false;
  app.add_option("--address", address, "an actstashd to use (default: start one)");
  app.add_option("--actstashd", binary, "the actstashd to start without --address");
  app.add_option("--sizes", sizes, "bytes per tensor");
  app.add_option("--ops", ops, "measured rounds per size")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed rounds per size first")->check(CLI::PositiveNumber);
  app.add_flag("--simulate-regression", regress,
               "one more copy of the bytes per round (the check's self-test)");
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<Daemon> daemon;
  if (address.empty()) {
    daemon = std::make_unique<Daemon>(binary, "256MiB");
    address = daemon->address();
  }
  Engine e;
  const std::string client_options = "{\"address\": \"" + address + "\"}";
  // A fresh daemon needs a moment before it serves.
  for (int tries = 0; actstash_client_connect(client_options.c_str(), &e.client) != 0; ++tries) {
    if (daemon == nullptr || tries == 300 || daemon->exited()) {
      Die(std::string("connect to ") + address + ": " + actstash_last_error());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CheckCode(actstash_engine_create(e.client, nullptr, nullptr, &e.engine), "engine");
  char* settings = actstash_engine_settings_json(e.engine);
  const std::string json = settings;
  actstash_free_string(settings);
  // The engine's own thresholds decide which unpack the front-end makes and
  // whether a store is in flight when pack returns.
  auto setting = [&json](const std::string& name) -> uint64_t {
    const std::string key = "\"" + name + "\":";
    const size_t at = json.find(key);
    if (at == std::string::npos) Die("no " + name + " in the engine's settings: " + json);
    return std::strtoull(json.c_str() + at + key.size(), nullptr, 10);
  };
  const Thresholds thresholds{setting("view_min_bytes"), setting("inline_store_bytes")};

  std::printf("%-10s %14s %14s %12s %12s\n", "size", "stash ns/op", "memcpy ns/op", "ratio",
              "faults/op");
  for (uint64_t n : sizes) {
    std::vector<char> src(n), dst(n), copy(n);
    for (uint64_t i = 0; i < n; ++i) src[i] = static_cast<char>(i * 131 + (i >> 12));
    std::memset(dst.data(), 1, n);
    std::memset(copy.data(), 1, n);
    for (int i = 0; i < warmup; ++i) {
      if (!Round(e.engine, src.data(), dst.data(), n, thresholds, /*verify=*/true)) {
        Die("the bytes of a " + SizeName(n) + " tensor did not come back");
      }
    }
    const std::string stash_name = "stash " + SizeName(n);
    const std::string memcpy_name = "memcpy " + SizeName(n);

    const long faults = MinorFaults();
    auto start = std::chrono::steady_clock::now();
    CALLGRIND_ZERO_STATS;
    StashRounds(e.engine, src.data(), dst.data(), n, thresholds, ops, regress);
    CALLGRIND_DUMP_STATS_AT(stash_name.c_str());
    const double stash_ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
        ops;
    const long stash_faults = MinorFaults() - faults;

    start = std::chrono::steady_clock::now();
    CALLGRIND_ZERO_STATS;
    MemcpyRounds(copy.data(), src.data(), n, ops);
    CALLGRIND_DUMP_STATS_AT(memcpy_name.c_str());
    const double memcpy_ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
        ops;
    std::printf("%-10s %14.0f %14.0f %12.2f %12.3f\n", SizeName(n).c_str(), stash_ns, memcpy_ns,
                stash_ns / memcpy_ns, static_cast<double>(stash_faults) / ops);
  }
  std::printf(
      "ops per size: %d (after %d warm-up rounds); view_min_bytes %llu, "
      "inline_store_bytes %llu\n",
      ops, warmup, static_cast<unsigned long long>(thresholds.view_min),
      static_cast<unsigned long long>(thresholds.inline_max));
  return 0;
}
