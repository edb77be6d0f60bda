// The residence table (common/residence.h), which LocalStore blocks and the
// daemon's inline objects follow: exactly the documented edges are legal, and
// what each state implies (I/O in flight, bytes on the daemon's disk) agrees
// with the edges.
#include "common/residence.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <utility>

namespace actstash {
namespace {

using S = Residence;
using E = ResidenceEvent;

constexpr S kStates[] = {S::kResident, S::kSpilling, S::kSpilled, S::kRestoring, S::kLost};
constexpr E kEvents[] = {E::kSpill,       E::kSpillDone,     E::kSpillFailed, E::kRestore,
                         E::kRestoreDone, E::kRestoreFailed, E::kSpillGone};

TEST(ResidenceTest, OnlyTheDocumentedEdgesAreLegal) {
  const std::map<std::pair<S, E>, S> edges = {
      {{S::kResident, E::kSpill}, S::kSpilling},
      {{S::kSpilling, E::kSpillDone}, S::kSpilled},
      {{S::kSpilling, E::kSpillFailed}, S::kResident},
      {{S::kSpilled, E::kRestore}, S::kRestoring},
      {{S::kRestoring, E::kRestoreDone}, S::kResident},
      {{S::kRestoring, E::kRestoreFailed}, S::kSpilled},
      {{S::kRestoring, E::kSpillGone}, S::kLost},
  };
  int legal = 0;
  for (S s : kStates) {
    for (E e : kEvents) {
      const std::optional<S> next = NextResidence(s, e);
      auto it = edges.find({s, e});
      if (it == edges.end()) {
        EXPECT_FALSE(next.has_value())
            << ResidenceName(s) << " on " << ResidenceEventName(e) << " must be illegal";
      } else {
        ASSERT_TRUE(next.has_value()) << ResidenceName(s) << " on " << ResidenceEventName(e);
        EXPECT_EQ(*next, it->second) << ResidenceName(s) << " on " << ResidenceEventName(e);
        ++legal;
      }
    }
  }
  EXPECT_EQ(legal, 7);
}

TEST(ResidenceTest, PredicatesAgreeWithTheEdges) {
  for (S s : kStates) {
    // An RPC is in flight exactly where its outcome is the next event.
    const bool outcome_pending =
        NextResidence(s, E::kSpillDone).has_value() || NextResidence(s, E::kRestoreDone);
    EXPECT_EQ(InFlight(s), outcome_pending) << ResidenceName(s);
    // On disk: spilled, or being read back (a failed read-back leaves it there).
    EXPECT_EQ(OnDisk(s), s == S::kSpilled || NextResidence(s, E::kRestoreFailed).has_value())
        << ResidenceName(s);
  }
  // Lost is final; every other state is left by some event.
  for (E e : kEvents) EXPECT_FALSE(NextResidence(S::kLost, e).has_value()) << ResidenceEventName(e);
}

TEST(ResidenceTest, EveryStateIsReachedFromResident) {
  std::set<S> reached = {S::kResident};
  for (bool grew = true; grew;) {
    grew = false;
    for (S s : std::set<S>(reached)) {
      for (E e : kEvents) {
        if (std::optional<S> next = NextResidence(s, e)) grew |= reached.insert(*next).second;
      }
    }
  }
  EXPECT_EQ(reached.size(), std::size(kStates));
}

TEST(ResidenceTest, NamesAreDistinct) {
  std::set<std::string> names;
  for (S s : kStates) names.insert(ResidenceName(s));
  for (E e : kEvents) names.insert(ResidenceEventName(e));
  EXPECT_EQ(names.size(), std::size(kStates) + std::size(kEvents));
  EXPECT_EQ(names.count("?"), 0u);
}

}  // namespace
}  // namespace actstash
