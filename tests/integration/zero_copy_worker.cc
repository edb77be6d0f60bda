// A client process for the zero-copy integration tests: stores, fetches and
// checks random buffers, or holds leases until killed.
//
//   zero_copy_worker --address A [--iterations N] [--seed S] [--max-bytes B]
//                    [--hold-bytes B] [--setuid UID]
// Exit 0 when every fetched byte matched; prints "holding" and sleeps after
// --hold-bytes are stored; "attach refused: <message>" and exit 3 when the
// daemon refused the attach.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actstash/client.h"

namespace {

std::string Arg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string address = Arg(argc, argv, "--address", "");
  const long iterations = std::atol(Arg(argc, argv, "--iterations", "200").c_str());
  const uint64_t seed = std::strtoull(Arg(argc, argv, "--seed", "1").c_str(), nullptr, 10);
  const uint64_t max_bytes =
      std::strtoull(Arg(argc, argv, "--max-bytes", "3000000").c_str(), nullptr, 10);
  const uint64_t hold = std::strtoull(Arg(argc, argv, "--hold-bytes", "0").c_str(), nullptr, 10);
  const long uid = std::atol(Arg(argc, argv, "--setuid", "-1").c_str());
  if (uid >= 0 && setuid(static_cast<uid_t>(uid)) != 0) {
    std::perror("setuid");
    return 2;
  }
  actstash::ClientOptions options;
  options.address = address;
  options.client_name = "zero-copy-worker";
  options.attach = actstash::AttachMode::kRequired;
  auto client = actstash::Client::Connect(options);
  if (!client.ok()) {
    std::printf("attach refused: %s\n", std::string(client.status().message()).c_str());
    std::fflush(stdout);
    return 3;
  }
  if (hold > 0) {
    std::vector<std::byte> chunk(8 << 20, std::byte{7});
    for (uint64_t held = 0; held < hold; held += chunk.size()) {
      if (!(*client)->Store(chunk.data(), chunk.size()).ok()) return 4;
    }
    std::printf("holding\n");
    std::fflush(stdout);
    while (true) std::this_thread::sleep_for(std::chrono::seconds(60));
  }
  std::mt19937_64 rng(seed);
  std::vector<std::pair<actstash::Ticket, std::vector<uint64_t>>> live;
  int errors = 0;
  for (long i = 0; i < iterations; ++i) {
    if (live.empty() || rng() % 2 == 0) {
      std::vector<uint64_t> words((rng() % max_bytes) / 8 + 1);
      for (uint64_t& w : words) w = rng();
      auto ticket = (*client)->Store(words.data(), words.size() * 8);
      if (!ticket.ok()) {
        std::printf("store: %s\n", ticket.status().ToString().c_str());
        return 1;
      }
      live.emplace_back(*ticket, std::move(words));
    } else {
      const size_t k = rng() % live.size();
      std::vector<uint64_t> back(live[k].second.size());
      absl::Status fetched = (*client)->Fetch(live[k].first, back.data(), back.size() * 8);
      if (!fetched.ok() || back != live[k].second) ++errors;
      if (!(*client)->Release(live[k].first).ok()) ++errors;
      live.erase(live.begin() + static_cast<long>(k));
    }
  }
  for (auto& [ticket, words] : live) {
    std::vector<uint64_t> back(words.size());
    if (!(*client)->Fetch(ticket, back.data(), back.size() * 8).ok() || back != words) ++errors;
    if (!(*client)->Release(ticket).ok()) ++errors;
  }
  std::printf("%s: %d errors, attached=%d\n", errors ? "FAILED" : "ok", errors,
              (*client)->attached());
  return errors == 0 ? 0 : 1;
}
