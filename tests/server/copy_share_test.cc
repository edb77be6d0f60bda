// The node's copy bandwidth and its share: the --copy-bandwidth setting, the
// measurement's one start on the work queue, and the count of copying
// sessions over the window.
#include "server/sessions/copy_share.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/base/work_queue.h"
#include "server/sessions/session.h"

namespace actstash::server {
namespace {

using ::testing::HasSubstr;
using Mode = CopyBandwidthSetting::Mode;

TEST(CopyBandwidthSettingTest, ParsesAutoOffAndRates) {
  EXPECT_EQ(ParseCopyBandwidth("auto")->mode, Mode::kAuto);
  EXPECT_EQ(ParseCopyBandwidth(" OFF ")->mode, Mode::kOff);
  absl::StatusOr<CopyBandwidthSetting> rate = ParseCopyBandwidth("150GB/s");
  ASSERT_TRUE(rate.ok()) << rate.status();
  EXPECT_EQ(rate->mode, Mode::kFixed);
  EXPECT_EQ(rate->bytes_per_second, 150e9);
  EXPECT_EQ(ParseCopyBandwidth("12GiB/s")->bytes_per_second, 12.0 * (uint64_t{1} << 30));
  EXPECT_EQ(ParseCopyBandwidth("1.5GB")->bytes_per_second, 1.5e9);  // "/s" may be left out
  for (const char* bad : {"", "fast", "0", "0GB/s", "-1GB/s", "10GB/h", "/s"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<CopyBandwidthSetting> parsed = ParseCopyBandwidth(bad);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("auto, off or a positive rate"));
  }
}

TEST(NodeCopyBandwidthTest, FixedAndOffNeverMeasure) {
  std::atomic<int> calls{0};
  auto measure = [&] { return ++calls, 1e9; };
  WorkQueue work;
  NodeCopyBandwidth fixed({Mode::kFixed, 5e9}, &work, measure);
  EXPECT_EQ(fixed.Get().bytes_per_second, 5e9);
  EXPECT_STREQ(fixed.Get().source, "configured");
  NodeCopyBandwidth off({Mode::kOff, 0}, &work, measure);
  EXPECT_EQ(off.Get().bytes_per_second, 0);
  EXPECT_STREQ(off.Get().source, "");
  work.Stop();
  EXPECT_EQ(calls.load(), 0);
}

TEST(NodeCopyBandwidthTest, AutoMeasuresOnceOnTheWorkQueueAndIsUnknownUntilThen) {
  std::atomic<int> calls{0};
  absl::Notification release;
  WorkQueue work;
  NodeCopyBandwidth node({Mode::kAuto, 0}, &work, [&] {
    ++calls;
    release.WaitForNotification();  // the asker is never the one who waits
    return 7e9;
  });
  EXPECT_EQ(node.Peek().bytes_per_second, 0);  // Peek starts nothing
  for (int i = 0; i < 3; ++i) {
    const NodeCopyBandwidth::Figure figure = node.Get();
    EXPECT_EQ(figure.bytes_per_second, 0);
    EXPECT_STREQ(figure.source, "");
  }
  release.Notify();
  work.Stop();  // runs the measurement to its end
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(node.Get().bytes_per_second, 7e9);
  EXPECT_STREQ(node.Peek().source, "measured");
}

TEST(NodeCopyBandwidthTest, AFailedMeasurementStaysUnknown) {
  WorkQueue work;
  NodeCopyBandwidth node({Mode::kAuto, 0}, &work, [] { return std::nan(""); });
  node.Get();
  work.Stop();
  EXPECT_EQ(node.Get().bytes_per_second, 0);
}

TEST(CopyShareTest, CountsTheSessionsThatCopiedWithinTheWindow) {
  auto session = [](uint64_t id) {
    return std::make_shared<Session>(id, "token", "s", 1, 1 << 20, 0);
  };
  std::vector<std::shared_ptr<Session>> sessions = {session(1), session(2), session(3)};
  const int64_t now = SteadyNowMs();
  NodeCopyBandwidth::Figure node{12e9, "configured"};
  v1::CopyStats none = CopyStatsOf(node, sessions, now);
  EXPECT_EQ(none.copying_sessions(), 0u);  // never copied
  EXPECT_EQ(ShareOf(none), 12e9);          // the asker counts as one at least
  sessions[0]->RecordStore(100);
  sessions[1]->MarkCopying();
  v1::CopyStats two = CopyStatsOf(node, sessions, SteadyNowMs());
  EXPECT_EQ(two.copying_sessions(), 2u);
  EXPECT_EQ(two.node_bytes_per_second(), 12e9);
  EXPECT_EQ(two.node_source(), "configured");
  EXPECT_EQ(two.window_seconds(), kCopyWindowMs / 1000);
  EXPECT_EQ(ShareOf(two), 6e9);
  // Reported zero-copy bytes count when they grew, not when a report repeats them.
  v1::ClientUsage usage;
  usage.set_objects(3);
  sessions[2]->RecordClientUsage(usage);
  EXPECT_EQ(CopyStatsOf(node, sessions, SteadyNowMs()).copying_sessions(), 2u);
  usage.set_bytes_fetched(4096);
  sessions[2]->RecordClientUsage(usage);
  EXPECT_EQ(CopyStatsOf(node, sessions, SteadyNowMs()).copying_sessions(), 3u);
  // Past the window nobody counts.
  EXPECT_EQ(CopyStatsOf(node, sessions, SteadyNowMs() + kCopyWindowMs + 1000).copying_sessions(),
            0u);
  EXPECT_EQ(ShareOf(CopyStatsOf({}, sessions, now)), 0);  // unknown node: unknown share
}

TEST(CopyShareTest, MemcpyBandwidthIsMeasured) {
  const double bps = MeasureMemcpyBandwidth(2, 1 << 20, 2);
  EXPECT_GT(bps, 1e6);  // any machine copies more than 1 MB/s
  EXPECT_TRUE(std::isfinite(bps));
}

}  // namespace
}  // namespace actstash::server
