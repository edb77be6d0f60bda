#include "server/sessions/copy_share.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/units.h"
#include "server/base/work_queue.h"
#include "server/sessions/session.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

absl::StatusOr<CopyBandwidthSetting> ParseCopyBandwidth(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  CopyBandwidthSetting setting;
  if (lower == "auto") return setting;
  if (lower == "off") {
    setting.mode = CopyBandwidthSetting::Mode::kOff;
    return setting;
  }
  absl::string_view rate = lower;
  absl::ConsumeSuffix(&rate, "/s");
  absl::StatusOr<uint64_t> bytes = ParseByteSize(rate);
  if (!bytes.ok() || *bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not auto, off or a positive rate in bytes per second (e.g. 150GB/s)"));
  }
  setting.mode = CopyBandwidthSetting::Mode::kFixed;
  setting.bytes_per_second = static_cast<double>(*bytes);
  return setting;
}

double MeasureMemcpyBandwidth(int threads, uint64_t bytes, int rounds) {
  threads = std::max(threads, 1);
  std::vector<std::vector<char>> src(threads), dst(threads);
  for (int t = 0; t < threads; ++t) {
    src[t].assign(bytes, static_cast<char>(t + 1));  // touched: no page faults while timed
    dst[t].assign(bytes, 0);
  }
  double best = 0;
  for (int r = 0; r < std::max(rounds, 1); ++r) {
    std::vector<std::thread> workers;
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] { std::memcpy(dst[t].data(), src[t].data(), bytes); });
    }
    for (std::thread& w : workers) w.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 0) best = std::max(best, static_cast<double>(bytes) * threads / seconds);
  }
  return best;
}

double MeasureNodeCopyBandwidth() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return MeasureMemcpyBandwidth(std::clamp(cores, 1, 16), uint64_t{16} << 20, 3);
}

NodeCopyBandwidth::NodeCopyBandwidth(CopyBandwidthSetting setting, WorkQueue* work, Measure measure)
    : setting_(setting), work_(work), measure_(std::move(measure)) {}

NodeCopyBandwidth::Figure NodeCopyBandwidth::Get() {
  if (setting_.mode == CopyBandwidthSetting::Mode::kAuto) {
    bool start = false;
    {
      absl::MutexLock lock(&mu_);
      start = !started_ && work_ != nullptr;
      started_ = true;
    }
    if (start) {
      work_->Post([this] {
        const auto start = std::chrono::steady_clock::now();
        const double measured = measure_();
        spdlog::info(
            "node copy bandwidth measured: {:.2f} GB/s (memcpy on every core, in {} ms); "
            "copying sessions share it (--copy-bandwidth sets it instead)",
            measured / 1e9,
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                  start)
                .count());
        absl::MutexLock lock(&mu_);
        measured_ = measured > 0 && std::isfinite(measured) ? measured : 0;
      });
    }
  }
  return Peek();
}

NodeCopyBandwidth::Figure NodeCopyBandwidth::Peek() const {
  switch (setting_.mode) {
    case CopyBandwidthSetting::Mode::kFixed:
      return {setting_.bytes_per_second, "configured"};
    case CopyBandwidthSetting::Mode::kOff:
      return {};
    case CopyBandwidthSetting::Mode::kAuto:
      break;
  }
  absl::MutexLock lock(&mu_);
  if (measured_ > 0) return {measured_, "measured"};
  return {};
}

v1::CopyStats CopyStatsOf(const NodeCopyBandwidth::Figure& node,
                          const std::vector<std::shared_ptr<Session>>& sessions, int64_t now_ms) {
  v1::CopyStats out;
  out.set_node_bytes_per_second(node.bytes_per_second);
  out.set_node_source(node.source);
  out.set_window_seconds(static_cast<uint32_t>(kCopyWindowMs / 1000));
  uint32_t copying = 0;
  for (const std::shared_ptr<Session>& s : sessions) {
    if (!s->closed() && s->CopiedWithin(now_ms, kCopyWindowMs)) ++copying;
  }
  out.set_copying_sessions(copying);
  return out;
}

double ShareOf(const v1::CopyStats& node) {
  return node.node_bytes_per_second() / std::max<uint32_t>(node.copying_sessions(), 1);
}

}  // namespace actstash::server
