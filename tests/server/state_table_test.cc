// The state table a restart after a crash reads (server/restart/
// state_table.h), driven through the managers that write it: what a killed
// daemon recorded comes back, a slot written halfway reads as free, damage
// and other configurations are refused, and the service manager's
// protocols (server/restart/service_manager.h) carry names and fds.
#include "server/restart/state_table.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "server/pool/host_pool.h"
#include "server/restart/crash_recovery.h"
#include "server/restart/service_manager.h"
#include "server/sessions/lease_manager.h"
#include "server/sessions/session_manager.h"
#include "testing/fd_store.h"

namespace actstash::server {
namespace {

using ::testing::HasSubstr;

constexpr TableGeometry kGeometry{1 << 20, 8, 4};

UniqueFd Dup(int fd) { return UniqueFd(fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

v1::SessionState SessionOf(uint64_t id) {
  v1::SessionState session;
  session.set_id(id);
  session.set_token("0123456789abcdef0123456789abcdef");
  return session;
}

v1::LeaseState LeaseOf(uint64_t id, uint64_t session, uint32_t first, uint32_t count) {
  v1::LeaseState lease;
  lease.set_id(id);
  lease.set_session_id(session);
  lease.set_first_segment(first);
  lease.set_count(count);
  return lease;
}

// Flips the lowest bit of byte `index` of the record `body` where the
// table holds it (damage from outside).
void DamageRecord(const StateTable& table, const TableGeometry& geometry, const std::string& body,
                  size_t index) {
  std::string bytes(StateTableBytes(geometry), '\0');
  ASSERT_EQ(pread(table.fd(), bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  const size_t at = bytes.find(body);
  ASSERT_NE(at, std::string::npos);
  const char flipped = static_cast<char>(bytes[at + index] ^ 1);
  ASSERT_EQ(pwrite(table.fd(), &flipped, 1, static_cast<off_t>(at + index)), 1);
}

absl::StatusOr<std::unique_ptr<StateTable>> Reopen(const StateTable& table, RecoveredState* out,
                                                   const TableGeometry& geometry = kGeometry) {
  return StateTable::Recover(Dup(table.fd()), geometry, out);
}

TEST(StateTableTest, WhatTheManagersRecordedComesBack) {
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kGeometry);
  ASSERT_TRUE(table.ok()) << table.status();
  HostPoolOptions options;
  options.pool_bytes = 8 << 20;
  options.segment_bytes = 1 << 20;
  options.mlock = Tristate::kOff;
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  SessionManager sessions(SessionManagerOptions{64 << 20, 64 << 20, 4}, table->get());
  LeaseManager leases(pool->get(), nullptr, 0, table->get());
  auto a = sessions.Open("a", 0, 11);
  auto b = sessions.Open("b", 0, 12);
  ASSERT_TRUE(a.ok() && b.ok());
  auto granted_a = leases.Grant(*a, 2, 1);
  auto granted_b = leases.Grant(*b, 1, 2);
  ASSERT_TRUE(granted_a.ok() && granted_b.ok());
  // A returned lease is released (and, renewed here at once, clean again);
  // a closed session is gone.
  ASSERT_TRUE(leases.Return((*a)->id(), {(*granted_a)[1]->id()}).ok());
  const uint32_t returned_segment = (*granted_a)[1]->first_segment();
  granted_a->pop_back();
  auto c = sessions.Open("c", 0, 13);
  ASSERT_TRUE(c.ok());
  sessions.Close((*c)->id());

  RecoveredState state;
  absl::StatusOr<std::unique_ptr<StateTable>> back = Reopen(**table, &state);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(state.sessions.size(), 2u);
  EXPECT_EQ(state.sessions[0].id() + state.sessions[1].id(), (*a)->id() + (*b)->id());
  for (const v1::SessionState& s : state.sessions) {
    EXPECT_EQ(s.token(), s.id() == (*a)->id() ? (*a)->token() : (*b)->token());
    EXPECT_EQ(s.name(), s.id() == (*a)->id() ? "a" : "b");
  }
  ASSERT_EQ(state.leases.size(), 2u);
  EXPECT_EQ(state.leases[0].id(), (*granted_a)[0]->id());
  EXPECT_EQ(state.leases[0].count(), 1u);
  EXPECT_EQ(state.leases[1].id(), (*granted_b)[0]->id());
  EXPECT_EQ(state.leases[1].count(), 2u);
  EXPECT_EQ(state.leases[1].session_id(), (*b)->id());
  // Nothing is clean or kept until stored (a new table vouches for no
  // segment); the returned one was renewed, which stores it.
  EXPECT_FALSE(state.clean[(*granted_a)[0]->first_segment()]);
  EXPECT_FALSE(state.kept[(*granted_a)[0]->first_segment()]);
  EXPECT_TRUE(state.clean[returned_segment]);
  EXPECT_TRUE(state.kept[returned_segment]);
  // A segment kept, then leased: kept but not clean.
  (*back)->SegmentsRenewed(7, 1);
  (*back)->LeaseGranted(LeaseOf((*granted_b)[0]->id() + 1, (*b)->id(), 7, 1));
  // Ids after a restart stay above every id given.
  EXPECT_GT(state.next_session_id, (*c)->id());
  EXPECT_GT(state.next_lease_id, (*granted_b)[0]->id());
  EXPECT_EQ(state.restarts, 0u);
  RecoveredState again;
  ASSERT_TRUE(Reopen(**back, &again).ok());
  EXPECT_EQ(again.restarts, 1u);
  EXPECT_TRUE(again.kept[7]);
  EXPECT_FALSE(again.clean[7]);
  EXPECT_EQ(again.leases.size(), 3u);
}

// A lease over memory that held inline objects is scrubbed (fresh memfds)
// before its fds leave the daemon. The table records it only once the
// journal holds the fresh memory: a crash between grant and scrub leaves no
// lease whose kept memfds are gone. One given back before its scrub is not
// recorded by it.
TEST(StateTableTest, ALeaseThatNeedsScrubbingIsRecordedOnlyOnceScrubbed) {
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kGeometry);
  ASSERT_TRUE(table.ok()) << table.status();
  HostPoolOptions options;
  options.pool_bytes = 8 << 20;
  options.segment_bytes = 1 << 20;
  options.mlock = Tristate::kOff;
  absl::StatusOr<std::unique_ptr<HostPool>> pool = CreateHostPool(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<Allocation> object = (*pool)->Allocate(1000);  // an inline object
  ASSERT_TRUE(object.ok());
  object->Reset();
  SessionManager sessions(SessionManagerOptions{64 << 20, 64 << 20, 4}, table->get());
  LeaseManager leases(pool->get(), nullptr, 0, table->get());
  auto a = sessions.Open("a", 0, 11);
  ASSERT_TRUE(a.ok());
  auto granted = leases.Grant(*a, 8, 1);  // the whole pool: one lease needs scrubbing
  ASSERT_TRUE(granted.ok()) << granted.status();
  std::vector<std::shared_ptr<Lease>> dirty;
  for (const auto& lease : *granted) {
    if (lease->needs_scrub()) dirty.push_back(lease);
  }
  ASSERT_EQ(dirty.size(), 1u);
  auto recorded = [&](uint64_t id) {
    RecoveredState state;
    EXPECT_TRUE(Reopen(**table, &state).ok());
    for (const v1::LeaseState& lease : state.leases) {
      if (lease.id() == id) return true;
    }
    return false;
  };
  EXPECT_TRUE(recorded((*granted)[0] == dirty[0] ? (*granted)[1]->id() : (*granted)[0]->id()));
  EXPECT_FALSE(recorded(dirty[0]->id()));
  ASSERT_TRUE(leases.Scrub(*dirty[0]).ok());
  EXPECT_TRUE(recorded(dirty[0]->id()));

  // Given back between grant and scrub: the scrub records nothing. (A lease
  // given back and no longer held goes back to the pool: room for another
  // inline object, whose segment the next grant must scrub.)
  auto b = sessions.Open("b", 0, 12);
  ASSERT_TRUE(b.ok());
  const uint64_t returned = dirty[0]->id();
  dirty.clear();
  ASSERT_TRUE(leases.Return((*a)->id(), {returned}).ok());
  granted->erase(std::remove_if(granted->begin(), granted->end(),
                                [&](const auto& lease) { return lease->id() == returned; }),
                 granted->end());
  absl::StatusOr<Allocation> another = (*pool)->Allocate(1000);
  ASSERT_TRUE(another.ok());
  another->Reset();
  auto again = leases.Grant(*b, 1, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)[0]->needs_scrub());
  const std::shared_ptr<Lease> kept = (*again)[0];
  ASSERT_TRUE(leases.Return((*b)->id(), {kept->id()}).ok());
  ASSERT_TRUE(leases.Scrub(*kept).ok());
  EXPECT_FALSE(recorded(kept->id()));
}

TEST(StateTableTest, ALeaseOfASessionThatWasClosingIsDropped) {
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kGeometry);
  ASSERT_TRUE(table.ok());
  (*table)->SessionOpened(SessionOf(5));
  (*table)->LeaseGranted(LeaseOf(9, 5, 2, 2));
  // Closing records the session first, its leases after: killed between.
  (*table)->SessionClosed(5);
  RecoveredState state;
  absl::StatusOr<std::unique_ptr<StateTable>> back = Reopen(**table, &state);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(state.sessions.empty());
  EXPECT_TRUE(state.leases.empty());
  EXPECT_FALSE(state.clean[2]);
  RecoveredState again;  // and the table no longer holds it
  ASSERT_TRUE(Reopen(**back, &again).ok());
  EXPECT_TRUE(again.leases.empty());
}

v1::SpillFileState SpillOf(uint64_t id, uint64_t session, uint64_t bytes) {
  v1::SpillFileState file;
  file.set_id(id);
  file.set_session_id(session);
  file.set_bytes(bytes);
  file.set_checksum(id * 0x9e3779b97f4a7c15ull);
  return file;
}

TEST(StateTableTest, SpillFilesComeBackAndTheirIdsAreNotGivenAgain) {
  constexpr TableGeometry kSpills{1 << 20, 8, 4, /*spill_slots=*/3};
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kSpills);
  ASSERT_TRUE(table.ok()) << table.status();
  for (uint64_t id : {1, 2}) {
    v1::SessionState session = SessionOf(id);
    session.set_token(absl::StrCat(session.token(), id));
    (*table)->SessionOpened(session);
  }
  (*table)->SpillFileKept(SpillOf(5, 1, 4 << 20), -1);
  (*table)->SpillFileKept(SpillOf(6, 2, 8 << 20), -1);
  (*table)->SpillFileKept(SpillOf(7, 1, 4 << 20), -1);
  (*table)->SpillFileKept(SpillOf(8, 1, 4 << 20), -1);  // no slot left: not recorded
  (*table)->SpillFileGone(6);
  (*table)->SpillFileKept(SpillOf(9, 3, 4 << 20), -1);  // its session's slot is gone
  RecoveredState state;
  absl::StatusOr<std::unique_ptr<StateTable>> back = Reopen(**table, &state, kSpills);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(state.spill_files.size(), 2u);
  absl::flat_hash_map<uint64_t, v1::SpillFileState> by_id;
  for (const v1::SpillFileState& file : state.spill_files) by_id[file.id()] = file;
  ASSERT_TRUE(by_id.contains(5) && by_id.contains(7));
  EXPECT_EQ(by_id[7].session_id(), 1u);
  EXPECT_EQ(by_id[7].bytes(), 4u << 20);
  EXPECT_EQ(by_id[7].checksum(), SpillOf(7, 1, 0).checksum());
  EXPECT_GT(state.next_spill_id, 9u) << "ids given before the crash are not given again";
  // The recovered table goes on: the slots of 9 (dropped) and 5 (gone)
  // take new files, and only what is recorded now comes back next time.
  (*back)->SpillFileGone(5);
  (*back)->SpillFileKept(SpillOf(20, 2, 4 << 20), -1);
  (*back)->SpillFileKept(SpillOf(21, 2, 4 << 20), -1);
  RecoveredState again;
  ASSERT_TRUE(Reopen(**back, &again, kSpills).ok());
  std::vector<uint64_t> ids;
  for (const v1::SpillFileState& file : again.spill_files) ids.push_back(file.id());
  EXPECT_THAT(ids, ::testing::UnorderedElementsAre(7, 20, 21));
  // Another number of spill slots is another configuration.
  TableGeometry other = kSpills;
  other.spill_slots = 0;
  RecoveredState ignored;
  EXPECT_EQ(Reopen(**back, &ignored, other).status().code(), absl::StatusCode::kFailedPrecondition);
  // A damaged slot is not trusted.
  DamageRecord(**back, kSpills, SpillOf(21, 2, 4 << 20).SerializeAsString(), 1);
  ASSERT_FALSE(HasFatalFailure());
  absl::Status damaged = Reopen(**back, &ignored, kSpills).status();
  EXPECT_EQ(damaged.code(), absl::StatusCode::kDataLoss) << damaged;
  EXPECT_THAT(damaged.message(), HasSubstr("spill file slot"));
}

v1::ObjectState ObjectOf(uint64_t handle, uint64_t session, bool spilled, uint64_t where) {
  v1::ObjectState object;
  object.set_handle(handle);
  object.set_session_id(session);
  object.set_dtype("bfloat16");
  for (int64_t dim : {4, 1024, 2048}) object.add_shape(dim);
  object.set_nbytes(16 << 20);
  object.set_checksum_algorithm(1);
  object.set_checksum(0x0123456789abcdef ^ handle);
  if (spilled) {
    object.set_spill_id(where);
  } else {
    object.set_pool_offset(where);
  }
  return object;
}

TEST(StateTableTest, ObjectsComeBackAsLastRecorded) {
  constexpr TableGeometry kObjects{1 << 20, 8, 4, 0, /*object_slots=*/4};
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kObjects);
  ASSERT_TRUE(table.ok()) << table.status();
  for (uint64_t id : {1, 2}) {
    v1::SessionState session = SessionOf(id);
    session.set_token(absl::StrCat(session.token(), id));
    (*table)->SessionOpened(session);
  }
  (*table)->ObjectStored(ObjectOf(10, 1, false, 0));
  (*table)->ObjectStored(ObjectOf(11, 2, true, 3));
  (*table)->ObjectStored(ObjectOf(12, 1, false, 1 << 20));
  (*table)->ObjectStored(ObjectOf(13, 1, false, 2 << 20));
  (*table)->ObjectStored(ObjectOf(14, 1, false, 3 << 20));  // no slot left: not recorded
  (*table)->ObjectGone(11);
  (*table)->ObjectStored(ObjectOf(12, 1, true, 7));   // spilled: its slot rewritten
  (*table)->ObjectStored(ObjectOf(15, 3, false, 0));  // its session's slot is gone
  RecoveredState state;
  absl::StatusOr<std::unique_ptr<StateTable>> back = Reopen(**table, &state, kObjects);
  ASSERT_TRUE(back.ok()) << back.status();
  absl::flat_hash_map<uint64_t, v1::ObjectState> by_handle;
  for (const v1::ObjectState& object : state.objects) by_handle[object.handle()] = object;
  ASSERT_EQ(by_handle.size(), 3u);
  ASSERT_TRUE(by_handle.contains(10) && by_handle.contains(12) && by_handle.contains(13));
  EXPECT_EQ(by_handle[12].SerializeAsString(), ObjectOf(12, 1, true, 7).SerializeAsString());
  EXPECT_EQ(by_handle[13].SerializeAsString(), ObjectOf(13, 1, false, 2 << 20).SerializeAsString());
  EXPECT_GT(state.next_object_handle, 15u) << "handles given before the crash are not given again";
  // The recovered table goes on recording: the dropped object's slot takes
  // a new one.
  (*back)->ObjectGone(10);
  (*back)->ObjectStored(ObjectOf(20, 2, false, 4 << 20));
  (*back)->ObjectStored(ObjectOf(21, 2, false, 5 << 20));
  (*back)->ObjectStored(ObjectOf(22, 2, false, 6 << 20));  // full again
  RecoveredState again;
  ASSERT_TRUE(Reopen(**back, &again, kObjects).ok());
  std::vector<uint64_t> handles;
  for (const v1::ObjectState& object : again.objects) handles.push_back(object.handle());
  EXPECT_THAT(handles, ::testing::UnorderedElementsAre(12, 13, 20, 21));
  // A damaged object slot is not trusted.
  DamageRecord(**back, kObjects, ObjectOf(21, 2, false, 5 << 20).SerializeAsString(), 4);
  ASSERT_FALSE(HasFatalFailure());
  RecoveredState ignored;
  absl::Status damaged = Reopen(**back, &ignored, kObjects).status();
  EXPECT_EQ(damaged.code(), absl::StatusCode::kDataLoss) << damaged;
  EXPECT_THAT(damaged.message(), HasSubstr("object slot"));
  // Another number of object slots is another configuration.
  TableGeometry other = kObjects;
  other.object_slots = 8;
  EXPECT_EQ(Reopen(**back, &ignored, other).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(StateTableTest, AnObjectWhoseNewRecordDoesNotFitIsNotLeftNamingItsOldPlace) {
  constexpr TableGeometry kObjects{1 << 20, 8, 4, 0, /*object_slots=*/4};
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kObjects);
  ASSERT_TRUE(table.ok()) << table.status();
  (*table)->SessionOpened(SessionOf(1));
  (*table)->ObjectStored(ObjectOf(7, 1, false, 0));
  (*table)->ObjectStored(ObjectOf(8, 1, false, 1 << 20));
  // Moved, with a record over a slot's 112 bytes (shape of 40 dimensions).
  v1::ObjectState moved = ObjectOf(7, 1, true, 5);
  for (int i = 0; i < 40; ++i) moved.add_shape(int64_t{1} << 30);
  ASSERT_GT(moved.ByteSizeLong(), kObjectSlotBytes);
  (*table)->ObjectStored(moved);
  RecoveredState state;
  ASSERT_TRUE(Reopen(**table, &state, kObjects).ok());
  ASSERT_EQ(state.objects.size(), 1u);
  EXPECT_EQ(state.objects[0].handle(), 8u);
}

TEST(StateTableTest, ARecoveryReadsOnlyTheObjectSlotsEverUsed) {
  // A million slots (128 MiB of memfd), three used: neither recording nor
  // recovering makes the kernel back the rest of the region with pages.
  constexpr TableGeometry kLarge{1 << 20, 8, 4, 0, /*object_slots=*/1 << 20};
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kLarge);
  ASSERT_TRUE(table.ok()) << table.status();
  (*table)->SessionOpened(SessionOf(1));
  for (uint64_t handle : {1, 2, 3})
    (*table)->ObjectStored(ObjectOf(handle, 1, false, handle << 20));
  RecoveredState state;
  absl::StatusOr<std::unique_ptr<StateTable>> back = Reopen(**table, &state, kLarge);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(state.objects.size(), 3u);
  struct stat st {};
  ASSERT_EQ(fstat((*back)->fd(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_size), kObjectSlotBytes << 20);
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, uint64_t{1} << 20)
      << "pages backed after a recovery";
}

// A take-over's successor records into a copy: the copy reads as the
// original does, the original stays as its daemon left it, and neither
// counts a restart.
TEST(StateTableTest, ACopyReadsAsTheOriginalAndLeavesItAlone) {
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kGeometry);
  ASSERT_TRUE(table.ok()) << table.status();
  (*table)->SessionOpened(SessionOf(5));
  (*table)->SegmentsRenewed(0, kGeometry.segments);
  (*table)->LeaseGranted(LeaseOf(7, 5, 2, 3));

  RecoveredState copied;
  absl::StatusOr<std::unique_ptr<StateTable>> copy =
      StateTable::Copy((*table)->fd(), kGeometry, &copied);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_NE((*copy)->fd(), (*table)->fd());
  ASSERT_EQ(copied.sessions.size(), 1u);
  EXPECT_EQ(copied.sessions[0].id(), 5u);
  ASSERT_EQ(copied.leases.size(), 1u);
  EXPECT_EQ(copied.leases[0].id(), 7u);
  EXPECT_TRUE(copied.kept[0] && copied.clean[0] && !copied.clean[2]);
  EXPECT_EQ(copied.restarts, 0u);

  // The copy's own records do not reach the original.
  (*copy)->LeaseReleased(7, 2);
  (*copy)->SessionClosed(5);
  (*copy)->SessionOpened(SessionOf(6));
  RecoveredState original;
  absl::StatusOr<std::unique_ptr<StateTable>> back = Reopen(**table, &original);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(original.sessions.size(), 1u);
  EXPECT_EQ(original.sessions[0].id(), 5u);
  EXPECT_EQ(original.leases.size(), 1u);
  EXPECT_EQ(original.restarts, 0u);  // the copy was not a restart
  RecoveredState from_copy;
  absl::StatusOr<std::unique_ptr<StateTable>> copy_back = Reopen(**copy, &from_copy);
  ASSERT_TRUE(copy_back.ok()) << copy_back.status();
  ASSERT_EQ(from_copy.sessions.size(), 1u);
  EXPECT_EQ(from_copy.sessions[0].id(), 6u);
  EXPECT_TRUE(from_copy.leases.empty());

  // Another configuration's table is not copied.
  TableGeometry other = kGeometry;
  other.session_slots = 64;
  RecoveredState ignored;
  EXPECT_EQ(StateTable::Copy((*table)->fd(), other, &ignored).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(StateTableTest, DamageIsDataLossAndOtherStatesArePreconditions) {
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kGeometry);
  ASSERT_TRUE(table.ok());
  (*table)->SessionOpened(SessionOf(5));
  const v1::LeaseState lease = LeaseOf(9, 5, 3, 1);
  (*table)->LeaseGranted(lease);
  RecoveredState state;
  ASSERT_TRUE(Reopen(**table, &state).ok());

  // Another configuration.
  TableGeometry other = kGeometry;
  other.segments = 16;
  absl::StatusOr<std::unique_ptr<StateTable>> wrong = Reopen(**table, &state, other);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("configuration changed"));

  // A byte of the lease's slot: the last slot region of the file.
  const size_t bytes = StateTableBytes(kGeometry);
  std::string file(bytes, '\0');
  ASSERT_EQ(pread((*table)->fd(), file.data(), bytes, 0), static_cast<ssize_t>(bytes));
  const size_t lease_body = file.rfind(lease.SerializeAsString());
  ASSERT_NE(lease_body, std::string::npos);
  const char flipped = static_cast<char>(file[lease_body] ^ 0x40);
  ASSERT_EQ(pwrite((*table)->fd(), &flipped, 1, lease_body), 1);
  absl::StatusOr<std::unique_ptr<StateTable>> damaged = Reopen(**table, &state);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss) << damaged.status();
  EXPECT_THAT(std::string(damaged.status().message()), HasSubstr("lease slot 3"));
  ASSERT_EQ(pwrite((*table)->fd(), &file[lease_body], 1, lease_body), 1);

  // The header's checksummed part.
  const char format = 9;
  ASSERT_EQ(pwrite((*table)->fd(), &format, 1, 8), 1);
  EXPECT_EQ(Reopen(**table, &state).status().code(), absl::StatusCode::kDataLoss);
  ASSERT_EQ(pwrite((*table)->fd(), &file[8], 1, 8), 1);
  ASSERT_TRUE(Reopen(**table, &state).ok());

  // A clean stop leaves nothing to recover.
  (*table)->Retire();
  absl::StatusOr<std::unique_ptr<StateTable>> retired = Reopen(**table, &state);
  EXPECT_EQ(retired.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(retired.status().message()), HasSubstr("shut down cleanly"));

  // Not a sealed memfd at all.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  close(pipe_fds[1]);
  EXPECT_EQ(StateTable::Recover(UniqueFd(pipe_fds[0]), kGeometry, &state).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(StateTableTest, ASlotWrittenHalfwayReadsAsFree) {
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(kGeometry);
  ASSERT_TRUE(table.ok());
  (*table)->SessionOpened(SessionOf(5));
  // A body and checksum written into a free lease slot, its word not yet
  // stored (a process killed there): garbage that must not count.
  const size_t bytes = StateTableBytes(kGeometry);
  const size_t slot = bytes - 64 * kGeometry.segments / 2;  // within the lease slots
  const char junk[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  ASSERT_EQ(pwrite((*table)->fd(), junk, sizeof(junk), static_cast<off_t>(slot + 16)), 32);
  RecoveredState state;
  ASSERT_TRUE(Reopen(**table, &state).ok());
  EXPECT_EQ(state.sessions.size(), 1u);
  EXPECT_TRUE(state.leases.empty());
}

// A datagram socket bound to the abstract address `name` ("@..."); invalid
// when it cannot be made.
UniqueFd BindNotifySocket(const std::string& name) {
  UniqueFd server(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data() + 1, name.size() - 1);
  if (!server.valid() ||
      bind(server.get(), reinterpret_cast<sockaddr*>(&addr),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size())) != 0) {
    return UniqueFd();
  }
  return server;
}

TEST(ServiceManagerTest, NotificationsCarryTextAndFds) {
  const std::string name = "@actstash-test-notify-" + std::to_string(getpid());
  UniqueFd server_fd = BindNotifySocket(name);
  ASSERT_TRUE(server_fd.valid());
  const int server = server_fd.get();
  absl::StatusOr<std::unique_ptr<ServiceNotifier>> notifier = ServiceNotifier::ForAddress(name);
  ASSERT_TRUE(notifier.ok()) << notifier.status();
  ASSERT_TRUE((*notifier)->StoreFd("seg-3", server).ok());
  char text[256] = {};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  iovec iov{text, sizeof(text) - 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ASSERT_GT(recvmsg(server, &msg, MSG_CMSG_CLOEXEC), 0);
  EXPECT_STREQ(text, "FDSTORE=1\nFDNAME=seg-3");
  cmsghdr* rights = CMSG_FIRSTHDR(&msg);
  ASSERT_NE(rights, nullptr);
  EXPECT_EQ(rights->cmsg_type, SCM_RIGHTS);
  int received = -1;
  std::memcpy(&received, CMSG_DATA(rights), sizeof(received));
  close(received);

  EXPECT_EQ((*notifier)->StoreFd("a:b", server).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(IsValidFdName(""));
  EXPECT_FALSE(IsValidFdName(std::string(256, 'x')));
  EXPECT_TRUE(IsValidFdName("state"));
  EXPECT_EQ(ServiceNotifier::ForAddress("relative/path").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A barrier returns once the manager closed the fd that came with it,
// i.e. handled everything sent before; not while the manager does not read.
TEST(ServiceManagerTest, ABarrierWaitsUntilTheManagerHandledIt) {
  const std::string name = "@actstash-test-barrier-" + std::to_string(getpid());
  UniqueFd unread = BindNotifySocket(name);
  ASSERT_TRUE(unread.valid());
  absl::StatusOr<std::unique_ptr<ServiceNotifier>> notifier = ServiceNotifier::ForAddress(name);
  ASSERT_TRUE(notifier.ok()) << notifier.status();
  EXPECT_EQ((*notifier)->Barrier(std::chrono::milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);

  // A manager that reads (and closes the fds it does not keep).
  absl::StatusOr<std::unique_ptr<testing::FdStore>> store = testing::FdStore::Create();
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::unique_ptr<ServiceNotifier>> to_store =
      ServiceNotifier::ForAddress((*store)->address());
  ASSERT_TRUE(to_store.ok()) << to_store.status();
  ASSERT_TRUE((*to_store)->Notify("MAINPID=4242").ok());
  EXPECT_TRUE((*to_store)->Barrier(std::chrono::seconds(10)).ok());
}

TEST(ServiceManagerTest, PassedFdsAreTakenOnlyWhenMeantForThisProcess) {
  setenv("LISTEN_PID", "1", 1);  // another process's
  setenv("LISTEN_FDS", "2", 1);
  absl::StatusOr<std::vector<PassedFd>> other = TakePassedFds();
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(other->empty());
  EXPECT_EQ(std::getenv("LISTEN_FDS"), nullptr);  // unset either way

  setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
  setenv("LISTEN_FDS", "many", 1);
  EXPECT_EQ(TakePassedFds().status().code(), absl::StatusCode::kInvalidArgument);

  // Two fds at 3 and 4 (moved there if something else holds them).
  const int saved3 = fcntl(3, F_DUPFD_CLOEXEC, 100);
  const int saved4 = fcntl(4, F_DUPFD_CLOEXEC, 100);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const int high0 = fcntl(pipe_fds[0], F_DUPFD, 200);
  const int high1 = fcntl(pipe_fds[1], F_DUPFD, 200);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  ASSERT_EQ(dup2(high0, 3), 3);
  ASSERT_EQ(dup2(high1, 4), 4);
  close(high0);
  close(high1);
  setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
  setenv("LISTEN_FDS", "2", 1);
  setenv("LISTEN_FDNAMES", "state:seg-0", 1);
  absl::StatusOr<std::vector<PassedFd>> passed = TakePassedFds();
  ASSERT_TRUE(passed.ok()) << passed.status();
  ASSERT_EQ(passed->size(), 2u);
  EXPECT_EQ((*passed)[0].name, "state");
  EXPECT_EQ((*passed)[1].name, "seg-0");
  EXPECT_EQ((*passed)[0].fd.get(), 3);
  EXPECT_NE(fcntl(3, F_GETFD) & FD_CLOEXEC, 0);
  passed->clear();  // closes 3 and 4
  if (saved3 >= 0) dup2(saved3, 3), close(saved3);
  if (saved4 >= 0) dup2(saved4, 4), close(saved4);
}

// Spill file slots follow what the spill tier can hold (one per segment-sized
// file), not a fixed count: a 64 GiB pool with a 1 TiB tier of 16 MiB files
// keeps every one of them across a crash.
TEST(TableGeometryTest, SpillSlotsScaleWithTheSpillTier) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  EXPECT_EQ(TableGeometryFor(64 * kGiB, 16 << 20, 64, 0).spill_slots, 0u);  // no tier
  EXPECT_EQ(TableGeometryFor(kGiB, 64 << 20, 64, 8 * kGiB).spill_slots, kMinKeptSpillFiles);
  EXPECT_EQ(TableGeometryFor(64 * kGiB, 16 << 20, 64, 1024 * kGiB).spill_slots, 65536u);
  EXPECT_EQ(TableGeometryFor(64 * kGiB, 4 << 20, 64, 64 * 1024 * kGiB).spill_slots,
            kMaxKeptSpillFiles);
  // A table of that geometry can be made (its slots are holes until used).
  const TableGeometry big = TableGeometryFor(64 * kGiB, 16 << 20, 64, 1024 * kGiB);
  absl::StatusOr<std::unique_ptr<StateTable>> table = StateTable::Create(big);
  ASSERT_TRUE(table.ok()) << table.status();
}

}  // namespace
}  // namespace actstash::server
