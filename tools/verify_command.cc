#include "tools/verify_command.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "actstash/v1/stash.pb.h"
#include "common/units.h"

namespace actstash::cli {
namespace {

uint64_t Mix(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Object `index`'s bytes: 64-bit words of a splitmix64 sequence whose start
// is the mixed index, so that no object is another shifted by some words (a
// start of golden * index would make object i+1 object i moved by 8 bytes)
// and a misplaced block is caught, not only a zeroed one.
void Fill(uint64_t index, std::vector<uint64_t>& words) {
  uint64_t state = Mix(index ^ 0x5eed5eed5eed5eedull);
  for (uint64_t& word : words) word = Mix(state += 0x9e3779b97f4a7c15ull);
}

struct SpillCounters {
  uint64_t written = 0;
  uint64_t read = 0;
  bool enabled = false;
};

absl::StatusOr<SpillCounters> ReadSpill(Client& client) {
  absl::StatusOr<v1::StatsReply> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  SpillCounters counters;
  counters.enabled = stats->has_spill();
  counters.written = stats->spill().bytes_written();
  counters.read = stats->spill().bytes_read();
  return counters;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "actstash verify: %s\n", what.c_str());
  return kExitUnavailable;
}

}  // namespace

int RunVerify(const Common& common, const VerifyOptions& options) {
  if (options.object_bytes == 0 || options.object_bytes % sizeof(uint64_t) != 0 ||
      options.total_bytes < options.object_bytes) {
    std::fprintf(stderr,
                 "actstash verify: --object-size must be a positive multiple of 8 bytes and at "
                 "most --bytes\n");
    return kExitUsage;
  }
  absl::StatusOr<std::unique_ptr<Client>> client =
      ConnectCli(common, /*quota=*/0, /*attach=*/options.zero_copy);
  if (!client.ok()) return Fail(std::string(client.status().message()));
  if (options.zero_copy && !(*client)->attached()) {
    return Fail("--zero-copy: the daemon did not attach this client (TCP, or another host)");
  }
  absl::StatusOr<SpillCounters> before = ReadSpill(**client);
  if (!before.ok()) return Fail(before.status().ToString());
  const uint64_t count = options.total_bytes / options.object_bytes;
  std::printf("actstash verify: %llu objects of %s (%s) through %s, %s path\n",
              static_cast<unsigned long long>(count), FormatBytes(options.object_bytes).c_str(),
              FormatBytes(count * options.object_bytes).c_str(), (*client)->address().c_str(),
              (*client)->attached() ? "zero-copy" : "inline gRPC");

  std::vector<uint64_t> expected(options.object_bytes / sizeof(uint64_t));
  std::vector<uint64_t> got(expected.size());
  std::vector<Ticket> tickets;
  tickets.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    Fill(i, expected);
    absl::StatusOr<Ticket> ticket = (*client)->Store(expected.data(), options.object_bytes);
    if (!ticket.ok()) {
      return Fail(absl::StrFormat("store %llu of %llu: %s", static_cast<unsigned long long>(i + 1),
                                  static_cast<unsigned long long>(count),
                                  ticket.status().ToString()));
    }
    tickets.push_back(*ticket);
  }
  // Oldest first: with more data than the pool, the oldest went to disk.
  for (uint64_t i = 0; i < count; ++i) {
    Fill(i, expected);
    std::fill(got.begin(), got.end(), 0);
    absl::Status fetched = (*client)->Fetch(tickets[i], got.data(), options.object_bytes);
    if (!fetched.ok()) {
      return Fail(absl::StrFormat("fetch %llu: %s", static_cast<unsigned long long>(i + 1),
                                  fetched.ToString()));
    }
    auto [mine, theirs] = std::mismatch(expected.begin(), expected.end(), got.begin());
    if (mine != expected.end()) {
      return Fail(absl::StrFormat(
          "object %llu came back different from what was stored, first at byte %llu",
          static_cast<unsigned long long>(i + 1),
          static_cast<unsigned long long>((mine - expected.begin()) * sizeof(uint64_t))));
    }
    absl::Status released = (*client)->Release(tickets[i]);
    if (!released.ok()) return Fail("release: " + released.ToString());
  }
  absl::StatusOr<SpillCounters> after = ReadSpill(**client);
  if (!after.ok()) return Fail(after.status().ToString());
  const uint64_t written = after->written - before->written;
  const uint64_t read = after->read - before->read;
  std::printf("actstash verify: every byte came back; spill tier: %s\n",
              !after->enabled ? "off (no --spill-dir)"
                              : absl::StrFormat("%s written to disk, %s read back",
                                                FormatBytes(written), FormatBytes(read))
                                    .c_str());
  if (options.require_spill && (written == 0 || read == 0)) {
    return Fail(after->enabled
                    ? "--require-spill: nothing went to disk and back (store more than the "
                      "session's quota or the pool: --bytes)"
                    : "--require-spill: the daemon has no spill tier (--spill-dir)");
  }
  return 0;
}

}  // namespace actstash::cli
