// Unit tests of Session (quota accounting), QuotaReservation and
// SessionManager (open, authenticate, close, list).
#include "server/sessions/session_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "server/sessions/session.h"

namespace actstash::server {
namespace {

SessionManagerOptions Options(uint64_t default_quota, uint64_t max_quota,
                              size_t max_sessions = 1024) {
  SessionManagerOptions options;
  options.default_quota_bytes = default_quota;
  options.max_quota_bytes = max_quota;
  options.max_sessions = max_sessions;
  return options;
}

bool IsLowerHex(const std::string& s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// --- Session and QuotaReservation -------------------------------------------

TEST(SessionTest, ReserveWithinQuotaAccumulatesAndReleases) {
  SessionManager manager(Options(1000, 1000));
  auto session = manager.Open("trainer", 0, 42);
  ASSERT_TRUE(session.ok()) << session.status();
  std::shared_ptr<Session> s = *session;
  EXPECT_EQ(s->used_bytes(), 0u);

  auto a = s->Reserve(300);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes(), 300u);
  EXPECT_EQ(s->used_bytes(), 300u);

  auto b = s->Reserve(700);  // exactly fills the quota
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(s->used_bytes(), 1000u);

  auto zero = s->Reserve(0);  // nothing left, but 0 always fits
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(zero->bytes(), 0u);

  a->Reset();
  EXPECT_EQ(a->bytes(), 0u);
  EXPECT_EQ(s->used_bytes(), 700u);
  a->Reset();  // a second Reset gives nothing back twice
  EXPECT_EQ(s->used_bytes(), 700u);

  *b = QuotaReservation();  // assigning over a reservation releases it
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST(SessionTest, ReserveBeyondQuotaIsResourceExhaustedWithNumbers) {
  SessionManager manager(Options(1000, 1000));
  std::shared_ptr<Session> s = *manager.Open("trainer", 0, 1);
  auto held = s->Reserve(600);
  ASSERT_TRUE(held.ok()) << held.status();

  auto too_much = s->Reserve(401);
  ASSERT_FALSE(too_much.ok());
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(too_much.status().message());
  EXPECT_NE(message.find("401"), std::string::npos) << message;  // requested
  EXPECT_NE(message.find("400"), std::string::npos) << message;  // available
  // A refused reservation changes nothing.
  EXPECT_EQ(s->used_bytes(), 600u);

  auto huge = s->Reserve(UINT64_MAX);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(huge.status().message()).find("18446744073709551615"), std::string::npos)
      << huge.status();
  EXPECT_EQ(s->used_bytes(), 600u);

  auto rest = s->Reserve(400);
  EXPECT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(s->used_bytes(), 1000u);
}

TEST(SessionTest, ReservationMoveTransfersOwnership) {
  SessionManager manager(Options(1000, 1000));
  std::shared_ptr<Session> s = *manager.Open("trainer", 0, 1);

  QuotaReservation empty;
  EXPECT_EQ(empty.bytes(), 0u);
  empty.Reset();  // no-op

  QuotaReservation a = *s->Reserve(100);
  QuotaReservation b(std::move(a));
  EXPECT_EQ(a.bytes(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(b.bytes(), 100u);
  EXPECT_EQ(s->used_bytes(), 100u);
  a.Reset();  // the moved-from one gives nothing back
  EXPECT_EQ(s->used_bytes(), 100u);

  QuotaReservation c = *s->Reserve(200);
  EXPECT_EQ(s->used_bytes(), 300u);
  c = std::move(b);  // c's 200 go back, c now holds b's 100
  EXPECT_EQ(c.bytes(), 100u);
  EXPECT_EQ(b.bytes(), 0u);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(s->used_bytes(), 100u);

  QuotaReservation& alias = c;
  c = std::move(alias);  // self-move keeps the reservation
  EXPECT_EQ(c.bytes(), 100u);
  EXPECT_EQ(s->used_bytes(), 100u);

  {
    std::vector<QuotaReservation> many;
    for (int i = 0; i < 9; ++i) many.push_back(*s->Reserve(100));  // vector growth moves
    EXPECT_EQ(s->used_bytes(), 1000u);
  }
  EXPECT_EQ(s->used_bytes(), 100u);
}

TEST(SessionTest, ReservationKeepsSessionAliveAfterManagerAndCloseAreGone) {
  QuotaReservation reservation;
  std::weak_ptr<Session> weak;
  {
    SessionManager manager(Options(1000, 1000));
    std::shared_ptr<Session> s = *manager.Open("trainer", 0, 1);
    weak = s;
    reservation = *s->Reserve(250);
    ASSERT_EQ(manager.Close(s->id()), s);
    EXPECT_TRUE(s->closed());
    EXPECT_EQ(s->used_bytes(), 250u);
  }
  // Manager and every other reference are gone; the reservation still holds
  // the session.
  std::shared_ptr<Session> s = weak.lock();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->used_bytes(), 250u);
  s.reset();
  reservation.Reset();
  EXPECT_TRUE(weak.expired());
}

TEST(SessionTest, StatsReflectIdentityCountersAndTheClientsReport) {
  SessionManager manager(Options(1000, 5000));
  const int64_t before = NowUnixMs();
  std::shared_ptr<Session> s = *manager.Open("rank-3", 2000, 4242);
  const int64_t after = NowUnixMs();
  auto held = s->Reserve(123);
  ASSERT_TRUE(held.ok());
  s->RecordStore(100);
  s->RecordStore(50);
  s->RecordFetch(70);
  v1::ClientUsage usage;
  usage.set_objects(7);
  usage.set_restores_ahead(3);
  s->RecordClientUsage(usage);

  v1::SessionStats stats;
  s->FillStats(&stats);
  EXPECT_EQ(stats.session_id(), s->id());
  EXPECT_EQ(stats.client_name(), "rank-3");
  EXPECT_EQ(stats.client_pid(), 4242u);
  EXPECT_EQ(stats.quota_bytes(), 2000u);
  EXPECT_EQ(stats.used_bytes(), 123u);
  EXPECT_EQ(stats.bytes_stored(), 150u);
  EXPECT_EQ(stats.puts(), 2u);
  EXPECT_EQ(stats.bytes_fetched(), 70u);
  EXPECT_EQ(stats.gets(), 1u);
  EXPECT_GE(stats.opened_unix_ms(), before);
  EXPECT_LE(stats.opened_unix_ms(), after);
  EXPECT_EQ(stats.client().objects(), 7u) << "the report is kept as sent";
  EXPECT_EQ(stats.client().restores_ahead(), 3u);
  EXPECT_FALSE(stats.has_spill()) << "the spill tier's part is not the session's";
}

// 8 threads reserve and release random amounts against one session. The sum
// of what they hold must never exceed the quota, the session must report no
// more than its quota, and everything must come back at the end.
TEST(SessionTest, ConcurrentReserveReleaseNeverExceedsQuota) {
  constexpr uint64_t kQuota = 256 << 10;
  constexpr int kThreads = 8;
  constexpr int kIterations = 4000;
  SessionManager manager(Options(kQuota, kQuota));
  std::shared_ptr<Session> s = *manager.Open("trainer", 0, 1);

  std::atomic<uint64_t> held_total{0};
  std::atomic<uint64_t> max_seen{0};
  std::atomic<int> refused{0};
  std::atomic<int> granted{0};
  std::atomic<bool> violation{false};
  auto note_max = [&](uint64_t value) {
    uint64_t prev = max_seen.load();
    while (value > prev && !max_seen.compare_exchange_weak(prev, value)) {
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + t);
      std::uniform_int_distribution<uint64_t> size(0, 64 << 10);
      std::vector<QuotaReservation> mine;
      for (int i = 0; i < kIterations; ++i) {
        if (mine.size() < 8 && (rng() % 3 != 0 || mine.empty())) {
          const uint64_t bytes = size(rng);
          absl::StatusOr<QuotaReservation> r = s->Reserve(bytes);
          if (r.ok()) {
            if (r->bytes() != bytes) violation = true;
            const uint64_t total = held_total.fetch_add(bytes) + bytes;
            note_max(total);
            if (total > kQuota) violation = true;
            mine.push_back(*std::move(r));
            ++granted;
          } else {
            if (r.status().code() != absl::StatusCode::kResourceExhausted) violation = true;
            ++refused;
          }
        } else {
          const size_t victim = rng() % mine.size();
          const uint64_t bytes = mine[victim].bytes();
          // Count it as released before the session sees it released, so
          // held_total never under-counts what the session has granted.
          std::swap(mine[victim], mine.back());
          held_total.fetch_sub(bytes);
          mine.pop_back();
        }
        const uint64_t used = s->used_bytes();
        note_max(used);
        if (used > kQuota) violation = true;
      }
      for (QuotaReservation& r : mine) {
        held_total.fetch_sub(r.bytes());
        r.Reset();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  EXPECT_FALSE(violation.load());
  EXPECT_LE(max_seen.load(), kQuota);
  EXPECT_GT(granted.load(), 0);
  // Demand (each thread holds up to 8 reservations of 32 KiB on average)
  // exceeds the quota even for one thread alone, so the limit must have been
  // hit.
  EXPECT_GT(refused.load(), 0);
  EXPECT_EQ(held_total.load(), 0u);
  EXPECT_EQ(s->used_bytes(), 0u);
}

// --- SessionManager ---------------------------------------------------------

TEST(SessionManagerTest, ZeroRequestGetsDefaultQuota) {
  SessionManager manager(Options(/*default_quota=*/100, /*max_quota=*/1000));
  auto s = manager.Open("a", 0, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->quota_bytes(), 100u);
}

TEST(SessionManagerTest, DefaultQuotaIsCappedAtMax) {
  SessionManager manager(Options(/*default_quota=*/5000, /*max_quota=*/1000));
  auto s = manager.Open("a", 0, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->quota_bytes(), 1000u);
}

TEST(SessionManagerTest, RequestedQuotaIsCappedAtMax) {
  SessionManager manager(Options(100, 1000));
  EXPECT_EQ((*manager.Open("below", 500, 1))->quota_bytes(), 500u);
  EXPECT_EQ((*manager.Open("exact", 1000, 1))->quota_bytes(), 1000u);
  EXPECT_EQ((*manager.Open("above", 5000, 1))->quota_bytes(), 1000u);
  EXPECT_EQ((*manager.Open("huge", UINT64_MAX, 1))->quota_bytes(), 1000u);
  EXPECT_EQ((*manager.Open("one", 1, 1))->quota_bytes(), 1u);
}

TEST(SessionManagerTest, KeepsNameAndPid) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> s = *manager.Open("rank-7", 0, 31337);
  EXPECT_EQ(s->name(), "rank-7");
  v1::SessionStats stats;
  s->FillStats(&stats);
  EXPECT_EQ(stats.client_pid(), 31337u);
  EXPECT_FALSE(s->closed());
}

TEST(SessionManagerTest, MaxSessionsIsResourceExhaustedUntilOneCloses) {
  SessionManager manager(Options(100, 1000, /*max_sessions=*/2));
  std::shared_ptr<Session> a = *manager.Open("a", 0, 1);
  std::shared_ptr<Session> b = *manager.Open("b", 0, 1);
  EXPECT_EQ(manager.size(), 2u);

  auto c = manager.Open("c", 0, 1);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(manager.size(), 2u);

  ASSERT_NE(manager.Close(a->id()), nullptr);
  auto d = manager.Open("d", 0, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(manager.size(), 2u);
}

// A daemon that exits once unused: it refuses only while no session is
// open, and after refusing opens none (the client starts another daemon).
TEST(SessionManagerTest, RefuseIfUnusedOnlyWhenEmptyAndThenForGood) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> a = *manager.Open("a", 0, 1);
  EXPECT_FALSE(manager.RefuseIfUnused());
  ASSERT_TRUE(manager.Open("b", 0, 1).ok());
  manager.Close(a->id());
  EXPECT_FALSE(manager.RefuseIfUnused());  // b is open
  for (const std::shared_ptr<Session>& s : manager.List()) manager.Close(s->id());
  EXPECT_TRUE(manager.RefuseIfUnused());
  auto late = manager.Open("late", 0, 1);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(late.status().message()), ::testing::HasSubstr("shutting down"));
  EXPECT_EQ(manager.size(), 0u);
  EXPECT_TRUE(manager.RefuseIfUnused());
}

TEST(SessionManagerTest, OverlongNameIsInvalidArgument) {
  SessionManager manager(Options(100, 1000));
  const std::string longest(kMaxClientNameBytes, 'n');
  auto ok = manager.Open(longest, 0, 1);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->name(), longest);

  auto bad = manager.Open(std::string(kMaxClientNameBytes + 1, 'n'), 0, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager.size(), 1u);

  auto empty = manager.Open("", 0, 1);  // an empty name is allowed
  EXPECT_TRUE(empty.ok()) << empty.status();
}

TEST(SessionManagerTest, TokensAre32HexCharsAndUnique) {
  SessionManager manager(Options(100, 1000));
  std::set<std::string> tokens;
  std::set<uint64_t> ids;
  constexpr int kSessions = 500;
  for (int i = 0; i < kSessions; ++i) {
    std::shared_ptr<Session> s = *manager.Open(absl::StrCat("s", i), 0, 1);
    EXPECT_EQ(s->token().size(), 32u) << s->token();
    EXPECT_TRUE(IsLowerHex(s->token())) << s->token();
    tokens.insert(s->token());
    ids.insert(s->id());
  }
  EXPECT_EQ(tokens.size(), static_cast<size_t>(kSessions));
  EXPECT_EQ(ids.size(), static_cast<size_t>(kSessions));
  EXPECT_EQ(ids.count(0), 0u);
}

TEST(SessionManagerTest, AuthenticateFindsTheSessionOfItsToken) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> a = *manager.Open("a", 0, 1);
  std::shared_ptr<Session> b = *manager.Open("b", 0, 2);
  auto found_a = manager.Authenticate(a->token());
  auto found_b = manager.Authenticate(b->token());
  ASSERT_TRUE(found_a.ok()) << found_a.status();
  ASSERT_TRUE(found_b.ok()) << found_b.status();
  EXPECT_EQ(*found_a, a);
  EXPECT_EQ(*found_b, b);
}

TEST(SessionManagerTest, AuthenticateRejectsEmptyAndUnknownWithoutEchoingToken) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> a = *manager.Open("a", 0, 1);

  auto empty = manager.Authenticate("");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kUnauthenticated);

  const std::string unknown = "0123456789abcdef0123456789abcdef";
  ASSERT_NE(unknown, a->token());
  auto bad = manager.Authenticate(unknown);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(std::string(bad.status().message()).find(unknown), std::string::npos) << bad.status();

  // A token differing from a real one in its last character is just as unknown.
  std::string near = a->token();
  near.back() = near.back() == '0' ? '1' : '0';
  auto near_status = manager.Authenticate(near);
  ASSERT_FALSE(near_status.ok());
  EXPECT_EQ(near_status.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(std::string(near_status.status().message()).find(near), std::string::npos);

  // A prefix of a real token is not that token.
  auto prefix = manager.Authenticate(a->token().substr(0, 16));
  EXPECT_EQ(prefix.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(SessionManagerTest, CloseStopsTokenAndMarksClosed) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> a = *manager.Open("a", 0, 1);
  std::shared_ptr<Session> b = *manager.Open("b", 0, 1);
  const std::string token = a->token();

  std::shared_ptr<Session> closed = manager.Close(a->id());
  ASSERT_EQ(closed, a);
  EXPECT_TRUE(a->closed());
  EXPECT_FALSE(b->closed());
  EXPECT_EQ(manager.size(), 1u);

  auto auth = manager.Authenticate(token);
  ASSERT_FALSE(auth.ok());
  EXPECT_EQ(auth.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(std::string(auth.status().message()).find(token), std::string::npos);
  EXPECT_TRUE(manager.Authenticate(b->token()).ok());

  EXPECT_EQ(manager.Close(a->id()), nullptr);  // not open any more
  EXPECT_EQ(manager.Close(987654), nullptr);   // never opened
  EXPECT_EQ(manager.size(), 1u);
}

TEST(SessionManagerTest, ReserveAfterCloseIsFailedPrecondition) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> s = *manager.Open("a", 0, 1);
  ASSERT_NE(manager.Close(s->id()), nullptr);
  auto r = s->Reserve(10);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  auto zero = s->Reserve(0);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST(SessionManagerTest, ReservationOutlivingCloseStillReleases) {
  SessionManager manager(Options(100, 1000));
  std::shared_ptr<Session> s = *manager.Open("a", 0, 1);
  QuotaReservation r = *s->Reserve(60);
  ASSERT_NE(manager.Close(s->id()), nullptr);
  EXPECT_EQ(s->used_bytes(), 60u);
  r.Reset();
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST(SessionManagerTest, ListIsSortedByIdAndOmitsClosed) {
  SessionManager manager(Options(100, 1000));
  std::vector<uint64_t> open_ids;
  for (int i = 0; i < 20; ++i) {
    std::shared_ptr<Session> s = *manager.Open(absl::StrCat("s", i), 0, 1);
    open_ids.push_back(s->id());
  }
  // Close every third one.
  std::vector<uint64_t> expected;
  for (size_t i = 0; i < open_ids.size(); ++i) {
    if (i % 3 == 0) {
      ASSERT_NE(manager.Close(open_ids[i]), nullptr);
    } else {
      expected.push_back(open_ids[i]);
    }
  }
  std::sort(expected.begin(), expected.end());

  std::vector<std::shared_ptr<Session>> listed = manager.List();
  std::vector<uint64_t> ids;
  for (const auto& s : listed) {
    ids.push_back(s->id());
    EXPECT_FALSE(s->closed());
  }
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(manager.size(), expected.size());
  EXPECT_TRUE(SessionManager(Options(1, 1)).List().empty());
}

TEST(SessionManagerTest, ConcurrentOpenRespectsMaxSessions) {
  constexpr size_t kMax = 50;
  SessionManager manager(Options(100, 1000, kMax));
  std::atomic<int> opened{0};
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        auto s = manager.Open("x", 0, 1);
        if (s.ok()) {
          ++opened;
        } else if (s.status().code() == absl::StatusCode::kResourceExhausted) {
          ++refused;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(opened.load(), static_cast<int>(kMax));
  EXPECT_EQ(refused.load(), 8 * 20 - static_cast<int>(kMax));
  EXPECT_EQ(manager.size(), kMax);
  std::set<std::string> tokens;
  for (const auto& s : manager.List()) tokens.insert(s->token());
  EXPECT_EQ(tokens.size(), kMax);
}

}  // namespace
}  // namespace actstash::server
