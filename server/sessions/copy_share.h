// The node's copy bandwidth (--copy-bandwidth) and the share of it each
// copying session gets. A rank that measured its copies alone plans with
// more than it gets once every rank on the node copies: the host's memory
// bandwidth is one, the ranks are many. The daemon sees them all.
#ifndef ACTSTASH_SERVER_SESSIONS_COPY_SHARE_H_
#define ACTSTASH_SERVER_SESSIONS_COPY_SHARE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "actstash/v1/stash.pb.h"

namespace actstash::server {

class Session;
class WorkQueue;

// A session counts as copying for this long after its last copy (a store,
// a fetch, a reported zero-copy byte count that grew, a CopyShare call):
// longer than a training step, so that a rank between two steps' copies
// still counts.
constexpr int64_t kCopyWindowMs = 30000;

// --copy-bandwidth: "auto" (measure), "off", or a rate: a byte size per
// second ("150GB/s", "12GiB/s"; the "/s" may be left out).
struct CopyBandwidthSetting {
  enum class Mode { kAuto, kOff, kFixed };
  Mode mode = Mode::kAuto;
  double bytes_per_second = 0;  // kFixed only; > 0
};
absl::StatusOr<CopyBandwidthSetting> ParseCopyBandwidth(absl::string_view text);

// The host's memcpy bandwidth: `threads` threads each copying between two
// buffers of `bytes` of their own (touched first), all at once; the best of
// `rounds`, in bytes moved per second summed over the threads. Blocks for
// the measurement (tens to hundreds of milliseconds).
double MeasureMemcpyBandwidth(int threads, uint64_t bytes, int rounds);
// MeasureMemcpyBandwidth over every core (at most 16 threads) with buffers
// of 16 MiB: beyond the caches, so that it is the memory's bandwidth.
double MeasureNodeCopyBandwidth();

// The node figure: fixed, off, or measured once in auto mode, on `work`
// (never on the calling thread: gRPC handlers ask) at the first Get; until
// it is done the figure is unknown. Thread-safe; `work` must outlive the
// measurement (the owner stops it first).
class NodeCopyBandwidth {
 public:
  using Measure = std::function<double()>;
  struct Figure {
    double bytes_per_second = 0;  // 0: unknown
    const char* source = "";      // "configured", "measured" or ""
  };
  NodeCopyBandwidth(CopyBandwidthSetting setting, WorkQueue* work,
                    Measure measure = MeasureNodeCopyBandwidth);
  NodeCopyBandwidth(const NodeCopyBandwidth&) = delete;
  NodeCopyBandwidth& operator=(const NodeCopyBandwidth&) = delete;

  // The figure now; in auto mode, the first call starts the measurement.
  Figure Get() ABSL_LOCKS_EXCLUDED(mu_);
  // The figure now, starting nothing (stats, metrics).
  Figure Peek() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const CopyBandwidthSetting setting_;
  WorkQueue* const work_;
  const Measure measure_;
  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  double measured_ ABSL_GUARDED_BY(mu_) = 0;
};

// The node's copy figures over `sessions` at `now_ms` (SteadyNowMs).
v1::CopyStats CopyStatsOf(const NodeCopyBandwidth::Figure& node,
                          const std::vector<std::shared_ptr<Session>>& sessions, int64_t now_ms);
// What each copying session gets when all copy at once: the node figure
// over the copying sessions (at least one: the asker); 0 when unknown.
double ShareOf(const v1::CopyStats& node);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SESSIONS_COPY_SHARE_H_
