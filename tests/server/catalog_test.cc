// Unit tests of Catalog over a real HostPool and real sessions.
#include "server/objects/catalog.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/pool/host_pool.h"
#include "server/pool/memory_pool.h"
#include "server/sessions/session.h"
#include "server/sessions/session_manager.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

class CatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostPoolOptions options;
    options.pool_bytes = 8 * kMiB;
    options.segment_bytes = 1 * kMiB;
    options.mlock = Tristate::kOff;
    auto pool = CreateHostPool(options);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);

    SessionManagerOptions session_options;
    session_options.default_quota_bytes = 4 * kMiB;
    session_options.max_quota_bytes = 4 * kMiB;
    sessions_ = std::make_unique<SessionManager>(session_options);
  }

  void TearDown() override {
    // Every object must be gone before the pool (its Allocations need it).
    catalog_.reset();
  }

  std::shared_ptr<Session> OpenSession(const std::string& name) {
    auto session = sessions_->Open(name, 0, 1);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *session : nullptr;
  }

  // An object of `nbytes` whose bytes are `fill`, holding quota of `session`
  // and memory of the pool.
  std::shared_ptr<StoredObject> MakeObject(Session& session, uint64_t nbytes, uint8_t fill,
                                           uint64_t put_id = 0) {
    absl::StatusOr<QuotaReservation> reservation = session.Reserve(nbytes);
    EXPECT_TRUE(reservation.ok()) << reservation.status();
    absl::StatusOr<Allocation> memory = pool_->Allocate(nbytes);
    EXPECT_TRUE(memory.ok()) << memory.status();
    if (!reservation.ok() || !memory.ok()) return nullptr;
    if (nbytes > 0) std::memset(memory->data(), fill, nbytes);
    ObjectMeta meta;
    meta.dtype = "float32";
    meta.shape = {static_cast<int64_t>(nbytes / 4)};
    meta.nbytes = nbytes;
    meta.checksum_algorithm = 1;
    meta.checksum = 0xabcdefu + fill;
    meta.put_id = put_id;
    return std::make_shared<StoredObject>(session.id(), std::move(meta), *std::move(memory),
                                          *std::move(reservation));
  }

  uint64_t Insert(Session& session, uint64_t nbytes, uint8_t fill) {
    absl::StatusOr<uint64_t> handle = catalog_->Insert(session, MakeObject(session, nbytes, fill));
    EXPECT_TRUE(handle.ok()) << handle.status();
    return handle.ok() ? *handle : 0;
  }

  uint64_t PoolUsed() const { return pool_->Stats().used_bytes(); }
  uint64_t PoolAllocations() const { return pool_->Stats().allocations(); }

  static bool AllBytesAre(const StoredObject& object, uint8_t fill) {
    const std::byte* data = object.data();
    for (uint64_t i = 0; i < object.meta().nbytes; ++i) {
      if (data[i] != static_cast<std::byte>(fill)) return false;
    }
    return true;
  }

  // Declared first so that it is destroyed last.
  std::unique_ptr<ObjectAllocator> pool_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<Catalog> catalog_ = std::make_unique<Catalog>();
};

TEST_F(CatalogTest, InsertThenLookupReturnsTheObject) {
  std::shared_ptr<Session> s = OpenSession("a");
  const uint64_t handle = Insert(*s, 4096, 0x5a);
  ASSERT_NE(handle, 0u);
  EXPECT_EQ(catalog_->size(), 1u);
  EXPECT_EQ(catalog_->SessionObjectCount(s->id()), 1u);
  EXPECT_EQ(s->used_bytes(), 4096u);
  EXPECT_GE(PoolUsed(), 4096u);

  auto found = catalog_->Lookup(s->id(), handle);
  ASSERT_TRUE(found.ok()) << found.status();
  const StoredObject& object = **found;
  EXPECT_EQ(object.session_id(), s->id());
  EXPECT_EQ(object.meta().nbytes, 4096u);
  EXPECT_EQ(object.meta().dtype, "float32");
  EXPECT_EQ(object.meta().shape, std::vector<int64_t>{1024});
  EXPECT_EQ(object.meta().checksum_algorithm, 1);
  EXPECT_EQ(object.meta().checksum, 0xabcdefu + 0x5a);
  EXPECT_TRUE(AllBytesAre(object, 0x5a));
}

TEST_F(CatalogTest, HandlesAreNonZeroAndUniqueAcrossSessions) {
  std::shared_ptr<Session> a = OpenSession("a");
  std::shared_ptr<Session> b = OpenSession("b");
  std::set<uint64_t> handles;
  for (int i = 0; i < 50; ++i) {
    handles.insert(Insert(*a, 256, 1));
    handles.insert(Insert(*b, 256, 2));
  }
  EXPECT_EQ(handles.size(), 100u);
  EXPECT_EQ(handles.count(0), 0u);
  EXPECT_EQ(catalog_->size(), 100u);
  EXPECT_EQ(catalog_->SessionObjectCount(a->id()), 50u);
  EXPECT_EQ(catalog_->SessionObjectCount(b->id()), 50u);
}

TEST_F(CatalogTest, HandlesAreNotReusedAfterRemoval) {
  std::shared_ptr<Session> s = OpenSession("a");
  std::set<uint64_t> issued;
  for (int round = 0; round < 5; ++round) {
    std::vector<uint64_t> batch;
    for (int i = 0; i < 10; ++i) {
      const uint64_t handle = Insert(*s, 1000, 3);
      EXPECT_TRUE(issued.insert(handle).second) << "handle " << handle << " reused";
      batch.push_back(handle);
    }
    ASSERT_TRUE(catalog_->Remove(s->id(), batch).ok());
  }
  catalog_->RemoveSession(s->id());
  const uint64_t later = Insert(*s, 1000, 3);
  EXPECT_EQ(issued.count(later), 0u);
}

TEST_F(CatalogTest, ForeignAndUnknownHandlesAreTheSameNotFound) {
  std::shared_ptr<Session> a = OpenSession("a");
  std::shared_ptr<Session> b = OpenSession("b");
  const uint64_t a_handle = Insert(*a, 512, 0xaa);

  auto foreign = catalog_->Lookup(b->id(), a_handle);
  auto unknown = catalog_->Lookup(b->id(), a_handle + 1000);
  auto zero = catalog_->Lookup(a->id(), 0);
  auto no_session = catalog_->Lookup(/*session_id=*/999, a_handle);
  ASSERT_FALSE(foreign.ok());
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(no_session.status().code(), absl::StatusCode::kNotFound);
  // The owner's name never appears in the answer to someone else.
  EXPECT_EQ(std::string(foreign.status().message()).find(absl::StrCat("session ", a->id())),
            std::string::npos);

  // Removing someone else's object is refused the same way and removes nothing.
  auto removed = catalog_->Remove(b->id(), {a_handle});
  ASSERT_FALSE(removed.ok());
  EXPECT_EQ(removed.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(catalog_->size(), 1u);
  EXPECT_TRUE(catalog_->Lookup(a->id(), a_handle).ok());
  EXPECT_EQ(catalog_->RemoveSession(b->id()).objects, 0u);
  EXPECT_TRUE(catalog_->Lookup(a->id(), a_handle).ok());
}

TEST_F(CatalogTest, RemoveGivesMemoryAndQuotaBack) {
  std::shared_ptr<Session> s = OpenSession("a");
  const uint64_t h1 = Insert(*s, 1000, 1);
  const uint64_t h2 = Insert(*s, 3000, 2);
  const uint64_t h3 = Insert(*s, 5000, 3);
  const uint64_t used_all = PoolUsed();
  EXPECT_EQ(s->used_bytes(), 9000u);

  auto removed = catalog_->Remove(s->id(), {h3, h1});
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->objects, 2u);
  EXPECT_EQ(removed->bytes, 6000u);
  EXPECT_EQ(s->used_bytes(), 3000u);
  EXPECT_LT(PoolUsed(), used_all);
  EXPECT_EQ(PoolAllocations(), 1u);
  EXPECT_EQ(catalog_->size(), 1u);
  EXPECT_EQ(catalog_->SessionObjectCount(s->id()), 1u);
  EXPECT_EQ(catalog_->Lookup(s->id(), h1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(catalog_->Lookup(s->id(), h3).status().code(), absl::StatusCode::kNotFound);
  auto kept = catalog_->Lookup(s->id(), h2);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(AllBytesAre(**kept, 2));
  kept->reset();

  // Removing it again is NOT_FOUND.
  EXPECT_EQ(catalog_->Remove(s->id(), {h1}).status().code(), absl::StatusCode::kNotFound);

  auto last = catalog_->Remove(s->id(), {h2});
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->objects, 1u);
  EXPECT_EQ(last->bytes, 3000u);
  EXPECT_EQ(PoolUsed(), 0u);
  EXPECT_EQ(s->used_bytes(), 0u);
  EXPECT_EQ(catalog_->size(), 0u);
  EXPECT_EQ(catalog_->SessionObjectCount(s->id()), 0u);
}

TEST_F(CatalogTest, AnObjectWithAPutIdTheSessionHoldsIsDroppedForTheFirst) {
  std::shared_ptr<Session> s = OpenSession("a");
  std::shared_ptr<Session> t = OpenSession("b");
  absl::StatusOr<uint64_t> first = catalog_->Insert(*s, MakeObject(*s, 1000, 1, /*put_id=*/5));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(catalog_->FindPut(s->id(), 5), *first);
  EXPECT_EQ(catalog_->FindPut(t->id(), 5), std::nullopt);
  EXPECT_EQ(catalog_->FindPut(s->id(), 0), std::nullopt);
  // Sent again: the first object's handle; the second's memory and quota
  // go back.
  bool stored_before = false;
  absl::StatusOr<uint64_t> again = catalog_->Insert(*s, MakeObject(*s, 1000, 2, 5), &stored_before);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *first);
  EXPECT_TRUE(stored_before);
  EXPECT_EQ(catalog_->size(), 1u);
  EXPECT_EQ(s->used_bytes(), 1000u);
  EXPECT_EQ(PoolAllocations(), 1u);
  auto kept = catalog_->Lookup(s->id(), *first);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(AllBytesAre(**kept, 1));
  kept->reset();
  // Another session's ids are its own; objects without one never match.
  absl::StatusOr<uint64_t> other = catalog_->Insert(*t, MakeObject(*t, 10, 3, 5));
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*other, *first);
  EXPECT_NE(Insert(*s, 10, 4), Insert(*s, 10, 4));
  // Once its object is gone, an id stores anew.
  ASSERT_TRUE(catalog_->Remove(s->id(), {*first}).ok());
  EXPECT_EQ(catalog_->FindPut(s->id(), 5), std::nullopt);
  absl::StatusOr<uint64_t> anew = catalog_->Insert(*s, MakeObject(*s, 1000, 5, 5), &stored_before);
  ASSERT_TRUE(anew.ok());
  EXPECT_GT(*anew, *first);
  EXPECT_FALSE(stored_before);
  catalog_->RemoveSession(t->id());
  EXPECT_EQ(catalog_->FindPut(t->id(), 5), std::nullopt);
  // A handed state naming one id twice in a session is refused.
  EXPECT_EQ(catalog_->Adopt(*s, 1000, MakeObject(*s, 10, 6, 5)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(catalog_->Adopt(*s, 1001, MakeObject(*s, 10, 6, 6)).ok());
  EXPECT_EQ(catalog_->FindPut(s->id(), 6), 1001u);
}

TEST_F(CatalogTest, RemoveIsAllOrNothing) {
  std::shared_ptr<Session> a = OpenSession("a");
  std::shared_ptr<Session> b = OpenSession("b");
  const uint64_t h1 = Insert(*a, 1000, 1);
  const uint64_t h2 = Insert(*a, 2000, 2);
  const uint64_t foreign = Insert(*b, 3000, 3);
  const uint64_t pool_used = PoolUsed();

  auto expect_nothing_removed = [&](const char* what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(catalog_->size(), 3u);
    EXPECT_EQ(catalog_->SessionObjectCount(a->id()), 2u);
    EXPECT_EQ(catalog_->SessionObjectCount(b->id()), 1u);
    EXPECT_TRUE(catalog_->Lookup(a->id(), h1).ok());
    EXPECT_TRUE(catalog_->Lookup(a->id(), h2).ok());
    EXPECT_TRUE(catalog_->Lookup(b->id(), foreign).ok());
    EXPECT_EQ(PoolUsed(), pool_used);
    EXPECT_EQ(a->used_bytes(), 3000u);
    EXPECT_EQ(b->used_bytes(), 3000u);
  };

  {
    const uint64_t unknown = foreign + 100;
    auto r = catalog_->Remove(a->id(), {h1, unknown, h2});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
    // The message names the first bad handle.
    EXPECT_NE(std::string(r.status().message()).find(absl::StrCat(unknown)), std::string::npos)
        << r.status();
    expect_nothing_removed("unknown handle last but one");
  }
  {
    auto r = catalog_->Remove(a->id(), {h2, h1, 0});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
    expect_nothing_removed("handle 0 last");
  }
  {
    auto r = catalog_->Remove(a->id(), {h1, h2, h1});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(r.status().message()).find(absl::StrCat(h1)), std::string::npos)
        << r.status();
    expect_nothing_removed("repeated handle");
  }
  {
    auto r = catalog_->Remove(a->id(), {h1, foreign});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
    expect_nothing_removed("another session's handle");
  }
  {
    auto r = catalog_->Remove(a->id(), {h2, h2});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    expect_nothing_removed("same handle twice");
  }
}

TEST_F(CatalogTest, RemoveSessionFreesEverythingOfThatSessionOnly) {
  std::shared_ptr<Session> a = OpenSession("a");
  std::shared_ptr<Session> b = OpenSession("b");
  uint64_t a_bytes = 0;
  for (int i = 1; i <= 20; ++i) {
    Insert(*a, 1000 * i, static_cast<uint8_t>(i));
    a_bytes += 1000 * i;
  }
  const uint64_t b_handle = Insert(*b, 7777, 0xbb);
  EXPECT_EQ(a->used_bytes(), a_bytes);

  RemovedTotals totals = catalog_->RemoveSession(a->id());
  EXPECT_EQ(totals.objects, 20u);
  EXPECT_EQ(totals.bytes, a_bytes);
  EXPECT_EQ(a->used_bytes(), 0u);
  EXPECT_EQ(catalog_->SessionObjectCount(a->id()), 0u);
  EXPECT_EQ(catalog_->size(), 1u);
  EXPECT_EQ(PoolAllocations(), 1u);

  // b is untouched.
  auto kept = catalog_->Lookup(b->id(), b_handle);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(AllBytesAre(**kept, 0xbb));
  kept->reset();
  EXPECT_EQ(b->used_bytes(), 7777u);

  // A second RemoveSession finds nothing.
  totals = catalog_->RemoveSession(a->id());
  EXPECT_EQ(totals.objects, 0u);
  EXPECT_EQ(totals.bytes, 0u);

  totals = catalog_->RemoveSession(b->id());
  EXPECT_EQ(totals.objects, 1u);
  EXPECT_EQ(totals.bytes, 7777u);
  EXPECT_EQ(PoolUsed(), 0u);
  EXPECT_EQ(PoolAllocations(), 0u);
  EXPECT_EQ(b->used_bytes(), 0u);
  EXPECT_EQ(catalog_->size(), 0u);
}

TEST_F(CatalogTest, CloseThenRemoveSessionFreesEverything) {
  std::shared_ptr<Session> s = OpenSession("a");
  for (int i = 0; i < 10; ++i) Insert(*s, 100 * 1024, static_cast<uint8_t>(i));
  EXPECT_GT(PoolUsed(), 0u);

  std::shared_ptr<Session> closed = sessions_->Close(s->id());
  ASSERT_EQ(closed, s);
  RemovedTotals totals = catalog_->RemoveSession(s->id());
  EXPECT_EQ(totals.objects, 10u);
  EXPECT_EQ(totals.bytes, 10u * 100 * 1024);
  EXPECT_EQ(PoolUsed(), 0u);
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST_F(CatalogTest, InsertAfterCloseIsFailedPreconditionAndGivesEverythingBack) {
  std::shared_ptr<Session> s = OpenSession("a");
  std::shared_ptr<StoredObject> object = MakeObject(*s, 64 * 1024, 7);
  ASSERT_NE(object, nullptr);
  EXPECT_EQ(s->used_bytes(), 64u * 1024);
  EXPECT_GT(PoolUsed(), 0u);

  ASSERT_NE(sessions_->Close(s->id()), nullptr);
  absl::StatusOr<uint64_t> handle = catalog_->Insert(*s, std::move(object));
  ASSERT_FALSE(handle.ok());
  EXPECT_EQ(handle.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(catalog_->size(), 0u);
  EXPECT_EQ(catalog_->SessionObjectCount(s->id()), 0u);
  // The refused object was dropped: memory and quota are back.
  EXPECT_EQ(PoolUsed(), 0u);
  EXPECT_EQ(PoolAllocations(), 0u);
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST_F(CatalogTest, LookupReferenceKeepsMemoryAliveAfterRemove) {
  std::shared_ptr<Session> s = OpenSession("a");
  const uint64_t handle = Insert(*s, 200 * 1024, 0x3c);
  const uint64_t used = PoolUsed();

  auto ref = catalog_->Lookup(s->id(), handle);
  ASSERT_TRUE(ref.ok());
  std::shared_ptr<const StoredObject> object = *std::move(ref);

  auto removed = catalog_->Remove(s->id(), {handle});
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->objects, 1u);
  EXPECT_EQ(catalog_->size(), 0u);
  EXPECT_EQ(catalog_->Lookup(s->id(), handle).status().code(), absl::StatusCode::kNotFound);

  // Still held by `object`: memory in use, quota held, bytes intact.
  EXPECT_EQ(PoolUsed(), used);
  EXPECT_EQ(s->used_bytes(), 200u * 1024);
  EXPECT_TRUE(AllBytesAre(*object, 0x3c));

  // Another object cannot be placed over it.
  const uint64_t other = Insert(*s, 200 * 1024, 0x11);
  EXPECT_TRUE(AllBytesAre(*object, 0x3c));
  ASSERT_TRUE(catalog_->Remove(s->id(), {other}).ok());

  object.reset();
  EXPECT_EQ(PoolUsed(), 0u);
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST_F(CatalogTest, LookupReferenceKeepsMemoryAliveAfterRemoveSession) {
  std::shared_ptr<Session> s = OpenSession("a");
  const uint64_t handle = Insert(*s, 4096, 0x77);
  std::shared_ptr<const StoredObject> object = catalog_->Lookup(s->id(), handle).value();
  ASSERT_NE(sessions_->Close(s->id()), nullptr);
  EXPECT_EQ(catalog_->RemoveSession(s->id()).objects, 1u);
  EXPECT_GT(PoolUsed(), 0u);
  EXPECT_EQ(s->used_bytes(), 4096u);
  EXPECT_TRUE(AllBytesAre(*object, 0x77));
  object.reset();
  EXPECT_EQ(PoolUsed(), 0u);
  EXPECT_EQ(s->used_bytes(), 0u);
}

TEST_F(CatalogTest, ConcurrentInsertLookupRemoveAcrossSessions) {
  constexpr int kThreads = 4;
  constexpr int kObjects = 200;
  std::vector<std::shared_ptr<Session>> sessions;
  for (int t = 0; t < kThreads; ++t) sessions.push_back(OpenSession(absl::StrCat("s", t)));

  std::vector<std::vector<uint64_t>> handles(kThreads);
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Session& session = *sessions[t];
      const auto fill = static_cast<uint8_t>(0x10 + t);
      for (int i = 0; i < kObjects; ++i) {
        std::shared_ptr<StoredObject> object = MakeObject(session, 1024 + i, fill);
        if (object == nullptr) {
          failed = true;
          return;
        }
        absl::StatusOr<uint64_t> handle = catalog_->Insert(session, std::move(object));
        if (!handle.ok() || *handle == 0) {
          failed = true;
          return;
        }
        handles[t].push_back(*handle);
        auto found = catalog_->Lookup(session.id(), *handle);
        if (!found.ok() || !AllBytesAre(**found, fill)) failed = true;
        if (i % 2 == 1) {  // remove every other pair
          auto removed = catalog_->Remove(session.id(), {handles[t][i - 1], handles[t][i]});
          if (!removed.ok() || removed->objects != 2) failed = true;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_FALSE(failed.load());

  std::set<uint64_t> all;
  for (const auto& list : handles) all.insert(list.begin(), list.end());
  EXPECT_EQ(all.size(), static_cast<size_t>(kThreads * kObjects));
  EXPECT_EQ(catalog_->size(), 0u);
  EXPECT_EQ(PoolUsed(), 0u);
  for (const auto& s : sessions) EXPECT_EQ(s->used_bytes(), 0u);
}

}  // namespace
}  // namespace actstash::server
