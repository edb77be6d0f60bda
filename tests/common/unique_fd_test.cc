#include "common/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "gtest/gtest.h"

namespace actstash {
namespace {

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

// A fresh fd (one end of a pipe; the other end is closed at once).
int OpenFd() {
  int ends[2];
  EXPECT_EQ(pipe2(ends, O_CLOEXEC), 0);
  ::close(ends[1]);
  return ends[0];
}

TEST(UniqueFdTest, ClosesWhenDestroyed) {
  const int raw = OpenFd();
  {
    UniqueFd fd(raw);
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(fd.get(), raw);
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, NegativeHoldsNothing) {
  UniqueFd fd(-5);
  EXPECT_FALSE(fd.valid());
  EXPECT_EQ(fd.get(), -1);
  EXPECT_FALSE(UniqueFd().valid());
}

TEST(UniqueFdTest, MoveTransfersOwnership) {
  const int raw = OpenFd();
  UniqueFd a(raw);
  UniqueFd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(b.get(), raw);
  {
    UniqueFd c;
    c = std::move(b);
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, MoveAssignmentClosesTheFdItHeld) {
  const int first = OpenFd();
  const int second = OpenFd();
  UniqueFd a(first);
  a = UniqueFd(second);
  EXPECT_FALSE(IsOpen(first));
  EXPECT_TRUE(IsOpen(second));
  EXPECT_EQ(a.get(), second);
}

TEST(UniqueFdTest, ReleaseGivesTheFdBackOpen) {
  const int raw = OpenFd();
  int released = -1;
  {
    UniqueFd fd(raw);
    released = fd.Release();
    EXPECT_FALSE(fd.valid());
  }
  EXPECT_EQ(released, raw);
  EXPECT_TRUE(IsOpen(raw));
  ::close(raw);
}

TEST(UniqueFdTest, ResetClosesAndTakesTheNewFd) {
  const int first = OpenFd();
  const int second = OpenFd();
  UniqueFd fd(first);
  fd.Reset(second);
  EXPECT_FALSE(IsOpen(first));
  EXPECT_EQ(fd.get(), second);
  fd.Reset();
  EXPECT_FALSE(IsOpen(second));
  EXPECT_FALSE(fd.valid());
}

}  // namespace
}  // namespace actstash
