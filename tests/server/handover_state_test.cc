// The pieces a take-over is made of, without a daemon: the state image
// (round trip, and every way a handed image can be wrong), a pool adopted
// from another pool's memfds (bytes kept, runs taken back exactly), and
// sessions and leases exported and adopted with their ids and quotas.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "server/pool/host_pool.h"
#include "server/restart/state_image.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session_manager.h"

namespace actstash::server {
namespace {

using ::testing::HasSubstr;

v1::DaemonState SampleState() {
  v1::DaemonState state;
  state.set_daemon_version("test");
  state.set_segments(4);
  state.set_segment_bytes(1 << 20);
  v1::SessionState* session = state.add_sessions();
  session->set_id(7);
  session->set_token("0123456789abcdef0123456789abcdef");
  session->set_name("trainer");
  session->set_quota_bytes(64 << 20);
  v1::LeaseState* lease = state.add_leases();
  lease->set_id(3);
  lease->set_session_id(7);
  lease->set_first_segment(1);
  lease->set_count(2);
  return state;
}

std::string ImageBytes(int fd) {
  std::string bytes(static_cast<size_t>(lseek(fd, 0, SEEK_END)), '\0');
  EXPECT_EQ(pread(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  return bytes;
}

UniqueFd Memfd(const std::string& bytes) {
  UniqueFd fd(memfd_create("image", MFD_CLOEXEC));
  EXPECT_EQ(pwrite(fd.get(), bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  return fd;
}

TEST(StateImageTest, RoundTripsAndIsSealed) {
  absl::StatusOr<UniqueFd> image = WriteStateImage(SampleState());
  ASSERT_TRUE(image.ok()) << image.status();
  absl::StatusOr<v1::DaemonState> back = ReadStateImage(image->get());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), SampleState().SerializeAsString());
  const char byte = 1;
  EXPECT_EQ(pwrite(image->get(), &byte, 1, 40), -1);  // F_SEAL_WRITE
  EXPECT_EQ(ftruncate(image->get(), 8), -1);          // F_SEAL_SHRINK
}

TEST(StateImageTest, EveryDamageIsRefused) {
  absl::StatusOr<UniqueFd> image = WriteStateImage(SampleState());
  ASSERT_TRUE(image.ok());
  const std::string good = ImageBytes(image->get());

  std::string truncated = good.substr(0, good.size() - 3);
  absl::StatusOr<v1::DaemonState> r = ReadStateImage(Memfd(truncated).get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();

  r = ReadStateImage(Memfd(good.substr(0, 20)).get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();

  std::string forged = good;
  forged[good.size() - 1] ^= 0x01;
  r = ReadStateImage(Memfd(forged).get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("checksum"));

  std::string other_format = good;
  other_format[8] = 9;
  r = ReadStateImage(Memfd(other_format).get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("format 9"));

  std::string not_an_image = good;
  not_an_image[0] = 'X';
  r = ReadStateImage(Memfd(not_an_image).get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);

  // A header that claims more body than the file holds.
  std::string oversize = good;
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(oversize.data() + 16, &huge, sizeof(huge));
  r = ReadStateImage(Memfd(oversize).get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
}

HostPoolOptions PoolOptions() {
  HostPoolOptions options;
  options.pool_bytes = 8 << 20;
  options.segment_bytes = 1 << 20;
  options.mlock = Tristate::kOff;
  return options;
}

TEST(AdoptHostPoolTest, KeepsTheBytesAndTakesRunsBackExactly) {
  absl::StatusOr<std::unique_ptr<HostPool>> first = CreateHostPool(PoolOptions());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<SegmentRun> run = (*first)->AllocateSegments(2);
  ASSERT_TRUE(run.ok());
  std::memset(run->memory.data(), 0x5a, run->memory.size());
  absl::StatusOr<Allocation> object = (*first)->Allocate(1000);  // an inline object's segment
  ASSERT_TRUE(object.ok());
  object->Reset();
  absl::StatusOr<std::vector<UniqueFd>> fds = (*first)->DupSegmentFds();
  ASSERT_TRUE(fds.ok());
  ASSERT_EQ(fds->size(), 8u);
  const std::vector<uint32_t> held = (*first)->HeldInlineSegments();
  ASSERT_FALSE(held.empty());

  HostPoolOptions wrong = PoolOptions();
  wrong.pool_bytes = 4 << 20;
  std::vector<UniqueFd> copies;
  for (const UniqueFd& fd : *fds) copies.emplace_back(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  absl::StatusOr<std::unique_ptr<HostPool>> mismatched =
      AdoptHostPool(wrong, std::move(copies), held);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::unique_ptr<HostPool>> second =
      AdoptHostPool(PoolOptions(), *std::move(fds), held);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->HeldInlineSegments(), held);
  absl::StatusOr<SegmentRun> adopted = (*second)->AdoptRun(run->first_segment, 2);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(static_cast<unsigned char>(adopted->memory.data()[12345]), 0x5a);
  EXPECT_EQ(static_cast<unsigned char>(adopted->memory.data()[(2 << 20) - 1]), 0x5a);
  // The same segments again, or past the end: refused.
  EXPECT_EQ((*second)->AdoptRun(run->first_segment + 1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*second)->AdoptRun(7, 2).status().code(), absl::StatusCode::kInvalidArgument);
  // A write through the successor reaches the predecessor's mapping (one memfd).
  adopted->memory.data()[0] = std::byte{0x11};
  EXPECT_EQ(static_cast<unsigned char>(run->memory.data()[0]), 0x11);
  EXPECT_EQ((*second)->Stats().used_bytes(), 2u << 20);
}

TEST(AdoptSessionsTest, IdsTokensAndQuotasComeBack) {
  SessionManagerOptions options{64 << 20, 64 << 20, 4};
  SessionManager first(options);
  absl::StatusOr<std::shared_ptr<Session>> a = first.Open("a", 0, 11);
  absl::StatusOr<std::shared_ptr<Session>> b = first.Open("b", 0, 12);
  ASSERT_TRUE(a.ok() && b.ok());
  (*a)->RecordStore(4096);
  v1::SessionState state;
  (*a)->ExportState(&state);

  SessionManager second(options);
  absl::StatusOr<std::shared_ptr<Session>> adopted = second.Adopt(state);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ((*adopted)->id(), (*a)->id());
  EXPECT_TRUE(second.Authenticate((*a)->token()).ok());
  EXPECT_FALSE(second.Authenticate((*b)->token()).ok());
  v1::SessionStats stats;
  (*adopted)->FillStats(&stats);
  EXPECT_EQ(stats.bytes_stored(), 4096u);
  EXPECT_EQ(second.Adopt(state).status().code(), absl::StatusCode::kInvalidArgument);  // repeat
  v1::SessionState tokenless = state;
  tokenless.set_id(99);
  tokenless.clear_token();
  EXPECT_EQ(second.Adopt(tokenless).status().code(), absl::StatusCode::kInvalidArgument);
  second.AdvanceNextId(first.next_id());
  absl::StatusOr<std::shared_ptr<Session>> fresh = second.Open("c", 0, 13);
  ASSERT_TRUE(fresh.ok());
  EXPECT_GT((*fresh)->id(), (*b)->id());

  // A lease adopted on a pool run holds the session's quota again.
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(PoolOptions());
  ASSERT_TRUE(pool.ok());
  LeaseManager leases(pool->get(), nullptr);
  v1::LeaseState lease;
  lease.set_id(5);
  lease.set_session_id((*adopted)->id());
  lease.set_first_segment(2);
  lease.set_count(3);
  absl::StatusOr<SegmentRun> run = (*pool)->AdoptRun(2, 3);
  ASSERT_TRUE(run.ok());
  ASSERT_TRUE(leases.Adopt(*adopted, lease, &*run).ok());
  EXPECT_EQ((*adopted)->used_bytes(), 3u << 20);
  ASSERT_EQ(leases.Export().size(), 1u);
  EXPECT_EQ(leases.Export()[0].first_segment(), 2u);
  EXPECT_GT(leases.next_id(), 5u);
  v1::LeaseState device_tier = lease;
  device_tier.set_id(tiered_id::Make(1, 9));
  absl::StatusOr<SegmentRun> other = (*pool)->AdoptRun(6, 1);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(leases.Adopt(*adopted, device_tier, &*other).code(),
            absl::StatusCode::kInvalidArgument);
  leases.StopRenewing();
  ASSERT_EQ(leases.ReleaseSession((*adopted)->id()).objects, 1u);
  EXPECT_EQ((*adopted)->used_bytes(), 0u);
}

// After a restart the client names the leases it holds: the carried ones it
// does not name go back; those it named, those of other sessions and those
// granted since are not touched, then or at a later confirmation.
TEST(AdoptSessionsTest, CarriedLeasesTheClientDoesNotNameGoBack) {
  SessionManager sessions(SessionManagerOptions{64 << 20, 64 << 20, 4});
  absl::StatusOr<std::shared_ptr<Session>> a = sessions.Open("a", 0, 11);
  absl::StatusOr<std::shared_ptr<Session>> b = sessions.Open("b", 0, 12);
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(PoolOptions());
  ASSERT_TRUE(pool.ok());
  LeaseManager leases(pool->get(), nullptr);
  auto adopt = [&](const std::shared_ptr<Session>& session, uint64_t id, uint32_t segment) {
    v1::LeaseState lease;
    lease.set_id(id);
    lease.set_session_id(session->id());
    lease.set_first_segment(segment);
    lease.set_count(1);
    absl::StatusOr<SegmentRun> run = (*pool)->AdoptRun(segment, 1);
    ASSERT_TRUE(run.ok());
    ASSERT_TRUE(leases.Adopt(session, lease, &*run).ok());
  };
  adopt(*a, 5, 0);
  adopt(*a, 7, 1);
  adopt(*b, 9, 2);
  absl::StatusOr<std::vector<std::shared_ptr<Lease>>> granted = leases.Grant(*a, 1, 1);
  ASSERT_TRUE(granted.ok()) << granted.status();
  const uint64_t fresh = (*granted)[0]->id();
  granted->clear();

  const RemovedTotals released = leases.ReleaseUnclaimed((*a)->id(), {5, 12345});
  EXPECT_EQ(released.objects, 1u);
  EXPECT_EQ(released.bytes, 1u << 20);
  EXPECT_TRUE(leases.Find((*a)->id(), 5).ok());
  EXPECT_EQ(leases.Find((*a)->id(), 7).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(leases.Find((*a)->id(), fresh).ok());
  EXPECT_TRUE(leases.Find((*b)->id(), 9).ok());
  EXPECT_EQ((*a)->used_bytes(), 2u << 20);
  EXPECT_EQ(leases.ReleaseUnclaimed((*a)->id(), {}).objects, 0u);  // 5 is a's now
  EXPECT_EQ(leases.ReleaseUnclaimed((*b)->id(), {}).objects, 1u);
  leases.StopRenewing();
  EXPECT_EQ(leases.ReleaseSession((*a)->id()).objects, 2u);
}

}  // namespace
}  // namespace actstash::server
