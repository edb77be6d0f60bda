// The states of a saved tensor (client/engine/saved_tensor_state.h): exactly the
// documented edges are legal, and what each state implies (source held,
// store running, counted live, released) agrees with the edges.
#include "client/engine/saved_tensor_state.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <utility>

namespace actstash::client_internal {
namespace {

using S = SavedState;
using E = SavedEvent;

constexpr S kStates[] = {S::kStoring,         S::kStored,         S::kFailed,
                         S::kReleasedStoring, S::kReleasedStored, S::kReleasedFailed};
constexpr E kEvents[] = {E::kStoreDone, E::kStoreFailed, E::kRelease};

TEST(SavedTensorStateTest, OnlyTheDocumentedEdgesAreLegal) {
  const std::map<std::pair<S, E>, S> edges = {
      {{S::kStoring, E::kStoreDone}, S::kStored},
      {{S::kStoring, E::kStoreFailed}, S::kFailed},
      {{S::kStoring, E::kRelease}, S::kReleasedStoring},
      {{S::kStored, E::kRelease}, S::kReleasedStored},
      {{S::kFailed, E::kRelease}, S::kReleasedFailed},
      {{S::kReleasedStoring, E::kStoreDone}, S::kReleasedStored},
      {{S::kReleasedStoring, E::kStoreFailed}, S::kReleasedFailed},
  };
  int legal = 0;
  for (S s : kStates) {
    for (E e : kEvents) {
      const std::optional<S> next = NextState(s, e);
      auto it = edges.find({s, e});
      if (it == edges.end()) {
        EXPECT_FALSE(next.has_value())
            << SavedStateName(s) << " on " << SavedEventName(e) << " must be illegal";
      } else {
        ASSERT_TRUE(next.has_value()) << SavedStateName(s) << " on " << SavedEventName(e);
        EXPECT_EQ(*next, it->second) << SavedStateName(s) << " on " << SavedEventName(e);
        ++legal;
      }
    }
  }
  EXPECT_EQ(legal, 7);
}

TEST(SavedTensorStateTest, PredicatesAgreeWithTheEdges) {
  for (S s : kStates) {
    // A store runs exactly where "store done" and "store failed" are legal.
    EXPECT_EQ(StoreRunning(s), NextState(s, E::kStoreDone).has_value()) << SavedStateName(s);
    EXPECT_EQ(StoreRunning(s), NextState(s, E::kStoreFailed).has_value()) << SavedStateName(s);
    // Released exactly where release is no longer legal.
    EXPECT_EQ(IsReleased(s), !NextState(s, E::kRelease).has_value()) << SavedStateName(s);
    // Live: still needed and not failed; the source is held while a store
    // runs or after it failed, until released.
    EXPECT_EQ(IsLive(s), !IsReleased(s) && !IsFailed(s)) << SavedStateName(s);
    EXPECT_EQ(HoldsSource(s), StoreRunning(s) || (IsFailed(s) && !IsReleased(s)))
        << SavedStateName(s);
    // Release keeps whether the store runs or failed.
    if (std::optional<S> released = NextState(s, E::kRelease)) {
      EXPECT_EQ(StoreRunning(*released), StoreRunning(s)) << SavedStateName(s);
      EXPECT_EQ(IsFailed(*released), IsFailed(s)) << SavedStateName(s);
    }
  }
}

TEST(SavedTensorStateTest, NamesAreDistinct) {
  std::set<std::string> names;
  for (S s : kStates) names.insert(SavedStateName(s));
  for (E e : kEvents) names.insert(SavedEventName(e));
  EXPECT_EQ(names.size(), std::size(kStates) + std::size(kEvents));
  EXPECT_EQ(names.count("?"), 0u);
}

}  // namespace
}  // namespace actstash::client_internal
